"""`jobrun drill` passes against a real database in both modes, and fails when it should."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harness import jobrun_cli
from jobrun import db, keys
from jobrun.exitcodes import LockStoreUnavailable
from jobrun.ops import background, drill

if TYPE_CHECKING:
    from pathlib import Path


def step_line(stdout: str, name: str) -> str:
    """The checklist line of step ``name``."""
    found = [line for line in stdout.splitlines() if name in line and line.strip()[:1] == "["]
    assert len(found) == 1, stdout
    return found[0]


def start_drill(*args: str, dsn: str) -> subprocess.Popen[str]:
    """``jobrun drill ARGS...`` in the background, stdout (the checklist) and stderr captured."""
    return subprocess.Popen(
        [*jobrun_cli.JOBRUN, "drill", *args],
        env=jobrun_cli.environment(dsn),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def marked_pids(marker: Path) -> list[int]:
    """Every pid the drill's command wrote to ``marker`` (one run per line, pids by spaces)."""
    if not marker.exists():
        return []
    return [int(word) for word in marker.read_text().split()]


def kill_groups(pgids: list[int]) -> None:
    """Leave nothing behind when a test fails."""
    for pgid in pgids:
        if not jobrun_cli.group_gone(pgid):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)


def key_is_free(key: str, mode: str, dsn: str) -> bool:
    """Whether a run of ``key`` gets the lock right now (it holds it for no time)."""
    result = jobrun_cli.run("--key", key, "--mode", mode, "--no-history", "--", "true", dsn=dsn)
    return result.returncode == 0


