"""--warn-after, --tz and --requires through the real CLI, in session and lease mode."""

from __future__ import annotations

import datetime as dt
import json
import shlex
import sys
import uuid
import zoneinfo
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from harness import jobrun_cli
from harness.jobrun_cli import event, events, wait_for_file
from jobrun import keys, sql
from jobrun.run import slow
from support.history import ensure_runs_table, hook, hook_calls, rows_of
from support.monitor import Monitor

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

    from support.tenants import Teams

MODES = ("session", "lease")
UTC = dt.timezone.utc
BERLIN = "Europe/Berlin"
#: How long a child waits for what the test awaits before it gives up (and fails the test).
PATIENCE = 30


def waits_for(path: Path) -> list[str]:
    """A child that exits 0 once ``path`` exists (1 if it never does within PATIENCE)."""
    body = (
        "import os, sys, time\n"
        f"deadline = time.monotonic() + {PATIENCE}\n"
        "while not os.path.exists(sys.argv[1]):\n"
        "    if time.monotonic() > deadline:\n"
        "        sys.exit(1)\n"
        "    time.sleep(0.02)\n"
    )
    return [sys.executable, "-c", body, str(path)]


def hook_writes(path: Path) -> str:
    """--on-alert: the test's hook (appends each event to ``path``) as one command line."""
    return shlex.join(hook(path))


def insert_run(
    dsn: str,
    key: str,
    *,
    outcome: str = "succeeded",
    started_at: dt.datetime | None = None,
    duration: float = 1.0,
    mode: str = "session",
) -> None:
    """A finished run of ``key`` written straight into the history, at a chosen time."""
    ensure_runs_table(dsn)
    start = started_at or dt.datetime.now(UTC) - dt.timedelta(minutes=5)
    finish = None if outcome == "running" else start + dt.timedelta(seconds=duration)
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            "INSERT INTO jobrun.runs (run_id, key, lock_ids, mode, host, pid, started_at,"
            " finished_at, outcome, exit_code, duration)"
            " VALUES (%s, %s, %s, %s, 'elsewhere', 1, %s, %s, %s, %s, %s)",
            (
                uuid.uuid4(),
                key,
                [keys.lock_id_for(key)],
                mode,
                start,
                finish,
                outcome,
                None if outcome == "running" else (0 if outcome == "succeeded" else 1),
                None if outcome == "running" else duration,
            ),
        )


def round_trips(stderr: str) -> int:
    """The history's round trips of a run (its debug line)."""
    return int(event(stderr, "history_calls")["round_trips"])


@pytest.fixture
def monitor() -> Iterator[Monitor]:
    made = Monitor("check")
    yield made
    made.close()


