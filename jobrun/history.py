"""Run history in ``jobrun.runs``: abandoned runs, ``--once-per``, streak alerts, pruning."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import os
import socket
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import psycopg
from psycopg import errors
from psycopg.types.json import Jsonb

from jobrun import alerts, db, metrics, sql
from jobrun.exitcodes import JobrunError, LockStoreUnavailable, UsageError
from jobrun.keys import Key, describe
from jobrun.locks.lease import SCHEMA_LOCK_ID

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping

    from structlog.typing import FilteringBoundLogger

    from jobrun.locks import Identity
    from jobrun.tail import Capture

    Connection = psycopg.Connection[tuple[Any, ...]]

T = TypeVar("T")

#: Outcomes that make a failure streak; ``skipped``, ``running`` and ``abandoned`` neither
#: extend nor break one (they say nothing about whether the job itself works).
FAILURES = frozenset({"failed", "timed_out", "lock_lost", "exec_failed"})
OUTCOMES = (
    "running",
    "succeeded",
    "failed",
    "skipped",
    "timed_out",
    "lock_lost",
    "exec_failed",
    "abandoned",
)
#: A history connection gives up connecting after this long, and the server cancels a
#: history statement after this long.
CONNECT_TIMEOUT = 5.0
STATEMENT_TIMEOUT = 5.0


@dataclass(frozen=True)
class HistoryConfig:
    """How the history of a run is kept and when it raises an alert (validated on creation)."""

    keep: int = 100
    alert_after: int = 3
    on_alert: tuple[str, ...] | None = None
    alert_timeout: float = 30.0
    metrics_file: str | None = None
    #: Longest a history call holds the caller up, whatever the network does (a silent
    #: network never answers; the server-side statement timeout cannot help there).
    timeout: float = 5.0

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise UsageError(
                f"--keep {self.keep}: keep at least 1 run per key (the streaks and "
                "--once-per read the newest rows); use --no-history to keep none"
            )
        if self.alert_after < 0:
            raise UsageError(f"--alert-after {self.alert_after}: use 0 to disable, or N >= 1")
        if self.alert_timeout <= 0:
            raise UsageError("the alert hook's timeout must be longer than 0")
        if self.timeout <= 0:
            raise UsageError("the history timeout must be longer than 0")


def ensure_schema(conn: Connection) -> None:
    """Create ``jobrun.runs`` once, even when 50 first runs race for it (as lease mode does).

    On an error the transaction is left open: the caller closes the connection.
    """
    conn.execute(sql.BEGIN)
    conn.execute(sql.SCHEMA_XACT_LOCK, (SCHEMA_LOCK_ID,))
    conn.execute(sql.RUNS_SCHEMA)
    conn.execute(sql.COMMIT)


def holder_ref(holder_fields: Mapping[str, object]) -> str | None:
    """Who blocked a skip, as one string: the holder's run id, else its backend session.

    Skips chain into a streak only behind the same holder, so the hosts of a fleet that
    merely lose the start race to a fresh run every time never build one.
    """
    run_id = holder_fields.get("holder_run_id")
    if run_id:
        return str(run_id)
    backend_pid = holder_fields.get("holder_backend_pid")
    if backend_pid:
        return f"backend:{backend_pid}@{holder_fields.get('holder_since')}"
    return None


def iso(value: object) -> str | None:
    """A timestamp as UTC ISO 8601 to the second (the form every event line uses)."""
    if isinstance(value, dt.datetime):
        return value.astimezone(dt.timezone.utc).isoformat(timespec="seconds")
    return None if value is None else str(value)


class _Call(Generic[T]):
    """One history call on a thread of its own, so that its caller can stop waiting."""

    def __init__(self, during: str, run: Callable[[_Call[T]], T | None]) -> None:
        self.during = during
        self.began = time.monotonic()
        self.result: T | None = None
        self.error: BaseException | None = None
        #: Set when the caller stopped waiting: a late connection then does nothing.
        self.abandoned = threading.Event()
        self._thread = threading.Thread(
            target=self._main, args=(run,), name="jobrun-history", daemon=True
        )
        self._thread.start()

    def _main(self, run: Callable[[_Call[T]], T | None]) -> None:
        try:
            self.result = run(self)
        except BaseException as exc:  # noqa: BLE001 - handed over to the waiting thread
            self.error = exc

    def wait(self, deadline: float) -> bool:
        """Wait until ``deadline`` (monotonic); True when the call is over."""
        self._thread.join(max(0.0, deadline - time.monotonic()))
        return not self._thread.is_alive()


class NullRecorder:
    """``--no-history``: records nothing in the database; still writes ``--metrics-file``."""

    def __init__(
        self, keys: tuple[Key, ...], *, config: HistoryConfig, log: FilteringBoundLogger
    ) -> None:
        self._label = describe(keys)
        self._config = config
        self._log = log
        self._started = time.time()

    def acquired(self, once_per: float | None) -> dict[str, object] | None:  # noqa: ARG002 - the Recorder's interface
        """Without history there is no earlier run to know about."""
        return None

    def started(self, child_pid: int | None) -> None:
        """Nothing to record."""

    def finished(
        self,
        outcome: str,
        exit_code: int,
        signal: str | None,  # noqa: ARG002 - the Recorder's interface
        duration: float,
        *,
        defer_alerts: bool = False,  # noqa: ARG002 - the Recorder's interface
    ) -> None:
        """Write the metrics (streaks counted on from the file's previous values)."""
        self._metrics(outcome, exit_code, duration)

    def skipped(self, reason: str, holder_fields: dict[str, object], exit_code: int) -> None:  # noqa: ARG002 - the Recorder's interface
        """Write the metrics (streaks counted on from the file's previous values)."""
        self._metrics("skipped", exit_code, None)

    def exec_failed(self, exit_code: int) -> None:
        """Write the metrics."""
        self._metrics("exec_failed", exit_code, 0.0)

    def flush(self) -> None:
        """Nothing is ever deferred."""

    def _metrics(self, outcome: str, exit_code: int, duration: float | None) -> None:
        if self._config.metrics_file:
            sample = metrics.Sample(
                key=self._label,
                outcome=outcome,
                exit_code=exit_code,
                started=self._started,
                finished=time.time(),
                duration=duration,
                skip_streak=None,
                failure_streak=None,
            )
            metrics.write(self._config.metrics_file, sample, self._log)


class Recorder:
    """Writes a run's history rows and raises streak alerts; never raises, never blocks long.

    Each call uses a short-lived connection of its own, on a thread of its own: the caller
    waits at most ``config.timeout`` (``started`` does not wait at all), however silent the
    network. The first failure in a run is one ``history_failed`` warning (later ones are
    debug lines); after a failure to connect or a timeout the recorder stops asking the
    database for the rest of the run, so a dead database costs the job one timeout.
    """

    def __init__(
        self,
        target: db.Target,
        identity: Identity,
        keys: tuple[Key, ...],
        *,
        mode: str,
        program: str,
        config: HistoryConfig,
        log: FilteringBoundLogger,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self._target = dataclasses.replace(
            target, connect_timeout=min(target.connect_timeout, CONNECT_TIMEOUT)
        )
        self._identity = identity
        self._label = describe(keys)
        self._config = config
        self._log = log
        self._environ = environ
        self._app_name = db.application_name(self._label)
        self._row: dict[str, object] = {
            "run_id": identity.run_id,
            "key": self._label,
            "lock_ids": [key.lock_id for key in keys],
            "mode": mode,
            "host": identity.host,
            "pid": identity.pid,
            # WARNING: the program name only; arguments can carry secrets.
            "program": program,
        }
        self._created = time.monotonic()
        self._started_wall = time.time()
        self._acquired_at: dt.datetime | None = None
        self._warned = False
        self._failures = 0
        self._gave_up = False
        self._pending: list[dict[str, object]] = []
        self._start_call: _Call[Any] | None = None
        self._in_flight: psycopg.Connection[tuple[Any, ...]] | None = None
        self._in_flight_lock = threading.Lock()
        #: --keep-output (operators): the alert hook's event carries the output tails.
        self.output: Capture | None = None

    # --- the interface the runner calls -------------------------------------------------------

    def acquired(self, once_per: float | None) -> dict[str, object] | None:
        """Called right after the lock is taken: mark abandoned runs (logging each).

        With ``once_per`` (seconds), return the run (run_id, host, pid, started_at, outcome,
        window_start) that makes this one redundant: the runner then skips with reason
        ``already_ran``. None otherwise, and whenever the history cannot tell.
        """

        def work(conn: Connection) -> tuple[list[tuple[Any, ...]], tuple[Any, ...] | None]:
            now = conn.execute(sql.RUNS_NOW).fetchone()
            # The run's start on the database's clock is when it took the lock: the
            # --once-per window a run belongs to must not depend on how long spawning took.
            self._acquired_at = now[0] if now else None
            abandoned = conn.execute(sql.RUNS_ABANDON, self._row).fetchall()
            earlier = None
            if once_per is not None:
                params = {**self._row, "window": once_per}
                earlier = conn.execute(sql.RUNS_ALREADY_RAN, params).fetchone()
            return abandoned, earlier

        deadline = time.monotonic() + self._config.timeout
        failures = self._failures
        result = self._attempt("checking earlier runs", work, create=False, deadline=deadline)
        if result is None:
            if once_per is not None and (self._gave_up or self._failures > failures):
                # WARNING: fail closed: without the history we cannot know whether this
                # window's run already happened (--on-db-error run opts out).
                raise LockStoreUnavailable(
                    "--once-per: the run history cannot be read, so whether this window "
                    "already had its run is unknown",
                    reason="history_unavailable",
                )
            return None
        abandoned, earlier = result
        for run_id, label, host, pid, started_at in abandoned:
            self._log.warning(
                "abandoned_run",
                abandoned_run_id=str(run_id),
                abandoned_key=label,
                abandoned_host=host,
                abandoned_pid=pid,
                abandoned_started_at=iso(started_at),
                note="still marked running, but its lock is ours now: it died (lease "
                "mode: or its lease expired)",
            )
        if earlier is None:
            return None
        run_id, host, pid, started_at, outcome, window_start = earlier
        return {
            "run_id": str(run_id),
            "host": host,
            "pid": pid,
            "started_at": iso(started_at),
            "outcome": outcome,
            "window_start": iso(window_start),
        }

    def started(self, child_pid: int | None) -> None:
        """Insert the ``running`` row (call it right after the child was spawned).

        Returns at once: the row is written on a thread of its own while the run goes on
        (the supervisor must not wait for the history); ``finished`` waits for it.
        """
        params = {**self._row, "child_pid": child_pid, "started_at": self._acquired_at}
        self._start_call = self._begin(
            "recording the start", lambda conn: conn.execute(sql.RUNS_START, params), create=True
        )

    def finished(
        self,
        outcome: str,
        exit_code: int,
        signal: str | None,
        duration: float,
        *,
        defer_alerts: bool = False,
    ) -> None:
        """Record how the run ended, prune, raise a failure-streak alert, write metrics.

        Call it before the lock is released: until then our row says ``running``, and the
        next run would take us for a dead one. ``defer_alerts`` keeps the alert hook (it
        may take up to ``alert_timeout``) for ``flush()``, to be called after the release.
        """

        def work(conn: Connection) -> tuple[int, dt.datetime | None]:
            streak = 0
            since: dt.datetime | None = None
            if outcome in FAILURES:
                previous = conn.execute(sql.RUNS_PREVIOUS_FINISHED, self._row).fetchone()
                streak = 1
                if previous is not None and previous[0] in FAILURES:
                    streak, since = int(previous[1]) + 1, previous[2]
            params = {
                **self._row,
                "outcome": outcome,
                "exit_code": exit_code,
                "signal": signal,
                "duration": duration,
                "streak": streak,
                "streak_since": since,
                "started_at": self._acquired_at,
            }
            row = conn.execute(sql.RUNS_FINISH, params).fetchone()
            self._prune_within(conn)
            return (int(row[0]), row[1]) if row else (streak, since)

        deadline = time.monotonic() + self._config.timeout
        start_call, self._start_call = self._start_call, None
        if start_call is not None:
            # Its time counts from when it began: a start still unwritten after the whole
            # run means the database is not answering, and the end must not wait for it.
            self._settle(start_call, min(deadline, start_call.began + self._config.timeout))
        result = self._attempt("recording the end", work, create=True, deadline=deadline)
        self._metrics(
            outcome,
            exit_code,
            duration,
            skip_streak=0,
            failure_streak=result[0] if result else None,
        )
        alert_after = self._config.alert_after
        if result is None or not alert_after or outcome not in FAILURES:
            return
        streak, since = result
        if streak >= alert_after:
            fields: dict[str, object] = {
                "count": streak,
                "since": iso(since),
                "threshold": alert_after,
                "outcome": outcome,
                "exit_code": exit_code,
                "signal": signal,
            }
            self._alert("failure_streak", fields, defer=defer_alerts)

    def skipped(self, reason: str, holder_fields: dict[str, object], exit_code: int) -> None:
        """Record a skip (``locked`` or ``already_ran``), prune, maybe alert, write metrics.

        A ``locked`` skip extends this host's streak behind the same holder. The alert goes
        out when it reaches ``alert_after`` and with every skip after that, but only from
        the first host of a fleet to reach each count: one alert per round, not per host.
        """
        ref = holder_ref(holder_fields) if reason == "locked" else None

        def work(conn: Connection) -> tuple[int, dt.datetime | None, int]:
            mine, anyone = 0, 0
            since: dt.datetime | None = None
            if ref is not None:
                params = {**self._row, "holder_ref": ref}
                # WARNING: hosts skipping behind this holder at the same moment must take
                # turns (until our COMMIT: _transaction runs us inside BEGIN), or they all
                # read the same old streaks and all alert.
                conn.execute(sql.RUNS_SKIP_SERIALIZE, params)
                chain = conn.execute(sql.RUNS_SKIP_CHAIN, params).fetchone()
                if chain is not None:
                    mine, since, anyone = int(chain[0] or 0), chain[1], int(chain[2] or 0)
            streak = mine + 1 if reason == "locked" else 0
            params = {
                **self._row,
                "reason": reason,
                "exit_code": exit_code,
                "duration": round(time.monotonic() - self._created, 3),
                "streak": streak,
                "streak_since": since,
                "holder_ref": ref,
                "holder": Jsonb(holder_fields, dumps=_json_dumps) if holder_fields else None,
            }
            inserted = conn.execute(sql.RUNS_SKIP, params).fetchone()
            self._prune_within(conn)
            if inserted is None:  # pragma: no cover - RETURNING always yields the row
                return streak, since, anyone
            return int(inserted[0]), inserted[1], anyone

        deadline = time.monotonic() + self._config.timeout
        result = self._attempt("recording the skip", work, create=True, deadline=deadline)
        self._metrics(
            "skipped",
            exit_code,
            None,
            skip_streak=result[0] if result else None,
            failure_streak=None,
        )
        alert_after = self._config.alert_after
        if result is None or not alert_after or reason != "locked":
            return
        streak, since, anyone = result
        if streak >= alert_after and streak > anyone:
            fields: dict[str, object] = {
                "count": streak,
                "since": iso(since),
                "threshold": alert_after,
                "reason": reason,
                "exit_code": exit_code,
                **holder_fields,
            }
            self._alert("skip_streak", fields)

    def exec_failed(self, exit_code: int) -> None:
        """The command could not be started: a finished run with outcome ``exec_failed``."""
        self.finished("exec_failed", exit_code, None, 0.0)

    def flush(self) -> None:
        """Run the alert hooks that ``finished(defer_alerts=True)`` kept back."""
        pending, self._pending = self._pending, []
        for event in pending:
            self._run_hook(event)

    # --- internals ----------------------------------------------------------------------------

    def _attempt(
        self, during: str, work: Callable[[Connection], T], *, create: bool, deadline: float
    ) -> T | None:
        """Run ``work`` in one short transaction, waiting until ``deadline`` at most."""
        return self._settle(self._begin(during, work, create=create), deadline)

    def _begin(
        self, during: str, work: Callable[[Connection], T], *, create: bool
    ) -> _Call[T] | None:
        """Start ``work`` on a thread of its own (None: the recorder has given up)."""
        if self._gave_up:
            return None
        return _Call(during, lambda call: self._session(call, work, create=create))

    def _settle(self, call: _Call[T] | None, deadline: float) -> T | None:
        """The call's result; on database trouble or no answer in time, warn and go on."""
        if call is None:
            return None
        if not call.wait(deadline):
            call.abandoned.set()
            self._gave_up = True
            self._interrupt()
            self._failed(call.during, f"no answer within {self._config.timeout:g}s")
            return None
        exc = call.error
        if exc is None:
            return call.result
        if isinstance(exc, JobrunError):  # from db.connect: unreachable or refused
            self._gave_up = True
            self._failed(call.during, str(exc))
        elif isinstance(exc, psycopg.Error):
            # Connection trouble and timeouts cost time: do not pay for them twice.
            if isinstance(exc, psycopg.OperationalError):
                self._gave_up = True
            self._failed(call.during, db.one_line(exc, self._target))
        else:
            raise exc
        return None

    def _session(
        self, call: _Call[T], work: Callable[[Connection], T], *, create: bool
    ) -> T | None:
        """On the call's thread: connect, run ``work`` in a transaction, disconnect.

        A missing table is created when ``create`` (the first write to a fresh database);
        a read of a table that does not exist yet finds nothing.
        """
        conn = db.connect(self._target, app_name=self._app_name)
        with self._in_flight_lock:
            self._in_flight = conn
        try:
            if call.abandoned.is_set():  # connected too late: the caller has moved on
                return None
            try:
                return self._transaction(conn, work)
            except errors.UndefinedTable:
                if not create:
                    return None
                conn.execute(sql.ROLLBACK)
                ensure_schema(conn)
                return self._transaction(conn, work)
        finally:
            with self._in_flight_lock:
                self._in_flight = None
            conn.close()

    def _interrupt(self) -> None:
        """Make a call that hangs on a silent network fail now, on its own thread."""
        with self._in_flight_lock:
            conn = self._in_flight
            if conn is None or conn.closed:
                return
            # shutdown(2) acts on the socket, not the descriptor, so a duplicate will do;
            # the lock keeps the connection from being closed (and its fd reused) meanwhile.
            with contextlib.suppress(OSError), socket.socket(fileno=os.dup(conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _transaction(conn: Connection, work: Callable[[Connection], T]) -> T:
        """``work`` in one transaction; on an error, closing the connection ends it."""
        conn.execute(sql.BEGIN)
        conn.execute(sql.RUNS_LOCAL_TIMEOUTS, {"ms": str(int(STATEMENT_TIMEOUT * 1000))})
        result = work(conn)
        conn.execute(sql.COMMIT)
        return result

    def _failed(self, during: str, error: str) -> None:
        self._failures += 1
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

    def _prune_within(self, conn: Connection) -> None:
        """Prune the key's old rows in the writing transaction, one connection for both.

        Under a savepoint: a prune that fails (a lock, a privilege) is a debug line and
        never costs the row just written.
        """
        conn.execute(sql.SAVEPOINT_PRUNE)
        try:
            conn.execute(sql.RUNS_PRUNE, {"key": self._label, "keep": self._config.keep})
        except psycopg.Error as exc:
            conn.execute(sql.ROLLBACK_TO_PRUNE)
            self._log.debug("history_prune_failed", error=db.one_line(exc, self._target))
            return
        conn.execute(sql.RELEASE_PRUNE)

    def _metrics(
        self,
        outcome: str,
        exit_code: int,
        duration: float | None,
        *,
        skip_streak: int | None,
        failure_streak: int | None,
    ) -> None:
        if not self._config.metrics_file:
            return
        sample = metrics.Sample(
            key=self._label,
            outcome=outcome,
            exit_code=exit_code,
            started=self._started_wall,
            finished=time.time(),
            duration=duration,
            skip_streak=skip_streak,
            failure_streak=failure_streak,
        )
        metrics.write(self._config.metrics_file, sample, self._log)

    def _alert(self, name: str, fields: dict[str, object], *, defer: bool = False) -> None:
        """Log the streak at error level and hand it to the ``--on-alert`` hook, if any."""
        self._log.error(name, **fields)
        if not self._config.on_alert:
            return
        event: dict[str, object] = {
            "event": name,
            "key": self._label,
            "lock_ids": self._row["lock_ids"],
            "run_id": self._identity.run_id,
            "host": self._identity.host,
            "pid": self._identity.pid,
            "mode": self._row["mode"],
            **fields,
        }
        if self.output is not None and self.output.used:  # --- operators: --keep-output
            from jobrun import tail  # noqa: PLC0415 - only runs that keep output

            event.update(tail.fields(self.output, limit=tail.ALERT_LIMIT))
        if defer:
            self._pending.append(event)
        else:
            self._run_hook(event)

    def _run_hook(self, event: dict[str, object]) -> None:
        if self._config.on_alert:
            alerts.deliver(
                self._config.on_alert,
                event,
                timeout=self._config.alert_timeout,
                log=self._log,
                environ=self._environ,
                secrets=self._target.secrets,
            )


def _json_dumps(value: object) -> str:
    return json.dumps(value, default=str)
