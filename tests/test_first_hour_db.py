"""A new user's first hour: DSN typos, a quiet server log, runs a server restart killed."""

from __future__ import annotations

import json
import re
import uuid
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql as pgsql

from harness import jobrun_cli
from harness.jobrun_cli import wait_for_file, wait_until
from harness.pgserver import PgServer
from jobrun.locks.session import CONFIRMATION_LIFETIME

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Callable, Iterator
    from pathlib import Path

#: A host name that never resolves (RFC 2606): a DSN naming it is unreachable, never up.
NOWHERE = "db.invalid"
#: What the server's log must not hold from a normal run, skip, status or stop.
NOISE = re.compile(r"\b(WARNING|ERROR|NOTICE|FATAL|PANIC):  ")
#: The application name of the test's own marker session (its WARNING is expected).
MARKER_APP = "first-hour-marker"
#: Seconds a server restart test's run may take to notice the dead session and stop its
#: child: the heartbeat's confirmation lifetime plus --kill-after, with room for a loaded
#: machine (the same slack the fault tests give).
KILL_AFTER = 1.0
NOTICE_BOUND = CONFIRMATION_LIFETIME + KILL_AFTER + 20.0


def child_marker(tmp_path: Path) -> tuple[Path, list[str]]:
    """A file the child creates, and the child's argv: proof the child ran."""
    marker = tmp_path / "child-ran"
    return marker, ["sh", "-c", f'touch "{marker}"']


class TestConfigurationErrors:
    """A connection string libpq would refuse is a usage error, whatever --on-db-error says."""

    def test_port_that_is_not_a_number_is_exit_64_and_never_runs_the_child(
        self, jobrun_here, tmp_path
    ):
        """``port=abc`` with --on-db-error run: exit 64, one line naming the port, no child."""
        marker, argv = child_marker(tmp_path)
        done = jobrun_here.run(
            "--on-db-error", "run", "--key", "typo", "--", *argv,
            dsn=f"host={NOWHERE} port=abc",
        )  # fmt: skip
        assert done.returncode == 64, done.stderr
        assert not marker.exists()
        assert done.stderr.count("\n") == 1, done.stderr
        assert 'invalid port "abc"' in done.stderr

    def test_bad_sslmode_in_the_environment_is_exit_64(self, jobrun_here, tmp_path):
        """PGSSLMODE=bogus (libpq reads it where the DSN sets none): exit 64, named, no child."""
        marker, argv = child_marker(tmp_path)
        done = jobrun_here.run(
            "--on-db-error", "run", "--key", "typo", "--", *argv,
            dsn=f"host={NOWHERE}", env={"PGSSLMODE": "bogus"},
        )  # fmt: skip
        assert done.returncode == 64, done.stderr
        assert not marker.exists()
        assert done.stderr.startswith("jobrun: error: PGSSLMODE: invalid sslmode"), done.stderr

    def test_a_bad_value_in_a_uri_never_shows_its_password(self, jobrun_here, tmp_path):
        """A URI with a bad port is exit 64, and its password is in no line jobrun writes."""
        password = "Zq8-first-hour-secret"  # noqa: S105 - a test's own
        marker, argv = child_marker(tmp_path)
        done = jobrun_here.run(
            "--on-db-error", "run", "--key", "typo", "--", *argv,
            dsn=f"postgresql://jobs:{password}@{NOWHERE}:5432x/app",
        )  # fmt: skip
        assert done.returncode == 64, done.stderr
        assert not marker.exists()
        assert password not in done.stderr + done.stdout
        assert "port" in done.stderr

    def test_unknown_target_session_attrs_is_exit_64(self, jobrun_here, tmp_path):
        """``target_session_attrs=primry`` (a typo): exit 64 before any connection, no child."""
        marker, argv = child_marker(tmp_path)
        done = jobrun_here.run(
            "--on-db-error", "run", "--key", "typo", "--", *argv,
            dsn=f"host={NOWHERE} target_session_attrs=primry",
        )  # fmt: skip
        assert done.returncode == 64, done.stderr
        assert not marker.exists()
        assert "target_session_attrs" in done.stderr


# --- a quiet server log ----------------------------------------------------------------------

#: Two databases: one where only session mode ever ran, one where both modes did.
SESSION_ONLY = "first_hour_session"
BOTH_MODES = "first_hour_both"


@pytest.fixture(scope="module")
def logging_server() -> Iterator[PgServer]:
    """A private server logging NOTICE and up, each line with its application name.

    jobrun's schema is made in both databases (its creation is not what is measured), and
    lease mode's table in one of them.
    """
    settings = {"log_min_messages": "notice", "log_line_prefix": "%m [%p] %q%u@%d %a "}
    with PgServer.start(settings) as server:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            for name in (SESSION_ONLY, BOTH_MODES):
                conn.execute(pgsql.SQL("CREATE DATABASE {}").format(pgsql.Identifier(name)))
        for name, mode in (
            (SESSION_ONLY, "session"),
            (BOTH_MODES, "session"),
            (BOTH_MODES, "lease"),
        ):
            warm = jobrun_cli.run(
                "--mode", mode, "--key", "warm-up", "--", "true", dsn=server.dsn(name)
            )
            assert warm.returncode == 0, warm.stderr
        yield server


