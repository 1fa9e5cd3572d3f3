"""Statements of ``jobrun timeline``: the runs of some keys over a window of time."""

from __future__ import annotations

#: The runs and skips of the keys that were going at some point of the last ``since`` seconds
#: (NULL: all of them), oldest first, at most ``limit``; and the database's clock, which a
#: run still going is drawn up to. Runs of a key newest first are what the index serves; the
#: outer query puts them back in order.
TIMELINE_RUNS = """
SELECT r.*, clock_timestamp() AS now FROM (
    SELECT run_id, key, host, started_at, finished_at, outcome, exit_code, deadlocks
    FROM jobrun.runs
    WHERE key = ANY(%(keys)s::text[])
      AND (%(since)s::float8 IS NULL
           OR coalesce(finished_at, clock_timestamp())
              >= clock_timestamp() - make_interval(secs => %(since)s::float8))
    ORDER BY started_at DESC
    LIMIT %(limit)s
) AS r
ORDER BY r.started_at
"""

#: The database's clock, when there is no history table to read it with.
TIMELINE_NOW = "SELECT clock_timestamp() AS now"
