"""The run's last history message carries the release; when it fails, the lock releases alone."""

from __future__ import annotations

import psycopg
import pytest
import structlog

from jobrun import db, keys
from jobrun.db.server_session import CarriedRelease, ServerSession
from jobrun.history.calls import Calls
from jobrun.locks import Holder, Identity, Lock, Taken, new_run_id
from jobrun.locks.lease import LeaseLock
from jobrun.locks.session import SessionLock, holder_comment


def made(mode: str, dsn: str, name: str, *, fence: bool = False) -> tuple[Lock, ServerSession]:
    identity = Identity(run_id=new_run_id(), pid=4242)
    target = db.Target(dsn=dsn)
    log = structlog.get_logger()
    if mode == "session":
        session = ServerSession(
            target, app_name="jobrun:test", held=True, comment=holder_comment(identity)
        )
        lock: Lock = SessionLock(
            (keys.from_name(name),),
            session,
            identity,
            log,
            heartbeat=1.0,
            kill_after=10.0,
            fence=fence,
        )
    else:
        session = ServerSession(target, app_name="jobrun:test", held=False)
        lock = LeaseLock(
            (keys.from_name(name),), session, identity, log, ttl=60.0, lifetime=20.0, heartbeat=1.0
        )
    return lock, session


def held_elsewhere(dsn: str, mode: str, name: str) -> bool:
    """Whether anyone holds ``name`` (seen from a session of our own)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        if mode == "session":
            classid, objid = keys.from_name(name).pg_locks_pair
            row = conn.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted "
                "AND classid = %s::int8::oid AND objid = %s::int8::oid AND objsubid = 1",
                (classid, objid),
            ).fetchone()
        else:
            row = conn.execute(
                "SELECT count(*) FROM jobrun.leases WHERE lock_id = %s "
                "AND expires_at > clock_timestamp()",
                (keys.lock_id_for(name),),
            ).fetchone()
    return bool(row and row[0])


def calls(dsn: str, session: ServerSession) -> Calls:
    return Calls(
        db.Target(dsn=dsn),
        app_name="jobrun:test",
        timeout=5.0,
        log=structlog.get_logger(),
        session=session,
    )


@pytest.mark.parametrize("mode", ["session", "lease"])
class TestReleaseWithTheEnd:
    def test_the_last_message_releases(self, dsn, key, mode):
        """The last call went through: the lock is free, the session still open."""
        lock, session = made(mode, dsn, key)
        try:
            assert isinstance(lock.acquire(0.0), Taken)
            session.resume(structlog.get_logger())  # lease mode: the end's connection
            assert held_elsewhere(dsn, mode, key)
            rows = calls(dsn, session).run("the end", ("SELECT 1 AS one",), {}, last=True)
            assert rows is not None
            assert rows[0] == [{"one": 1}]
            assert session.connection() is not None
            assert not held_elsewhere(dsn, mode, key)
            lock.check()  # nothing held, nothing lost
            lock.release()
        finally:
            session.close()

    def test_a_failed_last_message_leaves_the_release_to_the_lock(self, dsn, key, mode):
        """The history statement fails: nothing was released with it; release() does it."""
        lock, session = made(mode, dsn, key)
        try:
            assert isinstance(lock.acquire(0.0), Taken)
            session.resume(structlog.get_logger())
            assert calls(dsn, session).run("the end", ("SELECT 1/0",), {}, last=True) is None
            assert held_elsewhere(dsn, mode, key)
            lock.release()
            assert session.connection() is not None or mode == "lease"
            assert not held_elsewhere(dsn, mode, key)
        finally:
            session.close()

    def test_a_call_that_is_not_the_last_releases_nothing(self, dsn, key, mode):
        """The history's start (not ``last``) leaves the lock alone."""
        lock, session = made(mode, dsn, key)
        try:
            assert isinstance(lock.acquire(0.0), Taken)
            assert calls(dsn, session).run("the start", ("SELECT 1 AS one",), {}) == [[{"one": 1}]]
            assert held_elsewhere(dsn, mode, key)
        finally:
            lock.release()
            session.close()


