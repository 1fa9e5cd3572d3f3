"""Connecting to PostgreSQL the libpq way, and translating psycopg errors at this boundary."""

from __future__ import annotations

import contextlib
import math
import os
import random
import re
import signal
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

import psycopg
from psycopg import conninfo
from psycopg.adapt import AdaptersMap, Dumper

from jobrun import sql
from jobrun.exitcodes import TLS, LockStoreUnavailable, UsageError
from jobrun.log import safe_text
from jobrun.masking import forms, mask_text

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

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

_URI_PREFIXES = ("postgresql://", "postgres://")
#: Any URI's scheme (``postgresql+psycopg``, ``jdbc:postgresql``): safe to name in an error.
_SCHEME = r"[A-Za-z][A-Za-z0-9+.-]*(?::[A-Za-z][A-Za-z0-9+.-]*)*(?=://)"
#: libpq's hosts of a URI: ``host[:port]`` (IPv6 in brackets), comma-separated.
_URI_HOSTS = r"(?:\[[^\]]*\]|[^:,\[\]]*)(?::[0-9]*)?(?:,(?:\[[^\]]*\]|[^:,\[\]]*)(?::[0-9]*)?)*"
# The patterns below are used on error paths only: plain strings, compiled (and cached by
# ``re``) the first time they are needed, not at every start of a run.
#: The position PostgreSQL adds under a statement's error ("LINE 4: FROM jobrun.runs", then a
#: line with a caret): jobrun's own SQL, which tells a user nothing.
_ERROR_POSITION = r"\nLINE \d+: [^\n]*\n[ \t]*\^[^\n]*"
_QUOTED = r'"[^"]*"'

