"""``jobrun deadlocks`` on logs a real server wrote: every format, both sides named."""

from __future__ import annotations

import gzip
import json
import re
import subprocess
import threading
import time
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import jobrun_cli
from harness.pgserver import PgServer
from jobrun.analysis import deadlocks

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Debian's default prefix plus the application name.
PREFIX_WITH_APP = "%m [%p] %q%u@%d %a "
LOG_FILES = {"stderr": "pg.log", "csv": "pg.csv", "json": "pg.json"}
#: How long the logging collector may take to write a line out (it flushes per message).
LOG_WAIT = 30.0
JOBS = ("jobrun:job-a", "jobrun:job-b")


@pytest.fixture(scope="module")
def logging_server() -> Iterator[PgServer]:
    """A private server logging to stderr, csvlog and jsonlog files, with lock waits on."""
    server = PgServer.start(
        {
            "logging_collector": "on",
            "log_destination": "stderr,csvlog,jsonlog",
            "log_directory": "log",
            "log_filename": "pg",  # PostgreSQL adds .csv and .json for the other two
            "log_line_prefix": PREFIX_WITH_APP,
            "log_lock_waits": "on",
            "log_connections": "on",
            "deadlock_timeout": "100ms",
        }
    )
    with server, psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL)")
        conn.execute("INSERT INTO accounts VALUES (1, 100), (2, 100)")
        yield server


def log_path(server: PgServer, fmt: str) -> Path:
    """The server's log file of this format (the stderr one has no extension)."""
    name = "pg" if fmt == "stderr" else LOG_FILES[fmt]
    return server.data_dir / "log" / name


def configure(server: PgServer, prefix: str, *, connections: bool) -> None:
    """ALTER SYSTEM SET log_line_prefix and log_connections: returns once a session sees them."""
    wanted = (prefix, "on" if connections else "off")
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET log_line_prefix = '{prefix}'")
        conn.execute(f"ALTER SYSTEM SET log_connections = {wanted[1]}")
        conn.execute("SELECT pg_reload_conf()")
    deadline = time.monotonic() + LOG_WAIT
    while True:
        with psycopg.connect(server.dsn()) as conn:
            shown = conn.execute(
                "SELECT current_setting('log_line_prefix'), current_setting('log_connections')"
            ).fetchone()
        if shown == wanted:
            return
        assert time.monotonic() < deadline, f"log_line_prefix still {shown} after reload"
        time.sleep(0.05)


