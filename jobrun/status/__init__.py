"""``jobrun status`` and ``jobrun history``: what is held right now, and how runs went."""

from __future__ import annotations

from jobrun.status.collect import (
    STUCK_FACTOR,
    STUCK_MINIMUM,
    KeyStatus,
    Report,
    collect,
    lock_ids_of,
)
from jobrun.status.render import check_lines, history_table, overlap_table, status_table
from jobrun.status.runs import overlapping, runs_of

__all__ = [
    "STUCK_FACTOR",
    "STUCK_MINIMUM",
    "KeyStatus",
    "Report",
    "check_lines",
    "collect",
    "history_table",
    "lock_ids_of",
    "overlap_table",
    "overlapping",
    "runs_of",
    "status_table",
]
