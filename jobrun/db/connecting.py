"""Connecting: the deadline, busy-server backoff, failure reasons and the session's settings."""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import socket
import threading
import time
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg.adapt import AdaptersMap, Dumper

from jobrun import sql, threads
from jobrun.exitcodes import TLS, LockStoreUnavailable, UsageError
from jobrun.log import safe_text

from .dsn import describe, network_sslmode, parse_dsn
from .errors import one_line, unavailable

if TYPE_CHECKING:
    from .dsn import Target

Connection = psycopg.Connection[tuple[object, ...]]

#: libpq's application_name limit (NAMEDATALEN - 1 bytes).
APPLICATION_NAME_BYTES = 63

#: Session settings jobrun's own statements and result parsing depend on. A DBA may set any
#: of them per database or role (ALTER DATABASE ... SET), and a user through PGOPTIONS or
#: PGDATESTYLE: psycopg reads timestamps only in ISO DateStyle and intervals only in the
#: "postgres" IntervalStyle, --once-per windows are UTC days, the key names must survive the
#: client encoding, and no schema of the user's may shadow an object jobrun's SQL names.
PINNED_SETTINGS = sql.PINNED_SETTINGS
#: Settings the server reports at start-up (ParameterStatus), so checked without a query;
#: the values each may take that we accept as pinned.
_REPORTED = {
    "DateStyle": ("iso",),
    "IntervalStyle": ("postgres",),
    "TimeZone": ("utc", "etc/utc", "etc/universal", "universal", "zulu", "etc/zulu"),
    "client_encoding": ("utf8",),
}

#: Seconds without an answer after which a connection attempt says it is still under way.
SLOW_CONNECT = 2.0

#: Connection-failure reasons (``LockStoreUnavailable.reason``), documented in docs/connecting.md,
#: with ``TLS`` (imported from exitcodes: a certificate, a host name, TLS itself).
UNREACHABLE = "unreachable"
REFUSED = "refused"

# The patterns below are used on error paths only: plain strings, compiled (and cached by
# ``re``) the first time they are needed, not at every start of a run.

# libpq (or psycopg) rejected a value in the connection string itself: a usage error.
_BAD_OPTION = (
    r"(?i)invalid (?:integer |port |connection option|\S+ value)"
    r"|could not match \d+ (?:host names|port numbers)"
    r"|bad value for connect_timeout"
    r"|unrecognized (?:\S+ )?(?:value|option)"
    # sslnegotiation=direct with an sslmode that may fall back to plain text (libpq 17+).
    r"|may not be used with sslnegotiation"
    # service=NAME that no service file defines, or a service file libpq cannot read: both
    # found before any address is tried.
    r'|definition of service "[^"]*" not found|service file "'
)
# The server said no for now: many clients at once (SQLSTATE 53300) or it is starting up,
# shutting down or recovering (57P03). libpq does not expose the SQLSTATE of a failed
# start-up, so its (English) message text is all there is.
_BUSY = (
    r"(?i)too many (?:clients|connections)"
    r"|remaining connection slots are reserved"
    r"|the database system is (?:starting up|shutting down|in recovery mode"
    r"|not yet accepting connections|not accepting connections)"
)
# The server answered, and refused us.
_REFUSED = (
    r"(?i)FATAL:|authentication failed|no password supplied|password is required"
    r"|server requested .*authentication|SSL .*required|does not support SSL"
    r"|pg_hba\.conf|permission denied"
)
# TLS could not be set up as sslmode asks: the server's certificate failed verification or
# names another host (verify-ca, verify-full), the server does not offer TLS (require), a
# certificate or key file libpq needs is missing or unreadable, or the handshake failed.
# libpq's "SSL SYSCALL error" and an unexpected EOF are the network failing: unreachable.
# Likewise the user's own guards against a server in the middle: the server asked for an
# authentication method require_auth forbids, or for one without channel_binding=require.
_TLS = (
    r"(?i)certificate verify failed|does not match host name|server certificate for"
    r"|does not support SSL|root certificate file|certificate present, but not private key"
    r"|could not (?:load|read|open) (?:SSL )?(?:certificate|private key|root certificate)"
    r"|private key file|SSL error: (?!unexpected eof)|tlsv1 alert|sslv3 alert"
    r"|wrong version number"
    r"|authentication method requirement .* failed|channel binding (?:is )?required"
)
# sslnegotiation=direct opens with a TLS ClientHello where a server expects a start-up
# packet or an SSL request: a server before 17, or one without TLS, hangs up on it at once.
_DIRECT_EOF = r"(?i)SSL error: unexpected eof|SSL SYSCALL error: EOF"
_DIRECT_HINT = (
    "; sslnegotiation=direct needs a PostgreSQL 17 or later server with TLS on (an older "
    "one, or one without TLS, hangs up on it): remove it from the connection string"
)
# TLS failed where jobrun itself asked for it (sslmode=require, the connection string
# naming none): say why, and the one setting that allows plain text again.
_NETWORK_TLS_HINT = (
    "; jobrun asks for TLS over a network when the connection string sets no sslmode (a "
    "server that declines it may be someone in the middle): if this server really has no "
    "TLS, add sslmode=prefer to the connection string (its passwords then cross the network "
    "in the clear)"
)
# PgBouncer (before 1.20) refuses any start-up parameter it does not track.
_OPTIONS_UNSUPPORTED = r"(?i)unsupported startup parameter: options"

