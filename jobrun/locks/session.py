"""Session mode: ``pg_try_advisory_lock`` on the run's server session, held for the child's life."""

from __future__ import annotations

import contextlib
import json
import math
import re
import time
from typing import TYPE_CHECKING

import psycopg
from psycopg import errors

from jobrun import db, sql
from jobrun.exitcodes import LockLost, LockStoreUnavailable
from jobrun.keys import Key, describe
from jobrun.locks import Holder, Identity
from jobrun.locks.stops import StopProbe, bounded_row, lock_wait

if TYPE_CHECKING:
    from collections.abc import Sequence

    from structlog.typing import FilteringBoundLogger

    from jobrun.session import ServerSession

#: Without a successful check for this long, we no longer vouch for the session: a cut
#: network must be noticed well within 15 seconds (the kernel's tcp_user_timeout matches).
CONFIRMATION_LIFETIME = 10.0

#: Longest single blocking wait for a key (lock_timeout's limit is about 24.8 days).
_WAIT_SLICE = 86400.0

_ANNOUNCEMENT = re.compile(r"/\* jobrun-holder (\{[^*]*\}) \*/")


def holder_comment(identity: Identity) -> str:
    """Who holds the lock, as the SQL comment every statement on the lock session starts with.

    A run that finds the lock held names us from pg_stat_activity.query (host, pid, run id,
    since).
    """
    announcement = json.dumps(
        {
            "host": identity.host,
            "pid": identity.pid,
            "run_id": identity.run_id,
            "since": identity.started.isoformat(timespec="seconds"),
        },
        ensure_ascii=True,
    ).replace("*", "")
    return f"/* jobrun-holder {announcement} */ "