def noise(server: PgServer, database: str, action: Callable[[], None]) -> list[str]:
    """The lines of NOTICE or above that the server logged while ``action`` ran.

    The end is found by a WARNING of our own (its session is left out): once it is in the
    log, everything ``action``'s processes sent before it exited is there too.
    """
    offset = server.log_path.stat().st_size
    action()
    marker = f"first-hour-marker-{uuid.uuid4().hex}"
    with psycopg.connect(
        server.dsn(database), autocommit=True, application_name=MARKER_APP
    ) as conn:
        conn.execute(pgsql.SQL("DO $$BEGIN RAISE WARNING {}; END$$").format(pgsql.Literal(marker)))

    def text() -> str:
        return server.log_path.read_bytes()[offset:].decode(errors="replace")

    wait_until(lambda: marker in text(), what="the marker in the server's log")
    return [line for line in text().splitlines() if NOISE.search(line) and MARKER_APP not in line]


def ran(status: int, *args: str, dsn: str, env: dict[str, str] | None = None) -> Callable[[], None]:
    """An action: ``jobrun ARGS`` to its end, with this exit status."""

    def action() -> None:
        done = jobrun_cli.run(*args, dsn=dsn, env=env)
        assert done.returncode == status, done.stderr

    return action


def holder(tmp_path: Path, key: str, dsn: str, *mode: str) -> tuple[subprocess.Popen[str], Path]:
    """A run of ``key`` whose child waits for a file: (process, the file that ends it)."""
    running, go = tmp_path / "running", tmp_path / "go"
    proc = jobrun_cli.start(
        *mode, "--key", key, "--",
        "sh", "-c", f'echo $$ > "{running}"; while [ ! -e "{go}" ]; do sleep 0.05; done',
        dsn=dsn,
    )  # fmt: skip
    wait_for_file(running, proc=proc)
    return proc, go


class TestQuietServerLog:
    """A DBA grepping the server's log for WARNING, ERROR or NOTICE finds nothing of jobrun's."""

    def test_a_session_run_logs_nothing(self, logging_server, key):
        """A run in session mode (lock, history, end row with the release) is silent."""
        dsn = logging_server.dsn(SESSION_ONLY)
        assert (
            noise(logging_server, SESSION_ONLY, ran(0, "--key", key, "--", "true", dsn=dsn)) == []
        )

    def test_a_once_per_skip_logs_nothing(self, logging_server, key):
        """A --once-per skip (it took the lock, found the window's run, released) is silent."""
        dsn = logging_server.dsn(SESSION_ONLY)
        args = ("--key", key, "--once-per", "1d", "--", "true")
        ran(0, *args, dsn=dsn)()
        assert noise(logging_server, SESSION_ONLY, ran(75, *args, dsn=dsn)) == []

    def test_a_skip_and_the_run_it_skipped_behind_log_nothing(self, logging_server, key, tmp_path):
        """A skip behind a running holder, and that holder's end, are silent."""
        dsn = logging_server.dsn(SESSION_ONLY)

        def action() -> None:
            proc, go = holder(tmp_path, key, dsn)
            ran(75, "--key", key, "--", "true", dsn=dsn)()
            go.touch()
            _, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 0, stderr

        assert noise(logging_server, SESSION_ONLY, action) == []

    def test_a_lease_run_logs_nothing(self, logging_server, key):
        """A run in lease mode (lease, history, end row with the lease's delete) is silent."""
        dsn = logging_server.dsn(BOTH_MODES)
        action = ran(0, "--mode", "lease", "--key", key, "--", "true", dsn=dsn)
        assert noise(logging_server, BOTH_MODES, action) == []

    def test_status_where_lease_mode_never_ran_logs_nothing(self, logging_server, key):
        """``status`` and ``status --check`` on a database without jobrun.leases are silent."""
        dsn = logging_server.dsn(SESSION_ONLY)
        ran(0, "--key", key, "--", "true", dsn=dsn)()

        def action() -> None:
            ran(0, "status", dsn=dsn)()
            ran(0, "status", "--check", key, dsn=dsn)()

        assert noise(logging_server, SESSION_ONLY, action) == []

    def test_stop_and_the_run_it_stops_log_nothing(self, logging_server, key, tmp_path):
        """``jobrun stop KEY`` and the end of the run it stopped (exit 77) are silent."""
        dsn = logging_server.dsn(BOTH_MODES)

        def action() -> None:
            proc, _ = holder(tmp_path, key, dsn)
            ran(0, "stop", key, dsn=dsn)()
            _, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 77, stderr

        assert noise(logging_server, BOTH_MODES, action) == []

    def test_stop_where_lease_mode_never_ran_logs_nothing(self, logging_server, key, tmp_path):
        """``jobrun stop KEY`` on a database without jobrun.leases, and the run's end: silent."""
        dsn = logging_server.dsn(SESSION_ONLY)

        def action() -> None:
            proc, _ = holder(tmp_path, key, dsn)
            ran(0, "stop", key, dsn=dsn)()
            _, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 77, stderr

        assert noise(logging_server, SESSION_ONLY, action) == []


