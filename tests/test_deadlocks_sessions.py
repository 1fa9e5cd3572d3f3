"""``jobrun deadlocks --sessions``, ``--cron-log``, ``--journal``: who was there at a deadlock.

The server logs are written by a real server (log_connections and log_disconnections on).
The cron and journal files are made by hand around that deadlock's time, shaped exactly as
Debian's cron, cronie and ``journalctl -o json`` write them (no scheduler runs in a test).
"""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import threading
import time
import uuid
from typing import TYPE_CHECKING

import psycopg
import pytest

from harness import jobrun_cli
from harness.pgserver import PgServer
from jobrun.analysis import deadlocks
from jobrun.analysis.deadlocks.model import Entry
from jobrun.analysis.deadlocks.sessions import SessionLog
from jobrun.analysis.deadlocks.storms import moment

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

LOG_FILES = {"stderr": "pg", "csv": "pg.csv", "json": "pg.json"}
#: How long the logging collector may take to write a line out.
LOG_WAIT = 30.0
JOBS = ("jobrun:job-a", "jobrun:job-b")
#: Connected before the deadlock and still there: it must be named.
BYSTANDER = "reporting"
#: Connected and gone before the deadlock: it must not be.
GONE = "early-bird"


def cause_deadlock(server: PgServer) -> None:
    """Two sessions named after two jobs update two rows in opposite orders."""
    barrier = threading.Barrier(2, timeout=LOG_WAIT)

    def job(app: str, first: int, second: int) -> None:
        with psycopg.connect(server.dsn(), application_name=app) as conn:
            conn.execute("UPDATE accounts SET balance = balance - 1 WHERE id = %s", (first,))
            barrier.wait()
            with contextlib.suppress(psycopg.errors.DeadlockDetected):
                conn.execute("UPDATE accounts SET balance = balance + 1 WHERE id = %s", (second,))

    threads = [
        threading.Thread(target=job, args=(JOBS[0], 1, 2)),
        threading.Thread(target=job, args=(JOBS[1], 2, 1)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


@pytest.fixture(scope="module")
def night(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Path]]:
    """A real server's stderr, csvlog and jsonlog of one night: a bystander, a deadlock."""
    server = PgServer.start(
        {
            "logging_collector": "on",
            "log_destination": "stderr,csvlog,jsonlog",
            "log_directory": "log",
            "log_filename": "pg",
            "log_line_prefix": "%m [%p] %q%u@%d %a ",
            "log_connections": "on",
            "log_disconnections": "on",
            "deadlock_timeout": "100ms",
        }
    )
    with server:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL)")
            conn.execute("INSERT INTO accounts VALUES (1, 100), (2, 100)")
        with psycopg.connect(server.dsn(), application_name=GONE) as gone:
            gone.execute("SELECT 1")
        with psycopg.connect(server.dsn(), application_name=BYSTANDER) as bystander:
            bystander.execute("SELECT 1")
            cause_deadlock(server)
        marker = f"jobrun-test-marker-{uuid.uuid4().hex}"
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(f"DO $$BEGIN RAISE LOG '{marker}'; END$$")
        copies = {}
        where = tmp_path_factory.mktemp("night")
        for fmt, name in LOG_FILES.items():
            deadline = time.monotonic() + LOG_WAIT
            path = server.data_dir / "log" / name
            while marker.encode() not in path.read_bytes():
                assert time.monotonic() < deadline, f"no marker in the {fmt} log"
                time.sleep(0.05)
            copies[fmt] = where / name
            copies[fmt].write_bytes(path.read_bytes())
        yield copies


def deadlock_time(path: Path) -> dt.datetime:
    """The (one) deadlock's time in the log, as the log wrote it."""
    (deadlock,) = deadlocks.find([str(path)]).deadlocks
    when = moment(deadlock.time)
    assert when is not None
    return when


def sessions_run(*args: str) -> tuple[int, str]:
    """``jobrun deadlocks ARGS``: exit status and stdout."""
    result = jobrun_cli.run("deadlocks", *args, dsn=None)
    return result.returncode, result.stdout


