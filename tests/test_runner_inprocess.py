"""The runner driven without a server: a MemoryLock, real children (the fast tier).

Each run is ``runner.run`` with what assembly would build left out (a session that is never
opened, no history); its events are captured from the logger it is handed. Each runs in a
fork of the test process (``memory.forked``): the runner needs its process's signals to
itself, and pytest-xdist runs a thread of its own in the test process.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import signal
import sys
import time
from typing import TYPE_CHECKING, Any

import pytest
import structlog
from structlog.testing import LogCapture

from harness.memory import MemoryLock, MemoryStore, forked, run_in_process
from jobrun import keys
from jobrun.exitcodes import Exit
from jobrun.locks import Taken
from jobrun.procs import process_gone
from jobrun.run import supervise
from jobrun.run.job import Job
from jobrun.run.listeners import Listener

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence
    from pathlib import Path

    from structlog.typing import FilteringBoundLogger

#: Seconds between two checks of the lock: short, so a loss is noticed fast.
HEARTBEAT = 0.1
#: Seconds the memory lock vouches for itself after a check: well beyond a heartbeat, so
#: only a failed check (not the lifetime running out) can stop a child within it.
LIFETIME = 40 * HEARTBEAT
#: A child that would outlive every test unless jobrun stops it.
FOREVER = ("sleep", "300")


@pytest.fixture
def job(key: str) -> Job:
    """A run of ``true`` on a key of the test's own, with the options' defaults."""
    return Job(
        argv=("true",),
        keys=(keys.from_name(key),),
        wait=0.0,
        timeout=None,
        kill_after=5.0,
        skip_exit_code=int(Exit.SKIPPED),
        on_db_error="fail",
        on_lock_lost="terminate",
        heartbeat=HEARTBEAT,
        min_hold=None,
        once_per=None,
        pass_env=(),
    )


@pytest.fixture
def store() -> MemoryStore:
    """The lock store the test's runs share."""
    return MemoryStore()


def logger_for(events: LogCapture) -> FilteringBoundLogger:
    """A logger whose events go to ``events`` (nothing global is configured)."""
    logger: FilteringBoundLogger = structlog.wrap_logger(
        None,
        processors=[events],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
    )
    return logger


@dataclasses.dataclass
class Result:
    """What a run left: its status, events, the store's holders after it, listener reports."""

    status: int
    events: list[dict[str, Any]]
    held: dict[int, str]
    reports: list[object]


def bound(job: Job) -> float:
    """Seconds by which jobrun has ended ``job`` whatever happens: its timeout, a lifetime
    without a successful check, and the kill deadline twice (the stop, then the group)."""
    return (job.timeout or 0.0) + LIFETIME + 2 * job.kill_after


def drive(
    job: Job, store: MemoryStore, lock: MemoryLock, listeners: Sequence[Listener] = ()
) -> Result:
    """Run ``job`` under ``lock`` with ``listeners``, in a fork of the test process."""

    def work() -> Result:
        events = LogCapture()
        status = run_in_process(job, lock, logger_for(events), listeners=listeners)
        reports = [getattr(listener, "report", lambda: None)() for listener in listeners]
        return Result(status, events.entries, store.held(), reports)

    return forked(work, timeout=bound(job))


def lock_for(job: Job, store: MemoryStore) -> MemoryLock:
    """A memory lock on ``job``'s keys, vouched for LIFETIME after each check."""
    return MemoryLock(job.keys, store, lifetime=LIFETIME)


def named(result: Result, name: str) -> dict[str, Any]:
    """The one event called ``name``."""
    found = [entry for entry in result.events if entry["event"] == name]
    assert len(found) == 1, names(result)
    return found[0]


def names(result: Result) -> list[str]:
    """The events' names, in order."""
    return [str(entry["event"]) for entry in result.events]


