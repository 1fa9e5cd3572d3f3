"""A large history: the run path, status and row-level security read what they need only.

Counts of rows, not timings: each statement's plan (EXPLAIN ANALYZE, rolled back) says how
many rows of jobrun.runs it read; benchmarks/bench_history_scale.py has the timings.
"""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from psycopg.rows import dict_row

from harness import jobrun_cli
from jobrun import db, sql
from jobrun.history.schema import ensure as ensure_schema
from jobrun.history.upgrade import upgrade
from jobrun.ops.doctor.finding import WARN
from jobrun.ops.doctor.history_scale import history_scale
from jobrun.ops.status.collect import _slot_ids, collect
from jobrun.sql import history as history_sql
from jobrun.sql import schema as schema_sql
from jobrun.sql import status as status_sql

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

    Connection = psycopg.Connection[Any]

KEY = "big-key"
#: Rows of the big key: every fourth a skip (three hosts, each behind the run before it),
#: one run in 17 failed, one row every 5 minutes back from now.
ROWS = 6000

FILL = """
INSERT INTO jobrun.runs
    (run_id, key, lock_ids, mode, host, pid, program, started_at, finished_at, outcome,
     reason, exit_code, duration, streak, streak_since, holder_ref)
SELECT gen_random_uuid(), %(key)s, ARRAY[7::int8], 'session', 'host-' || (j %% 3), 1, 'p',
       clock_timestamp() - make_interval(mins => 5 * (%(rows)s - j)),
       clock_timestamp() - make_interval(mins => 5 * (%(rows)s - j)) + interval '3 seconds',
       CASE WHEN j %% 4 = 3 THEN 'skipped' WHEN j %% 17 = 0 THEN 'failed' ELSE 'succeeded' END,
       CASE WHEN j %% 4 = 3 THEN 'locked' END,
       CASE WHEN j %% 4 = 3 THEN 75 WHEN j %% 17 = 0 THEN 1 ELSE 0 END, 3.0 + j %% 5,
       CASE WHEN j %% 4 = 3 OR j %% 17 = 0 THEN 1 ELSE 0 END,
       CASE WHEN j %% 4 = 3 OR j %% 17 = 0
            THEN clock_timestamp() - make_interval(mins => 5 * (%(rows)s - j)) END,
       CASE WHEN j %% 4 = 3 THEN 'run-' || (j - 1) END
FROM generate_series(0, %(rows)s - 1) AS j
"""


@pytest.fixture
def big(fresh_dsn: str) -> Iterator[Connection]:
    """A database whose history holds ROWS rows of KEY and a few of two other keys."""
    with psycopg.connect(fresh_dsn, autocommit=True) as conn:
        ensure_schema(conn)
        conn.execute(FILL, {"key": KEY, "rows": ROWS})
        conn.execute(FILL, {"key": "small-a", "rows": 40})
        conn.execute(FILL, {"key": "small-b", "rows": 3})
        conn.execute("VACUUM ANALYZE jobrun.runs")
        yield conn


def _params(**extra: object) -> dict[str, object]:
    """A run's parameters as the recorder makes them."""
    return {
        "run_id": uuid.uuid4(),
        "key": KEY,
        "lock_ids": [7],
        "mode": "session",
        "host": "host-a",
        "pid": 4242,
        "program": "p",
        "keep": 100,
        "alert_after": 3,
        "repeat": 3600.0,
        "pause_keys": [KEY],
        "tz": None,
        "expect_every": None,
        "expect_grace": None,
        **extra,
    }


def rows_read(conn: Connection, statement: str, params: Mapping[str, object]) -> int:
    """Rows of jobrun.runs ``statement`` read (returned by a scan or removed by its filter)."""
    bound = psycopg.ClientCursor(conn).mogrify(statement, params)
    with conn.transaction(force_rollback=True):
        (plan,) = conn.execute(f"EXPLAIN (ANALYZE, FORMAT JSON) {bound}").fetchone()
    return _read(plan[0]["Plan"])


