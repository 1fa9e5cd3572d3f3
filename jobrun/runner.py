"""One guarded run: acquire (or skip) -> start -> supervise -> finish -> release -> status.

Who else hears of the run (history, output, pings, fence) are listeners composed around
this lifecycle (``jobrun.listeners``); ``jobrun.assemble`` builds them from the settings.
"""

from __future__ import annotations

import contextlib
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobrun import supervise
from jobrun.exitcodes import (
    Exit,
    Interrupted,
    LockLost,
    LockStoreUnavailable,
    from_wait_status,
    interruption,
)
from jobrun.keys import Key, describe
from jobrun.listeners import HistoryListener, Listeners
from jobrun.locks import Holder
from jobrun.watchdog import Watchdog

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence
    from types import FrameType

    from structlog.typing import FilteringBoundLogger

    from jobrun.listeners import Listener, Recorder
    from jobrun.locks import Identity, Lock, Taken
    from jobrun.session import ServerSession
    from jobrun.waiting import WaitReporter


@dataclass(frozen=True)
class Job:
    """What to run and the rules to run it by (validated; the defaults are the options')."""

    argv: tuple[str, ...]
    keys: tuple[Key, ...]
    wait: float
    timeout: float | None
    kill_after: float
    skip_exit_code: int
    on_db_error: str
    on_lock_lost: str
    heartbeat: float
    min_hold: float | None
    once_per: float | None
    #: jobrun's secret-bearing variables the child (and the hook) may have (``--pass-env``).
    pass_env: tuple[str, ...]


