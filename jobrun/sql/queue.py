"""``--coalesce``: the queued run's look for a stop request of its key (jobrun.locks.queue)."""

from __future__ import annotations

#: The database's clock now, and the first stop request for one of the run's keys written
#: at or after ``since`` (NULL: now), as JSON text. ``jobrun stop KEY`` writes its request
#: for the key's holder; a run queued behind it honours it as well (it would otherwise run
#: the moment the holder it stopped let go). Qualified: it may go through a pooler.
QUEUE_STOP_REQUEST = """
SELECT pg_catalog.clock_timestamp(),
       (SELECT pg_catalog.row_to_json(s)::pg_catalog.text FROM (
            SELECT host, username, pid, reason, requested_at FROM jobrun.stop_requests
            WHERE key OPERATOR(pg_catalog.=) ANY(%(stop_keys)s::pg_catalog.text[])
              AND requested_at OPERATOR(pg_catalog.>=)
                  coalesce(%(since)s::pg_catalog.timestamptz, pg_catalog.clock_timestamp())
            ORDER BY requested_at
            LIMIT 1) AS s)
"""
