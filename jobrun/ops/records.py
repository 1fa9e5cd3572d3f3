"""What is recorded of a key: the check that catches a mistyped KEY, and forgetting a key."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg import errors

from jobrun import sql
from jobrun.db import messages
from jobrun.escape import printable
from jobrun.exitcodes import NOT_GRANTED, Exit, JobrunError, LockStoreUnavailable
from jobrun.history import schema
from jobrun.locks.holders import candidate_ids, holder_among, holder_of
from jobrun.ops import control
from jobrun.sql import control as control_statements
from jobrun.sql import records as statements

if TYPE_CHECKING:
    from collections.abc import Sequence

    import psycopg

    from jobrun.locks import Holder

    Connection = psycopg.Connection[Any]


class NeverRecorded(JobrunError):
    """Nothing was ever recorded of a key: most likely a typo (exit 1)."""

    exit_code = Exit.ATTENTION

    def __init__(self, label: str, hint: str = "") -> None:
        super().__init__(f"no run of {label} was ever recorded (is the key spelled right?){hint}")


#: What each need of ``jobrun.allowed`` lets a role do, and the grant that gives it.
_NEEDS = {
    "control": ("stop, pause or resume", "{keys} (or --operator, for every key)"),
    "run": ("run or forget", "{keys}"),
    "read": ("read", "{keys} (or --operator, for every key)"),
}


class NotGranted(LockStoreUnavailable):
    """After ``jobrun init``: the role was not granted the key for what it asked (exit 69).

    The database's answer (``jobrun.allowed``), never a guess from rows this role cannot see:
    a key of another team is refused as such, not taken for a typo.
    """

    def __init__(self, role: str, label: str, need: str) -> None:
        does, grants = _NEEDS.get(need, _NEEDS["control"])
        keys = " ".join(f"--keys {printable(key)}" for key in label.split(","))
        super().__init__(
            f"role {printable(role)} is not granted {printable(label)}: it may not {does} it "
            f"(the database owner grants it with: jobrun grant {printable(role)} "
            f"{grants.format(keys=keys)})",
            reason=NOT_GRANTED,
        )


def _refuse_unless_granted(found: list[tuple[Any, ...]], label: str, need: str) -> None:
    """NotGranted if GRANTED's rows (``found``) say no; a database without init says nothing."""
    if found and found[0][0] == "false":
        raise NotGranted(str(found[0][1]), label, need)


def refuse_unless_granted(conn: Connection, label: str, need: str) -> None:
    """NotGranted unless this role is granted ``label`` for ``need`` (statements.GRANT_CHECK).

    For a path that is about to refuse anyway (a write row-level security turned down, a
    kept output not found): one statement more only there.
    """
    found = messages.results(conn, statements.GRANT_CHECK, {"key": label, "need": need})
    _refuse_unless_granted(found[-1], label, need)


class KeyHeld(JobrunError):
    """``forget`` refused: a run holds the key now (exit 1)."""

    exit_code = Exit.ATTENTION


def ever_recorded(conn: Connection, label: str) -> bool:
    """Whether ``label`` names a key jobrun knows: recorded, paused, expected, or held now.

    A run with ``--no-history`` leaves no row: its lease or advisory lock, while it holds
    the key, is what counts then. A history this role may not read is no proof of a typo:
    True.
    """
    for statement in (statements.RECORDED_IN_HISTORY, statements.RECORDED_IN_CONTROL):
        try:
            found = _read(conn, [statement], {"key": label})
        except errors.InsufficientPrivilege:
            return True
        if found is None:  # no jobrun schema: nothing was ever recorded
            break
        if found[0] and found[0][0][0]:
            return True
    return holder_of(conn, label) is not None


def _read(
    conn: Connection, reads: Sequence[str], params: dict[str, Any]
) -> list[list[tuple[Any, ...]]] | None:
    """The rows of each of ``reads`` in one message, after the schema's version check.

    None: there is no jobrun schema in this database (nothing recorded, nothing granted).
    """
    return schema.readable(
        conn, lambda check: messages.results(conn, [*check, *reads], params)[len(check) :]
    )


def held_if_recorded(conn: Connection, label: str) -> tuple[Holder | None, bool | None]:
    """The run holding ``label`` now (see locks.holders.holder_of); NeverRecorded for a typo.

    And whether ``jobrun init`` made the run-label function (None: not asked), so that
    ``control.verify_run`` need not try it in vain. One message where every table is there
    and readable: whether this role may control the key (NotGranted if not), whether the
    key was recorded, its lease holder, its session holder (with the run the history
    records on its lock), the function. Else the statements one by one, as
    ``require_recorded`` and ``holder_of`` send them (a missing table or grant costs only
    its own part).
    """
    params = {"key": label, "need": "control", "lock_ids": candidate_ids(label)}
    try:
        found = _read(
            conn,
            [
                *statements.GRANT_CHECK,
                statements.RECORDED_ANYWHERE,
                *sql.STOP_LEASE_HOLDER,
                control_statements.STOP_SESSION_HOLDER,
                sql.RUN_LABEL_DEFINED,
            ],
            params,
        )
    except errors.InsufficientPrivilege:
        found = None
    if found is None:
        require_recorded(conn, label, need="control")
        return holder_of(conn, label), None
    *_, granted, recorded, _, _, lease, session, labelled = found
    _refuse_unless_granted(granted, label, "control")
    initialised = bool(labelled and labelled[0][0])
    holder = holder_among(label, _first(lease), _first(session), initialised=initialised)
    if holder is None and not (recorded and recorded[0][0]):
        raise NeverRecorded(label)
    return holder, initialised