def child_environment(
    environ: Mapping[str, str],
    job: Job,
    run_id: str,
    *,
    slot: int | None = None,
) -> dict[str, str]:
    """The child's environment: ours plus who it runs as, for its own database sessions.

    Without jobrun's own secret-bearing variables (unless ``--pass-env`` names them), and
    without any inherited value of a variable jobrun sets: a stale ``JOBRUN_FENCE_TOKEN`` is a
    token this run never issued (``--fence`` adds the run's own: ``Listener.preparing``).
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
    if slot is not None:
        env["JOBRUN_SLOT"] = str(slot)
    env.setdefault("PGAPPNAME", application_name(describe(job.keys)))
    return env


def run(
    job: Job,
    *,
    lock: Lock,
    session: ServerSession,
    identity: Identity,
    environ: Mapping[str, str],
    log: FilteringBoundLogger,
    history: Recorder,
    listeners: Sequence[Listener] = (),
    waiting: WaitReporter | None = None,
) -> int:
    """Run ``job`` under ``lock``; every path logs its outcome and returns an exit status.

    ``session`` is the run's one server session (the lock's, the history's, the fence's):
    closed here once the lock is released.

    ``history`` is asked before the child starts (``--once-per``, a pause) and hears of
    each step first, then ``listeners`` (``--keep-output``, ``--ping``, ``--fence``) in
    their order; ``waiting`` (``--wait``) says lines while the lock is waited for.
    """
    told = Listeners([HistoryListener(history), *listeners])
    guarded = _GuardedRun(job, lock, session, identity, environ, log, history, told, waiting)
    status = int(Exit.INTERNAL)  # unless a status comes back: a bug in jobrun
    try:
        with _interruptible():
            status = guarded.run()
    except Exception as raised:  # Interrupted, or Interrupted that Python wrapped
        exc = interruption(raised)
        if exc is None:
            raise
        if guarded.status is None:
            log.warning("interrupted", signal=signal.Signals(exc.signum).name, child_started=False)
        # A signal after the run was over (the lock already released): the child's status stands.
        status = exc.exit_code if guarded.status is None else guarded.status
    finally:
        # Alert hooks, kept output, the end ping: after the release, never holding the lock.
        told.released(status)
    return status


@dataclass
class _GuardedRun:
    """The steps of one run, sharing its job, lock, session, log and listeners."""

    job: Job
    lock: Lock
    session: ServerSession
    identity: Identity
    environ: Mapping[str, str]
    log: FilteringBoundLogger
    history: Recorder
    listeners: Listeners
    waiting: WaitReporter | None
    #: jobrun's exit status, once the run is over.
    status: int | None = None

    def run(self) -> int:
        job = self.job
        try:
            with self.waiting.around(job.wait) if self.waiting else contextlib.nullcontext():
                got = self.lock.acquire(job.wait)
        except LockStoreUnavailable as exc:
            # A TLS failure is no outage: the child never runs without its lock then.
            unguarded = job.on_db_error == "run" and not exc.fails_closed
            self._unavailable(exc, ends_run=not unguarded, running_unguarded=unguarded)
            self.session.close()
            if not unguarded:
                return exc.exit_code
            with supervise.signals_held() as child_mask:
                self.status = self._run_child(child_mask, None, self.listeners.unguarded())
            return self.status
        if isinstance(got, Holder):  # held by someone else: skip
            try:
                return self._skip("locked", got.fields())
            finally:
                # The skip's row went over the lock session; a herd of skips must not keep
                # their sessions a moment longer (nothing is held: this only closes it).
                self._release()
        slot = got.slot
        if slot is not None:
            # The history knows the run by its slot's lock id: a run in another slot of the
            # key is alive, not abandoned.
            self.log.info("slot_taken", slot=slot[0], slot_lock_id=slot[1])
            self.history.use_lock_ids([slot[1]])
        try:
            # From here on, signals wait for the supervisor (or are dropped during the release).
            with supervise.signals_held() as child_mask:
                try:
                    self.status = self._run_held(child_mask, got)
                finally:
                    self._release()
        except BaseException:
            # A signal in the instant between the acquisition and signals_held(): no lock
            # may be left behind (a lease would otherwise stay taken until its TTL).
            self._release()
            raise
        return self.status

    def _release(self) -> None:
        """Give the lock back, then close the run's session (session mode: the lock's)."""
        try:
            self.lock.release()
        finally:
            self.session.close()

    def _run_held(self, child_mask: frozenset[int], taken: Taken) -> int:
        """With the lock taken: consult the history, then run the child, watched throughout."""
        # WARNING: the lock is watched from the moment it is taken, not only once the child
        # runs: the history may take seconds, and a lock lost meanwhile must keep the child
        # from starting at all (another run may already have it).
        watchdog = Watchdog(
            self.lock,
            self.session,
            interval=self.job.heartbeat,
            confirmed_at=taken.confirmed_at,
            wake=supervise.wake_main_thread(),
            log=self.log,
        )
        watchdog.start()
        try:
            refused = self._consult_history()
            if refused is not None:
                return refused
            # Lease mode: the attempt's connection carried the history's start (and a skip
            # row): nothing is held while the child runs.
            self.session.rest()
            return self._run_child(child_mask, watchdog, self.listeners, slot=taken.slot)
        finally:
            watchdog.stop()

    def _consult_history(self) -> int | None:
        """A skip's (or a failure's) exit status when the history says no; None: go on."""
        job = self.job
        try:
            earlier = self.history.acquired(job.once_per)
        except LockStoreUnavailable as exc:  # --once-per cannot be checked
            anyway = job.on_db_error == "run"
            self._unavailable(
                exc, ends_run=not anyway, running_unguarded=False, running_unchecked=anyway
            )
            if not anyway:
                return exc.exit_code
            earlier = None
        pause = self.history.paused()
        if pause is not None:
            return self._skip("paused", pause)  # not a streak: the operator asked for it
        if earlier is not None:
            return self._skip("already_ran", {f"previous_{k}": v for k, v in earlier.items()})
        return None

    def _skip(self, reason: str, fields: Mapping[str, Any]) -> int:
        """The one way a run skips: say why, tell the listeners, return the skip status."""
        self.log.info("skipped", reason=reason, exit_code=self.job.skip_exit_code, **fields)
        self.listeners.skipped(reason, fields, self.job.skip_exit_code)
        return self.job.skip_exit_code

    def _run_child(
        self,
        child_mask: frozenset[int],
        watchdog: Watchdog | None,
        listeners: Listeners,
        *,
        slot: tuple[int, int] | None = None,
    ) -> int:
        """Spawn and supervise the child under ``watchdog``'s lock (None: unguarded).

        ``slot``: the ``--slots`` slot taken (``Taken.slot``; None without one or a lock).
        """
        job, log, guarded = self.job, self.log, watchdog is not None
        env = child_environment(
            self.environ, job, self.identity.run_id, slot=None if slot is None else slot[0]
        )
        try:
            refused = listeners.preparing(env)  # --fence: a token while the lock is held
        except LockLost as exc:
            return self._not_started(listeners, str(exc))
        lost = watchdog.lost_before_start() if watchdog is not None else None
        if refused is not None or lost is not None:
            return refused if refused is not None else self._not_started(listeners, str(lost))
        supervise.become_subreaper()
        started = time.monotonic()
        try:
            child = supervise.spawn(job.argv, env, child_mask, stdio=listeners.stdio())
        except supervise.ExecFailed as exc:
            log.error(exc.event, error=str(exc), exit_code=exc.exit_code, command=job.argv[0])
            self._resume_for_the_end(guarded=guarded)
            listeners.not_started("exec_failed", exc.exit_code)
            return exc.exit_code
        try:
            log.info("started", command=job.argv[0], child_pid=child.pid, guarded=guarded)
            listeners.started(child.pid)
            ending = supervise.supervise(
                child,
                timeout=job.timeout,
                kill_after=job.kill_after,
                watchdog=watchdog,
                terminate_on_lock_lost=job.on_lock_lost == "terminate",
                log=log,
            )
            listeners.exited()  # the group is gone: its pipes can be drained
            outcome, status = _outcome(ending)
            # The line first: the history write may take a few seconds on a bad network.
            _log_finished(ending, outcome, status, log)
            held = guarded and job.min_hold and outcome != "lock_lost"
            hold_until = started + job.min_hold if held and job.min_hold else None
            self._resume_for_the_end(guarded=guarded, hold_until=hold_until)
            listeners.finished(outcome, status, ending.signal_name, ending.duration)
            if hold_until is not None:
                _hold(hold_until, log)
        except BaseException:
            # WARNING: jobrun itself failed (a bug) while the child may still run: the lock
            # is released next, so the child's group dies first (at most one run, always).
            supervise.abort(child)
            listeners.exited()
            raise
        return status

    def _not_started(self, listeners: Listeners, reason: str) -> int:
        """The lock is gone before the child could start: it never does."""
        self.log.error("lock_lost", reason=reason, action="not_started")
        self._resume_for_the_end(guarded=True)
        listeners.not_started("lock_lost", int(Exit.LOCK_LOST))
        return int(Exit.LOCK_LOST)

    def _unavailable(self, exc: LockStoreUnavailable, *, ends_run: bool, **fields: bool) -> None:
        """The lock store failed us; ``ends_run``: this is the run's last line (its status)."""
        self.log.error(
            exc.event,
            reason=exc.reason,
            error=str(exc),
            **fields,
            **({"exit_code": exc.exit_code} if ends_run else {}),
        )

    def _resume_for_the_end(self, *, guarded: bool, hold_until: float | None = None) -> None:
        """Lease mode: the release's connection, opened now, carries the end row too.

        Not when unguarded (no lock), nor across a ``--min-hold`` still to come: nothing is
        held open while we wait. Session mode: nothing to do (the session never rested).
        """
        if guarded and (hold_until is None or hold_until <= time.monotonic()):
            self.session.resume(self.log)
        else:
            # The end row may not carry the release: the lock is still ours during the hold.
            self.session.end_with(None)


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
