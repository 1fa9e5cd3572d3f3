"""Run history against a real PostgreSQL: rows, abandoned runs, --once-per, streaks, pruning."""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from jobrun import alerts, db, history, keys, log
from jobrun.exitcodes import LockStoreUnavailable, UsageError
from jobrun.history import HistoryConfig, Recorder
from jobrun.locks import Identity
from support import jobrun_cli
from support.jobrun_cli import event, events, wait_for_file, wait_until
from support.pgserver import create_database, drop_database

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from pathlib import Path


# --- helpers ---------------------------------------------------------------------------------


class Captured:
    """A real jobrun logger writing JSON lines to a file, and the events written so far."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.log = log.configure(fmt="json", level="info", fd=self._fd)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        lines = self.path.read_text().splitlines()
        found = [json.loads(line) for line in lines if line.strip()]
        return [e for e in found if name is None or e["event"] == name]

    def close(self) -> None:
        os.close(self._fd)


@pytest.fixture
def captured(tmp_path) -> Iterator[Captured]:
    """Events logged by the recorders of a test."""
    capture = Captured(tmp_path / "events.jsonl")
    yield capture
    capture.close()


@pytest.fixture
def fresh_dsn(pg_admin_dsn) -> Iterator[str]:
    """A database of this test's own, without the jobrun schema."""
    name = f"jobrun_fresh_{uuid.uuid4().hex[:12]}"
    create_database(pg_admin_dsn, name)
    try:
        yield make_conninfo(pg_admin_dsn, dbname=name)
    finally:
        drop_database(pg_admin_dsn, name)


@dataclass
class Run:
    """A Recorder with the run id and key label it records under."""

    recorder: Recorder
    run_id: str
    label: str
    dsn: str

    def __getattr__(self, name: str) -> Any:
        return getattr(self.recorder, name)

    def started_and_recorded(self, child_pid: int) -> None:
        """started() returns at once and writes in the background: wait for the row."""
        self.recorder.started(child_pid)
        wait_until(
            lambda: self.run_id in {str(row["run_id"]) for row in rows_of(self.dsn, self.label)},
            what="the running row",
        )


@pytest.fixture
def make_recorder(dsn, key, captured) -> Callable[..., Run]:
    """``make(host=..., config=..., ...) -> Run`` for this test's key, a new run id each."""

    def make(
        *,
        host: str = "host-a",
        pid: int = 4242,
        config: HistoryConfig | None = None,
        names: tuple[str, ...] = (key,),
        target_dsn: str | None = None,
        mode: str = "session",
        program: str = "backup.sh",
        environ: Mapping[str, str] | None = None,
    ) -> Run:
        identity = Identity(run_id=str(uuid.uuid4()), host=host, pid=pid)
        run_keys = keys.resolve(names, ())
        recorder = Recorder(
            db.Target(dsn=target_dsn if target_dsn is not None else dsn),
            identity,
            run_keys,
            mode=mode,
            program=program,
            config=config or HistoryConfig(),
            # As the CLI does: every line names the run.
            log=captured.log.bind(run_id=identity.run_id, host=host, pid=pid),
            environ=environ,
        )
        return Run(
            recorder,
            identity.run_id,
            keys.describe(run_keys),
            target_dsn if target_dsn is not None else dsn,
        )

    return make


def rows_of(dsn: str, label: str) -> list[dict[str, Any]]:
    """Every history row of ``label``, newest first (none while there is no table)."""
    with psycopg.connect(dsn) as conn:
        try:
            cur = conn.execute(
                "SELECT * FROM jobrun.runs WHERE key = %s ORDER BY started_at DESC", (label,)
            )
        except psycopg.errors.UndefinedTable:
            return []
        names = [column.name for column in cur.description or []]
        return [dict(zip(names, row, strict=True)) for row in cur.fetchall()]


