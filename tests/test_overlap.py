"""``jobrun overlap`` against a real PostgreSQL: deadlocks caught, fixes confirmed, jobs killed."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
import psycopg
import pytest
from click.testing import CliRunner
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harness import jobrun_cli, overlap_scenarios
from jobrun import db
from jobrun.analysis import overlap
from jobrun.analysis.overlap.model import SessionRow
from jobrun.cli.overlap import overlap_command
from jobrun.exitcodes import JobrunError, LockStoreUnavailable, UsageError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

#: A job: BEGIN; UPDATE row FIRST; wait (bounded) until the other job holds its first row,
#: waits for ours, or is gone; UPDATE row SECOND; COMMIT. Rows 1 then 2 against rows 2 then
#: 1 deadlock every time; the same order on both sides never does.
JOB = """
import os, sys, time
import psycopg

dsn, table, first, second = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
other = "B" if os.environ["JOBRUN_OVERLAP_ROLE"] == "A" else "A"
other_app = f"jobrun-overlap:{other}:{os.environ['JOBRUN_OVERLAP_ATTEMPT']}"
update = "UPDATE {} SET balance = balance + 1 WHERE id = {}"
with psycopg.connect(dsn, autocommit=True) as conn, psycopg.connect(
    dsn, autocommit=True, application_name="overlap-test-probe"
) as probe:
    try:
        conn.execute("SET deadlock_timeout = '200ms'")  # keeps the test fast (superuser only)
    except psycopg.errors.InsufficientPrivilege:
        pass

    def other_state():
        return probe.execute(
            "SELECT backend_xid IS NOT NULL OR wait_event_type = 'Lock' FROM pg_stat_activity"
            " WHERE application_name = %s AND datname = current_database()",
            (other_app,),
        ).fetchone()

    seen = other_state() is not None
    conn.execute("BEGIN")
    conn.execute(update.format(table, first))
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        row = other_state()
        if row is None and seen:
            break
        if row is not None:
            seen = True
            if row[0]:
                break
        time.sleep(0.01)
    conn.execute(update.format(table, second))
    conn.execute("COMMIT")
"""

#: B: exits 1 unless one of A's sessions is inside a transaction right now; then says done.
B_CHECKS_A = """
import os, sys
import psycopg

attempt = os.environ["JOBRUN_OVERLAP_ATTEMPT"]
with psycopg.connect(sys.argv[1], autocommit=True, application_name="overlap-test-probe") as c:
    row = c.execute(
        "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s"
        " AND xact_start IS NOT NULL AND datname = current_database()",
        (f"jobrun-overlap:A:{attempt}",),
    ).fetchone()
open(sys.argv[2], "w").close()
sys.exit(0 if row[0] else 1)
"""

#: A: BEGIN, then wait (bounded) until B says it is done, then COMMIT.
A_WAITS_FOR_B = """
import os, sys, time
import psycopg

with psycopg.connect(sys.argv[1], autocommit=True) as conn:
    conn.execute("BEGIN")
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not os.path.exists(sys.argv[2]):
        time.sleep(0.01)
    conn.execute("COMMIT")
"""

#: A job that updates row 1 and waits for as long as it takes.
UPDATE_ROW_1 = """
import sys
import psycopg

with psycopg.connect(sys.argv[1]) as conn:
    conn.execute(f"UPDATE {sys.argv[2]} SET balance = balance + 1 WHERE id = 1")
"""

#: A: writes its pid, updates row 1 and waits (bounded) for B's file; then row 2, COMMIT.
A_UPDATES_AND_WAITS = """
import os, sys, time
from pathlib import Path
import psycopg

dsn, table, pid_file, b_file = sys.argv[1:]
Path(pid_file).write_text(str(os.getpid()))
with psycopg.connect(dsn) as conn:
    conn.execute(f"UPDATE {table} SET balance = balance + 1 WHERE id = 1")
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and not os.path.exists(b_file):
        time.sleep(0.01)
    conn.execute(f"UPDATE {table} SET balance = balance + 1 WHERE id = 2")
"""

#: B: writes the state of A's process right now (T: stopped) to its file.
B_SEES_A = """
import sys
from pathlib import Path

pid = int(Path(sys.argv[1]).read_text())
state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
Path(sys.argv[2]).write_text(state)
"""

#: A: a short idle_in_transaction_session_timeout of its own, row 1, 0.3 s of work, row 2.
A_WITH_IDLE_TIMEOUT = """
import sys, time
import psycopg

with psycopg.connect(sys.argv[1]) as conn:
    conn.execute("SET idle_in_transaction_session_timeout = '500ms'")
    conn.execute(f"UPDATE {sys.argv[2]} SET balance = balance + 1 WHERE id = 1")
    time.sleep(0.3)
    conn.execute(f"UPDATE {sys.argv[2]} SET balance = balance + 1 WHERE id = 2")
"""

#: Row 1, 0.3 s of work, row 2: a job A that is held at its first statement.
UPDATE_1_THEN_2 = """
import sys, time
import psycopg

with psycopg.connect(sys.argv[1]) as conn:
    conn.execute(f"UPDATE {sys.argv[2]} SET balance = balance + 1 WHERE id = 1")
    time.sleep(0.3)
    conn.execute(f"UPDATE {sys.argv[2]} SET balance = balance + 1 WHERE id = 2")