class TestConnected:
    """--sessions names the applications connected at the moment of each deadlock."""

    @pytest.mark.parametrize("fmt", list(LOG_FILES))
    def test_connected_applications_under_the_deadlock(self, night, fmt):
        """Both jobs and the bystander were connected; the session gone before was not."""
        status, out = sessions_run("--sessions", str(night[fmt]))
        assert status == 0, out
        (line,) = [x for x in out.splitlines() if x.startswith("  connected at that moment: ")]
        for app in (*JOBS, BYSTANDER):
            assert f"{app} (1)" in line, line
        assert GONE not in line, line

    def test_pairs_table_counts_deadlocks_and_nights(self, night):
        """The two jobs were there together at 1 of 1 deadlocks, on 1 of 1 nights."""
        _, out = sessions_run("--sessions", str(night["stderr"]))
        lines = out.splitlines()
        assert "  DEADLOCKS  NIGHTS  PAIR" in lines, out
        assert f"  1/1        1/1     {JOBS[0]} + {JOBS[1]}  (at every deadlock)" in lines, out

    def test_the_same_lines_in_two_formats_count_once(self, night):
        """csvlog and jsonlog of one server: one session per application, not two."""
        _, out = sessions_run("--sessions", str(night["csv"]), str(night["json"]))
        (line,) = [x for x in out.splitlines() if x.startswith("  connected at that moment: ")]
        assert f"{BYSTANDER} (1)" in line, line

    def test_json_has_the_sessions(self, night):
        """--json: sessions.deadlocks[].connected and sessions.pairs."""
        _, out = sessions_run("--sessions", "--json", str(night["json"]))
        sessions = json.loads(out)["sessions"]
        assert sessions["deadlocks"][0]["connected"][BYSTANDER] == 1
        assert {"pair": list(JOBS), "deadlocks": 1, "nights": 1} in sessions["pairs"]

    def test_a_log_without_connection_lines_says_what_to_set(self, night, tmp_path):
        """Only the deadlock's lines: a note names log_connections and log_disconnections."""
        text = night["stderr"].read_text()
        kept = [x for x in text.splitlines(keepends=True) if "connection" not in x]
        bare = tmp_path / "bare.log"
        bare.write_text("".join(kept))
        _, out = sessions_run("--sessions", str(bare))
        assert "set log_connections = on and log_disconnections = on" in out, out


def entry(message: str, time: str, pid: int = 7, app: str | None = None) -> Entry:
    """A log entry as any format's reader makes it."""
    return Entry("t.log", 1, "LOG", message, pid=pid, app=app, time=time)


class TestSessionLines:
    """The connection lines of PostgreSQL 13 to 17, shaped as those versions write them."""

    def test_ssl_tail_and_a_unix_socket(self):
        """PostgreSQL 13's SSL tail after application_name; ``host=[local]`` at the end."""
        log = SessionLog()
        log.feed(
            entry(
                "connection authorized: user=jobs database=staging application_name=invoices "
                "SSL enabled (protocol=TLSv1.3, cipher=TLS_AES_256_GCM_SHA384, bits=256, "
                "compression=off)",
                "2026-12-01 02:00:01.100 UTC",
            )
        )
        log.feed(
            entry(
                "disconnection: session time: 0:00:05.250 user=jobs database=staging host=[local]",
                "2026-12-01 02:00:06.350 UTC",
            )
        )
        (session,) = log.sessions()
        assert (session.application, session.user, session.database, session.host) == (
            "invoices",
            "jobs",
            "staging",
            "[local]",
        )
        assert session.end is not None
        assert session.end - session.start == dt.timedelta(seconds=5.25)

    def test_a_session_older_than_the_log_is_dated_from_its_length(self):
        """Only its disconnection is in the log: it started session-time before."""
        log = SessionLog()
        log.feed(
            entry(
                "disconnection: session time: 26:00:00.000 user=jobs database=staging "
                "host=10.0.0.5 port=41234",
                "2026-12-02 04:00:00.000 UTC",
                app="refunds",
            )
        )
        (session,) = log.sessions()
        assert session.application == "refunds"
        assert session.start == dt.datetime(2026, 12, 1, 2, 0)  # noqa: DTZ001 - the log's zone


def syslog_time(when: dt.datetime) -> str:
    """``Dec  1 02:00:01``: syslog's traditional time (day padded with a blank)."""
    return f"{when:%b} {when.day:>2} {when:%H:%M:%S}"


