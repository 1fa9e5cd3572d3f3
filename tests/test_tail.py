"""--keep-output: the child's output passes through live, and the tails of failed runs are kept."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from typing import TYPE_CHECKING

import psycopg
import pytest
from hypothesis import given
from hypothesis import strategies as st
from psycopg.conninfo import make_conninfo

from harness import jobrun_cli as cli
from harness.pgtools import create_database, drop_database
from jobrun.exitcodes import UsageError
from jobrun.run import tail
from tests.support import blocked_signals, started_threads

if TYPE_CHECKING:
    from pathlib import Path

ALL_BYTES = bytes(range(256))


def _run_id(stderr: str) -> str:
    return str(cli.event(stderr, "started")["run_id"])


def _stored(dsn: str, run_id: str) -> tuple[bytes | None, bytes | None]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT stdout_tail, stderr_tail FROM jobrun.runs WHERE run_id = %s", (run_id,)
        ).fetchone()
    assert row is not None
    return row[0], row[1]


class TestParseSize:
    @pytest.mark.parametrize(
        ("text", "size"),
        [("4096", 4096), ("16KiB", 16384), ("64k", 65536), ("1MiB", 1048576), ("2kB", 2000)],
    )
    def test_units(self, text, size):
        """Plain bytes, binary (KiB, k, MiB) and decimal (kB) units."""
        assert tail.parse_size(text) == size

    @pytest.mark.parametrize("text", ["", "abc", "16 parsecs", "-1", "1.5k", "2MiB", "9" * 20])
    def test_bad_sizes_are_usage_errors(self, text):
        """Anything else, or more than 1 MiB, is refused with the option's name."""
        with pytest.raises(UsageError, match="--keep-output"):
            tail.parse_size(text)


class TestRing:
    @given(
        size=st.integers(min_value=1, max_value=64),
        chunks=st.lists(st.binary(max_size=100), max_size=20),
    )
    def test_keeps_exactly_the_last_size_bytes(self, size, chunks):
        """Whatever the chunking, the ring holds the last ``size`` bytes of the stream."""
        ring = tail.Ring(size)
        for chunk in chunks:
            ring.write(chunk)
        assert ring.value() == b"".join(chunks)[-size:]
        assert ring.total == sum(map(len, chunks))


class _Sink:
    """Two temporary files standing in for jobrun's stdout and stderr."""

    def __init__(self, tmp_path: Path) -> None:
        self.paths = (tmp_path / "out", tmp_path / "err")
        self.fds = tuple(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND) for p in self.paths)

    def read(self) -> tuple[bytes, bytes]:
        return self.paths[0].read_bytes(), self.paths[1].read_bytes()

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


@pytest.fixture
def sink(tmp_path):
    opened = _Sink(tmp_path)
    yield opened
    opened.close()


def _capture_run(capture: tail.Capture, body: str) -> subprocess.Popen[bytes]:
    out, err = capture.child_fds()
    child = subprocess.Popen(
        [sys.executable, "-c", body], stdout=out, stderr=err, start_new_session=True
    )
    capture.begin()
    child.wait()
    return child


