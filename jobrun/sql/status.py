"""Statements jobrun status reads what is held and each key's state with."""

from __future__ import annotations

#: Every granted bigint advisory lock in this database, with whoever holds it: its database
#: role (``usename``) is the server's word; everything else but the pid is the client's.
STATUS_ADVISORY_LOCKS = """
SELECT (l.classid::int8 << 32) | l.objid::int8 AS lock_id, l.pid,
       host(a.client_addr) AS client_addr, a.application_name, a.backend_start, a.query,
       a.usename
FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
ORDER BY 1
"""

STATUS_LEASES = """
SELECT lock_id, key, owner, host, pid, acquired_at, expires_at
FROM jobrun.leases
WHERE expires_at > clock_timestamp()
ORDER BY lock_id
"""

#: One row per key of the history (all keys, or those asked for): the last finished run,
#: the last success, the typical (median of the last 20 successful) duration, the streaks.
STATUS_HISTORY = """
SELECT k.key,
       (SELECT lock_ids FROM jobrun.runs AS x WHERE x.key = k.key
        ORDER BY x.started_at DESC LIMIT 1) AS lock_ids,
       last.outcome, last.exit_code, last.started_at, last.finished_at, last.duration,
       last.deadlocks,
       (SELECT max(x.finished_at) FROM jobrun.runs AS x
        WHERE x.key = k.key AND x.outcome = 'succeeded') AS last_success_at,
       (SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d.duration)
        FROM (SELECT x.duration FROM jobrun.runs AS x
              WHERE x.key = k.key AND x.outcome = 'succeeded' AND x.duration IS NOT NULL
              ORDER BY x.started_at DESC LIMIT 20) AS d) AS typical_duration,
       coalesce((SELECT max(x.streak) FROM jobrun.runs AS x
                 WHERE x.key = k.key AND x.outcome = 'skipped'
                   AND x.started_at > coalesce((SELECT max(y.started_at) FROM jobrun.runs AS y
                                                WHERE y.key = k.key AND y.outcome <> 'skipped'),
                                               '-infinity')), 0) AS skip_streak,
       coalesce((SELECT CASE WHEN x.outcome = 'succeeded' THEN 0 ELSE x.streak END
                 FROM jobrun.runs AS x
                 WHERE x.key = k.key
                   AND x.outcome IN ('succeeded', 'failed', 'timed_out', 'lock_lost',
                                     'exec_failed')
                 ORDER BY x.finished_at DESC LIMIT 1), 0) AS failure_streak,
       (SELECT max(x.started_at) FROM jobrun.runs AS x
        WHERE x.key = k.key AND x.outcome = 'skipped') AS last_skip_at
FROM (SELECT DISTINCT key FROM jobrun.runs WHERE %(all)s OR key = ANY(%(keys)s::text[])) AS k
LEFT JOIN LATERAL (
    SELECT x.outcome, x.exit_code, x.started_at, x.finished_at, x.duration, x.deadlocks
    FROM jobrun.runs AS x
    WHERE x.key = k.key AND x.outcome NOT IN ('running', 'skipped')
    ORDER BY x.finished_at DESC NULLS LAST LIMIT 1
) AS last ON true
ORDER BY k.key
"""
