"""``jobrun deadlocks``' suggested fix, read from logs a real server wrote for each shape."""

from __future__ import annotations

import subprocess
import time
import uuid
from typing import TYPE_CHECKING

import psycopg
import pytest

from harness import overlap_scenarios
from harness.jobrun_cli import JOBRUN
from harness.overlap_scenarios import Scenario
from harness.pgserver import PgServer
from jobrun.analysis import deadlocks
from jobrun.analysis.deadlocks.advice import suggest

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

#: How long the logging collector may take to write a line out.
LOG_WAIT = 30.0
#: A foreign key check that waits: each job locks one parent, then inserts a child of the
#: other parent, whose check (FOR KEY SHARE of that parent) waits.
FOREIGN_KEY = Scenario(
    "foreign key check waits",
    (
        "SELECT * FROM {s}.parents WHERE id = 1 FOR UPDATE",
        "INSERT INTO {s}.children (parent_id) VALUES (2)",
    ),
    (
        "SELECT * FROM {s}.parents WHERE id = 2 FOR UPDATE",
        "INSERT INTO {s}.children (parent_id) VALUES (1)",
    ),
    deadlocks=True,
)
SCENARIOS = {s.name: s for s in (*overlap_scenarios.SCENARIOS, FOREIGN_KEY)}
#: Scenario -> the shape the log shows (a foreign key's key-share lock held by an earlier
#: insert is not in the log: that cycle reads as rows in opposite order).
SHAPES = {
    "opposite row order": "rows in opposite order",
    "foreign key: child's key-share lock vs parent change": "rows in opposite order",
    "foreign key check waits": "a foreign key's share lock against a parent change",
    "lock upgrade: FOR SHARE, then UPDATE": "a shared lock upgraded",
    "advisory locks in opposite order": "advisory locks in opposite order",
    "unique keys inserted in opposite order": "the same unique key inserted",
    "table lock (a migration) against row locks": "a table lock against row locks",
}


@pytest.fixture(scope="module")
def logging_server() -> Iterator[PgServer]:
    """A private server logging to a stderr file, with a short deadlock_timeout."""
    started = PgServer.start(
        {
            "logging_collector": "on",
            "log_directory": "log",
            "log_filename": "pg",
            "log_line_prefix": "%m [%p] %q%u@%d %a ",
            "deadlock_timeout": "200ms",
        }
    )
    with started:
        yield started


def logged(server: PgServer, name: str, tmp_path: Path) -> Path:
    """Run scenario ``name`` once with jobrun overlap; the part of the log it wrote."""
    log = server.data_dir / "log" / "pg"
    offset = log.stat().st_size
    schema = f"advice_{uuid.uuid4().hex[:8]}"
    dsn = server.dsn()
    overlap_scenarios.create_schema(dsn, schema)
    scenario = SCENARIOS[name]
    result = subprocess.run(
        [
            *JOBRUN, "overlap", "--runs", "1", "--dsn", dsn,
            "--first", scenario.command(dsn, schema, "A"),
            "--second", scenario.command(dsn, schema, "B"),
        ],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 1, result.stdout + result.stderr
    marker = f"jobrun-test-marker-{uuid.uuid4().hex}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DO $$BEGIN RAISE LOG '{marker}'; END$$")
    deadline = time.monotonic() + LOG_WAIT
    while marker.encode() not in log.read_bytes()[offset:]:
        assert time.monotonic() < deadline, "the marker never reached the log"
        time.sleep(0.05)
    part = tmp_path / "part.log"
    part.write_bytes(log.read_bytes()[offset:])
    return part


class TestSuggestion:
    """Each shape of deadlock, as the server logged it, gets its own suggested fix."""

    @pytest.mark.parametrize("name", list(SHAPES), ids=list(SHAPES))
    def test_shape_from_the_log(self, logging_server, tmp_path, name):
        """The suggestion's shape is the one the log allows telling."""
        found = deadlocks.find([str(logged(logging_server, name, tmp_path))])
        assert found.deadlocks, deadlocks.report(found)
        suggestion = suggest(found.deadlocks[0])
        assert suggestion is not None, deadlocks.report(found)
        assert suggestion.shape == SHAPES[name], deadlocks.report(found)

    def test_report_labels_it_and_json_carries_it(self, logging_server, tmp_path):
        """``suggested fix (...):`` under the deadlock; ``suggested_fix`` in --json."""
        part = logged(logging_server, "advisory locks in opposite order", tmp_path)
        found = deadlocks.find([str(part)])
        text = deadlocks.report(found)
        assert (
            "  suggested fix (advisory locks in opposite order): take advisory locks in "
            "ascending key order in every job (1, then 2)"
        ) in text.splitlines(), text
        fix = deadlocks.json_of(found)["deadlocks"][0]["suggested_fix"]
        assert fix["shape"] == "advisory locks in opposite order"
