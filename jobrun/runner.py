"""One guarded run: acquire -> spawn -> supervise -> release, returning the exit status."""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from jobrun import supervise
from jobrun.exitcodes import (
    Exit,
    Interrupted,
    LockLost,
    LockStoreUnavailable,
    from_wait_status,
    interruption,
)
from jobrun.history.notify import NoHistory
from jobrun.keys import Key, describe
from jobrun.watchdog import Watchdog

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from types import FrameType

    from structlog.typing import FilteringBoundLogger

    from jobrun.locks import Identity, Lock
    from jobrun.ping import Pinger
    from jobrun.tail import Capture
    from jobrun.waiting import WaitReporter


@dataclass(frozen=True)
class Job:
    """What to run and the rules to run it by (already validated)."""

    argv: tuple[str, ...]
    keys: tuple[Key, ...]
    wait: float = 0.0
    timeout: float | None = None
    kill_after: float = 10.0
    skip_exit_code: int = int(Exit.SKIPPED)
    on_db_error: str = "fail"
    on_lock_lost: str = "terminate"
    heartbeat: float = 1.0
    min_hold: float | None = None
    once_per: float | None = None
    #: jobrun's secret-bearing variables the child (and the hook) may have (``--pass-env``).
    pass_env: tuple[str, ...] = ()


class Recorder(Protocol):
    """Run history and alerts (``jobrun.history``); every method swallows its own failures."""

    def acquired(self, once_per: float | None) -> dict[str, Any] | None:
        """Mark dead runs abandoned; return an earlier run that makes this one redundant."""
        ...

    def paused(self) -> dict[str, object] | None:
        """The pause (``jobrun pause``) of this key in force, as ``paused_*`` fields."""
        ...

    def use_lock_ids(self, lock_ids: list[int]) -> None:
        """Record the run under these lock ids (``--slots``: its slot's)."""
        ...

    def started(self, child_pid: int | None) -> None:
        """The child is running (never waits for the database)."""
        ...

    def finished(
        self,
        outcome: str,
        exit_code: int,
        signal: str | None,
        duration: float,
        *,
        defer_alerts: bool = False,
    ) -> None:
        """The child is done; ``defer_alerts`` keeps the alert hook for ``flush``.

        Called while the lock is still held, so the next run never takes us for a dead one.
        """
        ...

    def skipped(self, reason: str, holder_fields: Mapping[str, Any], exit_code: int) -> None:
        """The run skipped (the lock was held, or an earlier run made it redundant)."""
        ...

    def exec_failed(self, exit_code: int) -> None:
        """The command could not be started."""
        ...

    def flush(self) -> None:
        """Run what was deferred (alert hooks), after the lock is released."""
        ...


def child_environment(
    environ: Mapping[str, str],
    job: Job,
    run_id: str,
    *,
    fence: int | None = None,
    slot: int | None = None,
) -> dict[str, str]:
    """The child's environment: ours plus who it runs as, for its own database sessions.

    Without jobrun's own secret-bearing variables (unless ``--pass-env`` names them), and
    without any inherited value of a variable jobrun sets: a stale ``JOBRUN_FENCE_TOKEN`` is a
    token this run never issued.
    """
    from jobrun.db import application_name  # noqa: PLC0415 - keeps this module light
    from jobrun.masking import SET_FOR_CHILD, passed_on  # noqa: PLC0415

    env = passed_on(environ, job.pass_env)
    for name in SET_FOR_CHILD:
        env.pop(name, None)
    # In the form jobrun reads them back: a nested jobrun without keys of its own takes
    # (tries to take) exactly ours. Names one per line; raw --lock-id keys have none.
    names = [key.name for key in job.keys if key.name is not None]
    if names:
        env["JOBRUN_KEY"] = "\n".join(names)
    env["JOBRUN_LOCK_ID"] = ",".join(str(key.lock_id) for key in job.keys)
    env["JOBRUN_RUN_ID"] = run_id
    if fence is not None:
        env["JOBRUN_FENCE_TOKEN"] = str(fence)
    if slot is not None:
        env["JOBRUN_SLOT"] = str(slot)
    env.setdefault("PGAPPNAME", application_name(describe(job.keys)))
    return env


