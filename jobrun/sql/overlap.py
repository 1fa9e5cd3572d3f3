"""Statements jobrun overlap watches its attempt's sessions with."""

from __future__ import annotations

#: The sessions of one ``jobrun overlap`` attempt (by application_name, in this database):
#: the statement each runs and when it began, whether it is inside a transaction and holds
#: a lock there, who blocks it, and the lock it waits for. One pg_locks snapshot serves every
#: row. A wait for a row shows as a wait for the holder's transaction; the tuple lock the
#: waiter holds meanwhile names the row and its table. A transaction id is assigned on the
#: first write or row lock, so ``holds_lock`` covers row locks, which pg_locks does not list;
#: plain reads (AccessShareLock) do not count.
OVERLAP_SESSIONS = """
WITH locks AS MATERIALIZED (
    SELECT l.pid, l.granted, l.locktype, l.mode, l.relation::regclass::text AS relation,
           CASE l.locktype
               WHEN 'transactionid' THEN l.transactionid::text
               WHEN 'virtualxid' THEN l.virtualxid
               WHEN 'tuple' THEN '(' || l.page || ',' || l.tuple || ')'
               WHEN 'page' THEN l.page::text
               WHEN 'advisory' THEN
                   CASE WHEN l.objsubid = 1
                        THEN ((l.classid::int8 << 32) | l.objid::int8)::text
                        ELSE l.classid || ',' || l.objid END
               WHEN 'object' THEN l.classid::regclass || ' ' || l.objid
           END AS ident
    FROM pg_locks AS l
    WHERE l.pid IN (SELECT pid FROM pg_stat_activity WHERE application_name = ANY(%(names)s))
)
SELECT a.pid, a.application_name AS name,
       a.xact_start IS NOT NULL AND a.state IN ('active', 'idle in transaction')
           AS in_transaction,
       a.backend_xid IS NOT NULL OR EXISTS (
           SELECT FROM locks
           WHERE locks.pid = a.pid AND locks.granted
             AND locks.locktype NOT IN ('virtualxid', 'transactionid')
             AND NOT (locks.locktype = 'relation' AND locks.mode = 'AccessShareLock')
       ) AS holds_lock,
       coalesce(a.wait_event_type = 'Lock', false) AS waiting,
       a.query_start, left(a.query, %(query_chars)s) AS query,
       pg_blocking_pids(a.pid) AS blocked_by,
       w.locktype, w.mode, w.relation, w.ident, t.relation AS row_relation, t.ident AS row
FROM pg_stat_activity AS a
LEFT JOIN LATERAL (
    SELECT * FROM locks WHERE locks.pid = a.pid AND NOT locks.granted LIMIT 1
) AS w ON true
LEFT JOIN LATERAL (
    SELECT * FROM locks
    WHERE locks.pid = a.pid AND locks.granted AND locks.locktype = 'tuple'
    LIMIT 1
) AS t ON true
WHERE a.application_name = ANY(%(names)s)
  AND a.datid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND a.pid <> pg_backend_pid()
ORDER BY a.pid
"""

#: The server-side timeouts that can end a session jobrun overlap holds (for this role and
#: database; a job may set its own): milliseconds, 0 when off.
OVERLAP_TIMEOUTS = """
SELECT name, setting::int8 AS ms FROM pg_settings
WHERE name IN ('idle_in_transaction_session_timeout', 'statement_timeout', 'lock_timeout')
"""

#: End what is left of an attempt's sessions after its commands were killed: a killed
#: client's backend keeps its locks until it notices, which can take until the lock it
#: waits for is granted.
OVERLAP_TERMINATE = """
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
WHERE application_name = ANY(%(names)s)
  AND datid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND pid <> pg_backend_pid()
"""

#: The key columns of a table whose rows a wait-for cycle names (schema, table, columns in
#: index order): its primary key, else its first unique index on plain columns; none when
#: it has neither (the rows are then shown by position, ctid).
OVERLAP_ROW_KEY = """
SELECT n.nspname AS schema, c.relname AS name,
       coalesce((
           SELECT array_agg(a.attname::text ORDER BY array_position(i.indkey::int2[], a.attnum))
           FROM pg_attribute AS a
           WHERE a.attrelid = c.oid AND a.attnum = ANY(i.indkey::int2[])
       ), '{}') AS columns
FROM pg_class AS c
JOIN pg_namespace AS n ON n.oid = c.relnamespace
LEFT JOIN LATERAL (
    SELECT ix.indkey FROM pg_index AS ix
    WHERE ix.indrelid = c.oid AND ix.indisunique AND ix.indexprs IS NULL AND ix.indpred IS NULL
    ORDER BY ix.indisprimary DESC, ix.indexrelid
    LIMIT 1
) AS i ON true
WHERE c.oid = %(relation)s::regclass
"""

#: Reading a cycle's row by ctid never waits for a table lock that a job asked for.
OVERLAP_KEY_LOCK_TIMEOUT = "SET LOCAL lock_timeout = '50ms'"

#: Foreign keys from a table that a cycle's sessions wrote to (a RowExclusiveLock) onto the
#: tables of the cycle's rows: an insert or key update there took FOR KEY SHARE on the
#: referenced row, a lock that nobody's statement shows.
OVERLAP_FOREIGN_KEYS = """
SELECT DISTINCT l.pid, k.conrelid::regclass::text AS child, k.confrelid::regclass::text AS parent
FROM pg_constraint AS k
JOIN pg_locks AS l ON l.relation = k.conrelid AND l.granted AND l.mode = 'RowExclusiveLock'
WHERE k.contype = 'f'
  AND l.pid = ANY(%(pids)s)
  AND k.confrelid = ANY(%(relations)s::regclass[])
ORDER BY l.pid, child
"""