class SessionLock:
    """Advisory locks on the run's server session; the server frees them when it ends.

    The session is the run's (``jobrun.session``): opened here, closed by the run after
    ``release``; every statement on it carries ``session.comment``.
    """

    def __init__(
        self,
        keys: tuple[Key, ...],
        session: ServerSession,
        identity: Identity,
        log: FilteringBoundLogger,
        *,
        heartbeat: float,
        kill_after: float,
    ) -> None:
        # A slow heartbeat stretches the window: it must not stop a healthy job between checks.
        self.confirmation_lifetime = max(CONFIRMATION_LIFETIME, 3 * heartbeat)
        self._lock_wait = lock_wait(heartbeat)
        # WARNING: the server must notice a vanished host (with the OS defaults it keeps a
        # half-open connection, and so the lock, for about 2 h), but only after we would have
        # SIGKILLed the child on our side of a partition: its keepalives start after
        # lifetime + kill-after + slack.
        self._server_keepalive_idle = math.ceil(self.confirmation_lifetime + kill_after + 5)
        self._keys = keys
        self._session = session
        self._target = session.target
        self._log = log
        self._held: list[Key] = []
        self._comment = session.comment
        self._app_name = session.app_name
        self.confirmed_at = 0.0
        self._run_id = identity.run_id
        #: A stop request counts only if it names one of these (the label or a key's).
        self._stop_keys = list(dict.fromkeys([describe(keys), *(key.label for key in keys)]))
        #: A ``jobrun stop`` request for this run (who asked, why), once the heartbeat saw one.
        self.stop_request: dict[str, object] | None = None
        self._stop_probe = StopProbe(log, lambda exc: db.one_line(exc, self._target))
        #: No slots here (``slots.SlotLock`` has them).
        self.slot: tuple[int, int] | None = None

    def acquire(self, wait: float) -> Holder | None:
        """Take every key in ascending lock-id order, or none (then say who holds one)."""
        conn = self._session.open()
        try:
            with db.translate_errors(self._target, "preparing the lock session"):
                immune = (
                    sql.SESSION_IMMUNE_14
                    if conn.info.server_version >= 140000  # noqa: PLR2004 - PostgreSQL 14
                    else sql.SESSION_IMMUNE
                )
                setup = conn.execute(
                    immune + sql.SESSION_SETUP.format(idle=self._server_keepalive_idle)
                )
                while setup.nextset():  # the SETs come first; the row is the last result
                    pass
                row = setup.fetchone()
                standby, backend = (bool(row[3]), int(str(row[4]))) if row else (False, 0)
                pooler = (
                    None
                    if standby
                    else db.detect_transaction_pooler(
                        conn, self._target, app_name=self._app_name, backend=backend
                    )
                )
            if standby:
                _refuse_standby()
            if pooler:
                _refuse_pooler(pooler)
            with db.translate_errors(self._target, "taking the advisory lock"):
                blocked = self._take_all(conn, wait)
                if blocked is None:
                    leased = self._leased(conn)
                    if leased is None:
                        self.confirmed_at = time.monotonic()
                        return None
                    self._unlock_taken(conn)
                    return leased
                self._unlock_taken(conn)
                # The session stays open for the skip's history row (one session per skip);
                # the run closes it right after.
                return self._holder_of(conn, blocked)
        except BaseException:
            self._session.close()
            raise

    def _take_all(self, conn: psycopg.Connection[tuple[object, ...]], wait: float) -> Key | None:
        deadline = time.monotonic() + wait
        for key in self._keys:
            if not self._wait_for(conn, key, deadline):
                row = conn.execute(self._comment + sql.TRY_LOCK, (key.lock_id,)).fetchone()
                if not (row and row[0]):
                    return key
            self._held.append(key)
        return None

    def _wait_for(
        self, conn: psycopg.Connection[tuple[object, ...]], key: Key, deadline: float
    ) -> bool:
        """Block until ``key`` is ours (True) or ``deadline`` has passed (False).

        A bounded blocking wait: the server hands the lock over the moment it is freed.
        Waiting in ascending id order cannot deadlock with other jobruns.
        """
        while (remaining := deadline - time.monotonic()) * 1000 >= 1:
            # lock_timeout takes at most INT_MAX ms (24.8 days): a longer --wait takes turns.
            timeout_ms = int(min(remaining, _WAIT_SLICE) * 1000)
            conn.execute(sql.SET_LOCK_TIMEOUT, (f"{timeout_ms}ms",))
            try:
                conn.execute(self._comment + sql.LOCK, (key.lock_id,))
            except errors.LockNotAvailable:
                conn.execute(sql.SET_LOCK_TIMEOUT, ("0",))
                continue
            # Not in a finally: after any other exception (a signal mid-wait) the
            # connection is still busy, and the error raised must be that one.
            conn.execute(sql.SET_LOCK_TIMEOUT, ("0",))
            return True
        return False

    def _leased(self, conn: psycopg.Connection[tuple[object, ...]]) -> Holder | None:
        """The lease-mode run holding one of our keys, if any (checked once ours are taken).

        WARNING: the two modes must exclude each other (a fleet moving from one mode to the
        other runs both): lease mode takes a transaction lock on the same ids as it writes
        its lease, so a lease written before our locks were granted is visible here.
        """
        try:
            # With the comment, as every statement here: the session's last query names us.
            row = conn.execute(
                self._comment + sql.SESSION_LEASED, ([key.lock_id for key in self._keys],)
            ).fetchone()
        except errors.UndefinedTable:  # lease mode never ran in this database
            return None
        except errors.InsufficientPrivilege as exc:
            # A role that cannot read the leases cannot hold one either: only a host running
            # lease mode as another role could be missed. Say so, and go on.
            self._log.warning(
                "lease_check_failed",
                error=db.one_line(exc, self._target),
                note="lease-mode runs of this key (by other roles) cannot be seen",
            )
            return None
        if row is None:
            return None
        label, owner, host, pid, acquired_at, expires_at = row
        return Holder(
            key=str(label),
            host=_str_or_none(host),
            pid=_int_or_none(pid),
            run_id=_str_or_none(owner),
            since=acquired_at.isoformat(timespec="seconds") if acquired_at else None,  # type: ignore[attr-defined]
            expires_at=expires_at.isoformat(timespec="seconds") if expires_at else None,  # type: ignore[attr-defined]
        )

    def _holder_of(self, conn: psycopg.Connection[tuple[object, ...]], key: Key) -> Holder:
        classid, objid = key.pg_locks_pair
        row = conn.execute(sql.ADVISORY_HOLDER, (classid, objid)).fetchone()
        if row is None:  # released between our attempt and this query
            return Holder(key=key.label)
        return session_holder(key.label, row)

    def check(self) -> None:
        """Prove the session is alive and its backend still holds every key.

        The same statement reads a ``jobrun stop`` request for this run, where it can.
        """
        held = [key.lock_id for key in self._held]
        with self._session.use() as conn:
            if conn is None:
                gone = "broke" if self._session.broken() else "is closed"
                raise LockLost(f"the lock session {gone}")
            try:
                count, request = self._stop_probe.check(
                    lambda: bounded_row(
                        conn,
                        sql.HELD_BY_US_OR_STOP,
                        {"lock_ids": held, "run_id": self._run_id, "stop_keys": self._stop_keys},
                        wait=self._lock_wait,
                        prefix=self._comment,
                    ),
                    lambda: _count(
                        conn.execute(self._comment + sql.HELD_BY_US, (held,)).fetchone()
                    ),
                )
            except psycopg.Error as exc:
                if conn.broken or conn.closed:
                    raise LockLost(
                        f"the lock session broke: {db.one_line(exc, self._target)}"
                    ) from None
                raise db.unavailable(exc, self._target, "checking the lock") from None
        if request is not None and self.stop_request is None:
            self.stop_request = request
        if count != len(self._held):
            raise LockLost(
                f"the server no longer shows our advisory lock ({count} of {len(self._held)} held)"
            )

    def known_lost(self) -> str | None:
        """The lock session broke (a history call on it failed): the server freed our keys."""
        if self._held and self._session.connection() is None:
            return "the lock session broke"
        return None

    def release(self) -> None:
        """Unlock what we took (the session might be gone: then the server already did).

        The session stays open (the run closes it): a ``--slots`` run tries the next slot
        on it.
        """
        conn = self._session.connection()
        if conn is not None:
            for key in reversed(self._held):
                try:
                    row = conn.execute(sql.UNLOCK, (key.lock_id,)).fetchone()
                except psycopg.Error as exc:
                    self._log.warning(
                        "release_failed", error=db.one_line(exc, self._target), lock=key.label
                    )
                    break
                if not (row and row[0]):
                    self._log.warning("release_not_held", lock=key.label)
        self._held.clear()

    def _unlock_taken(self, conn: psycopg.Connection[tuple[object, ...]]) -> None:
        for key in reversed(self._held):
            conn.execute(sql.UNLOCK, (key.lock_id,))
        self._held.clear()


