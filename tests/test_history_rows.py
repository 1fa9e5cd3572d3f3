"""Run history rows against a real PostgreSQL: the table, runs, abandoned runs, --once-per."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid

import psycopg
import pytest

from harness.jobrun_cli import wait_until
from jobrun import keys
from jobrun.exitcodes import UsageError
from support.history import Run, history_config, holder, row_of, rows_of


class TestSchema:
    """jobrun.runs appears on first use, once, however many first runs race."""

    def test_first_write_creates_the_table(self, fresh_dsn, make_recorder, captured):
        """The first started() on a database without the schema creates it and writes."""
        recorder = make_recorder(target_dsn=fresh_dsn)
        recorder.running(123)
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

    def test_acquired_creates_the_table_and_the_running_row(
        self, fresh_dsn, make_recorder, captured
    ):
        """acquired() on a fresh database creates jobrun.runs and writes the running row.

        The --once-per check is only sound if the run it allows is written down at once.
        """
        recorder = make_recorder(target_dsn=fresh_dsn)
        assert recorder.acquired(3600) is None
        assert [row["outcome"] for row in rows_of(fresh_dsn, recorder.label)] == ["running"]
        assert captured.events("history_failed") == []


class TestRunRows:
    """A run's row says what happened, and only what is safe to say."""

    def test_acquired_writes_a_running_row_with_the_program_name_only(self, dsn, make_recorder):
        """Outcome running, host, pid, mode, lock ids and argv[0]; the child pid at the end."""
        recorder = make_recorder(program="/opt/jobs/export.sh")
        recorder.running(5151)
        (row,) = rows_of(dsn, recorder.label)
        assert row["outcome"] == "running"
        assert (row["host"], row["pid"], row["mode"]) == ("host-a", 4242, "session")
        assert row["program"] == "/opt/jobs/export.sh"
        assert row["lock_ids"] == [keys.lock_id_for(recorder.label)]
        assert row["finished_at"] is None
        recorder.finished("succeeded", 0, None, 1.0)
        assert rows_of(dsn, recorder.label)[0]["child_pid"] == 5151

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
        recorder.running(1)
        run_keys = keys.resolve((f"{key}-a", f"{key}-b"), ())
        (row,) = rows_of(dsn, keys.describe(run_keys))
        assert row["lock_ids"] == [k.lock_id for k in run_keys]


class TestAbandoned:
    """A row still marked running when we hold its lock belongs to a dead run."""

    def test_dead_runs_row_is_marked_abandoned_and_logged(self, dsn, make_recorder, captured):
        """acquired() marks it abandoned and logs abandoned_run naming host, pid, run id."""
        dead = make_recorder(host="crashed-host", pid=777)
        dead.running(1)
        make_recorder().acquired(None)
        assert row_of(dsn, dead.run_id)["outcome"] == "abandoned"
        (line,) = captured.events("abandoned_run")
        assert line["level"] == "warning"
        assert line["abandoned_run_id"] == dead.run_id
        assert (line["abandoned_host"], line["abandoned_pid"]) == ("crashed-host", 777)
        assert line["abandoned_started_at"]

    def test_a_run_sharing_one_lock_id_counts_too(self, dsn, key, make_recorder):
        """A dead multi-key run that held one of our keys is abandoned as well."""
        dead = make_recorder(names=(key, f"{key}-other"))
        dead.running(1)
        make_recorder(names=(key,)).acquired(None)
        assert row_of(dsn, dead.run_id)["outcome"] == "abandoned"

    def test_own_row_and_other_keys_are_left_alone(self, dsn, key, make_recorder, captured):
        """Our own running row and rows of unrelated keys keep their outcome."""
        other = make_recorder(names=(f"{key}-unrelated",))
        other.running(1)
        me = make_recorder()
        me.running(1)
        assert row_of(dsn, other.run_id)["outcome"] == "running"
        assert row_of(dsn, me.run_id)["outcome"] == "running"
        assert captured.events("abandoned_run") == []

    def test_a_late_finish_overwrites_abandoned(self, dsn, make_recorder):
        """A run taken for dead that does finish (a frozen lease holder) records the truth."""
        slow = make_recorder()
        slow.running(1)
        make_recorder().acquired(None)
        slow.finished("lock_lost", 76, None, 40.0)
        assert row_of(dsn, slow.run_id)["outcome"] == "lock_lost"


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
        make_recorder().running(1)  # dies: abandoned by the next acquired()
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
            "from jobrun.history.config import HistoryConfig\n"
            "from jobrun.run.recorder import Recorder\n"
            "from jobrun.locks import Identity\n"
            "dsn, key, host, out = sys.argv[1:]\n"
            "with psycopg.connect(dsn, autocommit=True, application_name='once-per-test') as c:\n"
            "    c.execute('SELECT pg_advisory_lock(%s)', (keys.lock_id_for(key),))\n"
            "    r = Recorder(db.Target(dsn=dsn), Identity(run_id=str(uuid.uuid4()), host=host),\n"
            "                 keys.resolve((key,), ()), mode='session', program='job',\n"
            "                 config=HistoryConfig(keep=100, alert_after=3, alert_repeat=3600,\n"
            "                     on_alert=None, metrics_file=None, timeout=5, expect_every=None,\n"
            "                     expect_grace=None),\n"
            "                 log=log.configure(fmt='json'))\n"
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


class TestPruning:
    """The history of a key stays bounded."""

    def test_keeps_the_newest_n_runs_and_the_newest_n_skips(self, dsn, make_recorder):
        """keep=3 after five runs and five skips: three of each, the newest."""
        config = history_config(keep=3, alert_after=0)
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
        config = history_config(keep=1)
        running = make_recorder(config=config)
        running.running(1)
        for _ in range(3):
            make_recorder(config=config).finished("succeeded", 0, None, 1.0)
        outcomes = [row["outcome"] for row in rows_of(dsn, running.label)]
        assert sorted(outcomes) == ["running", "succeeded"]

    def test_a_fleet_larger_than_keep_keeps_every_hosts_streak(self, dsn, make_recorder):
        """keep=2, four hosts behind one holder: each host's streak grows every round."""
        config = history_config(keep=2, alert_after=0)
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
        config = history_config(keep=1, alert_after=4)
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
            history_config(**options)