"""

#: Every field of ``jobrun overlap --json`` (docs/overlap.md).
REPORT_FIELDS = {
    "database",
    "first",
    "second",
    "runs",
    "start",
    "attempts_run",
    "deadlocks",
    "first_deadlock",
    "cycles_without_deadlock_error",
    "server_timeouts",
    "timeouts",
    "failed",
    "clean",
    "waits_observed",
    "exit_status",
    "cycles",
    "attempts",
    "notes",
}
ATTEMPT_FIELDS = {
    "attempt",
    "outcome",
    "first",
    "hold_at",
    "second_started",
    "held_seconds",
    "resumed",
    "timed_out",
    "duration",
    "exit_codes",
    "pids",
    "statements",
    "cycle",
    "advice",
    "waits",
    "deadlock_lines",
    "server_timeout_lines",
    "output_tail",
    "notes",
}
WAIT_FIELDS = {"job", "pid", "query", "lock", "held_by", "text"}


@pytest.fixture
def accounts(dsn: str) -> Iterator[str]:
    """A table of this test's own with rows 1 and 2."""
    table = f"overlap_accounts_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"CREATE TABLE {table} (id int PRIMARY KEY, balance int NOT NULL)")
        conn.execute(f"INSERT INTO {table} VALUES (1, 0), (2, 0)")  # noqa: S608 - our own name
    yield table
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP TABLE {table}")


def job(dsn: str, table: str, first: int, second: int) -> str:
    """The --first/--second text of a job that updates row ``first``, then row ``second``."""
    return shlex.join([sys.executable, "-c", JOB, dsn, table, str(first), str(second)])


@pytest.fixture
def overlap_cli() -> Callable[..., click.testing.Result]:
    """``overlap_cli(*args) -> Result``: ``jobrun overlap`` on a throwaway group, in-process."""
    group = click.Group(commands=[overlap_command])
    runner = CliRunner()

    def invoke(*args: str) -> click.testing.Result:
        return runner.invoke(group, ["overlap", *args], standalone_mode=False)

    return invoke


def exit_status(result: click.testing.Result) -> int:
    """The status jobrun's main() turns this result into (ClickException: 64)."""
    if isinstance(result.exception, click.ClickException):
        return 64
    if isinstance(result.exception, JobrunError):
        return result.exception.exit_code
    assert result.exception is None, result.exception
    return int(result.return_value)


def report_json(result: click.testing.Result) -> dict[str, Any]:
    """The --json report, checked for its documented fields."""
    assert result.exception is None, f"{result.exception!r}\n{result.output}"
    report = json.loads(result.stdout)
    assert set(report) == REPORT_FIELDS
    for attempt in report["attempts"]:
        assert set(attempt) == ATTEMPT_FIELDS
    return report


class TestDeadlock:
    """Two jobs that take the same rows in opposite orders."""

    def test_opposite_orders_deadlock_every_attempt(self, overlap_cli, dsn, accounts):
        """3 attempts, 3 deadlocks, exit 1; the cycle names both statements and the table."""
        result = overlap_cli(
            "--first", job(dsn, accounts, 1, 2), "--second", job(dsn, accounts, 2, 1),
            # A first every time: the cycle's shape below names A's and B's statements.
            "--runs", "3", "--dsn", dsn, "--timeout", "20s", "--order", "as-given", "--json",
        )  # fmt: skip
        report = report_json(result)
        assert exit_status(result) == 1
        assert report["deadlocks"] == 3, result.stdout
        assert [a["outcome"] for a in report["attempts"]] == ["deadlock"] * 3
        assert all(a["second_started"] == "held" for a in report["attempts"])
        # The held job was resumed once the other one blocked on its row, and not before.
        assert all(a["resumed"] == "second_waits" for a in report["attempts"])
        cycles = report["cycles"]
        # Every attempt saw a cycle. Usually all three look alike and group into one; on a
        # loaded machine a snapshot can catch a side in a slightly different state, so the
        # same deadlock may be listed as two shapes: check each one, not their number.
        assert sorted(n for cycle in cycles for n in cycle["attempts"]) == [1, 2, 3], cycles
        for cycle in cycles:
            waits = {wait["job"]: wait for wait in cycle["waits"]}
            assert set(waits) == {"A", "B"}, cycle
            assert waits["A"]["query"].endswith("WHERE id = 2"), cycle
            assert waits["B"]["query"].endswith("WHERE id = 1"), cycle
            assert waits["A"]["held_by"] == {"job": "B", "pid": waits["B"]["pid"]}
            assert waits["B"]["held_by"] == {"job": "A", "pid": waits["A"]["pid"]}
            for wait in waits.values():
                assert set(wait) == WAIT_FIELDS
                # None: the snapshot saw the session blocked before its lock row showed.
                if wait["lock"] is not None:
                    assert wait["lock"]["mode"] in ("ShareLock", "ExclusiveLock"), cycle
        # At least one attempt caught the whole cycle, every lock named.
        complete = [c for c in cycles if all(w["lock"] is not None for w in c["waits"])]
        assert complete, cycles
        for wait in complete[0]["waits"]:
            assert wait["lock"]["locktype"] == "transactionid", complete[0]
            # jobrun's sessions name relations from pg_catalog's view: schema-qualified.
            assert wait["lock"]["row_relation"] == f"public.{accounts}", complete[0]
        errors = [line for a in report["attempts"] for lines in a["deadlock_lines"].values()
                  for line in lines]  # fmt: skip
        assert any("deadlock detected" in line for line in errors)

    def test_human_report_shows_the_cycle_and_the_error(self, overlap_cli, dsn, accounts):
        """One line per side of the cycle: job, pid, lock, holder, statement; then the error."""
        result = overlap_cli(
            "--first", job(dsn, accounts, 1, 2), "--second", job(dsn, accounts, 2, 1),
            "--runs", "1", "--dsn", dsn, "--timeout", "20s",
        )  # fmt: skip
        assert exit_status(result) == 1, result.output
        out = result.stdout
        assert "1 attempt, 1 deadlock (1/1)" in out
        update = f"UPDATE {accounts} SET balance = balance + 1 WHERE id = "  # noqa: S608 - text
        a_line = next(line for line in out.splitlines() if line.startswith("  A (pid "))
        b_line = next(line for line in out.splitlines() if line.startswith("  B (pid "))
        assert "waits for ShareLock on transaction" in a_line
        assert f"of public.{accounts})" in a_line
        assert "held by B (pid " in a_line
        assert a_line.endswith(f"while running: {update}2")
        assert "held by A (pid " in b_line
        assert b_line.endswith(f"while running: {update}1")
        assert "deadlock error (attempt 1):" in out
        assert "deadlock detected" in out
        assert out.rstrip().endswith("deadlock in 1 of 1 attempt")


