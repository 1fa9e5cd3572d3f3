"""A run's rows in ``jobrun.runs``: acquired, finished or skipped; abandoned runs; streaks."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg.types.json import Jsonb

from jobrun import db, sql
from jobrun.exitcodes import LockStoreUnavailable
from jobrun.history.calls import Calls
from jobrun.history.config import FAILURES, holder_ref, iso, pause
from jobrun.keys import Key, describe, names
from jobrun.run.notify import Notifier

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import Mapping

    from structlog.typing import FilteringBoundLogger

    from jobrun.db.server_session import ServerSession
    from jobrun.history.config import HistoryConfig
    from jobrun.locks import Identity


class Recorder:
    """Writes a run's history rows and raises streak alerts; never raises, never blocks long.

    A run costs two history calls (one message each): ``acquired`` (mark dead runs
    abandoned, check ``--once-per``, insert our ``running`` row, note the database's deadlock
    count, claim skip streaks that ended) and ``finished`` (the outcome, the failure streak,
    the deadlocks during the run, pruning). A skip costs one. With ``session`` they go over
    the run's server session: session mode, the lock session (no other server session is
    ever opened); lease mode, the attempt's connection (the start, a skip) and the
    release's (the end). The first failure in a run is one ``history_failed`` warning
    (later ones are debug lines).
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
        secrets: tuple[str, ...] = (),
        session: ServerSession | None = None,
        checks: StartChecks | None = None,
    ) -> None:
        label = describe(keys)
        #: --tz, --requires, --warn-after auto: what the start message also asks.
        self._checks = checks if checks is not None else StartChecks()
        self._unmet: dict[str, object] | None = None
        self._durations: tuple[int, float | None] | None = None
        #: --warn-after: the bound the run went past (the end row says so).
        self._slow_after: float | None = None
        self._config = config
        self._log = log
        self._calls = Calls(
            target,
            app_name=db.application_name(label),
            timeout=config.timeout,
            log=log,
            session=session,
        )
        self.notifier = Notifier(
            label,
            [key.lock_id for key in keys],
            identity,
            mode=mode,
            config=config,
            log=log,
            environ=environ,
            secrets=(*target.secrets, *secrets),
        )
        self._row: dict[str, object] = {
            "run_id": identity.run_id,
            "key": label,
            "lock_ids": [key.lock_id for key in keys],
            "mode": mode,
            "host": identity.host,
            "pid": identity.pid,
            # WARNING: the program name only; arguments can carry secrets.
            "program": program,
            "keep": config.keep,
            "alert_after": config.alert_after,
            "repeat": config.alert_repeat,
            # A pause of the run's label, or of any of its key names, skips it.
            "pause_keys": names(keys),
            "expect_every": config.expect_every,
            "expect_grace": config.expect_grace,
        }
        self._created = time.monotonic()
        self._pause: dict[str, object] | None = None
        self._acquired_at: dt.datetime | None = None
        self._deadlocks_at_start: int | None = None
        self._child_pid: int | None = None
        #: Columns the run's options add to its row (``note``): none in a plain run.
        self._noted: dict[str, object] = {}

    @property
    def calls(self) -> Calls:
        """The database calls made so far (round trips, sessions opened, failures)."""
        return self._calls

    def acquired(self, once_per: float | None) -> dict[str, object] | None:
        """Called right after the lock is taken: mark abandoned runs, insert our running row.

        With ``once_per`` (seconds), return the run (run_id, host, pid, started_at, outcome,
        window_start) that makes this one redundant: the runner then skips with reason
        ``already_ran``. Raises LockStoreUnavailable (``history_unavailable``) when
        ``once_per`` is given and the history cannot be read and written: whether this
        window already had its run is then unknown, and the promise is to fail closed.
        Raises SchemaTooNew (``schema_too_new``, whatever ``once_per``) where a newer
        jobrun upgraded the schema past what this one may write.
        """
        # The pause and the expectation ride in the same message: no extra round trip.
        # So do --requires and --warn-after auto (only with their options: checks).
        checks = self._checks.statements()
        result = self._calls.run(
            "checking earlier runs",
            (
                sql.RUNS_ABANDON,
                sql.RUNS_ALREADY_RAN,
                sql.PAUSES_IN_FORCE,
                sql.RUNS_ACQUIRED,
                sql.RUNS_SKIPS_RECOVERED,
                sql.EXPECTATION,
                *checks,
            ),
            {**self._row, "window": once_per, **self._checks.params()},
            without_control=(
                sql.RUNS_ABANDON,
                sql.RUNS_ALREADY_RAN,
                sql.NO_ROWS,
                sql.RUNS_ACQUIRED_UNPAUSED,
                sql.RUNS_SKIPS_RECOVERED,
                sql.NO_ROWS,
                *checks,
            ),
            # The run's first write: a schema this jobrun may not write stops it here.
            refuse_newer=True,
        )
        if result is None:
            if once_per is not None:
                raise LockStoreUnavailable(
                    "--once-per: the run history cannot be read and written, so whether "
                    "this window already had its run is unknown",
                    reason="history_unavailable",
                )
            if self._checks.requires:
                raise LockStoreUnavailable(
                    "--requires: the run history cannot be read, so whether the required "
                    "keys succeeded is unknown",
                    reason="history_unavailable",
                )
            return None
        abandoned, earlier, paused, ours, recovered, _ = result[:6]
        self._read_checks(result[6:])
        self._pause = pause_fields(paused[0]) if paused else None
        for run in abandoned:
            self._log.warning(
                "abandoned_run",
                abandoned_run_id=str(run["run_id"]),
                abandoned_key=run["key"],
                abandoned_host=run["host"],
                abandoned_pid=run["pid"],
                abandoned_started_at=iso(run["started_at"]),
                note="still marked running, but its lock is ours now: it died (lease "
                "mode: or its lease expired)",
            )
        for streak in recovered:
            self._recovered("skip_streak", streak["count"], streak["since"], streak["ended"])
        if ours:
            # The run's start on the database's clock is when it took the lock: the
            # --once-per window a run belongs to must not depend on how long spawning took.
            self._acquired_at = ours[0]["started_at"]
            self._deadlocks_at_start = ours[0]["deadlocks"]
        if not earlier:
            return None
        found = earlier[0]
        return {
            "run_id": str(found["run_id"]),
            "host": found["host"],
            "pid": found["pid"],
            "started_at": iso(found["started_at"]),
            "outcome": found["outcome"],
            "window_start": iso(found["window_start"]),
        }

    def _read_checks(self, found: list[list[dict[str, Any]]]) -> None:
        """What the start message's --requires and --warn-after auto statements found."""
        at = 0
        if self._checks.requires:
            self._unmet = self._requirement(found[at])
            at += 1
        if self._checks.durations:
            row = found[at][0] if found[at] else {}
            self._durations = (int(row.get("runs") or 0), row.get("p95"))

    def _requirement(self, rows: list[dict[str, Any]]) -> dict[str, object] | None:
        """The first required key that is not met, as a skip's fields (None: all are met).

        Raises LockStoreUnavailable (``not_granted``, fails closed) for a required key this
        role may not read: row-level security would show it as one that never ran.
        """
        from jobrun.run import requires  # noqa: PLC0415 - only with --requires

        if requires.may_hide(rows):
            unreadable = self._calls.run(
                "checking the required keys' grants",
                (sql.RUNS_REQUIRES_UNREADABLE,),
                self._checks.params(),
            )
            if unreadable is None:
                raise LockStoreUnavailable(
                    "--requires: whether this role may read the required keys cannot be told",
                    reason="history_unavailable",
                )
            if unreadable[0]:
                raise requires.not_readable([row["key"] for row in unreadable[0]])
        return requires.unmet(rows, self._checks.requires_within)

    def unmet(self) -> dict[str, object] | None:
        """--requires: the first required key not met, as ``required_*`` fields (None: met)."""
        return self._unmet

    def recent_durations(self) -> tuple[int, float | None] | None:
        """--warn-after auto: (successes with a duration among the last 30, their p95)."""
        return self._durations

    def slow(self, fields: dict[str, object]) -> None:
        """--warn-after: the run is past its bound: the hook now, the end row later."""
        bound = fields.get("bound")
        self._slow_after = float(bound) if isinstance(bound, (int, float)) else None
        self.notifier.alert("slow_run", fields, background=True, logged=True)

    def use_lock_ids(self, lock_ids: list[int]) -> None:
        """Record the run under these lock ids (``--slots``: the slot taken)."""
        self._row["lock_ids"] = list(lock_ids)

    def paused(self) -> dict[str, object] | None:
        """The pause of this key that ``acquired`` found in force (None: not paused)."""
        return self._pause

    def note(self, **columns: object) -> None:
        """Columns for the run's last row (``sql.history.RUNS_NOTED_COLUMNS``).

        --coalesce, --jitter, --retries: written by one more statement in that row's message.
        """
        self._noted.update(columns)

    def _with_notes(self, statements: list[str], params: dict[str, object]) -> None:
        """Add the noted columns' UPDATE to a last message (nothing in a plain run)."""
        if not self._noted:
            return
        from jobrun.sql import history  # noqa: PLC0415 - only runs that note columns

        statements.append(history.runs_note(tuple(self._noted)))
        params.update({f"note_{name}": value for name, value in self._noted.items()})

    def started(self, child_pid: int | None) -> None:
        """Remember the child's pid for the end of the run (the running row already exists)."""
        self._child_pid = child_pid

    def finished(self, outcome: str, exit_code: int, signal: str | None, duration: float) -> None:
        """Record how the run ended, prune, raise or end a failure-streak alert, write metrics.

        Call it before the lock is released: until then our row says ``running``, and the
        next run would take us for a dead one. The alert hook (it may take up to
        ``alert_timeout``) waits for ``flush()``, called after the release.
        """
        params = {
            **self._row,
            "outcome": outcome,
            "exit_code": exit_code,
            "signal": signal,
            "duration": duration,
            "child_pid": self._child_pid,
            "started_at": self._acquired_at,
            "failed": outcome in FAILURES,
            "deadlocks_at_start": self._deadlocks_at_start,
        }
        statements = [sql.RUNS_FINISH, sql.RUNS_PRUNE]
        if self._slow_after is not None:
            # --warn-after: the bound the run went past, in the same message.
            statements.append(sql.RUNS_MARK_SLOW)
            params["slow_after"] = self._slow_after
        kept = self.notifier.output
        if kept is not None and kept.used and exit_code != 0:
            # --keep-output: a failed run's tails ride in the end row's message.
            statements.append(sql.RUNS_STORE_TAIL)
            params.update(stdout=kept.stdout_tail, stderr=kept.stderr_tail)
        self._with_notes(statements, params)
        # The run's last call: it carries the lock's release (no round trip of its own).
        result = self._calls.run(
            "recording the end",
            statements,
            params,
            last=True,
            # Without the extras (tails, slow_after) when the server refuses them: a role
            # that may not add their columns to an older table keeps its end row.
            otherwise=statements[:2] if len(statements) > 2 else None,  # noqa: PLR2004
            retry=True,
        )
        row = result[0][0] if result else None
        if kept is not None and result and any(r and "tails_stored" in r[0] for r in result):
            # The tails' result came back (a refused call was sent again without them:
            # they are then stored after the release, on a session of their own, which says
            # why they could not be).
            kept.stored = True  # not again after the release
            self._log.info(
                "output_stored",
                stdout_bytes=len(kept.stdout_tail),
                stderr_bytes=len(kept.stderr_tail),
            )
        self.notifier.metrics(
            outcome,
            exit_code,
            duration,
            skip_streak=0,
            failure_streak=row["streak"] if row else None,
        )
        self._log_calls()
        if row is None:
            return
        if row["deadlocks"]:
            self._log.warning(
                "deadlocks_during_run",
                count=row["deadlocks"],
                note="deadlocks in this database (any session's) while the run ran",
            )
        if row["alert"]:
            fields: dict[str, object] = {
                **self._streak(row),
                "outcome": outcome,
                "exit_code": exit_code,
                "signal": signal,
            }
            self.notifier.alert("failure_streak", fields, defer=True)
        if row["recovered_count"]:
            self._recovered(
                "failure_streak",
                row["recovered_count"],
                row["recovered_since"],
                row["finished_at"],
            )

    def skipped(self, reason: str, holder_fields: Mapping[str, object], exit_code: int) -> None:
        """Record a skip (``locked`` or ``already_ran``), prune, maybe alert, write metrics.

        A ``locked`` skip extends this host's streak behind the same holder. It alerts when
        it reaches ``alert_after``, then at most every ``alert_repeat`` while it lasts, from
        whichever host of a fleet is first (the time of the last alert is in the database).
        """
        params = {
            **self._row,
            "reason": reason,
            # A --coalesce arrival that found the queue taken skips behind the same holder.
            "locked": reason in {"locked", "queued"},
            "exit_code": exit_code,
            "duration": round(time.monotonic() - self._created, 3),
            "holder_ref": holder_ref(holder_fields) if reason == "locked" else None,
            "holder": Jsonb(dict(holder_fields), dumps=_json_dumps) if holder_fields else None,
        }
        statements = [sql.RUNS_SKIP_SERIALIZE, sql.RUNS_SKIP, sql.RUNS_PRUNE]
        self._with_notes(statements, params)
        result = self._calls.run(
            "recording the skip",
            statements,
            params,
            last=True,
            otherwise=statements[:3] if len(statements) > 3 else None,  # noqa: PLR2004
        )
        row = result[1][0] if result else None
        self.notifier.metrics(
            "skipped", exit_code, None, skip_streak=row["streak"] if row else None
        )
        self._log_calls()
        if row is not None and row["alert"]:
            fields: dict[str, object] = {
                **self._streak(row),
                "reason": reason,
                "exit_code": exit_code,
                **holder_fields,
            }
            self.notifier.alert("skip_streak", fields)

    def exec_failed(self, exit_code: int) -> None:
        """The command could not be started: a finished run with outcome ``exec_failed``."""
        self.finished("exec_failed", exit_code, None, 0.0)

    def flush(self) -> None:
        """Run the alert hooks that were deferred until the lock was released."""
        self.notifier.flush()

    def _recovered(
        self,
        streak: str,
        count: int,
        since: dt.datetime | None,
        ended: dt.datetime | None,
    ) -> None:
        """A streak that alerted is over: say so once, with how long it lasted."""
        lasted = (ended - since).total_seconds() if ended and since else None
        fields: dict[str, object] = {
            "streak": streak,
            "count": count,
            "since": iso(since),
            "duration": None if lasted is None else round(lasted, 3),
        }
        self.notifier.alert("recovered", fields, defer=True)

    def _streak(self, row: Mapping[str, Any]) -> dict[str, object]:
        """A streak alert's common fields: how long the streak is, since when, the threshold."""
        return {
            "count": row["streak"],
            "since": iso(row["streak_since"]),
            "threshold": self._config.alert_after,
        }

    def _log_calls(self) -> None:
        self._log.debug(
            "history_calls",
            round_trips=self._calls.round_trips,
            sessions=self._calls.sessions,
            failures=self._calls.failures,
        )


