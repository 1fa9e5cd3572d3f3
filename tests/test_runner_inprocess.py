"""The runner driven in this process: a MemoryLock, real children, no server (the fast tier).

Each run is ``runner.run`` with what assembly would build left out (a session that is never
opened, no history); its events are captured from the logger it is handed.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
import signal
import sys
import threading
from typing import TYPE_CHECKING, Any

import pytest
import structlog
from structlog.testing import LogCapture

from jobrun import keys, supervise
from jobrun.exitcodes import Exit
from jobrun.listeners import Listener
from jobrun.procs import process_gone
from jobrun.runner import Job
from jobrun.testing.memory import MemoryLock, MemoryStore, run_in_process

if TYPE_CHECKING:
    from collections.abc import Mapping
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


@pytest.fixture
def events() -> LogCapture:
    """The events the runs of the test log."""
    return LogCapture()


@pytest.fixture
def log(events: LogCapture) -> FilteringBoundLogger:
    """A logger whose events go to ``events`` (nothing global is configured)."""
    logger: FilteringBoundLogger = structlog.wrap_logger(
        None,
        processors=[events],
        wrapper_class=structlog.make_filtering_bound_logger(logging.DEBUG),
    )
    return logger


def lock_for(job: Job, store: MemoryStore) -> MemoryLock:
    """A memory lock on ``job``'s keys, vouched for LIFETIME after each check."""
    return MemoryLock(job.keys, store, lifetime=LIFETIME)


def named(events: LogCapture, name: str) -> dict[str, Any]:
    """The one event called ``name``."""
    found = [entry for entry in events.entries if entry["event"] == name]
    assert len(found) == 1, [entry["event"] for entry in events.entries]
    return found[0]


def names(events: LogCapture) -> list[str]:
    """The events' names, in order."""
    return [str(entry["event"]) for entry in events.entries]


class Recording(Listener):
    """A listener that writes down which steps it heard of, in order."""

    def __init__(self) -> None:
        self.heard: list[str] = []

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

    def started(self, child_pid: int) -> None:
        self.child_pid = child_pid
        for key in self.job.keys:
            self.store.take_away(key.lock_id)


class TestRunWithTheLock:
    """A run that gets the lock starts its child and exits with the child's status."""

    def test_a_child_that_succeeds_exits_0(self, job, store, log, events):
        """true: started, finished (succeeded), exit 0."""
        assert run_in_process(job, lock_for(job, store), log) == 0
        assert named(events, "started")["command"] == "true"
        finished = named(events, "finished")
        assert (finished["outcome"], finished["exit_code"]) == ("succeeded", 0)

    def test_a_child_that_fails_exits_with_its_status(self, job, store, log, events):
        """false: finished (failed), exit 1."""
        job = dataclasses.replace(job, argv=("false",))
        assert run_in_process(job, lock_for(job, store), log) == 1
        finished = named(events, "finished")
        assert (finished["outcome"], finished["child_exit_code"]) == ("failed", 1)

    def test_the_childs_own_status_is_passed_on(self, job, store, log, events):
        """sh -c 'exit 3': exit 3."""
        job = dataclasses.replace(job, argv=("sh", "-c", "exit 3"))
        assert run_in_process(job, lock_for(job, store), log) == 3
        assert named(events, "finished")["exit_code"] == 3

    def test_the_lock_is_free_after_the_run(self, job, store, log):
        """Released at the end: the next run gets it."""
        assert run_in_process(job, lock_for(job, store), log) == 0
        assert store.held() == {}
        assert lock_for(job, store).acquire(0) is None


