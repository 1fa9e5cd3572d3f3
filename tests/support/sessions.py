"""Counting the server sessions a command opens (pg_stat_database.sessions, PostgreSQL 14+)."""

from __future__ import annotations

from typing import final

import psycopg
import pytest

from harness.jobrun_cli import wait_until


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
        #: PostgreSQL 14's counts come from the statistics collector, by message, and a
        #: backend reads its file up to half a second old: a count is only complete once
        #: the file is newer than every session it must include (this one's, for a start).
        self._collector = self.conn.info.server_version < 150000
        self._start = self._ended()

    def _others(self) -> int:
        row = self.conn.execute(
            "SELECT count(*) FROM pg_stat_activity"
            " WHERE datname = current_database() AND pid <> pg_backend_pid()"
        ).fetchone()
        return int(row[0]) if row else 0

    def _ended(self) -> int:
        if self._collector:
            return self._ended_after(self._now())
        self.conn.execute("SELECT pg_stat_clear_snapshot()")
        row = self.conn.execute(
            "SELECT sessions FROM pg_stat_database WHERE datname = current_database()"
        ).fetchone()
        return int(row[0]) if row else 0

    def _now(self) -> object:
        row = self.conn.execute("SELECT clock_timestamp()").fetchone()
        assert row is not None
        return row[0]

    def _ended_after(self, since: object) -> int:
        """PostgreSQL 14: the count from a statistics file written after ``since``.

        Each session sends its count before it first answers, so a file written after
        ``since`` counts every session established before it.
        """
        counted: list[int] = []

        def fresh() -> bool:
            self.conn.execute("SELECT pg_stat_clear_snapshot()")
            row = self.conn.execute(
                "SELECT sessions, pg_stat_get_snapshot_timestamp() > %s"
                " FROM pg_stat_database WHERE datname = current_database()",
                (since,),
            ).fetchone()
            if row is None or not row[1]:
                return False
            counted.append(int(row[0]))
            return True

        wait_until(fresh, what="statistics written after the sessions to count")
        return counted[-1]

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