def _read(node: Mapping[str, Any]) -> int:
    found = 0
    if node.get("Relation Name") == "runs" and node.get("Node Type") != "ModifyTable":
        loops = node.get("Actual Loops", 1)
        found += loops * node.get("Actual Rows", 0)
        found += node.get("Rows Removed by Filter", 0) + node.get(
            "Rows Removed by Index Recheck", 0
        )
    return found + sum(_read(child) for child in node.get("Plans", ()))


class TestRunPath:
    """Each statement of a run's start and end and of a skip reads a few rows of its key."""

    def test_statements_read_a_bounded_number_of_rows(self, big):
        """With 6,000 rows in the key: none of them reads more than a few dozen."""
        finish = _params(
            outcome="succeeded",
            exit_code=0,
            signal=None,
            duration=1.0,
            child_pid=1,
            started_at=None,
            failed=False,
            deadlocks_at_start=0,
        )
        skip = _params(
            reason="locked",
            locked=True,
            exit_code=75,
            duration=0.1,
            holder_ref="run-5",
            holder=None,
            host="host-2",
        )
        read = {
            "abandoned": rows_read(big, sql.RUNS_ABANDON, _params()),
            "once-per": rows_read(big, sql.RUNS_ALREADY_RAN, _params(window=86400.0)),
            "running row": rows_read(big, sql.RUNS_ACQUIRED, _params(window=None)),
            "running row, once-per": rows_read(big, sql.RUNS_ACQUIRED, _params(window=86400.0)),
            "recovered": rows_read(big, sql.RUNS_SKIPS_RECOVERED, _params()),
            "finish": rows_read(big, sql.RUNS_FINISH, finish),
            "skip": rows_read(big, sql.RUNS_SKIP, skip),
            "prune, nothing to delete": rows_read(big, sql.RUNS_PRUNE, _params(keep=100_000)),
        }
        assert all(count <= 25 for count in read.values()), read

    def test_prune_deletes_a_batch_per_run_and_catches_up(self, big):
        """--keep lowered under 6,000 rows: each prune deletes a batch; the next ones the rest."""
        keep = 10
        counts = []
        for _ in range(10):
            big.execute(sql.RUNS_PRUNE, _params(keep=keep))
            counts.append(_count(big, KEY))
        first = counts[0]
        assert first >= ROWS - 2 * history_sql.PRUNE_BATCH, counts
        skips = _count(big, KEY, "outcome = 'skipped'")
        done = _count(big, KEY, "outcome <> 'skipped'")
        assert (done, skips) == (keep, keep), counts  # each host skipped among the newest
        newest = big.execute(
            "SELECT count(*) FROM (SELECT outcome FROM jobrun.runs WHERE key = %s "
            "AND outcome <> 'skipped' ORDER BY started_at DESC LIMIT %s) AS n",
            (KEY, keep),
        ).fetchone()
        assert newest == (keep,)
        summary = big.execute(
            "SELECT finished_count, skip_count FROM jobrun.run_keys WHERE key = %s", (KEY,)
        ).fetchone()
        assert summary == (done, skips)


def _count(conn: Connection, key: str, where: str = "true") -> int:
    row = conn.execute(
        f"SELECT count(*) FROM jobrun.runs WHERE key = %s AND {where}",  # noqa: S608 - constants
        (key,),
    ).fetchone()
    return int(row[0]) if row else 0


def _status(conn: Connection, statement: str) -> list[dict[str, Any]]:
    with conn.cursor(row_factory=dict_row) as cur:
        cur.execute(statement, {"all": True, "keys": []})
        return [_rounded(row) for row in cur.fetchall()]


def _rounded(row: dict[str, Any]) -> dict[str, Any]:
    return {
        name: round(value, 6) if isinstance(value, float) else value for name, value in row.items()
    }


