"""Checks of the server and the way to it: version, role, pooler, idle timeouts, keepalives."""

from __future__ import annotations

import ipaddress
from typing import TYPE_CHECKING

from jobrun import db, sql
from jobrun.log import safe_text
from jobrun.ops.doctor import query
from jobrun.ops.doctor.finding import FAIL, OK, WARN, Finding

if TYPE_CHECKING:
    from jobrun.ops.doctor.query import Connection

#: Oldest server jobrun is tested against (CI runs PostgreSQL 13 to 18).
MIN_TESTED_VERSION = 130000
#: A vanished client's session (and its advisory locks) should be dropped within this.
KEEPALIVE_BUDGET = 300


def connection(conn: Connection, target: db.Target) -> Finding:
    """Where the doctor connected, and as which role."""
    return Finding(OK, "connection", f"{db.describe(target)} as {conn.info.user}")


def encryption(conn: Connection) -> Finding:
    """Whether the connection is encrypted; in the clear over a network it warns.

    Asked of libpq (our end of this very connection), not of the server: behind a pooler
    the hop that matters first is ours.
    """
    pgconn = conn.pgconn
    sslmode = next(
        (str(opt.val.decode()) for opt in pgconn.info if opt.keyword == b"sslmode" and opt.val),
        "prefer",
    )
    if pgconn.ssl_in_use:
        if sslmode == "verify-full":
            return Finding(OK, "encryption", "encrypted (TLS), the server's identity verified")
        return Finding(
            OK,
            "encryption",
            f"encrypted (TLS), sslmode={sslmode}: the server's certificate and host name are "
            "not checked (sslmode=verify-full with sslrootcert checks both)",
        )
    peer = network_peer(conn.info.host, conn.info.hostaddr)
    if peer is None:
        return Finding(OK, "encryption", "not encrypted: a local connection (socket or loopback)")
    return Finding(
        WARN,
        "encryption",
        f"not encrypted over the network to {safe_text(peer)} (sslmode={sslmode}): "
        "passwords and job names cross it in the clear, and whoever is on the path can "
        "answer as the server; use sslmode=verify-full",
    )


def network_peer(host: str, hostaddr: str) -> str | None:
    """The address a TCP connection to a non-loopback host went to (None: a local one)."""
    if not host or host.startswith(("/", "@")):  # a Unix-domain socket (or an abstract one)
        return None
    try:
        if ipaddress.ip_address(hostaddr or host).is_loopback:
            return None
    except ValueError:  # a name without its address: say the name
        return host
    return hostaddr or host


def server(conn: Connection) -> Finding:
    """The server's version; a standby fails, since its locks are not the primary's."""
    version, number, standby = query.one(conn, sql.DOCTOR_SERVER)
    if standby:
        return Finding(
            FAIL,
            "server",
            f"PostgreSQL {version} is a standby: locks there are not shared with the primary "
            "or other standbys; point jobrun at the primary (target_session_attrs=read-write)",
        )
    if int(number) < MIN_TESTED_VERSION:
        return Finding(WARN, "server", f"PostgreSQL {version}: older than 13, untested")
    return Finding(OK, "server", f"PostgreSQL {version}")


def role(conn: Connection) -> Finding:
    """The role: a superuser warns; and how much of other sessions it can see."""
    user, superuser, signal_backend, read_all_stats = query.one(conn, sql.DOCTOR_ROLE)
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


def pooler(conn: Connection, target: db.Target, mode: str) -> Finding:
    """A transaction pooler in the way fails session mode, whose locks it would strand."""
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


def idle_timeouts(conn: Connection) -> list[Finding]:
    """Idle timeouts as a fresh session sees them (server, ALTER DATABASE/ROLE ... SET)."""
    names = ("idle_in_transaction_session_timeout", "idle_session_timeout")
    settings = query.settings(conn, names)
    findings = []
    for name in names:
        setting, shown = settings.get(name, (None, ""))
        if setting is None:
            said = "not in this server version"
        elif setting == "0":
            said = "0 (off)"
        else:
            # WARNING: this is only harmless because the lock session sets both to 0 for
            # itself; anything that holds a session lock without doing so would lose it.
            said = (
                f"{shown} for new sessions: jobrun's lock session sets it to 0 for itself "
                "(the job's own sessions are still subject to it)"
            )
        findings.append(Finding(OK, name, said))
    return findings


def keepalives(conn: Connection, mode: str) -> Finding:
    """How long the server keeps the session (and its locks) of a client that vanished."""
    over_tcp = query.one(conn, sql.DOCTOR_OVER_TCP)[0]
    if not over_tcp:
        return Finding(OK, "tcp keepalives", "Unix-domain socket: not applicable")
    names = ("tcp_keepalives_idle", "tcp_keepalives_interval", "tcp_keepalives_count")
    settings = query.settings(conn, names)
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
