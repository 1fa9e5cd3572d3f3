"""Whether the server log can confirm a deadlock and name both jobs: notes, never failures."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobrun.ops.doctor import query
from jobrun.ops.doctor.finding import NOTE, OK, Finding

if TYPE_CHECKING:
    from jobrun.ops.doctor.query import Connection

#: deadlock_timeout outside this range (ms) makes deadlock forensics harder.
DEADLOCK_TIMEOUT_RANGE = (100, 5000)


def deadlock_logging(conn: Connection) -> list[Finding]:
    """Whether the server log can confirm a deadlock and name both jobs (NOTE, not FAIL)."""
    names = (
        "log_lock_waits",
        "deadlock_timeout",
        "log_connections",
        "log_disconnections",
        "log_destination",
        "log_line_prefix",
    )
    settings = query.settings(conn, names)
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
    findings.append(
        Finding(OK, "log_disconnections", "on: with log_connections, every session is dated")
        if settings.get("log_disconnections", ("off", "off"))[0] == "on"
        else Finding(
            NOTE,
            "log_disconnections",
            "off: jobrun deadlocks --sessions cannot tell a session that ended before a "
            "deadlock from one still open; log_disconnections = on dates each session's end",
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
