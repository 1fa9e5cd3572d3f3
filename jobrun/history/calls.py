"""History calls: a few statements as one message, on the run's session or one of their own."""

from __future__ import annotations

import contextlib
import dataclasses
import random
import time
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors, pq
from psycopg.rows import dict_row

from jobrun import db, sql
from jobrun.db.server_session import SILENCE_GRACE
from jobrun.exitcodes import JobrunError, LockStoreUnavailable
from jobrun.history import schema

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from structlog.typing import FilteringBoundLogger

    from jobrun.db.server_session import Release, ServerSession

    Connection = psycopg.Connection[Any]
    Rows = list[dict[str, Any]]

#: A connection of the history's own gives up connecting after this long.
CONNECT_TIMEOUT = 5.0
#: First and longest pause between two tries of the run's end row (jittered); the tries
#: go on for the run's --connect-timeout after the first failure.
_FIRST_RETRY = 0.1
_MAX_RETRY = 1.0


class Calls:
    """Sends history calls; never raises for database trouble, says it once, then gives up.

    ``session`` is the run's server session (session mode: the lock session, shared with
    the heartbeat; lease mode: open between the lock's statements only). Each call is ONE
    message of a few statements, which the server runs as one implicit transaction, in one
    ``use`` of the session: the heartbeat's check waits for at most the call's timeout and
    never lands inside it, and the session is never left idle in a transaction. With the
    session closed (lease mode holds none while the child runs) a call connects on its own.

    The call's timeout is split between its statements (``statement_timeout`` and
    ``lock_timeout``, local to the transaction): a history stuck behind a table lock gives up
    within ``timeout`` and hands the session back to the heartbeat well within its deadline.
    """

    def __init__(
        self,
        target: db.Target,
        *,
        app_name: str,
        timeout: float,
        log: FilteringBoundLogger,
        session: ServerSession | None = None,
        create_schema: bool = True,
    ) -> None:
        self._target = dataclasses.replace(
            target, connect_timeout=min(target.connect_timeout, CONNECT_TIMEOUT)
        )
        self._app_name = app_name
        self._timeout = timeout
        self._log = log
        self._session = session
        #: How long the run's end row is asked again after its connection failed.
        self._retry_for = target.connect_timeout
        #: While retrying: no connection of the history's own may outlast this deadline.
        self._connect_by: float | None = None
        #: False: no schema yet means no rows (a read that must not create the schema); its
        #: version check is a reader's (a newer schema is read, never refused).
        self._create_schema = create_schema
        self._warned = False
        #: Calls that failed, and whether the database is given up on for this run.
        self.failures = 0
        self.gave_up = False
        #: Messages sent and server sessions opened (a lent connection is not counted).
        self.round_trips = 0
        self.sessions = 0
        #: Whether the last call went over the lock session (not a connection of its own).
        self._on_lock_session = False

    def run(
        self,
        during: str,
        statements: Sequence[str],
        params: Mapping[str, object],
        *,
        without_control: Sequence[str] | None = None,
        last: bool = False,
        otherwise: Sequence[str] | None = None,
        retry: bool = False,
        refuse_newer: bool = False,
    ) -> list[Rows] | None:
        """The rows of each statement, or None (warned) when the history is unavailable.

        A missing table or column (a fresh database, an older jobrun's table) is created
        and the call sent again, once. ``without_control``: the same call without the
        operators' tables (pauses, expectations), sent when this role is refused them.
        ``last``: the run's last call, which carries the lock's release where the lock
        registered one (``ServerSession.carried_release``): no round trip of its own.
        ``otherwise``: the call without an extra it carries (a failed run's output tails),
        sent when the server refused the call (a role that may not add the tails' columns
        must not lose its end row to them). ``retry``: a call whose connection failed (a
        restart, a failover) is sent again, on a connection of its own, for up to the
        run's --connect-timeout after the first failure (the run's end row: without it
        the run would stay "running"). ``refuse_newer``: a schema a newer jobrun made, which
        this one may not write, raises SchemaTooNew (the run's first call: the child must
        not start); else it is this call's failure, and the history is given up on.
        """
        if self.gave_up:
            return None
        deadline: float | None = None
        backoff = _FIRST_RETRY
        try:
            while True:
                rows, exc = self._try(statements, params, last=last, otherwise=otherwise)
                if exc is None:
                    return rows
                if isinstance(exc, schema.SchemaTooNew):
                    self.gave_up = True
                    if refuse_newer:
                        raise exc
                    self._failed(during, str(exc))
                    return None
                if isinstance(exc, errors.InsufficientPrivilege):
                    rows = self._without_control(during, exc, without_control, params)
                    if rows is None:
                        self._failed(during, db.one_line(exc, self._target))
                    return rows
                now = time.monotonic()
                deadline = now + self._retry_for if deadline is None else deadline
                pause = min(backoff, deadline - now)
                if not (retry and _connection_failed(exc) and pause > 0):
                    self._give_up(exc)
                    self._failed(during, self._text(exc))
                    return None
                # The run's end row, whose connection failed (a restart, a failover): without
                # it the run stays "running". Asked again on a connection of its own, until
                # the run's --connect-timeout has passed since the first failure.
                self._connect_by = deadline
                self._log.debug("history_retry", during=during, error=self._text(exc))
                time.sleep(random.uniform(pause / 2, pause))  # noqa: S311 - jitter, not crypto
                backoff = min(_MAX_RETRY, backoff * 2)
        finally:
            self._connect_by = None

    def _try(
        self,
        statements: Sequence[str],
        params: Mapping[str, object],
        *,
        last: bool,
        otherwise: Sequence[str] | None,
    ) -> tuple[list[Rows] | None, JobrunError | psycopg.Error | None]:
        """The rows of one try, or the database's error."""
        try:
            return self._attempt(statements, params, last=last, otherwise=otherwise), None
        except (JobrunError, psycopg.Error) as exc:
            return None, exc

    def _attempt(
        self,
        statements: Sequence[str],
        params: Mapping[str, object],
        *,
        last: bool,
        otherwise: Sequence[str] | None,
    ) -> list[Rows]:
        """One try of the call (then of ``otherwise`` when the server refused it)."""
        try:
            return self._on_connection(statements, params, last=last)
        except psycopg.Error as exc:
            if otherwise is None or isinstance(exc, psycopg.OperationalError):
                raise
            # No line of its own: what was left out says why (output_not_stored).
            return self._on_connection(otherwise, params, last=last)

    def _give_up(self, exc: BaseException) -> None:
        """Whether the database is given up on for the rest of the run, after ``exc``.

        A broken connection costs time: never twice. The lock session breaking under a
        call is not the database given up on: the next call connects on its own.
        """
        if isinstance(exc, JobrunError) or (  # JobrunError: db.connect's unreachable, refused
            isinstance(exc, psycopg.OperationalError)
            and not isinstance(exc, errors.QueryCanceled | errors.LockNotAvailable)
            and not (self._on_lock_session and self._usable() is None)
        ):
            self.gave_up = True

    def _text(self, exc: BaseException) -> str:
        return str(exc) if isinstance(exc, JobrunError) else db.one_line(exc, self._target)

    def _without_control(
        self,
        during: str,
        refused: psycopg.Error,
        statements: Sequence[str] | None,
        params: Mapping[str, object],
    ) -> list[Rows] | None:
        """The call again without the operators' tables, or None when that fails too.

        A role granted only jobrun.runs (as older versions asked: the operators' tables came
        later, and an owner made them) must keep its history, and --once-per its promise,
        rather than lose both to a pause check it cannot make. The refusal is blamed on
        those tables only once the call without them went through.
        """
        if statements is None:
            return None
        try:
            rows = self._on_connection(statements, params)
        except (JobrunError, psycopg.Error):
            return None
        self._log.warning(
            "control_tables_unavailable",
            during=during,
            error=db.one_line(refused, self._target),
            note="this role's runs see no pause and record no --expect-every until it may "
            "use jobrun.pauses and jobrun.expectations (jobrun doctor names the grants)",
        )
        return rows

    def _usable(self) -> Connection | None:
        """The run's session if it can still be used, else None."""
        return self._session.connection() if self._session is not None else None

    def _on_connection(
        self, statements: Sequence[str], params: Mapping[str, object], *, last: bool = False
    ) -> list[Rows]:
        session = self._session
        if session is not None:
            # WARNING: on a silent network (nothing answers, nothing tells the kernel) this
            # call, or the heartbeat check it waits for, would never return: past the call's
            # timeout the session cuts the socket, as the heartbeat's own watchdog does.
            with session.use(self._timeout + SILENCE_GRACE) as conn:
                self._on_lock_session = conn is not None and session.held
                if conn is not None:
                    if not last:
                        return self._send(conn, statements, params, prefix=session.comment)
                    # The one place the lock's release is sent with the history's message.
                    with session.carried_release.sending() as release:
                        return self._send(
                            conn, statements, params, prefix=session.comment, release=release
                        )
        # No session open: lease mode holds none while the child runs, or the lock session
        # is gone (and the lock with it). Session mode then opens its one second session:
        # without it a run whose lock was lost would stay "running" in the history, for the
        # next run to call abandoned, instead of saying lock_lost.
        self._on_lock_session = False
        self.sessions += 1
        self.round_trips += 1  # the connection's own start-up exchange
        target = self._target
        if self._connect_by is not None:
            within = max(_FIRST_RETRY, self._connect_by - time.monotonic())
            target = dataclasses.replace(target, connect_timeout=min(within, CONNECT_TIMEOUT))
        with db.connect(target, app_name=self._app_name) as own:
            return self._send(own, statements, params)

    def _send(
        self,
        conn: Connection,
        statements: Sequence[str],
        params: Mapping[str, object],
        *,
        prefix: str = "",
        release: Release | None = None,
    ) -> list[Rows]:
        share_ms = max(1, int(self._timeout * 1000 / len(statements)))
        values = {**params, "ms": str(share_ms)}
        writes = self._create_schema
        # The connection's first message starts with the schema's version check (no round
        # trip of its own); where it says steps are missing, they are run and the message
        # sent again, once.
        check = schema.prefix(conn, writes=writes)
        try:
            found = self._message(conn, check, statements, values, prefix=prefix, release=release)
        except psycopg.Error as exc:
            refused = schema.too_new(exc)
            if refused is not None:
                raise refused from None
            if not schema.behind(exc):
                raise
            if not writes:
                return [[] for _ in statements]
            self.round_trips += 1
            schema.ensure(conn, timeout_ms=int(self._timeout * 1000))
            return self._message(conn, (), statements, values, prefix=prefix, release=release)
        if check:
            schema.passed(conn, writes=writes)
        return found[len(check) :]

    def _message(
        self,
        conn: Connection,
        check: tuple[str, ...],
        statements: Sequence[str],
        values: Mapping[str, object],
        *,
        prefix: str,
        release: Release | None,
    ) -> list[Rows]:
        """The call as ONE message (``check`` first): the rows of each statement."""
        # Bound on the client: a percent sign in the prefix (a host name) must be doubled,
        # and so must one in the release (bound already: a literal may hold one).
        body = ";\n".join((sql.RUNS_TIMEOUTS, *check, *statements))
        opened = release is not None and release.after_commit
        if opened:
            # WARNING: a COMMIT of the implicit transaction a message runs in makes the
            # server log "WARNING: there is no transaction in progress" on every run: the
            # message opens its transaction itself, so the COMMIT ends one that exists.
            body = f"BEGIN;\n{body};\nCOMMIT"
        message = prefix.replace("%", "%%") + body
        if release is not None:
            # After the history's statements, so only once they went through: a statement
            # that fails ends the message before the release (the lock's own release then
            # does it), and the end row is never missing while the lock is free.
            message += ";\n" + release.statements.replace("%", "%%")
        self.round_trips += 1
        return self._results(conn, message, values, opened=opened)

    def _results(
        self, conn: Connection, message: str, values: Mapping[str, object], *, opened: bool
    ) -> list[Rows]:
        """``_results`` (after BEGIN's, if ``opened``); an aborted transaction is ended.

        WARNING: a failed statement inside BEGIN leaves the session in an aborted
        transaction (an implicit one ends with the message): it is rolled back in the same
        use of the session, before the heartbeat or the lock's release sends anything.
        """
        try:
            found = _results(conn, message, values)
        except psycopg.Error:
            if (
                not conn.closed
                and not conn.broken
                and conn.info.transaction_status == pq.TransactionStatus.INERROR
            ):
                self.round_trips += 1
                with contextlib.suppress(psycopg.Error):
                    conn.execute("ROLLBACK")
            raise
        return found[1:] if opened else found

    def _failed(self, during: str, error: str) -> None:
        self.failures += 1
        if self._warned:
            self._log.debug("history_failed", during=during, error=error)
            return
        self._warned = True
        self._log.warning(
            "history_failed",
            during=during,
            error=error,
            note="the job goes on; this run may be missing from the history",
        )


def _connection_failed(exc: BaseException) -> bool:
    """Whether ``exc`` says the connection failed (not the statements, nor TLS or the DSN)."""
    if isinstance(exc, LockStoreUnavailable):
        return exc.reason in (db.UNREACHABLE, db.REFUSED)
    return isinstance(exc, psycopg.OperationalError) and not isinstance(
        exc, errors.QueryCanceled | errors.LockNotAvailable
    )


def _results(conn: Connection, message: str, values: Mapping[str, object]) -> list[Rows]:
    """Send ``message`` (bound on the client: one simple-protocol message) and read each set.

    The first set (the timeouts) is left out.
    """
    cursor = psycopg.ClientCursor(conn, row_factory=dict_row)
    cursor.execute(message, values)
    results: list[Rows] = []
    while cursor.nextset():
        results.append(cursor.fetchall() if cursor.description else [])
    return results
