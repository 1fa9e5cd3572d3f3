"""Who hears of a run's steps: listeners, composed once around the run's one lifecycle."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence


class Listener:
    """One party the run tells of its steps; each method does nothing unless overridden.

    The steps, in order: ``skipped`` (and nothing else), or ``preparing``, then
    ``not_started`` or ``started`` / ``exited`` / ``finished``; ``released`` always last,
    after the lock is given back. Only ``preparing`` may stop the run.
    """

    #: Whether it hears of a run without its lock (``--on-db-error run``).
    unguarded_too = True

    def skipped(self, reason: str, fields: Mapping[str, Any], exit_code: int) -> None:
        """The run skipped: the lock was held, the key paused, or an earlier run did it."""

    def preparing(self, env: dict[str, str]) -> int | None:
        """The lock is held, the child about to start: add to its environment.

        Returns an exit status (the refusal already logged) to end the run without the
        child; raises LockLost when the lock is found gone.
        """
        del env
        return None

    def stdio(self) -> tuple[int, int] | None:
        """The child's stdout and stderr (None: it inherits ours)."""
        return None

    def not_started(self, outcome: str, exit_code: int) -> None:
        """The child was never started (``lock_lost``, ``exec_failed``)."""

    def started(self, child_pid: int) -> None:
        """The child runs (never waits for a database or a network)."""

    def exited(self) -> None:
        """The child's process group is gone (or abandoned after a bug in jobrun)."""

    def slow(self, fields: Mapping[str, Any]) -> None:
        """--warn-after: the child runs past its bound (said once; never blocks)."""

    def finished(self, outcome: str, exit_code: int, signal: str | None, duration: float) -> None:
        """The child is done; the lock is still held."""

    def released(self, status: int) -> None:
        """The run is over and its lock given back: what may take time without holding it."""


class Recorder(Protocol):
    """Run history and alerts (``jobrun.history``); every method swallows its own failures."""

    def acquired(self, once_per: float | None) -> dict[str, Any] | None:
        """Mark dead runs abandoned; return an earlier run that makes this one redundant."""
        ...

    def paused(self) -> dict[str, object] | None:
        """The pause (``jobrun pause``) of this key in force, as ``paused_*`` fields."""
        ...

    def use_lock_ids(self, lock_ids: list[int]) -> None:
        """Record the run under these lock ids (``--slots``: its slot's)."""
        ...

    def note(self, **columns: object) -> None:
        """Columns the run's options add to its last row (``sql.history.RUNS_NOTED_COLUMNS``)."""
        ...

    def started(self, child_pid: int | None) -> None:
        """The child is running (never waits for the database)."""
        ...

    def finished(self, outcome: str, exit_code: int, signal: str | None, duration: float) -> None:
        """The child is done (or never started); its alert hook waits for ``flush``.

        Called while the lock is still held, so the next run never takes us for a dead one.
        """
        ...

    def skipped(self, reason: str, holder_fields: Mapping[str, Any], exit_code: int) -> None:
        """The run skipped (the lock was held, or an earlier run made it redundant)."""
        ...

    def exec_failed(self, exit_code: int) -> None:
        """The command could not be started."""
        ...

    def unmet(self) -> dict[str, object] | None:
        """--requires: the first required key not met, as the skip's fields (None: met)."""
        ...

    def recent_durations(self) -> tuple[int, float | None] | None:
        """--warn-after auto: (recent successes with a duration, their p95); None: unknown."""
        ...

    def slow(self, fields: dict[str, object]) -> None:
        """--warn-after: the run is slow (the hook, on a thread; the end row says so)."""
        ...

    def flush(self) -> None:
        """Run what was deferred (alert hooks), after the lock is released."""
        ...


class HistoryListener(Listener):
    """The run history, its metrics and its alert hook (a ``Recorder``)."""

    #: A run without its lock is not recorded: it is nobody's run of the key.
    unguarded_too = False

    def __init__(self, recorder: Recorder) -> None:
        self._recorder = recorder

    def skipped(self, reason: str, fields: Mapping[str, Any], exit_code: int) -> None:
        """The skip's row (and metrics)."""
        self._recorder.skipped(reason, fields, exit_code)

    def not_started(self, outcome: str, exit_code: int) -> None:
        """The run's end row, without a child."""
        if outcome == "exec_failed":
            self._recorder.exec_failed(exit_code)
        else:
            self._recorder.finished(outcome, exit_code, None, 0.0)

    def started(self, child_pid: int) -> None:
        """The running row."""
        self._recorder.started(child_pid)

    def slow(self, fields: Mapping[str, Any]) -> None:
        """The hook now (on its thread); the end row will say the run was slow."""
        self._recorder.slow(dict(fields))

    def finished(self, outcome: str, exit_code: int, signal: str | None, duration: float) -> None:
        """The end row; the alert hook waits for the release."""
        self._recorder.finished(outcome, exit_code, signal, duration)

    def released(self, status: int) -> None:
        """The alert hook, now that a slow one holds no lock."""
        del status
        self._recorder.flush()


class Listeners(Listener):
    """Several listeners as one: each step goes to each of them, in the order given."""

    def __init__(self, listeners: Sequence[Listener]) -> None:
        self._listeners = tuple(listeners)

    def unguarded(self) -> Listeners:
        """Those that hear of a run without its lock."""
        return Listeners([each for each in self._listeners if each.unguarded_too])

    def skipped(self, reason: str, fields: Mapping[str, Any], exit_code: int) -> None:
        """Tell each."""
        for each in self._listeners:
            each.skipped(reason, fields, exit_code)

    def preparing(self, env: dict[str, str]) -> int | None:
        """Ask each; the first refusal ends the run."""
        for each in self._listeners:
            refused = each.preparing(env)
            if refused is not None:
                return refused
        return None

    def stdio(self) -> tuple[int, int] | None:
        """The first listener's pipes that has some."""
        for each in self._listeners:
            fds = each.stdio()
            if fds is not None:
                return fds
        return None

    def not_started(self, outcome: str, exit_code: int) -> None:
        """Tell each."""
        for each in self._listeners:
            each.not_started(outcome, exit_code)

    def started(self, child_pid: int) -> None:
        """Tell each."""
        for each in self._listeners:
            each.started(child_pid)

    def exited(self) -> None:
        """Tell each."""
        for each in self._listeners:
            each.exited()

    def slow(self, fields: Mapping[str, Any]) -> None:
        """Tell each."""
        for each in self._listeners:
            each.slow(fields)

    def finished(self, outcome: str, exit_code: int, signal: str | None, duration: float) -> None:
        """Tell each."""
        for each in self._listeners:
            each.finished(outcome, exit_code, signal, duration)

    def released(self, status: int) -> None:
        """Tell each."""
        for each in self._listeners:
            each.released(status)
