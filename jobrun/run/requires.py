"""``--requires KEY``: run only after each required key's recent success (none running now).

The rows come from the history's start message (``sql.RUNS_REQUIREMENTS``), sent after the
lock is taken: the decision is made holding the lock, and the run it allows (or the skip
it records) follows in the same hold.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobrun.durations import format_seconds
from jobrun.exitcodes import NOT_GRANTED, LockStoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

#: The skip's reason.
REASON = "requirement"


def may_hide(rows: Sequence[Mapping[str, Any]]) -> bool:
    """Whether a required key shows no row where row-level security may be hiding it."""
    return any(
        row["guarded"] and row["outcome"] is None and row["running_run_id"] is None for row in rows
    )


def not_readable(labels: Sequence[str]) -> LockStoreUnavailable:
    """The refusal of required keys this role may not read (exit 69, never run unchecked)."""
    names = ", ".join(labels)
    return LockStoreUnavailable(
        f"--requires {names}: this role may not read the history of {names} (jobrun grant "
        "ROLE reader or job on it), so whether it succeeded cannot be told",
        reason=NOT_GRANTED,
    )


def unmet(rows: Sequence[Mapping[str, Any]], within: float) -> dict[str, object] | None:
    """The first required key that is not met, as the skip's fields; None: all are met."""
    from jobrun.history.config import iso  # noqa: PLC0415 - with --requires only

    for row in rows:
        key = row["key"]
        if row["running_run_id"] is not None:
            return {
                "required_key": key,
                "requirement": "running",
                "note": f"{key} is running now (since {iso(row['running_since'])})",
                "required_run_id": str(row["running_run_id"]),
                "required_host": row["running_host"],
                "required_pid": row["running_pid"],
                "required_started_at": iso(row["running_since"]),
            }
        if row["outcome"] is None:
            return {
                "required_key": key,
                "requirement": "never_ran",
                "note": f"{key} never finished a run (none in the history)",
            }
        finished = iso(row["finished_at"])
        last = {"required_outcome": row["outcome"], "required_finished_at": finished}
        if row["outcome"] != "succeeded":
            return {
                "required_key": key,
                "requirement": "failed",
                "note": f"{key}'s last run ended {row['outcome']} at {finished}",
                **last,
            }
        if not row["fresh"]:
            return {
                "required_key": key,
                "requirement": "too_old",
                "note": f"{key}'s last success, at {finished}, is older than "
                f"--requires-within {format_seconds(within)}",
                **last,
            }
    return None