#: First and longest pause between two attempts at a busy server (jittered).
_FIRST_BACKOFF = 0.05
_MAX_BACKOFF = 1.0


def application_name(label: str) -> str:
    """``jobrun:<label>`` trimmed to 63 bytes without splitting a UTF-8 character."""
    encoded = safe_text(f"jobrun:{label}").encode()[:APPLICATION_NAME_BYTES]
    return encoded.decode("utf-8", "ignore")


def text_param(value: str) -> str:
    """``value`` fit for the database: bytes that were not UTF-8 spelled ``\\xNN``.

    Every str parameter sent on a connection from ``connect`` goes through this already;
    it is here for text built into SQL by other means.
    """
    return safe_text(value)


class _TextDumper(Dumper):
    """Python str -> text in the connection's encoding, never UnicodeEncodeError.

    WARNING: argv and environment text that was not UTF-8 reaches Python as lone
    surrogates (U+DCxx); psycopg's own dumper would raise on them, after the child ran.
    """

    oid = 0  # "unknown", as psycopg's own: the server infers the type from the statement

    def dump(self, obj: Any) -> bytes:
        encoding = self.connection.info.encoding if self.connection else "utf-8"
        return safe_text(str(obj)).encode(encoding, "backslashreplace")


_ADAPTERS = AdaptersMap(psycopg.adapters)
_ADAPTERS.register_dumper(str, _TextDumper)


