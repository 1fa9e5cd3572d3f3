"""The schema at work: each connection's version check, the upgrade, a schema too new.

The statements are in jobrun/sql/schema.py (the schema's one owner); this is what a
command does with them. A connection's first message starts with the version check
(``prefix``: no round trip of its own); where the check says the database lacks steps
(SCHEMA_BEHIND: no schema yet, or an older one), ``ensure`` runs them and the message is
sent again; where a newer jobrun's steps forbid this one to write (SCHEMA_AHEAD), the
command is refused (``SchemaTooNew``: exit 69, reason ``schema_too_new``). A connection
whose check went through is not checked again. This module is the one place that knows
what a missing schema looks like: callers see ``SchemaTooNew``, or None from ``guarded``.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, TypeVar

import psycopg

from jobrun.exitcodes import SCHEMA_TOO_NEW, LockStoreUnavailable
from jobrun.sql import schema as schema_sql

if TYPE_CHECKING:
    from collections.abc import Callable

    Connection = psycopg.Connection[Any]

T = TypeVar("T")

#: Connections whose version check went through (or that ran the upgrade themselves).
_checked: weakref.WeakSet[Connection] = weakref.WeakSet()
#: Of those, the ones that may also write (their check was CHECK_WRITE's).
_writable: weakref.WeakSet[Connection] = weakref.WeakSet()


class SchemaTooNew(LockStoreUnavailable):
    """A newer jobrun upgraded the schema past what this one may write: upgrade jobrun."""

    def __init__(self, version: int, compatible_from: int) -> None:
        super().__init__(
            f"the jobrun schema of this database is version {version}, which a jobrun that "
            f"knows a version before {compatible_from} may not write (this one knows "
            f"{schema_sql.VERSION}): upgrade jobrun on this host",
            reason=SCHEMA_TOO_NEW,
        )
        self.version = version
        self.compatible_from = compatible_from


#: The writers' check, always (a probe that must not trust what a connection passed).
CHECK_WRITE_ONLY = (schema_sql.CHECK_WRITE,)


def prefix(conn: Connection, *, writes: bool = True) -> tuple[str, ...]:
    """The version check to start ``conn``'s next message with (none once it went through)."""
    if conn in (_writable if writes else _checked):
        return ()
    return (schema_sql.CHECK_WRITE if writes else schema_sql.CHECK_READ,)


def passed(conn: Connection, *, writes: bool = True) -> None:
    """``conn``'s message with the check went through: not checked again."""
    _checked.add(conn)
    if writes:
        _writable.add(conn)


def behind(exc: BaseException) -> bool:
    """Whether ``exc`` is the check saying the database lacks steps (none, or older)."""
    return isinstance(exc, psycopg.Error) and exc.sqlstate == schema_sql.SCHEMA_BEHIND


def absent(exc: BaseException) -> bool:
    """Whether ``exc`` is the check saying there is no jobrun schema at all."""
    return isinstance(exc, psycopg.Error) and behind(exc) and _detail(exc) == "absent"


def too_new(exc: BaseException) -> SchemaTooNew | None:
    """The refusal ``exc`` is, where it is the check's SCHEMA_AHEAD (else None)."""
    if not (isinstance(exc, psycopg.Error) and exc.sqlstate == schema_sql.SCHEMA_AHEAD):
        return None
    version, _, compatible_from = _detail(exc).partition(" ")
    return SchemaTooNew(int(version), int(compatible_from))


def _detail(exc: psycopg.Error) -> str:
    return exc.diag.message_detail or ""


def ensure(
    conn: Connection, *, timeout_ms: int = 5000, writes: bool = True, remember: bool = True
) -> tuple[int, int]:
    """Run the steps the database lacks (one message); its (version, compatible_from).

    Fifty first runs at once make the schema once: the message takes the schema's advisory
    transaction lock first. Raises SchemaTooNew (``writes``) where a newer jobrun's steps
    forbid this one to write; an error rolls everything back (the connection is never left
    inside a transaction). ``remember``: False where the caller rolls it back (doctor).
    """
    cursor = psycopg.ClientCursor(conn)
    cursor.execute(schema_sql.upgrade_message(timeout_ms))
    while cursor.nextset():
        pass
    row = cursor.fetchone()
    version, compatible_from = (int(row[0]), int(row[1])) if row else (0, 0)
    if writes and compatible_from > schema_sql.VERSION:
        raise SchemaTooNew(version, compatible_from)
    if remember:
        passed(conn, writes=writes)
    return version, compatible_from


def guarded(
    conn: Connection,
    attempt: Callable[[tuple[str, ...]], T],
    *,
    writes: bool = True,
    timeout_ms: int = 5000,
    anyway: bool = False,
) -> T:
    """``attempt(check)``, whose message starts with ``check``; the schema made if needed.

    Where the check says the database lacks steps, ``ensure`` runs them and ``attempt`` is
    sent again, without the check. SCHEMA_AHEAD is SchemaTooNew. ``anyway``: where this
    role may not run the steps (another role owns the tables), ``attempt`` is sent all the
    same (the lock: its table is in every version; the history then says why it failed).
    WARNING: ``attempt`` must send ``check`` first in the same message (bound on the
    client: one implicit transaction), so that nothing after it runs on a schema it does
    not know.
    """
    found = _guarded(
        conn, attempt, writes=writes, create=True, timeout_ms=timeout_ms, anyway=anyway
    )
    assert found is not None  # noqa: S101 - create=True: never None
    return found[0]


def readable(
    conn: Connection, attempt: Callable[[tuple[str, ...]], T], *, timeout_ms: int = 5000
) -> T | None:
    """As ``guarded`` for a command that only reads: None where there is no schema at all.

    A reader never refuses a newer schema (steps never drop or rename what an older jobrun
    reads), and never makes an absent one; an older one is brought up to date (a role that
    may not do that gets the server's refusal).
    """
    found = _guarded(conn, attempt, writes=False, create=False, timeout_ms=timeout_ms)
    return None if found is None else found[0]


def _guarded(
    conn: Connection,
    attempt: Callable[[tuple[str, ...]], T],
    *,
    writes: bool,
    create: bool,
    timeout_ms: int,
    anyway: bool = False,
) -> tuple[T] | None:
    check = prefix(conn, writes=writes)
    try:
        found = attempt(check)
    except psycopg.Error as exc:
        refused = too_new(exc)
        if refused is not None:
            raise refused from None
        if not behind(exc):
            raise
        if not create and absent(exc):
            return None
        try:
            ensure(conn, timeout_ms=timeout_ms, writes=writes)
        except SchemaTooNew:
            raise
        except psycopg.Error:
            if not anyway:
                raise
        return (attempt(()),)
    if check:
        passed(conn, writes=writes)
    return (found,)


def results(
    conn: Connection, message: str, params: dict[str, Any] | None = None
) -> list[list[tuple[Any, ...]]]:
    """Each result set of ``message`` (bound on the client, as one message), in order."""
    cursor = psycopg.ClientCursor(conn)
    cursor.execute(message, params)
    found = [cursor.fetchall() if cursor.description else []]
    while cursor.nextset():
        found.append(cursor.fetchall() if cursor.description else [])
    return found
