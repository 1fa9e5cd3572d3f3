"""A lock's check that also reads this run's ``jobrun stop`` request, where it can."""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING

from psycopg import errors

if TYPE_CHECKING:
    from collections.abc import Callable

    from structlog.typing import FilteringBoundLogger

#: Without a readable stop requests' table, look for it again after this long (seconds).
STOP_TABLE_PROBE = 10.0


class StopProbe:
    """Sends a lock's check with the stop-request lookup, or, where that cannot work, alone.

    The lookup needs the stop requests' table and SELECT on it. Without the table (no run
    with history and no ``jobrun stop`` here yet) or without the privilege, the check goes
    on alone, and tries the lookup again after STOP_TABLE_PROBE (a table created, a grant
    added). WARNING: a refused lookup must never count as a failed check: the lock is fine,
    and a role nobody granted the table to would otherwise have every run stopped as lost.
    """

    def __init__(self, log: FilteringBoundLogger, describe: Callable[[Exception], str]) -> None:
        self._log = log
        self._describe = describe
        self._next = 0.0
        self._warned = False

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
            except errors.UndefinedTable:
                self._next = time.monotonic() + STOP_TABLE_PROBE
            except errors.InsufficientPrivilege as exc:
                refused = self._describe(exc)
            else:
                if row is None:
                    return 0, None
                request = None if row[1] is None else json.loads(str(row[1]))
                return int(str(row[0])), request
        count = alone()
        if refused is not None:
            # Blamed on the lookup only now that the check alone went through.
            self._refused(refused)
        return count, None

    def _refused(self, error: str) -> None:
        self._next = time.monotonic() + STOP_TABLE_PROBE
        if not self._warned:
            self._warned = True
            self._log.warning(
                "stop_requests_unreadable",
                error=error,
                note="jobrun stop cannot reach this run until this role is granted SELECT "
                "on jobrun.stop_requests; the lock itself is checked as usual",
            )
