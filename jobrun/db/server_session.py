"""The run's one server session: the run opens it and hands it to the lock, history and fence."""

from __future__ import annotations

import contextlib
import select
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg

from jobrun import db, masking, threads
from jobrun.exitcodes import LockStoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    from structlog.typing import FilteringBoundLogger

    Connection = psycopg.Connection[Any]

#: A use of the session with no answer this long after its own bound: the network is silent
#: (the server would have cancelled the statement), so the session is cut.
SILENCE_GRACE = 2.0


class ServerSession:
    """One autocommit connection, owned by the run, used by one party at a time.

    The lock's statements, its heartbeat, the history's calls and the fencing token all
    go over it, each through ``use``: one at a time (each a message that ends its own
    transaction, so the session is never left idle in a transaction), and a use bounded
    by the caller is cut short when the network goes silent under it.

    ``held`` (session mode): opened by the acquisition, kept until the run closes it; once
    it is gone the lock is gone with it, and it is never reopened. ``keeps`` (lease mode,
    ``--lease-connection kept``, the default): one connection for the whole run, carrying
    the attempt, the history, every heartbeat and the release; a connection that failed is
    reopened by the next heartbeat (``kept``), since a lease does not live in a session.
    Neither (``--lease-connection per-renewal``): the session is open only between two of
    the lock's statements: ``rest`` closes it before the child starts, ``resume`` opens it
    for the run's last statements (the end row and the release), each renewal connects on
    its own, and nothing is held while the child runs. Nothing is held while ``--wait``
    waits, in either lease case. ``lends``: the lease's connections carry the history's
    calls (not with ``--slots``: there each attempt closes its own).
    """

    def __init__(
        self,
        target: db.Target,
        *,
        app_name: str,
        held: bool,
        lends: bool = True,
        keeps: bool = False,
        comment: str = "",
    ) -> None:
        self.target = target
        self.app_name = app_name
        self.held = held
        self.keeps = keeps and not held
        self.lends = lends
        #: Who holds the lock, as a SQL comment on every statement (session mode): a run
        #: finding the lock held names us from pg_stat_activity.query.
        self.comment = comment
        self._conn: Connection | None = None
        self._turn = threading.Lock()
        #: By when each bounded use (in progress or waiting for its turn) must be over.
        self._deadlines: dict[object, float] = {}
        self._guard: threading.Thread | None = None
        self._changed = threading.Condition()
        #: The lock's release, sent with the run's last history message (``CarriedRelease``).
        self.carried_release = CarriedRelease()

    def open(self) -> Connection:
        """The session's connection: the one open (held or kept), or a new one."""
        conn = self.connection()
        if conn is not None and (self.held or self.keeps):
            return conn
        self.close()
        self._conn = _learned(db.connect(self.target, app_name=self.app_name))
        return self._conn

    def connection(self) -> Connection | None:
        """The open connection, if it can still be used."""
        conn = self._conn
        return conn if conn is not None and not conn.closed and not conn.broken else None

    def broken(self) -> bool:
        """Whether a connection was opened and has broken or been closed since (not resting)."""
        conn = self._conn
        return conn is not None and (conn.closed or conn.broken)

    @contextlib.contextmanager
    def use(self, bound: float | None = None) -> Iterator[Connection | None]:
        """The connection for one use (None: there is none), after any other use is over.

        WARNING: each use must end its own transaction (one message of a few statements, as
        ``history.calls`` sends). ``bound``: seconds, counted from now (the wait for the turn
        included), after which a use with no answer cuts the socket: on a silent network
        nothing else would ever end the wait, neither this use's nor the one it waits
        behind. Every use after the cut finds the connection broken, as it must: the lock
        went with it.
        """
        token = object()
        if bound is not None:
            self._arm(token, time.monotonic() + bound)
        try:
            with self._turn:
                yield self.connection()
        finally:
            if bound is not None:
                self._arm(token, None)

    def kept(
        self, bound: float | None = None
    ) -> contextlib.AbstractContextManager[Connection | None]:
        """Lease mode, kept: ``use`` of the run's connection, reopened first if it failed.

        Reconnecting (with the connect deadline and backoff of ``db.connect``) happens
        outside the turn, so a history call is not held up by it; a connection that broke
        again before this use gets None (the caller's check fails, the next one reopens).
        Raises LockStoreUnavailable when no connection can be had.
        """
        if self.connection() is None:
            fresh = _learned(db.connect(self.target, app_name=self.app_name))
            with self._turn:
                spare = self.connection() is not None  # another party reopened it meanwhile
                if not spare:
                    self.close()
                    self._conn = fresh
            if spare:
                fresh.close()
        return self.use(bound)

    def busy(self) -> bool:
        """Whether a use is in progress (its answer is then being read by it, not by us)."""
        if self._turn.acquire(blocking=False):
            self._turn.release()
            return False
        return True

    def pause(self, seconds: float, stop_fd: int) -> None:
        """Sleep up to ``seconds``; wake when ``stop_fd`` is readable or the server talks.

        Session mode: the server says FATAL before it hangs up, so a readable idle socket
        means trouble. A use in progress reads its own answer: then wait for it to end
        (its bound ends it) and go on waiting. Lease mode: nothing to watch.
        """
        deadline = time.monotonic() + max(0.0, seconds)
        while True:
            conn = self.connection() if self.held else None
            if conn is None:
                select.select([stop_fd], [], [], max(0.0, deadline - time.monotonic()))
                return
            ready, _, _ = select.select(
                [stop_fd, conn.fileno()], [], [], max(0.0, deadline - time.monotonic())
            )
            if not ready or stop_fd in ready:
                return
            if not self.busy():
                # No use in progress: the server talks (FATAL), unless a use that has just
                # ended read its own answer between our wake-up and now (then nothing is left
                # to read, and waking the heartbeat would be a spurious check).
                if self.connection() is not conn or _readable(conn):
                    return
                continue
            if self._turn.acquire(timeout=max(0.0, deadline - time.monotonic())):
                self._turn.release()
            if time.monotonic() >= deadline:
                return

    def cut(self) -> None:
        """Shut the socket down under whatever waits on it (a dead network): it fails now."""
        db.cut(self._conn)

    def rest(self) -> None:
        """Lease mode, per renewal: close the connection; nothing is held while the child runs.

        Kept (or held), the connection stays: the heartbeat goes on over it.
        """
        if not self.held and not self.keeps:
            self.close()

    def resume(self, log: FilteringBoundLogger) -> None:
        """Lease mode: the connection for the run's last statements. Never raises.

        Kept, it is reopened only if it failed. Without it, the end row and the release
        connect on their own.
        """
        if self.held or not (self.lends or self.keeps):
            return
        try:
            self.open()
        except (psycopg.Error, LockStoreUnavailable) as exc:
            log.debug("loan_failed", error=db.one_line(exc, self.target))

    def close(self) -> None:
        """Close the connection, if open (the server frees a session's locks with it)."""
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.close()

    def _arm(self, token: object, deadline: float | None) -> None:
        with self._changed:
            if deadline is None:
                self._deadlines.pop(token, None)
            else:
                self._deadlines[token] = deadline
                if self._guard is None:
                    # One guard at a time, awake only while a bounded use is on.
                    # WARNING: started with every signal blocked (threads.start): a SIGCHLD
                    # taken by this thread would never reach the supervisor's wait.
                    self._guard = threads.start(self._watch, name="jobrun-session")
            self._changed.notify()

    def _watch(self) -> None:
        while True:
            with self._changed:
                if not self._deadlines:
                    self._guard = None
                    return
                remaining = min(self._deadlines.values()) - time.monotonic()
                if remaining > 0:
                    self._changed.wait(remaining)
                    continue
                self._deadlines.clear()  # each use past its bound fails with the cut
            self.cut()