# --- runs a server restart killed ------------------------------------------------------------


def outcome_of(dsn: str, run_id: str) -> str:
    """What the history row of ``run_id`` says, as stored."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT outcome FROM jobrun.runs WHERE run_id = %s", (run_id,)
        ).fetchone()
    assert row is not None
    return str(row[0])


def run_through_a_restart(
    server: PgServer, key: str, tmp_path: Path, *, connect_timeout: str, back: str
) -> tuple[subprocess.Popen[str], Path]:
    """A run whose server shuts down under it; started again once ``back`` is in its log.

    Returns the run (its child stopped, its end row being written) and its log file.
    """
    log = tmp_path / "jobrun.log"
    proc = jobrun_cli.start(
        "--key", key, "--kill-after", f"{KILL_AFTER:g}s", "--connect-timeout", connect_timeout,
        "--log-file", str(log), "--log-level", "debug", "--", "sleep", "300",
        dsn=server.dsn(),
    )  # fmt: skip
    wait_until(lambda: log.exists() and '"started"' in log.read_text(), what="the run's start")
    server.stop("fast")
    wait_until(
        lambda: back in log.read_text() or proc.poll() is not None,
        timeout=NOTICE_BOUND,
        what=f"{back} in the run's log",
    )
    return proc, log


def dead_run(server: PgServer, key: str, tmp_path: Path) -> str:
    """A run the restart killed and that could not say so: its row still says running.

    With --connect-timeout 1s its end row is asked again for 1 s only, and the server
    stays down until the run has given up and exited.
    """
    proc, log = run_through_a_restart(server, key, tmp_path, connect_timeout="1s", back='"exit"')
    _, stderr = proc.communicate(timeout=NOTICE_BOUND)
    assert proc.returncode == 76, stderr
    server.start_again()
    events = jobrun_cli.events(log.read_text())
    run_id = str(next(e["run_id"] for e in events if e["event"] == "started"))
    assert outcome_of(server.dsn(), run_id) == "running"
    return run_id


class TestRunsARestartKilled:
    """A run the server's restart killed is not left, or shown, as running."""

    @pytest.mark.fault
    def test_the_end_row_is_written_once_the_server_is_back(
        self, private_server_factory, key, tmp_path
    ):
        """The end row that failed while the server was down is retried: it says lock_lost."""
        server = private_server_factory()
        connect_timeout = 30.0
        proc, log = run_through_a_restart(
            server, key, tmp_path, connect_timeout=f"{connect_timeout:g}s", back='"history_retry"'
        )
        if proc.poll() is not None:
            _, stderr = proc.communicate()
            pytest.fail(f"the run gave up on its end row while the server was down:\n{stderr}")
        server.start_again()
        _, stderr = proc.communicate(timeout=connect_timeout + NOTICE_BOUND)
        assert proc.returncode == 76, stderr
        events = jobrun_cli.events(log.read_text())
        run_id = str(next(e["run_id"] for e in events if e["event"] == "started"))
        assert outcome_of(server.dsn(), run_id) == "lock_lost"
        assert not [e for e in events if e["event"] == "history_failed"]

    @pytest.mark.fault
    def test_status_check_fails_on_a_run_whose_lock_is_gone(
        self, private_server_factory, key, tmp_path
    ):
        """``status --check`` exits 1 and names the run marked running whose lock is gone."""
        server = private_server_factory()
        run_id = dead_run(server, key, tmp_path)
        done = jobrun_cli.run("status", "--check", dsn=server.dsn())
        assert done.returncode == 1, done.stderr
        assert f"abandoned: {key}: run {run_id}" in done.stderr

    @pytest.mark.fault
    def test_status_json_names_the_abandoned_run(self, private_server_factory, key, tmp_path):
        """``status --json`` gives the dead run as ``abandoned_run``, and no ``running_for``."""
        server = private_server_factory()
        run_id = dead_run(server, key, tmp_path)
        done = jobrun_cli.run("status", "--json", key, dsn=server.dsn())
        assert done.returncode == 0, done.stderr
        [row] = json.loads(done.stdout)
        assert row["abandoned_run"]["run_id"] == run_id
        assert row["running_for"] is None

    @pytest.mark.fault
    def test_history_shows_the_dead_run_as_abandoned(self, private_server_factory, key, tmp_path):
        """``history KEY`` shows the run marked running whose lock is gone as abandoned."""
        server = private_server_factory()
        run_id = dead_run(server, key, tmp_path)
        done = jobrun_cli.run("history", key, "--json", dsn=server.dsn())
        assert done.returncode == 0, done.stderr
        [run] = json.loads(done.stdout)
        assert (run["run_id"], run["outcome"]) == (run_id, "abandoned")