class TestCapture:
    def test_the_copying_thread_leaves_every_signal_to_the_main_thread(self, sink):
        """Begun with nothing blocked, the thread still blocks SIGCHLD and the rest."""
        capture = tail.Capture(16, targets=sink.fds)
        out, err = capture.child_fds()
        # Our own copies of the write ends: no EOF, so the thread is alive to be looked at.
        held = (os.dup(out), os.dup(err))
        before = set(threading.enumerate())
        previous = signal.pthread_sigmask(signal.SIG_SETMASK, set())
        try:
            capture.begin()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        try:
            blocked = blocked_signals(started_threads(before, "jobrun-output"))
        finally:
            for fd in held:
                os.close(fd)
            capture.finish()
        assert {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT} <= blocked

    def test_binary_output_passes_through_whole_and_the_tail_is_kept(self, sink):
        """Every byte value, on both streams: copied whole, the last SIZE bytes kept."""
        capture = tail.Capture(100, targets=sink.fds)
        _capture_run(
            capture,
            "import sys; data = bytes(range(256)) * 40\n"
            "sys.stdout.buffer.write(data); sys.stderr.buffer.write(data[::-1])",
        )
        capture.finish()
        out, err = sink.read()
        assert out == ALL_BYTES * 40
        assert err == (ALL_BYTES * 40)[::-1]
        assert capture.stdout_tail == out[-100:]
        assert capture.stderr_tail == err[-100:]
        assert capture.complete

    def test_a_huge_line_is_copied_without_keeping_it(self, sink):
        """8 MiB without a newline: all of it copied, only the tail kept in memory."""
        capture = tail.Capture(1000, targets=sink.fds)
        _capture_run(
            capture,
            "import sys\nfor i in range(8): sys.stdout.buffer.write(bytes([65 + i]) * 1048576)",
        )
        capture.finish()
        out, _ = sink.read()
        assert len(out) == 8 * 1048576
        assert capture.stdout_tail == b"H" * 1000

    def test_a_stream_closed_early_does_not_stop_the_other(self, sink):
        """The child closes its stdout first, then writes to stderr: both tails are right."""
        capture = tail.Capture(64, targets=sink.fds)
        _capture_run(
            capture,
            "import os, sys, time\nos.write(1, b'bye\\n'); os.close(1)\n"
            "time.sleep(0.2); os.write(2, b'still here\\n')",
        )
        capture.finish()
        assert capture.stdout_tail == b"bye\n"
        assert capture.stderr_tail == b"still here\n"
        assert capture.complete

    def test_a_process_that_left_the_group_does_not_keep_us_reading(self, sink, tmp_path):
        """A daemon holding the pipe open: finish() returns after the grace, tails so far kept."""
        pidfile = tmp_path / "daemon.pid"
        capture = tail.Capture(64, grace=0.5, targets=sink.fds)
        _capture_run(
            capture,
            "import os, subprocess, sys\nos.write(1, b'parent\\n')\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
            " start_new_session=True)\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))",
        )
        daemon = int(pidfile.read_text())
        try:
            began = time.monotonic()
            capture.finish()
            elapsed = time.monotonic() - began
        finally:
            os.kill(daemon, signal.SIGKILL)
        # finish() waits the grace for EOF, then once more for the copy to stop.
        assert elapsed < 2 * capture.grace + 1.0
        assert not capture.complete
        assert capture.stdout_tail == b"parent\n"

    def test_a_closed_stdout_of_ours_does_not_block_the_child(self, tmp_path):
        """Our stdout is a pipe nobody reads any more: the child still runs to its end."""
        read_end, write_end = os.pipe()
        os.close(read_end)
        err = os.open(tmp_path / "err", os.O_WRONLY | os.O_CREAT)
        try:
            capture = tail.Capture(16, targets=(write_end, err))
            child = _capture_run(capture, "import sys; sys.stdout.write('x' * 1000000)")
            capture.finish()
        finally:
            os.close(write_end)
            os.close(err)
        assert child.returncode == 0
        assert capture.stdout_tail == b"x" * 16
        assert capture.forward_errors == {write_end: "EPIPE"}


class TestRender:
    def test_binary_is_shown_with_replacement_characters(self):
        """Invalid UTF-8 and NUL become U+FFFD; a missing tail says so."""
        shown = tail.render(
            {
                "run_id": "r",
                "key": "k",
                "host": "h",
                "outcome": "failed",
                "exit_code": 3,
                "started_at": None,
                "stdout": b"a\xffb\x00c",
                "stderr": None,
            }
        )
        assert "a\ufffdb\ufffdc\n" in shown
        assert "--- stderr: not kept" in shown