@dataclass(frozen=True)
class StartChecks:
    """What the history's start message also asks: --tz, --requires, --warn-after auto."""

    #: --tz: the zone of --once-per's day windows (None: UTC).
    tz: str | None = None
    #: --requires: key labels whose last finished run must be a recent success.
    requires: tuple[str, ...] = ()
    requires_within: float = 86400.0
    #: --warn-after auto: the key's recent successful durations.
    durations: bool = False

    def statements(self) -> tuple[str, ...]:
        """The start message's extra statements, in the order their results are read."""
        return (
            *((sql.RUNS_REQUIREMENTS,) if self.requires else ()),
            *((sql.RUNS_RECENT_DURATIONS,) if self.durations else ()),
        )

    def params(self) -> dict[str, object]:
        """Their parameters (``tz`` always: the --once-per window statement names it)."""
        return {
            "tz": self.tz,
            "requires": list(self.requires),
            "requires_within": self.requires_within,
        }


def _json_dumps(value: object) -> str:
    return json.dumps(value, default=str)


def pause_fields(row: Mapping[str, object]) -> dict[str, object]:
    """``paused_*`` log fields of a pause row (``paused_by_*`` for who paused it)."""
    fields = {
        f"paused_by_{name}" if name in ("host", "user", "pid") else f"paused_{name}": value
        for name, value in pause(row).items()
    }
    return {**fields, "paused_key": row["key"]}
