"""Operators in control, through the real CLI: stop, pause/resume, overdue keys, slots."""

from __future__ import annotations

import json

import psycopg
import pytest

from harness import jobrun_cli
from harness.jobrun_cli import event, events, wait_for_file, wait_until
from jobrun.keys import lock_id_for
from jobrun.locks.slots import slot_lock_id
from jobrun.locks.stops import STOP_TABLE_PROBE
from support.history import ensure_runs_table, rows_of

MODES = ("session", "lease")
#: The lock id of slot 0 of nightly-export (docs/control.md shows it too).
SLOT_0_OF_NIGHTLY_EXPORT = -7738332938438756051


def _holder(key: str, mode: str, marker, *args: str, dsn: str):
    """A run of ``key`` whose child writes its pid to ``marker`` and then sleeps."""
    return jobrun_cli.start(
        "--key",
        key,
        "--mode",
        mode,
        *args,
        "--",
        *jobrun_cli.holder_marker(marker),
        dsn=dsn,
    )


def _plain_check_sent(dsn: str, key: str) -> bool:
    """The lock session of ``key`` last sent the heartbeat check without the stop lookup."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT query FROM pg_stat_activity WHERE application_name = %s", (f"jobrun:{key}",)
        ).fetchall()
    return any("*/ \nSELECT count(*) FROM pg_locks" in str(row[0]) for row in rows)


class TestStop:
    """jobrun stop KEY: the holder stops its child and ends with outcome stopped (77)."""

    @pytest.mark.parametrize("mode", MODES)
    def test_stop_ends_the_run_with_outcome_stopped(self, dsn, key, tmp_path, mode):
        """The run logs who asked, its finished line says stopped, exit 77; stop exits 0."""
        marker = tmp_path / "child"
        proc = _holder(key, mode, marker, "--heartbeat", "200ms", dsn=dsn)
        wait_for_file(marker)
        result = jobrun_cli.run("stop", key, "--reason", "deploy freeze", dsn=dsn)
        _, stderr = proc.communicate(timeout=60)
        assert result.returncode == 0, result.stderr
        assert "stopped (exit 77)" in result.stdout
        assert proc.returncode == 77, stderr
        asked = event(stderr, "stop_requested")
        assert asked["requested_by_reason"] == "deploy freeze"
        assert asked["requested_by_pid"] > 0
        assert {"requested_by_host", "requested_by_username"} <= set(asked)
        finished = event(stderr, "finished")
        assert (finished["outcome"], finished["exit_code"]) == ("stopped", 77)
        assert finished["signal"] == "SIGTERM"
        assert rows_of(dsn, key)[0]["outcome"] == "stopped"

    def test_child_ignoring_sigterm_is_killed_after_kill_after(self, dsn, key, tmp_path):
        """A child that ignores SIGTERM gets SIGKILL after --kill-after: still stopped, 77."""
        marker = tmp_path / "child"
        body = (
            "import os, signal, time\n"
            "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"open({str(marker)!r}, 'w').write(str(os.getpid()) + '\\n')\n"
            "time.sleep(300)\n"
        )
        proc = jobrun_cli.start(
            "--key",
            key,
            "--kill-after",
            "1s",
            "--heartbeat",
            "200ms",
            "--",
            *jobrun_cli.child_script(body),
            dsn=dsn,
        )
        wait_for_file(marker)
        result = jobrun_cli.run("stop", key, dsn=dsn)
        _, stderr = proc.communicate(timeout=60)
        assert result.returncode == 0, result.stderr
        assert proc.returncode == 77, stderr
        assert event(stderr, "child_killed")["signal"] == "SIGKILL"
        finished = event(stderr, "finished")
        assert (finished["outcome"], finished["signal"]) == ("stopped", "SIGKILL")

    @pytest.mark.parametrize("mode", MODES)
    def test_stop_reaches_a_run_started_before_the_table_existed(
        self, fresh_dsn, key, tmp_path, mode
    ):
        """A fresh database, --no-history: the run finds the table stop creates, and stops."""
        marker = tmp_path / "child"
        proc = _holder(key, mode, marker, "--no-history", "--heartbeat", "200ms", dsn=fresh_dsn)
        wait_for_file(marker)
        if mode == "session":
            # The heartbeat has found no table and fallen back to its plain check.
            wait_until(lambda: _plain_check_sent(fresh_dsn, key), what="the plain check")
        # Both modes look for the table again every STOP_TABLE_PROBE seconds, at their next
        # heartbeat (lease mode: its renewal interval, below --ttl, 30 s by default).
        wait = STOP_TABLE_PROBE + 30
        result = jobrun_cli.run("stop", key, "--wait", f"{wait}s", dsn=fresh_dsn, timeout=wait + 30)
        _, stderr = proc.communicate(timeout=60)
        assert result.returncode == 0, result.stderr
        assert proc.returncode == 77, stderr

    @pytest.mark.parametrize("mode", MODES)
    def test_a_role_that_may_not_read_stop_requests_keeps_its_lock(
        self, fresh_dsn, key, role, tmp_path, mode
    ):
        """Every table granted but stop_requests: one warning, no failed heartbeat, exit 0."""
        for owner_mode in MODES:  # the owner's runs create every table
            owner_run = jobrun_cli.run(
                "--key", key, "--mode", owner_mode, "--", "true", dsn=fresh_dsn
            )
            assert owner_run.returncode == 0, owner_run.stderr
        dsn = role(
            "GRANT USAGE ON SCHEMA jobrun TO {role}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON jobrun.runs, jobrun.leases, jobrun.pauses, "
            "jobrun.expectations TO {role}",
            "GRANT USAGE ON ALL SEQUENCES IN SCHEMA jobrun TO {role}",
            database_dsn=fresh_dsn,
        )
        marker = tmp_path / "child"
        log = tmp_path / "jobrun.log"
        proc = jobrun_cli.start(
            "--key", key, "--mode", mode, "--heartbeat", "200ms", "--log-file", str(log), "--",
            "sh", "-c", f'echo $$ > "{marker}"; while [ ! -e "{marker}.go" ]; do sleep 0.05; done',
            dsn=dsn,
        )  # fmt: skip
        wait_for_file(marker)
        # Logged once the plain check (or renewal) that followed the refused one went through.
        wait_until(lambda: '"stop_requests_unreadable"' in log.read_text(), what="the warning")
        (tmp_path / "child.go").touch()
        proc.communicate(timeout=60)
        text = log.read_text()
        assert proc.returncode == 0, text
        assert [e["event"] for e in events(text)].count("stop_requests_unreadable") == 1
        assert "heartbeat_failed" not in text
        assert (
            "permission denied for table stop_requests"
            in event(text, "stop_requests_unreadable")["error"]
        )
        assert event(text, "finished")["outcome"] == "succeeded"

    def test_stop_of_a_free_key_exits_1(self, dsn, key):
        """Nothing holds the key: stop says so and exits 1."""
        assert jobrun_cli.run("--key", key, "--", "true", dsn=dsn).returncode == 0
        result = jobrun_cli.run("stop", key, dsn=dsn)
        assert result.returncode == 1
        assert f"nothing holds {key}" in result.stderr

    @pytest.mark.parametrize("schema", ["init", "leases", "runs only"])
    def test_a_holder_naming_a_run_of_another_key_is_not_asked(
        self, fresh_dsn, key, tmp_path, schema
    ):
        """A session holding KEY whose comment names another key's run: refused (3), no row.

        No request is written for that run (it would take the run id's one row), so its own
        key's stop still reaches it. The run's label is read from ``jobrun init``'s
        run_label, or the table itself: in the request's own message where the lookups
        before it could all be made at once (``init``, ``leases``), else one by one.
        """
        other = f"{key}-other"
        if schema == "init":
            assert jobrun_cli.run("init", dsn=fresh_dsn).returncode == 0
        elif schema == "leases":
            ran = jobrun_cli.run("--key", other, "--mode", "lease", "--", "true", dsn=fresh_dsn)
            assert ran.returncode == 0, ran.stderr
        marker = tmp_path / "child"
        proc = _holder(other, "session", marker, "--heartbeat", "200ms", dsn=fresh_dsn)
        try:
            wait_for_file(marker)
            run_id = next(
                str(row["run_id"])
                for row in rows_of(fresh_dsn, other)
                if row["finished_at"] is None
            )
            announced = json.dumps({"host": "h", "pid": 1, "run_id": run_id, "since": "s"})
            with psycopg.connect(fresh_dsn, autocommit=True) as forger:
                forger.execute(
                    f"/* jobrun-holder {announced} */ SELECT pg_advisory_lock(%s)",
                    (lock_id_for(key),),
                )
                refused = jobrun_cli.run("stop", key, "--wait", "0s", dsn=fresh_dsn)
            assert refused.returncode == 3, refused.stderr
            assert "records as a run of another key" in refused.stderr
            with psycopg.connect(fresh_dsn) as conn:
                requests = conn.execute(
                    "SELECT count(*) FROM jobrun.stop_requests WHERE run_id = %s", (run_id,)
                ).fetchone()
            assert requests == (0,)
            stopped = jobrun_cli.run("stop", other, dsn=fresh_dsn)
            assert stopped.returncode == 0, stopped.stderr
        finally:
            if proc.poll() is None:
                proc.terminate()
            proc.communicate(timeout=60)
        assert proc.returncode == 77

    def test_stop_request_does_not_reach_the_next_run(self, dsn, key, tmp_path):
        """A request names one run: the run after the stopped one goes ahead."""
        marker = tmp_path / "child"
        proc = _holder(key, "session", marker, "--heartbeat", "200ms", dsn=dsn)
        wait_for_file(marker)
        assert jobrun_cli.run("stop", key, dsn=dsn).returncode == 0
        proc.communicate(timeout=60)
        assert jobrun_cli.run("--key", key, "--", "true", dsn=dsn).returncode == 0

    def test_stop_that_does_not_end_in_wait_exits_3_and_force_takes_the_lock(
        self, dsn, key, tmp_path
    ):
        """A run that cannot hear (SIGSTOPped jobrun): exit 3; --force terminates its session."""
        marker = tmp_path / "child"
        proc = _holder(key, "session", marker, dsn=dsn)
        wait_for_file(marker)
        proc.send_signal(jobrun_cli.signal.SIGSTOP)
        try:
            result = jobrun_cli.run("stop", key, "--wait", "1s", "--force", dsn=dsn)
            assert result.returncode == 3, result.stderr
            assert "took its lock away" in result.stderr
            again = jobrun_cli.run("--key", key, "--wait", "20s", "--", "true", dsn=dsn)
            assert again.returncode == 0, again.stderr
        finally:
            proc.send_signal(jobrun_cli.signal.SIGCONT)
            proc.communicate(timeout=60)


class TestPause:
    """jobrun pause KEY / resume KEY: runs skip with reason paused, never building streaks."""

    @pytest.mark.parametrize("mode", MODES)
    def test_paused_key_skips_with_reason_paused_and_no_streak(self, dsn, key, tmp_path, mode):
        """Three paused runs: 75 each, reason paused, streak 0, no alert; the child never ran."""
        paused = jobrun_cli.run("pause", "--new", key, "--reason", "migration", dsn=dsn)
        assert paused.returncode == 0, paused.stderr
        ran = tmp_path / "ran"
        results = [
            jobrun_cli.run(
                "--key",
                key,
                "--mode",
                mode,
                "--alert-after",
                "2",
                "--",
                "touch",
                str(ran),
                dsn=dsn,
            )
            for _ in range(3)
        ]
        assert [r.returncode for r in results] == [75, 75, 75]
        assert not ran.exists()
        skipped = event(results[-1].stderr, "skipped")
        assert skipped["reason"] == "paused"
        assert skipped["paused_reason"] == "migration"
        assert all(e["event"] != "skip_streak" for r in results for e in events(r.stderr))
        rows = rows_of(dsn, key)
        assert [(r["outcome"], r["reason"], r["streak"]) for r in rows] == [
            ("skipped", "paused", 0)
        ] * 3

    def test_resume_lets_the_next_run_go(self, dsn, key):
        """After resume, the run goes ahead."""
        assert jobrun_cli.run("pause", "--new", key, dsn=dsn).returncode == 0
        assert jobrun_cli.run("--key", key, "--", "true", dsn=dsn).returncode == 75
        resumed = jobrun_cli.run("resume", key, dsn=dsn)
        assert "resumed" in resumed.stdout
        assert jobrun_cli.run("--key", key, "--", "true", dsn=dsn).returncode == 0

    def test_pause_for_expires(self, dsn, key):
        """--for 1s: skips until the pause's end on the database's clock, then runs."""
        assert jobrun_cli.run("pause", "--new", key, "--for", "1s", dsn=dsn).returncode == 0
        first = jobrun_cli.run("--key", key, "--", "true", dsn=dsn)
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT extract(epoch FROM until - clock_timestamp()) FROM jobrun.pauses "
                "WHERE key = %s",
                (key,),
            ).fetchone()
        assert row is not None
        # Derived from --for: still in force after the first run, so in force when it
        # looked; over by now, it may have been over then or not (a loaded machine).
        assert first.returncode == 75 if row[0] > 0 else first.returncode in {0, 75}
        wait_until(
            lambda: jobrun_cli.run("--key", key, "--", "true", dsn=dsn).returncode == 0,
            timeout=1.0 + 30,
            what="the pause to expire",
        )

    def test_paused_key_skips_without_history(self, dsn, key):
        """--no-history still honours a pause (a statement of its own)."""
        assert jobrun_cli.run("pause", "--new", key, dsn=dsn).returncode == 0
        result = jobrun_cli.run("--key", key, "--no-history", "--", "true", dsn=dsn)
        assert result.returncode == 75, result.stderr
        assert event(result.stderr, "skipped")["reason"] == "paused"

    def test_running_run_is_not_affected(self, dsn, key, tmp_path):
        """A pause while a run goes on: the run ends as it would have."""
        marker = tmp_path / "child"
        proc = jobrun_cli.start(
            "--key", key, "--", "sh", "-c", f'echo go > "{marker}"; sleep 1', dsn=dsn
        )
        wait_for_file(marker)
        assert jobrun_cli.run("pause", "--new", key, dsn=dsn).returncode == 0
        proc.communicate(timeout=60)
        assert proc.returncode == 0

    def test_status_shows_the_pause(self, dsn, key):
        """status --json: paused by whom, since, until, why."""
        assert (
            jobrun_cli.run(
                "pause", "--new", key, "--for", "1h", "--reason", "why", dsn=dsn
            ).returncode
            == 0
        )
        result = jobrun_cli.run("status", key, "--json", dsn=dsn)
        (row,) = json.loads(result.stdout)
        assert row["paused"]["reason"] == "why"
        assert {"host", "user", "pid", "since", "until"} <= set(row["paused"])


class TestWithoutTheOperatorsTables:
    """A role granted only runs and leases (as before the operators' tables existed)."""

    # A database whose schema lacks the tables lacks their step too (no version row, or an
    # older one): the owner's upgrade makes them (tests/test_schema.py), so "granted only
    # runs and leases" is the case left.
    @pytest.mark.parametrize("tables", ["not granted"])
    @pytest.mark.parametrize("mode", MODES)
    def test_history_and_once_per_go_on_without_pauses(self, fresh_dsn, key, role, mode, tables):
        """One warning per run, no history_failed; --once-per still skips its second run.

        A pause the role cannot read is not seen: the run goes ahead (a pause is an
        operator's convenience, not a lock), and the warning says so.
        """
        for owner_mode in MODES:  # the owner's runs create every table
            made = jobrun_cli.run("--key", key, "--mode", owner_mode, "--", "true", dsn=fresh_dsn)
            assert made.returncode == 0, made.stderr
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM jobrun.runs")
            if tables == "dropped":
                conn.execute("DROP TABLE jobrun.pauses, jobrun.expectations")
        if tables == "not granted":
            paused = jobrun_cli.run("pause", "--new", key, dsn=fresh_dsn)
            assert paused.returncode == 0, paused.stderr
        dsn = role(
            "GRANT USAGE ON SCHEMA jobrun TO {role}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON jobrun.runs, jobrun.leases TO {role}",
            database_dsn=fresh_dsn,
        )
        args = ("--key", key, "--mode", mode, "--once-per", "1d", "--expect-every", "1d")
        first = jobrun_cli.run(*args, "--", "true", dsn=dsn)
        second = jobrun_cli.run(*args, "--", "true", dsn=dsn)
        assert (first.returncode, second.returncode) == (0, 75), first.stderr + second.stderr
        for result in (first, second):
            assert "history_failed" not in result.stderr, result.stderr
            warning = event(result.stderr, "control_tables_unavailable")
            assert "no pause" in warning["note"]
        assert event(second.stderr, "skipped")["reason"] == "already_ran"
        assert [row["outcome"] for row in rows_of(fresh_dsn, key)] == ["skipped", "succeeded"]


class TestARoleWithoutCreate:
    """Operators whose role was granted jobrun's tables but may not create anything."""

    @staticmethod
    def _granted_role(role, fresh_dsn: str, key: str) -> str:
        for owner_mode in MODES:  # the owner's runs create every table
            made = jobrun_cli.run("--key", key, "--mode", owner_mode, "--", "true", dsn=fresh_dsn)
            assert made.returncode == 0, made.stderr
        return role(
            "GRANT USAGE ON SCHEMA jobrun TO {role}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA jobrun TO {role}",
            database_dsn=fresh_dsn,
        )

    def test_stop_pause_and_resume_need_no_create(self, fresh_dsn, key, role, tmp_path):
        """The tables are there and granted: stop, pause and resume work (they once asked
        for CREATE on the database first, and exited 69)."""
        dsn = self._granted_role(role, fresh_dsn, key)
        marker = tmp_path / "child"
        proc = _holder(key, "session", marker, "--heartbeat", "200ms", dsn=dsn)
        try:
            wait_for_file(marker, proc=proc)
            stopped = jobrun_cli.run("stop", key, dsn=dsn)
            assert stopped.returncode == 0, stopped.stderr
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)
        assert proc.returncode == 77, stderr
        paused = jobrun_cli.run("pause", "--new", key, dsn=dsn)
        assert paused.returncode == 0, paused.stderr
        skipped = jobrun_cli.run("--key", key, "--", "true", dsn=dsn)
        assert skipped.returncode == 75, skipped.stderr
        assert event(skipped.stderr, "skipped")["reason"] == "paused"
        resumed = jobrun_cli.run("resume", key, dsn=dsn)
        assert resumed.returncode == 0, resumed.stderr

    def test_stop_says_why_it_cannot_name_another_roles_run(self, fresh_dsn, key, role, tmp_path):
        """A run of another role hides its statements (where a run names itself): stop
        says what to grant, exits 3, and the run goes on."""
        dsn = self._granted_role(role, fresh_dsn, key)
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT pg_has_role('pg_read_all_stats', 'MEMBER')").fetchone()
        if row and row[0]:
            pytest.skip("the test role can read every session (superuser server default?)")
        marker = tmp_path / "child"
        proc = _holder(key, "session", marker, dsn=fresh_dsn)
        try:
            wait_for_file(marker, proc=proc)
            result = jobrun_cli.run("stop", key, dsn=dsn)
            assert result.returncode == 3, result.stderr
            assert "a jobrun session of another role" in result.stderr
            assert "pg_read_all_stats" in result.stderr
            assert proc.poll() is None
        finally:
            jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)


