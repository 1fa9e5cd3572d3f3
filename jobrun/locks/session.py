"""Session mode: ``pg_try_advisory_lock`` on the run's server session, held for the child's life."""

from __future__ import annotations

import json
import math
import time
from typing import TYPE_CHECKING

import psycopg
from psycopg import errors

from jobrun import db, sql
from jobrun.exitcodes import LockLost, LockStoreUnavailable, not_granted
from jobrun.keys import Key, describe, names
from jobrun.locks import Holder, Identity, Taken
from jobrun.locks.holders import (
    announcement,
    leased_holder,
    session_holder,
)
from jobrun.locks.stops import StopProbe, bounded_row, lock_wait

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from jobrun.db.server_session import ServerSession

#: Without a successful check for this long, we no longer vouch for the session: a cut
#: network must be noticed well within 15 seconds (the kernel's tcp_user_timeout matches).
CONFIRMATION_LIFETIME = 10.0

#: Longest single blocking wait for a key (lock_timeout's limit is about 24.8 days).
_WAIT_SLICE = 86400.0


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

    The session is the run's (``jobrun.db.server_session``): opened here, closed by the run after
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
        fence: bool = False,
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
        self._run_id = identity.run_id
        #: A stop request counts only if it names one of these (the label or a key's).
        self._stop_keys = names(keys)
        self._stop_probe = StopProbe(log, lambda exc: db.one_line(exc, self._target))
        #: ``--fence``: take the token in the acquisition's message (``fence_token``).
        self.fence = fence
        self.fence_token: int | None = None

    def acquire(self, wait: float) -> Taken | Holder:
        """Take every key in ascending lock-id order, or none (then say who holds one)."""
        conn = self._session.open()
        try:
            # Every statement below is translated where it is sent; this catches a
            # straggler (an unlock after a lease was found, as the server crashed): a
            # database error is LockStoreUnavailable, never an internal error.
            with db.translate_errors(self._target, "taking the advisory lock"):
                facts = None
                if wait <= 0 and len(self._keys) == 1:
                    # The common case in one message: settings, facts, lock, lease, holder.
                    taken = self._take_at_once(conn)
                    if not isinstance(taken, tuple):
                        return taken
                    facts = taken
                return self._acquire_probed(conn, wait, facts)
        except BaseException:
            # WARNING: the server frees a session's locks with it: whatever a failed
            # message took (a session lock outlives its transaction) goes here.
            self._session.close()
            raise

    def _acquire_probed(
        self,
        conn: psycopg.Connection[tuple[object, ...]],
        wait: float,
        facts: tuple[bool, int] | None,
    ) -> Taken | Holder:
        """Settings and facts (unless ``facts`` has them), the pooler probe, then the keys."""
        with db.translate_errors(self._target, "preparing the lock session"):
            if facts is None:
                setup = conn.execute(
                    self._immune(conn) + sql.SESSION_SETUP.format(idle=self._server_keepalive_idle)
                )
                while setup.nextset():  # the SETs come first; the row is the last result
                    pass
                row = setup.fetchone()
                facts = (bool(row[3]), int(str(row[4]))) if row else (False, 0)
            standby, backend = facts
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
                    return self._taken()
                self._unlock_taken(conn)
                return leased
            self._unlock_taken(conn)
            # The session stays open for the skip's history row (one session per skip);
            # the run closes it right after.
            return self._holder_of(conn, blocked)

    def _take_at_once(
        self, conn: psycopg.Connection[tuple[object, ...]]
    ) -> Taken | Holder | tuple[bool, int]:
        """One key, no wait, ONE message (sql.SESSION_TAKE_AT_ONCE): the outcome, or facts.

        (standby, backend pid) when the lock was not tried: the backend is not the one the
        handshake announced (a pooler, maybe), so the full probe decides.
        """
        key = self._keys[0]
        classid, objid = key.pg_locks_pair
        params = {
            "idle": str(self._server_keepalive_idle),
            "handshake": conn.info.backend_pid,
            "lock_id": key.lock_id,
            "fence": self.fence,
            "classid": classid,
            "objid": objid,
            "label": key.label,
        }
        message = (self._comment + self._immune(conn)).replace("%", "%%")
        with db.translate_errors(self._target, "taking the advisory lock"):
            cursor = psycopg.ClientCursor(conn)
            cursor.execute(message + sql.SESSION_TAKE_AT_ONCE, params)
            rows: list[tuple[object, ...] | None] = []
            while True:
                if cursor.description is not None:
                    rows.append(cursor.fetchone())
                if not cursor.nextset():
                    break
        take, found = rows
        assert take is not None  # noqa: S101 - one row each, always
        assert found is not None  # noqa: S101
        standby, backend, locked = bool(take[3]), int(str(take[4])), take[5]
        if standby:
            _refuse_standby()
        if locked is None:
            return standby, backend
        if not locked:
            return (
                session_holder(key.label, found[1:6])
                if found[1] is not None
                else Holder(key=key.label)
            )
        self._held.append(key)
        self._refuse_if_not_granted(conn, found[0])
        leased = leased_holder(found[0], self._log, self._target)
        if leased is not None:
            self._unlock_taken(conn)
            return leased
        token = found[6]
        self.fence_token = int(str(token)) if token is not None else None
        return self._taken()

    def _immune(self, conn: psycopg.Connection[tuple[object, ...]]) -> str:
        """The settings that keep the session alive: PostgreSQL 14 knows more of them."""
        return (
            sql.SESSION_IMMUNE_14
            if conn.info.server_version >= 140000  # noqa: PLR2004 - PostgreSQL 14
            else sql.SESSION_IMMUNE
        )

    def _taken(self) -> Taken:
        """Every key is ours: confirmed now; the run's last history message may release it.

        The unlock goes after the message's statements are committed (``after_commit``): a
        session lock is no part of a transaction, and the next run must find our end row,
        not our running one.
        """
        confirmed_at = time.monotonic()
        unlocks = ";\n".join(
            f"SELECT pg_catalog.pg_advisory_unlock({int(key.lock_id)})"
            for key in reversed(self._held)
        )
        self._session.carried_release.register(unlocks, self._held.clear, after_commit=True)
        return Taken(confirmed_at)

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
        # With the comment, as every statement here: the session's last query names us.
        # Bound on the client: one message of three statements.
        cursor = psycopg.ClientCursor(conn)
        cursor.execute(
            self._comment.replace("%", "%%") + sql.SESSION_LEASED,
            {"label": describe(self._keys)},
        )
        while cursor.nextset():  # the label's setting and the DO block come first
            pass
        row = cursor.fetchone()
        found = row[0] if row else None
        self._refuse_if_not_granted(conn, found)
        return leased_holder(found, self._log, self._target)

    def _refuse_if_not_granted(
        self, conn: psycopg.Connection[tuple[object, ...]], found: object
    ) -> None:
        """After ``jobrun init``, a role may hold only keys it was granted: else 69, not run.

        WARNING: fails closed even with ``--on-db-error run``: the database answered, and
        its answer is no. What we took is unlocked before the refusal.
        """
        if found != sql.NOT_GRANTED:
            return
        self._unlock_taken(conn)
        raise not_granted(conn.info.user, describe(self._keys))

    def _holder_of(self, conn: psycopg.Connection[tuple[object, ...]], key: Key) -> Holder:
        classid, objid = key.pg_locks_pair
        row = conn.execute(sql.ADVISORY_HOLDER, (classid, objid)).fetchone()
        if row is None:  # released between our attempt and this query
            return Holder(key=key.label)
        return session_holder(key.label, row)

    def check(self) -> dict[str, object] | None:
        """Prove the session is alive and its backend still holds every key.

        The same statement reads a ``jobrun stop`` request for this run, where it can: the
        request is returned (None: none read).
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
                        lookup=True,
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
        if count != len(self._held):
            raise LockLost(
                f"the server no longer shows our advisory lock ({count} of {len(self._held)} held)"
            )
        return request

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
        self._session.carried_release.withdraw()  # not with the history's last message: now
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


def _count(row: tuple[object, ...] | None) -> int:
    """The count a one-row ``SELECT count(*)`` returned."""
    return int(str(row[0])) if row else 0


__all__ = ["SessionLock", "announcement", "holder_comment", "session_holder"]
