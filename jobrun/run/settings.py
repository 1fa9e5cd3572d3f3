"""A run's settings: each run option declared once, and the settings built from them, checked."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from jobrun import flags
from jobrun.exitcodes import Exit, UsageError
from jobrun.flags import Duration, Option

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    # What the type checker sees: Settings is a dataclass (at run time, once imported).
    from dataclasses import dataclass as _dataclass_when_imported

    from jobrun import keys
else:

    def _dataclass_when_imported(**_: Any) -> Callable[[type], type]:
        """The class as written: ``__getattr__`` makes it a dataclass when first imported."""
        return lambda cls: cls


#: Field metadata: the option a field of Settings is read from.
OPTION = "jobrun.option"
#: Seconds between two checks of a session lock when --heartbeat is not given.
SESSION_HEARTBEAT = 1.0


class _Declared:
    """A field of Settings as written: the option it is read from (a dataclass field later)."""

    __slots__ = ("declaration", "secret")

    def __init__(self, declaration: Option, *, secret: bool) -> None:
        self.declaration = declaration
        self.secret = secret


def declared(declaration: Option, *, secret: bool = False) -> Any:
    """A field of Settings read from ``declaration`` (its default is the option's).

    ``secret``: a value that may carry a password or token, never shown in the repr.
    """
    return _Declared(declaration, secret=secret)


def option(
    flag: str, kind: click.ParamType[Any] | None = None, *, secret: bool = False, **spec: Any
) -> Any:
    """A field of Settings read from a run option declared here: see Option."""
    return declared(Option(flag, kind, **spec), secret=secret)


#: The run's keys (Settings.run_keys): they name one thing, so a flag wins over both
#: variables (jobrun.cli.run).
KEY_NAMES = Option(
    "--key",
    flags.Lines(),
    name="key_names",
    multiple=True,
    metavar="NAME",
    help="Lock name (repeatable: all or nothing, in ascending lock-id order).",
)
LOCK_IDS = Option(
    "--lock-id",
    flags.Commas(),
    name="lock_ids",
    multiple=True,
    metavar="INT",
    help="Raw signed 64-bit lock id, for interop with code that locks numbers (repeatable).",
)


@_dataclass_when_imported(frozen=True)
class Settings:
    """A run's options, checked against each other (durations in seconds).

    The three fields first are worked out from the options; every other field is an option,
    declared here once (flag, kind of value, default, help), and the run command's options
    are made from these declarations. Adding an option: CONTRIBUTING.md.
    """

    #: --key and --lock-id, resolved (a flag wins over both variables).
    run_keys: tuple[keys.Key, ...]
    #: Whether --dsn was written on the command line (visible in ps).
    dsn_on_command_line: bool
    #: lease: how long a renewal vouches for the lease (session: unused).
    lifetime: float

    dsn: str = declared(flags.dsn, secret=True)
    connect_timeout: float = declared(flags.connect_timeout)
    mode: str = declared(
        flags.mode(
            "session: advisory lock on a held connection; lease: TTL row, works through poolers."
        )
    )
    wait: float = option(
        "--wait", Duration(), default="0", help="Wait this long for the lock before skipping."
    )
    wait_report: float = option(
        "--wait-report",
        Duration(minimum="1s", why="each report looks the holder up"),
        default="1m",
        help="While --wait lasts, say who holds the lock this often (still_waiting events).",
    )
    #: None: never (0 given).
    timeout: float | None = declared(flags.timeout)
    kill_after: float = declared(flags.kill_after)
    #: Worked out when not given: 1 s (session), from --ttl and --kill-after (lease).
    heartbeat: float = declared(flags.heartbeat)
    ttl: float = declared(flags.ttl)
    lease_connection: str = option(
        "--lease-connection",
        click.Choice(["kept", "per-renewal"]),
        default="kept",
        help="Lease mode: one connection kept for the run, a heartbeat a second over it "
        "(kept), or one connection per renewal, none held between them (per-renewal).",
    )
    skip_exit_code: int = option(
        "--skip-exit-code",
        click.IntRange(0, 255),
        default=int(Exit.SKIPPED),
        help="Exit status when the lock is held elsewhere.",
    )
    on_db_error: str = option(
        "--on-db-error",
        click.Choice(["fail", "run"]),
        default="fail",
        help="Database unreachable: fail (exit 69) or run the child unguarded.",
    )
    on_lock_lost: str = option(
        "--on-lock-lost",
        click.Choice(["terminate", "ignore"]),
        default="terminate",
        help="Lock lost mid-run: stop the child (exit 76) or log and let it finish.",
    )
    #: None: none (0 given).
    min_hold: float | None = option(
        "--min-hold",
        Duration(),
        help="Keep the lock at least this long after the start (hosts with skewed clocks skip).",
    )
    once_per: float | None = option(
        "--once-per",
        Duration(minimum="1s", why="it names a window, e.g. 1h or 1d"),
        help="Skip (already_ran) if the key already ran in this UTC-aligned window, e.g. 1d.",
    )
    no_history: bool = option(
        "--no-history",
        is_flag=True,
        help="Do not record runs in jobrun.runs (no streak alerts, no --once-per).",
    )
    keep: int = option(
        "--keep",
        click.IntRange(min=1),
        default=100,
        help="History kept per key: the newest N runs and N skips (and each host's newest skip).",
    )
    alert_after: int = option(
        "--alert-after",
        click.IntRange(min=0),
        default=3,
        help="Error line (and --on-alert) after N skips or failures in a row; 0 disables.",
    )
    alert_repeat: float = option(
        "--alert-repeat",
        Duration(minimum="1s", why="a streak alerts again at most this often"),
        default="1h",
        help="While a streak lasts, alert again at most this often (then once: recovered).",
    )
    on_alert: str | None = option(
        "--on-alert",
        metavar="CMD",
        help="Command run on a streak alert (event JSON on stdin and in JOBRUN_ALERT_*).",
    )
    metrics_file: str | None = option(
        "--metrics-file",
        metavar="PATH",
        help="Prometheus textfile written after each run or skip ({key} is replaced).",
    )
    expect_every: float | None = option(
        "--expect-every",
        Duration(minimum="1s", why="it is how often the job should succeed"),
        help="The key should succeed this often: status --check says overdue past it plus grace.",
    )
    #: 10% of --expect-every when not given; None without --expect-every.
    expect_grace: float | None = option(
        "--expect-grace",
        Duration(),
        help="Slack past --expect-every before a key is overdue (default: 10% of it).",
    )
    slots: int = option(
        "--slots",
        click.IntRange(1, 256),
        default=1,
        metavar="N",
        help="At most N runs of the key at once (the child gets JOBRUN_SLOT, 0-based).",
    )
    # --warn-after, --tz, --requires, --requires-within (docs/history.md): watching a run.
    #: Seconds, "auto" (from the key's recorded successes), or None (never).
    warn_after: float | str | None = option(
        "--warn-after",
        flags.WarnAfter(minimum="1s", why="a run is slow past it"),
        metavar="DURATION|auto",
        help="One slow_run warning (log, --on-alert, --ping /log) when the child runs past "
        "this, e.g. 30m; auto: 1.5 x the p95 of the key's last 30 successes. Never stops it.",
    )
    #: None: UTC (as before --tz existed).
    tz: str | None = declared(
        flags.tz.but(
            help="IANA time zone of --once-per's day windows (1d: local midnight to local "
            "midnight, 23 or 25 hours across DST); default UTC."
        )
    )
    requires: tuple[str, ...] = option(
        "--requires",
        flags.Lines(),
        multiple=True,
        metavar="KEY",
        help="Run only if KEY's last finished run succeeded within --requires-within and "
        "none of it runs now; else skip (reason requirement). Repeatable.",
    )
    requires_within: float = option(
        "--requires-within",
        Duration(minimum="1s", why="it is how recent a required key's success must be"),
        default="1d",
        help="How recent a --requires key's success must be.",
    )
    # --- Queueing, jitter and retries (--coalesce, --jitter, --retries): jobrun.run.retry,
    # jobrun.locks.queue. Each is off by default: a plain run imports nothing of them.
    coalesce: bool = option(
        "--coalesce",
        is_flag=True,
        help="Key held: the first arrival waits as the one queued run (up to --wait, else "
        "until the holder ends); later arrivals skip (reason queued).",
    )
    jitter: float = option(
        "--jitter",
        Duration(),
        default="0",
        help="Wait a delay in [0, DURATION) before trying the lock, the same for a host and "
        "key every time (hash of the machine id or host name and the key).",
    )
    jitter_random: bool = option(
        "--jitter-random",
        is_flag=True,
        help="With --jitter: draw a fresh delay each run instead of the host's fixed one.",
    )
    retries: int = option(
        "--retries",
        click.IntRange(0, 100),
        default=0,
        metavar="N",
        help="Run a failed child again up to N times, under the same lock, in the same run.",
    )
    retry_delay: float = option(
        "--retry-delay",
        Duration(),
        default="1s",
        help="Pause before the first retry, doubled for each next one (at most 10 times it).",
    )
    #: Exit codes that are retried (empty: any non-zero exit).
    retry_on: tuple[int, ...] = option(
        "--retry-on",
        metavar="CODES",
        help="Retry only these exit codes (comma list, e.g. 1,75); default: any non-zero exit.",
    )
    ping: str | None = option(
        "--ping",
        secret=True,
        metavar="URL",
        help="Healthchecks-style monitor: URL/start, URL/<exit status>, URL/log on a skip; "
        "or a check's UUID or slug alone, after --ping-base.",
    )
    ping_base: str | None = option(
        "--ping-base",
        secret=True,
        metavar="URL",
        help="Where a bare --ping UUID or slug goes: https://hc-ping.com (UUID), "
        "https://hc-ping.com/PING_KEY (slug). Holds a credential: never logged.",
    )
    ping_body: str = option(
        "--ping-body",
        click.Choice(["always", "failure", "never"]),
        default="always",
        help="Which end pings carry the --keep-output tails: always, failure (exit status "
        "not 0) or never.",
    )
    ping_timeout: float = option(
        "--ping-timeout",
        Duration(minimum="100ms", why="a ping needs time to reach the monitor"),
        default="5s",
        help="Longest one ping may take, retries included (never changes the exit status).",
    )
    keep_output: str | None = option(
        "--keep-output",
        metavar="SIZE",
        help="Keep the last SIZE bytes (e.g. 16KiB) of stdout and stderr of failed runs.",
    )
    #: Also set by JOBRUN_FENCING, the variable's old name (jobrun.cli.run).
    fence: bool = option(
        "--fence",
        is_flag=True,
        help="Give the child a fencing token in JOBRUN_FENCE_TOKEN (greater than any earlier one).",
    )
    pass_env: tuple[str, ...] = option(
        "--pass-env",
        flags.PassedName(),
        multiple=True,
        metavar="NAME",
        help="Give the child and the hook this variable of jobrun's own that can hold a secret "
        "(JOBRUN_DSN, JOBRUN_PING, JOBRUN_ON_ALERT): withheld otherwise (repeatable).",
    )
    mask_env: tuple[str, ...] = option(
        "--mask-env",
        flags.VariableName(),
        multiple=True,
        metavar="NAME",
        help="Mask this variable's value (as ***) in kept output, pings and the alert hook's "
        "event, like the DSN's password (repeatable).",
    )
    log_format: str = declared(flags.log_format)
    log_file: str | None = declared(flags.log_file)
    log_level: str = declared(flags.log_level)

    @classmethod
    def declarations(cls) -> tuple[Option, ...]:
        """The options a field is read from, in the order of the fields (and of --help)."""
        return declarations()

    @classmethod
    def from_params(
        cls, params: Mapping[str, Any], *, run_keys: tuple[keys.Key, ...], dsn_on_command_line: bool
    ) -> Settings:
        """The settings of click's parsed ``params``, checked; usage errors exit 64."""
        given = {
            declaration.param_name: params[declaration.param_name]
            for declaration in cls.declarations()
        }
        heartbeat, lifetime = given["heartbeat"] or SESSION_HEARTBEAT, 0.0
        if given["mode"] == "lease":
            from jobrun.locks.lease import LeaseTiming  # noqa: PLC0415 - lease mode only

            # The lease's timing is checked where it is kept: LeaseTiming.
            lease = LeaseTiming.from_options(
                ttl=given["ttl"], kill_after=given["kill_after"], heartbeat=given["heartbeat"]
            )
            heartbeat, lifetime = lease.heartbeat, lease.lifetime
        check(given, run_keys)
        if given["ping"] is not None:
            from jobrun.run import ping  # noqa: PLC0415 - only with --ping

            # A check's UUID or slug alone becomes its URL here: the URL's secrets are
            # masked wherever a --ping URL is (kept output, the hook's event).
            given["ping"] = ping.resolve(given["ping"], given["ping_base"])
        every, grace = given["expect_every"], given["expect_grace"]
        given["retry_on"] = _retry_codes(given["retry_on"])
        return cls(
            **{
                **given,
                "timeout": given["timeout"] or None,
                "heartbeat": heartbeat,
                "min_hold": given["min_hold"] or None,
                "expect_grace": None if every is None else every / 10 if grace is None else grace,
                "requires": _required(given["requires"]),
            },
            run_keys=run_keys,
            dsn_on_command_line=dsn_on_command_line,
            lifetime=lifetime,
        )


#: Settings as written, before it is made a dataclass (``__getattr__``).
_AS_WRITTEN: type = Settings
#: Each field's option, in the order of the fields, read from the class as written.
_DECLARATIONS = tuple(
    value.declaration for value in vars(Settings).values() if isinstance(value, _Declared)
)
if not TYPE_CHECKING:
    # WARNING: made a dataclass only when imported (``from jobrun.run.settings import
    # Settings``): importing dataclasses and generating the methods of a dataclass of some
    # forty fields (compiling their source) was a third of what ``jobrun --help`` cost
    # beyond click, and --help needs only the declarations. Nothing in this module may
    # name Settings at run time but its classmethods (through ``cls``).
    del Settings


def __getattr__(name: str) -> Any:
    """``Settings``, made a dataclass the first time it is asked for."""
    if name != "Settings":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import dataclasses  # noqa: PLC0415 - see above

    for field, value in list(vars(_AS_WRITTEN).items()):
        if isinstance(value, _Declared):
            made_field = dataclasses.field(
                metadata={OPTION: value.declaration}, repr=not value.secret
            )
            setattr(_AS_WRITTEN, field, made_field)
    made: type = dataclasses.dataclass(frozen=True)(_AS_WRITTEN)
    globals()[name] = made
    return made


def declarations() -> tuple[Option, ...]:
    """The options a field of Settings is read from, in the order of the fields (and of --help).

    Without making Settings a dataclass (``jobrun --help`` needs only these).
    """
    return _DECLARATIONS


def check(given: Mapping[str, Any], run_keys: tuple[keys.Key, ...]) -> None:
    """The run options' rules about each other (an option alone is checked by its kind)."""
    no_history = given["no_history"]
    if given["once_per"] is not None and no_history:
        raise UsageError("--once-per needs the run history: drop --no-history")
    if given["expect_every"] is not None and no_history:
        raise UsageError("--expect-every is kept in the run history: drop --no-history")
    if given["slots"] > 1 and (len(run_keys) != 1 or run_keys[0].name is None):
        raise UsageError("--slots takes one key name (--key NAME)")
    _check_watching(given)
    if given["expect_grace"] is not None and given["expect_every"] is None:
        raise UsageError("--expect-grace goes with --expect-every")
    if given["fence"] and given["on_db_error"] == "run":
        raise UsageError(
            "--fence with --on-db-error run: a run without the database has no fencing "
            "token; drop one of them"
        )
    _check_queue_jitter_retries(given, run_keys)
    if no_history and given["ping"] is None and _keeps_output(given["keep_output"]):
        raise UsageError(
            "--keep-output keeps the tails in the run history and sends them with --ping: "
            "drop --no-history or add --ping"
        )


def _check_watching(given: Mapping[str, Any]) -> None:
    """--warn-after auto and --requires read the run history; --requires names keys."""
    no_history = given["no_history"]
    if given["warn_after"] == "auto" and no_history:
        raise UsageError(
            "--warn-after auto derives its bound from the run history: drop --no-history "
            "or give a duration"
        )
    if given["requires"] and no_history:
        raise UsageError("--requires reads the run history: drop --no-history")


def _required(labels: tuple[str, ...]) -> tuple[str, ...]:
    """--requires' key labels as the history records them (``b,a`` is the run ``a,b``)."""
    if not labels:
        return labels
    from jobrun import keys  # noqa: PLC0415 - only with --requires

    return tuple(_normalized(keys.normalized_label, label) for label in labels)


def _normalized(normalize: Callable[[str], str], label: str) -> str:
    """One --requires label normalized; a bad one is a usage error that names it."""
    try:
        return normalize(label)
    except UsageError as exc:
        raise UsageError(f"--requires {label!r}: {exc}") from None


def _check_queue_jitter_retries(given: Mapping[str, Any], run_keys: tuple[keys.Key, ...]) -> None:
    """--coalesce, --jitter and --retries: their rules about the other options."""
    if given["coalesce"] and given["slots"] > 1:
        raise UsageError("--coalesce with --slots: a queued run waits for one lock; drop one")
    if given["coalesce"] and (len(run_keys) != 1 or run_keys[0].name is None):
        raise UsageError("--coalesce takes one key name (--key NAME)")
    if given["jitter_random"] and not given["jitter"]:
        raise UsageError("--jitter-random goes with --jitter DURATION")
    if given["retries"] == 0 and given["retry_on"]:
        raise UsageError("--retry-on goes with --retries N")
    if given["retries"] and _keeps_output(given["keep_output"]):
        raise UsageError(
            "--retries with --keep-output: the kept tails would mix the attempts; drop one of them"
        )


def _retry_codes(text: str | None) -> tuple[int, ...]:
    """--retry-on's comma list of exit codes (empty: any non-zero exit)."""
    if not text:
        return ()
    codes = []
    for written in text.split(","):
        part = written.strip()
        if not (part.isascii() and part.isdigit()) or not 1 <= int(part) <= 255:  # noqa: PLR2004
            raise UsageError(f"--retry-on: {part!r} is not an exit code from 1 to 255")
        codes.append(int(part))
    return tuple(codes)


def _keeps_output(keep_output: str | None) -> bool:
    """Whether --keep-output keeps anything (``0`` keeps nothing)."""
    if keep_output is None:
        return False
    from jobrun.run import tail  # noqa: PLC0415 - only with --keep-output

    return tail.parse_size(keep_output) > 0
