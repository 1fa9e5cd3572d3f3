"""Every SQL statement jobrun sends, named, in one place."""

from __future__ import annotations

BACKEND_PID = "SELECT pg_backend_pid()"

# --- session mode: advisory locks on a dedicated connection ---------------------------------

#: Make the lock session immune to server-side idle timeouts (PITFALLS 2). 14+ knows both.
SESSION_IMMUNE_14 = "SET idle_in_transaction_session_timeout = 0; SET idle_session_timeout = 0"
SESSION_IMMUNE = "SET idle_in_transaction_session_timeout = 0"

TRY_LOCK = "SELECT pg_try_advisory_lock(%s)"
LOCK = "SELECT pg_advisory_lock(%s)"
UNLOCK = "SELECT pg_advisory_unlock(%s)"
SET_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', %s, false)"

#: How many of our lock ids this very backend holds. A bigint advisory key is stored as
#: classid (high 32 bits) and objid (low 32 bits) with objsubid 1 (PITFALLS 11); the shift
#: wraps, so negative ids come back exactly.
HELD_BY_US = """
SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND pid = pg_backend_pid()
  AND ((classid::int8 << 32) | objid::int8) = ANY(%s)
"""

#: Who holds one advisory lock id in this database (granted, any backend).
ADVISORY_HOLDER = """
SELECT l.pid, host(a.client_addr), a.application_name, a.backend_start, a.query
FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND l.classid = %s::int8::oid AND l.objid = %s::int8::oid
LIMIT 1
"""

# --- the jobrun schema (leases, run history) -------------------------------------------------

#: Taken (transaction-scoped) around the DDL so that 50 first runs at once create it once.
SCHEMA_XACT_LOCK = "SELECT pg_advisory_xact_lock(%s)"

SCHEMA = """
CREATE SCHEMA IF NOT EXISTS jobrun;
CREATE TABLE IF NOT EXISTS jobrun.leases (
    lock_id     bigint PRIMARY KEY,
    key         text NOT NULL,
    owner       uuid NOT NULL,
    host        text NOT NULL,
    pid         integer NOT NULL,
    acquired_at timestamptz NOT NULL,
    renewed_at  timestamptz NOT NULL,
    expires_at  timestamptz NOT NULL
);
"""

# --- lease mode -------------------------------------------------------------------------------

#: Take every lease that is free or expired, in one statement (rows in lock-id order).
LEASE_ACQUIRE = """
INSERT INTO jobrun.leases AS l
    (lock_id, key, owner, host, pid, acquired_at, renewed_at, expires_at)
SELECT k.lock_id, k.key, %(owner)s, %(host)s, %(pid)s,
       clock_timestamp(), clock_timestamp(), clock_timestamp() + make_interval(secs => %(ttl)s)
FROM unnest(%(lock_ids)s::int8[], %(keys)s::text[]) AS k (lock_id, key)
ORDER BY k.lock_id
ON CONFLICT (lock_id) DO UPDATE
    SET key = excluded.key, owner = excluded.owner, host = excluded.host, pid = excluded.pid,
        acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at,
        expires_at = excluded.expires_at
    WHERE l.expires_at <= clock_timestamp()
RETURNING l.lock_id
"""

LEASE_HOLDERS = """
SELECT lock_id, key, owner, host, pid, acquired_at, renewed_at, expires_at
FROM jobrun.leases
WHERE lock_id = ANY(%(lock_ids)s) AND owner <> %(owner)s AND expires_at > clock_timestamp()
ORDER BY lock_id
"""

#: Renew only what is still ours: a run whose lease was taken over can never extend it.
LEASE_RENEW = """
UPDATE jobrun.leases
SET renewed_at = clock_timestamp(), expires_at = clock_timestamp() + make_interval(secs => %(ttl)s)
WHERE lock_id = ANY(%(lock_ids)s) AND owner = %(owner)s
RETURNING lock_id
"""

#: Release only what is still ours: a stale run can never release a newer run's lease.
LEASE_RELEASE = "DELETE FROM jobrun.leases WHERE lock_id = ANY(%(lock_ids)s) AND owner = %(owner)s"

# --- jobrun drill: taking a lock away on purpose ----------------------------------------

DRILL_TERMINATE_HOLDER = """
SELECT pg_terminate_backend(pid) FROM pg_locks
WHERE locktype = 'advisory' AND granted AND objsubid = 1
  AND classid = %s::int8::oid AND objid = %s::int8::oid
"""

#: A stranger takes the lease over: the holder's next owner-checked renewal must fail.
DRILL_STEAL_LEASE = "UPDATE jobrun.leases SET owner = %s WHERE lock_id = %s"

DRILL_DELETE_LEASE = "DELETE FROM jobrun.leases WHERE lock_id = %s"