class TestFixed:
    """The same two jobs after the lock-ordering fix."""

    def test_same_order_never_deadlocks(self, overlap_cli, dsn, accounts):
        """Both take row 1 then row 2: 0 deadlocks in 3 attempts, exit 0."""
        result = overlap_cli(
            "--first", job(dsn, accounts, 1, 2), "--second", job(dsn, accounts, 1, 2),
            "--runs", "3", "--dsn", dsn, "--timeout", "20s", "--json",
        )  # fmt: skip
        report = report_json(result)
        assert exit_status(result) == 0
        assert report["deadlocks"] == 0
        assert report["cycles"] == []
        assert [a["outcome"] for a in report["attempts"]] == ["clean"] * 3
        assert all(a["exit_codes"] == {"A": 0, "B": 0} for a in report["attempts"])

    def test_human_report_says_no_deadlock(self, overlap_cli, dsn, accounts):
        """The last line says so, for a CI log."""
        result = overlap_cli(
            "--first", job(dsn, accounts, 1, 2), "--second", job(dsn, accounts, 1, 2),
            "--runs", "2", "--dsn", dsn, "--timeout", "20s",
        )  # fmt: skip
        assert exit_status(result) == 0, result.output
        assert "2 attempts, 0 deadlocks (0/2)" in result.stdout
        assert result.stdout.rstrip().endswith("no deadlock in 2 attempts")


class TestStartingB:
    """When B starts."""

    def test_inside_starts_b_while_a_is_inside_a_transaction(self, overlap_cli, dsn, tmp_path):
        """--start inside: B finds A's session inside a transaction (B exits 1 otherwise)."""
        done = tmp_path / "b-done"
        first = shlex.join([sys.executable, "-c", A_WAITS_FOR_B, dsn, str(done)])
        second = shlex.join([sys.executable, "-c", B_CHECKS_A, dsn, str(done)])
        result = overlap_cli(
            "--first", first, "--second", second, "--runs", "1", "--dsn", dsn, "--json",
            "--start", "inside",
        )  # fmt: skip
        (attempt,) = report_json(result)["attempts"]
        assert attempt["second_started"] == "inside_transaction"
        assert attempt["held_seconds"] is None
        assert attempt["outcome"] == "clean", attempt

    def test_b_starts_anyway_when_a_ends_without_a_transaction(self, overlap_cli, dsn):
        """A never touches the database: B still runs, and the report says why."""
        result = overlap_cli("--first", "true", "--second", "true", "--dsn", dsn, "--runs", "2")
        assert exit_status(result) == 0, result.output
        assert "attempt 1: A finished before its statement 1 was seen inside a transaction" in (
            result.stdout
        )
        assert "attempt 2: B finished before its statement 1" in result.stdout
        assert "no database session of A was seen" in result.stdout

    def test_start_after_a_delay(self, overlap_cli, dsn):
        """--start 50ms starts B after the delay, whatever A does."""
        result = overlap_cli(
            "--first", "sleep 5", "--second", "true", "--dsn", dsn, "--runs", "1",
            "--start", "50ms", "--timeout", "1s", "--json",
        )  # fmt: skip
        (attempt,) = report_json(result)["attempts"]
        assert attempt["second_started"] == "after_delay"
        assert attempt["exit_codes"]["B"] == 0


