"""What a run will do, done for real and rolled back: take a lease, write and read history."""

from __future__ import annotations

import os
import socket
import uuid
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors

from jobrun import keys
from jobrun.escape import printable
from jobrun.exitcodes import UsageError
from jobrun.history import schema
from jobrun.ops.doctor.finding import FAIL, NOTE, OK, WARN, Finding
from jobrun.sql import doctor as statements
from jobrun.sql import history, lease

if TYPE_CHECKING:
    from collections.abc import Sequence

    from jobrun.ops.doctor.query import Connection

#: What a probe key is made of: a key name no real job uses, or a grant's pattern filled
#: in with it (after ``jobrun init`` the role may only write rows of keys it was granted).
PROBE = "jobrun-doctor-probe"
#: Each probe's statements give up after this long, as a history call does.
PROBE_TIMEOUT_MS = 5000


class _Refused(Exception):
    """A probe's statement failed; the server's error, and whether creating the tables did."""

    def __init__(self, error: psycopg.Error, *, creating: bool) -> None:
        super().__init__(str(error))
        self.error = error
        self.creating = creating


def probes(conn: Connection, mode: str) -> list[Finding]:
    """Take a lease and write, read and finish a history row, each rolled back at once.

    The same statements a run sends, in the same order (creating jobrun's tables when they
    are missing, as a first run does), inside a transaction that is always rolled back:
    nothing stays, and what a run would be refused, the doctor is refused too.
    """
    key = probe_key(conn)
    return [_lease(conn, key, mode), _history(conn, key, mode)]


def probe_key(conn: Connection) -> keys.Key:
    """A key this role may write rows of: its first granted pattern filled in, else PROBE-…."""
    fallback = keys.from_name(f"{PROBE}-{uuid.uuid4().hex[:8]}")
    try:
        with conn.transaction():
            initialised = conn.execute(statements.DOCTOR_PROBE_INITIALISED).fetchone()
            if not (initialised and initialised[0]):
                return fallback
            patterns = [str(row[0]) for row in conn.execute(statements.DOCTOR_PROBE_PATTERNS)]
    except psycopg.Error:  # no USAGE on the schema: the probes say what that breaks
        return fallback
    filled = (_filled_in(pattern) for pattern in patterns)
    return next((key for key in filled if key is not None), fallback)


def _filled_in(pattern: str) -> keys.Key | None:
    """A key matching a grant's ``pattern`` (None: none can be made of it)."""
    try:
        if pattern.startswith(keys.LOCK_ID_PREFIX):
            return keys.parse_lock_id(pattern[len(keys.LOCK_ID_PREFIX) :])
        return keys.from_name(pattern.replace("*", PROBE).replace("?", "x"))
    except UsageError:
        return None


def _lease(conn: Connection, key: keys.Key, mode: str) -> Finding:
    """Lease mode's first statement for one key, after creating its table where missing."""
    params = {
        "lock_ids": [key.lock_id],
        "keys": [key.label],
        "label": key.label,
        "owner": str(uuid.uuid4()),
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "ttl": 60.0,
    }
    try:
        row = _rolled_back(
            conn,
            [(lease.LEASE_TAKE_ONE, params)],
        )[0]
    except _Refused as refused:
        if mode != "lease":
            return Finding(
                NOTE,
                "lease",
                f"--mode lease would exit 69 (not used in session mode): "
                f"{_why(conn, refused, key)}",
            )
        return Finding(FAIL, "lease", f"runs will exit 69: {_why(conn, refused, key)}")
    if not (row and row[0] and row[1]):
        held = "a lease of it is held" if row and row[0] else "a session holds its lock"
        return Finding(
            WARN, "lease", f"could not try: {held} (key {printable(key.label)}); run me again"
        )
    return Finding(
        OK,
        "lease",
        f"took a lease of {printable(key.label)} as a run would (rolled back: nothing kept)",
    )


