"""``jobrun overlap --job A --job B --job C``: every pair in both orders, a matrix of outcomes."""

from __future__ import annotations

import json
import shlex
import sys
import uuid
from typing import TYPE_CHECKING, Any

import click
import pytest
from click.testing import CliRunner

from harness import overlap_scenarios
from jobrun.cli.overlap import overlap_command
from jobrun.exitcodes import UsageError
from jobrun.run.supervise import ExecFailed

if TYPE_CHECKING:
    from collections.abc import Iterator


@pytest.fixture
def schema(dsn: str) -> Iterator[str]:
    """A schema of this test's own with the scenarios' tables."""
    name = f"matrix_{uuid.uuid4().hex[:8]}"
    overlap_scenarios.create_schema(dsn, name)
    yield name
    overlap_scenarios.drop_schema(dsn, name)


def updates(dsn: str, schema: str, *rows: int) -> str:
    """A job that updates ``rows`` of the accounts in that order, in one transaction."""
    update = "UPDATE {s}.accounts SET balance = balance + 1 WHERE id = "
    statements = [update + str(row) for row in rows]
    return shlex.join(
        [sys.executable, "-c", overlap_scenarios.JOB, dsn, schema, "0", "transaction", *statements]
    )


def invoke(*args: str) -> click.testing.Result:
    """``jobrun overlap ARGS`` in-process."""
    group = click.Group(commands=[overlap_command])
    return CliRunner().invoke(group, ["overlap", *args], standalone_mode=False)


def matrix_json(*args: str) -> tuple[int, dict[str, Any]]:
    """The exit status and the --json matrix."""
    result = invoke(*args, "--json")
    assert result.exception is None, f"{result.exception!r}\n{result.output}"
    return int(result.return_value), json.loads(result.stdout)


def outcomes(matrix: dict[str, Any]) -> dict[tuple[int, int], str]:
    """Pair (job numbers, from 1) -> outcome."""
    return {tuple(pair["jobs"]): pair["outcome"] for pair in matrix["pairs"]}


class TestMatrix:
    """Every pair of the jobs is run, and each pair's outcome is in the matrix."""

    def test_only_the_pair_in_opposite_order_deadlocks(self, dsn, schema):
        """1-2 against 2-1 deadlocks; against 3-4 neither does; exit 1."""
        status, matrix = matrix_json(
            "--job", updates(dsn, schema, 1, 2),
            "--job", updates(dsn, schema, 2, 1),
            "--job", updates(dsn, schema, 3, 4),
            "--runs", "2", "--dsn", dsn,
        )  # fmt: skip
        assert status == 1
        assert outcomes(matrix) == {(1, 2): "deadlocked", (1, 3): "clean", (2, 3): "clean"}
        deadlocked = matrix["pairs"][0]["report"]
        assert deadlocked["cycles"][0]["advice"]["shape"] == "rows in opposite order"

    def test_each_pair_runs_in_both_orders(self, dsn, schema):
        """Of each pair's two attempts, one starts A first and the other B."""
        _, matrix = matrix_json(
            "--job", updates(dsn, schema, 1), "--job", updates(dsn, schema, 3),
            "--job", updates(dsn, schema, 4), "--runs", "2", "--dsn", dsn,
        )  # fmt: skip
        for pair in matrix["pairs"]:
            firsts = [attempt["first"] for attempt in pair["report"]["attempts"]]
            assert sorted(firsts) == ["A", "B"], pair["jobs"]

    def test_a_failing_job_makes_its_pairs_failed_and_exit_0(self, dsn, schema):
        """A command that exits 3 is no deadlock: failed, exit 0."""
        failing = shlex.join([sys.executable, "-c", "raise SystemExit(3)"])
        status, matrix = matrix_json(
            "--job", updates(dsn, schema, 1), "--job", failing, "--runs", "2", "--dsn", dsn
        )
        assert status == 0
        assert outcomes(matrix) == {(1, 2): "failed"}

    def test_human_matrix_has_the_table_and_the_fix(self, dsn, schema):
        """A row per job, and the suggested fix under the pair that deadlocked."""
        result = invoke(
            "--job", updates(dsn, schema, 1, 2), "--job", updates(dsn, schema, 2, 1),
            "--runs", "2", "--dsn", dsn,
        )  # fmt: skip
        assert result.return_value == 1, result.output
        lines = result.stdout.splitlines()
        assert lines[3].split() == ["J1", "J2"], result.stdout
        assert lines[4].split() == ["J1", "-", "deadlocked"], result.stdout
        assert lines[5].split() == ["J2", "deadlocked", "-"], result.stdout
        assert any(line.startswith("  suggested fix: lock ") for line in lines), result.stdout
        assert lines[-1] == "deadlock in 1 of 1 pairs"


class TestMatrixCommands:
    """A --job command that cannot be run is named as the --job it is."""

    def test_a_missing_command_names_its_job(self, dsn):
        """Exit 127 and ``--job J2`` in the message, not --second."""
        result = invoke("--job", "true", "--job", "./no-such-job", "--runs", "2", "--dsn", dsn)
        assert isinstance(result.exception, ExecFailed), result.exception
        assert result.exception.exit_code == 127
        assert str(result.exception).startswith("--job J2: ./no-such-job: "), result.exception


class TestMatrixUsage:
    """--job's usage errors: exit 64, nothing run."""

    @pytest.mark.parametrize(
        "args",
        [
            ["--job", "true", "--job", "true", "--first", "true"],
            ["--job", "true"],
            ["--job", "true", "--job", "true", "--runs", "1"],
        ],
        ids=["with-first", "one-job", "one-run"],
    )
    def test_usage_error(self, args):
        """One-line usage error, before any database is needed."""
        result = invoke(*args, "--dsn", "host=127.0.0.1 port=1", "--connect-timeout", "1s")
        assert isinstance(result.exception, UsageError), result.exception
        assert "\n" not in str(result.exception)
