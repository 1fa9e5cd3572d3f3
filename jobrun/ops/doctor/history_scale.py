"""The history's size and indexes: what would make runs and ``status`` slow."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobrun.ops.doctor import query
from jobrun.ops.doctor.finding import OK, WARN, Finding
from jobrun.sql import doctor as doctor_sql
from jobrun.sql import schema as history_sql

if TYPE_CHECKING:
    from jobrun.ops.doctor.query import Connection

#: A key holding more rows than this is pruned for a while (each run deletes a batch), or
#: kept on purpose (``--keep``): said, since VACUUM and backups grow with it.
LARGE_KEY_ROWS = 1_000_000

_UPGRADE = "python -m jobrun.history.upgrade, as the tables' owner (runs go on meanwhile)"


def history_scale(conn: Connection) -> list[Finding]:
    """Missing indexes or summary (each run then reads every row of its key), and size."""
    exists, size, rows, summary, complete, missing = query.one(
        conn,
        doctor_sql.DOCTOR_HISTORY_SCALE,
        {
            "complete": history_sql.SUMMARY_COMPLETE,
            "indexes": [name for name, _ in history_sql.RUNS_INDEXES],
        },
    )
    if not exists:
        return []
    shape = f"{rows:,} rows, {_size(size)} with its indexes"
    findings: list[Finding] = []
    gaps = [f"index jobrun.{name}" for name in missing]
    if not summary:
        gaps.append("the summary jobrun.run_keys")
    elif not complete:
        gaps.append("the summary's backfill (status reads every run meanwhile)")
    if gaps:
        findings.append(
            Finding(
                WARN,
                "history indexes",
                f"jobrun.runs ({shape}) lacks {', '.join(gaps)}: each run reads every row "
                f"of its key, status every row; fix: {_UPGRADE}",
            )
        )
    keys, largest = (0, 0)
    if summary:
        keys, largest = query.one(conn, doctor_sql.DOCTOR_HISTORY_KEYS)
    if largest > LARGE_KEY_ROWS:
        findings.append(
            Finding(
                WARN,
                "history size",
                f"a key holds {largest:,} rows ({shape}, {keys:,} keys): runs stay quick "
                "(indexed), but VACUUM, backups and the first status after a restart grow "
                "with it; lower --keep unless the history is kept on purpose",
            )
        )
    if not findings:
        per_row = size / rows if rows else 0
        findings.append(
            Finding(
                OK,
                "history indexes",
                f"{shape} ({keys:,} keys, about {per_row:,.0f} bytes a row), indexed",
            )
        )
    return findings


def _size(size: int | None) -> str:
    """Bytes as MB or GB."""
    value = float(size or 0)
    if value >= 1024**3:
        return f"{value / 1024**3:.1f} GB"
    return f"{value / 1024**2:.1f} MB"