class TestOverdue:
    """--expect-every and status --check."""

    def _backdate(self, dsn: str, key: str, seconds: float) -> None:
        with psycopg.connect(dsn) as conn:
            conn.execute(
                "UPDATE jobrun.runs SET started_at = started_at - make_interval(secs => %s), "
                "finished_at = finished_at - make_interval(secs => %s) WHERE key = %s",
                (seconds, seconds, key),
            )
            conn.execute(
                "UPDATE jobrun.expectations SET updated_at = updated_at "
                "- make_interval(secs => %s) WHERE key = %s",
                (seconds, key),
            )

    def test_recent_success_is_not_overdue(self, dsn, key):
        """A success within --expect-every: check exits 0."""
        run = jobrun_cli.run("--key", key, "--expect-every", "1h", "--", "true", dsn=dsn)
        assert run.returncode == 0, run.stderr
        result = jobrun_cli.run("status", key, "--check", dsn=dsn)
        assert result.returncode == 0, result.stdout + result.stderr

    def test_late_success_is_overdue(self, dsn, key):
        """The last success started more than every + grace ago: check exits 1, says overdue."""
        run = jobrun_cli.run("--key", key, "--expect-every", "1h", "--", "true", dsn=dsn)
        assert run.returncode == 0, run.stderr
        self._backdate(dsn, key, 3600 * 1.1 + 60)
        result = jobrun_cli.run("status", key, "--check", dsn=dsn)
        assert result.returncode == 1
        assert f"overdue: {key}" in result.stderr

    def test_within_grace_is_not_overdue(self, dsn, key):
        """Past every but within the grace (10% by default): not overdue."""
        run = jobrun_cli.run("--key", key, "--expect-every", "1h", "--", "true", dsn=dsn)
        assert run.returncode == 0, run.stderr
        self._backdate(dsn, key, 3600 + 60)
        assert jobrun_cli.run("status", key, "--check", dsn=dsn).returncode == 0

    def test_failing_key_fails_the_check(self, dsn, key):
        """A failure streak of --alert-after: check exits 1, says failing."""
        for _ in range(2):
            jobrun_cli.run("--key", key, "--", "false", dsn=dsn)
        result = jobrun_cli.run("status", key, "--check", "--alert-after", "2", dsn=dsn)
        assert result.returncode == 1
        assert f"failing: {key}" in result.stderr

    def test_stuck_run_fails_the_check(self, dsn, key, tmp_path):
        """Running far longer than its typical duration: check exits 1, says stuck."""
        assert jobrun_cli.run("--key", key, "--", "true", dsn=dsn).returncode == 0
        marker = tmp_path / "child"
        proc = _holder(key, "session", marker, dsn=dsn)
        try:
            wait_for_file(marker)
            wait_until(
                lambda: any(r["outcome"] == "running" for r in rows_of(dsn, key)),
                what="running row",
            )
            with psycopg.connect(dsn) as conn:
                conn.execute(
                    "UPDATE jobrun.runs SET started_at = started_at - interval '2 hours' "
                    "WHERE key = %s AND outcome = 'running'",
                    (key,),
                )
            result = jobrun_cli.run("status", key, "--check", dsn=dsn)
            assert result.returncode == 1
            assert f"stuck: {key}" in result.stderr
        finally:
            jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)

    def test_never_ran_since_expectation_is_overdue(self, dsn, key):
        """An expectation whose key never succeeded since every + grace: overdue."""
        jobrun_cli.run("--key", key, "--expect-every", "1h", "--", "false", dsn=dsn)
        self._backdate(dsn, key, 3600 * 1.1 + 60)
        result = jobrun_cli.run("status", key, "--check", dsn=dsn)
        assert result.returncode == 1
        assert f"overdue: {key}" in result.stderr

    def test_a_check_that_cannot_read_the_history_is_no_all_clear(self, dsn, role):
        """A role refused the jobrun schema: --check names what it could not read, exit 1;
        without --check the same notes, exit 0."""
        ensure_runs_table(dsn)
        refused = role()
        checked = jobrun_cli.run("status", "--check", dsn=refused)
        assert checked.returncode == 1, checked.stderr
        assert "jobrun: cannot check: run history not readable" in checked.stderr
        assert "nothing to show: run history" in checked.stdout
        plain = jobrun_cli.run("status", dsn=refused)
        assert plain.returncode == 0, plain.stderr
        assert "run history not readable" in plain.stderr


