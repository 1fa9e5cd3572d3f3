"""The child's part of a run: start -> supervise -> finish (with the lock held, or not).

``jobrun.run.runner`` owns the lifecycle around it (acquire or skip, consult the history,
release); this module spawns the child in its environment, supervises it under the
watchdog, and tells the listeners how it ended.
"""

from __future__ import annotations

import dataclasses
import signal
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jobrun.exitcodes import Exit, LockLost, from_wait_status
from jobrun.keys import describe
from jobrun.run import supervise

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Mapping

    from structlog.typing import FilteringBoundLogger

    from jobrun.db.server_session import ServerSession
    from jobrun.locks import Identity
    from jobrun.run.job import Job
    from jobrun.run.listeners import Listeners, Recorder
    from jobrun.run.slow import Bound
    from jobrun.run.watchdog import Watchdog


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


@dataclass
class ChildRun:
    """One child's start, supervision and end: under the lock, or unguarded (--on-db-error run)."""

    job: Job
    session: ServerSession
    identity: Identity
    environ: Mapping[str, str]
    log: FilteringBoundLogger
    #: --warn-after: the bound past which the run is slow (None: never).
    warn: Bound | None = None
    #: Where ``--retries`` notes the attempts (None: a run without history, or unguarded).
    history: Recorder | None = None
    #: ``--retries``: each attempt's exit status, once the child is done (else empty).
    attempts: list[int] = dataclasses.field(default_factory=list)

    def run(
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
                **self._slow_watch(listeners),
            )
            if job.retries and guarded:
                retries = _Retries(self, child_mask, env, listeners, watchdog, started)
                try:
                    ending = retries.run(ending)
                finally:
                    if retries.child is not None:
                        child = retries.child  # the one to abort on a bug of jobrun's
            listeners.exited()  # the group is gone: its pipes can be drained
            outcome, status = _outcome(ending)
            # The line first: the history write may take a few seconds on a bad network.
            _log_finished(ending, outcome, status, log, attempts=self.attempts)
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

    def _slow_watch(self, listeners: Listeners) -> dict[str, Any]:
        """--warn-after: the supervisor's bound and what it does past it (one warning)."""
        warn = self.warn
        if warn is None:
            return {}

        def slow(elapsed: float) -> None:
            fields = warn.fields(elapsed)
            self.log.warning("slow_run", **fields, note="the child goes on")
            listeners.slow(fields)

        return {"warn_after": warn.seconds, "on_slow": slow}

    def _not_started(self, listeners: Listeners, reason: str) -> int:
        """The lock is gone before the child could start: it never does."""
        self.log.error("lock_lost", reason=reason, action="not_started")
        self._resume_for_the_end(guarded=True)
        listeners.not_started("lock_lost", int(Exit.LOCK_LOST))
        return int(Exit.LOCK_LOST)

    def _resume_for_the_end(self, *, guarded: bool, hold_until: float | None = None) -> None:
        """Lease mode: the release's connection, opened now, carries the end row too.

        Not when unguarded (no lock), nor across a ``--min-hold`` still to come: nothing is
        held open while we wait. Session mode: nothing to do (the session never rested).
        """
        if guarded and (hold_until is None or hold_until <= time.monotonic()):
            self.session.resume(self.log)
        else:
            # The end row may not carry the release: the lock is still ours during the hold.
            self.session.carried_release.withdraw()


@dataclass
class _Retries:
    """``--retries``: the child again after a failing attempt, under the same lock.

    Each attempt is started and supervised as the first; the pause between two sleeps with
    the lock held and watched (``pacing.pause``). ``--timeout`` bounds the whole run: an
    attempt gets what is left of it, and none starts once it is spent.
    """

    owner: ChildRun
    child_mask: frozenset[int]
    env: dict[str, str]
    listeners: Listeners
    watchdog: Watchdog | None
    started: float
    #: The attempt's child once a retry started (None: still the first).
    child: subprocess.Popen[bytes] | None = None

    def run(self, ending: supervise.Ending) -> supervise.Ending:
        """Try again while the rules allow; the last attempt's ending (whole-run duration)."""
        from jobrun.exitcodes import from_wait_status as status_of  # noqa: PLC0415
        from jobrun.run import pacing  # noqa: PLC0415 - only runs with --retries

        job, log = self.owner.job, self.owner.log
        codes = [status_of(ending.returncode)]
        while pacing.retryable(job, ending, attempts=len(codes)):
            delay = pacing.retry_delay(job.retry_delay, len(codes))
            left = self._left()
            if left is not None and left <= delay:
                log.warning("retry_abandoned", reason="timeout", timeout=job.timeout)
                break
            log.warning(
                "retrying",
                attempt=len(codes) + 1,
                max_attempts=job.retries + 1,
                exit_code=codes[-1],
                delay=round(delay, 3),
            )
            if pacing.pause(delay, self.watchdog, log) is not None:
                break
            try:
                child = supervise.spawn(
                    job.argv, self.env, self.child_mask, stdio=self.listeners.stdio()
                )
            except supervise.ExecFailed as exc:
                attempt = len(codes) + 1
                log.error(exc.event, error=str(exc), exit_code=exc.exit_code, attempt=attempt)
                break
            self.child = child
            log.info("started", command=job.argv[0], child_pid=child.pid, attempt=len(codes) + 1)
            left = self._left()
            ending = supervise.supervise(
                child,
                timeout=None if left is None else max(left, 0.001),
                kill_after=job.kill_after,
                watchdog=self.watchdog,
                terminate_on_lock_lost=job.on_lock_lost == "terminate",
                log=log,
            )
            codes.append(status_of(ending.returncode))
        if self.owner.history is not None:
            self.owner.history.note(attempts=len(codes), attempt_exit_codes=codes)
        self.owner.attempts = codes
        return dataclasses.replace(ending, duration=time.monotonic() - self.started)

    def _left(self) -> float | None:
        """What is left of the whole run's --timeout (None: no timeout)."""
        timeout = self.owner.job.timeout
        return None if timeout is None else self.started + timeout - time.monotonic()


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
    ending: supervise.Ending,
    outcome: str,
    status: int,
    log: FilteringBoundLogger,
    *,
    attempts: list[int],
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
        # --retries: how many attempts, and each one's exit status.
        **({"attempts": len(attempts), "attempt_exit_codes": attempts} if attempts else {}),
    )
