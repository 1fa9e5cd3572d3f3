"""Streak alerts against a real PostgreSQL: skips and failures in a row, reminders, hooks."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time
import uuid

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harness import jobrun_cli
from harness.jobrun_cli import wait_until
from jobrun.exitcodes import UsageError
from jobrun.history.config import iso
from jobrun.run import alerts
from support.history import Run, history_config, holder, hook, hook_calls, rows_of


def age_alerts(dsn: str, label: str, *, hours: int) -> None:
    """Move the last alert of every streak of ``label`` back: as if that much time passed."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "UPDATE jobrun.runs SET alerted_at = alerted_at - make_interval(hours => %s)"
            " WHERE key = %s AND alerted_at IS NOT NULL",
            (hours, label),
        )


class TestSkipStreak:
    """N skips in a row behind the same holder are an error line and a hook call."""

    def test_alert_fires_exactly_at_n_and_the_hook_gets_json_on_stdin(
        self, make_recorder, captured, tmp_path
    ):
        """Two skips: nothing. The third: skip_streak at error level and the hook's stdin."""
        calls = tmp_path / "calls"
        config = history_config(alert_after=3, on_alert=hook(calls))
        blocker = str(uuid.uuid4())
        for _ in range(2):
            make_recorder(config=config).skipped("locked", holder(blocker), 75)
        assert captured.events("skip_streak") == []
        assert hook_calls(calls) == []
        third = make_recorder(config=config)
        third.skipped("locked", holder(blocker), 75)
        (line,) = captured.events("skip_streak")
        assert line["level"] == "error"
        assert (line["count"], line["threshold"]) == (3, 3)
        assert line["holder_run_id"] == blocker
        assert line["since"]
        (call,) = hook_calls(calls)
        payload = json.loads(call["stdin"])
        assert payload["event"] == "skip_streak"
        assert payload["key"] == third.label
        assert payload["count"] == 3
        assert payload["run_id"] == third.run_id
        assert payload["holder_run_id"] == blocker
        assert call["env"]["JOBRUN_ALERT_EVENT"] == "skip_streak"
        assert call["env"]["JOBRUN_ALERT_KEY"] == third.label
        assert call["env"]["JOBRUN_ALERT_COUNT"] == "3"
        assert call["env"]["JOBRUN_ALERT_SINCE"] == payload["since"]
        assert captured.events("alert_sent")

    def test_a_streak_alerts_at_n_and_not_again_within_the_repeat(self, make_recorder, captured):
        """Skips 4 and 5 of a streak that alerted at 3 stay quiet (a stuck night is one page)."""
        config = history_config(alert_after=3)
        blocker = str(uuid.uuid4())
        for _ in range(5):
            make_recorder(config=config).skipped("locked", holder(blocker), 75)
        assert [line["count"] for line in captured.events("skip_streak")] == [3]

    def test_the_reminder_comes_once_the_repeat_has_passed(self, dsn, make_recorder, captured):
        """Once --alert-repeat has passed since the last alert, the next skip alerts again."""
        config = history_config(alert_after=3, alert_repeat=3600)
        blocker = str(uuid.uuid4())
        for _ in range(4):
            make_recorder(config=config).skipped("locked", holder(blocker), 75)
        age_alerts(dsn, make_recorder().label, hours=2)
        for _ in range(2):
            make_recorder(config=config).skipped("locked", holder(blocker), 75)
        assert [line["count"] for line in captured.events("skip_streak")] == [3, 5]

    def test_a_run_that_gets_the_lock_ends_the_streak_once(self, make_recorder, captured, tmp_path):
        """The next run to take the lock says recovered (count, since, duration), once."""
        calls = tmp_path / "calls"
        config = history_config(alert_after=2, on_alert=hook(calls))
        blocker = str(uuid.uuid4())
        for _ in range(3):
            make_recorder(config=config).skipped("locked", holder(blocker), 75)
        first = make_recorder(config=config)
        first.acquired(None)
        first.flush()
        make_recorder(config=config).acquired(None)
        (line,) = captured.events("recovered")
        assert (line["streak"], line["count"]) == ("skip_streak", 3)
        assert line["duration"] >= 0
        assert line["run_id"] == first.run_id
        payloads = [json.loads(call["stdin"]) for call in hook_calls(calls)]
        assert [p["event"] for p in payloads] == ["skip_streak", "recovered"]
        assert payloads[1]["count"] == 3

    def test_a_streak_that_never_alerted_recovers_silently(self, make_recorder, captured):
        """Two skips below --alert-after 3, then a run: no recovered line."""
        config = history_config(alert_after=3)
        blocker = str(uuid.uuid4())
        for _ in range(2):
            make_recorder(config=config).skipped("locked", holder(blocker), 75)
        make_recorder(config=config).acquired(None)
        assert captured.events("recovered") == []

    def test_since_is_the_first_skip_of_the_streak(self, dsn, make_recorder, captured):
        """``since`` stays the start of the first skip, however long the streak grows."""
        config = history_config(alert_after=2)
        blocker = str(uuid.uuid4())
        first = make_recorder(config=config)
        first.skipped("locked", holder(blocker), 75)
        for _ in range(2):
            make_recorder(config=config).skipped("locked", holder(blocker), 75)
        started = rows_of(dsn, first.label)[-1]["started_at"]
        assert {line["since"] for line in captured.events("skip_streak")} == {iso(started)}

    def test_a_new_holder_starts_a_new_streak(self, make_recorder, captured):
        """Skips behind a different run each time (a busy fleet) never build a streak."""
        config = history_config(alert_after=2)
        for _ in range(4):
            make_recorder(config=config).skipped("locked", holder(str(uuid.uuid4())), 75)
        assert captured.events("skip_streak") == []

    def test_a_fleet_alerts_once_per_repeat(self, make_recorder, captured):
        """Three hosts skipping behind one stuck holder, four rounds: one alert in all."""
        config = history_config(alert_after=3)
        blocker = str(uuid.uuid4())
        for _ in range(4):
            for host in ("web1", "web2", "web3"):
                make_recorder(host=host, config=config).skipped("locked", holder(blocker), 75)
        alerts_sent = captured.events("skip_streak")
        assert [(line["count"], line["host"]) for line in alerts_sent] == [(3, "web1")]

    def test_a_fleet_skipping_at_the_same_moment_alerts_once(self, make_recorder, captured):
        """Six hosts released together by a barrier, six rounds: one alert in all."""
        config = history_config(alert_after=3)
        blocker = str(uuid.uuid4())
        hosts = [f"web{n}" for n in range(6)]
        for _ in range(6):
            fleet = [make_recorder(host=host, config=config) for host in hosts]
            barrier = threading.Barrier(len(fleet))

            def skip(recorder: Run, barrier: threading.Barrier = barrier) -> None:
                barrier.wait()
                recorder.skipped("locked", holder(blocker), 75)

            threads = [threading.Thread(target=skip, args=(r,)) for r in fleet]
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
        assert captured.events("history_failed") == []
        assert [line["count"] for line in captured.events("skip_streak")] == [3]

    def test_skips_behind_an_unknown_holder_never_chain(self, make_recorder, captured):
        """Without a holder to tell rounds apart, a skip is a streak of one."""
        config = history_config(alert_after=2)
        for _ in range(3):
            make_recorder(config=config).skipped("locked", {}, 75)
        assert captured.events("skip_streak") == []

    def test_a_foreign_holder_is_known_by_its_backend(self, make_recorder, captured):
        """A holder that is not jobrun still chains skips through its backend pid and start."""
        config = history_config(alert_after=2)
        foreign = {"holder_backend_pid": 1234, "holder_since": "2026-01-01T00:00:00+00:00"}
        for _ in range(2):
            make_recorder(config=config).skipped("locked", foreign, 75)
        assert [line["count"] for line in captured.events("skip_streak")] == [2]

    def test_already_ran_skips_never_make_a_streak(self, dsn, make_recorder, captured):
        """--once-per skips are the plan working: streak 0, no alert."""
        config = history_config(alert_after=1)
        recorder = make_recorder(config=config)
        recorder.skipped("already_ran", {}, 75)
        assert captured.events("skip_streak") == []
        (row,) = rows_of(dsn, recorder.label)
        assert (row["reason"], row["streak"]) == ("already_ran", 0)

    def test_alert_after_zero_disables_alerts(self, make_recorder, captured, tmp_path):
        """--alert-after 0: no error line and no hook, however long the streak."""
        config = history_config(alert_after=0, on_alert=hook(tmp_path / "calls"))
        blocker = str(uuid.uuid4())
        for _ in range(4):
            make_recorder(config=config).skipped("locked", holder(blocker), 75)
        assert captured.events("skip_streak") == []
        assert hook_calls(tmp_path / "calls") == []

    def test_skip_row_records_reason_exit_code_and_holder(self, dsn, make_recorder):
        """The skip row carries the reason, jobrun's exit status and the holder fields."""
        recorder = make_recorder()
        blocker = str(uuid.uuid4())
        recorder.skipped("locked", holder(blocker), 0)
        (row,) = rows_of(dsn, recorder.label)
        assert (row["outcome"], row["reason"], row["exit_code"]) == ("skipped", "locked", 0)
        assert row["holder"]["holder_run_id"] == blocker
        assert row["streak"] == 1


