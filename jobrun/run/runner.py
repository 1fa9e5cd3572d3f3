"""One guarded run: acquire (or skip) -> start -> supervise -> finish -> release -> status.

Who else hears of the run (history, output, pings, fence) are listeners composed around
this lifecycle (``jobrun.run.listeners``); ``jobrun.run.assemble`` builds them from the settings.
"""

from __future__ import annotations

import contextlib
import signal
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobrun.exitcodes import (
    Exit,
    Interrupted,
    LockStoreUnavailable,
    interruption,
)
from jobrun.locks import Holder
from jobrun.run import supervise
from jobrun.run.child import ChildRun
from jobrun.run.listeners import HistoryListener, Listeners
from jobrun.run.watchdog import Watchdog

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping, Sequence
    from types import FrameType

    from structlog.typing import FilteringBoundLogger

    from jobrun.db.server_session import ServerSession
    from jobrun.locks import Identity, Lock, Taken
    from jobrun.run.job import Job
    from jobrun.run.listeners import Listener, Recorder
    from jobrun.run.slow import Bound
    from jobrun.run.waiting import WaitReporter


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
    environ: Mapping[str, str] = field(repr=False)  # the job's secrets are in it
    log: FilteringBoundLogger
    history: Recorder
    listeners: Listeners
    waiting: WaitReporter | None
    #: jobrun's exit status, once the run is over.
    status: int | None = None

    def run(self) -> int:
        job = self.job
        if job.jitter > 0:
            self._jitter()  # before any connection: nothing is held while it lasts
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
                child = self._child(warn=self._warn_bound())
                self.status = child.run(child_mask, None, self.listeners.unguarded())
            return self.status
        if isinstance(got, Holder):  # held by someone else: skip
            try:
                return self._skip(got.skip_reason, got.fields())
            finally:
                # The skip's row went over the lock session; a herd of skips must not keep
                # their sessions a moment longer (nothing is held: this only closes it).
                self._release()
        queued = getattr(self.lock, "queued_seconds", None)  # --coalesce
        if queued is not None:
            self.history.note(queued_seconds=queued)
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

    def _jitter(self) -> None:
        """--jitter: sleep the host's delay for the key (or a fresh one) before the lock.

        A signal ends it at once (``interrupted``, child never started); ``jobrun stop``
        cannot reach it (it addresses the key's holder).
        """
        import time  # noqa: PLC0415 - only runs with --jitter

        from jobrun.keys import describe  # noqa: PLC0415
        from jobrun.run import pacing  # noqa: PLC0415

        job = self.job
        delay = pacing.jitter_delay(job.jitter, describe(job.keys), fresh=job.jitter_random)
        self.log.info(
            "jitter", delay=round(delay, 3), jitter=job.jitter, fixed=not job.jitter_random
        )
        self.history.note(jitter_seconds=round(delay, 3))
        time.sleep(delay)

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
            child = self._child(warn=self._warn_bound())
            return child.run(child_mask, watchdog, self.listeners, slot=taken.slot)
        finally:
            watchdog.stop()

    def _consult_history(self) -> int | None:
        """A skip's (or a failure's) exit status when the history says no; None: go on."""
        job = self.job
        try:
            earlier = self.history.acquired(job.once_per)
        except LockStoreUnavailable as exc:  # --once-per cannot be checked, a newer schema
            # Not for a required key this role may not read (not_granted): that is no outage.
            anyway = job.on_db_error == "run" and not exc.fails_closed
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
        unmet = self.history.unmet()  # --requires, decided on the history's start message
        if unmet is not None:
            return self._skip("requirement", unmet)
        return None

    def _warn_bound(self) -> Bound | None:
        """--warn-after: the run's bound (auto: from what the history's start message read)."""
        if self.job.warn_after is None:
            return None
        from jobrun.run import slow  # noqa: PLC0415 - only with --warn-after

        return slow.bound(self.job.warn_after, self.history.recent_durations(), self.log)

    def _skip(self, reason: str, fields: Mapping[str, Any]) -> int:
        """The one way a run skips: say why, tell the listeners, return the skip status."""
        self.log.info("skipped", reason=reason, exit_code=self.job.skip_exit_code, **fields)
        self.listeners.skipped(reason, fields, self.job.skip_exit_code)
        return self.job.skip_exit_code

    def _child(self, warn: Bound | None = None) -> ChildRun:
        """Start -> supervise -> finish: the child's part (``jobrun.run.child``)."""
        history = self.history if self.job.retries else None  # --retries notes attempts
        return ChildRun(
            self.job, self.session, self.identity, self.environ, self.log, warn, history=history
        )

    def _unavailable(self, exc: LockStoreUnavailable, *, ends_run: bool, **fields: bool) -> None:
        """The lock store failed us; ``ends_run``: this is the run's last line (its status)."""
        self.log.error(
            exc.event,
            reason=exc.reason,
            error=str(exc),
            **fields,
            **({"exit_code": exc.exit_code} if ends_run else {}),
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