class TestTimeout:
    """An attempt that runs over its --timeout."""

    def test_timeout_kills_both_process_groups(self, overlap_cli, dsn):
        """Both commands and everything they started are killed; the attempt counts as timeout."""
        stuck = "sh -c 'sleep 60 & exec sleep 60'"
        result = overlap_cli(
            "--first", stuck, "--second", stuck, "--dsn", dsn, "--runs", "1",
            "--start", "together", "--timeout", "1s", "--json",
        )  # fmt: skip
        report = report_json(result)
        (attempt,) = report["attempts"]
        assert attempt["outcome"] == "timeout"
        assert attempt["timed_out"] is True
        assert attempt["exit_codes"] == {"A": 137, "B": 137}
        assert attempt["duration"] < 10
        for pid in attempt["pids"].values():
            jobrun_cli.wait_until(lambda pid=pid: jobrun_cli.group_gone(pid), timeout=5)
        assert report["timeouts"] == 1
        assert exit_status(result) == 0  # no deadlock happened

    def test_timeout_before_a_opens_a_transaction(self, overlap_cli, dsn):
        """A never opens a transaction within the time: B is never started."""
        result = overlap_cli(
            "--first", "sleep 60", "--second", "true", "--dsn", dsn, "--runs", "1",
            "--timeout", "300ms", "--json",
        )  # fmt: skip
        (attempt,) = report_json(result)["attempts"]
        assert attempt["outcome"] == "timeout"
        assert attempt["second_started"] == "not_started"
        assert attempt["exit_codes"] == {"A": 137, "B": None}
        jobrun_cli.wait_until(lambda: jobrun_cli.group_gone(attempt["pids"]["A"]), timeout=5)

    def test_timeout_ends_the_killed_commands_sessions(self, overlap_cli, dsn, accounts):
        """Sessions stuck behind a lock outlive their killed clients: they are terminated."""
        blocked = shlex.join([sys.executable, "-c", UPDATE_ROW_1, dsn, accounts])
        names = ["jobrun-overlap:A:1", "jobrun-overlap:B:1"]
        with psycopg.connect(dsn, autocommit=True) as holder:
            holder.execute("BEGIN")
            holder.execute(f"UPDATE {accounts} SET balance = 0 WHERE id = 1")  # noqa: S608
            result = overlap_cli(
                "--first", blocked, "--second", blocked, "--dsn", dsn, "--runs", "1",
                "--timeout", "1500ms", "--json",
            )  # fmt: skip
            left = holder.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = ANY(%s)"
                " AND datname = current_database()",
                (names,),
            ).fetchone()
            holder.execute("ROLLBACK")
        report = report_json(result)
        (attempt,) = report["attempts"]
        assert attempt["outcome"] == "timeout"
        assert left == (0,)
        holders = {wait["held_by"]["job"] for wait in attempt["waits"]}
        assert "other" in holders, attempt["waits"]


class TestCycles:
    """Finding a wait-for cycle in one look at the sessions."""

    def test_two_sessions(self):
        """A waits for B, B waits for A."""
        cycle = overlap.find_cycle(
            [
                overlap.Session("B", 20, in_transaction=True, query="q2", blocked_by=(10,)),
                overlap.Session("A", 10, in_transaction=True, query="q1", blocked_by=(20,)),
            ]
        )
        assert cycle is not None
        assert [(w.job, w.pid, w.holder_job, w.holder_pid) for w in cycle] == [
            ("A", 10, "B", 20),
            ("B", 20, "A", 10),
        ]

    def test_through_a_second_session_of_a(self):
        """A1 waits for B, B waits for A2, A2 waits for A1: one cycle of three."""
        cycle = overlap.find_cycle(
            [
                overlap.Session("A", 10, in_transaction=True, query="", blocked_by=(30,)),
                overlap.Session("A", 11, in_transaction=True, query="", blocked_by=(10,)),
                overlap.Session("B", 30, in_transaction=True, query="", blocked_by=(11, 99)),
            ]
        )
        assert cycle is not None
        assert [w.pid for w in cycle] == [10, 30, 11]

    def test_waits_without_a_cycle(self):
        """Both blocked by an outsider: waits, but no cycle."""
        assert (
            overlap.find_cycle(
                [
                    overlap.Session("A", 10, in_transaction=True, query="", blocked_by=(99,)),
                    overlap.Session("B", 20, in_transaction=True, query="", blocked_by=(10,)),
                ]
            )
            is None
        )

    @pytest.mark.parametrize("waiting", [True, False])
    def test_a_torn_look_is_no_wait(self, waiting):
        """Blockers beside an activity row that is not waiting are from a later instant.

        pg_stat_activity is one snapshot, pg_blocking_pids() and pg_locks are read after it:
        a job that sent its next statement in between shows the new blocker beside the old
        statement. Such a row must not make a wait, nor a cycle with the wrong statement.
        """
        row = SessionRow(
            pid=10, name="jobrun-overlap:A:1", in_transaction=True, holds_lock=True,
            waiting=waiting, query_start=None, query="UPDATE t SET x = 1 WHERE id = 1",
            blocked_by=[20], locktype="transactionid", mode="ShareLock", relation=None,
            ident="7", row_relation="t", row="(0,2)",
        )  # fmt: skip
        a = overlap.Session.from_row(row, "A", row.query or "")
        b = overlap.Session("B", 20, in_transaction=True, query="q", blocked_by=(10,))
        assert (a.blocked_by, a.lock is not None) == (((20,), True) if waiting else ((), False))
        assert (overlap.find_cycle([a, b]) is not None) is waiting

    def test_wait_sentence(self):
        """The sentence the report prints for one edge."""
        lock = overlap.Lock("transactionid", "ShareLock", None, "456", "(0,2)", "accounts")
        wait = overlap.Wait("A", 123, "UPDATE accounts SET x = 1 WHERE id = 2", lock, "B", 124)
        assert wait.describe() == (
            "A (pid 123) waits for ShareLock on transaction 456 (row (0,2) of accounts) "
            "held by B (pid 124) while running: UPDATE accounts SET x = 1 WHERE id = 2"
        )


