"""A run that waits says so: for its lock (--wait), and for a server that does not answer."""

from __future__ import annotations

import json
import signal
import socket
from typing import TYPE_CHECKING, Any

import pytest

from harness import jobrun_cli
from harness.jobrun_cli import wait_for_file
from jobrun import db
from jobrun.run import waiting

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Iterator

MODES = ("session", "lease")
PASSWORD = "s3cret-pw"  # noqa: S105 - a test's own


def _events_until(proc: subprocess.Popen[str], name: str) -> list[dict[str, Any]]:
    """The JSON event lines ``proc`` writes to stderr, up to and including ``name``."""
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(json.loads(line))
        if seen[-1]["event"] == name:
            return seen
    msg = f"jobrun ended (status {proc.wait()}) before {name!r}: {seen!r}"
    raise AssertionError(msg)


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A port that accepts TCP connections and never says a word."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield server.getsockname()[1]


class TestWaitingForTheLock:
    """--wait: one line when the wait starts (who holds the key), then one per --wait-report."""

    @pytest.mark.parametrize("mode", MODES)
    def test_a_waiting_run_names_the_holder_and_says_it_still_waits(self, dsn, key, tmp_path, mode):
        """waiting_for_lock with the holder's run id, then still_waiting; then it runs."""
        marker = tmp_path / "child"
        holder = jobrun_cli.start(
            "--key", key, "--mode", mode, "--", *jobrun_cli.holder_marker(marker), dsn=dsn
        )
        waiter = None
        try:
            holder_run = _events_until(holder, "started")[-1]["run_id"]
            wait_for_file(marker, proc=holder)
            waiter = jobrun_cli.start(
                "--key", key, "--mode", mode, "--wait", "5m", "--wait-report", "1s",
                "--", "true", dsn=dsn,
            )  # fmt: skip
            lines = _events_until(waiter, "still_waiting")
        finally:
            holder.send_signal(signal.SIGTERM)
            holder.communicate(timeout=60)
            if waiter is not None:
                rest = waiter.communicate(timeout=60)[1]
        first, later = (e for e in lines if e["event"] in {"waiting_for_lock", "still_waiting"})
        assert first["event"] == "waiting_for_lock"
        assert first["holder_run_id"] == holder_run
        assert first["wait"] == 300
        assert first["waited"] >= waiting.NOTICE_AFTER
        assert later["event"] == "still_waiting"
        assert later["holder_run_id"] == holder_run
        # --wait-report 1s apart, each figure rounded to 0.1 s
        assert later["waited"] - first["waited"] >= 1 - 0.1
        assert waiter.returncode == 0, rest
        assert jobrun_cli.event(rest, "started")["run_id"] == lines[0]["run_id"]

    def test_a_free_lock_is_taken_without_a_word_of_waiting(self, dsn, key):
        """--wait on a free key: no waiting line (and no second session to look one up)."""
        result = jobrun_cli.run("--key", key, "--wait", "5m", "--", "true", dsn=dsn)
        assert result.returncode == 0, result.stderr
        names = {e["event"] for e in jobrun_cli.events(result.stderr)}
        assert names.isdisjoint({"waiting_for_lock", "still_waiting"})


class TestStillConnecting:
    """A server that accepts and never answers: one line after 2 s, the password masked."""

    def test_a_run_logs_still_connecting_once(self, jobrun_here, silent_listener, key):
        """Event still_connecting with the address, then exit 69; the password nowhere."""
        dsn = f"postgresql://u:{PASSWORD}@127.0.0.1:{silent_listener}/d"
        timeout = f"{2 * db.SLOW_CONNECT:g}s"
        result = jobrun_here.run("--key", key, "--connect-timeout", timeout, "--", "true", dsn=dsn)
        assert result.returncode == 69, result.stderr
        line = jobrun_cli.event(result.stderr, "still_connecting")
        assert line["target"] == f"127.0.0.1:{silent_listener}/d"
        assert PASSWORD not in result.stderr

    def test_a_subcommand_says_it_is_still_connecting(self, jobrun_here, silent_listener):
        """`jobrun status`: one line on stderr naming the address, then exit 69."""
        dsn = f"postgresql://u:{PASSWORD}@127.0.0.1:{silent_listener}/d"
        timeout = f"{2 * db.SLOW_CONNECT:g}s"
        result = jobrun_here.run("status", "--connect-timeout", timeout, dsn=dsn)
        assert result.returncode == 69
        assert result.stderr.count("still connecting") == 1
        assert f"still connecting to 127.0.0.1:{silent_listener}/d" in result.stderr
        assert PASSWORD not in result.stderr
