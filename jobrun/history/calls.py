"""History calls: a few statements as one message, on the run's session or one of their own."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors
from psycopg.rows import dict_row

from jobrun import db, sql
from jobrun.exitcodes import JobrunError
from jobrun.session import SILENCE_GRACE

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    from structlog.typing import FilteringBoundLogger

    from jobrun.session import ServerSession

    Connection = psycopg.Connection[Any]
    Rows = list[dict[str, Any]]

#: A connection of the history's own gives up connecting after this long.
CONNECT_TIMEOUT = 5.0


def ensure_schema(conn: Connection, *, timeout_ms: int = 5000) -> None:
    """Create (or bring up to date) ``jobrun.runs`` once, even when 50 first runs race for it.

    One message, one implicit transaction: the transaction-scoped advisory lock serializes
    the racers, and an error rolls everything back (the connection is never left inside a
    transaction).
    """
    psycopg.ClientCursor(conn).execute(
        sql.RUNS_TIMEOUTS + ";\n" + sql.RUNS_SCHEMA_LOCK + ";\n" + sql.RUNS_SCHEMA,
        {"ms": str(timeout_ms)},
    )


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
        #: False: a missing table means no rows (a read that must not create the schema).
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
    ) -> list[Rows] | None:
        """The rows of each statement, or None (warned) when the history is unavailable.

        A missing table or column (a fresh database, an older jobrun's table) is created
        and the call sent again, once. ``without_control``: the same call without the
        operators' tables (pauses, expectations), sent when this role is refused them.
        ``last``: the run's last call, which carries the lock's release where the lock left
        it one on the run's session (``ServerSession.end_with``): no round trip of its own.
        ``otherwise``: the call without an extra it carries (a failed run's output tails),
        sent when the server refused the call (a role that may not add the tails' columns
        must not lose its end row to them).
        """
        if self.gave_up:
            return None
        try:
            try:
                return self._on_connection(statements, params, last=last)
            except psycopg.Error as exc:
                if otherwise is None or isinstance(exc, psycopg.OperationalError):
                    raise
                # No line of its own: what was left out says why (output_not_stored).
                return self._on_connection(otherwise, params, last=last)
        except errors.InsufficientPrivilege as exc:
            rows = self._without_control(during, exc, without_control, params)
            if rows is not None:
                return rows
            self._failed(during, db.one_line(exc, self._target))
        except JobrunError as exc:  # from db.connect: unreachable or refused
            self.gave_up = True
            self._failed(during, str(exc))
        except psycopg.Error as exc:
            # A broken connection costs time: never twice. The lock session breaking under a
            # call is not the database given up on: the next call connects on its own.
            if (
                isinstance(exc, psycopg.OperationalError)
                and not isinstance(exc, errors.QueryCanceled | errors.LockNotAvailable)
                and not (self._on_lock_session and self._usable() is None)
            ):
                self.gave_up = True
            self._failed(during, db.one_line(exc, self._target))
        return None

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
                    ending = session.take_ending() if last else None
                    try:
                        rows = self._send(
                            conn,
                            statements,
                            params,
                            prefix=session.comment,
                            ending=ending[0] if ending else "",
                        )
                    except BaseException:
                        if ending is not None:  # not released: for a retry, or the lock
                            session.end_with(*ending)
                        raise
                    if ending is not None:
                        ending[1]()  # the message went through: so did the release
                    return rows
        # No session open: lease mode holds none while the child runs, or the lock session
        # is gone (and the lock with it). Session mode then opens its one second session:
        # without it a run whose lock was lost would stay "running" in the history, for the
        # next run to call abandoned, instead of saying lock_lost.
        self._on_lock_session = False
        self.sessions += 1
        self.round_trips += 1  # the connection's own start-up exchange
        with db.connect(self._target, app_name=self._app_name) as own:
            return self._send(own, statements, params)

    def _send(
        self,
        conn: Connection,
        statements: Sequence[str],
        params: Mapping[str, object],
        *,
        prefix: str = "",
        ending: str = "",
    ) -> list[Rows]:
        share_ms = max(1, int(self._timeout * 1000 / len(statements)))
        # Bound on the client: a percent sign in the prefix (a host name) must be doubled,
        # and so must one in the ending (bound already: a literal may hold one).
        message = prefix.replace("%", "%%") + ";\n".join((sql.RUNS_TIMEOUTS, *statements))
        if ending:
            # After the history's statements, so only once they went through: a statement
            # that fails ends the message before the release (the lock's own release then
            # does it), and the end row is never missing while the lock is free.
            message += ";\n" + ending.replace("%", "%%")
        values = {**params, "ms": str(share_ms)}
        try:
            self.round_trips += 1
            return _results(conn, message, values)
        except (errors.UndefinedTable, errors.UndefinedColumn):
            if not self._create_schema:
                return [[] for _ in statements]
            self.round_trips += 2
            ensure_schema(conn, timeout_ms=int(self._timeout * 1000))
            return _results(conn, message, values)

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
