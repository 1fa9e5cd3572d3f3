"""Statements jobrun status reads what is held and each key's state with."""

from __future__ import annotations

from jobrun.sql.schema import SUMMARY_COMPLETE

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

#: One row per key of the history (all keys, or those asked for): the last finished run,
#: the last success, the typical (median of the last 20 successful) duration, the streaks,
#: read from the runs themselves: each key's rows through its indexes, every key by a scan.
#: What ``status`` reads while the summary is not complete (an upgrade under way), and where
#: there is none (a schema of an older version).
STATUS_HISTORY_RUNS = """
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

#: The same from the summary (jobrun.run_keys: a row per key, kept by the history's
#: triggers), once it is complete; until then (the upgrade's backfill under way) from the
#: runs (a one-time filter: the branch not taken is never run).
STATUS_HISTORY = f"""
SELECT s.key, s.lock_ids, s.outcome, s.exit_code, s.started_at, s.finished_at, s.duration,
       s.deadlocks, s.last_success_at,
       (SELECT pg_catalog.percentile_cont(0.5) WITHIN GROUP (ORDER BY d.duration)
        FROM pg_catalog.unnest(s.success_durations) AS d (duration)) AS typical_duration,
       s.skip_streak, s.failure_streak, s.last_skip_at
FROM jobrun.run_keys AS s
WHERE (SELECT c.complete FROM complete AS c)
  AND (%(all)s OR s.key OPERATOR(pg_catalog.=) ANY(%(keys)s::pg_catalog.text[]))
UNION ALL
SELECT * FROM ({STATUS_HISTORY_RUNS}) AS h WHERE NOT (SELECT c.complete FROM complete AS c)
ORDER BY 1
"""
STATUS_HISTORY = (
    "WITH complete AS (SELECT pg_catalog.obj_description("
    "pg_catalog.to_regclass('jobrun.run_keys'), 'pg_class') IS NOT DISTINCT FROM "
    f"'{SUMMARY_COMPLETE}' AS complete)" + STATUS_HISTORY
)

#: The unexpired leases, where jobrun.leases exists. A database that never saw lease mode
#: has no such table, and a statement naming it would be an ERROR in the server's log at
#: every ``status``: the DO block looks first and leaves the leases, as JSON, in a setting
#: local to the message, which STATUS_LEASES reads back (in the same message: no round
#: trip of its own). A role refused the table still fails here (status says so).
STATUS_LEASES_FIND = """
DO $jobrun$
BEGIN
  IF pg_catalog.to_regclass('jobrun.leases') IS NOT NULL THEN
    PERFORM pg_catalog.set_config('jobrun.status_leases', coalesce((
      SELECT pg_catalog.json_agg(l)::pg_catalog.text FROM (
        SELECT lock_id, key, owner, host, pid, acquired_at, expires_at FROM jobrun.leases
        WHERE expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()) AS l), ''), true);
  END IF;
END
$jobrun$
"""

STATUS_LEASES = """
SELECT l.lock_id, l.key, l.owner, l.host, l.pid, l.acquired_at, l.expires_at
FROM pg_catalog.json_to_recordset(
       coalesce(nullif(pg_catalog.current_setting('jobrun.status_leases', true), ''),
                '[]')::pg_catalog.json)
     AS l(lock_id pg_catalog.int8, key pg_catalog.text, owner pg_catalog.uuid,
          host pg_catalog.text, pid pg_catalog.int4, acquired_at pg_catalog.timestamptz,
          expires_at pg_catalog.timestamptz)
ORDER BY l.lock_id
"""

#: Runs the history says are ``running`` whose lock is no longer held: a session-mode run
#: whose lock ids are not all granted in pg_locks (its session died: a crash, a server
#: restart), a lease-mode run without an unexpired lease of its own. Left, as run ids, in a
#: setting local to the message for STATUS_ABANDONED, which keeps those still ``running`` in
#: a snapshot taken after pg_locks was read: a run that ended between this statement's
#: snapshot and its look at pg_locks (its end row committed, then its lock released) is
#: not taken for a dead one. A lease table that is missing or out of reach leaves lease
#: runs alone (not known to be lost).
STATUS_ABANDONED_FIND = """
DO $jobrun$
BEGIN
  PERFORM pg_catalog.set_config('jobrun.abandoned', coalesce((
    WITH held AS MATERIALIZED (
      SELECT (l.classid::pg_catalog.int8 OPERATOR(pg_catalog.<<) 32)
             OPERATOR(pg_catalog.|) l.objid::pg_catalog.int8 AS lock_id
      FROM pg_catalog.pg_locks AS l
      WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' AND l.granted
        AND l.objsubid OPERATOR(pg_catalog.=) 1
        AND l.database OPERATOR(pg_catalog.=) (
          SELECT d.oid FROM pg_catalog.pg_database AS d
          WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
    )
    SELECT pg_catalog.string_agg(r.run_id::pg_catalog.text, ',') FROM jobrun.runs AS r
    WHERE r.outcome OPERATOR(pg_catalog.=) 'running'
      AND r.mode OPERATOR(pg_catalog.<>) 'lease'
      AND EXISTS (SELECT FROM pg_catalog.unnest(r.lock_ids) AS i(id)
                  WHERE NOT EXISTS (SELECT FROM held
                                    WHERE held.lock_id OPERATOR(pg_catalog.=) i.id))), ''),
    true);
  IF pg_catalog.to_regclass('jobrun.leases') IS NOT NULL THEN
    BEGIN
      PERFORM pg_catalog.set_config('jobrun.abandoned', pg_catalog.concat_ws(',',
        nullif(pg_catalog.current_setting('jobrun.abandoned'), ''), (
        SELECT pg_catalog.string_agg(r.run_id::pg_catalog.text, ',') FROM jobrun.runs AS r
        WHERE r.outcome OPERATOR(pg_catalog.=) 'running'
          AND r.mode OPERATOR(pg_catalog.=) 'lease'
          AND NOT EXISTS (SELECT FROM jobrun.leases AS l
                          WHERE l.owner OPERATOR(pg_catalog.=) r.run_id
                            AND l.expires_at OPERATOR(pg_catalog.>)
                                pg_catalog.clock_timestamp()))), true);
    EXCEPTION WHEN insufficient_privilege THEN
      NULL;
    END;
  END IF;
END
$jobrun$
"""

#: The runs STATUS_ABANDONED_FIND found, still ``running`` now (of the keys asked for).
STATUS_ABANDONED = """
SELECT r.run_id, r.key, r.host, r.pid, r.started_at, r.mode
FROM jobrun.runs AS r
WHERE r.outcome OPERATOR(pg_catalog.=) 'running'
  AND r.run_id::pg_catalog.text OPERATOR(pg_catalog.=) ANY(pg_catalog.string_to_array(
        nullif(pg_catalog.current_setting('jobrun.abandoned', true), ''), ','))
  AND (%(all)s OR r.key OPERATOR(pg_catalog.=) ANY(%(keys)s::pg_catalog.text[]))
ORDER BY r.started_at
"""
