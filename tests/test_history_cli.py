"""Run history through the real CLI: abandoned runs, --once-per across processes, alerts."""

from __future__ import annotations

import json
import shlex
import signal

from harness import jobrun_cli
from harness.jobrun_cli import event, events, wait_for_file, wait_until
from support.history import hook, hook_calls, rows_of, table_exists


class TestWiredThroughCli:
    """The run command with history options, end to end."""

    def test_kill_9_leaves_an_abandoned_run_that_the_next_run_reports(self, dsn, key, tmp_path):
        """jobrun killed with SIGKILL: the next run logs abandoned_run naming it."""
        marker = tmp_path / "child"
        proc = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        wait_for_file(marker)
        wait_until(lambda: table_exists(dsn) and bool(rows_of(dsn, key)), what="running row")
        proc.kill()
        proc.communicate(timeout=30)
        result = jobrun_cli.run("--key", key, "--wait", "20s", "--", "true", dsn=dsn)
        assert result.returncode == 0, result.stderr
        line = event(result.stderr, "abandoned_run")
        assert line["abandoned_pid"] == proc.pid
        assert rows_of(dsn, key)[-1]["outcome"] == "abandoned"

    def test_once_per_runs_once_across_concurrent_processes(self, dsn, key, tmp_path):
        """Four hosts start at once with --once-per 1h: one child runs, three skip."""
        out = tmp_path / "ran"
        procs = [
            jobrun_cli.start(
                "--key",
                key,
                "--once-per",
                "1h",
                "--wait",
                "30s",
                "--",
                "sh",
                "-c",
                f'echo ran >> "{out}"',
                dsn=dsn,
            )
            for _ in range(4)
        ]
        outputs = [proc.communicate(timeout=60)[1] for proc in procs]
        results = list(zip([proc.returncode for proc in procs], outputs, strict=True))
        assert out.read_text().splitlines() == ["ran"]
        skipped = [stderr for status, stderr in results if status == 75]
        assert len(skipped) == 3
        assert all(event(stderr, "skipped")["reason"] == "already_ran" for stderr in skipped)

    def test_skip_streak_alert_runs_the_hook(self, dsn, key, tmp_path):
        """Three skips behind one holder with --alert-after 3: the hook gets the event."""
        marker = tmp_path / "child"
        calls = tmp_path / "calls"
        holder_proc = jobrun_cli.start(
            "--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn
        )
        try:
            wait_for_file(marker)
            command = shlex.join(hook(calls))
            results = [
                jobrun_cli.run(
                    "--key", key, "--alert-after", "3", "--on-alert", command, "--", "true", dsn=dsn
                )
                for _ in range(3)
            ]
        finally:
            jobrun_cli.signal_and_wait(holder_proc, signal.SIGTERM)
        assert [r.returncode for r in results] == [75, 75, 75]
        assert [e["event"] for e in events(results[2].stderr)].count("skip_streak") == 1
        assert all(e["event"] != "skip_streak" for r in results[:2] for e in events(r.stderr))
        (call,) = hook_calls(calls)
        assert json.loads(call["stdin"])["count"] == 3

    def test_no_history_writes_nothing(self, dsn, key):
        """--no-history: the run leaves no row."""
        result = jobrun_cli.run("--key", key, "--no-history", "--", "true", dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert not table_exists(dsn) or rows_of(dsn, key) == []

    def test_a_streak_that_alerted_recovers_once_through_the_hook(self, dsn, key, tmp_path):
        """Skips alert once at --alert-after, then the next run says recovered (hook too)."""
        marker = tmp_path / "child"
        calls = tmp_path / "calls"
        command = shlex.join(hook(calls))
        options = ("--alert-after", "2", "--alert-repeat", "1h", "--on-alert", command)
        holder_proc = jobrun_cli.start(
            "--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn
        )
        try:
            wait_for_file(marker)
            skips = [
                jobrun_cli.run("--key", key, *options, "--", "true", dsn=dsn) for _ in range(3)
            ]
        finally:
            jobrun_cli.signal_and_wait(holder_proc, signal.SIGTERM)
        assert [r.returncode for r in skips] == [75, 75, 75]
        alerted = [
            e["count"] for r in skips for e in events(r.stderr) if e["event"] == "skip_streak"
        ]
        assert alerted == [2]
        runs = [jobrun_cli.run("--key", key, *options, "--", "true", dsn=dsn) for _ in range(2)]
        assert [r.returncode for r in runs] == [0, 0]
        assert event(runs[0].stderr, "recovered")["count"] == 3
        assert all(e["event"] != "recovered" for e in events(runs[1].stderr))
        payloads = [json.loads(call["stdin"]) for call in hook_calls(calls)]
        assert [p["event"] for p in payloads] == ["skip_streak", "recovered"]

    def test_a_bad_alert_repeat_is_a_usage_error(self, dsn, key, tmp_path):
        """--alert-repeat 0 or nonsense: exit 64, one line, no child."""
        ran = tmp_path / "ran"
        for value in ("0", "soon"):
            result = jobrun_cli.run(
                "--key", key, "--alert-repeat", value, "--", "touch", str(ran), dsn=dsn
            )
            assert result.returncode == 64, result.stderr
            assert len(result.stderr.strip().splitlines()) == 1
        assert not ran.exists()
