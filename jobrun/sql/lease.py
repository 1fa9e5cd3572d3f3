"""The jobrun schema's lease table and lease mode's statements on it."""

from __future__ import annotations

#: Taken (transaction-scoped) around the DDL so that 50 first runs at once create it once.
#: WARNING: jobrun's own advisory locks live in the two-int4 space (pg_locks objsubid 2),
#: which no key can reach: every key, named or ``--lock-id``, locks a bigint (objsubid 1).
#: A key that maps to one of them could otherwise hold up every first run, or be held up.
#: classid 1785684594 is "jobr" in ASCII; objid 1 is the schema.
SCHEMA_XACT_LOCK = "SELECT pg_advisory_xact_lock(1785684594, 1)"

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


#: Write our lease on every key whose lease is free or expired ({rows}: which rows to try).
_WRITE_LEASES = """
INSERT INTO jobrun.leases AS l
    (lock_id, key, owner, host, pid, acquired_at, renewed_at, expires_at)
SELECT k.lock_id, k.key, %(owner)s, %(host)s, %(pid)s,
       clock_timestamp(), clock_timestamp(), clock_timestamp() + make_interval(secs => %(ttl)s)
FROM unnest(%(lock_ids)s::int8[], %(keys)s::text[]) AS k (lock_id, key)
{rows}
ON CONFLICT (lock_id) DO UPDATE
    SET key = excluded.key, owner = excluded.owner, host = excluded.host, pid = excluded.pid,
        acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at,
        expires_at = excluded.expires_at
    WHERE l.expires_at <= clock_timestamp()
RETURNING l.lock_id
"""

#: Take every lease that is free or expired, in one statement (rows in lock-id order).
LEASE_ACQUIRE = _WRITE_LEASES.format(rows="ORDER BY k.lock_id")

#: Lease mode must also respect a session-mode run of the same key (a fleet moving from one
#: mode to the other): a transaction-scoped advisory lock on every id, which fails while a
#: session holds one; taken just before the lease is written, released at our COMMIT.
LEASE_NO_SESSION_LOCK = """
SELECT bool_and(pg_try_advisory_xact_lock(id)) FROM unnest(%(lock_ids)s::int8[]) AS id
"""

#: The session holding one of these advisory lock ids in this database (a session-mode run).
SESSION_HOLDER_OF_ANY = """
SELECT (l.classid::int8 << 32) | l.objid::int8, l.pid, host(a.client_addr),
       a.application_name, a.backend_start, a.query
FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND ((l.classid::int8 << 32) | l.objid::int8) = ANY(%(lock_ids)s::int8[])
LIMIT 1
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
WHERE lock_id = ANY(%(lock_ids)s::int8[]) AND owner = %(owner)s::uuid
  -- An expired lease is not renewed: another run (of either mode) may have started on it.
  AND expires_at > clock_timestamp()
RETURNING lock_id
"""

#: The renewal alone, as one row: how many leases it renewed.
LEASE_RENEW_COUNT = f"WITH renewed AS ({LEASE_RENEW}) SELECT count(*) FROM renewed"  # noqa: S608 - constants only

#: A heartbeat with no renewal due: how many of the leases are still ours and unexpired.
LEASE_HELD = """
SELECT count(*) FROM jobrun.leases
WHERE lock_id = ANY(%(lock_ids)s::int8[]) AND owner = %(owner)s::uuid
  AND expires_at > clock_timestamp()
"""

#: Release only what is still ours: a stale run can never release a newer run's lease.
LEASE_RELEASE = "DELETE FROM jobrun.leases WHERE lock_id = ANY(%(lock_ids)s) AND owner = %(owner)s"

#: One key's lease in ONE statement (autocommit: its own transaction), and who is in the
#: way when we did not get it: the transaction lock on the id that keeps session-mode runs
#: out (LEASE_NO_SESSION_LOCK, held until the statement commits), the lease written only
#: where that lock was free (LEASE_ACQUIRE), the lease-mode holder (a lease committed
#: before this statement began) and the session-mode holder (pg_locks, live). Several keys
#: take the transaction of LEASE_NO_SESSION_LOCK and LEASE_ACQUIRE: all or none of them.
LEASE_TAKE_ONE = "".join(
    (
        """
WITH free AS (
    SELECT bool_and(pg_try_advisory_xact_lock(id)) AS ok FROM unnest(%(lock_ids)s::int8[]) AS id
), taken AS (""",
        _WRITE_LEASES.format(rows="WHERE (SELECT ok FROM free)"),
        """)
SELECT f.ok, (SELECT count(*) FROM taken) AS taken,
       h.key, h.owner, h.host, h.pid, h.acquired_at, h.expires_at,
       s.lock_id, s.pid, s.client_addr, s.application_name, s.backend_start, s.query
FROM free AS f
LEFT JOIN LATERAL (
    SELECT key, owner, host, pid, acquired_at, expires_at FROM jobrun.leases
    WHERE lock_id = ANY(%(lock_ids)s::int8[]) AND owner <> %(owner)s
      AND expires_at > clock_timestamp()
    ORDER BY lock_id LIMIT 1
) AS h ON f.ok
LEFT JOIN LATERAL (
    SELECT (l.classid::int8 << 32) | l.objid::int8 AS lock_id, l.pid,
           host(a.client_addr) AS client_addr, a.application_name, a.backend_start, a.query
    FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND ((l.classid::int8 << 32) | l.objid::int8) = ANY(%(lock_ids)s::int8[])
    LIMIT 1
) AS s ON NOT f.ok
""",
    )
)