class Recording(Listener):
    """A listener that writes down which steps it heard of, in order."""

    def __init__(self) -> None:
        self.heard: list[str] = []

    def report(self) -> list[str]:
        """What it heard, for the test."""
        return self.heard

    def skipped(self, reason: str, fields: Mapping[str, Any], exit_code: int) -> None:
        del fields  # the holder's fields: the skipped event's, checked there
        self.heard.append(f"skipped:{reason}:{exit_code}")

    def not_started(self, outcome: str, exit_code: int) -> None:
        self.heard.append(f"not_started:{outcome}:{exit_code}")

    def started(self, child_pid: int) -> None:
        del child_pid
        self.heard.append("started")

    def finished(self, outcome: str, exit_code: int, signal: str | None, duration: float) -> None:
        del duration
        self.heard.append(f"finished:{outcome}:{exit_code}:{signal}")

    def released(self, status: int) -> None:
        self.heard.append(f"released:{status}")


class TakeAwayOnStart(Listener):
    """Takes the lock away from under the run as soon as its child runs."""

    def __init__(self, store: MemoryStore, job: Job) -> None:
        self.store = store
        self.job = job
        self.child_pid: int | None = None

    def report(self) -> int | None:
        """The child's pid, for the test."""
        return self.child_pid

    def started(self, child_pid: int) -> None:
        self.child_pid = child_pid
        for key in self.job.keys:
            self.store.take_away(key.lock_id)


class TestRunWithTheLock:
    """A run that gets the lock starts its child and exits with the child's status."""

    def test_a_child_that_succeeds_exits_0(self, job, store):
        """true: started, finished (succeeded), exit 0."""
        result = drive(job, store, lock_for(job, store))
        assert result.status == 0
        assert named(result, "started")["command"] == "true"
        finished = named(result, "finished")
        assert (finished["outcome"], finished["exit_code"]) == ("succeeded", 0)

    def test_a_child_that_fails_exits_with_its_status(self, job, store):
        """false: finished (failed), exit 1."""
        job = dataclasses.replace(job, argv=("false",))
        result = drive(job, store, lock_for(job, store))
        assert result.status == 1
        finished = named(result, "finished")
        assert (finished["outcome"], finished["child_exit_code"]) == ("failed", 1)

    def test_the_childs_own_status_is_passed_on(self, job, store):
        """sh -c 'exit 3': exit 3."""
        job = dataclasses.replace(job, argv=("sh", "-c", "exit 3"))
        result = drive(job, store, lock_for(job, store))
        assert result.status == 3
        assert named(result, "finished")["exit_code"] == 3

    def test_the_lock_is_free_after_the_run(self, job, store):
        """Released at the end: nothing is left held in the store."""
        lock = lock_for(job, store)
        result = drive(job, store, lock)
        assert result.status == 0
        assert result.held == {}


class TestSkip:
    """A run that finds its key held skips, names the holder and never starts its child."""

    def test_a_held_key_skips_with_the_skip_status_and_the_holder(self, job, store, tmp_path: Path):
        """Held: skipped (reason locked, the holder's run id), exit 75; the child never ran."""
        holder = lock_for(job, store)
        assert isinstance(holder.acquire(0), Taken)
        marker = tmp_path / "ran"
        job = dataclasses.replace(job, argv=("touch", str(marker)))
        result = drive(job, store, lock_for(job, store))
        assert result.status == Exit.SKIPPED
        skipped = named(result, "skipped")
        assert skipped["reason"] == "locked"
        assert skipped["exit_code"] == Exit.SKIPPED
        assert skipped["holder_run_id"] == holder.identity.run_id
        assert skipped["holder_pid"] == holder.identity.pid
        assert "started" not in names(result)
        assert not marker.exists()
        # The skip left the holder's lock alone.
        assert result.held == {job.keys[0].lock_id: holder.identity.run_id}

    def test_the_skip_status_is_the_jobs(self, job, store):
        """--skip-exit-code 0: a skip exits 0."""
        assert isinstance(lock_for(job, store).acquire(0), Taken)
        job = dataclasses.replace(job, skip_exit_code=0)
        result = drive(job, store, lock_for(job, store))
        assert result.status == 0
        assert named(result, "skipped")["exit_code"] == 0


