"""The one table of jobrun's own exit statuses and the errors that carry them."""

from __future__ import annotations

import enum


class Exit(enum.IntEnum):
    """Exit statuses jobrun itself chooses; otherwise it passes on the child's status."""

    OK = 0
    #: ``status --check``: a key is overdue, failing or stuck, or the history is unreadable;
    #: ``stop``: nothing held KEY; a KEY never recorded (``records.NeverRecorded``).
    ATTENTION = 1
    #: ``stop``: the run did not end within ``--wait`` (with ``--force``: its lock was taken).
    NOT_ENDED = 3
    USAGE = 64
    DATA_ERROR = 65  # jobrun deadlocks: a file that is not a PostgreSQL log (EX_DATAERR)
    NO_INPUT = 66  # jobrun deadlocks: a log file missing or unreadable (EX_NOINPUT)
    UNAVAILABLE = 69
    INTERNAL = 70
    IO_ERROR = 74
    SKIPPED = 75
    LOCK_LOST = 76
    #: The run was stopped on request (``jobrun stop``).
    STOPPED = 77
    TIMED_OUT = 124
    NOT_EXECUTABLE = 126
    NOT_FOUND = 127
    #: 128 + SIGPIPE: the reader of a subcommand's output went away (``| head -1``).
    BROKEN_PIPE = 141


#: Status -> meaning, in the order the README's table lists them (a test checks the README).
TABLE: tuple[tuple[str, str], ...] = (
    ("child's own", "the child ran and exited with this status"),
    ("128+N", "the child was killed by signal N (143 = SIGTERM, 137 = SIGKILL)"),
    (
        str(Exit.SKIPPED.value),
        "skipped: the lock is held elsewhere (`--skip-exit-code` changes it, 0 included)",
    ),
    (
        str(Exit.UNAVAILABLE.value),
        (
            "lock store unavailable or unfit: the child was not started; `reason` says "
            "`unreachable` (nobody answered in `--connect-timeout`), `refused` (auth, role, "
            "database, still full after retrying), `tls` (certificate, host name or no TLS "
            "where sslmode asks for it, `require` over a network unless set; never run "
            "unguarded), `not_granted` (after `jobrun "
            "init`, the role was not granted the key; never run unguarded), `standby`, "
            "`transaction_pooler`, `history_unavailable` (`--once-per`, `--requires`), "
            "`schema_too_new` (a newer jobrun upgraded the schema past what this one may "
            "write; never run unguarded); after `jobrun init`, `not_granted` also for a "
            "`--requires` key the role may not read"
        ),
    ),
    (
        str(Exit.USAGE.value),
        (
            "usage error: bad flag, key, duration, missing command, or a connection string "
            "libpq rejects (`port=abc`; a raw `@` in a URI password: write `%40`)"
        ),
    ),
    (
        str(Exit.LOCK_LOST.value),
        "the lock was lost mid-run and the child was stopped (`--on-lock-lost terminate`)",
    ),
    (
        str(Exit.STOPPED.value),
        "the run was stopped on request (`jobrun stop KEY`): SIGTERM, SIGKILL after `--kill-after`",
    ),
    (str(Exit.TIMED_OUT.value), "`--timeout` ran out; the child was stopped"),
    (str(Exit.NOT_EXECUTABLE.value), "the command is not executable"),
    (str(Exit.NOT_FOUND.value), "the command was not found"),
    (str(Exit.INTERNAL.value), "internal error in jobrun (a bug: please report it)"),
    (
        str(Exit.ATTENTION.value),
        (
            "`jobrun status --check`: a key is overdue, failing or stuck, or the history cannot be "
            "read; `jobrun stop`: nothing held the key; `status --check KEY`, `stop`, `pause`, "
            "`resume`, `forget`: no run of KEY was ever recorded (a typo?); `forget`: a run "
            "holds the key; `show`: no such run, or it kept no output"
        ),
    ),
    (str(Exit.NOT_ENDED.value), "`jobrun stop`: the run did not end within `--wait`"),
    (str(Exit.DATA_ERROR.value), "`jobrun deadlocks`: a file that is not a PostgreSQL server log"),
    (str(Exit.NO_INPUT.value), "`jobrun deadlocks`: a log file is missing or unreadable"),
    (
        str(Exit.IO_ERROR.value),
        (
            "a subcommand could not write its output (stdout full, closed or failing); one "
            "line on stderr"
        ),
    ),
    (
        str(Exit.BROKEN_PIPE.value),
        (
            "the reader of a subcommand's output went away (`jobrun status` piped into `head -1`): "
            "jobrun stops quietly, as Unix tools do (128 + SIGPIPE)"
        ),
    ),
)


