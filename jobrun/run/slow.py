"""``--warn-after DURATION | auto``: one ``slow_run`` warning when the child runs past a bound.

The bound is watched by the supervisor's own loop (one more deadline beside --timeout's):
no thread of its own. The warning goes to the log, the ``--on-alert`` hook (on a thread:
the supervisor never waits for it) and a ``--ping`` ``/log`` ping; the child runs on.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobrun.durations import format_seconds

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

#: ``auto``: the bound is this many times the 95th percentile of recent successes...
FACTOR = 1.5
#: ...over the key's last this many successful runs...
WINDOW = 30
#: ...once at least this many are recorded (fewer: no bound, and no warning).
MINIMUM_RUNS = 5
#: Never a bound shorter than this (a job of a few milliseconds would warn on a hiccup).
FLOOR = 1.0


@dataclass(frozen=True)
class Bound:
    """How long a run may take before it is slow, and where that figure comes from."""

    seconds: float
    #: "given" (--warn-after DURATION) or "auto".
    derived: str
    #: auto: the p95 of the recorded successful durations, and how many there were.
    p95: float | None = None
    runs: int | None = None

    def describe(self) -> str:
        """How the bound was derived, in words (the event's ``derivation``)."""
        if self.derived == "given":
            return f"--warn-after {format_seconds(self.seconds)}"
        return f"auto: {FACTOR:g} x p95 {self.p95:.3f}s of the last {self.runs} successful runs" + (
            f" (at least {FLOOR:g}s)" if self.seconds == FLOOR else ""
        )

    def fields(self, elapsed: float) -> dict[str, object]:
        """The ``slow_run`` event's fields: the bound, the time elapsed, how it was derived."""
        return {
            "bound": round(self.seconds, 3),
            "elapsed": round(elapsed, 3),
            "derived": self.derived,
            "derivation": self.describe(),
            **({"p95": round(self.p95, 3), "runs": self.runs} if self.p95 is not None else {}),
        }


def bound(
    warn_after: float | str | None,
    durations: tuple[int, float | None] | None,
    log: FilteringBoundLogger,
) -> Bound | None:
    """The run's bound: the given duration, or derived from ``durations`` (auto)."""
    if warn_after is None:
        return None
    if warn_after != "auto":
        return Bound(float(warn_after), "given")
    runs, p95 = durations if durations is not None else (0, None)
    if durations is None or runs < MINIMUM_RUNS or p95 is None:
        log.info(
            "warn_after_auto",
            runs=runs if durations is not None else None,
            needed=MINIMUM_RUNS,
            note=f"no slow_run warning for this run: --warn-after auto needs {MINIMUM_RUNS} "
            "recorded successful runs of the key"
            + ("" if durations is not None else " (the history could not be read)"),
        )
        return None
    derived = Bound(max(FLOOR, float(p95) * FACTOR), "auto", p95=float(p95), runs=runs)
    log.info("warn_after_auto", bound=round(derived.seconds, 3), derivation=derived.describe())
    return derived
