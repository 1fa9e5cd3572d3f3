"""``jobrun status`` and ``jobrun history``: what is held right now, and how runs went."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobrun.ops.status import render
from jobrun.ops.status.collect import (
    STUCK_FACTOR,
    STUCK_MINIMUM,
    KeyStatus,
    Report,
    abandoned_lines,
    collect,
)
from jobrun.ops.status.render import history_table, overlap_table, status_table
from jobrun.ops.status.runs import overlapping, runs_of

if TYPE_CHECKING:
    from collections.abc import Sequence


def check_lines(rows: Sequence[KeyStatus], alert_after: int) -> list[str]:
    """``status --check``: one line per key overdue, failing, stuck, or with a dead run."""
    return [*render.check_lines(rows, alert_after), *abandoned_lines(rows)]


__all__ = [
    "STUCK_FACTOR",
    "STUCK_MINIMUM",
    "KeyStatus",
    "Report",
    "check_lines",
    "collect",
    "history_table",
    "overlap_table",
    "overlapping",
    "runs_of",
    "status_table",
]