def table_exists(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT to_regclass('jobrun.runs') IS NOT NULL").fetchone()
    return bool(row and row[0])


def holder(run_id: str, host: str = "holder-host") -> dict[str, object]:
    """Skip fields as the runner passes them for a jobrun holder."""
    return {"holder_run_id": run_id, "holder_host": host, "holder_pid": 99}


def hook(path: Path) -> tuple[str, ...]:
    """An --on-alert hook that appends its stdin and JOBRUN_ALERT_* variables to ``path``."""
    body = (
        "import json, os, sys\n"
        "data = sys.stdin.read()\n"
        "env = {k: v for k, v in os.environ.items() if k.startswith('JOBRUN_ALERT_')}\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    f.write(json.dumps({'stdin': data, 'env': env}) + '\\n')\n"
    )
    return (sys.executable, "-c", body, str(path))


def hook_calls(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.fixture
def role(dsn, pg_admin_dsn) -> Iterator[Callable[..., str]]:
    """``make(*grants) -> dsn``: a login role of this test's own with only the given grants."""
    made: list[tuple[str, str]] = []

    def make(*grants: str, database_dsn: str | None = None) -> str:
        name = f"jobrun_role_{uuid.uuid4().hex[:10]}"
        target = database_dsn or dsn
        made.append((name, target))
        with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("CREATE ROLE {} LOGIN").format(pgsql.Identifier(name)))
        with psycopg.connect(target, autocommit=True) as conn:
            for grant in grants:
                conn.execute(pgsql.SQL(grant).format(role=pgsql.Identifier(name)))
        return make_conninfo(target, user=name)

    yield make
    for name, target in made:
        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP OWNED BY {}").format(pgsql.Identifier(name)))
        with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
            conn.execute(pgsql.SQL("DROP ROLE IF EXISTS {}").format(pgsql.Identifier(name)))


def ensure_runs_table(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        history.ensure_schema(conn)


# --- the table -------------------------------------------------------------------------------


class TestSchema:
    """jobrun.runs appears on first use, once, however many first runs race."""

    def test_first_write_creates_the_table(self, fresh_dsn, make_recorder, captured):
        """The first started() on a database without the schema creates it and writes."""
        recorder = make_recorder(target_dsn=fresh_dsn)
        recorder.started_and_recorded(123)
        assert [row["outcome"] for row in rows_of(fresh_dsn, recorder.label)] == ["running"]
        assert captured.events("history_failed") == []

    def test_concurrent_first_writes_create_it_once(self, fresh_dsn, make_recorder, captured):
        """Twelve runs writing their first row at the same moment all succeed."""
        recorders = [make_recorder(target_dsn=fresh_dsn) for _ in range(12)]
        barrier = threading.Barrier(len(recorders))

        def start(recorder: Run) -> None:
            barrier.wait()
            recorder.started(1)
            recorder.finished("succeeded", 0, None, 0.1)

        threads = [threading.Thread(target=start, args=(r,)) for r in recorders]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert captured.events("history_failed") == []
        assert len(rows_of(fresh_dsn, recorders[0].label)) == 12

    def test_a_read_never_creates_the_table(self, fresh_dsn, make_recorder, captured):
        """acquired() on a fresh database finds nothing, creates nothing, warns nothing."""
        assert make_recorder(target_dsn=fresh_dsn).acquired(3600) is None
        assert not table_exists(fresh_dsn)
        assert captured.events() == []


class TestRunRows:
    """A run's row says what happened, and only what is safe to say."""

    def test_started_writes_a_running_row_with_the_program_name_only(self, dsn, make_recorder):
        """Outcome running, child pid, host, pid, mode, lock ids and argv[0] are recorded."""
        recorder = make_recorder(program="/opt/jobs/export.sh")
        recorder.acquired(None)
        recorder.started_and_recorded(5151)
        (row,) = rows_of(dsn, recorder.label)
        assert row["outcome"] == "running"
        assert row["child_pid"] == 5151
        assert (row["host"], row["pid"], row["mode"]) == ("host-a", 4242, "session")
        assert row["program"] == "/opt/jobs/export.sh"
        assert row["lock_ids"] == [keys.lock_id_for(recorder.label)]
        assert row["finished_at"] is None

    def test_finished_records_outcome_exit_code_signal_and_duration(self, dsn, make_recorder):
        """The row is updated in place with how the run ended."""
        recorder = make_recorder()
        recorder.started(1)
        recorder.finished("failed", 143, "SIGTERM", 2.5)
        (row,) = rows_of(dsn, recorder.label)
        assert (row["outcome"], row["exit_code"], row["signal"]) == ("failed", 143, "SIGTERM")
        assert row["duration"] == 2.5
        assert row["finished_at"] >= row["started_at"]

    def test_finished_without_a_recorded_start_still_records_the_run(self, dsn, make_recorder):
        """A start that was never written (a failed write) does not lose the end."""
        recorder = make_recorder()
        recorder.finished("succeeded", 0, None, 3.0)
        (row,) = rows_of(dsn, recorder.label)
        assert row["outcome"] == "succeeded"
        assert 2.5 < (row["finished_at"] - row["started_at"]).total_seconds() < 10

    def test_exec_failed_is_a_finished_run(self, dsn, make_recorder):
        """A command that could not start leaves an exec_failed row with its exit code."""
        recorder = make_recorder()
        recorder.exec_failed(127)
        (row,) = rows_of(dsn, recorder.label)
        assert (row["outcome"], row["exit_code"]) == ("exec_failed", 127)

    def test_multi_key_run_is_one_row_under_the_comma_joined_label(self, dsn, key, make_recorder):
        """Two keys: one row, key = labels in locking order, every lock id."""
        recorder = make_recorder(names=(f"{key}-a", f"{key}-b"))
        recorder.started_and_recorded(1)
        run_keys = keys.resolve((f"{key}-a", f"{key}-b"), ())
        (row,) = rows_of(dsn, keys.describe(run_keys))
        assert row["lock_ids"] == [k.lock_id for k in run_keys]


class TestAbandoned:
    """A row still marked running when we hold its lock belongs to a dead run."""

    def test_dead_runs_row_is_marked_abandoned_and_logged(self, dsn, make_recorder, captured):
        """acquired() marks it abandoned and logs abandoned_run naming host, pid, run id."""
        dead = make_recorder(host="crashed-host", pid=777)
        dead.started_and_recorded(1)
        make_recorder().acquired(None)
        (row,) = rows_of(dsn, dead.label)
        assert row["outcome"] == "abandoned"
        (line,) = captured.events("abandoned_run")
        assert line["level"] == "warning"
        assert line["abandoned_run_id"] == dead.run_id
        assert (line["abandoned_host"], line["abandoned_pid"]) == ("crashed-host", 777)
        assert line["abandoned_started_at"]

    def test_a_run_sharing_one_lock_id_counts_too(self, dsn, key, make_recorder):
        """A dead multi-key run that held one of our keys is abandoned as well."""
        dead = make_recorder(names=(key, f"{key}-other"))
        dead.started_and_recorded(1)
        make_recorder(names=(key,)).acquired(None)
        assert rows_of(dsn, dead.label)[0]["outcome"] == "abandoned"

    def test_own_row_and_other_keys_are_left_alone(self, dsn, key, make_recorder, captured):
        """Our own running row and rows of unrelated keys keep their outcome."""
        other = make_recorder(names=(f"{key}-unrelated",))
        other.started_and_recorded(1)
        me = make_recorder()
        me.started_and_recorded(1)
        me.acquired(None)
        assert rows_of(dsn, other.label)[0]["outcome"] == "running"
        assert rows_of(dsn, me.label)[0]["outcome"] == "running"
        assert captured.events("abandoned_run") == []

    def test_a_late_finish_overwrites_abandoned(self, dsn, make_recorder):
        """A run taken for dead that does finish (a frozen lease holder) records the truth."""
        slow = make_recorder()
        slow.started_and_recorded(1)
        make_recorder().acquired(None)
        slow.finished("lock_lost", 76, None, 40.0)
        assert rows_of(dsn, slow.label)[0]["outcome"] == "lock_lost"


class TestOncePer:
    """--once-per: a running or successful run in the current epoch-aligned window wins."""

    def test_a_success_in_this_window_makes_the_run_redundant(self, make_recorder):
        """The earlier run comes back with its run id, host, start and window start."""
        earlier = make_recorder(host="host-1")
        earlier.acquired(3600)
        earlier.started(1)
        earlier.finished("succeeded", 0, None, 1.0)
        found = make_recorder(host="host-2").acquired(3600)
        assert found is not None
        assert found["run_id"] == earlier.run_id
        assert (found["host"], found["outcome"]) == ("host-1", "succeeded")
        assert str(found["window_start"]) <= str(found["started_at"])

    @pytest.mark.parametrize("outcome", ["failed", "timed_out", "lock_lost", "exec_failed"])
    def test_a_failed_run_does_not_count(self, make_recorder, outcome):
        """A run that did not succeed leaves the window open for a retry."""
        earlier = make_recorder()
        earlier.started(1)
        earlier.finished(outcome, 1, None, 1.0)
        assert make_recorder().acquired(3600) is None

    def test_skips_and_abandoned_runs_do_not_count(self, make_recorder):
        """Neither a skip nor a run that died makes the window done."""
        make_recorder().skipped("locked", holder(str(uuid.uuid4())), 75)
        make_recorder().started_and_recorded(1)  # dies: abandoned by the next acquired()
        assert make_recorder().acquired(3600) is None

    def test_window_is_aligned_to_the_epoch_on_the_database_clock(self, dsn, make_recorder):
        """A start one second before the window start does not count; one at it does."""
        earlier = make_recorder()
        earlier.started(1)
        earlier.finished("succeeded", 0, None, 1.0)
        with psycopg.connect(dsn) as conn:
            start = conn.execute(
                "SELECT to_timestamp(floor(extract(epoch FROM clock_timestamp()) / 3600) * 3600)"
            ).fetchone()
            assert start is not None
            conn.execute(
                "UPDATE jobrun.runs SET started_at = %s - interval '1 second' WHERE run_id = %s",
                (start[0], earlier.run_id),
            )
        assert make_recorder().acquired(3600) is None
        with psycopg.connect(dsn) as conn:
            conn.execute(
                "UPDATE jobrun.runs SET started_at = %s WHERE run_id = %s",
                (start[0], earlier.run_id),
            )
        assert make_recorder().acquired(3600) is not None

    def test_without_once_per_nothing_is_returned(self, make_recorder):
        """acquired(None) never makes a run redundant."""
        earlier = make_recorder()
        earlier.started(1)
        earlier.finished("succeeded", 0, None, 1.0)
        assert make_recorder().acquired(None) is None

    def test_concurrent_hosts_run_once(self, dsn, key, tmp_path):
        """Six processes queued on the lock at once: exactly one runs, five skip."""
        lock_id = keys.lock_id_for(key)
        script = (
            "import sys, uuid\n"
            "import psycopg\n"
            "from jobrun import db, keys, log\n"
            "from jobrun.history import HistoryConfig, Recorder\n"
            "from jobrun.locks import Identity\n"
            "dsn, key, host, out = sys.argv[1:]\n"
            "with psycopg.connect(dsn, autocommit=True, application_name='once-per-test') as c:\n"
            "    c.execute('SELECT pg_advisory_lock(%s)', (keys.lock_id_for(key),))\n"
            "    r = Recorder(db.Target(dsn=dsn), Identity(run_id=str(uuid.uuid4()), host=host),\n"
            "                 keys.resolve((key,), ()), mode='session', program='job',\n"
            "                 config=HistoryConfig(), log=log.configure(fmt='json'))\n"
            "    earlier = r.acquired(3600)\n"
            "    if earlier is None:\n"
            "        r.started(1)\n"
            "        open(out, 'a').write('ran ' + host + '\\n')\n"
            "        r.finished('succeeded', 0, None, 0.1)\n"
            "    else:\n"
            "        r.skipped('already_ran', {}, 75)\n"
            "        open(out, 'a').write('skipped ' + host + '\\n')\n"
        )
        out = tmp_path / "out"
        with psycopg.connect(dsn, autocommit=True) as gate:
            gate.execute("SELECT pg_advisory_lock(%s)", (lock_id,))
            procs = [
                subprocess.Popen(
                    [sys.executable, "-c", script, dsn, key, f"host-{n}", str(out)],
                    stderr=subprocess.PIPE,
                    text=True,
                )
                for n in range(6)
            ]
            classid, objid = keys.from_name(key).pg_locks_pair

            def all_queued() -> bool:
                row = gate.execute(
                    "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                    "AND classid = %s::int8::oid AND objid = %s::int8::oid AND objsubid = 1",
                    (classid, objid),
                ).fetchone()
                return bool(row and row[0] == len(procs))

            wait_until(all_queued, what="six processes waiting for the lock")
            gate.execute("SELECT pg_advisory_unlock(%s)", (lock_id,))
        for proc in procs:
            _, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 0, stderr
        lines = out.read_text().splitlines()
        assert len([line for line in lines if line.startswith("ran ")]) == 1
        assert len([line for line in lines if line.startswith("skipped ")]) == 5
        reasons = [row["reason"] for row in rows_of(dsn, key) if row["outcome"] == "skipped"]
        assert reasons == ["already_ran"] * 5


class TestSkipStreak:
    """N skips in a row behind the same holder are an error line and a hook call."""

    def test_alert_fires_exactly_at_n_and_the_hook_gets_json_on_stdin(
        self, make_recorder, captured, tmp_path
    ):
        """Two skips: nothing. The third: skip_streak at error level and the hook's stdin."""
        calls = tmp_path / "calls"
        config = HistoryConfig(alert_after=3, on_alert=hook(calls))
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

    def test_every_skip_after_n_alerts_again(self, make_recorder, captured):
        """The fourth and fifth skip in a row alert with their own counts."""
        config = HistoryConfig(alert_after=3)
        blocker = str(uuid.uuid4())
        for _ in range(5):
            make_recorder(config=config).skipped("locked", holder(blocker), 75)
        assert [line["count"] for line in captured.events("skip_streak")] == [3, 4, 5]

    def test_since_is_the_first_skip_of_the_streak(self, dsn, make_recorder, captured):
        """``since`` stays the start of the first skip, however long the streak grows."""
        config = HistoryConfig(alert_after=2)
        blocker = str(uuid.uuid4())
        first = make_recorder(config=config)
        first.skipped("locked", holder(blocker), 75)
        for _ in range(2):
            make_recorder(config=config).skipped("locked", holder(blocker), 75)
        started = rows_of(dsn, first.label)[-1]["started_at"]
        assert {line["since"] for line in captured.events("skip_streak")} == {history.iso(started)}

    def test_a_new_holder_starts_a_new_streak(self, make_recorder, captured):
        """Skips behind a different run each time (a busy fleet) never build a streak."""
        config = HistoryConfig(alert_after=2)
        for _ in range(4):
            make_recorder(config=config).skipped("locked", holder(str(uuid.uuid4())), 75)
        assert captured.events("skip_streak") == []

    def test_a_fleet_alerts_once_per_round(self, make_recorder, captured):
        """Three hosts skipping behind one stuck holder: one alert per round from round 3."""
        config = HistoryConfig(alert_after=3)
        blocker = str(uuid.uuid4())
        for _ in range(4):
            for host in ("web1", "web2", "web3"):
                make_recorder(host=host, config=config).skipped("locked", holder(blocker), 75)
        alerts_sent = captured.events("skip_streak")
        assert [(line["count"], line["host"]) for line in alerts_sent] == [
            (3, "web1"),
            (4, "web1"),
        ]

    def test_a_fleet_skipping_at_the_same_moment_alerts_once_per_round(
        self, make_recorder, captured
    ):
        """Six hosts released together by a barrier, six rounds: one alert per round from 3."""
        config = HistoryConfig(alert_after=3)
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
        assert [line["count"] for line in captured.events("skip_streak")] == [3, 4, 5, 6]

    def test_skips_behind_an_unknown_holder_never_chain(self, make_recorder, captured):
        """Without a holder to tell rounds apart, a skip is a streak of one."""
        config = HistoryConfig(alert_after=2)
        for _ in range(3):
            make_recorder(config=config).skipped("locked", {}, 75)
        assert captured.events("skip_streak") == []

    def test_a_foreign_holder_is_known_by_its_backend(self, make_recorder, captured):
        """A holder that is not jobrun still chains skips through its backend pid and start."""
        config = HistoryConfig(alert_after=2)
        foreign = {"holder_backend_pid": 1234, "holder_since": "2026-01-01T00:00:00+00:00"}
        for _ in range(2):
            make_recorder(config=config).skipped("locked", foreign, 75)
        assert [line["count"] for line in captured.events("skip_streak")] == [2]

    def test_already_ran_skips_never_make_a_streak(self, dsn, make_recorder, captured):
        """--once-per skips are the plan working: streak 0, no alert."""
        config = HistoryConfig(alert_after=1)
        recorder = make_recorder(config=config)
        recorder.skipped("already_ran", {}, 75)
        assert captured.events("skip_streak") == []
        (row,) = rows_of(dsn, recorder.label)
        assert (row["reason"], row["streak"]) == ("already_ran", 0)

    def test_alert_after_zero_disables_alerts(self, make_recorder, captured, tmp_path):
        """--alert-after 0: no error line and no hook, however long the streak."""
        config = HistoryConfig(alert_after=0, on_alert=hook(tmp_path / "calls"))
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
        config = HistoryConfig(alert_after=3, on_alert=hook(calls))
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
        config = HistoryConfig(alert_after=3)
        for outcome in ("failed", "failed", "succeeded", "failed", "failed"):
            make_recorder(config=config).finished(
                outcome, 0 if outcome == "succeeded" else 1, None, 1
            )
        assert captured.events("failure_streak") == []

    def test_skips_and_dead_runs_neither_extend_nor_break_it(self, make_recorder, captured):
        """failed, skip, abandoned, failed, failed: the third failure alerts."""
        config = HistoryConfig(alert_after=3)
        make_recorder(config=config).finished("failed", 1, None, 1.0)
        make_recorder(config=config).skipped("locked", holder(str(uuid.uuid4())), 75)
        make_recorder(config=config).started_and_recorded(1)  # dies
        make_recorder(config=config).acquired(None)  # ... and is marked abandoned
        make_recorder(config=config).finished("failed", 1, None, 1.0)
        make_recorder(config=config).finished("lock_lost", 76, None, 1.0)
        assert [line["count"] for line in captured.events("failure_streak")] == [3]

    def test_deferred_alert_waits_for_flush(self, make_recorder, captured, tmp_path):
        """finished(defer_alerts=True) logs at once but runs the hook only on flush()."""
        calls = tmp_path / "calls"
        config = HistoryConfig(alert_after=1, on_alert=hook(calls))
        recorder = make_recorder(config=config)
        recorder.finished("failed", 1, None, 1.0, defer_alerts=True)
        assert len(captured.events("failure_streak")) == 1
        assert hook_calls(calls) == []
        recorder.flush()
        assert len(hook_calls(calls)) == 1


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
        config = HistoryConfig(
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


class TestPruning:
    """The history of a key stays bounded."""

    def test_keeps_the_newest_n_runs_and_the_newest_n_skips(self, dsn, make_recorder):
        """keep=3 after five runs and five skips: three of each, the newest."""
        config = HistoryConfig(keep=3, alert_after=0)
        finished = []
        for _ in range(5):
            recorder = make_recorder(config=config)
            recorder.started(1)
            recorder.finished("succeeded", 0, None, 1.0)
            finished.append(recorder.run_id)
            make_recorder(config=config).skipped("locked", holder(str(uuid.uuid4())), 75)
        rows = rows_of(dsn, recorder.label)
        assert [row["outcome"] for row in rows].count("skipped") == 3
        kept = [str(row["run_id"]) for row in rows if row["outcome"] == "succeeded"]
        assert kept == finished[:1:-1]

    def test_running_rows_are_never_pruned(self, dsn, make_recorder):
        """A row still running survives any number of newer runs."""
        config = HistoryConfig(keep=1)
        running = make_recorder(config=config)
        running.started_and_recorded(1)
        for _ in range(3):
            make_recorder(config=config).finished("succeeded", 0, None, 1.0)
        outcomes = [row["outcome"] for row in rows_of(dsn, running.label)]
        assert sorted(outcomes) == ["running", "succeeded"]

    def test_a_fleet_larger_than_keep_keeps_every_hosts_streak(self, dsn, make_recorder):
        """keep=2, four hosts behind one holder: each host's streak grows every round."""
        config = HistoryConfig(keep=2, alert_after=0)
        blocker = str(uuid.uuid4())
        hosts = ("web1", "web2", "web3", "web4")
        for round_ in range(1, 5):
            for host in hosts:
                make_recorder(host=host, config=config).skipped("locked", holder(blocker), 75)
            rows = rows_of(dsn, make_recorder().label)
            newest = {row["host"]: row["streak"] for row in reversed(rows)}  # rows: newest first
            assert newest == dict.fromkeys(hosts, round_)
            assert len(rows) == len(hosts)  # bounded: the newest 2, and each host's newest

    def test_a_streak_outlives_its_pruned_rows(self, make_recorder, captured):
        """keep=1: the fourth skip in a row still counts 4."""
        config = HistoryConfig(keep=1, alert_after=4)
        blocker = str(uuid.uuid4())
        for _ in range(4):
            make_recorder(config=config).skipped("locked", holder(blocker), 75)
        assert [line["count"] for line in captured.events("skip_streak")] == [4]

    @pytest.mark.parametrize(
        ("options", "message"),
        [
            ({"keep": 0}, "--keep"),
            ({"alert_after": -1}, "--alert-after"),
            ({"alert_timeout": 0}, "timeout"),
        ],
    )
    def test_bad_settings_are_usage_errors(self, options, message):
        """keep < 1, alert_after < 0 or a zero hook timeout: UsageError saying which."""
        with pytest.raises(UsageError, match=message):
            HistoryConfig(**options)


class TestHistoryFailures:
    """A history that cannot be written costs one warning line, never the job."""

    def test_missing_privileges_are_one_warning_and_no_exception(
        self, dsn, make_recorder, captured, role
    ):
        """A role that may not write jobrun.runs: the whole run logs one history_failed."""
        ensure_runs_table(dsn)
        limited = role(
            "GRANT USAGE ON SCHEMA jobrun TO {role}", "GRANT SELECT ON jobrun.runs TO {role}"
        )
        recorder = make_recorder(target_dsn=limited, config=HistoryConfig(alert_after=1))
        assert recorder.acquired(None) is None
        recorder.started(1)
        recorder.finished("failed", 1, None, 1.0)
        recorder.skipped("locked", holder(str(uuid.uuid4())), 75)
        (line,) = captured.events("history_failed")
        assert line["level"] == "warning"
        assert "permission denied" in line["error"]
        assert captured.events("failure_streak") == []

    def test_an_unreachable_database_costs_one_attempt(self, make_recorder, captured):
        """Connection refused: one warning, then no more attempts for the rest of the run."""
        recorder = make_recorder(target_dsn="host=127.0.0.1 port=1 dbname=x connect_timeout=2")
        recorder.acquired(None)
        started = time.monotonic()
        recorder.started(1)
        recorder.finished("succeeded", 0, None, 1.0)
        assert time.monotonic() - started < 0.5
        (line,) = captured.events("history_failed")
        assert line["during"] == "checking earlier runs"

    def test_a_locked_table_times_out_instead_of_holding_the_job(
        self, fresh_dsn, make_recorder, captured, monkeypatch
    ):
        """A history statement stuck behind a lock gives up after the statement timeout."""
        monkeypatch.setattr(history, "STATEMENT_TIMEOUT", 0.5)
        ensure_runs_table(fresh_dsn)
        with psycopg.connect(fresh_dsn) as blocker:
            blocker.execute("LOCK TABLE jobrun.runs IN ACCESS EXCLUSIVE MODE")
            started = time.monotonic()
            recorder = make_recorder(target_dsn=fresh_dsn)
            recorder.started(1)
            recorder.finished("succeeded", 0, None, 1.0)
            assert time.monotonic() - started < 4
        (line,) = captured.events("history_failed")
        assert line["during"] == "recording the start"
        assert "timeout" in line["error"]

    def test_started_never_waits_for_the_database(self, dsn, make_recorder, proxy, pg_address):
        """A silent network: started() returns at once (the supervisor must not wait)."""
        cut = proxy(*pg_address)
        cut.blackhole()
        recorder = make_recorder(target_dsn=cut.dsn_for(dsn), config=HistoryConfig(timeout=1))
        started = time.monotonic()
        recorder.started(1)
        assert time.monotonic() - started < 0.5

    def test_a_silent_network_costs_the_timeout_at_most(
        self, dsn, make_recorder, captured, proxy, pg_address
    ):
        """No answer at all: acquired() gives up after HistoryConfig.timeout, and says so."""
        cut = proxy(*pg_address)
        cut.blackhole()
        recorder = make_recorder(target_dsn=cut.dsn_for(dsn), config=HistoryConfig(timeout=1))
        started = time.monotonic()
        with pytest.raises(LockStoreUnavailable):  # --once-per fails closed
            recorder.acquired(3600)
        assert time.monotonic() - started < 3
        recorder.finished("succeeded", 0, None, 1.0)  # given up: no second wait
        assert time.monotonic() - started < 3
        (line,) = captured.events("history_failed")
        assert line["error"] == "no answer within 1s"

    def test_a_statement_hanging_on_a_silent_network_is_cut(
        self, fresh_dsn, make_recorder, captured, proxy, *, pg_address, monkeypatch
    ):
        """A write blocked when the network goes silent: the caller moves on, the thread ends."""
        monkeypatch.setattr(history, "STATEMENT_TIMEOUT", 60)
        ensure_runs_table(fresh_dsn)
        cut = proxy(*pg_address)
        recorder = make_recorder(target_dsn=cut.dsn_for(fresh_dsn), config=HistoryConfig(timeout=1))
        with psycopg.connect(fresh_dsn) as blocker:
            blocker.execute("LOCK TABLE jobrun.runs IN ACCESS EXCLUSIVE MODE")
            recorder.started(1)

            def insert_waiting() -> bool:
                # A separate session: the blocker's own transaction sees one stats snapshot.
                with psycopg.connect(fresh_dsn) as watcher:
                    row = watcher.execute(
                        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                        " AND query LIKE '%%INSERT INTO jobrun.runs%%'"
                        " AND datname = current_database()"
                    ).fetchone()
                return bool(row and row[0])

            wait_until(insert_waiting, what="the history INSERT waiting for the lock")
            cut.blackhole()
            started = time.monotonic()
            recorder.finished("succeeded", 0, None, 1.0)
            assert time.monotonic() - started < 3
        (line,) = captured.events("history_failed")
        assert (line["during"], line["error"]) == ("recording the start", "no answer within 1s")
        wait_until(
            lambda: not [t for t in threading.enumerate() if t.name == "jobrun-history"],
            timeout=5,
            what="the history thread to end",
        )

    def test_a_password_never_reaches_the_warning(self, make_recorder, captured):
        """The DSN's password is masked in history_failed."""
        recorder = make_recorder(target_dsn="host=127.0.0.1 port=1 password=hunter2secret")
        recorder.started(1)
        assert "hunter2secret" not in captured.path.read_text()


# --- through the real CLI (needs the lead's wiring of the run options) -----------------------


class TestWiredThroughCli:
    """The run command with history options; these fail until cli.py/runner.py wire them."""

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

    def test_a_history_that_cannot_be_written_does_not_fail_the_job(self, dsn, key, role):
        """A role without privileges on jobrun.runs: exit 0 and one history_failed line."""
        ensure_runs_table(dsn)
        limited = role("GRANT USAGE ON SCHEMA jobrun TO {role}")
        result = jobrun_cli.run("--key", key, "--", "true", dsn=limited)
        assert result.returncode == 0, result.stderr
        assert event(result.stderr, "history_failed")["level"] == "warning"
        assert event(result.stderr, "finished")["outcome"] == "succeeded"

    def test_once_per_fails_closed_when_the_history_cannot_be_read(self, dsn, key, role, tmp_path):
        """--once-per without a readable history: exit 69, the child does not run."""
        ensure_runs_table(dsn)
        limited = role("GRANT USAGE ON SCHEMA jobrun TO {role}")
        ran = tmp_path / "ran"
        result = jobrun_cli.run("--key", key, "--once-per", "1h", "--", "touch", str(ran),
                                dsn=limited)  # fmt: skip
        assert result.returncode == 69, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["reason"] == "history_unavailable"
        assert not ran.exists()

    def test_once_per_with_on_db_error_run_runs_unchecked(self, dsn, key, role, tmp_path):
        """--on-db-error run opts into running when --once-per cannot be checked."""
        ensure_runs_table(dsn)
        limited = role("GRANT USAGE ON SCHEMA jobrun TO {role}")
        ran = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key", key, "--once-per", "1h", "--on-db-error", "run", "--", "touch", str(ran),
            dsn=limited,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["running_unchecked"] is True
        assert ran.exists()

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
        (call,) = hook_calls(calls)
        assert json.loads(call["stdin"])["count"] == 3

    def test_no_history_writes_nothing(self, dsn, key):
        """--no-history: the run leaves no row."""
        result = jobrun_cli.run("--key", key, "--no-history", "--", "true", dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert not table_exists(dsn) or rows_of(dsn, key) == []
