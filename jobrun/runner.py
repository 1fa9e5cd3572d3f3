"""One guarded run: acquire -> spawn -> supervise -> release, returning the exit status."""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobrun import supervise
from jobrun.exitcodes import Exit, LockStoreUnavailable, from_wait_status
from jobrun.keys import Key, describe
from jobrun.watchdog import Watchdog

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping
    from types import FrameType

    from structlog.typing import FilteringBoundLogger

    from jobrun.locks import Identity, Lock


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


class Interrupted(Exception):
    """A terminating signal arrived before the child started."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def child_environment(environ: Mapping[str, str], job: Job, run_id: str) -> dict[str, str]:
    """The child's environment: ours plus who it runs as, for its own database sessions."""
    from jobrun.db import application_name  # noqa: PLC0415 - keeps this module light

    env = dict(environ)
    env["JOBRUN_KEY"] = describe(job.keys)
    env["JOBRUN_LOCK_ID"] = ",".join(str(key.lock_id) for key in job.keys)
    env["JOBRUN_RUN_ID"] = run_id
    env.setdefault("PGAPPNAME", application_name(describe(job.keys)))
    return env


def run(
    job: Job,
    *,
    lock: Lock,
    identity: Identity,
    environ: Mapping[str, str],
    log: FilteringBoundLogger,
) -> int:
    """Run ``job`` under ``lock``; every path logs its outcome and returns an exit status."""
    try:
        with _interruptible():
            return _run(job, lock=lock, identity=identity, environ=environ, log=log)
    except Interrupted as exc:
        log.warning("interrupted", signal=str(exc), child_started=False)
        return 128 + exc.signum


def _run(
    job: Job,
    *,
    lock: Lock,
    identity: Identity,
    environ: Mapping[str, str],
    log: FilteringBoundLogger,
) -> int:
    try:
        holder = lock.acquire(job.wait)
    except LockStoreUnavailable as exc:
        unguarded = job.on_db_error == "run"
        log.error(exc.event, reason=exc.reason, error=str(exc), running_unguarded=unguarded)
        if not unguarded:
            return exc.exit_code
        with supervise.signals_held() as child_mask:
            return _run_child(job, child_mask, identity=identity, environ=environ, log=log)
    if holder is not None:
        log.info("skipped", reason="locked", exit_code=job.skip_exit_code, **holder.fields())
        return job.skip_exit_code
    # From here on, signals wait for the supervisor (or are dropped during the release).
    with supervise.signals_held() as child_mask:
        try:
            return _run_child(
                job,
                child_mask,
                identity=identity,
                environ=environ,
                log=log,
                lock=lock,
            )
        finally:
            lock.release()


def _run_child(
    job: Job,
    child_mask: frozenset[int],
    *,
    identity: Identity,
    environ: Mapping[str, str],
    log: FilteringBoundLogger,
    lock: Lock | None = None,
) -> int:
    """Spawn and supervise the child under ``lock`` (None: unguarded)."""
    env = child_environment(environ, job, identity.run_id)
    supervise.become_subreaper()
    try:
        child = supervise.spawn(job.argv, env, child_mask)
    except supervise.ExecFailed as exc:
        log.error(exc.event, error=str(exc), exit_code=exc.exit_code, command=job.argv[0])
        return exc.exit_code
    log.info("started", command=job.argv[0], child_pid=child.pid, guarded=lock is not None)
    watchdog = None
    if lock is not None:
        watchdog = Watchdog(
            lock,
            interval=job.heartbeat,
            confirmed_at=lock.confirmed_at,
            wake=supervise.wake_main_thread(),
            log=log,
        )
        watchdog.start()
    try:
        ending = supervise.supervise(
            child,
            timeout=job.timeout,
            kill_after=job.kill_after,
            watchdog=watchdog,
            terminate_on_lock_lost=job.on_lock_lost == "terminate",
            log=log,
        )
    finally:
        if watchdog is not None:
            watchdog.stop()
    return _finish(ending, log)


def _finish(ending: supervise.Ending, log: FilteringBoundLogger) -> int:
    if ending.stopped_for == "timed_out":
        outcome, status = "timed_out", int(Exit.TIMED_OUT)
    elif ending.stopped_for == "lock_lost":
        outcome, status = "lock_lost", int(Exit.LOCK_LOST)
    else:
        status = from_wait_status(ending.returncode)
        outcome = "succeeded" if status == 0 else "failed"
    emit = log.info if outcome == "succeeded" else log.warning if outcome == "failed" else log.error
    emit(
        "finished",
        outcome=outcome,
        exit_code=status,
        child_exit_code=from_wait_status(ending.returncode),
        signal=ending.signal_name,
        duration=round(ending.duration, 3),
        **({"lock_lost": ending.lost_reason} if ending.lost_reason else {}),
    )
    return status


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
