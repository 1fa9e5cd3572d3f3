"""Where PostgreSQL majors differ (jobrun supports 13 to 18), on the server at hand.

CI runs this file on each major (.ci/run). A setting a major lacks is left out (the lock
session sets only what its server knows), or said in one line; never an internal error.
"""

from __future__ import annotations

import json
import select

import psycopg
import structlog
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict

from harness import jobrun_cli
from jobrun import db, keys
from jobrun.db.server_session import ServerSession
from jobrun.exitcodes import Exit
from jobrun.locks import Identity, Taken, new_run_id
from jobrun.locks.session import SessionLock

#: server_version_num of the first major with idle_session_timeout and
#: client_connection_check_interval.
PG14 = 140000

#: Every setting the lock session pins against the role's and the database's own.
PINNED = (
    "idle_in_transaction_session_timeout",
    "statement_timeout",
    "idle_session_timeout",
    "client_connection_check_interval",
)


def server_version(dsn: str) -> int:
    with psycopg.connect(dsn) as conn:
        return conn.info.server_version


class TestTheLockSession:
    """The lock session turns off each idle timeout its server has, and only those."""

    def test_it_pins_each_setting_this_major_has(self, dsn, key):
        """14+: idle_session_timeout 0 and a client check every second; 13 has neither
        setting, and the lock is taken all the same."""
        session = ServerSession(db.Target(dsn=dsn), app_name="jobrun:test", held=True)
        lock = SessionLock(
            (keys.from_name(key),),
            session,
            Identity(run_id=new_run_id(), pid=1),
            structlog.get_logger(),
            heartbeat=1.0,
            kill_after=7.0,
        )
        assert isinstance(lock.acquire(0), Taken)
        try:
            conn = session.connection()
            assert conn is not None
            version = conn.info.server_version
            shown = dict(
                conn.execute(
                    "SELECT name, setting FROM pg_catalog.pg_settings WHERE name = ANY(%s)",
                    (list(PINNED),),
                ).fetchall()
            )
        finally:
            lock.release()
            session.close()
        expected = {"idle_in_transaction_session_timeout": "0", "statement_timeout": "0"}
        if version >= PG14:
            expected |= {"idle_session_timeout": "0", "client_connection_check_interval": "1000"}
        assert shown == expected

    def test_a_quiet_run_outlives_the_databases_idle_timeouts(self, fresh_dsn, pg_admin_dsn, key):
        """Idle timeouts of 1 s set on the database (idle_session_timeout too where the server
        has it, 14+): a run whose lock session stays quiet for 3 s still exits 0."""
        name = conninfo_to_dict(fresh_dsn)["dbname"]
        with psycopg.connect(pg_admin_dsn, autocommit=True) as admin:
            has_idle_session = admin.info.server_version >= PG14
            timeouts = ["idle_in_transaction_session_timeout"]
            timeouts += ["idle_session_timeout"] if has_idle_session else []
            for setting in timeouts:
                admin.execute(
                    pgsql.SQL("ALTER DATABASE {} SET {} = '1s'").format(
                        pgsql.Identifier(str(name)), pgsql.Identifier(setting)
                    )
                )
        if has_idle_session:
            with psycopg.connect(fresh_dsn, autocommit=True) as idle:
                # The setting is live: a plain idle session is closed by the server.
                readable, _, _ = select.select([idle.fileno()], [], [], 30)
                assert readable
        result = jobrun_cli.run(
            "--key", key, "--heartbeat", "5s", "--", "sleep", "3", dsn=fresh_dsn, timeout=60
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert "lock_lost" not in result.stderr


class TestDoctor:
    """The doctor reads each major's settings without an error of its own."""

    def test_it_names_what_this_major_lacks(self, dsn):
        """13 to 18 are tested (no 'untested' warning); idle_session_timeout is 'not in this
        server version' on 13 and a value on 14+."""
        result = jobrun_cli.run("doctor", "--json", dsn=dsn)
        assert result.returncode in {Exit.OK, Exit.ATTENTION}, result.stderr
        found = {row["check"]: row for row in json.loads(result.stdout)}
        assert found["server"]["status"] == "OK", found["server"]
        assert "untested" not in found["server"]["detail"]
        lacks = "not in this server version" in found["idle_session_timeout"]["detail"]
        assert lacks == (server_version(dsn) < PG14), found["idle_session_timeout"]
