"""``jobrun doctor``: check the database, role, settings and capacity a run depends on."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from jobrun import db, sql
from jobrun.exitcodes import JobrunError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    Connection = psycopg.Connection[tuple[Any, ...]]

OK, NOTE, WARN, FAIL, UNKNOWN = "OK", "NOTE", "WARN", "FAIL", "UNKNOWN"
#: A check that could not run proves nothing: it fails the doctor like a FAIL does.
FAILING = frozenset({FAIL, UNKNOWN})
#: Oldest server jobrun is tested against.
MIN_TESTED_VERSION = 120000
#: A vanished client's session (and its advisory locks) should be dropped within this.
KEEPALIVE_BUDGET = 300
#: Below this many free connection slots, a burst of jobs may be refused.
MIN_FREE_CONNECTIONS = 5
#: A role-level statement_timeout (or transaction_timeout) below this cancels jobrun's own
#: history and lease statements, which normally take milliseconds but can take longer on a
#: busy server.
MIN_STATEMENT_TIMEOUT_MS = 1000
#: deadlock_timeout outside this range (ms) makes deadlock forensics harder.
DEADLOCK_TIMEOUT_RANGE = (100, 5000)
#: Attempts at making the doctor's own session immune to a tiny statement_timeout.
_IMMUNE_ATTEMPTS = 20
#: SHOW's units, in milliseconds.
_UNITS_MS = {"us": 0.001, "ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}
#: Advisory locks share the lock table with every other lock: one table for all of them.
LOCK_TABLE_WARN = 0.5
LOCK_TABLE_FAIL = 0.9
_PERCENT = 100


@dataclass(frozen=True)
class Finding:
    """One line of the report."""

    status: str  # OK, NOTE, WARN, FAIL or UNKNOWN
    check: str
    detail: str

    def as_json(self) -> dict[str, str]:
        """``{"check": ..., "status": ..., "detail": ...}``."""
        return {"check": self.check, "status": self.status, "detail": self.detail}


def diagnose(conn: Connection, target: db.Target, *, mode: str) -> list[Finding]:
    """Every check, in order; a check that cannot run is UNKNOWN, saying why."""
    immune = _immunise(conn)
    defaults: dict[str, str] = {}
    checks: tuple[tuple[str, Callable[[], Iterable[Finding]]], ...] = (
        ("connection", lambda: [_connection(conn, target)]),
        ("server", lambda: [_server(conn)]),
        ("role", lambda: [_role(conn)]),
        ("session defaults", lambda: _session_defaults(conn, mode, defaults)),
        ("schema", lambda: _schema(conn, mode, read_only=defaults.get(_READ_ONLY) == "on")),
        ("pooler", lambda: [_pooler(conn, target, mode)]),
        ("idle timeouts", lambda: _idle_timeouts(conn)),
        ("tcp keepalives", lambda: [_keepalives(conn, mode)]),
        ("connections", lambda: [_connections(conn)]),
        ("advisory locks", lambda: _advisory(conn)),
        ("deadlock logging", lambda: _deadlock_logging(conn)),
    )
    findings: list[Finding] = []
    for name, check in checks:
        try:
            findings.extend(check())
        except (psycopg.Error, JobrunError) as exc:  # noqa: PERF203 - a dozen checks, not a hot loop
            error = db.one_line(exc, target)
            findings.append(Finding(UNKNOWN, name, f"could not check: {error}"))
    if immune:
        _end_immunity(conn)
    return findings


def exit_status(findings: Iterable[Finding]) -> int:
    """0 when every check ran and nothing FAILs, else 1."""
    return 1 if any(finding.status in FAILING for finding in findings) else 0


def report(findings: Iterable[Finding]) -> str:
    """``STATUS  CHECK  DETAIL`` lines, aligned."""
    rows = list(findings)
    width = max((len(row.check) for row in rows), default=0)
    status_width = max((len(row.status) for row in rows), default=4)
    return "\n".join(
        f"{row.status:<{status_width}}  {row.check:<{width}}  {row.detail}" for row in rows
    )


def _one(conn: Connection, query: str, params: dict[str, object] | None = None) -> tuple[Any, ...]:
    row = conn.execute(query, params).fetchone()
    if row is None:  # pragma: no cover - every doctor query returns one row
        raise psycopg.DataError("no row")
    return row


def _connection(conn: Connection, target: db.Target) -> Finding:
    return Finding(OK, "connection", f"{db.describe(target)} as {conn.info.user}")


def _server(conn: Connection) -> Finding:
    version, number, standby = _one(conn, sql.DOCTOR_SERVER)
    if standby:
        return Finding(
            FAIL,
            "server",
            f"PostgreSQL {version} is a standby: locks there are not shared with the primary "
            "or other standbys; point jobrun at the primary (target_session_attrs=read-write)",
        )
    if int(number) < MIN_TESTED_VERSION:
        return Finding(WARN, "server", f"PostgreSQL {version}: older than 12, untested")
    return Finding(OK, "server", f"PostgreSQL {version}")


def _role(conn: Connection) -> Finding:
    user, superuser, signal_backend, read_all_stats = _one(conn, sql.DOCTOR_ROLE)
    sees = (
        "sees every session's query (a skip names the holder's host, pid and run id)"
        if superuser or read_all_stats
        else "sees other roles' sessions without their queries (a skip names a holder of "
        "another role by backend pid only; grant pg_read_all_stats to see more)"
    )
    if superuser:
        return Finding(
            WARN,
            "role",
            f"{user} is a superuser: jobrun needs only CONNECT (and CREATE on the database "
            f"once); use a dedicated role; {sees}",
        )
    signals = (
        "; member of pg_signal_backend: can terminate other sessions and break their locks"
        if signal_backend
        else ""
    )
    return Finding(OK, "role", f"{user}, not a superuser{signals}; {sees}")


def _schema(conn: Connection, mode: str, *, read_only: bool) -> list[Finding]:
    """The jobrun schema and its tables: there, or creatable, and usable by this role."""
    exists, create_in_db, usage, create_in_schema = _one(conn, sql.DOCTOR_SCHEMA)
    lease_needed = FAIL if mode == "lease" else WARN
    if not exists:
        if read_only:
            return [
                Finding(
                    lease_needed,
                    "schema",
                    "jobrun schema missing, and this role's sessions are read-only "
                    "(default_transaction_read_only = on): it cannot be created",
                )
            ]
        if create_in_db:
            return [Finding(OK, "schema", "jobrun schema not there yet; created on first use")]
        return [
            Finding(
                lease_needed,
                "schema",
                "jobrun schema missing and this role may not create it (no CREATE on the "
                "database): lease mode cannot work and run history is not kept; have an "
                "owner run CREATE SCHEMA jobrun AUTHORIZATION <role>, or GRANT CREATE",
            )
        ]
    if not usage:
        return [
            Finding(
                lease_needed,
                "schema",
                "jobrun schema exists but this role lacks USAGE on it: GRANT USAGE ON SCHEMA "
                "jobrun TO <role>",
            )
        ]
    findings = [Finding(OK, "schema", "jobrun schema exists")]
    for table, purpose, severity in (
        ("leases", "lease mode", lease_needed if mode == "lease" else OK),
        ("runs", "run history", WARN),
    ):
        present, *privileges = _one(conn, sql.DOCTOR_TABLE, {"table": table})
        name = f"jobrun.{table}"
        if not present:
            if create_in_schema:
                findings.append(Finding(OK, name, "not there yet; created on first use"))
            else:
                findings.append(
                    Finding(
                        severity,
                        name,
                        f"missing, and this role may not create it: {purpose} will not work",
                    )
                )
            continue
        missing = [
            verb
            for verb, granted in zip(
                ("SELECT", "INSERT", "UPDATE", "DELETE"), privileges, strict=True
            )
            if not granted
        ]
        if missing:
            note = "" if severity != OK else " (not used in session mode)"
            findings.append(
                Finding(
                    severity,
                    name,
                    f"exists; this role lacks {', '.join(missing)}: {purpose} will fail{note}",
                )
            )
        else:
            findings.append(Finding(OK, name, "exists; SELECT, INSERT, UPDATE, DELETE granted"))
    return findings


_READ_ONLY = "default_transaction_read_only"
_TIMEOUTS = ("statement_timeout", "transaction_timeout")


def _immunise(conn: Connection) -> bool:
    """Lift a tiny role-level statement_timeout for the doctor's own session.

    A role whose statement_timeout is a millisecond cancels nearly every check; the doctor
    reads that setting from pg_settings.reset_val instead, and names it. If even this is
    cancelled every time, the checks run anyway, and each one cancelled shows as UNKNOWN.
    Returns whether it changed the session (to be undone by _end_immunity).

    WARNING: through a transaction pooler a SET outlives our session on a shared server
    connection, so the doctor only lifts a timeout that would cancel its own checks, and
    resets it at the end.
    """
    for _ in range(_IMMUNE_ATTEMPTS):
        try:
            row = conn.execute(sql.DOCTOR_STATEMENT_TIMEOUT).fetchone()
            if row is None or not 0 < _milliseconds(str(row[0])) < MIN_STATEMENT_TIMEOUT_MS:
                return False
            conn.execute(sql.DOCTOR_IMMUNE)
        except psycopg.errors.QueryCanceled:
            continue
        except psycopg.Error:
            return False
        return True
    return False


def _end_immunity(conn: Connection) -> None:
    with contextlib.suppress(psycopg.Error):
        conn.execute(sql.DOCTOR_IMMUNE_END)


def _milliseconds(shown: str) -> float:
    """``SHOW statement_timeout`` (``0``, ``1ms``, ``2s``, ``1min``) in milliseconds."""
    number = shown.rstrip("abcdefghijklmnopqrstuvwxyz")
    return float(number) * _UNITS_MS.get(shown[len(number) :], 1)


def _session_defaults(conn: Connection, mode: str, seen: dict[str, str]) -> list[Finding]:
    """Settings every session of this role starts with that make jobrun's statements fail."""
    rows = conn.execute(sql.DOCTOR_SESSION_DEFAULTS, {"names": [_READ_ONLY, *_TIMEOUTS]}).fetchall()
    values = {str(name): (str(value), str(unit or "")) for name, value, unit in rows}
    seen.update({name: value for name, (value, _unit) in values.items()})
    lease_breaks = FAIL if mode == "lease" else WARN
    broken = (
        "lease mode cannot take or renew a lease (exit 69)"
        if mode == "lease"
        else "session mode runs, but run history is not kept and --once-per runs exit 69"
    )
    findings: list[Finding] = []
    read_only = values.get(_READ_ONLY, ("off", ""))[0]
    if read_only == "on":
        findings.append(
            Finding(
                lease_breaks,
                _READ_ONLY,
                f"on for this role: jobrun cannot write its tables; {broken}; "
                f"ALTER ROLE <role> SET {_READ_ONLY} = off (or use another role)",
            )
        )
    else:
        findings.append(Finding(OK, _READ_ONLY, "off"))
    for name in _TIMEOUTS:
        if name not in values:
            continue  # transaction_timeout is new in PostgreSQL 17
        findings.append(_timeout(name, *values[name], severity=lease_breaks, broken=broken))
    return findings