def _history(conn: Connection, key: keys.Key, mode: str) -> Finding:
    """A run's history: its running row, read back, then finished; tables created if missing."""
    params = {
        "ms": str(PROBE_TIMEOUT_MS),
        "run_id": str(uuid.uuid4()),
        "key": key.label,
        "lock_ids": [key.lock_id],
        "mode": mode,
        "host": socket.gethostname(),
        "pid": os.getpid(),
        "program": PROBE,
        "window": None,
        "tz": None,
        "pause_keys": [key.label],
    }
    steps = [
        (history.RUNS_ACQUIRED, params),
        (statements.DOCTOR_PROBE_READ, params),
        (statements.DOCTOR_PROBE_FINISH, params),
    ]
    try:
        rows = _rolled_back(conn, steps)
    except _Refused as refused:
        if _unpaused(conn, refused, [(history.RUNS_ACQUIRED_UNPAUSED, params), *steps[1:]]):
            # As a run does: refused the pauses, it writes its row without them.
            return Finding(
                WARN,
                "history",
                f"wrote, read and finished a history row of {printable(key.label)} without "
                "jobrun.pauses, which this role may not read: its runs see no pause "
                "(rolled back: nothing kept)",
            )
        return Finding(
            WARN,
            "history",
            "runs go on without a history (a history_failed line each) and --once-per runs "
            f"exit 69: {_why(conn, refused, key)}",
        )
    if not all(rows):
        return Finding(
            WARN,
            "history",
            f"a history row of {printable(key.label)} was written but could not be read back "
            "or finished: jobrun status and --once-per will not see this role's runs",
        )
    return Finding(
        OK,
        "history",
        f"wrote, read and finished a history row of {printable(key.label)} "
        "(rolled back: nothing kept)",
    )


def _unpaused(
    conn: Connection, refused: _Refused, steps: Sequence[tuple[str, dict[str, Any]]]
) -> bool:
    """Whether the history works without the pauses, after ``refused`` (a privilege)."""
    if refused.creating or not isinstance(refused.error, errors.InsufficientPrivilege):
        return False
    try:
        rows = _rolled_back(conn, steps)
    except _Refused:
        return False
    return all(rows)


def _rolled_back(
    conn: Connection, steps: Sequence[tuple[str, dict[str, Any]]]
) -> list[tuple[Any, ...] | None]:
    """The first row of each step, in one transaction that is then rolled back.

    The first step's message carries the schema's version check, as a run's does; where
    the schema lacks steps they are run first (in a savepoint, rolled back with the rest),
    as a run does on its first use. Every statement is bounded by PROBE_TIMEOUT_MS and
    runs with the search_path pinned (the history's own limits).
    """
    rows: list[tuple[Any, ...] | None] = []
    limits = {"ms": str(PROBE_TIMEOUT_MS)}

    def first(check: tuple[str, ...]) -> tuple[Any, ...] | None:
        with conn.transaction():
            *_, found = schema.results(conn, ";\n".join((*check, steps[0][0])), steps[0][1])
        return found[0] if found else None

    try:
        with conn.transaction(force_rollback=True):
            conn.execute(history.RUNS_TIMEOUTS, limits)
            try:
                rows.append(first(schema.CHECK_WRITE_ONLY))
            except psycopg.Error as exc:
                if not schema.behind(exc):
                    raise
                try:
                    with conn.transaction():
                        schema.ensure(conn, timeout_ms=PROBE_TIMEOUT_MS, remember=False)
                except psycopg.Error as exc:
                    raise _Refused(exc, creating=True) from None
                rows.append(first(()))
            rows += [conn.execute(text, values).fetchone() for text, values in steps[1:]]
    except psycopg.Error as exc:
        raise _Refused(exc, creating=False) from None
    return rows


def _why(conn: Connection, refused: _Refused, key: keys.Key) -> str:
    """The server's refusal, and what makes it go away."""
    error = refused.error
    said = printable(str(error.diag.message_primary or error).strip())
    role, database = _ident(conn.info.user), _ident(conn.info.dbname)
    if isinstance(error, errors.ReadOnlySqlTransaction):
        fix = f"ALTER ROLE {role} SET default_transaction_read_only = off (or use another role)"
    elif "for database" in said:
        fix = (
            f"GRANT CREATE ON DATABASE {database} TO {role} (its first run creates the jobrun "
            "schema and tables), or have the database owner run jobrun init, then jobrun "
            f"grant {printable(conn.info.user)} --keys PATTERN (docs/operations.md, "
            "preparing a database)"
        )
    elif "row-level security" in said:
        fix = (
            f"jobrun grant {printable(conn.info.user)} --keys PATTERN, as the owner of "
            f"jobrun's tables (key {printable(key.label)} was tried)"
        )
    elif "must be owner" in said or refused.creating:
        fix = (
            "some of jobrun's tables are missing and another role owns the others: their "
            "owner runs jobrun init (or any run) once to create the rest"
        )
    elif isinstance(error, errors.InsufficientPrivilege):
        fix = (
            f"the owner of jobrun's tables runs jobrun init, then jobrun grant "
            f"{printable(conn.info.user)} --keys PATTERN"
        )
    else:
        return said
    return f"{said}; fix: {fix}"


def _ident(name: str | None) -> str:
    """``name`` as an SQL identifier, quoted, for a line to paste into psql."""
    return '"' + printable(name or "").replace('"', '""') + '"'
