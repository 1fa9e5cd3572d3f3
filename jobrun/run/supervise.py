"""The child: spawn it in its own process group, forward signals, enforce deadlines, reap it."""

from __future__ import annotations

import contextlib
import ctypes
import math
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobrun.exitcodes import Exit, JobrunError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping, Sequence

    from structlog.typing import FilteringBoundLogger

    from jobrun.run.watchdog import Watchdog

#: Signals jobrun passes on to the child's process group.
FORWARDED = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
)
#: Sent by the heartbeat thread to the main thread when the lock is gone.
WAKE = signal.SIGRTMIN
WAITED = {*FORWARDED, signal.SIGCHLD, WAKE}

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
#: Longest single sleep of the supervision loop when no deadline is near.
#: WARNING: the child's exit is awaited as SIGCHLD, which the kernel may hand to any thread
#: that does not block it. jobrun's own threads block every signal (jobrun.threads), but
#: a host process's may not (jobrun run in-process, as the tests do): the loop looks at the
#: child at least this often, so a SIGCHLD taken elsewhere costs a second, not an hour.
_IDLE_WAIT = 1.0
#: Poll period while waiting for grandchildren that are not ours to reap.
_GROUP_POLL = 0.05


class ExecFailed(JobrunError):
    """The command could not be started (126: not executable, 127: not found)."""

    event = "exec_failed"

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Ending:
    """How the child's run ended."""

    returncode: int  # Popen convention: negative = killed by that signal
    stopped_for: str | None  # "timed_out", "lock_lost" or "stopped" when jobrun stopped it
    lost_reason: str | None  # why the lock was lost (also with --on-lock-lost ignore)
    duration: float
    #: The last signal passed on to the child (--retries: a job asked to end is not retried).
    forwarded: int | None = None

    @property
    def signal_name(self) -> str | None:
        """The signal that killed the child, by name."""
        if self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"SIG{-self.returncode}"


def _libc_prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    libc = ctypes.CDLL(None, use_errno=True)
    prctl: Callable[..., int] = libc.prctl
    return prctl


@contextlib.contextmanager
def signals_held() -> Iterator[frozenset[int]]:
    """Block the signals we wait for, so none is lost between spawn and wait; yield the old mask.

    WARNING: this must happen before the child is spawned and before any thread starts
    (threads inherit the mask, so every such signal is left for the main thread to take).
    """
    # A wake-up that comes after the supervisor stopped listening must not kill us (the
    # default action of a real-time signal): ignored, it still queues while blocked.
    signal.signal(WAKE, signal.SIG_IGN)
    old = signal.pthread_sigmask(signal.SIG_BLOCK, WAITED)
    try:
        yield frozenset(old)
    finally:
        # Whatever arrived and was not consumed is dropped: the child is gone by now.
        for pending in signal.sigpending() & WAITED:
            signal.sigtimedwait([pending], 0)
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def become_subreaper() -> None:
    """Adopt orphaned descendants so their exit wakes us and we can reap them (Linux)."""
    prctl = _libc_prctl()
    if prctl is not None:
        prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


def spawn(
    argv: Sequence[str],
    env: Mapping[str, str],
    child_mask: frozenset[int],
    *,
    stdio: tuple[int, int] | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``argv`` (no shell) in a new process group that dies with us; raise ExecFailed.

    ``stdio``: descriptors for the child's stdout and stderr (--keep-output's pipes); by
    default it inherits ours.
    """
    # WARNING: the parent-death signal fires when the *thread* that forked the child ends,
    # not the process: a child spawned from a short-lived thread would be SIGKILLed when that
    # thread returned, while jobrun still guards it. Only the main thread, which lives as long
    # as jobrun, may spawn.
    if threading.current_thread() is not threading.main_thread():
        raise RuntimeError("supervise.spawn must be called from the main thread")
    out, err = stdio if stdio is not None else (None, None)
    prctl = _libc_prctl()
    parent = os.getpid()

    def in_child() -> None:
        # Runs between fork and exec, in the child: keep it to async-signal-safe calls.
        os.setpgid(0, 0)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # WARNING: if jobrun died before prctl took effect, nobody will send the
            # signal (the fork -> prctl race): check the parent is still the one that forked us.
            if os.getppid() != parent:
                os.kill(os.getpid(), signal.SIGKILL)
        signal.signal(WAKE, signal.SIG_DFL)  # an ignored signal would stay ignored after exec
        signal.pthread_sigmask(signal.SIG_SETMASK, child_mask)

    try:
        return subprocess.Popen(
            list(argv),
            env=dict(env),
            preexec_fn=in_child,  # noqa: PLW1509 - the fork->exec setup needs it (async-signal-safe calls only)
            stdout=out,
            stderr=err,
        )
    except FileNotFoundError as exc:
        raise ExecFailed(f"{argv[0]}: command not found ({exc.strerror})", Exit.NOT_FOUND) from None
    except PermissionError as exc:
        raise ExecFailed(
            f"{argv[0]}: not executable ({exc.strerror})", Exit.NOT_EXECUTABLE
        ) from None
    except OSError as exc:
        raise ExecFailed(
            f"{argv[0]}: cannot execute ({exc.strerror})", Exit.NOT_EXECUTABLE
        ) from None


def wake_main_thread() -> Callable[[], None]:
    """A callable that interrupts the supervisor's wait from another thread."""
    main = threading.main_thread().ident
    assert main is not None  # noqa: S101 - the main thread is always running here

    def wake() -> None:
        signal.pthread_kill(main, WAKE)

    return wake