class TestBadInput:
    """Bad flags are usage errors (exit 64, one line), found before anything runs."""

    @pytest.mark.parametrize(
        "args",
        [
            ["--first", "true"],
            ["--first", "true", "--second", "true", "--runs", "0"],
            ["--first", "true", "--second", "true", "--runs", "many"],
            ["--first", "'unclosed", "--second", "true"],
            ["--first", "  ", "--second", "true"],
            ["--first", "true", "--second", "true", "--timeout", "soon"],
            ["--first", "true", "--second", "true", "--timeout", "0"],
            ["--first", "true", "--second", "true", "--start", "later"],
            ["--first", "true", "--second", "true", "--start", "2m", "--timeout", "1m"],
            ["--first", "true", "--second", "true", "--order", "random"],
        ],
        ids=[
            "missing-second",
            "zero-runs",
            "runs-not-a-number",
            "unclosed-quote",
            "empty-command",
            "bad-timeout",
            "zero-timeout",
            "bad-start",
            "start-delay-beyond-timeout",
            "bad-order",
        ],
    )
    def test_usage_error(self, overlap_cli, args):
        """Exit 64 with a one-line message, and no database is needed to say so."""
        result = overlap_cli(*args, "--dsn", "host=127.0.0.1 port=1", "--connect-timeout", "1s")
        assert exit_status(result) == 64, result.exception
        message = (
            result.exception.format_message()
            if isinstance(result.exception, click.ClickException)
            else str(result.exception)
        )
        assert "\n" not in message.strip()
        assert isinstance(result.exception, (click.ClickException, UsageError))


class TestDatabase:
    """The watched database."""

    def test_unreachable_database_runs_nothing(self, overlap_cli, tmp_path):
        """Exit 69, and neither command was started."""
        marker = tmp_path / "ran"
        touch = shlex.join(["touch", str(marker)])
        result = overlap_cli(
            "--first", touch, "--second", touch,
            "--dsn", "host=127.0.0.1 port=1", "--connect-timeout", "1s",
        )  # fmt: skip
        assert isinstance(result.exception, LockStoreUnavailable)
        assert exit_status(result) == 69
        assert not marker.exists()

    @pytest.mark.parametrize("as_json", [False, True], ids=["text", "json"])
    def test_report_never_shows_the_password(self, overlap_cli, dsn, as_json):
        """Not in the database line, nor in a command, nor in a command's output."""
        password = conninfo_to_dict(dsn).get("password") or f"pw-{uuid.uuid4().hex}"
        with_password = make_conninfo(dsn, password=password)
        leaky = shlex.join(["sh", "-c", f"echo 'password={password}' >&2; exit 3"])
        result = overlap_cli(
            "--first", leaky, "--second", f"echo {password}", "--dsn", with_password,
            "--runs", "1", *(["--json"] if as_json else []),
        )  # fmt: skip
        assert exit_status(result) == 0, result.output
        assert password not in result.output
        assert "password=***" in result.stdout
        database = conninfo_to_dict(dsn)["dbname"]
        assert f"/{database}" in result.stdout


class TestThroughCli:
    """``python -m jobrun overlap``: the command as the console script runs it."""

    def test_help(self, jobrun_here):
        """--help describes the command and exits 0."""
        result = jobrun_here.run("overlap", "--help", dsn=None)
        assert result.returncode == 0, result.stderr
        assert "--start" in result.stdout
        assert "--order" in result.stdout

    def test_missing_second_is_exit_64_on_one_line(self, dsn):
        """One error line on stderr, nothing started."""
        result = jobrun_cli.run("overlap", "--first", "true", dsn=dsn)
        assert result.returncode == 64
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "--second" in result.stderr

    def test_unreachable_database_is_exit_69(self, jobrun_here):
        """No database to watch: exit 69 with one line."""
        result = jobrun_here.run(
            "overlap", "--first", "true", "--second", "true", "--connect-timeout", "1s",
            dsn="host=127.0.0.1 port=1",
        )  # fmt: skip
        assert result.returncode == 69
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr

    def test_deadlock_is_exit_1_and_fixed_is_exit_0(self, dsn, accounts):
        """The CI use: the deadlocking pair fails, the fixed pair passes."""
        broken = jobrun_cli.run(
            "overlap", "--first", job(dsn, accounts, 1, 2), "--second", job(dsn, accounts, 2, 1),
            "--runs", "1", dsn=dsn,
        )  # fmt: skip
        assert broken.returncode == 1, broken.stdout + broken.stderr
        assert "1 deadlock (1/1)" in broken.stdout
        fixed = jobrun_cli.run(
            "overlap", "--first", job(dsn, accounts, 1, 2), "--second", job(dsn, accounts, 1, 2),
            "--runs", "1", dsn=dsn,
        )  # fmt: skip
        assert fixed.returncode == 0, fixed.stdout + fixed.stderr


