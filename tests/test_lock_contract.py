"""One contract over every Lock: the in-memory one of the fast tests and the two real modes.

The same tests run against ``memory`` (no server: in the ``-m "not pg"`` tier), ``session``
and ``lease`` (the test server): the fake cannot drift from what the real locks do.
"""

from __future__ import annotations

import itertools
import time
from typing import TYPE_CHECKING, Protocol

import psycopg
import pytest
import structlog

from harness.memory import MemoryLock, MemoryStore
from harness.pgtools import terminate_backend
from jobrun import db, keys
from jobrun.db.server_session import ServerSession
from jobrun.exitcodes import LockLost, LockStoreUnavailable
from jobrun.history import schema
from jobrun.locks import Holder, Identity, Lock, Taken, new_run_id, slots
from jobrun.locks.lease import LeaseLock
from jobrun.locks.session import SessionLock, holder_comment

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Pids the locks claim to run as: each lock its own, so a holder names the right one.
_PIDS = itertools.count(40_001)


class Locks(Protocol):
    """Locks of one mode over one store, as separate runs would hold them."""

    def make(self, *names: str) -> tuple[Lock, Identity]:
        """A new lock on the keys ``names`` (not yet acquired), and who it runs as."""
        ...

    def take_away(self, name: str) -> None:
        """Lose key ``name`` under its holder, as this mode loses a lock in real life."""
        ...


def _identity() -> Identity:
    return Identity(run_id=new_run_id(), pid=next(_PIDS))


class MemoryLocks:
    """MemoryLocks over one MemoryStore."""

    def __init__(self) -> None:
        self.store = MemoryStore()

    def make(self, *names: str) -> tuple[Lock, Identity]:
        identity = _identity()
        lock_keys = tuple(keys.from_name(name) for name in names)
        return MemoryLock(lock_keys, self.store, identity), identity

    def take_away(self, name: str) -> None:
        self.store.take_away(keys.lock_id_for(name))

    def close(self) -> None:
        """Nothing to close: the store goes with the test."""


class ServerLocks:
    """SessionLocks or LeaseLocks, each over a ServerSession of its own, as a run has."""

    def __init__(self, mode: str, dsn: str) -> None:
        self.mode = mode
        self.dsn = dsn
        self._made: list[tuple[Lock, ServerSession]] = []

    def make(self, *names: str) -> tuple[Lock, Identity]:
        identity = _identity()
        lock_keys = tuple(keys.from_name(name) for name in names)
        target = db.Target(dsn=self.dsn)
        log = structlog.get_logger()
        lock: Lock
        if self.mode == "session":
            session = ServerSession(
                target, app_name="jobrun:test", held=True, comment=holder_comment(identity)
            )
            lock = SessionLock(lock_keys, session, identity, log, heartbeat=1.0, kill_after=10.0)
        elif self.mode == "lease":
            session = ServerSession(target, app_name="jobrun:test", held=False)
            lock = LeaseLock(
                lock_keys, session, identity, log, ttl=60.0, lifetime=20.0, heartbeat=1.0
            )
        else:
            # A run's kept connection, a beat a second, a renewal every 5 s: a check right
            # after the acquisition renews nothing, it sees whether the leases are still ours.
            session = ServerSession(target, app_name="jobrun:test", held=False, keeps=True)
            lock = LeaseLock(
                lock_keys, session, identity, log, ttl=60.0, lifetime=20.0, heartbeat=1.0,
                renew_every=5.0,
            )  # fmt: skip
        self._made.append((lock, session))
        return lock, identity

    def take_away(self, name: str) -> None:
        lock_id = keys.lock_id_for(name)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            if self.mode == "session":
                classid, objid = keys.from_name(name).pg_locks_pair
                row = conn.execute(
                    "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
                    "AND classid = %s::int8::oid AND objid = %s::int8::oid AND objsubid = 1",
                    (classid, objid),
                ).fetchone()
                assert row is not None, "nobody holds the key"
                # Waits (up to 10 s) until the backend is gone: the lock with it.
                terminate_backend(conn, row[0], 10.0)
            else:
                conn.execute("DELETE FROM jobrun.leases WHERE lock_id = %s", (lock_id,))

    def close(self) -> None:
        """Release every lock made and close its session (as each run would)."""
        for lock, session in self._made:
            lock.release()
            session.close()