def _timeout(name: str, value: str, unit: str, *, severity: str, broken: str) -> Finding:
    milliseconds = int(value) * (1000 if unit == "s" else 1)
    if milliseconds == 0:
        return Finding(OK, name, "0 (off)")
    shown = f"{value}{unit}"
    if milliseconds < MIN_STATEMENT_TIMEOUT_MS:
        return Finding(
            severity,
            name,
            f"{shown} for this role: cancels jobrun's own statements; {broken}; "
            f"ALTER ROLE <role> SET {name} = 0 (or at least "
            f"{MIN_STATEMENT_TIMEOUT_MS // 1000}s)",
        )
    if name == "transaction_timeout":
        # WARNING: unlike statement_timeout, this one ends the whole session, and the lock
        # session does not lift it: a blocking --wait longer than this loses the session.
        return Finding(
            WARN,
            name,
            f"{shown} for this role: ends any session whose transaction lasts longer, so a "
            "--wait for a held key must be shorter than that",
        )
    return Finding(
        OK,
        name,
        f"{shown} for new sessions: jobrun's lock session sets it to 0 for itself "
        "(the job's own sessions are still subject to it)",
    )


def _deadlock_logging(conn: Connection) -> list[Finding]:
    """Whether the server log can confirm a deadlock and name both jobs (NOTE, not FAIL)."""
    names = (
        "log_lock_waits",
        "deadlock_timeout",
        "log_connections",
        "log_destination",
        "log_line_prefix",
    )
    settings = _settings(conn, names)
    findings: list[Finding] = []
    waits = settings.get("log_lock_waits", ("off", "off"))[0]
    findings.append(
        Finding(OK, "log_lock_waits", "on: lock waits longer than deadlock_timeout are logged")
        if waits == "on"
        else Finding(
            NOTE,
            "log_lock_waits",
            "off: turn it on (ALTER SYSTEM SET log_lock_waits = on) so the server log shows "
            "who waited for whom before a deadlock, for jobrun deadlocks",
        )
    )
    timeout_ms, timeout_shown = settings["deadlock_timeout"]
    low, high = DEADLOCK_TIMEOUT_RANGE
    if int(timeout_ms) < low:
        findings.append(
            Finding(
                NOTE,
                "deadlock_timeout",
                f"{timeout_shown}: so short that jobrun overlap may not see the wait-for "
                "cycle before PostgreSQL breaks it, and log_lock_waits logs every short wait",
            )
        )
    elif int(timeout_ms) > high:
        findings.append(
            Finding(
                NOTE,
                "deadlock_timeout",
                f"{timeout_shown}: both jobs of a deadlock stand still this long before "
                "PostgreSQL breaks it",
            )
        )
    else:
        findings.append(Finding(OK, "deadlock_timeout", timeout_shown))
    connections = settings.get("log_connections", ("off", "off"))[0]
    # PostgreSQL 18 takes a list of aspects; "authorization" is the line naming the session.
    if connections in {"on", "all"} or "authorization" in connections.split(","):
        findings.append(
            Finding(OK, "log_connections", "on: every session's first line names its application")
        )
    else:
        findings.append(
            Finding(
                NOTE,
                "log_connections",
                "off: the other side of a deadlock is named only if it logged a line itself "
                "(a lock wait, an error); log_connections = on names every session",
            )
        )
    destinations = set(settings.get("log_destination", ("stderr", ""))[0].split(","))
    prefix = settings.get("log_line_prefix", ("", ""))[0]
    if "%a" in prefix:
        findings.append(Finding(OK, "log_line_prefix", f"'{prefix}' names the application (%a)"))
    elif destinations <= {"csvlog", "jsonlog"}:
        findings.append(Finding(OK, "log_line_prefix", "csvlog/jsonlog carry the application name"))
    else:
        findings.append(
            Finding(
                NOTE,
                "log_line_prefix",
                f"'{prefix}' has no %a: a deadlock's sides show as pids, not as the jobs "
                "(jobrun:<key>); add %a, or log to csvlog/jsonlog as well",
            )
        )
    return findings