def announcement(query: object) -> dict[str, object]:
    """What a lock session's ``/* jobrun-holder {...} */`` comment says ({} if nothing usable).

    WARNING: any session can write such a comment: take nothing in it on trust (the values
    are checked by whoever reads them).
    """
    match = _ANNOUNCEMENT.search(str(query or ""))
    if match:
        with contextlib.suppress(ValueError, RecursionError):
            announced = json.loads(match.group(1))
            if isinstance(announced, dict):
                return announced
    return {}


def session_holder(label: str, row: Sequence[object]) -> Holder:
    """The session holding an advisory lock, from its pg_locks / pg_stat_activity ``row``.

    ``row``: backend pid, client address, application_name, backend_start, query; the
    holder's comment in the query (if any) names its host, pid, run id and start.
    """
    backend_pid, client_addr, app_name, backend_start, query = row
    announced = announcement(query)
    started = backend_start.isoformat(timespec="seconds") if backend_start else None  # type: ignore[attr-defined]
    return Holder(
        key=label,
        host=_str_or_none(announced.get("host")),
        pid=_int_or_none(announced.get("pid")),
        run_id=_str_or_none(announced.get("run_id")),
        since=_str_or_none(announced.get("since")) or started,
        backend_pid=_int_or_none(backend_pid),
        client_addr=_str_or_none(client_addr),
        application_name=_str_or_none(app_name),
    )


def _refuse_pooler(why: str) -> None:
    raise LockStoreUnavailable(
        f"a transaction pooler sits between jobrun and PostgreSQL ({why}); session locks "
        "would be stranded on a backend we no longer talk to. Connect directly (or through "
        "a session-mode pooler), or use --mode lease",
        reason="transaction_pooler",
    )


def _refuse_standby() -> None:
    # WARNING: a standby grants advisory locks that nobody else sees: two hosts that reach
    # two different servers (a read endpoint, a multi-host DSN) would both run the job.
    raise LockStoreUnavailable(
        "the server is a standby (in recovery): its advisory locks are not shared with the "
        "primary or the other standbys, so they cannot keep a job to one run. Point --dsn "
        "at the primary (with several hosts: target_session_attrs=read-write)",
        reason="standby",
    )


def _str_or_none(value: object) -> str | None:
    return None if value is None else str(value)


def _int_or_none(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _count(row: tuple[object, ...] | None) -> int:
    """The count a one-row ``SELECT count(*)`` returned."""
    return int(str(row[0])) if row else 0