@pytest.fixture(
    params=[
        "memory",
        # Explicitly: the server is asked for with getfixturevalue, unseen at collection.
        pytest.param("session", marks=pytest.mark.pg),
        pytest.param("lease", marks=pytest.mark.pg),
        pytest.param("lease-kept", marks=pytest.mark.pg),
    ]
)
def locks(request: pytest.FixtureRequest) -> Iterator[MemoryLocks | ServerLocks]:
    """A factory of locks of one mode (memory, session, lease, lease-kept) over one store."""
    made: MemoryLocks | ServerLocks
    if request.param == "memory":
        made = MemoryLocks()
    else:
        made = ServerLocks(request.param, request.getfixturevalue("dsn"))
    try:
        yield made
    finally:
        made.close()


@pytest.fixture
def names(key: str) -> tuple[str, str]:
    """Two key names no other test uses."""
    return f"{key}-a", f"{key}-b"


class TestAcquire:
    """A free key is taken; a held one is not, and its holder is named."""

    def test_a_free_key_is_acquired(self, locks, names):
        """acquire on a free key returns None: held (and checks fine)."""
        lock, _ = locks.make(names[0])
        assert isinstance(lock.acquire(0), Taken)
        lock.check()

    def test_a_held_key_is_not_acquired_and_names_its_holder(self, locks, names):
        """A second lock on a held key gets the holder back: its host, pid and run id."""
        first, who = locks.make(names[0])
        assert isinstance(first.acquire(0), Taken)
        second, _ = locks.make(names[0])
        holder = second.acquire(0)
        assert isinstance(holder, Holder)
        assert (holder.host, holder.pid, holder.run_id) == (who.host, who.pid, who.run_id)

    def test_a_released_key_is_acquired_by_the_next(self, locks, names):
        """Once the holder releases, the second lock gets the key."""
        first, _ = locks.make(names[0])
        second, _ = locks.make(names[0])
        assert isinstance(first.acquire(0), Taken)
        assert isinstance(second.acquire(0), Holder)
        first.release()
        assert isinstance(second.acquire(0), Taken)

    def test_several_keys_are_taken_all_or_none(self, locks, names):
        """A lock on [a, b] while b is held elsewhere: not acquired, and a is left free."""
        a, b = names
        other, _ = locks.make(b)
        assert isinstance(other.acquire(0), Taken)
        both, _ = locks.make(a, b)
        holder = both.acquire(0)
        assert isinstance(holder, Holder)
        assert holder.key == b
        alone, _ = locks.make(a)
        assert isinstance(alone.acquire(0), Taken)

    def test_taken_says_when_the_lock_was_confirmed(self, locks, names):
        """Taken.confirmed_at lies within the acquisition (sent or completed); no slot."""
        lock, _ = locks.make(names[0])
        before = time.monotonic()
        taken = lock.acquire(0)
        after = time.monotonic()
        assert isinstance(taken, Taken)
        assert before <= taken.confirmed_at <= after
        assert taken.slot is None

    def test_the_first_free_slot_is_taken_and_named(self, locks, names):
        """SlotLock over two locks (a slot each), the first held elsewhere: slot 1, its id."""
        ids = [keys.lock_id_for(name) for name in names]
        elsewhere, _ = locks.make(names[0])
        assert isinstance(elsewhere.acquire(0), Taken)
        lock = slots.SlotLock([locks.make(name)[0] for name in names], ids)
        taken = lock.acquire(0)
        assert isinstance(taken, Taken)
        assert taken.slot == (1, ids[1])
        assert lock.check() is None
        full = slots.SlotLock([locks.make(name)[0] for name in names], ids)
        assert isinstance(full.acquire(0), Holder)
        lock.release()
        assert isinstance(full.acquire(0), Taken)


