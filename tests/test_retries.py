"""--retries: a failed child runs again under the same lock, in the same run."""

from __future__ import annotations

import json
import signal
from typing import Any

import psycopg
import pytest
from test_ping import Monitor

from harness import jobrun_cli
from harness.jobrun_cli import wait_until
from jobrun import keys
from jobrun.run import pacing
from support.modes import LEASE_TTL, MODES
from support.modes import events_until as _events_until
from support.modes import run as _run
from support.modes import start as _start
from support.spans import assert_no_overlap, attempt_child, started


def _row(dsn: str, key: str) -> tuple[Any, ...]:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT outcome, exit_code, attempts, attempt_exit_codes FROM jobrun.runs "
            "WHERE key = %s AND outcome <> 'skipped'",
            (key,),
        ).fetchone()
    assert row is not None
    return tuple(row)


class TestBackoff:
    def test_the_delay_doubles_up_to_ten_times_the_first(self):
        assert [pacing.retry_delay(2.0, n) for n in range(1, 7)] == [2, 4, 8, 16, 20, 20]


@pytest.mark.parametrize("mode", MODES)
class TestRetries:
    def test_a_failing_child_runs_again_until_it_succeeds(self, dsn, key, tmp_path, mode):
        """Exit 1, exit 2, then 0: one run, three attempts, each one's status recorded."""
        log, counter = tmp_path / "spans", tmp_path / "n"
        result = _run(
            key, mode, "--retries", "3", "--retry-delay", "100ms", "--",
            *attempt_child(log, counter, [1, 2]), dsn=dsn,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        retrying = [e for e in jobrun_cli.events(result.stderr) if e["event"] == "retrying"]
        assert [(e["attempt"], e["exit_code"], e["delay"]) for e in retrying] == [
            (2, 1, 0.1),
            (3, 2, 0.2),
        ]
        finished = jobrun_cli.event(result.stderr, "finished")
        assert (finished["attempts"], finished["attempt_exit_codes"]) == (3, [1, 2, 0])
        assert len(assert_no_overlap(log)) == 3
        assert _row(dsn, key) == ("succeeded", 0, 3, [1, 2, 0])

    def test_a_rival_skips_between_attempts_and_the_last_status_stands(
        self, dsn, key, tmp_path, mode
    ):
        """The lock is held across the pause: a rival skips; the run exits the last code."""
        log, counter = tmp_path / "spans", tmp_path / "n"
        proc = _start(
            key, mode, "--retries", "2", "--retry-delay", "1s", "--",
            *attempt_child(log, counter, [3, 3, 5]), dsn=dsn,
        )  # fmt: skip
        try:
            _events_until(proc, "retrying")
            rival = _run(key, mode, "--", *attempt_child(log, tmp_path / "r", [0]), dsn=dsn)
            assert rival.returncode == 75, rival.stderr
            _, rest = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 5, rest
        assert len(assert_no_overlap(log)) == 3  # the rival's child never ran
        assert _row(dsn, key) == ("failed", 5, 3, [3, 3, 5])

    def test_only_the_retry_on_codes_are_retried(self, dsn, key, tmp_path, mode):
        log, counter = tmp_path / "spans", tmp_path / "n"
        result = _run(
            key, mode, "--retries", "5", "--retry-delay", "10ms", "--retry-on", "3,9", "--",
            *attempt_child(log, counter, [3, 4]), dsn=dsn,
        )  # fmt: skip
        assert result.returncode == 4, result.stderr
        assert started(log) == 2
        assert _row(dsn, key) == ("failed", 4, 2, [3, 4])

    def test_a_child_killed_by_a_signal_is_not_retried(self, dsn, key, tmp_path, mode):
        log, counter = tmp_path / "spans", tmp_path / "n"
        result = _run(
            key, mode, "--retries", "3", "--retry-delay", "10ms", "--",
            *attempt_child(log, counter, [-int(signal.SIGKILL)]), dsn=dsn,
        )  # fmt: skip
        assert result.returncode == 128 + signal.SIGKILL, result.stderr
        assert started(log) == 1
        assert "retrying" not in [e["event"] for e in jobrun_cli.events(result.stderr)]

    def test_timeout_bounds_the_whole_run_not_each_attempt(self, dsn, key, tmp_path, mode):
        """--timeout 2s with attempts of 0.8 s each: never the 11 attempts asked for."""
        log, counter = tmp_path / "spans", tmp_path / "n"
        timeout, attempt = 2.0, 0.8
        result = _run(
            key, mode, "--timeout", f"{timeout:g}s", "--kill-after", "1s", "--retries", "10",
            "--retry-delay", "10ms", "--",
            *attempt_child(log, counter, [1] * 11, seconds=attempt), dsn=dsn,
        )  # fmt: skip
        events = [e["event"] for e in jobrun_cli.events(result.stderr)]
        # Either the last attempt was cut by the timeout (124), or no time was left to
        # start another (the last attempt's own status, 1).
        assert result.returncode in {124, 1}, result.stderr
        assert ("timed_out" in events) == (result.returncode == 124)
        assert started(log) <= int(timeout / attempt) + 1
        finished = jobrun_cli.event(result.stderr, "finished")
        assert finished["duration"] < timeout + 1.0 + attempt  # timeout + kill-after + one

    def test_a_kill_9_between_attempts_leaves_no_lock_behind(self, dsn, key, tmp_path, mode):
        """jobrun killed during the pause: the server frees the lock (lease: at its TTL)."""
        log, counter = tmp_path / "spans", tmp_path / "n"
        proc = _start(
            key, mode, "--retries", "3", "--retry-delay", "1h", "--",
            *attempt_child(log, counter, [1]), dsn=dsn,
        )  # fmt: skip
        _events_until(proc, "retrying")
        proc.kill()
        proc.communicate()
        bound = 20.0 + (LEASE_TTL if mode == "lease" else 0.0)
        wait_until(
            lambda: _run(key, mode, "--", "true", dsn=dsn).returncode == 0,
            timeout=bound,
            what="the key to be free",
        )
        assert started(log) == 1

    def test_a_stop_between_attempts_ends_the_run(self, dsn, key, tmp_path, mode):
        log, counter = tmp_path / "spans", tmp_path / "n"
        proc = _start(
            key, mode, "--retries", "3", "--retry-delay", "1h", "--",
            *attempt_child(log, counter, [6]), dsn=dsn,
        )  # fmt: skip
        try:
            _events_until(proc, "retrying")
            stop = jobrun_cli.run("stop", key, "--reason", "enough", "--wait", "20s", dsn=dsn)
            assert stop.returncode == 0, stop.stdout + stop.stderr
            _, rest = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 6, rest
        abandoned = jobrun_cli.event(rest, "retry_abandoned")
        assert abandoned["stop_requested_by_reason"] == "enough"
        assert started(log) == 1

    def test_a_signal_between_attempts_ends_the_run(self, dsn, key, tmp_path, mode):
        log, counter = tmp_path / "spans", tmp_path / "n"
        proc = _start(
            key, mode, "--retries", "3", "--retry-delay", "1h", "--",
            *attempt_child(log, counter, [7]), dsn=dsn,
        )  # fmt: skip
        _events_until(proc, "retrying")
        rest = jobrun_cli.signal_and_wait(proc, signal.SIGTERM)
        assert proc.returncode == 7, rest
        assert jobrun_cli.event(rest, "retry_abandoned")["signal"] == "SIGTERM"
        assert started(log) == 1
        assert _run(key, mode, "--", "true", dsn=dsn).returncode == 0  # released


@pytest.mark.parametrize("mode", MODES)
class TestLostLockBetweenAttempts:
    def test_a_lost_lock_stops_retrying(self, dsn, key, tmp_path, mode):
        """The lock taken away during the pause (session ended, lease deleted): no retry."""
        log, counter = tmp_path / "spans", tmp_path / "n"
        proc = _start(
            key, mode, "--retries", "3", "--retry-delay", "1h", "--",
            *attempt_child(log, counter, [8]), dsn=dsn,
        )  # fmt: skip
        try:
            _events_until(proc, "retrying")
            classid, objid = keys.from_name(key).pg_locks_pair
            with psycopg.connect(dsn, autocommit=True) as conn:
                if mode == "session":
                    conn.execute(
                        "SELECT pg_terminate_backend(pid) FROM pg_locks "
                        "WHERE locktype = 'advisory' AND classid = %s::int8::oid "
                        "AND objid = %s::int8::oid AND objsubid = 1",
                        (classid, objid),
                    )
                else:
                    conn.execute(
                        "DELETE FROM jobrun.leases WHERE lock_id = %s", (keys.lock_id_for(key),)
                    )
            _, rest = proc.communicate(timeout=30)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        assert proc.returncode == 8, rest
        assert "lock_lost" in jobrun_cli.event(rest, "retry_abandoned")
        assert started(log) == 1


class TestRetriesSession:
    def test_one_start_ping_and_one_end_ping_per_run(self, dsn, key, tmp_path):
        monitor = Monitor()
        try:
            result = jobrun_cli.run(
                "--key", key, "--ping", monitor.url, "--retries", "2", "--retry-delay", "10ms",
                "--", *attempt_child(tmp_path / "spans", tmp_path / "n", [1, 1]), dsn=dsn,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            assert monitor.paths() == ["/start", "/0"]
        finally:
            monitor.stop()


class TestRefused:
    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (("--retry-on", "1"), "--retry-on goes with --retries"),
            (("--retries", "1", "--retry-on", "1,x"), "'x' is not an exit code"),
            (("--retries", "1", "--retry-on", "0"), "'0' is not an exit code"),
            (("--retries", "1", "--keep-output", "1KiB"), "--retries with --keep-output"),
            (("--jitter-random",), "--jitter-random goes with --jitter"),
        ],
    )
    def test_usage_errors(self, jobrun_here, args, message):
        result = jobrun_here.run("--key", "k", *args, "--", "true", dsn="host=/nonexistent")
        assert result.returncode == 64, result.stderr
        assert message in result.stderr


