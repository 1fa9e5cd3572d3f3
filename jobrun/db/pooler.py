"""The pooler probe: whether a transaction pooler stands between us and PostgreSQL."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobrun import sql

from .connecting import connect

if TYPE_CHECKING:
    from .connecting import Connection
    from .dsn import Target


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