class TestStopRequest:
    """``check`` returns the ``jobrun stop`` request for the run it read (None: none)."""

    def test_check_returns_the_request_for_this_run(self, locks, names):
        """No request: None; one written for the run's id and key: every check returns it."""
        if not isinstance(locks, ServerLocks):
            pytest.skip("no jobrun stop request reaches a memory lock")
        with psycopg.connect(locks.dsn, autocommit=True) as conn:
            schema.ensure(conn)
        lock, who = locks.make(names[0])
        assert isinstance(lock.acquire(0), Taken)
        assert lock.check() is None
        with psycopg.connect(locks.dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO jobrun.stop_requests (run_id, key, host, username, pid, reason) "
                "VALUES (%s, %s, 'h', session_user, 1, 'contract')",
                (who.run_id, names[0]),
            )
        request = lock.check()
        assert request is not None
        assert request["reason"] == "contract"
        assert lock.check() == request  # a read consumes nothing: the watchdog keeps the first


class TestLoss:
    """A lock taken away is noticed at the next check; release never raises."""

    def test_a_lock_taken_away_fails_its_check(self, locks, names):
        """Taken away (backend terminated, lease deleted, memory freed): check raises LockLost."""
        lock, _ = locks.make(names[0])
        assert isinstance(lock.acquire(0), Taken)
        locks.take_away(names[0])
        with pytest.raises(LockLost):
            lock.check()

    def test_one_key_of_several_taken_away_fails_the_check(self, locks, names):
        """Losing one of two keys is losing the lock."""
        lock, _ = locks.make(*names)
        assert isinstance(lock.acquire(0), Taken)
        locks.take_away(names[1])
        with pytest.raises(LockLost):
            lock.check()

    def test_a_key_taken_away_can_be_acquired_by_another(self, locks, names):
        """The loss is real: another lock gets the key."""
        lock, _ = locks.make(names[0])
        assert isinstance(lock.acquire(0), Taken)
        locks.take_away(names[0])
        other, _ = locks.make(names[0])
        assert isinstance(other.acquire(0), Taken)

    def test_release_after_loss_does_not_raise_nor_free_the_new_holder(self, locks, names):
        """Releasing a lost lock is quiet and leaves the key's new holder alone."""
        lock, _ = locks.make(names[0])
        assert isinstance(lock.acquire(0), Taken)
        locks.take_away(names[0])
        other, _ = locks.make(names[0])
        assert isinstance(other.acquire(0), Taken)
        lock.release()
        other.check()

    def test_release_is_idempotent(self, locks, names):
        """A second release is quiet, and the key stays free for the next."""
        lock, _ = locks.make(names[0])
        assert isinstance(lock.acquire(0), Taken)
        lock.release()
        lock.release()
        other, _ = locks.make(names[0])
        assert isinstance(other.acquire(0), Taken)


class TestMemoryStoreDown:
    """The memory store can be made unavailable, as a server that cannot be reached."""

    def test_acquire_on_a_store_that_is_down_raises_unavailable(self, names):
        """store.down: acquire raises LockStoreUnavailable (exit 69's error)."""
        store = MemoryStore()
        store.down = True
        lock = MemoryLock((keys.from_name(names[0]),), store)
        with pytest.raises(LockStoreUnavailable):
            lock.acquire(0)

    def test_check_on_a_store_that_is_down_raises_unavailable(self, names):
        """store.down while held: check cannot tell, so it raises LockStoreUnavailable."""
        store = MemoryStore()
        lock = MemoryLock((keys.from_name(names[0]),), store)
        assert isinstance(lock.acquire(0), Taken)
        store.down = True
        with pytest.raises(LockStoreUnavailable):
            lock.check()
        store.down = False
        lock.check()  # still ours once it is back