def run(
    job: Job,
    *,
    lock: Lock,
    identity: Identity,
    environ: Mapping[str, str],
    log: FilteringBoundLogger,
    recorder: Recorder | None = None,
    pinger: Pinger | None = None,
    capture: Capture | None = None,
    fencer: Callable[[], int] | None = None,
    waiting: WaitReporter | None = None,
) -> int:
    """Run ``job`` under ``lock``; every path logs its outcome and returns an exit status.

    Operators' extras, each optional: ``pinger`` (--ping: start and skip pings; the end
    ping is the caller's, after the release), ``capture`` (--keep-output: the child's
    stdout and stderr through pipes), ``fencer`` (--fence: a token for JOBRUN_FENCE_TOKEN),
    ``waiting`` (--wait: lines while the lock is waited for).
    """
    recorder = recorder or NoHistory()
    guarded = _GuardedRun(
        job, lock=lock, identity=identity, environ=environ, log=log, recorder=recorder
    )
    # Operators' extras (--ping, --keep-output, --fence), each optional.
    guarded.pinger, guarded.capture, guarded.fencer = pinger, capture, fencer
    guarded.waiting = waiting
    try:
        with _interruptible():
            return guarded.run()
    except Exception as raised:  # Interrupted, or Interrupted that Python wrapped
        exc = interruption(raised)
        if exc is None:
            raise
        if guarded.status is not None:
            # The signal came after the run was over (the lock already released): the
            # child's status stands.
            return guarded.status
        log.warning("interrupted", signal=signal.Signals(exc.signum).name, child_started=False)
        return exc.exit_code
    finally:
        # Alert hooks run here, after the release: a slow hook never holds the lock.
        recorder.flush()