class TestInheritance:
    def test_without_keep_output_the_child_has_our_descriptors(self, dsn, key, tmp_path):
        """No pipes: the child's stdout is jobrun's own file."""
        out = tmp_path / "out"
        script = "import os; print(os.readlink('/proc/self/fd/1'))"
        with out.open("w") as stdout:
            proc = subprocess.run(
                [*cli.JOBRUN, "--key", key, "--", sys.executable, "-c", script],
                env=cli.environment(dsn),
                stdout=stdout,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
                check=False,
            )
        assert proc.returncode == 0, proc.stderr
        assert out.read_text().strip() == str(out)

    def test_with_keep_output_the_child_writes_to_a_pipe(self, dsn, key, tmp_path):
        """--keep-output: the child's stdout is our pipe; its text still lands in the file."""
        out = tmp_path / "out"
        script = "import os; print(os.readlink('/proc/self/fd/1'))"
        with out.open("w") as stdout:
            proc = subprocess.run(
                [
                    *cli.JOBRUN,
                    "--key",
                    key,
                    "--keep-output",
                    "1k",
                    "--",
                    sys.executable,
                    "-c",
                    script,
                ],
                env=cli.environment(dsn),
                stdout=stdout,
                stderr=subprocess.PIPE,
                text=True,
                timeout=60,
                check=False,
            )
        assert proc.returncode == 0, proc.stderr
        assert out.read_text().startswith("pipe:[")


