"""Counting the server sessions a command opens (pg_stat_database.sessions, PostgreSQL 14+)."""

from __future__ import annotations

from typing import final

import psycopg
import pytest

from jobrun.testing.jobrun_cli import wait_until


@final
class SessionCounter:
    """Counts the server sessions established to one database (pg_stat_database, PG14+).

    It is made (and its own session established) before the sessions it counts.
    """

    def __init__(self, dsn: str) -> None:
        self.conn = psycopg.connect(dsn, autocommit=True)
        if self.conn.info.server_version < 140000:
            self.conn.close()  # skip() raises: closed here, or the leak check fails the test
            pytest.skip("pg_stat_database.sessions needs PostgreSQL 14")
        self._start = self._ended()

    def _others(self) -> int:
        row = self.conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
        return int(row[0]) if row else 0

    def _ended(self) -> int:
        self.conn.execute("SELECT pg_stat_clear_snapshot()")
        row = self.conn.execute(
            "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        return int(row[0]) if row else 0

    def ended_since_start(self, expected: int) -> int:
        """Sessions established since the counter was made, once every other one is gone.

        A session's count is reported a moment after it began: wait for ``expected`` (or
        more) to show, then report what shows.
        """
        wait_until(lambda: self._others() == 0, what="every other session to end")
        wait_until(
            lambda: self._ended() - self._start >= expected, what=f"{expected} sessions counted"
        )
        return self._ended() - self._start

    def close(self) -> None:
        self.conn.close()

    def __enter__(self) -> SessionCounter:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()