class TestFailureStreak:
    """N failed runs in a row are an error line and a hook call."""

    def test_alert_fires_at_n_failures_in_a_row(self, make_recorder, captured, tmp_path):
        """failed, timed_out, then exec_failed: failure_streak with count 3 and the hook."""
        calls = tmp_path / "calls"
        config = history_config(alert_after=3, on_alert=hook(calls))
        make_recorder(config=config).finished("failed", 1, None, 1.0)
        make_recorder(config=config).finished("timed_out", 124, "SIGTERM", 9.0)
        assert captured.events("failure_streak") == []
        make_recorder(config=config).exec_failed(127)
        (line,) = captured.events("failure_streak")
        assert line["level"] == "error"
        assert (line["count"], line["outcome"], line["exit_code"]) == (3, "exec_failed", 127)
        (call,) = hook_calls(calls)
        assert json.loads(call["stdin"])["event"] == "failure_streak"
        assert call["env"]["JOBRUN_ALERT_COUNT"] == "3"

    def test_a_success_ends_the_streak(self, make_recorder, captured):
        """failed, failed, succeeded, failed, failed: never three in a row."""
        config = history_config(alert_after=3)
        for outcome in ("failed", "failed", "succeeded", "failed", "failed"):
            make_recorder(config=config).finished(
                outcome, 0 if outcome == "succeeded" else 1, None, 1
            )
        assert captured.events("failure_streak") == []

    def test_skips_and_dead_runs_neither_extend_nor_break_it(self, make_recorder, captured):
        """failed, skip, abandoned, failed, failed: the third failure alerts."""
        config = history_config(alert_after=3)
        make_recorder(config=config).finished("failed", 1, None, 1.0)
        make_recorder(config=config).skipped("locked", holder(str(uuid.uuid4())), 75)
        make_recorder(config=config).running(1)  # dies
        make_recorder(config=config).acquired(None)  # ... and is marked abandoned
        make_recorder(config=config).finished("failed", 1, None, 1.0)
        make_recorder(config=config).finished("lock_lost", 76, None, 1.0)
        assert [line["count"] for line in captured.events("failure_streak")] == [3]

    def test_deferred_alert_waits_for_flush(self, make_recorder, captured, tmp_path):
        """finished() logs at once but runs the hook only on flush(), after the release."""
        calls = tmp_path / "calls"
        config = history_config(alert_after=1, on_alert=hook(calls))
        recorder = make_recorder(config=config).recorder
        recorder.finished("failed", 1, None, 1.0)
        assert len(captured.events("failure_streak")) == 1
        assert hook_calls(calls) == []
        recorder.flush()
        assert len(hook_calls(calls)) == 1

    def test_failures_past_n_stay_quiet_then_a_success_recovers(
        self, make_recorder, captured, tmp_path
    ):
        """Five failures alert once (at 3); the success after them says recovered, count 5."""
        calls = tmp_path / "calls"
        config = history_config(alert_after=3, on_alert=hook(calls))
        for _ in range(5):
            make_recorder(config=config).finished("failed", 1, None, 1.0)
        make_recorder(config=config).finished("succeeded", 0, None, 1.0)
        make_recorder(config=config).finished("succeeded", 0, None, 1.0)
        assert [line["count"] for line in captured.events("failure_streak")] == [3]
        (line,) = captured.events("recovered")
        assert (line["streak"], line["count"]) == ("failure_streak", 5)
        assert [json.loads(c["stdin"])["event"] for c in hook_calls(calls)] == [
            "failure_streak",
            "recovered",
        ]

    def test_a_failure_reminder_comes_once_the_repeat_has_passed(
        self, dsn, make_recorder, captured
    ):
        """The failure after --alert-repeat has passed since the last alert alerts again."""
        config = history_config(alert_after=2, alert_repeat=3600)
        for _ in range(3):
            make_recorder(config=config).finished("failed", 1, None, 1.0)
        age_alerts(dsn, make_recorder().label, hours=2)
        make_recorder(config=config).finished("failed", 1, None, 1.0)
        assert [line["count"] for line in captured.events("failure_streak")] == [2, 4]


