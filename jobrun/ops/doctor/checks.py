"""Every doctor check in order; one that cannot run is reported UNKNOWN, saying why."""

from __future__ import annotations

from typing import TYPE_CHECKING

import psycopg

from jobrun import db
from jobrun.exitcodes import JobrunError
from jobrun.ops.doctor.capacity import advisory, connections, schema
from jobrun.ops.doctor.defaults import READ_ONLY, end_immunity, immunise, session_defaults
from jobrun.ops.doctor.finding import UNKNOWN, Finding
from jobrun.ops.doctor.forensics import deadlock_logging
from jobrun.ops.doctor.history_scale import history_scale
from jobrun.ops.doctor.probe import probes
from jobrun.ops.doctor.server import (
    connection,
    encryption,
    idle_timeouts,
    keepalives,
    pooler,
    role,
    server,
)
from jobrun.ops.doctor.tenancy import tenancy

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from jobrun.ops.doctor.query import Connection


def diagnose(conn: Connection, target: db.Target, *, mode: str) -> list[Finding]:
    """Every check, in order; a check that cannot run is UNKNOWN, saying why."""
    immune = immunise(conn)
    defaults: dict[str, str] = {}
    checks: tuple[tuple[str, Callable[[], Iterable[Finding]]], ...] = (
        ("connection", lambda: [connection(conn, target)]),
        ("encryption", lambda: [encryption(conn)]),
        ("server", lambda: [server(conn)]),
        ("role", lambda: [role(conn)]),
        ("session defaults", lambda: session_defaults(conn, mode, defaults)),
        ("schema", lambda: schema(conn, mode, read_only=defaults.get(READ_ONLY) == "on")),
        ("tenancy", lambda: tenancy(conn)),
        ("probes", lambda: probes(conn, mode)),
        ("history", lambda: history_scale(conn)),
        ("pooler", lambda: [pooler(conn, target, mode)]),
        ("idle timeouts", lambda: idle_timeouts(conn)),
        ("tcp keepalives", lambda: [keepalives(conn, mode)]),
        ("connections", lambda: [connections(conn)]),
        ("advisory locks", lambda: advisory(conn)),
        ("deadlock logging", lambda: deadlock_logging(conn)),
    )
    findings: list[Finding] = []
    for name, check in checks:
        try:
            findings.extend(check())
        except (psycopg.Error, JobrunError) as exc:  # noqa: PERF203 - a dozen checks, not a hot loop
            error = db.one_line(exc, target)
            findings.append(Finding(UNKNOWN, name, f"could not check: {error}"))
    if immune:
        end_immunity(conn)
    return findings
