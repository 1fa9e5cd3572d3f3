"""The role's session defaults that break jobrun's statements, lifted for the doctor's own."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING

import psycopg

from jobrun import sql
from jobrun.ops.doctor.finding import FAIL, OK, WARN, Finding

if TYPE_CHECKING:
    from jobrun.ops.doctor.query import Connection

#: A role-level statement_timeout (or transaction_timeout) below this cancels jobrun's own
#: history and lease statements, which normally take milliseconds but can take longer on a
#: busy server.
MIN_STATEMENT_TIMEOUT_MS = 1000
#: Attempts at making the doctor's own session immune to a tiny statement_timeout.
_IMMUNE_ATTEMPTS = 20
#: SHOW's units, in milliseconds.
_UNITS_MS = {"us": 0.001, "ms": 1, "s": 1000, "min": 60_000, "h": 3_600_000, "d": 86_400_000}
READ_ONLY = "default_transaction_read_only"
_TIMEOUTS = ("statement_timeout", "transaction_timeout")


def immunise(conn: Connection) -> bool:
    """Lift a tiny role-level statement_timeout for the doctor's own session.

    A role whose statement_timeout is a millisecond cancels nearly every check; the doctor
    reads that setting from pg_settings.reset_val instead, and names it. If even this is
    cancelled every time, the checks run anyway, and each one cancelled shows as UNKNOWN.
    Returns whether it changed the session (to be undone by end_immunity).

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


def end_immunity(conn: Connection) -> None:
    """Undo what immunise set; a failure here changes no finding."""
    with contextlib.suppress(psycopg.Error):
        conn.execute(sql.DOCTOR_IMMUNE_END)


def _milliseconds(shown: str) -> float:
    """``SHOW statement_timeout`` (``0``, ``1ms``, ``2s``, ``1min``) in milliseconds."""
    number = shown.rstrip("abcdefghijklmnopqrstuvwxyz")
    return float(number) * _UNITS_MS.get(shown[len(number) :], 1)


def session_defaults(conn: Connection, mode: str, seen: dict[str, str]) -> list[Finding]:
    """Settings every session of this role starts with that make jobrun's statements fail."""
    rows = conn.execute(sql.DOCTOR_SESSION_DEFAULTS, {"names": [READ_ONLY, *_TIMEOUTS]}).fetchall()
    values = {str(name): (str(value), str(unit or "")) for name, value, unit in rows}
    seen.update({name: value for name, (value, _unit) in values.items()})
    lease_breaks = FAIL if mode == "lease" else WARN
    broken = (
        "lease mode cannot take or renew a lease (exit 69)"
        if mode == "lease"
        else "session mode runs, but run history is not kept and --once-per runs exit 69"
    )
    findings: list[Finding] = []
    read_only = values.get(READ_ONLY, ("off", ""))[0]
    if read_only == "on":
        findings.append(
            Finding(
                lease_breaks,
                READ_ONLY,
                f"on for this role: jobrun cannot write its tables; {broken}; "
                f"ALTER ROLE <role> SET {READ_ONLY} = off (or use another role)",
            )
        )
    else:
        findings.append(Finding(OK, READ_ONLY, "off"))
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