class TestLockLost:
    """A lock lost while the child runs stops the child: exit 76."""

    def test_a_lock_taken_away_stops_the_child_with_76(self, job, store):
        """Taken away as the child starts: noticed by a check, child stopped, exit 76."""
        job = dataclasses.replace(job, argv=FOREVER)
        result = drive(job, store, lock_for(job, store), [TakeAwayOnStart(store, job)])
        assert result.status == Exit.LOCK_LOST
        lost = named(result, "lock_lost")
        assert "taken away" in lost["reason"]  # a failed check, not the lifetime running out
        assert lost["action"] == "terminate"
        finished = named(result, "finished")
        assert (finished["outcome"], finished["signal"]) == ("lock_lost", "SIGTERM")
        # Noticed by a check well within the lifetime (a check comes every HEARTBEAT).
        assert finished["duration"] < LIFETIME
        (child_pid,) = result.reports
        assert isinstance(child_pid, int)
        assert process_gone(child_pid)

    def test_on_lock_lost_ignore_lets_the_child_finish(self, job, store):
        """--on-lock-lost ignore: the loss is logged and the child's own status stands."""
        # The child outlives several heartbeats, so a check sees the loss while it runs.
        job = dataclasses.replace(job, argv=("sleep", str(5 * HEARTBEAT)), on_lock_lost="ignore")
        result = drive(job, store, lock_for(job, store), [TakeAwayOnStart(store, job)])
        assert result.status == 0
        assert named(result, "lock_lost")["action"] == "ignore"
        assert named(result, "finished")["lock_lost"]


class TestStartFailures:
    """A command that cannot be started: 127 not found, 126 not executable."""

    def test_a_missing_command_exits_127(self, job, store):
        """No such command: exec_failed, exit 127, the lock released."""
        job = dataclasses.replace(job, argv=("jobrun-test-no-such-command",))
        result = drive(job, store, lock_for(job, store))
        assert result.status == 127
        assert named(result, "exec_failed")["exit_code"] == 127
        assert "started" not in names(result)
        assert result.held == {}

    def test_a_file_that_is_not_executable_exits_126(self, job, store, tmp_path: Path):
        """A file without the execute bit: exec_failed, exit 126."""
        script = tmp_path / "script.sh"
        script.write_text("#!/bin/sh\nexit 0\n")
        script.chmod(0o644)
        job = dataclasses.replace(job, argv=(str(script),))
        result = drive(job, store, lock_for(job, store))
        assert result.status == 126
        assert named(result, "exec_failed")["exit_code"] == 126


class TestTimeout:
    """--timeout stops the child: exit 124."""

    def test_a_child_past_its_timeout_is_stopped_with_124(self, job, store):
        """sleep past --timeout: SIGTERM at the timeout, finished timed_out, exit 124."""
        job = dataclasses.replace(job, argv=FOREVER, timeout=0.5)
        result = drive(job, store, lock_for(job, store))
        assert result.status == Exit.TIMED_OUT
        finished = named(result, "finished")
        assert (finished["outcome"], finished["signal"]) == ("timed_out", "SIGTERM")
        # sleep dies of the SIGTERM: stopped at the timeout, long before the SIGKILL.
        assert job.timeout <= finished["duration"] < job.timeout + job.kill_after


class TestStoreDown:
    """The lock store unavailable: exit 69, or the child unguarded with --on-db-error run."""

    def test_a_store_that_is_down_fails_the_run_with_69(self, job, store):
        """store.down: lockstore_unavailable, exit 69, no child."""
        store.down = True
        result = drive(job, store, lock_for(job, store))
        assert result.status == Exit.UNAVAILABLE
        assert named(result, "lockstore_unavailable")["exit_code"] == Exit.UNAVAILABLE
        assert "started" not in names(result)

    def test_on_db_error_run_runs_the_child_unguarded(self, job, store):
        """store.down with --on-db-error run: the child runs, guarded=False."""
        store.down = True
        job = dataclasses.replace(job, on_db_error="run")
        result = drive(job, store, lock_for(job, store))
        assert result.status == 0
        assert named(result, "started")["guarded"] is False


