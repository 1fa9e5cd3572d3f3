"""``--slots N``: the first free of N locks of one key, so at most N runs of it at once."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING

from jobrun.keys import Key, lock_id_for
from jobrun.locks import Taken

if TYPE_CHECKING:
    from jobrun.locks import Holder, Lock

#: The most slots a key may have (``status`` looks up this many lock ids per key).
MAX_SLOTS = 256
#: Longest pause between two rounds over the slots while ``--wait`` lasts.
_WAIT_POLL = 1.0


def slot_lock_id(name: str, slot: int) -> int:
    """The lock id of slot ``slot`` (0-based) of key ``name``.

    The lock id of the text ``name + "\\n" + "slot " + slot`` (as ``jobrun key`` derives any
    lock id): no key name can contain a line feed, so no plain key ever shares a slot's id
    (but for the 64-bit hash collisions any two names may have).
    """
    return lock_id_for(f"{name}\nslot {slot}")


def slot_keys(key: Key, slots: int) -> list[Key]:
    """Slot i of ``key`` (a named key): its lock id, under ``key``'s name (for logs, history)."""
    name = str(key.name)
    return [Key(slot_lock_id(name, i), name) for i in range(slots)]


class SlotLock:
    """A ``Lock`` over the first free of several locks, each tried in slot order.

    Each slot is a lock of the run's mode on the run's one session; once one is taken,
    every call goes to it, and ``acquire`` says which (``Taken.slot``).
    """

    def __init__(self, locks: list[Lock], lock_ids: list[int]) -> None:
        self._locks = locks
        self._lock_ids = lock_ids
        self._taken: Lock | None = None

    @property
    def _lock(self) -> Lock:
        return self._taken if self._taken is not None else self._locks[0]

    @property
    def confirmation_lifetime(self) -> float:
        """The taken slot's (before: the first slot's)."""
        return self._lock.confirmation_lifetime

    def acquire(self, wait: float) -> Taken | Holder:
        """Take the first free slot, trying all of them until ``wait`` runs out."""
        deadline = time.monotonic() + wait
        while True:
            holder = None
            for slot, lock in enumerate(self._locks):
                found = lock.acquire(0.0)
                if isinstance(found, Taken):
                    self._taken = lock
                    return replace(found, slot=(slot, self._lock_ids[slot]))
                holder = holder or found
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                assert holder is not None  # noqa: S101 - one slot at least, each held
                return holder
            time.sleep(min(_WAIT_POLL, remaining))

    def check(self) -> dict[str, object] | None:
        """Check (or renew) the taken slot; the stop request it read."""
        return self._lock.check()

    def known_lost(self) -> str | None:
        """Whether the taken slot is known to be lost."""
        return self._lock.known_lost()

    def release(self) -> None:
        """Release the taken slot (no other was kept)."""
        if self._taken is not None:
            self._taken.release()
