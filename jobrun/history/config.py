"""The run history's settings and vocabulary (outcomes, timestamps), free of psycopg."""

from __future__ import annotations

import datetime as dt
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobrun.exitcodes import UsageError

if TYPE_CHECKING:
    from collections.abc import Mapping

#: Outcomes that make a failure streak; ``skipped``, ``running`` and ``abandoned`` neither
#: extend nor break one (they say nothing about whether the job itself works).
FAILURES = ("failed", "timed_out", "lock_lost", "exec_failed")
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


#: Longest one history call may take (lease mode: at most half a renewal's lifetime).
CALL_TIMEOUT = 5.0
#: Longest the ``--on-alert`` hook may run.
ALERT_TIMEOUT = 30.0


@dataclass(frozen=True)
class HistoryConfig:
    """How the history of a run is kept and when it raises an alert (validated on creation).

    Every value comes from the run's settings: the defaults are the options' own.
    """

    keep: int
    alert_after: int
    #: Seconds between two alerts of one streak while it lasts (the first comes at N).
    alert_repeat: float
    on_alert: tuple[str, ...] | None
    metrics_file: str | None
    #: Longest one history call may take: shared by its statements, each cancelled by the
    #: server (statement_timeout, lock_timeout) after its share.
    timeout: float
    #: ``--expect-every``: seconds between successful runs, and the grace past that before
    #: ``status`` calls the key overdue (None: no expectation recorded).
    expect_every: float | None
    expect_grace: float | None
    #: Longest the alert hook may run (no option: ALERT_TIMEOUT).
    alert_timeout: float = ALERT_TIMEOUT

    def __post_init__(self) -> None:
        if self.keep < 1:
            raise UsageError(
                f"--keep {self.keep}: keep at least 1 run per key (the streaks and "
                "--once-per read the newest rows); use --no-history to keep none"
            )
        if self.alert_after < 0:
            raise UsageError(f"--alert-after {self.alert_after}: use 0 to disable, or N >= 1")
        if self.alert_repeat <= 0:
            raise UsageError("--alert-repeat must be longer than 0")
        if self.alert_timeout <= 0:
            raise UsageError("the alert hook's timeout must be longer than 0")
        if self.timeout <= 0:
            raise UsageError("the history timeout must be longer than 0")


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


def pause(row: Mapping[str, object]) -> dict[str, object]:
    """A ``jobrun.pauses`` row as ``status`` shows it: who paused the key, when, until, why."""
    return {
        "host": row["host"],
        "user": row["username"],
        "pid": row["pid"],
        "since": iso(row["paused_at"]),
        "until": iso(row["until"]),
        "reason": row["reason"],
    }
