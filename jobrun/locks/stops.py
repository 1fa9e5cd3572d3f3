"""A lock's check that also reads this run's ``jobrun stop`` request, where it can."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors

from jobrun import sql
from jobrun.history import schema

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from structlog.typing import FilteringBoundLogger

#: Without a readable stop requests' table, look for it again after this long (seconds).
STOP_TABLE_PROBE = 10.0

#: Longest wait of a heartbeat's statement for a table lock (seconds). WARNING: a history
#: call on the lock session waits for the heartbeat's statement to end and is cut as silent
#: 2 s past its own timeout: this keeps a heartbeat stuck behind a table lock well inside
#: that grace, and leaves room for the lock check alone right after it.
LOCK_WAIT_CAP = 0.5


def lock_wait(heartbeat: float) -> float:
    """How long one heartbeat statement may wait for a table lock: half an interval, capped.

    A table held by someone else (``LOCK TABLE``) must not hold the heartbeat past its own
    cadence: the lock check then goes on without the stop-request lookup.
    """
    return min(heartbeat / 2, LOCK_WAIT_CAP)


def bounded_row(
    conn: psycopg.Connection[Any],
    statement: str,
    params: Mapping[str, object],
    *,
    wait: float,
    prefix: str = "",
    lookup: bool = False,
) -> tuple[object, ...] | None:
    """``statement``'s row, sent in one message after a lock_timeout of ``wait`` local to it.

    lock_timeout must be in force before the statement is parsed (its tables are locked
    then): the setting is a statement of its own in the same message, bound on the client.
    ``lookup``: the statement reads the stop requests; on a connection whose schema was not
    checked yet, the (reader's) version check goes first in the same message, and fails
    where there is no schema, or an older one (StopProbe then goes on without the lookup).
    """
    check = schema.prefix(conn, writes=False) if lookup else ()
    # Bound on the client: a percent sign in the prefix (a host name) must be doubled.
    message = ";\n".join((prefix.replace("%", "%%") + sql.HEARTBEAT_LOCK_WAIT, *check, statement))
    cursor = psycopg.ClientCursor(conn)
    cursor.execute(message, {**params, "lock_wait": f"{max(1, round(wait * 1000))}ms"})
    for _ in range(1 + len(check)):
        cursor.nextset()
    row = cursor.fetchone()
    if check:
        schema.passed(conn, writes=False)
    return row


class StopProbe:
    """Sends a lock's check with the stop-request lookup, or, where that cannot work, alone.

    The lookup needs the stop requests' table, SELECT on it, and the table not locked by
    someone else. Without the table (no run with history and no ``jobrun stop`` here yet),
    without the privilege, or behind another session's lock for longer than the statement's
    lock_timeout, the check goes on alone, and tries the lookup again after
    STOP_TABLE_PROBE (a table created, a grant added, a lock gone).

    WARNING: only the lock check itself proves a loss. A refused or locked lookup must never
    count as a failed check: the lock is fine, and a role nobody granted the table to, or
    anyone able to lock it, would otherwise have every run stopped as lost.
    """

    def __init__(self, log: FilteringBoundLogger, describe: Callable[[Exception], str]) -> None:
        self._log = log
        self._describe = describe
        self._next = 0.0
        self._warned: set[str] = set()

    def check(
        self,
        with_lookup: Callable[[], tuple[object, ...] | None],
        alone: Callable[[], int],
    ) -> tuple[int, dict[str, object] | None]:
        """The count the check returns, and the stop request it read (or None).

        ``with_lookup`` runs the combined statement (its row: the count, then the request
        as JSON or NULL); ``alone`` the plain one. A failed statement ended its own
        transaction, so ``alone`` may follow it on the same connection.
        """
        refused = None
        if time.monotonic() >= self._next:
            try:
                row = with_lookup()
            except errors.InsufficientPrivilege as exc:
                refused = ("stop_requests_unreadable", self._describe(exc))
            except errors.LockNotAvailable as exc:
                # Our lock (lease mode: the lease table) or the stop requests' table: the
                # check alone tells which, and only it can count the lock lost.
                refused = ("stop_check_unavailable", self._describe(exc))
            except psycopg.Error as exc:
                if not schema.behind(exc):  # no schema yet (or an older one): later
                    raise
                self._next = time.monotonic() + STOP_TABLE_PROBE
            else:
                if row is None:
                    return 0, None
                request = None if row[1] is None else json.loads(str(row[1]))
                return int(str(row[0])), request
        count = alone()
        if refused is not None:
            # Blamed on the lookup only now that the check alone went through.
            self._refused(*refused)
        return count, None

    def _refused(self, event: str, error: str) -> None:
        self._next = time.monotonic() + STOP_TABLE_PROBE
        if event in self._warned:
            return
        self._warned.add(event)
        if event == "stop_requests_unreadable":
            note = (
                "jobrun stop cannot reach this run until this role is granted SELECT "
                "on jobrun.stop_requests; the lock itself is checked as usual"
            )
        else:
            note = (
                "the stop-request lookup waited in vain for a table another session has "
                "locked: jobrun stop cannot reach this run meanwhile; the lock itself is "
                "checked as usual and the run goes on"
            )
        self._log.warning(event, error=error, note=note)