def cause_deadlock(server: PgServer) -> list[str]:
    """Two sessions named after two jobs update two rows in opposite orders.

    Each takes its first row, both wait at a barrier, then each asks for the other's row:
    a deadlock every time. Returns the errors the sessions saw.
    """
    barrier = threading.Barrier(2, timeout=LOG_WAIT)
    errors: list[str] = []

    def job(app: str, first: int, second: int) -> None:
        with psycopg.connect(server.dsn(), application_name=app) as conn:
            conn.execute("UPDATE accounts SET balance = balance - 1 WHERE id = %s", (first,))
            barrier.wait()
            try:
                conn.execute("UPDATE accounts SET balance = balance + 1 WHERE id = %s", (second,))
            except psycopg.errors.DeadlockDetected as exc:
                errors.append(str(exc))

    threads = [
        threading.Thread(target=job, args=(JOBS[0], 1, 2)),
        threading.Thread(target=job, args=(JOBS[1], 2, 1)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return errors


def logged_deadlock(
    server: PgServer, tmp_path: Path, prefix: str, *, connections: bool = True
) -> dict[str, Path]:
    """Set the prefix, cause one deadlock, and return what each log file got meanwhile."""
    configure(server, prefix, connections=connections)
    offsets = {fmt: log_path(server, fmt).stat().st_size for fmt in LOG_FILES}
    assert cause_deadlock(server), "the two sessions did not deadlock"
    # The victim logs its error before the client sees it: a line logged after that is
    # written after the error, and once it is in every file, so is the deadlock.
    marker = f"jobrun-test-marker-{uuid.uuid4().hex}"
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"DO $$BEGIN RAISE LOG '{marker}'; END$$")
    slices = {}
    for fmt, name in LOG_FILES.items():
        deadline = time.monotonic() + LOG_WAIT
        while True:
            data = log_path(server, fmt).read_bytes()[offsets[fmt] :]
            if marker.encode() in data:
                break
            assert time.monotonic() < deadline, f"no deadlock in the {fmt} log: {data!r}"
            time.sleep(0.05)
        slices[fmt] = tmp_path / name
        slices[fmt].write_bytes(data)
    return slices


def only_deadlock(path: Path, prefix: str | None = None) -> deadlocks.Deadlock:
    """The one deadlock in a log file."""
    found = deadlocks.find([str(path)], prefix=prefix)
    assert len(found.deadlocks) == 1, deadlocks.report(found)
    return found.deadlocks[0]


class TestRealLogs:
    """Logs written by a real server around a real deadlock between two named sessions."""

    @pytest.mark.parametrize("fmt", list(LOG_FILES))
    def test_both_jobs_are_named_in_every_format(self, logging_server, tmp_path, fmt):
        """stderr with %a, csvlog and jsonlog: two sides, jobrun:job-a and jobrun:job-b."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        deadlock = only_deadlock(logs[fmt])
        assert {side.application for side in deadlock.sides} == set(JOBS)
        assert {side.job for side in deadlock.sides} == {"job-a", "job-b"}
        for side in deadlock.sides:
            assert side.waits_for is not None
            assert side.waits_for.startswith("ShareLock on transaction ")
            assert side.statement is not None
            assert side.statement.startswith("UPDATE accounts SET balance = balance + 1")
        blockers = {side.pid: side.blocked_by for side in deadlock.sides}
        first, second = blockers
        assert blockers == {first: second, second: first}
        assert deadlock.victim in blockers
        assert deadlock.db == "postgres"

    @pytest.mark.parametrize(
        "prefix",
        [
            "%t [%p]: [%l-1] user=%u,db=%d,app=%a,client=%h ",
            "%m [%p] %q%a %u@%d ",
        ],
    )
    def test_common_prefixes_with_the_application_are_recognised(
        self, logging_server, tmp_path, prefix
    ):
        """Prefixes in the list of common layouts need no --log-line-prefix."""
        logs = logged_deadlock(logging_server, tmp_path, prefix)
        deadlock = only_deadlock(logs["stderr"])
        assert {side.application for side in deadlock.sides} == set(JOBS)

    def test_an_unusual_prefix_is_read_with_or_without_it_given(self, logging_server, tmp_path):
        """%c, %x and %l in an order no common layout covers: read as is, or as given."""
        prefix = "%l|%c|%x|%a|%m|"
        logs = logged_deadlock(logging_server, tmp_path, prefix)
        found = only_deadlock(logs["stderr"])
        assert {side.application for side in found.sides} == set(JOBS)  # log_connections
        deadlock = only_deadlock(logs["stderr"], prefix=prefix)
        assert {side.application for side in deadlock.sides} == set(JOBS)
        # No %p: the pid comes from the session id (%c is <start>.<pid> in hex).
        assert deadlock.victim in {side.pid for side in deadlock.sides}

    @pytest.mark.parametrize("prefix", ["%m [%p] ", "%t:%r:%u@%d:[%p]:"])
    def test_without_the_application_sides_are_pids_with_a_note(
        self, logging_server, tmp_path, prefix
    ):
        """PostgreSQL's default and Amazon RDS's prefix: both pids, no names, and a note."""
        logs = logged_deadlock(logging_server, tmp_path, prefix, connections=False)
        found = deadlocks.find([str(logs["stderr"])])
        (deadlock,) = found.deadlocks
        assert len(deadlock.sides) == 2
        assert all(side.application is None for side in deadlock.sides)
        text = deadlocks.report(found)
        assert "application unknown" in text
        assert "add %a to log_line_prefix" in text

    @pytest.mark.parametrize("prefix", ["%m [%p] ", "%t:%r:%u@%d:[%p]:"])
    def test_without_the_application_log_connections_names_both(
        self, logging_server, tmp_path, prefix
    ):
        """No %a, but log_connections on: each session's "connection authorized" names it."""
        logs = logged_deadlock(logging_server, tmp_path, prefix, connections=True)
        deadlock = only_deadlock(logs["stderr"])
        assert {side.application for side in deadlock.sides} == set(JOBS)
        assert all(side.named_by != "this line" for side in deadlock.sides)

    @pytest.mark.parametrize("per", ["line", "message"])
    def test_a_cloud_logging_export_is_read(self, logging_server, tmp_path, per):
        """JSON records carrying stderr text (textPayload), one per line or per message.

        Built from a real stderr log in the shape of a Cloud Logging export (Cloud SQL's
        prefix is ``%m [%p]: [%l-1] db=%d,user=%u``); no export of a real Cloud SQL
        instance was available to test against.
        """
        prefix = "%m [%p]: [%l-1] db=%d,user=%u "
        logs = logged_deadlock(logging_server, tmp_path, prefix)
        text = logs["stderr"].read_text()
        # Per message: a continuation line (a tab first) stays with the line before it.
        by_message = re.split(r"\n(?!\t)", text.rstrip("\n"))
        records = text.splitlines() if per == "line" else by_message
        export = tmp_path / "export.json"
        export.write_text(
            "".join(
                json.dumps({"textPayload": record, "resource": {"type": "cloudsql_database"}})
                + "\n"
                for record in records
            )
        )
        found = deadlocks.find([str(export)])
        assert found.files[0].format == "exported-json"
        (deadlock,) = found.deadlocks
        assert {side.application for side in deadlock.sides} == set(JOBS)
        assert all(side.statement for side in deadlock.sides)

    def test_the_cli_reads_stdin_gzip_and_prints_json(self, logging_server, tmp_path):
        """``jobrun deadlocks --json - f.gz``: the same deadlock from both, exit 0."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        packed = tmp_path / "pg.csv.gz"
        packed.write_bytes(gzip.compress(logs["csv"].read_bytes()))
        with logs["json"].open("rb") as stdin:
            result = jobrun_cli.run("deadlocks", "--json", "-", str(packed), dsn=None, stdin=stdin)
        assert result.returncode == 0, result.stderr
        out = json.loads(result.stdout)
        assert [f["format"] for f in out["files"]] == ["json", "csv, gzip"]
        for deadlock in out["deadlocks"]:
            assert {side["job"] for side in deadlock["sides"]} == {"job-a", "job-b"}

    def test_check_exits_1_when_a_deadlock_is_found(self, logging_server, tmp_path):
        """--check: 1 with a deadlock in the log, 0 without."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        found = jobrun_cli.run("deadlocks", "--check", str(logs["stderr"]), dsn=None)
        assert found.returncode == 1, found.stderr
        assert "jobrun:job-a" in found.stdout
        quiet = tmp_path / "quiet.log"
        quiet.write_text("2026-12-01 02:00:00.000 UTC [42] LOG:  checkpoint starting: time\n")
        assert jobrun_cli.run("deadlocks", "--check", str(quiet), dsn=None).returncode == 0


class TestOtherSide:
    """The victim's line names only the victim: the other side is looked up by its pid."""

    VICTIM = (
        "2026-12-01 02:08:12.163 UTC [100] u@db {app} ERROR:  deadlock detected\n"
        "2026-12-01 02:08:12.163 UTC [100] u@db {app} DETAIL:  Process 100 waits for "
        "ShareLock on transaction 7; blocked by process 200.\n"
        "\tProcess 200 waits for ShareLock on transaction 8; blocked by process 100.\n"
        "\tProcess 100: UPDATE a\n"
        "\t  SET x = 1\n"
        "\tProcess 200: UPDATE b\n"
    )

    def parse(self, tmp_path: Path, text: str) -> deadlocks.Deadlock:
        path = tmp_path / "log"
        path.write_text(text)
        return only_deadlock(path)

    def test_unknown_when_no_line_of_that_pid_names_it(self, tmp_path):
        """No other line of pid 200: its application is unknown, and the report says so."""
        deadlock = self.parse(tmp_path, self.VICTIM.format(app="jobrun:a"))
        other = next(side for side in deadlock.sides if side.pid == 200)
        assert other.application is None
        assert "process 200 (application unknown" in deadlocks.describe(other)

    def test_the_nearest_line_of_that_pid_wins(self, tmp_path):
        """A reused pid: the line nearest the deadlock names the side, before or after."""
        line = "2026-12-01 02:08:12.163 UTC [200] u@db {app} LOG:  something\n"
        text = (
            line.format(app="old-session")
            + "\n".join(["2026-12-01 02:08:12.163 UTC [300] u@db x LOG:  filler"] * 20)
            + "\n"
            + self.VICTIM.format(app="jobrun:a")
            + line.format(app="jobrun:b")
        )
        deadlock = self.parse(tmp_path, text)
        other = next(side for side in deadlock.sides if side.pid == 200)
        assert other.application == "jobrun:b"

    def test_a_statement_over_several_lines_is_kept_whole(self, tmp_path):
        """Continuation lines of a statement in the DETAIL stay with that statement."""
        deadlock = self.parse(tmp_path, self.VICTIM.format(app="jobrun:a"))
        victim = next(side for side in deadlock.sides if side.pid == 100)
        assert victim.statement == "UPDATE a\n  SET x = 1"


_STATEMENT_TEXT = st.text(
    alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\x00"),
    min_size=1,
    max_size=60,
).filter(lambda text: text.strip() == text and "Process " not in text)


class TestDetailProperty:
    """Whatever the pids, locks and statements, the sides come back as PostgreSQL logged them."""

    @settings(max_examples=150, deadline=None)
    @given(
        pids=st.lists(st.integers(1, 4_194_304), min_size=2, max_size=4, unique=True),
        statements=st.lists(
            st.lists(_STATEMENT_TEXT, min_size=1, max_size=3).map("\n".join),
            min_size=4,
            max_size=4,
        ),
        app=st.text(alphabet="abcdefghijklmnopqrstuvwxyz-:_", min_size=1, max_size=30),
    )
    def test_a_cycle_of_any_size_round_trips(self, tmp_path_factory, pids, statements, app):
        """An n-way cycle in stderr format: every pid, lock, blocker and statement parsed."""
        cycle = list(zip(pids, pids[1:] + pids[:1], strict=True))
        detail = [
            f"Process {pid} waits for ShareLock on transaction {n}; blocked by process {blocker}."
            for n, (pid, blocker) in enumerate(cycle)
        ] + [f"Process {pid}: {statements[n]}" for n, pid in enumerate(pids)]
        prefix = f"2026-12-01 02:08:12.163 UTC [{pids[0]}] u@db {app} "
        text = (
            f"{prefix}ERROR:  deadlock detected\n"
            f"{prefix}DETAIL:  " + "\n".join(detail).replace("\n", "\n\t") + "\n"
        )
        path = tmp_path_factory.mktemp("cycle") / "log"
        path.write_text(text)
        deadlock = only_deadlock(path, prefix=PREFIX_WITH_APP)
        assert [side.pid for side in deadlock.sides] == pids
        for n, side in enumerate(deadlock.sides):
            assert side.blocked_by == cycle[n][1]
            assert side.waits_for == f"ShareLock on transaction {n}"
            # Blanks at a line's end are dropped as a pasted log's are: the rest is kept.
            kept = "\n".join(line.rstrip(" \t") for line in statements[n].split("\n"))
            assert side.statement == kept
        assert deadlock.sides[0].application == app


class TestBadInput:
    """Missing files, non-logs and odd bytes: a one-line error and a documented status."""

    def test_a_missing_file_exits_66_before_any_output(self, jobrun_here, tmp_path):
        """EX_NOINPUT, one line on stderr, nothing on stdout."""
        good = tmp_path / "good.log"
        good.write_text("2026-12-01 02:00:00.000 UTC [42] LOG:  ready\n")
        result = jobrun_here.run("deadlocks", str(good), str(tmp_path / "nope.log"), dsn=None)
        assert result.returncode == 66
        assert result.stdout == ""
        (line,) = result.stderr.strip().splitlines()
        assert "nope.log" in line

    def test_a_file_that_is_not_a_log_exits_65(self, jobrun_here, tmp_path):
        """EX_DATAERR, naming the file and the way out (--log-line-prefix)."""
        path = tmp_path / "notes.txt"
        path.write_text("shopping list\nmilk\n")
        result = jobrun_here.run("deadlocks", str(path), dsn=None)
        assert result.returncode == 65
        (line,) = result.stderr.strip().splitlines()
        assert "--log-line-prefix" in line

    def test_an_empty_file_is_a_quiet_night(self, jobrun_here, tmp_path):
        """An empty (freshly rotated) log: 0 deadlocks, exit 0."""
        path = tmp_path / "empty.log"
        path.write_bytes(b"")
        result = jobrun_here.run("deadlocks", str(path), dsn=None)
        assert result.returncode == 0, result.stderr
        assert "0 deadlock(s)" in result.stdout

    @pytest.mark.process  # the real process's descriptor 1 on a full disk
    def test_a_full_disk_exits_74(self, tmp_path):
        """The report cannot be written (/dev/full): EX_IOERR, one line, no traceback."""
        if not Path("/dev/full").exists():
            pytest.skip("no /dev/full here")
        path = tmp_path / "log"
        path.write_text(TestOtherSide.VICTIM.format(app="jobrun:a"))
        with Path("/dev/full").open("w") as full:
            result = subprocess.run(
                [*jobrun_cli.JOBRUN, "deadlocks", str(path)],
                stdout=full,
                stderr=subprocess.PIPE,
                text=True,
                check=False,
                timeout=60,
            )
        assert result.returncode == 74
        (line,) = result.stderr.strip().splitlines()
        assert "cannot write to standard output" in line

    def test_line_numbers_count_leading_blank_lines(self, tmp_path):
        """The entry's line number is its line in the file, blank lines before it included."""
        path = tmp_path / "log"
        path.write_text("\n\n" + TestOtherSide.VICTIM.format(app="jobrun:a"))
        assert only_deadlock(path).line == 3

    @settings(max_examples=200, deadline=None)
    @given(garbage=st.binary(max_size=400), where=st.integers(min_value=0, max_value=400))
    def test_any_bytes_inside_a_log_never_crash(self, tmp_path_factory, garbage, where):
        """Invalid UTF-8, stray tabs, NULs, quotes inside a real deadlock entry: parsed."""
        text = TestOtherSide.VICTIM.format(app="jobrun:a").encode()
        mixed = text[:where] + garbage + text[where:]
        path = tmp_path_factory.mktemp("bytes") / "log"
        path.write_bytes(mixed)
        for fmt_prefix in (None, PREFIX_WITH_APP):
            deadlocks.report(deadlocks.find([str(path)], prefix=fmt_prefix))