def connect(target: Target, *, app_name: str) -> Connection:
    """An autocommit connection with keepalives, pinned settings and a bounded connect time.

    Waits out a busy server (too many clients, starting up) with jittered backoff until
    ``target.connect_timeout`` runs out. Raises LockStoreUnavailable (reason ``unreachable``
    or ``refused``), or UsageError for a connection string libpq rejects.

    WARNING: autocommit is essential: a lock session left "idle in transaction" would be
    killed by ``idle_in_transaction_session_timeout`` and take the lock with it.
    """
    params = parse_dsn(target.dsn)
    deadline = time.monotonic() + target.connect_timeout
    backoff = _FIRST_BACKOFF
    attempts = 0
    busy = ""  # the server's last "not now", if it said so
    while True:
        attempts += 1
        try:
            conn = _connect_once(target, params, app_name, deadline)
        except _ConnectTimeoutError:
            if busy:  # the deadline came while we asked again: the server's answer stands
                raise LockStoreUnavailable(
                    f"cannot connect to {describe(target)}: {busy} (still so after "
                    f"{attempts - 1} attempts in {target.connect_timeout:g}s)",
                    reason=REFUSED,
                ) from None
            raise LockStoreUnavailable(
                f"cannot connect to {describe(target)}: no answer within "
                f"{target.connect_timeout:g}s (--connect-timeout)"
                + (f", after {attempts} attempts" if attempts > 1 else ""),
                reason=UNREACHABLE,
            ) from None
        except psycopg.Error as exc:
            text = one_line(exc, target)
            if re.search(_BAD_OPTION, text) and not re.search(_REFUSED, text):
                raise UsageError(f"--dsn/JOBRUN_DSN: {_strip_prefix(text)}") from None
            if re.search(_BUSY, text):
                busy = text
                pause = random.uniform(backoff / 2, backoff)  # noqa: S311 - jitter, not crypto
                if time.monotonic() + pause < deadline:
                    time.sleep(pause)
                    backoff = min(_MAX_BACKOFF, backoff * 2)
                    continue
                text += f" (still so after {attempts} attempts in {target.connect_timeout:g}s)"
            reason = classify(text)
            if reason == UNREACHABLE and _direct(params) and re.search(_DIRECT_EOF, text):
                # Every attempt fails alike: a setting that does not fit the server, not an
                # outage, so never a reason to run unguarded (at worst a real cut during the
                # handshake fails closed too).
                reason, text = TLS, text + _DIRECT_HINT
            text += _network_tls_hint(reason, params)
            raise LockStoreUnavailable(
                f"cannot connect to {describe(target)}: {text}", reason=reason
            ) from None
        try:
            _pin_settings(conn)
        except psycopg.Error as exc:
            conn.close()
            raise unavailable(exc, target, "preparing the session") from None
        return conn


def classify(message: str) -> str:
    """``tls``, ``refused`` (the server answered and said no) or ``unreachable``."""
    if re.search(_TLS, message):
        return TLS
    return REFUSED if re.search(_BUSY, message) or re.search(_REFUSED, message) else UNREACHABLE


def _network_tls_hint(reason: str, params: dict[str, Any]) -> str:
    """Why TLS was asked for, when it was jobrun's own sslmode that failed ("" otherwise)."""
    return _NETWORK_TLS_HINT if reason == TLS and network_sslmode(params) else ""


def _direct(params: dict[str, Any]) -> bool:
    """Whether libpq opens with TLS at once (``sslnegotiation=direct``, DSN or environment)."""
    chosen = params.get("sslnegotiation") or os.environ.get("PGSSLNEGOTIATION", "")
    return str(chosen) == "direct"


def _strip_prefix(text: str) -> str:
    for prefix in ("connection is bad: ", "connection failed: "):
        text = text.removeprefix(prefix)
    return text


def _connection_kwargs(
    target: Target, params: dict[str, Any], app_name: str, timeout: float
) -> dict[str, Any]:
    kwargs: dict[str, Any] = {
        "autocommit": True,
        # Poolers in transaction mode cannot keep prepared statements.
        "prepare_threshold": None,
        "context": _ADAPTERS,
        "application_name": safe_text(app_name),
        # libpq rounds to whole seconds (at least 2); the real deadline is ours.
        "connect_timeout": max(2, math.ceil(timeout)),
        "client_encoding": "UTF8",
        "keepalives": 1,
        "keepalives_idle": 5,
        "keepalives_interval": 2,
        "keepalives_count": 3,
        "tcp_user_timeout": int(target.tcp_user_timeout * 1000),
    }
    # WARNING: libpq's default (prefer) sends a cleartext password over plain text when a
    # server, or whoever answers in its place, declines TLS: over a network, TLS or nothing.
    sslmode = network_sslmode(params)
    if sslmode:
        kwargs["sslmode"] = sslmode
    if not target._learned.get("no_options"):  # noqa: SLF001 - our own memo
        # The user's options (DSN, else PGOPTIONS) first: a later -c wins, so ours do.
        theirs = str(params.get("options") or os.environ.get("PGOPTIONS", ""))
        # The server splits options at spaces (a backslash keeps one in a value).
        ours = " ".join(
            f"-c {name}={value.replace(' ', chr(92) + ' ')}" for name, value in PINNED_SETTINGS
        )
        kwargs["options"] = f"{theirs} {ours}".strip()
    return kwargs