class _SlowCloseProxy:
    """A TCP proxy that passes a client's disconnect on to the server ``delay`` s late.

    A lock session's backend then outlives its killed client by ``delay``: the server does
    not free the lock at once.
    """

    def __init__(self, host: str, port: int, delay: float) -> None:
        self.target = (host, port)
        self.delay = delay
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def dsn_for(self, dsn: str) -> str:
        params = conninfo_to_dict(dsn)
        params.pop("hostaddr", None)
        params.update(host="127.0.0.1", port=str(self.port))
        return make_conninfo("", **params)

    def _connect(self) -> socket.socket:
        host, port = self.target
        if host.startswith("/"):
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(f"{host}/.s.PGSQL.{port}")
            return sock
        return socket.create_connection((host, port))

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                client, _ = self.listener.accept()
                server = self._connect()
                self.sockets += [client, server]
                for args in ((client, server, True), (server, client, False)):
                    threading.Thread(target=self._pump, args=args, daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                dst.sendall(data)
        if from_client:
            time.sleep(self.delay)  # the point of this proxy: the server learns of it late
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


@pytest.fixture
def other_database(fresh_dsn: str) -> str:
    """A DSN for a second database of this test's own."""
    return fresh_dsn


class TestDrill:
    """The crash-path rehearsal, end to end."""

    @pytest.mark.parametrize(
        "mode_args",
        [("--mode", "session"), ("--mode", "lease", "--ttl", "4s", "--kill-after", "1s")],
        ids=["session", "lease"],
    )
    def test_drill_passes_on_the_test_database(self, dsn, key, mode_args):
        """Every step passes and the exit status is 0."""
        result = jobrun_cli.run("drill", "--key", key, *mode_args, dsn=dsn, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        steps = [line for line in result.stdout.splitlines() if line.strip().startswith("[")]
        assert len(steps) >= 5
        assert all(line.strip().startswith("[PASS]") for line in steps), result.stdout
        assert "backend terminated" in result.stdout or "lease handed" in result.stdout

    def test_drill_fails_when_the_key_is_busy(self, dsn, key, tmp_path):
        """With the key held by someone else, the first step fails and so does the drill."""
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            jobrun_cli.wait_for_file(marker)
            result = jobrun_cli.run("drill", "--key", key, dsn=dsn, timeout=120)
        finally:
            jobrun_cli.signal_and_wait(holder, jobrun_cli.SIGTERM)
        assert result.returncode == 1
        assert "[FAIL] guarded run started" in result.stdout
        assert "drill FAILED" in result.stdout

    def test_a_busy_lease_is_left_to_its_owner(self, dsn, key, tmp_path):
        """Lease mode, key held by a real job: the drill fails and never deletes its lease."""
        marker = tmp_path / "holder"
        lease = ("--key", key, "--mode", "lease", "--ttl", "30s")
        holder = jobrun_cli.start(*lease, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            jobrun_cli.wait_for_file(marker)
            result = jobrun_cli.run("drill", "--key", key, "--mode", "lease", dsn=dsn, timeout=120)
            third = jobrun_cli.run(*lease, "--", "true", dsn=dsn)
        finally:
            stderr = jobrun_cli.signal_and_wait(holder, jobrun_cli.SIGTERM)
        assert result.returncode == 1, result.stdout
        assert third.returncode == 75, third.stderr
        assert holder.returncode == 143, stderr
        assert '"lock_lost"' not in stderr

    def test_drill_without_database_is_exit_69_on_one_line(self, jobrun_here, key):
        """An unreachable database: one error line, exit 69, nothing started, no checklist."""
        result = jobrun_here.run(
            "drill", "--key", key, "--connect-timeout", "1s", dsn="host=127.0.0.1 port=1"
        )
        assert result.returncode == 69, result.stdout + result.stderr
        assert result.stdout == ""
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "cannot connect" in result.stderr

    @pytest.mark.parametrize("heartbeat", ["0", "50ms"])
    def test_too_short_heartbeat_is_a_usage_error(self, jobrun_here, key, heartbeat):
        """As for a run: exit 64 with one line, before any database is needed."""
        result = jobrun_here.run(
            "drill", "--key", key, "--heartbeat", heartbeat, dsn="host=127.0.0.1 port=1"
        )
        assert result.returncode == 64, result.stdout + result.stderr
        assert result.stdout == ""
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr
        assert "--heartbeat must be at least 100ms" in result.stderr

    def test_reads_the_runs_variables(self, jobrun_here, key):
        """JOBRUN_HEARTBEAT is the drill's --heartbeat too: a bad one is named (exit 64)."""
        result = jobrun_here.run(
            "drill", "--key", key, dsn="host=127.0.0.1 port=1", env={"JOBRUN_HEARTBEAT": "50ms"}
        )
        assert result.returncode == 64, result.stdout + result.stderr
        assert "JOBRUN_HEARTBEAT (the variable for --heartbeat) must be at least" in result.stderr

    def test_runs_get_the_drills_connect_timeout(self, key):
        """--connect-timeout is passed on to every run the drill starts."""
        plan = drill.Drill(
            key=keys.from_name(key),
            mode="session",
            target=db.Target(dsn="", connect_timeout=3.0),
            command=("true",),
            ttl=10.0,
            kill_after=2.0,
            heartbeat=None,
        )
        argv = plan.args("--", "true")
        assert argv[argv.index("--connect-timeout") + 1] == "3.0s"


class TestWhatTheDrillMustCatch:
    """Each step fails when what it rehearses does not hold."""

    def test_a_stranger_in_another_database_is_left_alone(self, dsn, key, other_database):
        """Advisory locks are per database: the same lock id held elsewhere is not ours."""
        lock_id = keys.from_name(key).lock_id
        with psycopg.connect(other_database, autocommit=True) as stranger:
            stranger.execute("SELECT pg_advisory_lock(%s)", (lock_id,))
            result = jobrun_cli.run("drill", "--key", key, dsn=dsn, timeout=120)
            # Terminated, this session would raise here.
            held = stranger.execute(
                "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND granted"
                " AND pid = pg_backend_pid()"
            ).fetchone()
        assert held == (1,)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "backend terminated" in result.stdout

    def test_session_lock_freed_late_fails(self, dsn, key, pg_address):
        """The server keeps a killed jobrun's session 4 s: not "at once", so the step fails."""
        proxy = _SlowCloseProxy(*pg_address, delay=4.0)
        try:
            result = jobrun_cli.run("drill", "--key", key, dsn=proxy.dsn_for(dsn), timeout=120)
        finally:
            proxy.close()
        line = step_line(result.stdout, "next run acquired after the crash")
        assert line.strip().startswith("[FAIL]"), result.stdout
        assert "(expected at once: within 2s)" in line
        assert result.returncode == 1

    def test_lease_expired_early_by_hand_fails(self, dsn, key, tmp_path):
        """Someone expires the crashed run's lease: the next run gets it too early: FAIL."""
        marker = tmp_path / "pids"
        command = ["sh", "-c", f'echo $$ >> "{marker}"; exec sleep 600']
        args = ("--key", key, "--mode", "lease", "--ttl", "8s", "--kill-after", "1s")
        proc = start_drill(*args, "--", *command, dsn=dsn)
        try:
            jobrun_cli.wait_for_file(marker)
            first_child = marked_pids(marker)[0]
            # The kill -9 step: jobrun dies, and with it its child.
            jobrun_cli.wait_until(
                lambda: jobrun_cli.process_gone(first_child), timeout=60, what="the kill"
            )
            with psycopg.connect(dsn, autocommit=True) as conn:
                conn.execute(
                    "UPDATE jobrun.leases SET expires_at = clock_timestamp() WHERE lock_id = %s",
                    (keys.from_name(key).lock_id,),
                )
            stdout, stderr = proc.communicate(timeout=120)
        finally:
            proc.kill()
            proc.communicate()
            kill_groups(marked_pids(marker))
        line = step_line(stdout, "next run acquired after the crash")
        assert line.strip().startswith("[FAIL]"), stdout + stderr
        assert "BEFORE the lease could expire" in line
        assert proc.returncode == 1

    def test_output_before_the_started_line_is_read_at_once(self, dsn, key):
        """The child writes to the shared stderr first: no line may get stuck in a buffer."""
        started = time.monotonic()
        result = jobrun_cli.run(
            "drill", "--key", key, "--", "sh", "-c", "echo starting >&2; exec sleep 605",
            dsn=dsn, timeout=120,
        )  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert "[PASS] guarded run started" in result.stdout
        # A line stuck in a buffer would hold the step up to its whole timeout.
        assert time.monotonic() - started < drill.STEP_TIMEOUT, result.stdout

    def test_two_lines_in_one_read_are_both_seen(self):
        """The awaited event after another line in the same chunk is found at once."""
        lines = b'starting\n{"event": "started", "child_pid": 1}\n'
        script = f"import os, time; os.write(2, {lines!r}); time.sleep(600)"
        run = background.BackgroundRun([sys.executable, "-c", script], dict(os.environ))
        try:
            started = time.monotonic()
            event = run.wait_event("started", 10)
            waited = time.monotonic() - started
        finally:
            run.proc.kill()
            run.finish(10)
        assert event == {"event": "started", "child_pid": 1}
        assert waited < 5

    def test_grandchildren_that_survive_the_kill_fail_and_are_killed(self, dsn, key, tmp_path):
        """`sh -c 'sleep 601; true'`: sleep outlives a killed jobrun; the drill shows it."""
        marker = tmp_path / "pids"
        command = ["sh", "-c", f'echo $$ >> "{marker}"; sleep 601; true']
        try:
            result = jobrun_cli.run("drill", "--key", key, "--", *command, dsn=dsn, timeout=120)
            groups = marked_pids(marker)
            survived = [pgid for pgid in groups if not jobrun_cli.group_gone(pgid)]
        finally:
            kill_groups(marked_pids(marker))
        line = step_line(result.stdout, "kill -9 of jobrun: the child died")
        assert line.strip().startswith("[FAIL]"), result.stdout
        assert (
            "1 process of the job's group survived jobrun's death: use exec or systemd, "
            "see README" in line
        )
        assert result.returncode == 1
        # The first run's group, and the lock-taken-away run's when its shell got as far as
        # writing its pid: on a loaded machine the lock can be gone, and the group stopped,
        # before the shell runs its first command.
        assert 1 <= len(groups) <= 2, groups
        assert survived == [], "the drill left the job's group running"


class TestStoppingTheDrill:
    """A drill that is stopped, or whose step fails with an error, leaves nothing behind."""

    @pytest.mark.parametrize(
        ("mode", "signum"),
        [
            ("session", signal.SIGTERM),
            ("lease", signal.SIGTERM),
            ("session", signal.SIGQUIT),
            ("session", signal.SIGUSR1),
        ],
        ids=["session-TERM", "lease-TERM", "session-QUIT", "session-USR1"],
    )
    def test_a_signal_mid_run_stops_the_runs_and_frees_the_key(
        self, dsn, key, tmp_path, mode, signum
    ):
        """A stop signal while the guarded run holds the lock: checklist, 128+N, key free."""
        marker = tmp_path / "pids"
        command = ["sh", "-c", f'echo $$ $PPID >> "{marker}"; exec sleep 600']
        args = ("--key", key, "--mode", mode, "--ttl", "6s", "--kill-after", "1s")
        proc = start_drill(*args, "--", *command, dsn=dsn)
        try:
            jobrun_cli.wait_for_file(marker)
            child, jobrun_pid = marked_pids(marker)[:2]
            proc.send_signal(signum)
            stdout, stderr = proc.communicate(timeout=60)
        finally:
            proc.kill()
            proc.communicate()
            kill_groups(marked_pids(marker)[::2])
        name = signal.Signals(signum).name
        assert proc.returncode == 128 + signum, stdout + stderr
        assert f"  interrupted by {name}" in stdout  # the step it stopped: [FAIL]
        assert stdout.rstrip().endswith(f"drill interrupted by {name}")
        assert stderr == ""
        assert jobrun_cli.process_gone(jobrun_pid)
        assert jobrun_cli.group_gone(child)
        assert key_is_free(key, mode, dsn)

    def test_a_step_that_raises_fails_and_the_runs_are_stopped(
        self, dsn, key, tmp_path, monkeypatch
    ):
        """The database drops before step 5 takes the lock away: FAIL, checklist, cleanup."""
        marker = tmp_path / "pids"

        def database_gone(_drill: drill.Drill) -> str:
            raise LockStoreUnavailable("cannot connect to the database: connection refused")

        monkeypatch.setattr(drill, "_take_lock_away", database_gone)
        plan = drill.Drill(
            key=keys.from_name(key),
            mode="session",
            target=db.Target(dsn=dsn, connect_timeout=5.0),
            command=("sh", "-c", f'echo $$ >> "{marker}"; exec sleep 600'),
            ttl=10.0,
            kill_after=1.0,
            heartbeat=None,
        )
        lines: list[str] = []
        try:
            status = drill.run_drill(plan, lines.append)
        finally:
            kill_groups(marked_pids(marker))
        out = "\n".join(lines)
        assert status == 1, out
        line = step_line(out, "lock taken away: child stopped (exit 76)")
        assert line.strip().startswith("[FAIL]"), out
        assert "error: cannot connect to the database: connection refused" in line
        assert out.endswith("drill FAILED")
        victim = marked_pids(marker)[-1]
        assert jobrun_cli.process_gone(victim)
        assert key_is_free(key, "session", dsn)