class TestEndToEnd:
    def test_failed_run_keeps_the_tails_and_show_prints_them(self, dsn, key):
        """Exit 3: the output passes through whole, the last 1 KiB of each is in the history."""
        script = (
            "import sys; data = bytes(range(256)) * 20\n"
            "sys.stdout.buffer.write(data); sys.stderr.buffer.write(b'boom\\xff\\x00\\n')\n"
            "sys.exit(3)"
        )
        proc = subprocess.run(
            [
                *cli.JOBRUN,
                "--key",
                key,
                "--keep-output",
                "1KiB",
                "--",
                sys.executable,
                "-c",
                script,
            ],
            env=cli.environment(dsn),
            capture_output=True,
            timeout=60,
            check=False,
        )
        stderr = proc.stderr.decode("utf-8", "replace")
        assert proc.returncode == 3, stderr
        assert proc.stdout == ALL_BYTES * 20
        assert b"boom\xff\x00\n" in proc.stderr
        run_id = _run_id("\n".join(line for line in stderr.splitlines() if line.startswith("{")))
        assert _stored(dsn, run_id) == ((ALL_BYTES * 20)[-1024:], b"boom\xff\x00\n")
        shown = cli.run("show", run_id, dsn=dsn)
        assert shown.returncode == 0, shown.stderr
        assert "--- stderr (last 7 bytes)\nboom\ufffd\ufffd\n" in shown.stdout
        assert "--- stdout (last 1024 bytes)" in shown.stdout

    def test_successful_run_keeps_nothing(self, dsn, key):
        """Exit 0: no tail in the history (show says so, exit 1)."""
        proc = cli.run("--key", key, "--keep-output", "1k", "--", "echo", "fine", dsn=dsn)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout == "fine\n"
        run_id = _run_id(proc.stderr)
        assert _stored(dsn, run_id) == (None, None)
        assert cli.run("show", run_id, dsn=dsn).returncode == 1

    def test_output_reaches_our_stdout_while_the_child_runs(self, dsn, key, tmp_path):
        """The child waits for the test to have read its first line from jobrun's stdout."""
        go = tmp_path / "go"
        script = (
            "import os, sys, time\nprint('ready', flush=True)\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\nprint('done')"
        )
        proc = subprocess.Popen(
            [*cli.JOBRUN, "--key", key, "--keep-output", "1k", "--", sys.executable, "-c", script],
            env=cli.environment(dsn),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        assert proc.stdout is not None
        try:
            assert proc.stdout.readline() == "ready\n"
            go.touch()
            out, err = proc.communicate(timeout=60)
        finally:
            proc.kill()
        assert proc.returncode == 0, err
        assert out == "done\n"

    def test_a_daemon_holding_the_pipes_does_not_hang_jobrun(self, dsn, key, tmp_path):
        """The child starts a setsid daemon that keeps stdout and stderr open, then fails."""
        pidfile = tmp_path / "daemon.pid"
        script = (
            "import subprocess, sys\nprint('started a daemon', flush=True)\n"
            "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(300)'],"
            " start_new_session=True)\n"
            f"open({str(pidfile)!r}, 'w').write(str(p.pid))\nsys.exit(5)"
        )
        try:
            proc = cli.run(
                "--key", key, "--keep-output", "1k", "--", sys.executable, "-c", script, dsn=dsn
            )
        finally:
            if pidfile.exists():
                os.kill(int(pidfile.read_text()), signal.SIGKILL)
        assert proc.returncode == 5, proc.stderr
        assert _stored(dsn, _run_id(proc.stderr)) == (b"started a daemon\n", b"")

    def test_the_alert_hook_gets_the_tails(self, dsn, key, tmp_path):
        """A failure streak alert carries stdout_tail and stderr_tail in its JSON."""
        received = tmp_path / "alert.json"
        copy = f"import sys; open({str(received)!r}, 'w').write(sys.stdin.read())"
        hook = f'{sys.executable} -c "{copy}"'
        script = "import sys; print('out'); print('err', file=sys.stderr); sys.exit(2)"
        proc = cli.run(
            "--key", key, "--keep-output", "1k", "--alert-after", "1", "--on-alert", hook,
            "--", sys.executable, "-c", script, dsn=dsn,
        )  # fmt: skip
        assert proc.returncode == 2, proc.stderr
        event = json.loads(received.read_text())
        assert event["event"] == "failure_streak"
        assert (event["stdout_tail"], event["stderr_tail"]) == ("out\n", "err\n")

    def test_show_in_a_history_that_never_kept_output(self, pg_admin_dsn, key):
        """No tail columns yet: show finds the run, says nothing was kept, exits 1."""
        name = f"jobrun_tail_{uuid.uuid4().hex[:12]}"
        create_database(pg_admin_dsn, name)
        try:
            fresh = make_conninfo(pg_admin_dsn, dbname=name)
            proc = cli.run("--key", key, "--", "false", dsn=fresh)
            assert proc.returncode == 1, proc.stderr
            shown = cli.run("show", _run_id(proc.stderr), dsn=fresh)
        finally:
            drop_database(pg_admin_dsn, name)
        assert shown.returncode == 1
        assert "--- stdout: not kept" in shown.stdout

    def test_an_older_history_waits_for_its_owner_to_upgrade_it(self, fresh_dsn, role, key):
        """An older history (no version row, no tail columns) used by a role that does not
        own it: the run goes on and says why its history failed (the role may not run the
        schema's steps); the owner's next run upgrades it, and the role's runs keep output.
        """
        ensure = cli.run("--key", f"{key}-owner", "--", "true", dsn=fresh_dsn)
        assert ensure.returncode == 0, ensure.stderr
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            conn.execute("ALTER TABLE jobrun.runs DROP COLUMN stdout_tail, DROP COLUMN stderr_tail")
            conn.execute("DROP TABLE jobrun.schema_version")
        worker = role(
            "GRANT USAGE ON SCHEMA jobrun TO {role}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON jobrun.runs TO {role}",
            database_dsn=fresh_dsn,
        )
        proc = cli.run("--key", key, "--keep-output", "1KiB", "--", "false", dsn=worker)
        assert proc.returncode == 1, proc.stderr
        assert "permission denied" in str(cli.event(proc.stderr, "history_failed")["error"])
        upgraded = cli.run("--key", f"{key}-owner", "--", "true", dsn=fresh_dsn)
        assert upgraded.returncode == 0, upgraded.stderr
        proc = cli.run("--key", key, "--keep-output", "1KiB", "--", "false", dsn=worker)
        assert proc.returncode == 1, proc.stderr
        assert "history_failed" not in proc.stderr
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            row = conn.execute(
                "SELECT outcome, stdout_tail IS NOT NULL FROM jobrun.runs WHERE key = %s",
                (key,),
            ).fetchone()
        assert row == ("failed", True)

    @pytest.mark.parametrize(
        "args",
        [
            ("--keep-output", "2MiB"),
            ("--keep-output", "lots"),
            ("--keep-output", "1k", "--no-history"),
        ],
    )
    def test_bad_keep_output_is_a_usage_error(self, dsn, key, args, tmp_path):
        """Refused with one line and exit 64, the child never started."""
        marker = tmp_path / "ran"
        proc = cli.run("--key", key, *args, "--", "touch", str(marker), dsn=dsn)
        assert proc.returncode == 64
        assert proc.stderr.count("\n") == 1
        assert "--keep-output" in proc.stderr
        assert not marker.exists()
