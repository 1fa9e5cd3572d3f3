"""A Lock that lives in this process, for fast tests: no server, the Protocol of the real modes.

Two ``MemoryLock`` over one ``MemoryStore`` contend as two runs on one database would; the
store can take a lock away (``take_away``) or be down (``down = True``), so ``check`` and
``acquire`` fail the way the real modes do. tests/test_lock_contract.py runs the same tests
over this lock and the real ones, so it cannot drift from them.
"""

from __future__ import annotations

import ctypes
import os
import pickle
import select
import signal
import threading
import time
import traceback
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from jobrun import db
from jobrun.db.server_session import ServerSession
from jobrun.exitcodes import LockLost, LockStoreUnavailable
from jobrun.keys import describe
from jobrun.locks import Holder, Identity, Taken, new_run_id

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from structlog.typing import FilteringBoundLogger

    from jobrun.keys import Key
    from jobrun.run.job import Job
    from jobrun.run.listeners import Listener

T = TypeVar("T")

#: How a memory lock says it holds a key (``Holder.mode``).
MODE = "memory"


@dataclass(frozen=True)
class _Held:
    """One key's holder in the store: which lock object, and who it runs as."""

    owner: object
    label: str
    identity: Identity


class MemoryStore:
    """The shared "database": lock id -> holder, guarded by one ``threading.Lock``."""

    def __init__(self) -> None:
        self._changed = threading.Condition(threading.Lock())
        self._held: dict[int, _Held] = {}
        #: True: every acquire and check raises LockStoreUnavailable (the server is gone).
        self.down = False

    def take_away(self, lock_id: int) -> None:
        """Free ``lock_id`` under its holder's feet (a terminated backend, a deleted lease)."""
        with self._changed:
            self._held.pop(lock_id, None)
            self._changed.notify_all()

    def held(self) -> dict[int, str]:
        """Lock id -> the run id holding it, as ``status`` would list them."""
        with self._changed:
            return {lock_id: held.identity.run_id for lock_id, held in self._held.items()}

    def _unavailable(self) -> None:
        if self.down:
            raise LockStoreUnavailable("the memory lock store is down", reason="unreachable")

    def take(
        self, owner: object, keys: tuple[Key, ...], identity: Identity, wait: float
    ) -> _Held | None:
        """Every key for ``owner`` (None), or the first one's holder once ``wait`` is over."""
        deadline = time.monotonic() + wait
        with self._changed:
            while True:
                self._unavailable()
                blocker = next(
                    (
                        held
                        for key in keys
                        if (held := self._held.get(key.lock_id)) is not None
                        and held.owner is not owner
                    ),
                    None,
                )
                if blocker is None:
                    for key in keys:
                        self._held[key.lock_id] = _Held(owner, key.label, identity)
                    return None
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return blocker
                self._changed.wait(remaining)

    def still_held(self, owner: object, keys: tuple[Key, ...]) -> int:
        """How many of ``keys`` ``owner`` still holds (down: LockStoreUnavailable)."""
        with self._changed:
            self._unavailable()
            return sum(
                1
                for key in keys
                if (held := self._held.get(key.lock_id)) is not None and held.owner is owner
            )

    def free(self, owner: object, keys: tuple[Key, ...]) -> None:
        """Free those of ``keys`` ``owner`` still holds (never another's)."""
        with self._changed:
            for key in keys:
                held = self._held.get(key.lock_id)
                if held is not None and held.owner is owner:
                    del self._held[key.lock_id]
            self._changed.notify_all()


class MemoryLock:
    """``keys`` taken all or none in ``store``; the ``Lock`` Protocol of ``jobrun.locks``."""

    def __init__(
        self,
        keys: tuple[Key, ...],
        store: MemoryStore,
        identity: Identity | None = None,
        *,
        lifetime: float = 10.0,
    ) -> None:
        self._keys = keys
        self._store = store
        #: Who the lock runs as (a run's identity: its run id names it as a holder).
        self.identity = identity or Identity(run_id=new_run_id(), pid=os.getpid())
        self.confirmation_lifetime = lifetime

    def acquire(self, wait: float) -> Taken | Holder:
        """Take every key (``Taken``) or none (the first key's holder), waiting up to ``wait``."""
        blocker = self._store.take(self, self._keys, self.identity, wait)
        if blocker is None:
            return Taken(time.monotonic())
        who = blocker.identity
        return Holder(
            key=blocker.label,
            mode=MODE,
            host=who.host,
            pid=who.pid,
            run_id=who.run_id,
            since=who.started.isoformat(timespec="seconds"),
        )

    def check(self) -> dict[str, object] | None:
        """Still ours: every key held by this lock; else LockLost (down: unavailable).

        No ``jobrun stop`` request ever reaches a memory lock: None.
        """
        ours = self._store.still_held(self, self._keys)
        if ours != len(self._keys):
            raise LockLost(
                f"the memory lock on {describe(self._keys)} was taken away"
                f" ({ours} of {len(self._keys)} still ours)"
            )
        return None

    def known_lost(self) -> str | None:
        """As a lease: a loss shows only when checked."""
        return None

    def release(self) -> None:
        """Free the keys still ours (never another's); never raises, even when down."""
        self._store.free(self, self._keys)