class TestSessionAcquisitionMessage:
    def test_where_lease_mode_never_ran(self, fresh_dsn, key):
        """No jobrun.leases: the one message still takes the lock (nothing to look up)."""
        lock, session = made("session", fresh_dsn, key)
        try:
            assert isinstance(lock.acquire(0.0), Taken)
            assert held_elsewhere(fresh_dsn, "session", key)
        finally:
            lock.release()
            session.close()

    def test_a_lease_found_after_the_lock_gives_the_key_back(self, dsn, key):
        """A lease-mode run holds the key: a skip naming it, and our advisory lock let go."""
        lease, lease_session = made("lease", dsn, key)
        lock, session = made("session", dsn, key)
        try:
            assert isinstance(lease.acquire(0.0), Taken)
            holder = lock.acquire(0.0)
            assert isinstance(holder, Holder)
            assert holder.expires_at is not None
            assert session.connection() is not None
            assert not held_elsewhere(dsn, "session", key)
        finally:
            session.close()
            lease.release()
            lease_session.close()

    def test_the_holder_comes_with_the_attempt(self, dsn, key):
        """Held by another session: the holder named from the same message."""
        first, first_session = made("session", dsn, key)
        second, second_session = made("session", dsn, key)
        try:
            assert isinstance(first.acquire(0.0), Taken)
            holder = second.acquire(0.0)
            assert isinstance(holder, Holder)
            assert holder.backend_pid is not None
            assert holder.pid == 4242
        finally:
            second_session.close()
            first.release()
            first_session.close()

    def test_a_role_kept_out_of_the_schema_still_takes_the_lock(self, fresh_dsn, role, key):
        """No USAGE on schema jobrun (where leases and the fence exist): to_regclass itself
        would fail there. The lock is taken all the same, no lease is seen, no token given
        (the token's own way then says why)."""
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE SCHEMA jobrun; CREATE TABLE jobrun.leases (lock_id int8, x int); "
                "CREATE SEQUENCE jobrun.fence"
            )
        outsider = role(database_dsn=fresh_dsn)
        lock, session = made("session", outsider, key, fence=True)
        try:
            assert isinstance(lock.acquire(0.0), Taken)
            assert held_elsewhere(fresh_dsn, "session", key)
            assert getattr(lock, "fence_token", "missing") is None
        finally:
            lock.release()
            session.close()

    def test_the_fence_token_comes_with_the_lock(self, fresh_dsn, key):
        """--fence where the sequence exists: a token from the acquisition's message."""
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA jobrun; CREATE SEQUENCE jobrun.fence")
        lock, session = made("session", fresh_dsn, key, fence=True)
        try:
            assert isinstance(lock.acquire(0.0), Taken)
            assert getattr(lock, "fence_token", None) == 1
        finally:
            lock.release()
            session.close()


class TestCarriedRelease:
    """The one channel: registered by the lock, taken by one message, kept if it failed."""

    def test_a_message_that_went_through_releases_once(self):
        released: list[str] = []
        channel = CarriedRelease()
        channel.register("SELECT 1", lambda: released.append("done"), after_commit=True)
        with channel.sending() as release:
            assert release is not None
            assert (release.statements, release.after_commit) == ("SELECT 1", True)
            assert released == []  # not before the message went through
        assert released == ["done"]
        with channel.sending() as release:
            assert release is None  # sent once, never twice

    def test_a_failed_message_keeps_it_for_a_retry_or_the_lock(self):
        released: list[str] = []
        channel = CarriedRelease()
        channel.register("SELECT 1", lambda: released.append("done"))
        with pytest.raises(psycopg.OperationalError), channel.sending():
            raise psycopg.OperationalError("the message failed")
        assert released == []
        with channel.sending() as release:
            assert release is not None
        assert released == ["done"]

    def test_withdrawn_it_rides_on_nothing(self):
        channel = CarriedRelease()
        channel.register("SELECT 1", lambda: None)
        channel.withdraw()
        with channel.sending() as release:
            assert release is None