# libpq (or psycopg) rejected a value in the connection string itself: a usage error.
_BAD_OPTION = (
    r"(?i)invalid (?:integer |port |connection option|\S+ value)"
    r"|could not match \d+ (?:host names|port numbers)"
    r"|bad value for connect_timeout"
    r"|unrecognized (?:\S+ )?(?:value|option)"
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
_TLS = (
    r"(?i)certificate verify failed|does not match host name|server certificate for"
    r"|does not support SSL|root certificate file|certificate present, but not private key"
    r"|could not (?:load|read|open) (?:SSL )?(?:certificate|private key|root certificate)"
    r"|private key file|SSL error: (?!unexpected eof)|tlsv1 alert|sslv3 alert"
    r"|wrong version number"
)
# PgBouncer (before 1.20) refuses any start-up parameter it does not track.
_OPTIONS_UNSUPPORTED = r"(?i)unsupported startup parameter: options"

#: First and longest pause between two attempts at a busy server (jittered).
_FIRST_BACKOFF = 0.05
_MAX_BACKOFF = 1.0


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """Mask passwords in ``text``: URI userinfo, ``password=`` pairs, and known secrets.

    Known secrets are masked where they stand as a value (quoted, after ``=`` or ``:``,
    before ``@``), never inside other words: a one-letter password must not garble text.
    """
    return mask_text(text, secrets)


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


@dataclass(frozen=True)
class Target:
    """Where and how to connect: a DSN (or libpq defaults) plus jobrun's session settings."""

    dsn: str = ""
    connect_timeout: float = 10.0
    #: Seconds of unacknowledged sends after which the kernel drops the connection.
    tcp_user_timeout: float = 10.0
    #: What this process learned about the server path (a pooler refusing ``options``).
    _learned: dict[str, bool] = field(default_factory=dict, compare=False, repr=False)
    #: Called once per attempt that has had no answer for SLOW_CONNECT seconds (a server
    #: that accepts and never answers would otherwise mean --connect-timeout of silence).
    on_slow_connect: Callable[[], None] | None = field(default=None, compare=False, repr=False)

    @property
    def secrets(self) -> tuple[str, ...]:
        """The DSN's password (and PGPASSWORD), in every form an error may quote: never shown."""
        passwords = [str(parse_dsn(self.dsn).get("password") or ""), *_uri_passwords(self.dsn)]
        passwords.append(os.environ.get("PGPASSWORD", ""))
        # Also URL-encoded: a job that builds its own URI from them prints them that way.
        return tuple(dict.fromkeys(form for secret in passwords for form in forms(secret)))

    @property
    def has_password(self) -> bool:
        """Whether the DSN itself carries a password (visible in ``ps`` when given as a flag)."""
        return bool(parse_dsn(self.dsn).get("password")) or bool(_uri_passwords(self.dsn))


def _uri_passwords(dsn: str) -> list[str]:
    """The password of a URI as typed (and each piece of it around a raw ``@``).

    Any scheme: a driver-qualified ``postgresql+psycopg://`` is refused, but its password
    must not show in the meantime. The userinfo ends where libpq ends it, at the last
    ``@`` before the first ``/``.
    """
    if re.match(_SCHEME, dsn) is None:
        return []
    authority = dsn.split("://", 1)[1].split("/", 1)[0]
    userinfo, at, _ = authority.rpartition("@")
    if not at or ":" not in userinfo:
        return []
    raw = userinfo.split(":", 1)[1]
    pieces = [raw, unquote(raw), *raw.split("@")]
    return [piece for piece in dict.fromkeys(pieces) if piece]


def parse_dsn(dsn: str) -> dict[str, Any]:
    """The DSN's parameters, or UsageError (with passwords masked) when it does not parse."""
    if safe_text(dsn) != dsn:
        raise UsageError(
            "--dsn/JOBRUN_DSN contains bytes that are not UTF-8 (check the locale or the file "
            "it came from)"
        )
    _check_uri(dsn)
    try:
        params = conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        # WARNING: libpq quotes the part it could not parse, and that may be the password.
        detail = redact(" ".join(str(exc).split()), tuple(_uri_passwords(dsn)))
        detail = re.sub(_QUOTED, lambda m: _quoted_fragment(m.group(0), dsn), detail)
        raise UsageError(f"--dsn/JOBRUN_DSN is not a valid connection string: {detail}") from None
    if dsn.startswith(_URI_PREFIXES) and "@" in str(params.get("host") or ""):
        raise UsageError(
            "--dsn/JOBRUN_DSN: the URI has more than one '@' before the host; an '@' inside "
            "the user name or password must be written %40"
        )
    return params


def _check_uri(dsn: str) -> None:
    """UsageError for a URI libpq would misread or not take; the message shows no part of it.

    Driver-qualified URIs (SQLAlchemy's ``postgresql+psycopg://``, JDBC's
    ``jdbc:postgresql://``) are refused rather than rewritten: their query parameters are
    the driver's, not libpq's, and a guess could connect somewhere else than meant.
    """
    scheme = re.match(_SCHEME, dsn)
    if scheme is None:
        return
    if not dsn.startswith(_URI_PREFIXES):
        name = scheme.group(0)
        if "postgres" not in name.lower():
            raise UsageError(
                f"--dsn/JOBRUN_DSN: a {name}:// URI is not a PostgreSQL connection string "
                "(postgresql://... or host=... dbname=...)"
            )
        raise UsageError(
            f"--dsn/JOBRUN_DSN: {name}:// is a driver's URL, not libpq's: write it "
            "postgresql://... (as psql takes it), without the driver's query parameters"
        )
    rest = dsn.split("://", 1)[1]
    hosts, slash, path = rest.partition("/")
    if "@" in hosts or not slash:
        return
    database = path.split("?", 1)[0]
    if "@" in database or ("@" in path and re.fullmatch(_URI_HOSTS, hosts) is None):
        # libpq ends the user name and password at the first "/": it would take the
        # password for a port and the rest for the database name, and show them.
        raise UsageError(
            "--dsn/JOBRUN_DSN: the URI has an '@' after a '/': a '/' inside the user name "
            "or password must be written %2F (and an '@' in a database name %40)"
        )


def _quoted_fragment(quoted: str, dsn: str) -> str:
    """A fragment libpq quoted from the DSN: kept unless it could hold the password."""
    fragment = quoted[1:-1]
    risky = "password" in dsn.lower() or bool(_uri_passwords(dsn))
    if risky and fragment and fragment not in ("=", "'") and not _is_keyword(fragment):
        return '"***"'
    return quoted


def _is_keyword(word: str) -> bool:
    return bool(re.fullmatch(r"[a-z_]+", word)) and word != "password"


def describe(target: Target) -> str:
    """``host:port/dbname`` as far as the DSN says: safe to log (no user, no password)."""
    params = parse_dsn(target.dsn)
    env = os.environ
    service = params.get("service") or env.get("PGSERVICE")
    if service and not (params.get("host") or params.get("hostaddr")):
        # The address is in a service file: say which service, rather than guess a socket.
        return redact(safe_text(f"service {service}"), target.secrets)
    # As libpq resolves them: the DSN, then the PG* variables, then its built-in defaults.
    host = params.get("host") or params.get("hostaddr") or env.get("PGHOST") or "local socket"
    port = params.get("port") or env.get("PGPORT") or "5432"
    dbname = (
        params.get("dbname")
        or env.get("PGDATABASE")
        or params.get("user")
        or env.get("PGUSER")
        or "(default database)"
    )
    return redact(safe_text(f"{host}:{port}/{dbname}"), target.secrets)


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
            raise LockStoreUnavailable(
                f"cannot connect to {describe(target)}: {text}", reason=classify(text)
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
    thread = threading.Thread(target=attempt.run, name="jobrun-connect", daemon=True)
    # WARNING: a signal delivered to a thread runs the main thread's Python handler at once,
    # even while the main thread blocks that signal (a guarded child runs): the thread
    # inherits a mask that blocks every signal, so they all stay with the main thread.
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
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


def one_line(exc: BaseException, target: Target | None = None) -> str:
    """An exception as one line with passwords masked (and without the SQL's position)."""
    text = re.sub(_ERROR_POSITION, "", str(exc))
    text = " ".join(safe_text(text).split()) or type(exc).__name__
    return redact(text, target.secrets if target else ())


def unavailable(exc: BaseException, target: Target, doing: str = "") -> LockStoreUnavailable:
    """The LockStoreUnavailable for a psycopg error raised while ``doing`` something.

    The one place a database error becomes jobrun's: the message is one line with the
    secrets masked; a rollback that could not be sent (the session died mid-transaction)
    is a database error like any other.
    """
    if isinstance(exc, psycopg.Rollback):
        text = "the session broke before its transaction could be rolled back"
    else:
        text = one_line(exc, target)
    return LockStoreUnavailable(f"{doing}: {text}" if doing else text, reason="error")


@contextlib.contextmanager
def translate_errors(target: Target, doing: str) -> Iterator[None]:
    """Turn psycopg errors raised while ``doing`` something into LockStoreUnavailable.

    WARNING: ``psycopg.Rollback`` is not a ``psycopg.Error``; it escapes a transaction
    block when the ROLLBACK itself fails on a dead connection, and is caught here too.
    """
    try:
        yield
    except (psycopg.Error, psycopg.Rollback) as exc:
        raise unavailable(exc, target, doing) from None


def detect_transaction_pooler(
    conn: Connection, target: Target, *, app_name: str, backend: int | None = None
) -> str | None:
    """Return why we believe a transaction/statement pooler sits between us and Postgres.

    A direct connection (or a plain TCP proxy) reports the same backend pid in the protocol
    handshake as ``pg_backend_pid()`` does; poolers such as PgBouncer invent their own. Only
    then do we spend a second connection: if it lands on the same server backend as ours
    while we sit idle, two clients share one backend - transaction pooling, where a session
    lock would be stranded on a backend we no longer talk to. ``backend`` is
    ``pg_backend_pid()`` if the caller has asked already.
    """
    first = backend_pid(conn) if backend is None else backend
    if conn.info.backend_pid == first:
        return None
    with connect(target, app_name=app_name) as probe:
        if backend_pid(probe) == first:
            return "a second connection was served by our backend (transaction pooling)"
    if backend_pid(conn) != first:
        return "our statements ran on different backends (transaction pooling)"
    return None


def backend_pid(conn: Connection) -> int:
    """The server backend that ran this statement."""
    row = conn.execute(sql.BACKEND_PID).fetchone()
    assert row is not None  # noqa: S101 - a SELECT of one value always returns a row
    return int(str(row[0]))