class TestSummary:
    """status reads a row per key, kept equal to what the runs say."""

    def test_summary_says_what_the_runs_say(self, big, make_recorder):
        """Runs, skips, failures, an abandoned run, updates and deletes by hand: all agree."""
        recorder = make_recorder(target_dsn=big.info.dsn)
        recorder.running(1)
        recorder.finished("failed", 1, None, 2.5)
        skipper = make_recorder(target_dsn=big.info.dsn, host="host-z")
        skipper.skipped("locked", {"holder_run_id": str(uuid.uuid4())}, 75)
        big.execute(
            "UPDATE jobrun.runs SET outcome = 'abandoned' "
            "WHERE key = 'small-b' AND outcome = 'succeeded'"
        )
        big.execute(
            "DELETE FROM jobrun.runs WHERE run_id IN (SELECT run_id FROM jobrun.runs "
            "WHERE key = 'small-a' ORDER BY started_at DESC LIMIT 5)"
        )
        big.execute("DELETE FROM jobrun.runs WHERE key = 'small-b'")
        summary = _status(big, sql.STATUS_HISTORY)
        assert summary == _status(big, status_sql.STATUS_HISTORY_RUNS)
        assert {row["key"] for row in summary} == {KEY, "small-a", recorder.label}

    def test_status_reads_no_run(self, big):
        """status of every key reads the summary: not one row of jobrun.runs."""
        assert rows_read(big, sql.STATUS_HISTORY, {"all": True, "keys": []}) == 0

    def test_status_while_the_summary_is_incomplete(self, big):
        """Until the upgrade's backfill marks it complete, status reads the runs."""
        expected = _status(big, sql.STATUS_HISTORY)
        big.execute("DELETE FROM jobrun.run_keys WHERE key = 'small-a'")
        big.execute("COMMENT ON TABLE jobrun.run_keys IS NULL")
        assert _status(big, sql.STATUS_HISTORY) == expected

    def test_status_of_many_keys_hashes_no_slot_ids(self, big):
        """Nothing held: status of 300 keys never works out a key's 256 slot lock ids."""
        big.execute(
            "INSERT INTO jobrun.runs (run_id, key, lock_ids, mode, host, pid, started_at, "
            "finished_at, outcome) SELECT gen_random_uuid(), 'many-' || n, ARRAY[n::int8], "
            "'session', 'h', 1, clock_timestamp(), clock_timestamp(), 'succeeded' "
            "FROM generate_series(1, 300) AS n"
        )
        _slot_ids.cache_clear()
        report = collect(big)
        assert len(report.keys) == 303
        assert _slot_ids.cache_info().currsize == 0


class TestUpgrade:
    """A history written before the summary and indexes: brought up to date concurrently."""

    def test_upgrade_of_an_older_history(self, big):
        """No summary, no triggers, two indexes: the upgrade makes them all, status agrees."""
        expected = _status(big, sql.STATUS_HISTORY)
        big.execute("DROP TABLE jobrun.run_keys CASCADE")
        big.execute("DROP TABLE jobrun.schema_version")  # older versions had none
        for name in ("runs_inserted", "runs_updated", "runs_deleted", "runs_truncated"):
            big.execute(f"DROP TRIGGER {name} ON jobrun.runs")
        for name, _ in schema_sql.RUNS_INDEXES:
            big.execute(f"DROP INDEX jobrun.{name}")
        assert [f.status for f in history_scale(big)] == [WARN]
        said: list[str] = []
        took = upgrade(big, said.append)
        # Under INLINE_BUILD_BYTES the schema's step builds the indexes itself (quick);
        # past it the upgrade builds them concurrently (the next test).
        assert (
            {"schema", "summary"}
            <= set(took)
            <= {"schema", "summary"} | {n for n, _ in schema_sql.RUNS_INDEXES}
        )
        assert _status(big, sql.STATUS_HISTORY) == expected
        assert rows_read(big, sql.STATUS_HISTORY, {"all": True, "keys": []}) == 0
        assert [f.status for f in history_scale(big)] == ["OK"]

    def test_schema_message_leaves_a_large_tables_indexes_to_the_upgrade(self, big):
        """Past INLINE_BUILD_BYTES the schema's message builds no index (it would block runs)."""
        big.execute("DROP TABLE jobrun.run_keys CASCADE")
        big.execute("DROP TABLE jobrun.schema_version")  # older versions had none
        for name, _ in schema_sql.RUNS_INDEXES:
            big.execute(f"DROP INDEX jobrun.{name}")
        rows = 200_000
        with big.transaction():
            big.execute("SET LOCAL session_replication_role = replica")  # an older version's
            big.execute(FILL, {"key": "filler", "rows": rows})
        (size,) = big.execute("SELECT pg_relation_size('jobrun.runs')").fetchone() or (0,)
        assert size > schema_sql.INLINE_BUILD_BYTES
        ensure_schema(big)
        built = big.execute(
            "SELECT count(*) FROM pg_class WHERE relname = ANY(%s)",
            ([name for name, _ in schema_sql.RUNS_INDEXES],),
        ).fetchone()
        assert built == (0,)
        assert "summary" in history_scale(big)[0].detail
        upgrade(big, lambda _: None)
        assert [f.status for f in history_scale(big)] == ["OK"]
        assert _status(big, sql.STATUS_HISTORY) == _status(big, status_sql.STATUS_HISTORY_RUNS)

    def test_doctor_names_a_missing_index(self, big):
        """jobrun doctor warns of an index the runs need, and says how to build it."""
        big.execute("DROP INDEX jobrun.runs_key_finished")
        (finding,) = history_scale(big)
        assert finding.status == WARN
        assert "jobrun.runs_key_finished" in finding.detail
        assert "jobrun.history.upgrade" in finding.detail