def resume_if_recorded(conn: Connection, label: str) -> bool:
    """End the pause of ``label`` (False: it was not paused); NeverRecorded for a typo.

    One message where the tables are there and readable: whether this role may control the
    key (NotGranted if not: row-level security let its DELETE remove nothing), whether the
    key was recorded, and the resume itself (a key never recorded has no pause to delete:
    nothing is changed).
    """
    try:
        found = _read(
            conn,
            [*statements.GRANT_CHECK, statements.RECORDED_ANYWHERE, sql.RESUME_NAMED],
            {"key": label, "need": "control"},
        )
    except errors.InsufficientPrivilege:
        found = None
    if found is None:
        require_recorded(conn, label, need="control")
        return control.resume(conn, label)
    *_, granted, recorded, resumed = found
    _refuse_unless_granted(granted, label, "control")
    if not (recorded and recorded[0][0]) and holder_of(conn, label) is None:
        raise NeverRecorded(label)
    return bool(resumed)


def _first(rows: list[tuple[Any, ...]]) -> tuple[Any, ...] | None:
    return rows[0] if rows else None


def require_recorded(
    conn: Connection, label: str, *, need: str, unless: bool = False, hint: str = ""
) -> None:
    """Raise NeverRecorded unless ``label`` was ever recorded (see ever_recorded) or ``unless``.

    First NotGranted, after ``jobrun init``, unless this role is granted ``label`` for
    ``need`` (``jobrun.allowed``): a key of another team is not a typo. Asked in the message
    that looks for the key's rows, where its tables are there and readable (else the
    statements one by one, as ever_recorded sends them). ``hint`` ends the error line (how
    to go ahead all the same).
    """
    if unless:
        return
    try:
        found = _read(
            conn,
            [*statements.GRANT_CHECK, statements.RECORDED_ANYWHERE],
            {"key": label, "need": need},
        )
    except errors.InsufficientPrivilege:
        found = None
    if found is None:
        known = ever_recorded(conn, label)
    else:
        *_, granted, recorded = found
        _refuse_unless_granted(granted, label, need)
        known = bool(recorded and recorded[0][0]) or holder_of(conn, label) is not None
    if not known:
        raise NeverRecorded(label, hint)


@dataclass(frozen=True)
class Forgotten:
    """The rows ``forget`` removed, per table."""

    runs: int = 0
    skips: int = 0
    kept_output: int = 0
    pauses: int = 0
    expectations: int = 0
    stop_requests: int = 0
    expired_leases: int = 0

    @property
    def total(self) -> int:
        """Every row removed (kept output lives in run rows: not counted twice)."""
        return (
            self.runs
            + self.skips
            + self.pauses
            + self.expectations
            + self.stop_requests
            + self.expired_leases
        )

    def describe(self) -> str:
        """``3 runs (1 with kept output), 2 skips, 1 pause, ...``: every table, even at 0."""
        parts = [
            _count(self.runs, "run") + f" ({self.kept_output} with kept output)",
            _count(self.skips, "skip"),
            _count(self.pauses, "pause"),
            _count(self.expectations, "expectation"),
            _count(self.stop_requests, "stop request"),
            _count(self.expired_leases, "expired lease"),
        ]
        return ", ".join(parts)


def _count(number: int, noun: str) -> str:
    return f"{number} {noun}" + ("" if number == 1 else "s")


def forget(conn: Connection, label: str) -> Forgotten:
    """Remove everything recorded of ``label``, in one transaction, unless a run holds it.

    Raises KeyHeld while a session-mode run holds one of its lock ids or a lease of it is
    live: the key is not retired. The key's lock ids are held (transaction-scoped) until
    the commit, so no run of it can start halfway.
    """
    lock_ids = candidate_ids(label)
    params = {"key": label, "lock_ids": lock_ids}

    def attempt(check: tuple[str, ...]) -> Forgotten:
        with conn.transaction():
            # The schema's version check rides with the first statement (one message): a
            # schema that lacks steps rolls this back, and is brought up to date first.
            *_, locked = messages.results(conn, [*check, statements.FORGET_LOCK_IDS], params)
            if not (locked and locked[0][0]):
                raise KeyHeld(
                    f"{label} is held by a running job (session mode): forget only a retired "
                    f"key; stop it first (jobrun stop {label}) or wait for it to end"
                )
            lease = _one(conn, statements.FORGET_LIVE_LEASE, params)
            if lease is not None:
                owner, host, pid = (printable(value) for value in lease)
                raise KeyHeld(
                    f"{label} is held by run {owner} on {host} (pid {pid}, lease mode): "
                    f"forget only a retired key; stop it first (jobrun stop {label}) or wait "
                    "for it to end"
                )
            row = _one(conn, statements.FORGET_RUNS, params)
            runs, skips, kept = (int(row[0]), int(row[1]), int(row[2])) if row else (0, 0, 0)
            return Forgotten(
                runs=runs,
                skips=skips,
                kept_output=kept,
                pauses=_deleted(conn, statements.FORGET_PAUSES, params),
                expectations=_deleted(conn, statements.FORGET_EXPECTATIONS, params),
                stop_requests=_deleted(conn, statements.FORGET_STOP_REQUESTS, params),
                expired_leases=_deleted(conn, statements.FORGET_LEASES, params),
            )

    return schema.guarded(conn, attempt)


def _one(conn: Connection, statement: str, params: dict[str, Any]) -> Any:
    """The statement's one row (None: no row)."""
    return conn.execute(statement, params).fetchone()


def _deleted(conn: Connection, statement: str, params: dict[str, Any]) -> int:
    row = _one(conn, statement, params)
    return int(row[0]) if row else 0
