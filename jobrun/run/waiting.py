"""``--wait``: a run waiting for its lock says so, who holds it, and again at intervals."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import TYPE_CHECKING

from jobrun import threads

if TYPE_CHECKING:
    from collections.abc import Iterator

    from structlog.typing import FilteringBoundLogger

    from jobrun import db

#: A lock granted within this long is no wait worth a line (nor a second server session).
NOTICE_AFTER = 1.0


class WaitReporter:
    """While ``acquire`` waits: ``waiting_for_lock`` once, then ``still_waiting`` each interval.

    The holder is looked up on a short connection of the reporter's own (the lock's session
    is busy waiting), once per line. A lookup that fails costs the line its holder, never
    the run anything.
    """

    def __init__(
        self, label: str, target: db.Target, log: FilteringBoundLogger, *, interval: float
    ) -> None:
        self._label = label
        self._target = target
        self._log = log
        self._interval = interval

    @contextlib.contextmanager
    def around(self, wait: float) -> Iterator[None]:
        """Report while the body (the lock's ``acquire(wait)``) runs; nothing if wait is 0."""
        if wait <= 0:
            yield
            return
        done = threading.Event()
        # As every thread of ours, it must not run the main thread's signal handlers.
        threads.start(self._talk, wait, done, name="jobrun-wait")
        try:
            yield
        finally:
            done.set()  # not joined: a lookup under way must not delay the run

    def _talk(self, wait: float, done: threading.Event) -> None:
        started = time.monotonic()
        if done.wait(min(NOTICE_AFTER, self._interval)):
            return
        event = "waiting_for_lock"
        while True:
            holder = self._holder()
            if done.is_set():
                return
            waited = time.monotonic() - started
            self._log.info(
                event,
                wait=wait,
                waited=round(waited, 1),
                remaining=round(wait - waited, 1),
                **holder,
            )
            event = "still_waiting"
            if done.wait(self._interval):
                return

    def _holder(self) -> dict[str, object]:
        """``holder_*`` fields of whoever holds the key now (empty when it cannot be told)."""
        from jobrun import db  # noqa: PLC0415 - only a run that waits needs them
        from jobrun.locks.holders import holder_of  # noqa: PLC0415

        try:
            with db.connect(self._target, app_name="jobrun-wait") as conn:
                holder = holder_of(conn, self._label)
        except Exception as exc:  # noqa: BLE001 - a report never costs the run anything
            self._log.debug("wait_holder_unknown", error=db.one_line(exc, self._target))
            return {}
        return holder.fields() if holder is not None else {}
