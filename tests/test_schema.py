"""The schema's version row and steps: made on first use, upgraded, refused when too new."""

from __future__ import annotations

import subprocess
import sys
from typing import TYPE_CHECKING

import psycopg
import pytest

from harness import jobrun_cli
from jobrun.exitcodes import Exit
from jobrun.history import schema
from jobrun.sql import schema as schema_sql

if TYPE_CHECKING:
    from pathlib import Path

MODES = ("session", "lease")

#: The tables as a jobrun before schema versions made them, in their oldest shape that is
#: still upgraded: no version row, no summary, no later columns (alerted_at, deadlocks,
#: the output tails, claimed_user), no fence.
OLD_LAYOUT = """
CREATE SCHEMA jobrun;
CREATE TABLE jobrun.runs (
    run_id uuid PRIMARY KEY, key text NOT NULL, lock_ids bigint[] NOT NULL,
    mode text NOT NULL, host text NOT NULL, pid integer NOT NULL, child_pid integer,
    program text, started_at timestamptz NOT NULL, finished_at timestamptz,
    outcome text NOT NULL, reason text, exit_code integer, signal text,
    duration double precision, streak integer NOT NULL DEFAULT 0,
    streak_since timestamptz, holder_ref text, holder jsonb
);
CREATE TABLE jobrun.stop_requests (
    run_id uuid PRIMARY KEY, key text NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT clock_timestamp(), host text NOT NULL,
    username text NOT NULL, pid integer NOT NULL, reason text
);
CREATE TABLE jobrun.leases (
    lock_id bigint PRIMARY KEY, key text NOT NULL, owner uuid NOT NULL, host text NOT NULL,
    pid integer NOT NULL, acquired_at timestamptz NOT NULL, renewed_at timestamptz NOT NULL,
    expires_at timestamptz NOT NULL
);
INSERT INTO jobrun.runs (run_id, key, lock_ids, mode, host, pid, started_at, finished_at,
                         outcome, exit_code)
VALUES (gen_random_uuid(), 'old-key', '{1}', 'session', 'old-host', 1,
        now() - interval '1 hour', now() - interval '59 minutes', 'succeeded', 0);
"""


def version_row(dsn: str) -> tuple[int, int] | None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(schema_sql.VERSION_ROW).fetchone()
    return (int(row[0]), int(row[1])) if row else None


def set_version(dsn: str, version: int, compatible_from: int) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE jobrun.schema_version SET version = %s, compatible_from = %s",
            (version, compatible_from),
        )