class TestOlderHistory:
    def test_a_role_that_cannot_upgrade_still_runs_and_the_owners_upgrade_adds_them(
        self, teams, tmp_path
    ):
        """A history from before the columns (schema step 1), a granted role: it runs."""
        with psycopg.connect(teams.owner, autocommit=True) as conn:
            conn.execute(
                "ALTER TABLE jobrun.runs DROP COLUMN attempts, DROP COLUMN attempt_exit_codes;"
                "UPDATE jobrun.schema_version SET version = 1"
            )
        child = attempt_child(tmp_path / "spans", tmp_path / "n", [1])
        result = jobrun_cli.run(
            "--key", "a-old", "--retries", "1", "--retry-delay", "10ms", "--", *child,
            dsn=teams.a,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr  # the child ran, retried, under the lock
        # The owner's next run upgrades the schema (step 2 adds the columns) ...
        owner = jobrun_cli.run("--key", "a-owner", "--", "true", dsn=teams.owner)
        assert owner.returncode == 0, owner.stderr
        # ... and the team's runs record their attempts again.
        child = attempt_child(tmp_path / "spans2", tmp_path / "n2", [1])
        again = jobrun_cli.run(
            "--key", "a-old", "--retries", "1", "--retry-delay", "10ms", "--", *child,
            dsn=teams.a,
        )  # fmt: skip
        assert again.returncode == 0, again.stderr
        shown = jobrun_cli.run("history", "a-old", "--json", dsn=teams.owner)
        assert shown.returncode == 0, shown.stderr
        newest = json.loads(shown.stdout)[0]
        assert (newest["outcome"], newest["attempts"]) == ("succeeded", 2), newest

    def test_history_shows_the_attempts(self, dsn, key, tmp_path):
        result = jobrun_cli.run(
            "--key", key, "--retries", "1", "--retry-delay", "10ms", "--",
            *attempt_child(tmp_path / "spans", tmp_path / "n", [4]), dsn=dsn,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        shown = jobrun_cli.run("history", key, dsn=dsn)
        assert "2 attempts (4,0)" in shown.stdout, shown.stdout
        runs = json.loads(jobrun_cli.run("history", key, "--json", dsn=dsn).stdout)
        assert (runs[0]["attempts"], runs[0]["attempt_exit_codes"]) == (2, [4, 0])
