"""What a run tells the outside: ``--metrics-file``, streak alerts and their ``--on-alert`` hook."""

from __future__ import annotations

import time
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import threading
    from collections.abc import Callable, Mapping

    from structlog.typing import FilteringBoundLogger

    from jobrun.history.config import HistoryConfig
    from jobrun.locks import Identity
    from jobrun.run.tail import Capture


#: Alerts said at warning level (the others are errors).
WARNINGS = frozenset({"recovered", "slow_run"})


@dataclass
class Notifier:
    """Writes the metrics file and raises alerts (error line + hook) for one run."""

    label: str
    lock_ids: list[int]
    identity: Identity
    _: KW_ONLY
    mode: str
    config: HistoryConfig
    log: FilteringBoundLogger
    #: The hook's environment and what it must never show: never in the repr.
    environ: Mapping[str, str] | None = field(default=None, repr=False)
    secrets: tuple[str, ...] = field(default=(), repr=False)
    #: --keep-output: the alert hook's event carries the output tails.
    output: Capture | None = None
    _started: float = field(default_factory=time.time, init=False)
    _pending: list[dict[str, object]] = field(default_factory=list, init=False)
    _background: list[threading.Thread] = field(default_factory=list, init=False)

    def metrics(
        self,
        outcome: str,
        exit_code: int,
        duration: float | None,
        *,
        skip_streak: int | None = None,
        failure_streak: int | None = None,
    ) -> None:
        """Write ``--metrics-file`` (streaks None: counted on from the file's values)."""
        if not self.config.metrics_file:
            return
        from jobrun.run import metrics  # noqa: PLC0415 - only with --metrics-file: a lean run path

        sample = metrics.Sample(
            key=self.label,
            outcome=outcome,
            exit_code=exit_code,
            started=self._started,
            finished=time.time(),
            duration=duration,
            skip_streak=skip_streak,
            failure_streak=failure_streak,
        )
        metrics.write(self.config.metrics_file, sample, self.log)

    def alert(
        self,
        name: str,
        fields: dict[str, object],
        *,
        defer: bool = False,
        background: bool = False,
        logged: bool = False,
    ) -> None:
        """Log a streak at error level (``recovered``, ``slow_run``: warning), hand it to the hook.

        ``defer`` keeps the hook (it may take up to ``alert_timeout``) for ``flush``;
        ``background`` runs it now on a thread of its own (``slow_run``: while the child
        runs, the supervisor never waits for it), which ``flush`` waits for. ``logged``:
        the line was said already (the hook only).
        """
        if not logged:
            emit = self.log.warning if name in WARNINGS else self.log.error
            emit(name, **fields)
        if not self.config.on_alert:
            return
        event: dict[str, object] = {
            "event": name,
            "key": self.label,
            "lock_ids": self.lock_ids,
            "run_id": self.identity.run_id,
            "host": self.identity.host,
            "pid": self.identity.pid,
            "mode": self.mode,
            **fields,
        }
        if self.output is not None and self.output.used and not background:
            from jobrun.run import tail  # noqa: PLC0415 - only runs that keep output

            event.update(tail.fields(self.output, limit=tail.ALERT_LIMIT))
        if defer:
            self._pending.append(event)
        elif background:
            from jobrun import threads  # noqa: PLC0415 - only a slow run's hook

            hook = threads.start(self._run_hook, event, name="jobrun-hook")
            self._background.append(hook)
        else:
            self._run_hook(event)

    def flush(self) -> None:
        """Run the hooks that ``alert(defer=True)`` kept back (after one still running)."""
        running, self._background = self._background, []
        for thread in running:
            thread.join()  # bounded: the hook is killed at alert_timeout
        pending, self._pending = self._pending, []
        for event in pending:
            self._run_hook(event)

    def _run_hook(self, event: dict[str, object]) -> None:
        if not self.config.on_alert:
            return
        from jobrun.run import alerts  # noqa: PLC0415 - only a run with --on-alert needs it

        alerts.deliver(
            self.config.on_alert,
            event,
            timeout=self.config.alert_timeout,
            log=self.log,
            environ=self.environ,
            secrets=self.secrets,
        )


class NoHistory:
    """The recorder of a run without history: nothing in the database, metrics if asked."""

    def __init__(
        self,
        notifier: Notifier | None = None,
        pauses: Callable[[], dict[str, object] | None] | None = None,
    ) -> None:
        self.notifier = notifier
        self._pauses = pauses

    def use_lock_ids(self, lock_ids: list[int]) -> None:
        """Nothing is recorded."""

    def paused(self) -> dict[str, object] | None:
        """The pause of this key in force (a statement of its own: there is no history call)."""
        return self._pauses() if self._pauses is not None else None

    def acquired(self, once_per: float | None) -> dict[str, object] | None:  # noqa: ARG002 - the Recorder's interface
        """Without history there is no earlier run to know about."""
        return None

    def note(self, **columns: object) -> None:
        """No row to add the columns to."""
        del columns

    def started(self, child_pid: int | None) -> None:
        """Nothing to record."""

    def finished(self, outcome: str, exit_code: int, signal: str | None, duration: float) -> None:  # noqa: ARG002 - the Recorder's interface
        """Write the metrics (streaks counted on from the file's previous values)."""
        if self.notifier is not None:
            self.notifier.metrics(outcome, exit_code, duration)

    def skipped(self, reason: str, holder_fields: Mapping[str, object], exit_code: int) -> None:  # noqa: ARG002 - the Recorder's interface
        """Write the metrics (streaks counted on from the file's previous values)."""
        if self.notifier is not None:
            self.notifier.metrics("skipped", exit_code, None)

    def exec_failed(self, exit_code: int) -> None:
        """Write the metrics."""
        if self.notifier is not None:
            self.notifier.metrics("exec_failed", exit_code, 0.0)

    def unmet(self) -> dict[str, object] | None:
        """--requires needs the history (refused with --no-history)."""
        return None

    def recent_durations(self) -> tuple[int, float | None] | None:
        """--warn-after auto needs the history (refused with --no-history)."""
        return None

    def slow(self, fields: dict[str, object]) -> None:
        """--warn-after: the hook (on a thread; the line was said already)."""
        if self.notifier is not None:
            self.notifier.alert("slow_run", fields, background=True, logged=True)

    def flush(self) -> None:
        """The hook of a slow run, if one is still running."""
        if self.notifier is not None:
            self.notifier.flush()