@pytest.mark.parametrize("mode", MODES)
class TestWarnAfter:
    """One slow_run warning past the bound: log, hook, ping; the child goes on."""

    def test_past_the_bound_one_warning_to_log_hook_and_ping(
        self, dsn, key, tmp_path, monitor, mode
    ):
        """The child waits for the hook's call: it only ends because the warning came."""
        calls = tmp_path / "calls"
        result = jobrun_cli.run(
            "--key", key, "--mode", mode, "--warn-after", "1s",
            "--on-alert", hook_writes(calls), "--ping", monitor.url,
            "--", *waits_for(calls), dsn=dsn, timeout=PATIENCE + 30,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        warned = event(result.stderr, "slow_run")
        assert warned["level"] == "warning"
        assert warned["bound"] == 1.0
        assert warned["elapsed"] >= 1.0
        assert warned["derived"] == "given"
        assert event(result.stderr, "finished")["outcome"] == "succeeded"
        (call,) = hook_calls(calls)
        sent = json.loads(call["stdin"])
        assert (sent["event"], sent["bound"], sent["key"]) == ("slow_run", 1.0, key)
        assert call["env"]["JOBRUN_ALERT_EVENT"] == "slow_run"
        paths = [path.removeprefix("/ping/check") for path, _ in monitor.requests]
        assert paths == ["/start", "/log", "/0"]
        assert monitor.requests[1][1].startswith(b"slow_run bound=1.0 elapsed=")
        (row,) = rows_of(dsn, key)
        assert row["slow_after"] == 1.0

    def test_a_role_that_cannot_add_the_column_keeps_its_end_row(self, teams, tmp_path, mode):
        """A history made before slow_after, a tenant role: the run is recorded without it."""
        with psycopg.connect(teams.owner, autocommit=True) as conn:
            conn.execute("ALTER TABLE jobrun.runs DROP COLUMN slow_after")
        calls = tmp_path / "calls"
        result = jobrun_cli.run(
            "--key", "a-slow", "--mode", mode, "--warn-after", "1s",
            "--on-alert", hook_writes(calls), "--", *waits_for(calls),
            dsn=teams.a, timeout=PATIENCE + 30,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert event(result.stderr, "slow_run")["bound"] == 1.0
        (row,) = rows_of(teams.owner, "a-slow")
        assert row["outcome"] == "succeeded"
        assert "slow_after" not in row

    def test_a_failing_hook_is_reported_as_failing(self, dsn, key, tmp_path, mode):
        """The hook runs while the supervisor reaps orphans: its exit status is still its own."""
        calls = tmp_path / "calls"
        failing = shlex.join(
            ["sh", "-c", f'cat > /dev/null; echo x > "{calls}"; echo nope >&2; exit 3']
        )
        result = jobrun_cli.run(
            "--key", key, "--mode", mode, "--warn-after", "1s", "--on-alert", failing,
            "--", *waits_for(calls), dsn=dsn, timeout=PATIENCE + 30,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        failed = event(result.stderr, "alert_failed")
        assert (failed["alert"], failed["exit_code"], failed["stderr"]) == ("slow_run", 3, "nope")

    def test_a_quick_run_says_nothing_and_records_no_bound(self, dsn, key, mode):
        """Under the bound: no warning, no slow_after, and the same round trips as without."""
        plain = jobrun_cli.run(
            "--key", key, "--mode", mode, "--log-level", "debug", "--", "true", dsn=dsn
        )
        warned = jobrun_cli.run(
            "--key", key, "--mode", mode, "--log-level", "debug", "--warn-after", "1h",
            "--", "true", dsn=dsn,
        )  # fmt: skip
        assert warned.returncode == 0, warned.stderr
        assert [e for e in events(warned.stderr) if e["event"] == "slow_run"] == []
        assert round_trips(warned.stderr) == round_trips(plain.stderr)
        assert [row["slow_after"] for row in rows_of(dsn, key)] == [None, None]

    def test_auto_needs_five_successes_and_says_so(self, dsn, key, mode):
        """Four recorded successes: one info line, no bound, no warning; no extra round trip."""
        for _ in range(3):
            insert_run(dsn, key, duration=0.1)
        plain = jobrun_cli.run(
            "--key", key, "--mode", mode, "--log-level", "debug", "--", "true", dsn=dsn
        )
        result = jobrun_cli.run(
            "--key", key, "--mode", mode, "--log-level", "debug", "--warn-after", "auto",
            "--", "true", dsn=dsn,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        said = event(result.stderr, "warn_after_auto")
        assert said["level"] == "info"
        assert (said["runs"], said["needed"]) == (4, slow.MINIMUM_RUNS)  # 3 + the plain run
        assert "bound" not in said
        assert round_trips(result.stderr) == round_trips(plain.stderr)

    def test_auto_bound_is_p95_times_1_5_of_the_last_30_successes(self, dsn, key, tmp_path, mode):
        """Old and failed runs do not count; the event says the bound and its derivation."""
        now = dt.datetime.now(UTC)
        for age in range(40):  # the 30 newest: 0.8 s each; ten older ones of 100 s
            start = now - dt.timedelta(hours=age + 1)
            insert_run(dsn, key, started_at=start, duration=0.8 if age < 30 else 100.0)
        insert_run(dsn, key, outcome="failed", duration=500.0)
        calls = tmp_path / "calls"
        result = jobrun_cli.run(
            "--key", key, "--mode", mode, "--warn-after", "auto",
            "--on-alert", hook_writes(calls), "--", *waits_for(calls),
            dsn=dsn, timeout=PATIENCE + 30,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert event(result.stderr, "warn_after_auto")["bound"] == pytest.approx(1.2)
        warned = event(result.stderr, "slow_run")
        assert warned["bound"] == pytest.approx(1.2)
        assert (warned["derived"], warned["runs"], warned["p95"]) == ("auto", 30, 0.8)
        assert "1.5 x p95" in warned["derivation"]
        assert json.loads(hook_calls(calls)[0]["stdin"])["derived"] == "auto"


class TestWarnAfterUsage:
    def test_auto_without_history_is_a_usage_error(self, jobrun_here, key):
        result = jobrun_here.run(
            "--key", key, "--warn-after", "auto", "--no-history", "--", "true", dsn=None
        )
        assert result.returncode == 64
        assert result.stderr.count("\n") == 1
        assert "--warn-after auto" in result.stderr

    def test_a_bad_duration_is_a_usage_error(self, jobrun_here, key):
        result = jobrun_here.run("--key", key, "--warn-after", "soon", "--", "true", dsn=None)
        assert result.returncode == 64
        assert "auto" in result.stderr


def window_start(dsn: str, at: dt.datetime, window: float, tz: str | None) -> dt.datetime:
    """The --once-per window ``at`` falls in, as the database works it out."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            psycopg.sql.SQL(sql.WINDOW_START_AT),  # type: ignore[arg-type]
            {"at": at, "window": window, "tz": tz},
        ).fetchone()
    assert row is not None
    return row[0].astimezone(UTC)


def utc(text: str) -> dt.datetime:
    return dt.datetime.fromisoformat(text).replace(tzinfo=UTC)


DAY = 86400.0


class TestTzWindows:
    """--tz: a day window is a local day, 23 or 25 hours long across a DST change."""

    @pytest.mark.parametrize(
        ("at", "start", "next_start", "hours"),
        [
            # Berlin springs forward on 2026-03-29 (02:00 CET -> 03:00 CEST): a 23-hour day.
            ("2026-03-29 12:00", "2026-03-28 23:00", "2026-03-29 22:00", 23),
            # ...and falls back on 2026-10-25 (03:00 CEST -> 02:00 CET): a 25-hour day.
            ("2026-10-25 12:00", "2026-10-24 22:00", "2026-10-25 23:00", 25),
            # An ordinary winter day.
            ("2026-12-04 20:00", "2026-12-03 23:00", "2026-12-04 23:00", 24),
        ],
    )
    def test_a_day_runs_from_local_midnight_to_local_midnight(
        self, dsn, at, start, next_start, hours
    ):
        first = window_start(dsn, utc(at), DAY, BERLIN)
        assert first == utc(start)
        # The last instant of the day is still in it; the next local midnight starts anew.
        end = utc(next_start)
        assert window_start(dsn, end - dt.timedelta(microseconds=1), DAY, BERLIN) == first
        assert window_start(dsn, end, DAY, BERLIN) == end
        assert (end - first) == dt.timedelta(hours=hours)

    def test_without_tz_days_stay_utc_days(self, dsn):
        assert window_start(dsn, utc("2026-03-29 12:00"), DAY, None) == utc("2026-03-29 00:00")

    def test_multi_day_windows_count_local_days_from_1970(self, dsn):
        """7d: local weeks from Thursday 1970-01-01; 2d: pairs of local days."""
        week = window_start(dsn, utc("2026-10-27 12:00"), 7 * DAY, BERLIN)
        local = week.astimezone(zoneinfo.ZoneInfo(BERLIN))
        assert (local.hour, local.minute, local.weekday()) == (0, 0, 3)  # Thursday 00:00
        assert local.date() == dt.date(2026, 10, 22)  # the week across the DST change
        two = window_start(dsn, utc("2026-10-25 12:00"), 2 * DAY, BERLIN)
        days = (two.astimezone(zoneinfo.ZoneInfo(BERLIN)).date() - dt.date(1970, 1, 1)).days
        assert days % 2 == 0

    @pytest.mark.parametrize("window", [3600.0, 1800.0, 1.5 * DAY])
    def test_windows_not_of_whole_days_are_unchanged(self, dsn, window):
        """1h, 30m, 36h: fixed length, aligned to the Unix epoch, with or without --tz."""
        at = utc("2026-03-29 01:40")
        assert window_start(dsn, at, window, BERLIN) == window_start(dsn, at, window, None)

    @pytest.mark.parametrize("mode", MODES)
    def test_a_run_in_the_local_day_but_not_the_utc_day_decides(self, dsn, key, mode):
        """A success placed between the two midnights: one zone skips, the other runs."""
        now = dt.datetime.now(UTC)
        local_midnight = (
            now.astimezone(zoneinfo.ZoneInfo(BERLIN))
            .replace(hour=0, minute=0, second=0, microsecond=0)
            .astimezone(UTC)
        )
        utc_midnight = now.replace(hour=0, minute=0, second=0, microsecond=0)
        earlier = min(local_midnight, utc_midnight)
        in_berlin_only = local_midnight < utc_midnight
        insert_run(dsn, key, started_at=earlier + dt.timedelta(seconds=1), duration=0.5)
        args = ("--key", key, "--mode", mode, "--once-per", "1d")
        berlin = jobrun_cli.run(*args, "--tz", BERLIN, "--", "true", dsn=dsn)
        assert berlin.returncode == (75 if in_berlin_only else 0), berlin.stderr
        if in_berlin_only:
            skipped = event(berlin.stderr, "skipped")
            assert skipped["previous_window_start"] == local_midnight.isoformat()

    def test_a_bad_zone_is_one_line_exit_64(self, jobrun_here, key):
        result = jobrun_here.run(
            "--key", key, "--once-per", "1d", "--tz", "Mars/Olympus", "--", "true", dsn=None
        )
        assert result.returncode == 64
        assert result.stderr.count("\n") == 1
        assert "Mars/Olympus" in result.stderr


@pytest.mark.parametrize("mode", MODES)
class TestRequires:
    """--requires: only after each required key's recent success, none of it running."""

    def _run(self, dsn: str, key: str, mode: str, *args: str) -> Any:
        return jobrun_cli.run(
            "--key", key, "--mode", mode, "--log-level", "debug", *args, "--", "true", dsn=dsn
        )

    def test_met_runs_with_no_extra_round_trip(self, dsn, key, mode):
        insert_run(dsn, f"{key}-up")
        plain = self._run(dsn, key, mode)
        result = self._run(dsn, key, mode, "--requires", f"{key}-up")
        assert result.returncode == 0, result.stderr
        assert round_trips(result.stderr) == round_trips(plain.stderr)

    def test_never_ran(self, dsn, key, mode):
        insert_run(dsn, f"{key}-up")
        result = self._run(dsn, key, mode, "--requires", f"{key}-up", "--requires", f"{key}-no")
        assert result.returncode == 75, result.stderr
        skipped = event(result.stderr, "skipped")
        assert (skipped["reason"], skipped["required_key"]) == ("requirement", f"{key}-no")
        assert skipped["requirement"] == "never_ran"
        (row,) = [r for r in rows_of(dsn, key) if r["outcome"] == "skipped"]
        assert row["reason"] == "requirement"

    def test_last_run_failed(self, dsn, key, mode):
        insert_run(dsn, f"{key}-up", started_at=dt.datetime.now(UTC) - dt.timedelta(hours=2))
        insert_run(dsn, f"{key}-up", outcome="failed")
        result = self._run(dsn, key, mode, "--requires", f"{key}-up")
        assert result.returncode == 75, result.stderr
        skipped = event(result.stderr, "skipped")
        assert (skipped["requirement"], skipped["required_outcome"]) == ("failed", "failed")
        assert "failed at" in skipped["note"]

    def test_last_success_too_old(self, dsn, key, mode):
        insert_run(dsn, f"{key}-up", started_at=dt.datetime.now(UTC) - dt.timedelta(hours=3))
        result = self._run(dsn, key, mode, "--requires", f"{key}-up", "--requires-within", "2h")
        assert result.returncode == 75, result.stderr
        assert event(result.stderr, "skipped")["requirement"] == "too_old"
        again = self._run(dsn, key, mode, "--requires", f"{key}-up", "--requires-within", "4h")
        assert again.returncode == 0, again.stderr

    @pytest.mark.parametrize("holder_mode", MODES)
    def test_running_now(self, dsn, key, tmp_path, mode, holder_mode):
        """A run of the required key in progress (either mode): skip, naming it."""
        insert_run(dsn, f"{key}-up")
        marker = tmp_path / "up"
        holder = jobrun_cli.start(
            "--key", f"{key}-up", "--mode", holder_mode, "--",
            *jobrun_cli.holder_marker(marker), dsn=dsn,
        )  # fmt: skip
        try:
            wait_for_file(marker, proc=holder)
            result = self._run(dsn, key, mode, "--requires", f"{key}-up")
        finally:
            jobrun_cli.signal_and_wait(holder, jobrun_cli.SIGTERM)
        assert result.returncode == 75, result.stderr
        skipped = event(result.stderr, "skipped")
        assert skipped["requirement"] == "running"
        assert skipped["required_pid"] == holder.pid

    def test_a_dead_session_run_is_not_running(self, dsn, key, mode):
        """A session-mode row still marked running whose lock nobody holds: not in progress."""
        insert_run(dsn, f"{key}-up", started_at=dt.datetime.now(UTC) - dt.timedelta(hours=1))
        insert_run(dsn, f"{key}-up", outcome="running")
        result = self._run(dsn, key, mode, "--requires", f"{key}-up")
        assert result.returncode == 0, result.stderr

    def test_a_key_the_role_may_not_read_is_refused(self, teams: Teams, mode):
        """Under jobrun init: b-* is team_b's; team_a requiring it is refused, not 'never ran'."""
        insert_run(teams.owner, "b-export")
        result = jobrun_cli.run(
            "--key", "a-report", "--mode", mode, "--requires", "b-export", "--", "true",
            dsn=teams.a,
        )  # fmt: skip
        assert result.returncode == 69, result.stderr
        refused = [e for e in events(result.stderr) if e.get("reason") == "not_granted"]
        assert len(refused) == 1
        assert "may not read the history of b-export" in refused[0]["error"]
        # A key of its own that never ran is just that.
        mine = jobrun_cli.run(
            "--key", "a-report", "--mode", mode, "--requires", "a-extract", "--", "true",
            dsn=teams.a,
        )  # fmt: skip
        assert mine.returncode == 75, mine.stderr
        assert event(mine.stderr, "skipped")["requirement"] == "never_ran"

    def test_without_history_is_a_usage_error(self, jobrun_here, key, mode):
        result = jobrun_here.run(
            "--key", key, "--mode", mode, "--requires", "x", "--no-history", "--", "true",
            dsn=None,
        )  # fmt: skip
        assert result.returncode == 64
        assert result.stderr.count("\n") == 1


class TestTablesInAZone:
    """status --tz and history --tz: the tables' times in the zone; --json stays UTC."""

    def test_status_and_history_show_local_times(self, dsn, key):
        start = utc("2026-07-01 10:00")  # CEST: 12:00 in Berlin
        insert_run(dsn, key, started_at=start, duration=60.0)
        status = jobrun_cli.run("status", key, "--wide", "--tz", BERLIN, dsn=dsn)
        assert status.returncode == 0, status.stderr
        assert "2026-07-01 12:01:00 CEST" in status.stdout
        history = jobrun_cli.run("history", key, "--tz", BERLIN, dsn=dsn)
        assert "2026-07-01 12:00:00 CEST" in history.stdout
        plain = jobrun_cli.run("history", key, dsn=dsn)
        assert "2026-07-01 10:00:00Z" in plain.stdout
        as_json = jobrun_cli.run("history", key, "--json", "--tz", BERLIN, dsn=dsn)
        assert json.loads(as_json.stdout)[0]["started_at"] == "2026-07-01T10:00:00+00:00"

    def test_a_bad_zone_is_one_line_exit_64(self, dsn):
        result = jobrun_cli.run("status", "--tz", "Nowhere/Town", dsn=dsn)
        assert result.returncode == 64
        assert result.stderr.count("\n") == 1

    def test_show_gives_the_start_in_the_zone(self, dsn, key):
        result = jobrun_cli.run("--key", key, "--keep-output", "1KiB", "--", "false", dsn=dsn)
        assert result.returncode == 1, result.stderr
        shown = jobrun_cli.run("show", key, "--tz", "Asia/Tokyo", dsn=dsn)
        assert "+09:00  outcome failed" in shown.stdout.splitlines()[0]