def marker_run(dsn: str, key: str, marker: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """A run whose child leaves ``marker`` behind: whether the child started."""
    return jobrun_cli.run(*args, "--key", key, "--", "touch", str(marker), dsn=dsn)


@pytest.mark.parametrize("mode", MODES)
def test_a_first_run_writes_the_version_row(fresh_dsn, key, mode):
    """An empty database: the run makes every step and records the last one."""
    done = jobrun_cli.run("--mode", mode, "--key", key, "--", "true", dsn=fresh_dsn)
    assert done.returncode == 0, done.stderr
    assert version_row(fresh_dsn) == (schema_sql.VERSION, schema_sql.STEPS[-1].compatible_from)
    with psycopg.connect(fresh_dsn, autocommit=True) as conn:
        for table in ("runs", "run_keys", "leases", "stop_requests", "pauses", "fence"):
            found = conn.execute(
                "SELECT to_regclass(%s) IS NOT NULL", (f"jobrun.{table}",)
            ).fetchone()
            assert found == (True,), table


@pytest.mark.parametrize("mode", MODES)
def test_an_old_layout_is_upgraded_by_a_run(fresh_dsn, key, mode, tmp_path):
    """Tables an older jobrun made (no version row) get step 1, history kept, then the run."""
    with psycopg.connect(fresh_dsn, autocommit=True) as conn:
        conn.execute(OLD_LAYOUT)
    marker = tmp_path / "ran"
    done = marker_run(fresh_dsn, key, marker, "--mode", mode)
    assert done.returncode == 0, done.stderr
    assert marker.exists()
    assert version_row(fresh_dsn) == (schema_sql.VERSION, 1)
    with psycopg.connect(fresh_dsn, autocommit=True) as conn:
        columns = {
            str(row[0])
            for row in conn.execute(
                "SELECT attname FROM pg_attribute WHERE attrelid = 'jobrun.runs'::regclass"
            )
        }
        assert {"alerted_at", "deadlocks", "stdout_tail", "stderr_tail"} <= columns
        keys = {str(row[0]) for row in conn.execute("SELECT key FROM jobrun.run_keys")}
        assert keys == {"old-key", key}


def test_an_old_layout_is_upgraded_by_the_upgrade_command(fresh_dsn):
    with psycopg.connect(fresh_dsn, autocommit=True) as conn:
        conn.execute(OLD_LAYOUT)
    done = subprocess.run(
        [sys.executable, "-m", "jobrun.history.upgrade", fresh_dsn],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert f"schema: version {schema_sql.VERSION}" in done.stdout
    assert version_row(fresh_dsn) == (schema_sql.VERSION, 1)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("on_db_error", ["fail", "run"])
def test_a_schema_too_new_is_refused_and_the_child_never_starts(
    fresh_dsn, key, mode, on_db_error, tmp_path
):
    """A newer jobrun's step that older ones may not write past: exit 69, one line, no child.

    Even with --on-db-error run: the database answered, and writing would be wrong.
    """
    warm = jobrun_cli.run("--mode", mode, "--key", key, "--", "true", dsn=fresh_dsn)
    assert warm.returncode == 0, warm.stderr
    newer = schema_sql.VERSION + 1
    set_version(fresh_dsn, newer, newer)
    marker = tmp_path / "ran"
    done = marker_run(fresh_dsn, key, marker, "--mode", mode, "--on-db-error", on_db_error)
    assert done.returncode == Exit.UNAVAILABLE, done.stderr
    assert not marker.exists()
    refusals = [line for line in done.stderr.splitlines() if "schema_too_new" in line]
    assert len(refusals) == 1, done.stderr
    assert "upgrade jobrun" in refusals[0]
    assert "Traceback" not in done.stderr
    # Nothing was written, and the lock is free again: a run after the upgrade would go on.
    with psycopg.connect(fresh_dsn, autocommit=True) as conn:
        rows = conn.execute("SELECT count(*) FROM jobrun.runs WHERE key = %s", (key,)).fetchone()
        assert rows == (1,)
        leases = conn.execute(
            "SELECT count(*) FROM jobrun.leases WHERE key = %s AND expires_at > now()", (key,)
        ).fetchone()
        assert leases == (0,)


@pytest.mark.parametrize("mode", MODES)
def test_a_newer_schema_that_allows_older_writers_is_used(fresh_dsn, key, mode, tmp_path):
    """A step that only added (compatible_from unchanged): an older jobrun keeps working."""
    warm = jobrun_cli.run("--mode", mode, "--key", key, "--", "true", dsn=fresh_dsn)
    assert warm.returncode == 0, warm.stderr
    set_version(fresh_dsn, schema_sql.VERSION + 1, schema_sql.VERSION)
    marker = tmp_path / "ran"
    done = marker_run(fresh_dsn, key, marker, "--mode", mode)
    assert done.returncode == 0, done.stderr
    assert marker.exists()
    assert version_row(fresh_dsn) == (schema_sql.VERSION + 1, schema_sql.VERSION)


def test_readers_read_a_schema_too_new_to_write(fresh_dsn, key):
    """status and history name only what older steps made: they keep working."""
    warm = jobrun_cli.run("--key", key, "--", "true", dsn=fresh_dsn)
    assert warm.returncode == 0, warm.stderr
    newer = schema_sql.VERSION + 1
    set_version(fresh_dsn, newer, newer)
    shown = jobrun_cli.run("history", key, dsn=fresh_dsn)
    assert shown.returncode == 0, shown.stderr
    assert "succeeded" in shown.stdout


def test_the_upgrade_command_and_init_refuse_a_schema_too_new(fresh_dsn, key):
    warm = jobrun_cli.run("--key", key, "--", "true", dsn=fresh_dsn)
    assert warm.returncode == 0, warm.stderr
    newer = schema_sql.VERSION + 1
    set_version(fresh_dsn, newer, newer)
    done = subprocess.run(
        [sys.executable, "-m", "jobrun.history.upgrade", fresh_dsn],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert done.returncode == Exit.UNAVAILABLE, done.stderr
    assert "schema_too_new" in done.stderr
    init = jobrun_cli.run("init", dsn=fresh_dsn)
    assert init.returncode == Exit.UNAVAILABLE, init.stderr
    assert "upgrade jobrun" in init.stderr
    assert version_row(fresh_dsn) == (newer, newer)


@pytest.mark.parametrize("mode", MODES)
def test_concurrent_first_runs_make_one_schema(fresh_dsn, mode):
    """Several first runs at once on an empty database: one schema, every run fine."""
    runs = [
        jobrun_cli.start("--mode", mode, "--key", f"first-{n}", "--", "true", dsn=fresh_dsn)
        for n in range(6)
    ]
    for proc in runs:
        _, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, stderr
        assert "history_failed" not in stderr, stderr
    assert version_row(fresh_dsn) == (schema_sql.VERSION, 1)
    with psycopg.connect(fresh_dsn, autocommit=True) as conn:
        count = conn.execute("SELECT count(*) FROM jobrun.schema_version").fetchone()
        assert count == (1,)
        done = conn.execute("SELECT count(*) FROM jobrun.runs").fetchone()
        assert done == (6,)


def test_a_connection_is_checked_once(fresh_dsn):
    """The check rides in a connection's first message only (then it is remembered)."""
    with psycopg.connect(fresh_dsn, autocommit=True) as conn:
        assert schema.prefix(conn) == (schema_sql.CHECK_WRITE,)
        schema.ensure(conn)
        assert schema.prefix(conn) == ()
        assert schema.prefix(conn, writes=False) == ()
    with psycopg.connect(fresh_dsn, autocommit=True) as other:
        assert schema.prefix(other, writes=False) == (schema_sql.CHECK_READ,)


def test_steps_are_numbered_in_order():
    assert [step.number for step in schema_sql.STEPS] == list(range(1, len(schema_sql.STEPS) + 1))
    assert len(schema_sql.STEPS) == schema_sql.VERSION
    compat = [step.compatible_from for step in schema_sql.STEPS]
    assert all(c <= step.number for c, step in zip(compat, schema_sql.STEPS, strict=True))