class TestStopped:
    """``jobrun overlap`` itself is stopped mid-attempt."""

    @pytest.mark.parametrize(
        "signum",
        [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGUSR1],
        ids=["TERM", "HUP", "INT", "QUIT", "USR1"],
    )
    def test_signal_kills_both_commands_and_ends_their_sessions(
        self, dsn, accounts, tmp_path, signum
    ):
        """Both commands wait behind a third session's row lock: nothing of them is left."""
        marker = tmp_path / "pids"
        blocked = shlex.join(
            ["sh", "-c", f'echo $$ >> "{marker}"; exec "$0" "$@"',
             sys.executable, "-c", UPDATE_ROW_1, dsn, accounts]
        )  # fmt: skip
        names = ["jobrun-overlap:A:1", "jobrun-overlap:B:1"]
        count = (
            "SELECT count(*) FROM pg_stat_activity WHERE application_name = ANY(%s)"
            " AND datname = current_database()"
        )
        with (
            psycopg.connect(dsn, autocommit=True) as holder,
            psycopg.connect(dsn, autocommit=True) as watcher,  # autocommit: fresh snapshots
        ):
            holder.execute("BEGIN")
            holder.execute(f"UPDATE {accounts} SET balance = 0 WHERE id = 1")  # noqa: S608
            proc = subprocess.Popen(
                [*jobrun_cli.JOBRUN, "overlap", "--first", blocked, "--second", blocked,
                 "--runs", "1", "--timeout", "100s"],
                env=jobrun_cli.environment(dsn),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                # Under nohup (or a shell's background job) the signal arrives ignored, and
                # jobrun rightly keeps it so: the test is about a signal that is not ignored.
                preexec_fn=lambda: signal.signal(signum, signal.SIG_DFL),  # noqa: PLW1509
            )  # fmt: skip
            try:
                jobrun_cli.wait_until(
                    lambda: watcher.execute(count + " AND wait_event_type = 'Lock'", (names,))
                    .fetchone() == (2,),
                    what="both commands waiting for the row",
                )  # fmt: skip
                proc.send_signal(signum)
                stdout, stderr = proc.communicate(timeout=60)
                left = watcher.execute(count, (names,)).fetchone()
            finally:
                proc.kill()
                proc.communicate()
                pids = [int(pid) for pid in marker.read_text().split()]
                for pid in pids:
                    if not jobrun_cli.group_gone(pid):
                        with contextlib.suppress(ProcessLookupError):
                            os.killpg(pid, signal.SIGKILL)
                holder.execute("ROLLBACK")
        name = signal.Signals(signum).name
        assert proc.returncode == 128 + signum, stdout + stderr
        assert stderr.strip() == (
            ""  # Ctrl-C: quiet, as everywhere in jobrun
            if signum == signal.SIGINT
            else f"jobrun: error: interrupted by {name}: the commands were killed and their "
            "database sessions ended"
        )
        assert len(pids) == 2
        assert all(jobrun_cli.group_gone(pid) for pid in pids)
        assert left == (0,)


class TestSecrets:
    """Bad input never echoes a password."""

    @pytest.mark.parametrize("option", ["--first", "--second"])
    def test_quoting_error_masks_the_password(self, jobrun_here, option):
        """A connection string in an unclosed quote: exit 64, one line, password masked."""
        command = "psql postgresql://postgres:Secr3tPw@127.0.0.1/x '"
        other = "--second" if option == "--first" else "--first"
        result = jobrun_here.run(
            "overlap", option, command, other, "true", dsn="host=127.0.0.1 port=1"
        )
        assert result.returncode == 64, result.stderr
        assert "Secr3tPw" not in result.stderr + result.stdout
        assert result.stderr.strip() == (
            f'jobrun: error: {option} "psql postgresql://postgres:***@127.0.0.1/x \'": '
            "No closing quotation"
        )


def python_job(script: str, *args: str) -> str:
    """The --first/--second text of ``python -c script args...``."""
    return shlex.join([sys.executable, "-c", script, *args])


