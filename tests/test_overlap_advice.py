"""``jobrun overlap``'s suggested fix: each shape of deadlock read from its wait-for cycle."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING, Any

import click
import pytest
from click.testing import CliRunner

from harness import overlap_scenarios
from jobrun.analysis.overlap import advice
from jobrun.analysis.overlap.model import Lock, Wait
from jobrun.cli.overlap import overlap_command

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Each deadlocking scenario of harness/overlap_scenarios.py, the shape its cycle is
#: read as, and words its suggested fix must hold.
SHAPES = {
    "opposite row order": ("rows in opposite order", "ORDER BY id FOR UPDATE"),
    "foreign key: child's key-share lock vs parent change": (
        "a foreign key's share lock against a parent change",
        "lock the",
    ),
    "lock upgrade: FOR SHARE, then UPDATE": ("a shared lock upgraded", "FOR UPDATE"),
    "advisory locks in opposite order": ("advisory locks in opposite order", "ascending key"),
    "unique keys inserted in opposite order": (
        "the same unique key inserted",
        "ascending key order",
    ),
    "table lock (a migration) against row locks": (
        "a table lock against row locks",
        "LOCK TABLE",
    ),
}
#: A job that locks the whole table whose row the other job waits for: the watcher's read
#: of that row by ctid would queue behind the pending ACCESS EXCLUSIVE request.
TABLE_OF_THE_ROWS = overlap_scenarios.Scenario(
    "table lock on the rows' own table",
    (
        "UPDATE {s}.accounts SET balance = 1 WHERE id = 1",
        "UPDATE {s}.accounts SET balance = 1 WHERE id = 2",
    ),
    (
        "UPDATE {s}.accounts SET balance = 1 WHERE id = 2",
        "LOCK TABLE {s}.accounts IN ACCESS EXCLUSIVE MODE",
    ),
    deadlocks=True,
)
SCENARIOS = {s.name: s for s in (*overlap_scenarios.SCENARIOS, TABLE_OF_THE_ROWS)}


@pytest.fixture
def scenario_schema(dsn: str) -> Iterator[str]:
    """A schema of this test's own with the scenarios' tables."""
    schema = f"advice_{uuid.uuid4().hex[:8]}"
    overlap_scenarios.create_schema(dsn, schema)
    yield schema
    overlap_scenarios.drop_schema(dsn, schema)


def overlap_json(dsn: str, schema: str, name: str, *extra: str) -> tuple[int, Any]:
    """``jobrun overlap`` on scenario ``name`` (2 attempts): its exit status and its output."""
    scenario = SCENARIOS[name]
    group = click.Group(commands=[overlap_command])
    result = CliRunner().invoke(
        group,
        [
            "overlap",
            "--first", scenario.command(dsn, schema, "A"),
            "--second", scenario.command(dsn, schema, "B"),
            "--runs", "2", "--dsn", dsn, *extra,
        ],
        standalone_mode=False,
    )  # fmt: skip
    assert result.exception is None, f"{result.exception!r}\n{result.output}"
    return int(result.return_value), json.loads(result.stdout) if "--json" in extra else result


def first_advice(report: dict[str, Any]) -> dict[str, Any]:
    """The advice of the report's first cycle (there must be one)."""
    assert report["cycles"], report["attempts"]
    found = report["cycles"][0]["advice"]
    assert found is not None, report["cycles"]
    return found


class TestShapes:
    """Each shape of deadlock, run for real, gets its own suggested fix."""

    @pytest.mark.parametrize("name", list(SHAPES), ids=list(SHAPES))
    def test_shape_and_its_fix(self, dsn, scenario_schema, name):
        """The cycle is read as the scenario's shape, and the fix says what to do about it."""
        status, report = overlap_json(dsn, scenario_schema, name, "--json")
        assert status == 1
        found = first_advice(report)
        shape, words = SHAPES[name]
        assert found["shape"] == shape, found
        assert words in found["suggested_fix"], found
        assert found["evidence"], found


class TestTableLocks:
    """A table lock in the cycle: the lock held is told apart from the one asked for."""

    def test_the_holder_holds_a_conflicting_lock_not_the_one_asked(self, dsn, scenario_schema):
        """The job that waits for a row holds a lock in conflict with ACCESS EXCLUSIVE."""
        status, report = overlap_json(dsn, scenario_schema, TABLE_OF_THE_ROWS.name, "--json")
        assert status == 1
        found = first_advice(report)
        assert found["shape"] == "a table lock against row locks", found
        table = f"{scenario_schema}.accounts"
        holder = next(step for step in found["steps"] if "LOCK TABLE" not in step)
        assert f"locked table {table} (a lock in conflict with AccessExclusiveLock)" in holder


class TestRowKeys:
    """Rows are named by their key, read by ctid while the jobs are held in the cycle."""

    def test_each_job_locked_one_id_then_waited_for_the_other(self, dsn, scenario_schema):
        """A locked id=1 then waited for id=2; B the other way round."""
        _, report = overlap_json(dsn, scenario_schema, "opposite row order", "--json")
        steps = first_advice(report)["steps"]
        table = f"{scenario_schema}.accounts"
        by_job = {step.split(" ", 1)[0]: step for step in steps}
        assert f"locked {table} id=1, then waited for {table} id=2" in by_job["A"], steps
        assert f"locked {table} id=2, then waited for {table} id=1" in by_job["B"], steps

    def test_human_report_labels_the_advice(self, dsn, scenario_schema):
        """The report says "suggested fix:" and the lock order it is based on."""
        status, result = overlap_json(dsn, scenario_schema, "opposite row order")
        assert status == 1
        lines = result.stdout.splitlines()
        assert "lock order (rows in opposite order):" in lines, result.stdout
        assert any(line.startswith("suggested fix: lock ") for line in lines), result.stdout
        assert any(line.startswith("  evidence: rows read by ctid") for line in lines)

    def test_a_fixed_pair_has_no_advice(self, dsn, scenario_schema):
        """No cycle, no advice."""
        status, report = overlap_json(dsn, scenario_schema, "fixed: same row order", "--json")
        assert status == 0
        assert all(attempt["advice"] is None for attempt in report["attempts"])


def wait(job: str, pid: int, lock: Lock, holder: str, holder_pid: int) -> Wait:
    """One edge of a hand-made cycle."""
    return Wait(job, pid, "q", lock, holder, holder_pid)


class TestAdviceText:
    """The advice as text: escaped, and the generic order when the locks say little."""

    def test_key_values_are_escaped(self):
        """A key value with an ESC in it is printed as ``\\x1b``."""
        row1 = Lock("transactionid", "ShareLock", None, "7", "(0,1)", "accounts")
        row2 = Lock("transactionid", "ShareLock", None, "8", "(0,2)", "accounts")
        cycle = (wait("A", 1, row1, "B", 2), wait("B", 2, row2, "A", 1))
        facts = advice.Facts(
            keys={("accounts", "(0,1)"): "name=\x1b[2Jx", ("accounts", "(0,2)"): "name=y"},
            columns={"accounts": ("name",)},
        )
        text = "\n".join(advice.advise(cycle, facts).lines())
        assert "\x1b" not in text
        assert "name=\\x1b[2Jx" in text

    def test_unknown_locks_get_the_generic_order(self):
        """Locks of no known shape: take them in one order."""
        lock = Lock("object", "AccessExclusiveLock", None, "pg_class 1")
        cycle = (wait("A", 1, lock, "B", 2), wait("B", 2, lock, "A", 1))
        assert advice.advise(cycle, advice.Facts()).shape == "locks in opposite order"