class _ConnectTimeoutError(Exception):
    """No connection within the deadline."""


class _Attempt:
    """One libpq connection attempt on a thread of its own, abandoned at the deadline.

    WARNING: libpq counts connect_timeout in whole seconds, at least 2, per address it
    tries: the deadline is only kept by not waiting for it. A connection that arrives after
    we gave up is closed by the thread itself.
    """

    def __init__(self, kwargs: dict[str, Any], dsn: str) -> None:
        self._kwargs = kwargs
        self._dsn = dsn
        self._lock = threading.Lock()
        self._abandoned = False
        self.done = threading.Event()
        self.conn: Connection | None = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            conn: Connection = psycopg.connect(self._dsn, **self._kwargs)
        except BaseException as exc:  # noqa: BLE001 - handed to the waiting thread
            self.error = exc
        else:
            with self._lock:
                if self._abandoned:
                    conn.close()
                else:
                    self.conn = conn
        self.done.set()

    def abandon(self) -> Connection | None:
        """Give up; return the connection if it arrived in the meantime after all."""
        with self._lock:
            self._abandoned = True
            conn, self.conn = self.conn, None
            return conn


def _connect_once(
    target: Target, params: dict[str, Any], app_name: str, deadline: float
) -> Connection:
    remaining = deadline - time.monotonic()
    if remaining <= 0:
        raise _ConnectTimeoutError
    attempt = _Attempt(_connection_kwargs(target, params, app_name, remaining), target.dsn)
    threads.start(attempt.run, name="jobrun-connect")
    try:
        finished = attempt.done.wait(min(remaining, SLOW_CONNECT))
        if not finished and target.on_slow_connect is not None:
            target.on_slow_connect()
        finished = finished or attempt.done.wait(max(0.0, deadline - time.monotonic()))
    finally:
        late = attempt.abandon()
    if late is not None:
        return late
    if not finished:
        raise _ConnectTimeoutError
    error = attempt.error
    if (
        isinstance(error, psycopg.Error)
        and re.search(_OPTIONS_UNSUPPORTED, str(error))
        and not target._learned.get("no_options")  # noqa: SLF001 - our own memo
    ):
        # A pooler that does not pass start-up options on: pin with SET instead.
        target._learned["no_options"] = True  # noqa: SLF001
        return _connect_once(target, params, app_name, deadline)
    if error is not None:
        raise error
    raise _ConnectTimeoutError  # pragma: no cover - done is set only with a result


def _pin_settings(conn: Connection) -> None:
    """SET the pinned settings when the session did not start with them: one round trip.

    The start-up options normally pin them; they can be dropped by a pooler (PgBouncer
    refuses or ignores ``options``) or overridden by libpq's own start-up parameters
    (PGDATESTYLE, PGTZ are sent after ``options``, and the later wins). The server reports
    these settings at start-up, so checking them costs nothing.
    """
    for name, accepted in _REPORTED.items():
        value = conn.info.parameter_status(name) or ""
        if isinstance(value, bytes):
            value = value.decode("utf-8", "replace")
        if value.split(",")[0].strip().lower() not in accepted:
            conn.execute(sql.PIN_SETTINGS)
            return


def cut(conn: Connection | None) -> None:
    """Shut ``conn``'s socket down under whoever waits on it (another thread): it fails now.

    The way out of a call that hangs on a silent network; never raises.
    """
    if conn is None or conn.closed:
        return
    # shutdown(2) acts on the socket, not the descriptor, so a duplicate will do.
    with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
        sock.shutdown(socket.SHUT_RDWR)