class TestSlots:
    """--slots N: at most N runs of the key at once, each in a slot of its own."""

    @pytest.mark.parametrize("mode", MODES)
    def test_burst_of_ten_never_exceeds_three_slots(self, dsn, key, tmp_path, mode):
        """10 starters with --slots 3: each slot held by one child at a time, at most 3 at once.

        Each child takes an exclusive flock on its slot's file (a second holder of a slot
        would fail it) and counts the children inside at once by marker files.
        """
        body = (
            "import fcntl, os, sys, time\n"
            f"d = {str(tmp_path)!r}\n"
            "slot = os.environ['JOBRUN_SLOT']\n"
            "f = open(os.path.join(d, 'slot' + slot), 'a')\n"
            "try:\n"
            "    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)\n"
            "except BlockingIOError:\n"
            "    open(os.path.join(d, 'violation'), 'a').write(slot + '\\n')\n"
            "    sys.exit(3)\n"
            "mine = os.path.join(d, 'in-%d' % os.getpid())\n"
            "open(mine, 'w').close()\n"
            "inside = len([n for n in os.listdir(d) if n.startswith('in-')])\n"
            "open(os.path.join(d, 'log'), 'a').write('%s %d\\n' % (slot, inside))\n"
            "time.sleep(0.5)\n"
            "os.remove(mine)\n"
        )
        procs = [
            jobrun_cli.start(
                "--key",
                key,
                "--mode",
                mode,
                "--slots",
                "3",
                "--wait",
                "60s",
                "--",
                *jobrun_cli.child_script(body),
                dsn=dsn,
            )
            for _ in range(10)
        ]
        outputs = [proc.communicate(timeout=120)[1] for proc in procs]
        assert [proc.returncode for proc in procs] == [0] * 10, outputs
        assert not (tmp_path / "violation").exists()
        lines = [line.split() for line in (tmp_path / "log").read_text().splitlines()]
        assert len(lines) == 10
        assert {slot for slot, _ in lines} <= {"0", "1", "2"}
        assert max(int(inside) for _, inside in lines) <= 3

    def test_all_slots_taken_skips(self, dsn, key, tmp_path):
        """With both of 2 slots held, a third run skips (75); status shows 2 slots in use."""
        markers = [tmp_path / "a", tmp_path / "b"]
        procs = [
            jobrun_cli.start(
                "--key", key, "--slots", "2", "--", *jobrun_cli.holder_marker(m), dsn=dsn
            )
            for m in markers
        ]
        try:
            for marker in markers:
                wait_for_file(marker)
            third = jobrun_cli.run("--key", key, "--slots", "2", "--", "true", dsn=dsn)
            assert third.returncode == 75, third.stderr
            (row,) = json.loads(jobrun_cli.run("status", key, "--json", dsn=dsn).stdout)
            assert row["slots_in_use"] == 2
            assert row["held"]
        finally:
            for proc in procs:
                jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)

    def test_slot_ids_are_pinned(self):
        """The slot lock id formula never changes silently."""
        assert slot_lock_id("nightly-export", 0) == lock_id_for("nightly-export\nslot 0")
        assert slot_lock_id("nightly-export", 2) != slot_lock_id("nightly-export", 0)
        assert slot_lock_id("nightly-export", 0) == SLOT_0_OF_NIGHTLY_EXPORT


