"""Fencing tokens (``--fence``): a number per acquisition, greater than every earlier one."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobrun import db, sql
from jobrun.exitcodes import LockStoreUnavailable
from jobrun.history import schema
from jobrun.run.listeners import Listener

if TYPE_CHECKING:
    import psycopg
    from structlog.typing import FilteringBoundLogger

    from jobrun.db.server_session import ServerSession
    from jobrun.locks import Lock

#: The variable the child reads its token from. Not ``JOBRUN_FENCE``: that is --fence's own
#: variable, and a jobrun inside the child would read the token as the flag.
ENV = "JOBRUN_FENCE_TOKEN"


def take(target: db.Target, *, app_name: str, session: ServerSession | None = None) -> int:
    """The next value of ``jobrun.fence`` (made with the schema); LockStoreUnavailable if not.

    One sequence serves every key: tokens of one key are then increasing too, and a token
    means the same thing whichever lock mode or host took it. On the run's ``session`` while
    it is open (session mode: the lock session, so a run stays one server session); else on
    a short connection of its own (a lease run: its session is closed by now). The
    connection's first message carries the schema's version check; the very first token
    of a database makes the schema first (history/schema.py).
    """
    if session is not None:
        with session.use() as conn, db.translate_errors(target, "taking a fencing token"):
            if conn is not None:
                # One autocommit statement, with the holder's comment as every statement on
                # the lock session (a skipping run reads who holds the key from it).
                return _next(conn, prefix=session.comment)
    with (
        db.connect(target, app_name=app_name) as conn,
        db.translate_errors(target, "taking a fencing token"),
    ):
        return _next(conn)


def issue(
    target: db.Target,
    lock: Lock,
    *,
    app_name: str,
    log: FilteringBoundLogger,
    session: ServerSession | None = None,
) -> int:
    """A token taken while ``lock`` is provably held: take it, then confirm the lock.

    WARNING: the order matters. A token taken after the lock was lost (a lease that expired
    while we were paused, a lock session that dropped) is greater than the new holder's and
    would let our stale writes win. Confirming the lock *after* the token proves the lock
    was held the whole time since the acquisition, the token's moment included: a session
    lock cannot be lost and come back, and an expired lease is never renewed. Raises
    LockLost or LockStoreUnavailable when that proof cannot be had (the child must then
    not start).
    """
    token = take(target, app_name=app_name, session=session)
    # A stop request this check may read is the watchdog's to act on: a request's row is
    # not consumed by a read (a repeat keeps the first), so the watchdog's next check reads it.
    lock.check()
    log.info("fence_taken", fence=token)
    return token


class Fence(Listener):
    """``--fence`` as a run's listener: the child's JOBRUN_FENCE_TOKEN, taken while locked."""

    #: A run without its lock has no token to give (the options refuse the pair).
    unguarded_too = False

    def __init__(
        self, target: db.Target, lock: Lock, session: ServerSession, *, log: FilteringBoundLogger
    ) -> None:
        self._target = target
        self._lock = lock
        self._session = session
        self._log = log

    def preparing(self, env: dict[str, str]) -> int | None:
        """Add the token; without one the child never starts (LockLost raised as such)."""
        # Session mode takes it in the acquisition's message, in a statement after the one
        # that took the lock, on the lock's own session: the lock was held at the token's
        # moment by construction (nothing left to confirm), and no round trip is spent.
        taken = getattr(self._lock, "fence_token", None)
        if isinstance(taken, int):
            self._log.info("fence_taken", fence=taken)
            env[ENV] = str(taken)
            return None
        try:
            token = issue(
                self._target,
                self._lock,
                app_name="jobrun-fence",
                log=self._log,
                session=self._session,
            )
        except LockStoreUnavailable as exc:
            self._log.error(
                exc.event, reason=exc.reason, error=str(exc), fence=True, exit_code=exc.exit_code
            )
            return exc.exit_code
        env[ENV] = str(token)
        return None


def _next(conn: psycopg.Connection[tuple[object, ...]], *, prefix: str = "") -> int:
    def attempt(check: tuple[str, ...]) -> int:
        *_, rows = schema.results(conn, prefix + ";\n".join((*check, sql.FENCE_NEXT)))
        return int(str(rows[0][0]))

    return schema.guarded(conn, attempt, anyway=True)  # a sequence made before, if any