@dataclass(frozen=True)
class Release:
    """A lock's release as SQL, to run at the end of the run's last history message."""

    #: Bound SQL, run after the history's statements.
    statements: str
    #: Called once the message went through: the lock is then released.
    done: Callable[[], None]
    #: The history's statements are committed first (BEGIN ... COMMIT around them).
    after_commit: bool = False


class CarriedRelease:
    """The one channel by which a lock's release rides on the run's last history message.

    A run ends with two messages to the server: its end row, then the lock's release. Sent
    as one, they cost one round trip instead of two (a host far from the database pays
    30-150 ms for each). This object, owned by the run's session, is where that happens,
    and the only place:

    - the lock registers its release here once it holds every key (``register``), and
      withdraws it when it must release on its own (``withdraw``: its ``release`` is called
      first, or a ``--min-hold`` keeps the lock past the end row);
    - the history's last call (``history.calls``, ``last=True``) asks for it explicitly
      (``sending``) and appends it to its message; once that message went through, the
      lock is released and ``done`` says so to the lock. A message that failed released
      nothing: the release stays registered, for the call's retry or the lock's own
      ``release``.
    """

    def __init__(self) -> None:
        self._pending: Release | None = None

    def register(
        self, statements: str, done: Callable[[], None], *, after_commit: bool = False
    ) -> None:
        """Let the run's last history message carry this release.

        ``statements`` (bound already) run after the history's; ``done`` is called once that
        message went through. ``after_commit``: the history's statements must be committed
        before ``statements`` run (a session lock is no part of a transaction): the message
        then opens a transaction of its own and commits it.
        """
        self._pending = Release(statements, done, after_commit)

    def withdraw(self) -> None:
        """No history message may carry the release any more: the lock sends it itself."""
        self._pending = None

    @contextlib.contextmanager
    def kept(self) -> Iterator[None]:
        """The release registered now stays so while another lock of the session lets go.

        (``--coalesce``: the queue slot, released once the key is held, must not withdraw
        the key's own release from the run's last message.)
        """
        pending = self._pending
        try:
            yield
        finally:
            self._pending = pending

    @contextlib.contextmanager
    def sending(self) -> Iterator[Release | None]:
        """The release to append to one message (None: none registered).

        Taken for the message's time: the block ends without an exception once the message
        went through (the release is then done and gone); after an exception nothing was
        released, and it is put back.
        """
        release, self._pending = self._pending, None
        try:
            yield release
        except BaseException:
            if release is not None:
                self._pending = release
            raise
        if release is not None:
            release.done()


def _learned(conn: Connection) -> Connection:
    """``conn``, its password now masked wherever jobrun masks (kept output, pings, the hook).

    PQpass is the password libpq took, whatever its source (the DSN, PGPASSWORD, a service
    file, the password file): the run's first connection comes before its child, so every
    tail kept is masked with it.
    """
    info = conn.info
    masking.learn(info.password, info.user)
    return conn


def _readable(conn: Connection) -> bool:
    """Whether ``conn``'s socket has something to read right now (or is gone: then True)."""
    try:
        ready, _, _ = select.select([conn.fileno()], [], [], 0)
    except (psycopg.Error, OSError, ValueError):
        return True
    return bool(ready)