class TestListenerOrder:
    """A listener hears the run's steps in order, ``released`` last."""

    def test_a_run_is_heard_as_started_finished_released(self, job, store):
        """Run: started, finished, released (with the run's status)."""
        job = dataclasses.replace(job, argv=("sh", "-c", "exit 3"))
        result = drive(job, store, lock_for(job, store), [Recording()])
        assert result.reports == [["started", "finished:failed:3:None", "released:3"]]

    def test_a_skip_is_heard_as_skipped_then_released(self, job, store):
        """Skip: skipped (reason, status), released; never started."""
        assert isinstance(lock_for(job, store).acquire(0), Taken)
        result = drive(job, store, lock_for(job, store), [Recording()])
        skip = int(Exit.SKIPPED)
        assert result.reports == [[f"skipped:locked:{skip}", f"released:{skip}"]]

    def test_an_exec_failure_is_heard_as_not_started(self, job, store):
        """Exec failure: not_started (exec_failed, 127), released."""
        job = dataclasses.replace(job, argv=("jobrun-test-no-such-command",))
        result = drive(job, store, lock_for(job, store), [Recording()])
        assert result.reports == [["not_started:exec_failed:127", "released:127"]]

    def test_a_lost_lock_is_heard_after_the_start(self, job, store):
        """Lock lost mid-run: started, finished (lock_lost, 76), released."""
        job = dataclasses.replace(job, argv=FOREVER)
        listeners = [TakeAwayOnStart(store, job), Recording()]
        result = drive(job, store, lock_for(job, store), listeners)
        assert result.reports[1] == ["started", "finished:lock_lost:76:SIGTERM", "released:76"]


def _is_subreaper() -> bool:
    """Whether orphaned descendants are re-parented to this process (prctl, Linux)."""
    flag = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return bool(flag.value)


#: prctl(2): read whether this process is a subreaper.
_PR_GET_CHILD_SUBREAPER = 37


class TestRunInProcess:
    """run_in_process leaves its process as it found it (a test process runs on)."""

    @pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
    def test_the_process_is_no_subreaper_after_a_run(self, job, store):
        """The runner makes its process a subreaper; run_in_process undoes it."""

        def work() -> tuple[int, bool]:
            status = run_in_process(job, lock_for(job, store), logger_for(LogCapture()))
            return status, _is_subreaper()

        assert forked(work, timeout=bound(job)) == (0, False)

    def test_the_wake_up_signal_is_put_back(self, job, store):
        """The runner ignores its wake-up signal from then on; run_in_process restores it."""

        def work() -> tuple[int, bool]:
            signal.signal(supervise.WAKE, signal.SIG_DFL)
            status = run_in_process(job, lock_for(job, store), logger_for(LogCapture()))
            return status, signal.getsignal(supervise.WAKE) == signal.SIG_DFL

        assert forked(work, timeout=bound(job)) == (0, True)


class TestForked:
    """The fork a run is driven in reports its failures and its hangs."""

    def test_a_failure_in_the_fork_fails_the_test(self):
        """An exception in the fork comes back as an AssertionError with its traceback."""

        def work() -> None:
            raise ValueError("boom")

        with pytest.raises(AssertionError, match="ValueError: boom"):
            forked(work, timeout=LIFETIME)

    def test_a_fork_that_hangs_is_killed_at_its_timeout(self):
        """A fork that never answers: TimeoutError at the timeout, the fork killed."""
        with pytest.raises(TimeoutError):
            forked(lambda: time.sleep(300), timeout=HEARTBEAT)