class _GuardedRun:
    """The steps of one run, sharing the job, the lock and the log."""

    def __init__(
        self,
        job: Job,
        *,
        lock: Lock,
        identity: Identity,
        environ: Mapping[str, str],
        log: FilteringBoundLogger,
        recorder: Recorder,
    ) -> None:
        self.job = job
        self.lock = lock
        self.identity = identity
        self.environ = environ
        self.log = log
        self.recorder = recorder
        #: jobrun's exit status, once the run is over.
        self.status: int | None = None
        # Operators' extras (--ping, --keep-output, --fence), each optional.
        self.pinger: Pinger | None = None
        self.capture: Capture | None = None
        self.fencer: Callable[[], int] | None = None
        #: The fencing token taken for this run (``--fence``), for the child's JOBRUN_FENCE_TOKEN.
        self.fence: int | None = None
        self.waiting: WaitReporter | None = None

    def run(self) -> int:
        job, log = self.job, self.log
        try:
            with self.waiting.around(job.wait) if self.waiting else contextlib.nullcontext():
                holder = self.lock.acquire(job.wait)
        except LockStoreUnavailable as exc:
            # A TLS failure is no outage: the child never runs without its lock then.
            unguarded = job.on_db_error == "run" and not exc.fails_closed
            log.error(
                exc.event,
                reason=exc.reason,
                error=str(exc),
                running_unguarded=unguarded,
                # The run's last line when the child is not started: it carries the exit status.
                **({} if unguarded else {"exit_code": exc.exit_code}),
            )
            if not unguarded:
                return exc.exit_code
            with supervise.signals_held() as child_mask:
                self.status = self._run_child(child_mask, watchdog=None, recorder=NoHistory())
            return self.status
        slot = self.lock.slot_taken() if holder is None else None
        if slot is not None:
            # The history knows the run by its slot's lock id: a run in another slot of the
            # key is alive, not abandoned.
            log.info("slot_taken", slot=slot[0], slot_lock_id=slot[1])
            self.recorder.use_lock_ids([slot[1]])
        if holder is not None:
            log.info("skipped", reason="locked", exit_code=job.skip_exit_code, **holder.fields())
            try:
                self.recorder.skipped("locked", holder.fields(), job.skip_exit_code)
            finally:
                # The skip's row went over the lock session; a herd of skips must not keep
                # their sessions a moment longer (nothing is held: this only closes it).
                self.lock.release()
            if self.pinger is not None:
                self.pinger.skipped("locked", holder.fields())
            return job.skip_exit_code
        try:
            # From here on, signals wait for the supervisor (or are dropped during the release).
            with supervise.signals_held() as child_mask:
                try:
                    self.status = self._run_held(child_mask)
                finally:
                    self.lock.release()
        except BaseException:
            # A signal in the instant between the acquisition and signals_held(): no lock
            # may be left behind (a lease would otherwise stay taken until its TTL).
            self.lock.release()
            raise
        return self.status

    def _run_held(self, child_mask: frozenset[int]) -> int:
        """With the lock taken: consult the history, then run the child, watched throughout."""
        job, log = self.job, self.log
        # WARNING: the lock is watched from the moment it is taken, not only once the child
        # runs: the history may take seconds, and a lock lost meanwhile must keep the child
        # from starting at all (another run may already have it).
        watchdog = Watchdog(
            self.lock,
            interval=job.heartbeat,
            confirmed_at=self.lock.confirmed_at,
            wake=supervise.wake_main_thread(),
            log=log,
        )
        watchdog.start()
        try:
            try:
                earlier = self.recorder.acquired(job.once_per)
            except LockStoreUnavailable as exc:  # --once-per cannot be checked
                checked_anyway = job.on_db_error == "run"
                log.error(
                    exc.event,
                    reason=exc.reason,
                    error=str(exc),
                    running_unguarded=False,
                    running_unchecked=checked_anyway,
                    **({} if checked_anyway else {"exit_code": exc.exit_code}),
                )
                if not checked_anyway:
                    return exc.exit_code
                earlier = None
            pause = self.recorder.paused()
            if pause is not None:
                # Not a streak: the operator asked for these skips.
                log.info("skipped", reason="paused", exit_code=job.skip_exit_code, **pause)
                self.recorder.skipped("paused", pause, job.skip_exit_code)
                if self.pinger is not None:
                    self.pinger.skipped("paused", pause)
                return job.skip_exit_code
            if earlier is not None:
                fields = {f"previous_{name}": value for name, value in earlier.items()}
                log.info("skipped", reason="already_ran", exit_code=job.skip_exit_code, **fields)
                self.recorder.skipped("already_ran", fields, job.skip_exit_code)
                if self.pinger is not None:
                    self.pinger.skipped("already_ran", fields)
                return job.skip_exit_code
            # Lease mode: the attempt's connection carried the history's start (and a skip
            # row): nothing is held while the child runs.
            self.lock.end_loan()
            # --fence: a token taken while the lock is provably held.
            if self.fencer is not None:
                try:
                    token = self.fencer()
                except LockLost as exc:
                    log.error("lock_lost", reason=str(exc), action="not_started")
                    self.recorder.finished("lock_lost", int(Exit.LOCK_LOST), None, 0.0)
                    return int(Exit.LOCK_LOST)
                except LockStoreUnavailable as exc:
                    log.error(
                        exc.event,
                        reason=exc.reason,
                        error=str(exc),
                        fence=True,
                        exit_code=exc.exit_code,
                    )
                    return exc.exit_code
                self.fence = token
            return self._run_child(child_mask, watchdog=watchdog, recorder=self.recorder)
        finally:
            watchdog.stop()

    def _run_child(  # noqa: C901 - --keep-output adds its optional steps
        self, child_mask: frozenset[int], *, watchdog: Watchdog | None, recorder: Recorder
    ) -> int:
        """Spawn and supervise the child under ``watchdog``'s lock (None: unguarded)."""
        job, log = self.job, self.log
        if watchdog is not None:
            lost = watchdog.lost_before_start()
            if lost is not None:
                log.error("lock_lost", reason=lost, action="not_started")
                self._lend_for_the_end(guarded=True)
                recorder.finished("lock_lost", int(Exit.LOCK_LOST), None, 0.0)
                return int(Exit.LOCK_LOST)
        slot = self.lock.slot_taken()
        env = child_environment(
            self.environ,
            job,
            self.identity.run_id,
            fence=self.fence,
            slot=None if slot is None else slot[0],
        )
        supervise.become_subreaper()
        started = time.monotonic()
        capture = self.capture
        stdio = capture.child_fds() if capture is not None else None
        try:
            child = supervise.spawn(job.argv, env, child_mask, stdio=stdio)
        except supervise.ExecFailed as exc:
            if capture is not None:
                capture.close()
            log.error(exc.event, error=str(exc), exit_code=exc.exit_code, command=job.argv[0])
            self._lend_for_the_end(guarded=watchdog is not None)
            recorder.exec_failed(exc.exit_code)
            return exc.exit_code
        if capture is not None:
            capture.begin()
        try:
            guarded = watchdog is not None
            log.info("started", command=job.argv[0], child_pid=child.pid, guarded=guarded)
            recorder.started(child.pid)
            if self.pinger is not None:
                self.pinger.start()
            ending = supervise.supervise(
                child,
                timeout=job.timeout,
                kill_after=job.kill_after,
                watchdog=watchdog,
                terminate_on_lock_lost=job.on_lock_lost == "terminate",
                log=log,
            )
            if capture is not None:  # the group is gone: the pipes can be drained
                capture.finish()
            outcome, status = _outcome(ending)
            # The line first: the history write may take a few seconds on a bad network.
            _log_finished(ending, outcome, status, log)
            hold_until = (
                started + job.min_hold
                if guarded and job.min_hold and outcome != "lock_lost"
                else None
            )
            self._lend_for_the_end(guarded=guarded, hold_until=hold_until)
            recorder.finished(
                outcome, status, ending.signal_name, ending.duration, defer_alerts=True
            )
            if hold_until is not None:
                _hold(hold_until, log)
        except BaseException:
            # WARNING: jobrun itself failed (a bug) while the child may still run: the lock
            # is released next, so the child's group dies first (at most one run, always).
            supervise.abort(child)
            if capture is not None:
                capture.finish()
            raise
        return status

    def _lend_for_the_end(self, *, guarded: bool, hold_until: float | None = None) -> None:
        """Lease mode: the release's connection, opened now, carries the end row too.

        Not when unguarded (no lock), nor across a ``--min-hold`` still to come: nothing is
        held open while we wait. Session mode: nothing to do (the lock session is lent).
        """
        if guarded and (hold_until is None or hold_until <= time.monotonic()):
            self.lock.lend()