class TestAlertHook:
    """The hook is bounded and its failures are logged, never raised."""

    def test_a_failing_hook_is_one_warning_with_its_stderr(self, captured):
        """Exit 3 with a message on stderr: alert_failed with both, and False."""
        argv = (sys.executable, "-c", "import sys; sys.stderr.write('pager down'); sys.exit(3)")
        assert not alerts.deliver(argv, {"event": "skip_streak"}, timeout=10, log=captured.log)
        (line,) = captured.events("alert_failed")
        assert (line["reason"], line["exit_code"], line["stderr"]) == (
            "exit_status",
            3,
            "pager down",
        )

    def test_the_hooks_stderr_never_shows_a_password(self, captured):
        """PGPASSWORD and the DSN's password are masked in alert_failed, even one cut in two."""
        pgpassword, dsn_password = "pg-env-Secret-4711", "dsn-Secret-0815"
        # Unmasked, the 300-character tail would start in the middle of the first PGPASSWORD.
        after_cut = len(pgpassword) - len(pgpassword) // 2
        filler = alerts.STDERR_TAIL - after_cut - 6 - len(dsn_password) - len(pgpassword)
        script = (
            "import os, sys\n"
            "pg = os.environ['PGPASSWORD']\n"
            "sys.stderr.write('x' * 500 + pg + ' / ' + sys.argv[1] + ' / ' + pg"
            " + 'y' * int(sys.argv[2]))\n"
            "sys.exit(1)\n"
        )
        argv = (sys.executable, "-c", script, dsn_password, str(filler))
        assert not alerts.deliver(
            argv,
            {"event": "skip_streak"},
            timeout=10,
            log=captured.log,
            environ={"PGPASSWORD": pgpassword},
            secrets=(dsn_password,),
        )
        (line,) = captured.events("alert_failed")
        assert line["stderr"].count("***") == 3, line["stderr"]
        written = captured.path.read_text()
        assert dsn_password not in written
        assert pgpassword[len(pgpassword) // 2 :] not in written

    def test_a_recorders_hook_never_shows_its_passwords(self, dsn, make_recorder, captured):
        """Through the Recorder: the DSN's password and PGPASSWORD are masked in alert_failed."""
        password = conninfo_to_dict(dsn).get("password") or "dsn-Secret-0815"
        pgpassword = "pg-env-Secret-4711"
        script = "import os, sys; sys.stderr.write(os.environ['PGPASSWORD'] + ' ' + sys.argv[1])"
        config = history_config(
            alert_after=1, on_alert=(sys.executable, "-c", f"{script}; sys.exit(1)", str(password))
        )
        recorder = make_recorder(
            target_dsn=make_conninfo(dsn, password=password),
            config=config,
            environ={"PGPASSWORD": pgpassword},
        )
        recorder.finished("failed", 1, None, 1.0)
        (line,) = captured.events("alert_failed")
        assert line["stderr"] == "*** ***"
        written = captured.path.read_text()
        assert str(password) not in written
        assert pgpassword not in written

    def test_a_hanging_hook_is_killed_at_the_timeout(self, captured, tmp_path):
        """A hook (and what it started) that outlives the timeout is killed with its group."""
        pid_file = tmp_path / "pid"
        argv = ("sh", "-c", f'sleep 300 & echo $! > "{pid_file}"; wait')
        started = time.monotonic()
        assert not alerts.deliver(argv, {"event": "skip_streak"}, timeout=0.5, log=captured.log)
        assert time.monotonic() - started < 5
        (line,) = captured.events("alert_failed")
        assert line["reason"] == "timed_out"
        wait_until(lambda: jobrun_cli.process_gone(int(pid_file.read_text())), what="sleep gone")

    def test_a_missing_hook_program_is_one_warning(self, captured):
        """A hook that cannot be started: alert_failed, reason cannot_execute."""
        argv = ("/nonexistent/pager",)
        assert not alerts.deliver(argv, {"event": "skip_streak"}, timeout=5, log=captured.log)
        assert captured.events("alert_failed")[0]["reason"] == "cannot_execute"

    def test_the_hook_runs_with_signals_unblocked(self, captured, tmp_path):
        """Even from inside the runner's blocked-signal section, SIGTERM reaches the hook."""
        out = tmp_path / "mask"
        argv = ("sh", "-c", f'grep SigBlk /proc/self/status > "{out}"')
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGCHLD})
        try:
            assert alerts.deliver(argv, {"event": "skip_streak"}, timeout=10, log=captured.log)
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        assert int(out.read_text().split()[1], 16) == 0

    def test_lists_and_unknown_fields_in_the_environment(self):
        """Lists are comma-joined, None is left out, old JOBRUN_ALERT_* are dropped."""
        env = alerts.environment(
            {"event": "x", "lock_ids": [1, -2], "holder_host": None},
            {"PATH": "/bin", "JOBRUN_ALERT_STALE": "1"},
        )
        assert env == {"PATH": "/bin", "JOBRUN_ALERT_EVENT": "x", "JOBRUN_ALERT_LOCK_IDS": "1,-2"}

    def test_on_alert_is_split_like_a_shell_without_one(self):
        """Quotes group words; nothing is expanded."""
        assert alerts.parse_command("page --to 'ops team' $HOME") == (
            "page",
            "--to",
            "ops team",
            "$HOME",
        )

    @pytest.mark.parametrize("text", ["", "   ", "page 'unterminated"])
    def test_a_bad_on_alert_is_a_usage_error(self, text):
        """Empty or badly quoted: UsageError (exit 64)."""
        with pytest.raises(UsageError):
            alerts.parse_command(text)
