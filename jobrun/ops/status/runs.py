"""``jobrun history``: the recent runs of a key, and the runs that overlapped another key's."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from psycopg import errors

from jobrun import sql
from jobrun.history import schema
from jobrun.history.config import iso
from jobrun.ops.status.collect import read_many, rounded_seconds
from jobrun.sql import status as status_sql

if TYPE_CHECKING:
    import psycopg

    Connection = psycopg.Connection[Any]


def runs_of(conn: Connection, label: str, limit: int) -> list[dict[str, object]] | None:
    """The newest ``limit`` rows of ``label`` (None when there is no history table yet).

    A run marked ``running`` whose lock is no longer held (it died: a crash, a server
    restart) is shown ``abandoned``, as the next run will record it; ``recorded`` says what
    the row itself says. Found in the same message: no round trip of its own.
    """
    params = {"key": label, "limit": limit, "all": False, "keys": [label]}
    found = schema.readable(conn, lambda check: _runs_of_key(conn, params, check))
    if found is None:
        return None
    rows, _, dead = found
    abandoned = {str(run["run_id"]) for run in dead}
    for run in rows:
        if str(run["run_id"]) in abandoned:
            run.update(outcome="abandoned", recorded="running")
        run.update(
            run_id=str(run["run_id"]),
            lock_ids=list(run["lock_ids"] or []),
            started_at=iso(run["started_at"]),
            finished_at=iso(run["finished_at"]),
            duration=rounded_seconds(run["duration"]),
        )
    return rows


def _runs_of_key(
    conn: Connection, params: dict[str, Any], check: tuple[str, ...]
) -> list[list[dict[str, Any]]]:
    """The key's runs with --coalesce's, --jitter's and --retries' columns where readable.

    A reader granted before those columns existed (``jobrun init`` not run again since)
    may not select them: it reads the runs without them.
    """
    from jobrun.sql.history import RUNS_OF_KEY_NOTED  # noqa: PLC0415 - its own block

    abandoned = [status_sql.STATUS_ABANDONED_FIND, status_sql.STATUS_ABANDONED]
    try:
        return read_many(conn, [RUNS_OF_KEY_NOTED, *abandoned], params, check=check)
    except errors.InsufficientPrivilege:
        return read_many(conn, [sql.RUNS_OF_KEY, *abandoned], params, check=check)


def overlapping(
    conn: Connection, label: str, other: str, *, since: float | None, limit: int
) -> list[dict[str, object]] | None:
    """Runs of ``label`` whose window intersected a run of ``other``, newest first.

    ``since``: only runs of ``label`` that started at most that many seconds ago.
    One row per pair (a long run can overlap several), each side's start, end, host,
    outcome and deadlocks, and how many seconds they overlapped. None: no history table.
    """
    params = {"key": label, "other": other, "since": since, "limit": limit}
    found = schema.readable(
        conn, lambda check: read_many(conn, [sql.RUNS_OVERLAPPING], params, check=check)
    )
    if found is None:
        return None
    [rows] = found
    for pair in rows:
        for side in ("", "other_"):
            pair[f"{side}run_id"] = str(pair[f"{side}run_id"])
            pair[f"{side}started_at"] = iso(pair[f"{side}started_at"])
            pair[f"{side}finished_at"] = iso(pair[f"{side}finished_at"])
        pair["overlap"] = rounded_seconds(pair["overlap"])
    return rows