class TestSkip:
    """A run that finds its key held skips, names the holder and never starts its child."""

    def test_a_held_key_skips_with_the_skip_status_and_the_holder(
        self, job, store, log, events, tmp_path: Path
    ):
        """Held: skipped (reason locked, the holder's run id), exit 75; the child never ran."""
        holder = lock_for(job, store)
        assert holder.acquire(0) is None
        marker = tmp_path / "ran"
        job = dataclasses.replace(job, argv=("touch", str(marker)))
        assert run_in_process(job, lock_for(job, store), log) == Exit.SKIPPED
        skipped = named(events, "skipped")
        assert skipped["reason"] == "locked"
        assert skipped["exit_code"] == Exit.SKIPPED
        assert skipped["holder_run_id"] == holder.identity.run_id
        assert skipped["holder_pid"] == holder.identity.pid
        assert "started" not in names(events)
        assert not marker.exists()
        holder.check()  # the skip left the holder's lock alone

    def test_the_skip_status_is_the_jobs(self, job, store, log):
        """--skip-exit-code 0: a skip exits 0."""
        assert lock_for(job, store).acquire(0) is None
        job = dataclasses.replace(job, skip_exit_code=0)
        assert run_in_process(job, lock_for(job, store), log) == 0


class TestLockLost:
    """A lock lost while the child runs stops the child: exit 76."""

    def test_a_lock_taken_away_stops_the_child_with_76(self, job, store, log, events):
        """Taken away as the child starts: noticed by a check, child stopped, exit 76."""
        job = dataclasses.replace(job, argv=FOREVER)
        thief = TakeAwayOnStart(store, job)
        assert run_in_process(job, lock_for(job, store), log, listeners=[thief]) == Exit.LOCK_LOST
        lost = named(events, "lock_lost")
        assert "taken away" in lost["reason"]  # a failed check, not the lifetime running out
        assert lost["action"] == "terminate"
        finished = named(events, "finished")
        assert (finished["outcome"], finished["signal"]) == ("lock_lost", "SIGTERM")
        # Noticed by a check well within the lifetime (a check comes every HEARTBEAT).
        assert finished["duration"] < LIFETIME
        assert thief.child_pid is not None
        assert process_gone(thief.child_pid)

    def test_on_lock_lost_ignore_lets_the_child_finish(self, job, store, log, events):
        """--on-lock-lost ignore: the loss is logged and the child's own status stands."""
        # The child outlives several heartbeats, so a check sees the loss while it runs.
        job = dataclasses.replace(job, argv=("sleep", str(5 * HEARTBEAT)), on_lock_lost="ignore")
        thief = TakeAwayOnStart(store, job)
        assert run_in_process(job, lock_for(job, store), log, listeners=[thief]) == 0
        assert named(events, "lock_lost")["action"] == "ignore"
        assert named(events, "finished")["lock_lost"]


class TestStartFailures:
    """A command that cannot be started: 127 not found, 126 not executable."""

    def test_a_missing_command_exits_127(self, job, store, log, events):
        """No such command: exec_failed, exit 127, the lock released."""
        job = dataclasses.replace(job, argv=("jobrun-test-no-such-command",))
        assert run_in_process(job, lock_for(job, store), log) == 127
        assert named(events, "exec_failed")["exit_code"] == 127
        assert "started" not in names(events)
        assert store.held() == {}

    def test_a_file_that_is_not_executable_exits_126(self, job, store, log, events, tmp_path: Path):
        """A file without the execute bit: exec_failed, exit 126."""
        script = tmp_path / "script.sh"
        script.write_text("#!/bin/sh\nexit 0\n")
        script.chmod(0o644)
        job = dataclasses.replace(job, argv=(str(script),))
        assert run_in_process(job, lock_for(job, store), log) == 126
        assert named(events, "exec_failed")["exit_code"] == 126


class TestTimeout:
    """--timeout stops the child: exit 124."""

    def test_a_child_past_its_timeout_is_stopped_with_124(self, job, store, log, events):
        """sleep past --timeout: SIGTERM at the timeout, finished timed_out, exit 124."""
        job = dataclasses.replace(job, argv=FOREVER, timeout=0.5)
        assert run_in_process(job, lock_for(job, store), log) == Exit.TIMED_OUT
        finished = named(events, "finished")
        assert (finished["outcome"], finished["signal"]) == ("timed_out", "SIGTERM")
        # sleep dies of the SIGTERM: stopped at the timeout, long before the SIGKILL.
        assert job.timeout <= finished["duration"] < job.timeout + job.kill_after