def _pooler(conn: Connection, target: db.Target, mode: str) -> Finding:
    why = db.detect_transaction_pooler(conn, target, app_name="jobrun-doctor")
    if why is None:
        return Finding(OK, "pooler", "no transaction pooler in the way")
    if mode == "lease":
        return Finding(OK, "pooler", f"transaction pooler detected ({why}): fine for lease mode")
    return Finding(
        FAIL,
        "pooler",
        f"transaction pooler detected ({why}): session locks would be stranded; connect "
        "directly (or through a session-mode pooler), or use --mode lease",
    )


def _settings(conn: Connection, names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Each setting this server knows, by name: (raw value, as SHOW prints it)."""
    rows = conn.execute(sql.DOCTOR_SETTINGS, {"names": list(names)}).fetchall()
    return {str(name): (str(setting), str(shown)) for name, setting, _unit, shown in rows}


def _idle_timeouts(conn: Connection) -> list[Finding]:
    """Idle timeouts as a fresh session sees them (server, ALTER DATABASE/ROLE ... SET)."""
    names = ("idle_in_transaction_session_timeout", "idle_session_timeout")
    settings = _settings(conn, names)
    findings = []
    for name in names:
        if name not in settings:
            findings.append(Finding(OK, name, "not in this server version"))
            continue
        setting, shown = settings[name]
        if setting == "0":
            findings.append(Finding(OK, name, "0 (off)"))
        else:
            # WARNING: this is only harmless because the lock session sets both to 0 for
            # itself; anything that holds a session lock without doing so would lose it.
            findings.append(
                Finding(
                    OK,
                    name,
                    f"{shown} for new sessions: jobrun's lock session sets it to 0 for itself "
                    "(the job's own sessions are still subject to it)",
                )
            )
    return findings


def _keepalives(conn: Connection, mode: str) -> Finding:
    """How long the server keeps the session (and its locks) of a client that vanished."""
    over_tcp = _one(conn, sql.DOCTOR_OVER_TCP)[0]
    if not over_tcp:
        return Finding(OK, "tcp keepalives", "Unix-domain socket: not applicable")
    names = ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count")
    settings = _settings(conn, names)
    idle, interval, count = (int(settings.get(name, ("0", ""))[0] or 0) for name in names)
    # 0 means "the operating system's default"; over TCP the server reports the socket's
    # actual value, so a 0 left here means it could not tell: assume Linux's 2 hours.
    idle = idle or 7200
    budget = idle + interval * count
    detail = (
        f"server drops a vanished client after about {budget}s "
        f"(tcp_keepalives_idle={idle}, interval={interval}, count={count})"
    )
    if budget <= KEEPALIVE_BUDGET or mode == "lease":
        suffix = "" if mode != "lease" else "; lease mode does not depend on it"
        return Finding(OK, "tcp keepalives", detail + suffix)
    # The lock session sets its own server-side keepalives (jobrun.locks.session), so the
    # server's defaults only concern other sessions: worth a note, not a warning.
    return Finding(
        OK,
        "tcp keepalives",
        f"{detail}; jobrun's lock session sets its own (idle = 10s + kill-after + 5s, "
        "interval 2s, count 3): a vanished host loses its lock in about 31s with the defaults",
    )


def _connections(conn: Connection) -> Finding:
    max_connections, superuser_reserved, reserved, in_use = _one(conn, sql.DOCTOR_CONNECTIONS)
    usable = int(max_connections) - int(superuser_reserved) - int(reserved)
    free = usable - int(in_use)
    detail = (
        f"{in_use} of {max_connections} in use, {superuser_reserved + reserved} reserved, "
        f"{free} free (a session-mode run holds one for its whole run)"
    )
    if free <= 0:
        return Finding(FAIL, "connections", f"{detail}: new runs will be refused")
    if free < max(MIN_FREE_CONNECTIONS, usable // 10):
        return Finding(WARN, "connections", f"{detail}: little headroom")
    return Finding(OK, "connections", detail)


def _advisory(conn: Connection) -> list[Finding]:
    capacity = int(_one(conn, sql.DOCTOR_LOCK_CAPACITY)[0])
    cluster, here, by_jobrun = (int(value) for value in _one(conn, sql.DOCTOR_ADVISORY))
    held = Finding(
        OK,
        "advisory locks",
        f"{here} held in this database now, {by_jobrun} of them by jobrun sessions; "
        f"{cluster} in the whole cluster",
    )
    share = cluster / capacity if capacity else 1.0
    detail = (
        f"room for about {capacity} locks (max_locks_per_transaction x (max_connections + "
        f"max_prepared_transactions)), shared by every lock; advisory locks take "
        f"{share * _PERCENT:.1f}%"
    )
    status = FAIL if share >= LOCK_TABLE_FAIL else WARN if share >= LOCK_TABLE_WARN else OK
    return [held, Finding(status, "lock table", detail)]
