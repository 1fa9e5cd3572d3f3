"""Lease mode: a row per key with an owner and an expiry on the database's clock, renewed."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors

from jobrun import db, sql
from jobrun.db.server_session import SILENCE_GRACE
from jobrun.durations import format_seconds
from jobrun.exitcodes import (
    NOT_GRANTED,
    LockLost,
    LockStoreUnavailable,
    UsageError,
    not_granted,
)
from jobrun.history import schema
from jobrun.keys import Key, describe, names
from jobrun.locks import Holder, Identity, Taken
from jobrun.locks.stops import StopProbe, bounded_row, lock_wait

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from structlog.typing import FilteringBoundLogger

    from jobrun.db.server_session import ServerSession

#: Longest pause between two attempts while ``--wait`` lasts.
_WAIT_POLL = 1.0

#: Longest pause between two heartbeats over a kept connection (seconds): the stop check's.
_KEPT_BEAT = 1.0


def safety_margin(ttl: float) -> float:
    """Slack between the child's SIGKILL and the lease's expiry: clock rates, scheduling."""
    return max(1.0, ttl / 10)


@dataclass(frozen=True)
class LeaseTiming:
    """A lease's TTL, kill-after, heartbeat and lifetime, checked against each other.

    The child must be dead before the lease can expire: after a renewal sent at t, SIGTERM
    goes out at t + lifetime and SIGKILL at t + lifetime + kill_after, where
    lifetime = ttl - kill_after - margin. Two heartbeats must fit into the lifetime, so one
    failed renewal alone never stops the job. A LeaseTiming that breaks this cannot be built.
    """

    ttl: float
    kill_after: float
    heartbeat: float
    #: Whether the heartbeat was given (the error message then names --heartbeat).
    heartbeat_given: bool

    @classmethod
    def from_options(cls, *, ttl: float, kill_after: float, heartbeat: float | None) -> LeaseTiming:
        """The timing for ``--ttl``, ``--kill-after`` and ``--heartbeat`` (None: derived)."""
        if ttl <= 0:
            raise UsageError("--ttl must be longer than 0")
        lifetime = ttl - kill_after - safety_margin(ttl)
        beat = heartbeat if heartbeat is not None else min(10.0, lifetime / 3)
        return cls(
            ttl=ttl, kill_after=kill_after, heartbeat=beat, heartbeat_given=heartbeat is not None
        )

    @property
    def margin(self) -> float:
        """Slack between the child's SIGKILL and the lease's expiry."""
        return safety_margin(self.ttl)

    @property
    def lifetime(self) -> float:
        """How long a renewal vouches for the lease: ttl - kill_after - margin."""
        return self.ttl - self.kill_after - self.margin

    def __post_init__(self) -> None:
        if self.ttl <= 0:
            raise UsageError("--ttl must be longer than 0")
        if self.lifetime <= 0 or 2 * self.heartbeat > self.lifetime:
            given = self.heartbeat if self.heartbeat_given else None
            beat_for_message = given if given is not None else 0.5
            need = 2 * beat_for_message + self.kill_after
            needed_ttl = math.ceil(max(need + 1.0, need / 0.9))
            raise UsageError(
                f"--ttl {format_seconds(self.ttl)} is too short for --kill-after "
                f"{format_seconds(self.kill_after)}"
                + (f" and --heartbeat {format_seconds(given)}" if given is not None else "")
                + ": the child is stopped kill-after + a safety margin before the lease "
                "expires, and two heartbeats must fit before that; use --ttl "
                f"{format_seconds(needed_ttl)} or more, or lower --kill-after"
                + (" / --heartbeat" if given is not None else "")
            )


def beat(renewal: float, *, kept: bool) -> float:
    """Seconds between two heartbeats of a lease run that renews every ``renewal`` seconds.

    Kept connection: a beat of at most 1 s (one statement: the stop-request lookup, with the
    lease's own check or, when due, its renewal), so ``jobrun stop`` reaches the run within
    about a second. Per renewal: every beat is a renewal on a connection of its own.
    """
    return min(_KEPT_BEAT, renewal) if kept else renewal


def timing(ttl: float, kill_after: float, heartbeat: float | None) -> tuple[float, float]:
    """(heartbeat, lifetime) of a valid LeaseTiming; kept for callers of the tuple form."""
    checked = LeaseTiming.from_options(ttl=ttl, kill_after=kill_after, heartbeat=heartbeat)
    return checked.heartbeat, checked.lifetime


class LeaseLock:
    """Leases in ``jobrun.leases``, renewed every ``renew_every`` seconds.

    The run's server session (``jobrun.db.server_session``) carries the attempt and the release, and
    between them (when it ``lends``) the history's calls. When it ``keeps`` its connection,
    every heartbeat (``check``, every ``heartbeat`` seconds) goes over it too, reopened
    after a failure; otherwise each check is a renewal on a connection of its own.

    WARNING: a heartbeat that renews nothing vouches for nothing new: the lease is vouched
    for only from the last renewal *sent* (``confirmation_lifetime`` counts from it).
    Nothing here is session-scoped (each statement is its own transaction), so the kept
    connection may go through a transaction pooler.
    """

    def __init__(
        self,
        keys: tuple[Key, ...],
        session: ServerSession,
        identity: Identity,
        log: FilteringBoundLogger,
        *,
        ttl: float,
        lifetime: float,
        heartbeat: float,
        renew_every: float | None = None,
    ) -> None:
        self._keys = keys
        self._session = session
        self._target = session.target
        self._identity = identity
        self._log = log
        self._ttl = ttl
        self._lifetime = lifetime
        self._lock_wait = lock_wait(heartbeat)
        self._heartbeat = heartbeat
        # WARNING: a beat over the kept connection with no answer this long is cut (a silent
        # network: the next beat reconnects), but never sooner than a renewal interval: a
        # beat queued behind a busy transaction pooler must not be cut into a reconnection
        # storm. A renewal cut at its bound is retried half a beat later, still well within
        # the lifetime (two renewal intervals fit in it: LeaseTiming).
        self._beat_bound = max(lock_wait(heartbeat) + SILENCE_GRACE, renew_every or heartbeat)
        #: None: every check renews.
        self._renew_every = renew_every
        #: When the acquisition was sent (the first renewal, in effect): ``Taken.confirmed_at``.
        self.confirmed_at = 0.0
        #: When the last successful renewal and heartbeat were sent (-inf: none yet; not 0,
        #: which is a time like any other on the monotonic clock, whose origin is unspecified).
        self._renewed_sent = -math.inf
        self._beat_sent = -math.inf
        self._app_name = session.app_name
        self._held = False
        self._stop_probe = StopProbe(log, lambda exc: db.one_line(exc, self._target))
        self._params = {
            "lock_ids": [key.lock_id for key in keys],
            "keys": [key.label for key in keys],
            "label": describe(keys),
            "owner": identity.run_id,
            "host": identity.host,
            "pid": identity.pid,
            "ttl": ttl,
            # A stop request counts only if it names one of these (the label or a key's).
            "stop_keys": names(keys),
        }

    @property
    def confirmation_lifetime(self) -> float:
        """From the last heartbeat sent: what the last renewal sent still vouches for."""
        renewed = max(self._renewed_sent, self.confirmed_at)
        return self._lifetime - (max(self._beat_sent, self.confirmed_at) - renewed)

    def _renewal_due(self, now: float) -> bool:
        """Whether the beat sent at ``now`` renews the leases.

        It does when the next beat would come ``renew_every`` or more after the last
        renewal sent: renewals are never further apart than that (two of them fit in the
        lifetime: LeaseTiming), and with ``renew_every`` == ``heartbeat`` every beat renews.
        """
        if self._renew_every is None:
            return True
        renewed = max(self._renewed_sent, self.confirmed_at)
        return now + self._heartbeat >= renewed + self._renew_every

    def acquire(self, wait: float) -> Taken | Holder:
        """Take every lease that is free or expired, or none; retry while ``wait`` lasts."""
        deadline = time.monotonic() + wait
        while True:
            holder = self._try_once()
            if holder is None:
                return Taken(self.confirmed_at)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return holder
            self._session.close()  # nothing is held while we wait
            time.sleep(min(_WAIT_POLL, remaining))

    def _try_once(self) -> Holder | None:
        """One attempt, on a new connection that then carries the history's next call."""
        conn = self._session.open()
        try:
            with db.translate_errors(self._target, "taking the lease"):
                holder = self._attempt(conn)
        except BaseException:
            self._session.close()
            raise
        if not self._session.lends:
            self._session.close()
        return holder

    def _attempt(self, conn: psycopg.Connection[tuple[object, ...]]) -> Holder | None:
        """Take every lease (None), or say who holds one."""
        # Deadlines count from when the winning statement was *sent*: never later
        # than the database's own start of the lease.
        sent = time.monotonic()

        def attempt(check: tuple[str, ...]) -> bool | Holder | None:
            nonlocal sent
            sent = time.monotonic()
            return self._insert_refused(conn, check)

        # The connection's first statement carries the schema's version check (one
        # message); where the schema lacks steps (a first run) they are run, and sent again
        # (anyway: a role that may not run them still takes its lease, as before).
        taken = schema.guarded(conn, attempt, anyway=True)
        if isinstance(taken, Holder):
            return taken
        if taken:
            self._held = True
            self.confirmed_at = sent
            # The run's end row carries the release (one message, one transaction: the
            # lease goes as the row is written); else ``release`` sends it on its own.
            release = psycopg.ClientCursor(conn).mogrify(sql.LEASE_RELEASE, self._params)
            self._session.carried_release.register(release, self._released_with_end)
            return None
        if taken is None:
            return self._session_holder(conn)
        row = conn.execute(sql.LEASE_HOLDERS, self._params).fetchone()
        if row is None:  # expired or released between the two statements: try again later
            return Holder(key=describe(self._keys))
        _, label, owner, host, pid, acquired_at, _, expires_at = row
        return _lease_holder((label, owner, host, pid, acquired_at, expires_at))

    def _insert_refused(
        self, conn: psycopg.Connection[tuple[object, ...]], check: tuple[str, ...]
    ) -> bool | Holder | None:
        """``_insert``; a lease the database refuses this role is LockStoreUnavailable.

        WARNING: a refusal fails closed (reason ``not_granted``, even with ``--on-db-error
        run``): the database answered, and its answer is no. After ``jobrun init``,
        row-level security refuses the lease of a key the role was not granted; without
        it, the table's own grants may.
        """
        try:
            return self._insert(conn, check)
        except errors.InsufficientPrivilege as exc:
            if "row-level security" in str(exc):
                raise not_granted(conn.info.user, describe(self._keys)) from None
            raise LockStoreUnavailable(
                f"taking the lease: {db.one_line(exc, self._target)}", reason=NOT_GRANTED
            ) from None

    def _insert(
        self, conn: psycopg.Connection[tuple[object, ...]], check: tuple[str, ...]
    ) -> bool | Holder | None:
        """All leases in one statement and one transaction; roll back unless we got all.

        True: taken. False: another run's lease is in the way. None: a session-mode run
        holds one of the keys (WARNING: the two modes must exclude each other too). A
        Holder: one key, not taken, its holder found by the same statement.

        WARNING: when the ROLLBACK fails (the backend was terminated mid-transaction),
        psycopg lets ``Rollback`` itself escape: the caller's translate_errors turns it
        into LockStoreUnavailable like any other database error.
        """
        if len(self._keys) == 1:
            return self._insert_one(conn, check)
        session_held = False
        with conn.transaction():
            free = _first_row(conn, check, sql.LEASE_NO_SESSION_LOCK, self._params)
            if not (free and free[0]):
                free = self._past_squatters(conn, sql.LEASE_NO_SESSION_RUN)
            if free and free[0]:
                rows = conn.execute(sql.LEASE_ACQUIRE, self._params).fetchall()
                if len(rows) == len(self._keys):
                    return True
            else:
                session_held = True
            raise psycopg.Rollback
        return None if session_held else False

    def _insert_one(
        self, conn: psycopg.Connection[tuple[object, ...]], check: tuple[str, ...]
    ) -> bool | Holder:
        """One key: the lease, or who holds the key, in ONE statement (sql.LEASE_TAKE_ONE)."""
        row = _first_row(conn, check, sql.LEASE_TAKE_ONE, self._params)
        assert row is not None  # noqa: S101 - one row, always
        if not row[0] and row[8] is not None:
            row = self._past_squatters(conn, sql.LEASE_TAKE_ONE_PAST_SQUATTERS) or row
        free, taken, *lease = row[:8]
        if free and taken:
            return True
        label = self._keys[0].label
        if not free:
            if row[8] is None:  # released in the meantime: a skip all the same, this time
                return Holder(key=label)
            from jobrun.locks.holders import session_holder  # noqa: PLC0415 - rare path

            return session_holder(label, row[9:14])
        if lease[0] is None:  # expired or released since: try again later
            return Holder(key=label)
        return _lease_holder(lease)

    def _past_squatters(
        self, conn: psycopg.Connection[tuple[object, ...]], statement: str
    ) -> tuple[object, ...] | None:
        """``statement`` again, treating advisory locks of roles not granted the key as free.

        Only when a session holds one of our ids: an advisory lock is no part of the
        grants, so any role that may connect can take a key's id (``jobrun key NAME``
        prints it). After ``jobrun init`` such a lock guards no run of the key, and lease
        mode, whose rows the grants do guard, goes past it; a session of a role that may
        run the key still keeps us out. None where ``jobrun init`` never ran (no
        ``jobrun.only_squatters``): the lock stands, as before. One more round trip, on
        this path only.
        """
        try:
            if conn.info.transaction_status == psycopg.pq.TransactionStatus.IDLE:
                return conn.execute(statement, self._params).fetchone()
            with conn.transaction():  # several keys: a savepoint in their transaction
                return conn.execute(statement, self._params).fetchone()
        except errors.UndefinedFunction:
            return None

    def _session_holder(self, conn: psycopg.Connection[tuple[object, ...]]) -> Holder:
        """Who holds one of our keys as a session-mode advisory lock."""
        from jobrun.locks.session import session_holder  # noqa: PLC0415 - rare path

        row = conn.execute(sql.SESSION_HOLDER_OF_ANY, self._params).fetchone()
        if row is None:  # released in the meantime: a skip all the same, this time
            return Holder(key=describe(self._keys))
        lock_id, *session = row
        label = next((key.label for key in self._keys if key.lock_id == lock_id), str(lock_id))
        return session_holder(label, session)

    def check(self) -> dict[str, object] | None:
        """One heartbeat: renew every lease when due, else see that they are still ours.

        One statement either way, which also reads a ``jobrun stop`` request for us, where
        it can (returned; None: none read). A lease that is no longer ours is lost. Only a
        renewal moves the deadline (``confirmation_lifetime``); a failed or unanswered one is
        retried at the next beat.
        """
        if not self._held:
            return None  # released with the end row: nothing left to renew
        sent = time.monotonic()
        renew = self._renewal_due(sent)
        what = "renewing the lease" if renew else "checking the lease"
        try:
            if self._session.keeps:
                with self._session.kept(self._beat_bound) as conn:
                    if conn is None:
                        raise LockStoreUnavailable(f"{what}: the connection broke")
                    count, request = self._beat(conn, renew=renew)
            else:
                with db.connect(self._target, app_name=self._app_name) as conn:
                    count, request = self._beat(conn, renew=renew)
        except psycopg.Error as exc:
            raise db.unavailable(exc, self._target, what) from None
        if count != len(self._keys) and self._held:
            # _held stays True: the leases still ours (just renewed) must be deleted in
            # release(), which is owner-checked and so never touches the lost ones.
            raise LockLost(
                f"the lease was taken over or released ({count} of {len(self._keys)} still ours)"
            )
        if renew:
            self._renewed_sent = sent
        self._beat_sent = sent
        return request

    def _beat(
        self, conn: psycopg.Connection[tuple[object, ...]], *, renew: bool
    ) -> tuple[int, dict[str, object] | None]:
        """The heartbeat's one statement: (leases renewed or still ours, a stop request).

        Each statement waits for a table lock only so long: a lock on the stop requests'
        table costs the lookup, never the lease check (nor the run). One on the lease table
        fails the check itself: an ambiguous heartbeat, retried until the lease would expire.
        """
        with_stop, alone = (
            (sql.LEASE_RENEW_OR_STOP, sql.LEASE_RENEW_COUNT)
            if renew
            else (sql.LEASE_HELD_OR_STOP, sql.LEASE_HELD)
        )
        return self._stop_probe.check(
            lambda: bounded_row(conn, with_stop, self._params, wait=self._lock_wait, lookup=True),
            lambda: self._count_alone(conn, alone),
        )

    def _count_alone(self, conn: psycopg.Connection[tuple[object, ...]], statement: str) -> int:
        """The heartbeat without the stop-request lookup: how many leases are still ours."""
        row = bounded_row(conn, statement, self._params, wait=self._lock_wait)
        return int(str(row[0])) if row else 0

    def release(self) -> None:
        """Delete our leases (only ours: a newer owner's lease is left alone).

        On the run's session if it is open (the end row's), else on a connection of its own.
        """
        self._session.carried_release.withdraw()  # not with the run's end row: now
        if not self._held:
            return
        self._held = False
        try:
            with self._session.use() as conn:
                self._delete(conn)
        except (psycopg.Error, psycopg.Rollback, LockStoreUnavailable) as exc:
            self._log.warning(
                "release_failed",
                error=db.one_line(exc, self._target),
                note="the lease expires on its own after --ttl",
            )

    def _released_with_end(self) -> None:
        """The run's end row's message deleted our leases (``CarriedRelease``)."""
        self._held = False

    def _delete(self, conn: psycopg.Connection[tuple[object, ...]] | None) -> None:
        if conn is not None:
            try:
                conn.execute(sql.LEASE_RELEASE, self._params)
            except psycopg.Error:
                pass  # it broke under the history's call: a fresh one (the delete is idempotent)
            else:
                return
        with db.connect(self._target, app_name=self._app_name) as fresh:
            fresh.execute(sql.LEASE_RELEASE, self._params)

    def known_lost(self) -> str | None:
        """A lease's loss only shows when a renewal fails: nothing is known in between."""
        return None


def _lease_holder(lease: Sequence[Any]) -> Holder:
    """The lease-mode run holding a key: key, owner, host, pid, acquired_at, expires_at."""
    key, owner, host, pid, acquired_at, expires_at = lease
    return Holder(
        key=str(key),
        host=str(host),
        pid=int(str(pid)),
        run_id=str(owner),
        since=acquired_at.isoformat(timespec="seconds"),
        expires_at=expires_at.isoformat(timespec="seconds"),
    )


def _first_row(
    conn: psycopg.Connection[tuple[object, ...]],
    check: tuple[str, ...],
    statement: str,
    params: Mapping[str, object],
) -> tuple[object, ...] | None:
    """``statement``'s first row; after ``check`` in the same message where there is one.

    Without a check, the statement alone (bound on the server, as ever); with one, both as
    one message bound on the client (a failed check runs nothing of the statement).
    """
    if not check:
        return conn.execute(statement, params).fetchone()
    *_, rows = schema.results(conn, ";\n".join((*check, statement)), dict(params))
    return rows[0] if rows else None