class TestTenants:
    """Row-level security looks a role's grants up once per statement, not once per row."""

    def test_grants_read_once_per_statement(self, teams):
        """team_a counting 3,000 rows of jobrun.runs: jobrun.grants is read once."""
        with psycopg.connect(teams.owner, autocommit=True) as owner:
            owner.execute(FILL, {"key": "a-big", "rows": 3000})
            owner.execute("ANALYZE jobrun.runs")
        with psycopg.connect(teams.a, autocommit=True) as conn:
            (plan,) = conn.execute(
                "EXPLAIN (ANALYZE, FORMAT JSON) SELECT count(*) FROM jobrun.runs"
            ).fetchone()
        (scan,) = _scans_of(plan[0]["Plan"], "runs")
        assert scan["Actual Rows"] == 3000, scan
        # A key of its own is matched against the grants' patterns, an InitPlan's (read
        # once per statement): no function is called per row.
        # (PostgreSQL 17 shows the InitPlan's output as ``(InitPlan 1).col1``, earlier ``$0``.)
        assert re.search(r"~~ ANY \((\$\d+|\(InitPlan \d+\)\.col\d+)\)", scan["Filter"]), scan

    def test_no_tenant_may_set_a_summary(self, teams):
        """The summary's counts decide the prune: a role may not refresh a key by hand."""
        with psycopg.connect(teams.a, autocommit=True) as conn:
            try:
                conn.execute("SELECT jobrun.run_keys_refresh('b-one', 1000000, 0)")
            except psycopg.Error as exc:
                refused = exc.sqlstate
            else:
                refused = None
        assert refused == "42501"

    def test_granted_status_sees_its_keys_only(self, teams):
        """The summary as team_a sees it, and its status: a-* keys, never b-*."""
        assert jobrun_cli.run("--key", "a-one", "--", "true", dsn=teams.a).returncode == 0
        assert jobrun_cli.run("--key", "b-one", "--", "true", dsn=teams.b).returncode == 0
        with psycopg.connect(teams.a, autocommit=True) as conn:
            assert conn.execute("SELECT key FROM jobrun.run_keys").fetchall() == [("a-one",)]
        shown = jobrun_cli.run("status", "--json", dsn=teams.a)
        assert shown.returncode == 0, shown.stderr
        assert [row["key"] for row in json.loads(shown.stdout)] == ["a-one"]


def _scans_of(node: Mapping[str, Any], relation: str) -> list[Mapping[str, Any]]:
    found = [node] if node.get("Relation Name") == relation else []
    for child in node.get("Plans", ()):
        found += _scans_of(child, relation)
    return found


def test_jobrun_sessions_have_no_jit(dsn):
    """No plan of jobrun's is compiled: its sessions pin jit off."""
    with db.connect(db.Target(dsn=dsn), app_name="jobrun:test") as conn:
        assert conn.execute("SHOW jit").fetchone() == ("off",)