def process_state(pid: int) -> str | None:
    """The state letter of ``pid`` (T: stopped), None when it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return stat.rsplit(")", 1)[1].split()[0]


class TestHold:
    """--start hold (the default): the first job is stopped at its transaction meanwhile."""

    def test_b_runs_while_a_is_stopped_inside_its_transaction(
        self, overlap_cli, dsn, accounts, tmp_path
    ):
        """B sees A's process stopped (T); A is resumed when B exits, and finishes."""
        pid_file, b_file = tmp_path / "a-pid", tmp_path / "b-saw"
        result = overlap_cli(
            "--first", python_job(A_UPDATES_AND_WAITS, dsn, accounts, str(pid_file), str(b_file)),
            "--second", python_job(B_SEES_A, str(pid_file), str(b_file)),
            "--runs", "1", "--dsn", dsn, "--timeout", "60s", "--json",
        )  # fmt: skip
        (attempt,) = report_json(result)["attempts"]
        assert b_file.read_text() == "T", attempt
        assert attempt["first"] == "A"
        assert attempt["hold_at"] == 1
        assert attempt["second_started"] == "held"
        assert attempt["resumed"] == "second_exited"
        assert attempt["outcome"] == "clean", attempt
        assert attempt["exit_codes"] == {"A": 0, "B": 0}

    def test_a_session_ended_by_the_server_while_held_is_no_clean_attempt(
        self, overlap_cli, dsn, accounts
    ):
        """A's own idle_in_transaction_session_timeout ends it while held: server_timeout."""
        result = overlap_cli(
            "--first", python_job(A_WITH_IDLE_TIMEOUT, dsn, accounts),
            "--second", "sleep 5", "--order", "as-given",
            "--runs", "1", "--dsn", dsn, "--timeout", "60s", "--json",
        )  # fmt: skip
        report = report_json(result)
        (attempt,) = report["attempts"]
        assert attempt["resumed"] == "session_ended", attempt
        assert attempt["outcome"] == "server_timeout", attempt
        assert attempt["exit_codes"]["A"] != 0
        assert report["server_timeouts"] == 1
        assert report["clean"] == 0
        assert any("ended while it was held" in note for note in report["notes"])

    def test_hold_ends_before_the_timeout(self, overlap_cli, dsn, accounts):
        """B never waits nor exits: A is resumed at half the attempt's time and finishes."""
        result = overlap_cli(
            "--first", python_job(UPDATE_1_THEN_2, dsn, accounts),
            "--second", "sleep 60", "--order", "as-given",
            "--runs", "1", "--dsn", dsn, "--timeout", "4s", "--json",
        )  # fmt: skip
        (attempt,) = report_json(result)["attempts"]
        assert attempt["resumed"] == "hold_limit", attempt
        assert attempt["held_seconds"] < 4
        assert attempt["exit_codes"] == {"A": 0, "B": 137}
        assert attempt["outcome"] == "timeout"
        assert process_state(attempt["pids"]["A"]) is None

    def test_signal_while_a_job_is_held(self, dsn, accounts, tmp_path):
        """SIGUSR1 while A is stopped: 138, one line, nothing of either job left running."""
        marker = tmp_path / "pids"
        first = shlex.join(
            ["sh", "-c", f'echo $$ >> "{marker}"; exec "$0" "$@"',
             sys.executable, "-c", UPDATE_1_THEN_2, dsn, accounts]
        )  # fmt: skip
        proc = subprocess.Popen(
            [*jobrun_cli.JOBRUN, "overlap", "--first", first, "--second", "sleep 600",
             "--runs", "1", "--timeout", "100s", "--order", "as-given"],
            env=jobrun_cli.environment(dsn),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            jobrun_cli.wait_for_file(marker)
            held = int(marker.read_text().split()[0])
            jobrun_cli.wait_until(lambda: process_state(held) == "T", what="A held", timeout=60)
            proc.send_signal(signal.SIGUSR1)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.communicate()
            for pgid in [int(pid) for pid in marker.read_text().split()]:
                if not jobrun_cli.group_gone(pgid):
                    os.killpg(pgid, signal.SIGKILL)
        assert proc.returncode == 128 + signal.SIGUSR1, stdout + stderr
        assert stderr.strip() == (
            "jobrun: error: interrupted by SIGUSR1: the commands were killed and their "
            "database sessions ended"
        )
        assert jobrun_cli.group_gone(held)
        with psycopg.connect(dsn, autocommit=True) as conn:
            # Row 1 is free again: A's transaction did not outlive it.
            conn.execute("SET lock_timeout = '5s'")
            conn.execute(f"UPDATE {accounts} SET balance = 0 WHERE id = 1")  # noqa: S608

    def test_a_held_job_dies_with_a_killed_jobrun(self, dsn, accounts, tmp_path):
        """kill -9 of jobrun while A is stopped: A gets SIGKILL too, and its row is free."""
        marker = tmp_path / "pids"
        first = shlex.join(
            ["sh", "-c", f'echo $$ >> "{marker}"; exec "$0" "$@"',
             sys.executable, "-c", UPDATE_1_THEN_2, dsn, accounts]
        )  # fmt: skip
        proc = subprocess.Popen(
            [*jobrun_cli.JOBRUN, "overlap", "--first", first, "--second", "sleep 600",
             "--runs", "1", "--timeout", "100s", "--order", "as-given"],
            env=jobrun_cli.environment(dsn),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            jobrun_cli.wait_for_file(marker)
            held = int(marker.read_text().split()[0])
            jobrun_cli.wait_until(lambda: process_state(held) == "T", what="A held", timeout=60)
            proc.kill()
            proc.wait()
            jobrun_cli.wait_until(lambda: jobrun_cli.process_gone(held), what="A's death")
        finally:
            proc.kill()
            proc.wait()
            for pgid in [int(pid) for pid in marker.read_text().split()]:
                if not jobrun_cli.group_gone(pgid):
                    os.killpg(pgid, signal.SIGKILL)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SET lock_timeout = '5s'")
            conn.execute(f"UPDATE {accounts} SET balance = 0 WHERE id = 1")  # noqa: S608


class TestSchedule:
    """Which job goes first, and where it is held, attempt after attempt."""

    @staticmethod
    def attempts(schedule, outcomes):
        points = []
        for number, outcome in enumerate(outcomes, 1):
            first, hold_at = schedule.next()
            attempt = overlap.Attempt(number, first=first, hold_at=hold_at, outcome=outcome)
            attempt.statements = {"A": 3, "B": 2}
            schedule.record(attempt)
            points.append((first, hold_at))
        return points

    def test_sweep_alternates_then_goes_deeper(self):
        """A and B take turns at statement 1, then 2, then A alone at 3, then again."""
        plan = overlap.Plan(first=("true",), second=("true",), target=db.Target(dsn=""))
        points = self.attempts(overlap.Schedule(plan), ["clean"] * 6)
        assert points == [("A", 1), ("B", 1), ("A", 2), ("B", 2), ("A", 3), ("A", 1)]

    def test_a_point_that_deadlocked_is_kept(self):
        """B held at statement 1 deadlocked: kept until it misses twice in a row."""
        plan = overlap.Plan(first=("true",), second=("true",), target=db.Target(dsn=""))
        outcomes = ["clean", "deadlock", "deadlock", "clean", "deadlock", "clean", "clean"]
        points = self.attempts(overlap.Schedule(plan), [*outcomes, "clean"])
        assert points == [
            ("A", 1),
            ("B", 1),
            ("B", 1),
            ("B", 1),
            ("B", 1),
            ("B", 1),
            ("B", 1),
            ("A", 2),
        ]

    def test_as_given_order_keeps_a_first(self):
        """--order as-given: A goes first in every attempt; only the hold point moves."""
        plan = overlap.Plan(
            first=("true",), second=("true",), target=db.Target(dsn=""), alternate=False
        )
        points = self.attempts(overlap.Schedule(plan), ["clean"] * 4)
        assert points == [("A", 1), ("A", 2), ("A", 3), ("A", 1)]


@pytest.fixture
def scenario_schema(dsn: str) -> Iterator[str]:
    """A schema of this test's own with the scenarios' tables."""
    schema = f"overlap_{uuid.uuid4().hex[:8]}"
    overlap_scenarios.create_schema(dsn, schema)
    yield schema
    overlap_scenarios.drop_schema(dsn, schema)


SCENARIO_RUNS = {
    "slow start (A works 1.5 s first)": 2,
    "foreign key: child's key-share lock vs parent change": 2,
    "advisory locks in opposite order": 2,
    # Autocommit: the jobs are never inside a transaction, only holding an advisory lock.
    "session advisory locks, opposite order, autocommit": 2,
    # Held after their read, neither job holds anything yet: the sweep needs a third attempt.
    "a read before the locks, in both jobs": 4,
    "fixed: slow start, same row order": 2,
    "nothing shared": 2,
}


class TestScenarios:
    """A quick run of benchmarks/bench_overlap.py's suite: found where it can be, never else."""

    @pytest.mark.parametrize(
        "scenario",
        [s for s in overlap_scenarios.SCENARIOS if s.name in SCENARIO_RUNS],
        ids=lambda s: s.name,
    )
    def test_deadlock_found_exactly_where_one_can_happen(
        self, overlap_cli, dsn, scenario_schema, scenario
    ):
        """Exit 1 with a deadlock for a pair that can deadlock; exit 0, none, for a fixed one."""
        result = overlap_cli(
            "--first", scenario.command(dsn, scenario_schema, "A"),
            "--second", scenario.command(dsn, scenario_schema, "B"),
            "--runs", str(SCENARIO_RUNS[scenario.name]), "--dsn", dsn, "--json",
        )  # fmt: skip
        report = report_json(result)
        outcomes = [a["outcome"] for a in report["attempts"]]
        if scenario.deadlocks:
            assert report["deadlocks"] >= 1, outcomes
            assert exit_status(result) == 1
        else:
            assert report["deadlocks"] == 0, outcomes
            assert report["cycles"] == [], report["cycles"]
            assert outcomes == ["clean"] * len(outcomes), report["attempts"]
            assert exit_status(result) == 0


def _screen(raw: bytes) -> list[str]:
    """The lines a terminal shows for ``raw``: each line as its last carriage return left it."""
    text = raw.decode().replace("\r\n", "\n")
    return [line.rsplit("\r", 1)[-1].replace("\x1b[K", "") for line in text.split("\n")]


class TestProgressOnATerminal:
    """On a terminal (stdout and stderr together), each attempt is listed once."""

    def test_each_attempt_shows_once(self, dsn):
        """The progress line is replaced and erased; the report lists attempt 1 and 2 once."""
        import pty  # noqa: PLC0415 - POSIX only, as this test

        leader, follower = pty.openpty()
        proc = subprocess.Popen(
            [*jobrun_cli.JOBRUN, "overlap", "--first", "true", "--second", "true", "--runs", "2"],
            env=jobrun_cli.environment(dsn),
            stdin=subprocess.DEVNULL,
            stdout=follower,
            stderr=follower,
        )
        os.close(follower)
        raw = b""
        try:
            while chunk := os.read(leader, 4096):
                raw += chunk
        except OSError:  # EIO: the terminal's last writer is gone
            pass
        finally:
            os.close(leader)
            proc.wait(timeout=60)
        screen = _screen(raw)
        assert proc.returncode == 0, screen
        listed = [line for line in screen if not line.startswith("note:")]
        for number in (1, 2):
            assert sum(f"attempt {number}" in line for line in listed) == 1, screen