class TestStoreDown:
    """The lock store unavailable: exit 69, or the child unguarded with --on-db-error run."""

    def test_a_store_that_is_down_fails_the_run_with_69(self, job, store, log, events):
        """store.down: lockstore_unavailable, exit 69, no child."""
        store.down = True
        assert run_in_process(job, lock_for(job, store), log) == Exit.UNAVAILABLE
        assert named(events, "lockstore_unavailable")["exit_code"] == Exit.UNAVAILABLE
        assert "started" not in names(events)

    def test_on_db_error_run_runs_the_child_unguarded(self, job, store, log, events):
        """store.down with --on-db-error run: the child runs, guarded=False."""
        store.down = True
        job = dataclasses.replace(job, on_db_error="run")
        assert run_in_process(job, lock_for(job, store), log) == 0
        assert named(events, "started")["guarded"] is False


class TestListenerOrder:
    """A listener hears the run's steps in order, ``released`` last."""

    def test_a_run_is_heard_as_started_finished_released(self, job, store, log):
        """Run: started, finished, released (with the run's status)."""
        heard = Recording()
        job = dataclasses.replace(job, argv=("sh", "-c", "exit 3"))
        run_in_process(job, lock_for(job, store), log, listeners=[heard])
        assert heard.heard == ["started", "finished:failed:3:None", "released:3"]

    def test_a_skip_is_heard_as_skipped_then_released(self, job, store, log):
        """Skip: skipped (reason, status), released; never started."""
        assert lock_for(job, store).acquire(0) is None
        heard = Recording()
        run_in_process(job, lock_for(job, store), log, listeners=[heard])
        assert heard.heard == [
            f"skipped:locked:{int(Exit.SKIPPED)}",
            f"released:{int(Exit.SKIPPED)}",
        ]

    def test_an_exec_failure_is_heard_as_not_started(self, job, store, log):
        """Exec failure: not_started (exec_failed, 127), released."""
        heard = Recording()
        job = dataclasses.replace(job, argv=("jobrun-test-no-such-command",))
        run_in_process(job, lock_for(job, store), log, listeners=[heard])
        assert heard.heard == ["not_started:exec_failed:127", "released:127"]

    def test_a_lost_lock_is_heard_after_the_start(self, job, store, log):
        """Lock lost mid-run: started, finished (lock_lost, 76), released."""
        job = dataclasses.replace(job, argv=FOREVER)
        heard = Recording()
        run_in_process(
            job, lock_for(job, store), log, listeners=[TakeAwayOnStart(store, job), heard]
        )
        assert heard.heard == ["started", "finished:lock_lost:76:SIGTERM", "released:76"]


def _is_subreaper() -> bool:
    """Whether orphaned descendants are re-parented to this process (prctl, Linux)."""
    flag = ctypes.c_int(0)
    ctypes.CDLL(None, use_errno=True).prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)
    return bool(flag.value)


#: prctl(2): read whether this process is a subreaper.
_PR_GET_CHILD_SUBREAPER = 37


class TestRunInProcess:
    """Running the runner in the test process leaves the process as it was."""

    @pytest.mark.skipif(not sys.platform.startswith("linux"), reason="prctl is Linux's")
    def test_the_process_is_no_subreaper_after_a_run(self, job, store, log):
        """The runner makes its process a subreaper; run_in_process undoes it."""
        assert run_in_process(job, lock_for(job, store), log) == 0
        assert not _is_subreaper()

    def test_the_wake_up_signal_is_put_back(self, job, store, log):
        """The runner ignores its wake-up signal from then on; run_in_process restores it."""
        previous = signal.signal(supervise.WAKE, signal.SIG_DFL)
        try:
            assert run_in_process(job, lock_for(job, store), log) == 0
            assert signal.getsignal(supervise.WAKE) == signal.SIG_DFL
        finally:
            signal.signal(supervise.WAKE, previous)


def test_no_runner_thread_is_left_behind() -> None:
    """Guard for this module: every heartbeat thread ended with its run."""
    assert [t.name for t in threading.enumerate() if t.name.startswith("jobrun")] == []
