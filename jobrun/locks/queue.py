"""``--coalesce``: when a key is held, one run waits as its queued run; later ones skip.

The queue slot is a lock of the run's mode on a second lock id derived from the key (a
second advisory lock in session mode, a second lease row in lease mode), so it is guarded
by PostgreSQL like the key itself: across hosts, and freed with the session (session mode)
or at its TTL (lease mode) when its run dies.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import psycopg
from psycopg import errors

from jobrun import db
from jobrun.exitcodes import LockLost
from jobrun.keys import Key, lock_id_for, names
from jobrun.locks import Holder, Taken
from jobrun.sql.queue import QUEUE_STOP_REQUEST

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from jobrun.db.server_session import ServerSession
    from jobrun.locks import Lock

#: How often a queued run tries the key again and looks for a stop request (seconds).
#: Session mode blocks on the key this long at a time (the server hands it over at once).
QUEUE_POLL = 1.0


def queue_lock_id(name: str) -> int:
    """The lock id of key ``name``'s queue slot.

    The lock id of the text ``name + "\\n" + "queue"`` (as ``jobrun key`` derives any lock
    id): no key name can contain a line feed, so no plain key ever shares it, and a slot's
    text (``name\\nslot N``, jobrun.locks.slots) is never this one (but for the 64-bit hash
    collisions any two names may have).
    """
    return lock_id_for(f"{name}\nqueue")


def queue_key(key: Key) -> Key:
    """The queue slot of ``key`` (a named key): its lock id, under the key's name.

    The name is the key's own: the history, the grants (``jobrun init``) and a lease row's
    ``key`` know the slot as the key's (``jobrun.ids_fit`` accepts the queue's id).
    """
    name = str(key.name)
    return Key(queue_lock_id(name), name)


@dataclass(frozen=True)
class QueueTaken(Holder):
    """The key is held and another run is already queued for it: skip, reason ``queued``."""

    skip_reason: ClassVar[str] = "queued"


@dataclass(frozen=True)
class QueueStopped(Holder):
    """``jobrun stop KEY`` while queued: leave without running, reason ``stop_requested``."""

    skip_reason: ClassVar[str] = "stop_requested"


class CoalesceLock:
    """A ``Lock`` on a key that queues one run when the key is held.

    ``acquire``: the key if free; else the queue slot (taken elsewhere: a ``QueueTaken``
    skip); then the key, tried every QUEUE_POLL until ``wait`` runs out (0: until its
    holder ends). Once the key is ours the slot is given back at once, so the next arrival
    may queue behind us. While queued, a ``jobrun stop KEY`` written since ends the wait
    (``QueueStopped``); a signal ends it as any wait (the slot goes with the session, or
    is deleted: lease mode).
    """

    def __init__(
        self,
        main: Lock,
        queue: Lock,
        session: ServerSession,
        key: Key,
        log: FilteringBoundLogger,
        *,
        lease: bool,
    ) -> None:
        self._main = main
        self._queue = queue
        self._session = session
        self._log = log
        self._lease = lease
        self._stop_keys = names((key,))
        self._label = key.label
        self._queued = False
        self._stop_lookup = True
        #: Seconds the run waited as the queued one (None: it did not queue).
        self.queued_seconds: float | None = None

    @property
    def confirmation_lifetime(self) -> float:
        """The key's lock's."""
        return self._main.confirmation_lifetime

    def acquire(self, wait: float) -> Taken | Holder:
        """The key, or queued for it, or a skip (see the class)."""
        got = self._main.acquire(0.0)
        if isinstance(got, Taken):
            return got
        try:
            queued = self._queue.acquire(0.0)
            if not isinstance(queued, Taken):
                return QueueTaken(**vars(got))
            self._queued = True
            started = time.monotonic()
            # The database's time now: stop requests from here on reach this run.
            since, _ = self._look(None)
            self._log.info("queued", wait=wait or None, **got.fields())
            got = self._wait(wait, since)
            self.queued_seconds = round(time.monotonic() - started, 3)
            if isinstance(got, Taken):
                self._log.info("dequeued", queued_seconds=self.queued_seconds)
            return got
        finally:
            # Taken or not, the slot goes: the next arrival may queue behind us.
            self._leave_queue(keep_ending=isinstance(got, Taken))

    def _wait(self, wait: float, since: object) -> Taken | Holder:
        """Try the key every QUEUE_POLL until ``wait`` is out (0: for ever).

        ``since``: the database's time when the run queued (None: unknown).
        """
        deadline = time.monotonic() + wait if wait > 0 else math.inf
        while True:
            remaining = deadline - time.monotonic()
            # Session mode blocks on the key for a poll; lease mode tries it once.
            got = self._main.acquire(0.0 if self._lease else max(0.0, min(QUEUE_POLL, remaining)))
            # Looked for once more when the key is ours: the holder a stop ended hands the
            # key over at once, maybe before this run's last look.
            since, request = self._look(since)
            if request is not None:
                self._log.warning(
                    "stop_requested",
                    queued=True,
                    **{f"requested_by_{name}": value for name, value in request.items()},
                )
                if isinstance(got, Taken):
                    self._main.release()
                    return QueueStopped(key=self._label)
                return QueueStopped(**vars(got))
            if isinstance(got, Taken):
                return got
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return got
            if self._lease:
                if not self._renew():
                    return QueueTaken(**vars(got))
                self._session.close()  # nothing is held open while we wait
                time.sleep(min(QUEUE_POLL, remaining))

    def _look(self, since: object) -> tuple[object, dict[str, object] | None]:
        """(the database's time, a stop request for the key written since ``since``)."""
        if not self._stop_lookup:
            return since, None
        conn = self._session.open()
        try:
            row = (
                psycopg.ClientCursor(conn)
                .execute(
                    self._session.comment.replace("%", "%%") + QUEUE_STOP_REQUEST,
                    {"stop_keys": self._stop_keys, "since": since},
                )
                .fetchone()
            )
        except (
            errors.UndefinedTable,
            errors.InvalidSchemaName,
            errors.InsufficientPrivilege,
        ) as exc:
            # No table yet (nobody ever asked), or not readable: a stop cannot reach the
            # queued run (a signal still can); the wait goes on.
            self._stop_lookup = False
            self._log.debug("queue_stop_lookup_off", error=db.one_line(exc, self._session.target))
            return since, None
        except psycopg.Error as exc:
            raise db.unavailable(exc, self._session.target, "waiting in the queue") from None
        if row is None:
            return since, None
        request = None if row[1] is None else json.loads(str(row[1]))
        return (row[0] if since is None else since), request

    def _renew(self) -> bool:
        """Lease mode: renew the queue slot's lease when due; False: it is someone else's.

        A slot whose lease expired under us (a stalled host) is taken again if still free.
        """
        try:
            self._queue.check()
        except LockLost as exc:
            self._log.warning("queue_slot_lost", reason=str(exc))
            self._queue.release()
            if not isinstance(self._queue.acquire(0.0), Taken):
                self._queued = False
                return False
        return True

    def _leave_queue(self, *, keep_ending: bool = False) -> None:
        """Give the queue slot back (nothing if we never held it).

        ``keep_ending``: the key is ours, and its release still rides with the run's last
        history message (session.carried_release; the slot's own release would otherwise
        withdraw it).
        """
        if not self._queued:
            return
        self._queued = False
        if keep_ending:
            with self._session.carried_release.kept():
                self._queue.release()
        else:
            self._queue.release()

    def check(self) -> dict[str, object] | None:
        """The key's lock's check."""
        return self._main.check()

    def known_lost(self) -> str | None:
        """The key's lock's."""
        return self._main.known_lost()

    def release(self) -> None:
        """Release the key (the queue slot went when the key was taken)."""
        self._leave_queue()
        self._main.release()