def serverless_session() -> ServerSession:
    """A run's session that is never opened: what the runner closes and rests around a memory lock.

    Not held and lending nothing, so the runner's ``rest``/``resume``/``close`` and the
    watchdog's pauses never connect.
    """
    return ServerSession(db.Target(dsn=""), app_name="jobrun:memory", held=False, lends=False)


def run_in_process(
    job: Job,
    lock: MemoryLock,
    log: FilteringBoundLogger,
    *,
    listeners: Sequence[Listener] = (),
    environ: Mapping[str, str] | None = None,
) -> int:
    """``runner.run`` in this process: ``lock``, no server, no history; its exit status.

    What assembly would add around the runner is left out: a session that is never opened,
    a history that records nothing. WARNING: the runner leaves its process a subreaper and
    its wake-up signal ignored (a run's process exits next); a test process runs on, so
    both are put back here.
    """
    from jobrun.run import runner, supervise  # noqa: PLC0415 - heavy for an import of the lock
    from jobrun.run.notify import NoHistory  # noqa: PLC0415

    wake = signal.getsignal(supervise.WAKE)
    try:
        return runner.run(
            job,
            lock=lock,
            session=serverless_session(),
            identity=lock.identity,
            environ=dict(os.environ if environ is None else environ),
            log=log,
            history=NoHistory(),
            listeners=listeners,
        )
    finally:
        signal.signal(supervise.WAKE, wake)
        _no_longer_subreaper()


def _no_longer_subreaper() -> None:
    """Orphans go to init again, not to this process (Linux; elsewhere there is nothing to undo)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return
    prctl = getattr(libc, "prctl", None)
    if prctl is not None:
        prctl(_PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


#: prctl(2): whether orphaned descendants are re-parented to this process.
_PR_SET_CHILD_SUBREAPER = 36


def forked(work: Callable[[], T], *, timeout: float) -> T:
    """``work()`` in a fork of this process with one thread; its (picklable) result here.

    WARNING: the runner waits for the child's exit signal in its main thread with every
    thread blocking it; a test process may run threads of its own (pytest-xdist's channel)
    that would take the signal instead, and the run would not see its child end. A fork
    has the forking thread alone. ``timeout``: seconds after which the fork is killed (its
    child dies with it) and TimeoutError raised.
    """
    read_fd, write_fd = os.pipe()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # a fork of a threaded process
        pid = os.fork()
    if pid == 0:  # pragma: no cover - the fork reports over the pipe, then vanishes
        os.close(read_fd)
        try:
            payload = pickle.dumps((True, work()))
        except BaseException as exc:  # noqa: BLE001 - every failure goes back to the test
            payload = pickle.dumps((False, "".join(traceback.format_exception(exc))))
        with os.fdopen(write_fd, "wb") as out:
            out.write(payload)
        os._exit(0)
    os.close(write_fd)
    deadline = time.monotonic() + timeout
    chunks = []
    with os.fdopen(read_fd, "rb") as answer:
        while True:
            ready, _, _ = select.select([answer], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                msg = f"the fork did not answer within {timeout} s"
                raise TimeoutError(msg)
            chunk = os.read(answer.fileno(), 65536)
            if not chunk:
                break
            chunks.append(chunk)
    os.waitpid(pid, 0)
    ok, value = pickle.loads(b"".join(chunks))  # noqa: S301 - our own fork's answer
    if not ok:
        msg = f"the fork failed:\n{value}"
        raise AssertionError(msg)
    return value  # type: ignore[no-any-return]
