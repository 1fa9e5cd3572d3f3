"""Lease mode's beats over a kept connection: only a renewal vouches for the lease anew."""

from __future__ import annotations

import os

import psycopg
import pytest
import structlog

from jobrun import db, keys
from jobrun.db.server_session import ServerSession
from jobrun.exitcodes import LockStoreUnavailable
from jobrun.locks import Identity, Taken, new_run_id
from jobrun.locks.lease import LeaseLock

#: Long enough that the test never reaches a renewal by the clock: it moves the clock itself.
RENEW_EVERY = 3600.0
LIFETIME = 7200.0


def _renewed_at(dsn: str, lock_id: int) -> object:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT renewed_at FROM jobrun.leases WHERE lock_id = %s", (lock_id,)
        ).fetchone()
    assert row is not None
    return row[0]


class TestKeptBeats:
    """A beat that is not a renewal checks the lease and reads stop requests, nothing more."""

    def test_a_beat_before_the_renewal_is_due_neither_renews_nor_vouches(self, dsn, key):
        """The lease row is untouched and the deadline still counts from the acquisition;
        the beat at which the next one would come too late renews, and the deadline moves."""
        lock_key = keys.from_name(key)
        lock, session = _kept_lease(dsn, key)
        try:
            assert isinstance(lock.acquire(0), Taken)
            conn = session.connection()
            assert conn is not None
            acquired = _renewed_at(dsn, lock_key.lock_id)
            lock.check()
            assert _renewed_at(dsn, lock_key.lock_id) == acquired
            # What the acquisition vouched for, less the time since it was sent: never more.
            assert lock.confirmation_lifetime < LIFETIME
            assert session.connection() is conn  # the same connection, kept
            # As if RENEW_EVERY had passed since the acquisition: the next beat renews.
            lock.confirmed_at -= RENEW_EVERY
            lock.check()
            assert _renewed_at(dsn, lock_key.lock_id) != acquired
            assert LIFETIME - 60 < lock.confirmation_lifetime <= LIFETIME
            assert session.connection() is conn
        finally:
            lock.release()
            session.close()

    def test_a_broken_kept_connection_is_reopened_by_the_next_beat(self, dsn, key):
        """The kept connection failing is not fatal: the next beat connects again."""
        lock, session = _kept_lease(dsn, key)
        try:
            assert isinstance(lock.acquire(0), Taken)
            first = session.connection()
            assert first is not None
            with psycopg.connect(dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s)", (first.info.backend_pid,))
            # The beat that finds it gone fails (an ambiguous heartbeat: retried), the next
            # one connects again.
            with pytest.raises(LockStoreUnavailable):
                lock.check()
            assert session.connection() is None
            lock.check()
            again = session.connection()
            assert again is not None
            assert again is not first
        finally:
            lock.release()
            session.close()


def _kept_lease(dsn: str, key: str) -> tuple[LeaseLock, ServerSession]:
    """A lease lock on ``key`` over a kept connection: a beat a second, renewing when due."""
    session = ServerSession(db.Target(dsn=dsn), app_name="jobrun:test", held=False, keeps=True)
    lock = LeaseLock(
        (keys.from_name(key),), session, Identity(run_id=new_run_id(), pid=os.getpid()),
        structlog.get_logger(), ttl=3 * LIFETIME, lifetime=LIFETIME, heartbeat=1.0,
        renew_every=RENEW_EVERY,
    )  # fmt: skip
    return lock, session