def from_wait_status(returncode: int) -> int:
    """Map a ``Popen.returncode`` (negative for a signal) to a shell-style exit status."""
    return signal_status(-returncode) if returncode < 0 else returncode


def signal_status(signum: int) -> int:
    """The shell's exit status for "ended by signal ``signum``": 128 + N."""
    return 128 + signum


class JobrunError(Exception):
    """An error jobrun reports as one line and turns into ``exit_code``."""

    exit_code: int = Exit.INTERNAL
    event: str = "error"


class UsageError(JobrunError):
    """Bad input: flags, keys, durations, invariants between options."""

    exit_code = Exit.USAGE
    event = "usage_error"


#: The server could not prove who it is, or would not encrypt when asked to (a certificate,
#: a host name, TLS itself): no outage, so never a reason to run a child unguarded.
TLS = "tls"
#: After ``jobrun init``, the role was not granted the key: the database said no, which is
#: no outage either.
NOT_GRANTED = "not_granted"
#: A newer jobrun upgraded the schema past what this one may write: no outage either (the
#: database answered), and writing anyway could record rows the newer schema means
#: otherwise.
SCHEMA_TOO_NEW = "schema_too_new"


class LockStoreUnavailable(JobrunError):
    """The database cannot be reached, refuses us, or cannot hold our lock safely."""

    exit_code = Exit.UNAVAILABLE
    event = "lockstore_unavailable"

    def __init__(self, message: str, *, reason: str = "unreachable") -> None:
        super().__init__(message)
        self.reason = reason

    @property
    def fails_closed(self) -> bool:
        """Whether the child must not run even with ``--on-db-error run``.

        WARNING: whoever can stand between us and the server (a spoofed address, a proxy
        with the wrong certificate) could otherwise have every job run unguarded at will.
        """
        return self.reason in {TLS, NOT_GRANTED, SCHEMA_TOO_NEW}


def not_granted(role: str, label: str) -> LockStoreUnavailable:
    """The refusal of a run of ``label`` by ``role``, which ``jobrun init``'s grants forbid."""
    return LockStoreUnavailable(
        f"role {role!r} is not granted key {label!r} on this database (jobrun init guards "
        f"it): the database owner can run jobrun grant {role} --keys {label}",
        reason=NOT_GRANTED,
    )


class LockLost(JobrunError):
    """The lock we held is gone (or can no longer be proven to be ours)."""

    exit_code = Exit.LOCK_LOST
    event = "lock_lost"


class OutputError(JobrunError):
    """Standard output cannot be written: full, closed or failing (not a bug: exit 74)."""

    exit_code = Exit.IO_ERROR
    event = "output_error"


class PipeClosed(JobrunError):
    """The reader of standard output went away: end quietly, as ``head`` expects."""

    exit_code = Exit.BROKEN_PIPE
    event = "pipe_closed"


class Interrupted(JobrunError):
    """A stop signal arrived: jobrun stopped what it started and exits 128 + N."""

    event = "interrupted"

    def __init__(self, signum: int, detail: str = "") -> None:
        # Imported here: its enums cost `jobrun key` and `--help` for nothing. Whoever
        # catches a signal has imported it already (no import inside a handler).
        import signal  # noqa: PLC0415

        name = signal.Signals(signum).name
        super().__init__(f"interrupted by {name}{': ' + detail if detail else ''}")
        self.signum = signum
        self.exit_code = signal_status(signum)


def interruption(exc: BaseException) -> Interrupted | None:
    """The Interrupted that ``exc`` is, or that Python wrapped in it, else None.

    WARNING: Python 3.10 and 3.11 turn whatever a ``__set_name__`` raises into RuntimeError
    ("Error calling __set_name__ ..."): a stop signal whose handler raises while an import
    creates a dataclass with field defaults arrives wrapped, as the cause.
    """
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(cause, Interrupted):
            return cause
        cause = cause.__cause__
    return None
