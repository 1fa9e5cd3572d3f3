"""The run's one server session: one use at a time, a silent network cut at a use's bound."""

from __future__ import annotations

import threading
import time

import psycopg

from jobrun import db
from jobrun.db.server_session import ServerSession


class TestBoundedUse:
    """A bounded use is never held longer than its bound, however silent the network."""

    def test_a_use_waiting_behind_one_stuck_on_a_silent_network_is_cut_at_its_bound(
        self, dsn, proxy, pg_address
    ):
        """A heartbeat check stuck on a black hole holds the session: the history call
        waiting behind it cuts the socket at its own bound, counted from when it asked."""
        cut = proxy(*pg_address)
        target = db.Target(dsn=cut.dsn_for(dsn))
        session = ServerSession(target, app_name="jobrun:test", held=True)
        session.open()
        stuck = threading.Event()
        errors: list[Exception] = []

        def heartbeat_check() -> None:
            with session.use() as conn:
                assert conn is not None
                stuck.set()
                try:
                    conn.execute("SELECT 1")
                except psycopg.OperationalError as exc:
                    errors.append(exc)

        cut.blackhole()
        check = threading.Thread(target=heartbeat_check)
        check.start()
        try:
            assert stuck.wait(timeout=target.connect_timeout)
            bound = 0.5
            asked = time.monotonic()
            with session.use(bound) as conn:
                waited = time.monotonic() - asked
                # The cut broke the session under the check: there is none left to use.
                assert conn is None
            # Well before the kernel would have given up on the silent socket by itself.
            assert waited < target.tcp_user_timeout
            check.join(timeout=target.tcp_user_timeout)
            assert errors
            assert session.broken()
        finally:
            session.close()
            check.join()