class TestCron:
    """--cron-log: the cron commands running at the deadlock."""

    def test_debian_cron_start_without_an_end(self, night, tmp_path):
        """Debian's cron logs CMD only: running, end unknown; a job started after is not."""
        when = deadlock_time(night["stderr"])
        before, after = when - dt.timedelta(seconds=30), when + dt.timedelta(minutes=5)
        cron = tmp_path / "syslog"
        first, later = syslog_time(before), syslog_time(after)
        cron.write_text(
            f"{first} db1 systemd[1]: Started session-42.scope.\n"
            f"{first} db1 CRON[4120]: (jobs) CMD (jobrun --key invoices -- ./invoices.py)\n"
            f"{first} db1 CRON[4121]: (jobs) CMD (jobrun --key refunds -- ./refunds.py)\n"
            f"{later} db1 CRON[4190]: (jobs) CMD (./later.sh)\n"
        )
        _, out = sessions_run("--cron-log", str(cron), str(night["stderr"]))
        running = [x for x in out.splitlines() if x.startswith("  running: ")]
        assert len(running) == 2, out
        assert "cron (jobs) jobrun --key invoices -- ./invoices.py" in running[0]
        assert all("end unknown" in x for x in running), running
        assert "later.sh" not in out

    def test_cronie_end_line_ends_the_run(self, night, tmp_path):
        """cronie's CMDEND: a command that ended before the deadlock was not running."""
        when = deadlock_time(night["stderr"])
        start, end = when - dt.timedelta(seconds=60), when - dt.timedelta(seconds=10)
        cron = tmp_path / "cron"
        cron.write_text(
            f"{syslog_time(start)} db1 CROND[5001]: (jobs) CMD (./done-early.sh)\n"
            f"{syslog_time(start)} db1 CROND[5002]: (jobs) CMD (./still-going.sh)\n"
            f"{syslog_time(end)} db1 CROND[5001]: (jobs) CMDEND (./done-early.sh)\n"
        )
        _, out = sessions_run("--cron-log", str(cron), "--json", str(night["stderr"]))
        (there,) = json.loads(out)["sessions"]["deadlocks"]
        assert [run["command"] for run in there["running"]] == ["cron (jobs) ./still-going.sh"]

    def test_assume_duration_bounds_an_unknown_end(self, night, tmp_path):
        """A Debian cron run started 10 minutes before: running with 1h, not with 5m."""
        when = deadlock_time(night["stderr"])
        cron = tmp_path / "syslog"
        start = syslog_time(when - dt.timedelta(minutes=10))
        cron.write_text(f"{start} db1 CRON[4120]: (jobs) CMD (./slow.sh)\n")
        _, out = sessions_run("--cron-log", str(cron), str(night["stderr"]))
        assert "  running: cron (jobs) ./slow.sh" in out, out
        _, out = sessions_run(
            "--cron-log", str(cron), "--assume-duration", "5m", str(night["stderr"])
        )
        assert "slow.sh" not in out, out

    def test_a_command_with_control_characters_is_escaped(self, night, tmp_path):
        """An ESC in a crontab command reaches the report as ``\\x1b``, never raw."""
        when = deadlock_time(night["stderr"])
        cron = tmp_path / "syslog"
        start = syslog_time(when - dt.timedelta(seconds=5))
        cron.write_text(f"{start} db1 CRON[4120]: (jobs) CMD (./x.sh \x1b[2J)\n")
        _, out = sessions_run("--cron-log", str(cron), str(night["stderr"]))
        assert "\x1b" not in out
        assert "./x.sh \\x1b[2J" in out, out

    def test_a_missing_cron_log_is_66_before_any_output(self, night, tmp_path):
        """A typo in --cron-log: exit 66, nothing on stdout."""
        status, out = sessions_run("--cron-log", str(tmp_path / "nope"), str(night["stderr"]))
        assert (status, out) == (66, "")


def journal_record(unit: str, message: str, when: dt.datetime) -> str:
    """One line of ``journalctl -o json``: what systemd (pid 1) logs about a unit."""
    stamp = int(when.replace(tzinfo=dt.timezone.utc).timestamp() * 1_000_000)
    return json.dumps(
        {
            "__REALTIME_TIMESTAMP": str(stamp),
            "_PID": "1",
            "_SYSTEMD_UNIT": "init.scope",
            "UNIT": unit,
            "MESSAGE": message,
            "SYSLOG_IDENTIFIER": "systemd",
        }
    )


class TestJournal:
    """--journal: the systemd units running at the deadlock."""

    def test_units_between_starting_and_deactivated(self, night, tmp_path):
        """A unit started before and deactivated after is named; one finished before is not.

        The server logs in UTC (log_timezone of the test server), as the journal's times are.
        """
        when = deadlock_time(night["stderr"])
        second = dt.timedelta(seconds=1)
        journal = tmp_path / "journal.json"
        records = [
            ("early.service", "Starting early.service - Early...", -9),
            ("early.service", "early.service: Deactivated successfully.", -5),
            ("early.service", "Finished early.service - Early.", -5),
            ("invoices.service", "Starting invoices.service - Invoices...", -3),
            ("invoices.service", "invoices.service: Deactivated successfully.", 3),
            ("invoices.service", "Finished invoices.service - Invoices.", 3),
        ]
        journal.write_text(
            "".join(f"{journal_record(u, m, when + n * second)}\n" for u, m, n in records)
        )
        _, out = sessions_run("--journal", str(journal), str(night["stderr"]))
        running = [x for x in out.splitlines() if x.startswith("  running: ")]
        assert len(running) == 1, out
        assert running[0].startswith("  running: systemd invoices.service, started "), running

    def test_a_unit_seen_only_by_its_own_lines_spans_first_to_last(self, night, tmp_path):
        """A journal filtered by _SYSTEMD_UNIT: the invocation's first to last line."""
        when = deadlock_time(night["stderr"])
        stamp = int(when.replace(tzinfo=dt.timezone.utc).timestamp() * 1_000_000)
        lines = [
            {
                "__REALTIME_TIMESTAMP": str(stamp + offset * 1_000_000),
                "_SYSTEMD_UNIT": "refunds.service",
                "_SYSTEMD_INVOCATION_ID": "5e1f0c9d1f0a4b7e9d2c1b0a99887766",
                "MESSAGE": text,
            }
            for offset, text in ((-2, "refunds: starting"), (2, "refunds: done"))
        ]
        journal = tmp_path / "journal.json"
        journal.write_text("".join(json.dumps(line) + "\n" for line in lines))
        _, out = sessions_run("--journal", str(journal), str(night["stderr"]))
        running = [x for x in out.splitlines() if x.startswith("  running: ")]
        assert len(running) == 1, out
        assert "systemd refunds.service, started " in running[0], running
        assert "end unknown (its last line at " in running[0], running
