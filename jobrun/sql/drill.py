"""Statements jobrun drill uses to take a lock away on purpose."""

from __future__ import annotations

#: Advisory locks are per database: a session in another database holding the same id is
#: a stranger's, never ours to terminate.
DRILL_TERMINATE_HOLDER = """
SELECT pg_terminate_backend(pid) FROM pg_locks
WHERE locktype = 'advisory' AND granted AND objsubid = 1
  AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND classid = %s::int8::oid AND objid = %s::int8::oid
"""

#: Whether a session of this database still holds the advisory lock id (classid, objid).
DRILL_LOCK_HELD = """
SELECT EXISTS (
    SELECT FROM pg_locks
    WHERE locktype = 'advisory' AND granted AND objsubid = 1
      AND database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND classid = %s::int8::oid AND objid = %s::int8::oid
)
"""

#: The lease of one lock id (owner, start and expiry on the database's clock) and that clock.
DRILL_LEASE = """
SELECT l.owner::text AS owner, l.acquired_at, l.expires_at, clock_timestamp() AS now
FROM (SELECT 1) AS one LEFT JOIN jobrun.leases AS l ON l.lock_id = %s
"""

#: A stranger takes the lease over: the holder's next owner-checked renewal must fail.
DRILL_STEAL_LEASE = "UPDATE jobrun.leases SET owner = %s WHERE lock_id = %s"

#: Only leases the drill's own runs (or its stranger) own: never a real job's.
DRILL_DELETE_LEASE = """
DELETE FROM jobrun.leases WHERE lock_id = %s AND owner::text = ANY(%s::text[])
"""