class _Group:
    """The child's process group, as far as signals go."""

    def __init__(self, pgid: int) -> None:
        self.pgid = pgid

    def send(self, signum: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pgid, signum)

    def alive(self) -> bool:
        try:
            os.killpg(self.pgid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True


def supervise(
    child: subprocess.Popen[bytes],
    *,
    timeout: float | None,
    kill_after: float,
    watchdog: Watchdog | None,
    terminate_on_lock_lost: bool,
    log: FilteringBoundLogger,
    warn_after: float | None = None,
    on_slow: Callable[[float], None] | None = None,
) -> Ending:
    """Wait for the child, forwarding signals; stop it on timeout or lost lock; reap its group.

    ``warn_after`` (--warn-after): once the child has run this long, ``on_slow(elapsed)``
    is called once, from this loop (it must not block); the child runs on.
    """
    supervision = _Supervision(
        _Group(child.pid),
        timeout=timeout,
        kill_after=kill_after,
        watchdog=watchdog,
        terminate_on_lock_lost=terminate_on_lock_lost,
        log=log,
    )
    if warn_after is not None and on_slow is not None:
        supervision.warn_at = supervision.started + warn_after
        supervision.on_slow = on_slow
    while child.poll() is None:
        supervision.step()
        # What the job daemonized and has exited since: no zombies pile up in a long run.
        _reap_orphans(keep=child.pid)
    _clear_group(
        supervision.group,
        stopping=supervision.stopped_for is not None,
        kill_at=supervision.kill_at,
        kill_after=kill_after,
        log=log,
    )
    return Ending(
        returncode=child.returncode,
        stopped_for=supervision.stopped_for,
        lost_reason=supervision.lost_reason,
        duration=time.monotonic() - supervision.started,
        forwarded=supervision.forwarded,
    )


class _Supervision:
    """The state of one supervision loop: deadlines, and why the child is being stopped."""

    def __init__(
        self,
        group: _Group,
        *,
        timeout: float | None,
        kill_after: float,
        watchdog: Watchdog | None,
        terminate_on_lock_lost: bool,
        log: FilteringBoundLogger,
    ) -> None:
        self.group = group
        self.started = time.monotonic()
        self.timeout = timeout
        self.timeout_at = self.started + timeout if timeout else math.inf
        self.kill_after = kill_after
        self.kill_at = math.inf
        self.watchdog = watchdog
        self.terminate_on_lock_lost = terminate_on_lock_lost
        self.log = log
        self.stopped_for: str | None = None
        self.lost_reason: str | None = None
        #: --warn-after: when the child is slow, and whom to tell (once).
        self.warn_at = math.inf
        self.on_slow: Callable[[float], None] | None = None
        self.forwarded: int | None = None

    def step(self) -> None:
        """Act on whatever deadline has passed, then sleep until the next one or a signal."""
        now = time.monotonic()
        if self.stopped_for is None and now >= self.timeout_at:
            self.log.error("timed_out", timeout=self.timeout, kill_after=self.kill_after)
            self._begin_stop("timed_out")
        if self.stopped_for is None:
            self._check_lock(now)
        if self.stopped_for is None and now >= self.warn_at:
            self.warn_at = math.inf  # once
            if self.on_slow is not None:
                self.on_slow(now - self.started)
        if now >= self.kill_at:
            self.log.warning("child_killed", signal="SIGKILL", after=self.kill_after)
            self.group.send(signal.SIGKILL)
            self.kill_at = math.inf
        deadlines = [self.kill_at]
        if self.stopped_for is None:
            deadlines.append(self.timeout_at)
            deadlines.append(self.warn_at)
            if self.watchdog is not None:
                deadlines.append(self.watchdog.stop_at)
        forwarded = _wait_and_forward(min(min(deadlines) - now, _IDLE_WAIT), self.group, self.log)
        if forwarded is not None:
            self.forwarded = forwarded

    def _check_lock(self, now: float) -> None:
        watchdog = self.watchdog
        if watchdog is None:
            return
        if watchdog.stop_request is not None and watchdog.lost is None:
            # Stopped on request: as for a lost lock, but the lock stays watched meanwhile.
            self.log.warning(
                "stop_requested",
                **{f"requested_by_{name}": value for name, value in watchdog.stop_request.items()},
            )
            self._begin_stop("stopped")
            return
        reason = watchdog.lost
        if reason is None and now >= watchdog.stop_at:
            reason = "the lock could not be confirmed in time (no heartbeat answer)"
        if reason is None:
            return
        self.lost_reason = reason
        self.watchdog = None  # reported once; with "ignore" the child runs on unwatched
        action = "terminate" if self.terminate_on_lock_lost else "ignore"
        self.log.error("lock_lost", reason=reason, action=action)
        if self.terminate_on_lock_lost:
            self._begin_stop("lock_lost")

    def _begin_stop(self, reason: str) -> None:
        self.stopped_for = reason
        self.kill_at = time.monotonic() + self.kill_after
        self.group.send(signal.SIGTERM)


def abort(child: subprocess.Popen[bytes]) -> None:
    """Kill the child's whole group now and reap it: jobrun cannot supervise it any longer.

    For a failure of jobrun itself while the child runs: the lock is released right after,
    so nothing of the job may be left running beside the next run.
    """
    group = _Group(child.pid)
    group.send(signal.SIGKILL)
    with contextlib.suppress(ChildProcessError):
        child.wait()
    deadline = time.monotonic() + 2.0
    while True:
        _reap_orphans()
        if not group.alive() or time.monotonic() >= deadline:
            return
        group.send(signal.SIGKILL)
        time.sleep(_GROUP_POLL)


def linger(seconds: float) -> int | None:
    """Sleep ``seconds`` with the child gone; return early with the signal that ends it."""
    deadline = time.monotonic() + seconds
    while (remaining := deadline - time.monotonic()) > 0:
        info = signal.sigtimedwait(WAITED, remaining)
        if info is not None and info.si_signo in FORWARDED:
            return info.si_signo
    return None


def _wait_and_forward(seconds: float, group: _Group, log: FilteringBoundLogger) -> int | None:
    """Wait for a signal up to ``seconds``; pass one for the child on (returned)."""
    info = signal.sigtimedwait(WAITED, max(0.0, seconds))
    if info is not None and info.si_signo in FORWARDED:
        name = signal.Signals(info.si_signo).name
        log.info("signal_forwarded", signal=name, sender_pid=info.si_pid)
        group.send(info.si_signo)
        return info.si_signo
    return None


#: Processes that one of jobrun's own threads started and reaps itself (a slow run's
#: ``--on-alert`` hook, while the child runs): the orphan reaper leaves them to it, or the
#: thread would find its process gone and take any exit status for 0. A pid is added under
#: the lock together with its fork (``spawning``), so the reaper never sees it unknown.
_SPARED: set[int] = set()
_SPARING = threading.Lock()


@contextlib.contextmanager
def spawning() -> Iterator[Callable[[int], None]]:
    """Hold the reaper off while a thread starts a process; yield how to spare its pid."""
    with _SPARING:
        yield _SPARED.add


def reaped_by_owner(pid: int) -> None:
    """The pid's owner has reaped it: the reaper may take that pid again."""
    with _SPARING:
        _SPARED.discard(pid)


def _reap_orphans(keep: int | None = None) -> None:
    """Collect exited descendants that were re-parented to us (we are their subreaper).

    ``keep`` is left for its owner to reap: the child itself, whose status Popen must see;
    so are the processes jobrun's threads started (``spawning``).
    """
    while True:
        with _SPARING:
            try:
                info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:  # no children at all
                return
            if info is None or info.si_pid == keep or info.si_pid in _SPARED:
                return
            with contextlib.suppress(ChildProcessError):
                os.waitpid(info.si_pid, 0)


def _clear_group(
    group: _Group, *, stopping: bool, kill_at: float, kill_after: float, log: FilteringBoundLogger
) -> None:
    """Make sure nothing of the job outlives it: the lock is released only after this.

    WARNING: what the child left running in its process group would otherwise run on
    unguarded once the lock is released (the next run could start beside it).
    """
    _reap_orphans()
    if not group.alive():
        return
    if not stopping:
        log.warning("leftover_processes", action="SIGTERM", kill_after=kill_after)
        group.send(signal.SIGTERM)
        kill_at = time.monotonic() + kill_after
    elif math.isinf(kill_at):
        # SIGKILL went out already: what is still "alive" cannot be killed (a zombie that
        # is not ours to reap, a process in uninterruptible sleep). Once more, then go on.
        kill_at = time.monotonic()
    for signum in (signal.SIGKILL, None):
        while group.alive() and time.monotonic() < kill_at:
            _wait_and_forward(min(_GROUP_POLL, kill_at - time.monotonic()), group, log)
            _reap_orphans()
        if signum is None or not group.alive():
            return
        group.send(signum)
        kill_at = time.monotonic() + 2.0