def _outcome(ending: supervise.Ending) -> tuple[str, int]:
    """(outcome, jobrun's exit status) for how the child ended."""
    if ending.stopped_for == "timed_out":
        return "timed_out", int(Exit.TIMED_OUT)
    if ending.stopped_for == "lock_lost":
        return "lock_lost", int(Exit.LOCK_LOST)
    if ending.stopped_for == "stopped":
        return "stopped", int(Exit.STOPPED)
    status = from_wait_status(ending.returncode)
    return ("succeeded" if status == 0 else "failed"), status


def _hold(until: float, log: FilteringBoundLogger) -> None:
    """``--min-hold``: keep the lock until ``until`` so hosts with late clocks still skip."""
    remaining = until - time.monotonic()
    if remaining <= 0:
        return
    log.info("holding", seconds=round(remaining, 3), reason="min_hold")
    signum = supervise.linger(remaining)
    if signum is not None:
        log.info("hold_interrupted", signal=signal.Signals(signum).name)


def _log_finished(
    ending: supervise.Ending, outcome: str, status: int, log: FilteringBoundLogger
) -> None:
    emit = (
        log.info
        if outcome == "succeeded"
        else log.warning
        if outcome in {"failed", "stopped"}
        else log.error
    )
    emit(
        "finished",
        outcome=outcome,
        exit_code=status,
        child_exit_code=from_wait_status(ending.returncode),
        signal=ending.signal_name,
        duration=round(ending.duration, 3),
        **({"lock_lost": ending.lost_reason} if ending.lost_reason else {}),
    )


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """Until the child runs, a terminating signal aborts the run cleanly (lock released)."""

    def handler(signum: int, _frame: FrameType | None) -> None:
        raise Interrupted(signum)

    previous = {signum: signal.signal(signum, handler) for signum in supervise.FORWARDED}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, old)
