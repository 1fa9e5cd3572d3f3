"""Settings a DBA may set per database or role, or a user per environment, never break jobrun."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from harness import jobrun_cli
from harness.pgtools import create_database, drop_database
from jobrun import sql as jobrun_sql

if TYPE_CHECKING:
    from collections.abc import Iterator
    from subprocess import CompletedProcess

#: Every setting jobrun's run path depends on, at a value other than the one it needs.
HOSTILE = {
    "DateStyle": "SQL, DMY",
    "IntervalStyle": "sql_standard",
    "TimeZone": "Asia/Kathmandu",
    "client_encoding": "LATIN1",
    "search_path": "nowhere, public",
    "extra_float_digits": "-15",
    "lc_messages": "C",
}
#: A key name LATIN1 (and SJIS) cannot hold.
KEY = "nightly-экспорт-ジョブ"


@pytest.fixture(scope="module")
def hostile_dsn(pg_admin_dsn: str) -> Iterator[str]:
    """A fresh database carrying every hostile setting (ALTER DATABASE ... SET)."""
    name = f"jobrun_settings_{uuid.uuid4().hex[:10]}"
    create_database(pg_admin_dsn, name)
    try:
        with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
            for setting, value in HOSTILE.items():
                conn.execute(
                    sql.SQL("ALTER DATABASE {} SET {} = {}").format(
                        sql.Identifier(name), sql.Identifier(setting.lower()), sql.Literal(value)
                    )
                )
        yield make_conninfo(pg_admin_dsn, dbname=name)
    finally:
        drop_database(pg_admin_dsn, name)


#: The ways a user's environment can carry the same settings (libpq reads them).
ENVIRONMENTS = {
    "database": {},
    "pgoptions": {
        "PGOPTIONS": "-c DateStyle=German -c IntervalStyle=iso_8601 -c TimeZone=Pacific/Chatham "
        "-c search_path=nowhere -c extra_float_digits=-15"
    },
    "pgdatestyle": {"PGDATESTYLE": "Postgres, DMY", "PGTZ": "America/St_Johns"},
    "pgclientencoding": {"PGCLIENTENCODING": "SJIS"},
}


@pytest.fixture(params=sorted(ENVIRONMENTS))
def setting_env(request: pytest.FixtureRequest) -> dict[str, str]:
    """One of the ways hostile settings reach jobrun's sessions."""
    return ENVIRONMENTS[request.param]


def jobrun(*args: str, dsn: str, env: dict[str, str]) -> CompletedProcess[str]:
    """``jobrun ARGS`` with the environment under test."""
    return jobrun_cli.run(*args, dsn=dsn, env=env)


def unique(key: str) -> str:
    """A fresh key of the hostile kind for one test."""
    return f"{key}-{uuid.uuid4().hex[:6]}"


@pytest.mark.parametrize("mode", ["session", "lease"])
class TestRunPath:
    """The guarded run and its skip, in both modes."""

    def test_run_succeeds(self, hostile_dsn, setting_env, mode):
        """A run records its history and exits with the child's status, not 70."""
        result = jobrun(
            "--mode", mode, "--key", unique(KEY), "--", "true", dsn=hostile_dsn, env=setting_env
        )
        assert result.returncode == 0, result.stderr
        finished = jobrun_cli.event(result.stderr, "finished")
        assert finished["outcome"] == "succeeded"
        assert not [e for e in jobrun_cli.events(result.stderr) if e["event"] == "history_failed"]

    def test_skip_names_the_holder(self, hostile_dsn, setting_env, mode, tmp_path):
        """A second run skips (75) and says who holds the key and since when."""
        key = unique(KEY)
        marker = tmp_path / "pid"
        holder = jobrun_cli.start(
            "--mode",
            mode,
            "--key",
            key,
            "--",
            *jobrun_cli.holder_marker(marker),
            dsn=hostile_dsn,
            env=setting_env,
        )
        try:
            jobrun_cli.wait_for_file(marker)
            result = jobrun(
                "--mode", mode, "--key", key, "--", "true", dsn=hostile_dsn, env=setting_env
            )
            assert result.returncode == 75, result.stderr
            skipped = jobrun_cli.event(result.stderr, "skipped")
            assert skipped["holder_since"]
        finally:
            jobrun_cli.signal_and_wait(holder, jobrun_cli.SIGTERM)

    def test_once_per_skips_the_second_run_of_a_window(self, hostile_dsn, setting_env, mode):
        """--once-per reads the history (timestamps) and skips a run already done today."""
        key = unique(KEY)
        args = ("--mode", mode, "--key", key, "--once-per", "1d", "--", "true")
        first = jobrun(*args, dsn=hostile_dsn, env=setting_env)
        assert first.returncode == 0, first.stderr
        second = jobrun(*args, dsn=hostile_dsn, env=setting_env)
        assert second.returncode == 75, second.stderr
        assert jobrun_cli.event(second.stderr, "skipped")["reason"] == "already_ran"


class TestOperations:
    """status and history read what runs wrote, whatever the session's settings."""

    def test_status_and_history(self, hostile_dsn, setting_env):
        """Both commands exit 0 and show the key."""
        key = unique(KEY)
        ran = jobrun("--key", key, "--", "true", dsn=hostile_dsn, env=setting_env)
        assert ran.returncode == 0, ran.stderr
        status = jobrun("status", "--json", dsn=hostile_dsn, env=setting_env)
        assert status.returncode == 0, status.stderr
        assert key in json.dumps(json.loads(status.stdout), ensure_ascii=False)
        history = jobrun("history", key, dsn=hostile_dsn, env=setting_env)
        assert history.returncode == 0, history.stderr
        assert "succeeded" in history.stdout


class TestPinned:
    """The one statement that pins the settings when start-up options cannot."""

    def test_statement_sets_every_pinned_setting(self):
        """PIN_SETTINGS and PINNED_SETTINGS name the same settings and values."""
        for name, value in jobrun_sql.PINNED_SETTINGS:
            assert f"SET {name} = " in jobrun_sql.PIN_SETTINGS
            assert value in jobrun_sql.PIN_SETTINGS


class TestThroughAPooler:
    """PgBouncer refuses the start-up ``options`` jobrun pins the settings with."""

    def test_lease_mode_pins_with_set_instead(self, hostile_dsn, pgbouncer, pg_address):
        """Lease mode through transaction pooling runs, skips and reads its history."""
        bouncer = pgbouncer(*pg_address, pool_mode="transaction")
        pooled = bouncer.dsn_for(hostile_dsn)
        key = unique(KEY)
        args = ("--mode", "lease", "--key", key, "--once-per", "1d", "--", "true")
        first = jobrun(*args, dsn=pooled, env={})
        assert first.returncode == 0, first.stderr
        second = jobrun(*args, dsn=pooled, env={})
        assert second.returncode == 75, second.stderr
        assert jobrun_cli.event(second.stderr, "skipped")["reason"] == "already_ran"
