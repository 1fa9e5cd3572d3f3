"""Connecting to PostgreSQL the libpq way, and translating psycopg errors at this boundary."""

from __future__ import annotations

import contextlib
import math
import os
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import conninfo

from jobrun import sql
from jobrun.exitcodes import LockStoreUnavailable, UsageError

if TYPE_CHECKING:
    from collections.abc import Iterator

#: libpq's application_name limit (NAMEDATALEN - 1 bytes).
APPLICATION_NAME_BYTES = 63

_URI_PASSWORD = re.compile(r"(://[^:/@\s]*:)[^@\s]*@")
_QUOTED = re.compile(r'"[^"]*"')
_KV_PASSWORD = re.compile(r"(password\s*=\s*)('(?:[^'\\]|\\.)*'|\S+)", re.IGNORECASE)


def redact(text: str, secrets: tuple[str, ...] = ()) -> str:
    """Mask passwords in ``text``: URI userinfo, ``password=`` pairs, and any known secret."""
    text = _URI_PASSWORD.sub(r"\1***@", text)
    text = _KV_PASSWORD.sub(r"\1***", text)
    for secret in secrets:
        if secret:
            text = text.replace(secret, "***")
    return text


def application_name(label: str) -> str:
    """``jobrun:<label>`` trimmed to 63 bytes without splitting a UTF-8 character."""
    encoded = f"jobrun:{label}".encode()[:APPLICATION_NAME_BYTES]
    return encoded.decode("utf-8", "ignore")


@dataclass(frozen=True)
class Target:
    """Where and how to connect: a DSN (or libpq defaults) plus jobrun's session settings."""

    dsn: str = ""
    connect_timeout: float = 10.0
    #: Seconds of unacknowledged sends after which the kernel drops the connection.
    tcp_user_timeout: float = 10.0

    @property
    def secrets(self) -> tuple[str, ...]:
        """The password in the DSN, if any: never to be shown."""
        password = parse_dsn(self.dsn).get("password")
        return (str(password),) if password else ()

    @property
    def has_password(self) -> bool:
        """Whether the DSN itself carries a password (visible in ``ps`` when given as a flag)."""
        return bool(self.secrets)


def parse_dsn(dsn: str) -> dict[str, Any]:
    """The DSN's parameters, or UsageError (with passwords masked) when it does not parse."""
    try:
        return conninfo.conninfo_to_dict(dsn)
    except psycopg.ProgrammingError as exc:
        # WARNING: libpq quotes the part it could not parse, and that may be the password.
        detail = _QUOTED.sub('"***"', redact(str(exc)))
        raise UsageError(f"--dsn/JOBRUN_DSN is not a valid connection string: {detail}") from None


def describe(target: Target) -> str:
    """``host:port/dbname`` as far as the DSN says: safe to log (no user, no password)."""
    params = parse_dsn(target.dsn)
    env = os.environ
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
    return f"{host}:{port}/{dbname}"


def connect(target: Target, *, app_name: str) -> psycopg.Connection[tuple[object, ...]]:
    """An autocommit connection with keepalives, a connect timeout and a bounded send queue.

    WARNING: autocommit is essential: a lock session left "idle in transaction" would be
    killed by ``idle_in_transaction_session_timeout`` and take the lock with it.
    """
    try:
        return psycopg.connect(
            target.dsn,
            autocommit=True,
            # Poolers in transaction mode cannot keep prepared statements.
            prepare_threshold=None,
            application_name=app_name,
            connect_timeout=max(1, math.ceil(target.connect_timeout)),
            keepalives=1,
            keepalives_idle=5,
            keepalives_interval=2,
            keepalives_count=3,
            tcp_user_timeout=int(target.tcp_user_timeout * 1000),
        )
    except psycopg.Error as exc:
        raise LockStoreUnavailable(
            f"cannot connect to {describe(target)}: {one_line(exc, target)}"
        ) from None


def one_line(exc: BaseException, target: Target | None = None) -> str:
    """An exception as one line with passwords masked."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return redact(text, target.secrets if target else ())


@contextlib.contextmanager
def translate_errors(target: Target, doing: str) -> Iterator[None]:
    """Turn psycopg errors raised while ``doing`` something into LockStoreUnavailable."""
    try:
        yield
    except psycopg.Error as exc:
        raise LockStoreUnavailable(f"{doing}: {one_line(exc, target)}", reason="error") from None


def detect_transaction_pooler(
    conn: psycopg.Connection[tuple[object, ...]], target: Target, *, app_name: str
) -> str | None:
    """Return why we believe a transaction/statement pooler sits between us and Postgres.

    A direct connection (or a plain TCP proxy) reports the same backend pid in the protocol
    handshake as ``pg_backend_pid()`` does; poolers such as PgBouncer invent their own. Only
    then do we spend a second connection: if it lands on the same server backend as ours
    while we sit idle, two clients share one backend - transaction pooling, where a session
    lock would be stranded on a backend we no longer talk to (PITFALLS 1).
    """
    first = backend_pid(conn)
    if conn.info.backend_pid == first:
        return None
    with connect(target, app_name=app_name) as probe:
        if backend_pid(probe) == first:
            return "a second connection was served by our backend (transaction pooling)"
    if backend_pid(conn) != first:
        return "our statements ran on different backends (transaction pooling)"
    return None


def backend_pid(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    """The server backend that ran this statement."""
    row = conn.execute(sql.BACKEND_PID).fetchone()
    assert row is not None  # noqa: S101 - a SELECT of one value always returns a row
    return int(str(row[0]))
