"""The heartbeat thread: keeps checking (or renewing) the lock and says when it is gone."""

from __future__ import annotations

import os
import time
from typing import TYPE_CHECKING

from jobrun import threads
from jobrun.exitcodes import LockLost, LockStoreUnavailable

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable

    from structlog.typing import FilteringBoundLogger

    from jobrun.db.server_session import ServerSession
    from jobrun.locks import Lock


class Watchdog:
    """Run ``lock.check()`` every ``interval`` seconds in a daemon thread.

    The supervisor reads two things: ``lost`` (a reason, once the lock is provably gone) and
    ``stop_at`` (the monotonic time by which the child must be told to stop unless a newer
    check succeeds). A check that fails without proof of loss - an error, a timeout, an
    answer that never came - does not move ``stop_at``: an ambiguous heartbeat counts as
    no heartbeat (a renewal whose answer was lost may or may not have happened).
    """

    def __init__(
        self,
        lock: Lock,
        session: ServerSession,
        *,
        interval: float,
        confirmed_at: float,
        wake: Callable[[], None],
        log: FilteringBoundLogger,
    ) -> None:
        self._lock = lock
        #: The run's session: waited on between checks, cut when a check hangs at the end.
        self._session = session
        self._interval = interval
        self._wake = wake
        self._log = log
        self.lost: str | None = None
        #: Who asked (``jobrun stop``) for this run to stop: the first request a check read.
        self.stop_request: dict[str, object] | None = None
        self.stop_at = confirmed_at + lock.confirmation_lifetime
        # The acquisition was the first confirmation: the first check is one interval later.
        self._first_check = confirmed_at + interval
        self._stop_r, self._stop_w = os.pipe()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Begin checking (every signal blocked in the thread: they are the supervisor's)."""
        self._thread = threads.start(self._loop, name="jobrun-heartbeat")

    def stop(self) -> None:
        """Stop checking; if a check hangs on a dead network, cut it short."""
        os.write(self._stop_w, b"x")
        thread = self._thread
        if thread is not None:
            thread.join(timeout=1.0)
            if thread.is_alive():
                # Per-renewal lease checks have a connection of their own (bounded by its
                # connect deadline and tcp_user_timeout); held and kept ones use the session's.
                if self._session.held or self._session.keeps:
                    self._session.cut()
                thread.join(timeout=2.0)
        os.close(self._stop_w)
        if thread is None or not thread.is_alive():
            os.close(self._stop_r)

    def lost_before_start(self) -> str | None:
        """Why the lock can no longer be vouched for (None: it can), asked before spawning."""
        if self.lost is not None:
            return self.lost
        # The lock session broke under another statement (a history call shares it): the
        # heartbeat would say so at its next check, but the child must not start meanwhile.
        known = self._lock.known_lost()
        if known is not None:
            return known
        if time.monotonic() >= self.stop_at:
            return "the lock could not be confirmed in time (no heartbeat answer)"
        return None

    def _stopping(self) -> bool:
        import select  # noqa: PLC0415 - only the heartbeat thread needs it

        return bool(select.select([self._stop_r], [], [], 0)[0])

    def _loop(self) -> None:
        failures = 0
        self._session.pause(self._first_check - time.monotonic(), self._stop_r)
        while not self._stopping():
            sent = time.monotonic()
            try:
                request = self._lock.check()
            except LockLost as exc:
                if not self._stopping():
                    self.lost = str(exc)
                    self._wake()
                return
            except LockStoreUnavailable as exc:
                failures += 1
                self._log.warning("heartbeat_failed", error=str(exc), failures=failures)
                # Retry sooner: the confirmation is running out.
                self._session.pause(self._interval / 2, self._stop_r)
                continue
            except Exception as exc:  # noqa: BLE001 - a broken heartbeat must stop the job
                self.lost = f"heartbeat crashed: {type(exc).__name__}: {exc}"
                self._wake()
                return
            if failures:
                self._log.info("heartbeat_recovered", failures=failures)
                failures = 0
            self.stop_at = sent + self._lock.confirmation_lifetime
            self._log.debug("lock_confirmed", valid_for=self._lock.confirmation_lifetime)
            if request is not None and self.stop_request is None:
                # The first request counts (who asked first); later ones change nothing.
                self.stop_request = request
                self._wake()
            self._session.pause(sent + self._interval - time.monotonic(), self._stop_r)