class TestBadInput:
    """Bad input to the control commands: one line, exit 64, nothing changed."""

    @pytest.mark.parametrize(
        "args",
        [
            ("pause", "k", "--until", "yesterday"),
            ("pause", "k", "--until", "2001-01-01T00:00:00+00:00"),
            ("pause", "k", "--for", "1h", "--until", "2999-01-01T00:00:00"),
            ("pause", "k", "--for", "0s"),
            ("stop", "bad\nkey"),
            ("resume", ""),
            ("--key", "a", "--key", "b", "--slots", "2", "--", "true"),
            ("--lock-id", "5", "--slots", "2", "--", "true"),
            ("--key", "a", "--slots", "0", "--", "true"),
            ("--key", "a", "--expect-grace", "1m", "--", "true"),
            ("--key", "a", "--expect-every", "1h", "--no-history", "--", "true"),
        ],
    )
    def test_usage_error(self, dsn, args):
        """Exit 64 with one line on stderr, never a traceback."""
        result = jobrun_cli.run(*args, dsn=dsn)
        assert result.returncode == 64, result.stderr
        assert "Traceback" not in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr

    def test_until_in_the_future_is_shown(self, dsn, key):
        """--until TIME: the pause ends then (as the database stores it)."""
        result = jobrun_cli.run(
            "pause", "--new", key, "--until", "2999-01-01T00:00:00+00:00", dsn=dsn
        )
        assert result.returncode == 0, result.stderr
        assert "until 2999-01-01T00:00:00+00:00" in result.stdout
        assert jobrun_cli.run("--key", key, "--", "true", dsn=dsn).returncode == 75
