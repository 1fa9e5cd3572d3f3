"""The jobrun schema's lease table and lease mode's statements on it."""

from __future__ import annotations

# WARNING: lease mode's statements are the ones that may reach the server through a
# transaction pooler, where the session's pinned search_path (sql.session.SEARCH_PATH) may
# not follow them from backend to backend: every function, operator and non-keyword type
# in them is schema-qualified, so that no object another role puts on the path is called.
_EQ = "OPERATOR(pg_catalog.=)"
_NE = "OPERATOR(pg_catalog.<>)"
_GT = "OPERATOR(pg_catalog.>)"
_LE = "OPERATOR(pg_catalog.<=)"
_PLUS = "OPERATOR(pg_catalog.+)"
_NOW = "pg_catalog.clock_timestamp()"
_TTL = f"{_NOW} {_PLUS} pg_catalog.make_interval(secs => %(ttl)s)"
#: The lock id (bigint) of a pg_locks row of a bigint advisory lock (objsubid 1).
_PG_LOCKS_ID = (
    "((l.classid::bigint OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) l.objid::bigint)"
)
_THIS_DATABASE = (
    f"(SELECT d.oid FROM pg_catalog.pg_database AS d "
    f"WHERE d.datname {_EQ} pg_catalog.current_database())"
)

#: Write our lease on every key whose lease is free or expired ({rows}: which rows to try).
_WRITE_LEASES = f"""
INSERT INTO jobrun.leases AS l
    (lock_id, key, owner, host, pid, acquired_at, renewed_at, expires_at)
SELECT k.lock_id, k.key, %(owner)s, %(host)s, %(pid)s, {_NOW}, {_NOW}, {_TTL}
FROM ROWS FROM (pg_catalog.unnest(%(lock_ids)s::bigint[]),
                pg_catalog.unnest(%(keys)s::pg_catalog.text[])) AS k (lock_id, key)
{{rows}}
ON CONFLICT (lock_id) DO UPDATE
    SET key = excluded.key, owner = excluded.owner, host = excluded.host, pid = excluded.pid,
        acquired_at = excluded.acquired_at, renewed_at = excluded.renewed_at,
        expires_at = excluded.expires_at
    WHERE l.expires_at {_LE} {_NOW}
RETURNING l.lock_id
"""

#: Take every lease that is free or expired, in one statement (rows in lock-id order).
LEASE_ACQUIRE = _WRITE_LEASES.format(rows="ORDER BY k.lock_id")

#: Whether a session-mode run may hold any of %(lock_ids)s, as one boolean: a
#: transaction-scoped advisory lock on every id, which fails while a session holds one.
#: Taken just before the lease is written, released at our COMMIT.
_NO_SESSION_LOCK = (
    "SELECT pg_catalog.bool_and(pg_catalog.pg_try_advisory_xact_lock(id)) AS ok "
    "FROM pg_catalog.unnest(%(lock_ids)s::bigint[]) AS id"
)
#: The same, except that an id held only by sessions of roles that may not run the key
#: (``jobrun init``'s only_squatters: a role with no grant, which can take any advisory
#: lock it likes) counts as free: a squatter's lock guards no run of the key.
_NO_SESSION_RUN = (
    "SELECT pg_catalog.bool_and(pg_catalog.pg_try_advisory_xact_lock(id) "
    "OR jobrun.only_squatters(ARRAY[id], %(label)s)) AS ok "
    "FROM pg_catalog.unnest(%(lock_ids)s::bigint[]) AS id"
)

#: Lease mode must also respect a session-mode run of the same key (a fleet moving from one
#: mode to the other): _NO_SESSION_LOCK as a statement of its own (several keys).
LEASE_NO_SESSION_LOCK = _NO_SESSION_LOCK
LEASE_NO_SESSION_RUN = _NO_SESSION_RUN

#: The session holding one of these advisory lock ids in this database (a session-mode run).
SESSION_HOLDER_OF_ANY = f"""
SELECT {_PG_LOCKS_ID}, l.pid, pg_catalog.host(a.client_addr),
       a.application_name, a.backend_start, a.query
FROM pg_catalog.pg_locks AS l LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid {_EQ} l.pid
WHERE l.locktype {_EQ} 'advisory' AND l.granted AND l.objsubid {_EQ} 1
  AND l.database {_EQ} {_THIS_DATABASE}
  AND {_PG_LOCKS_ID} {_EQ} ANY(%(lock_ids)s::bigint[])
LIMIT 1
"""

LEASE_HOLDERS = f"""
SELECT lock_id, key, owner, host, pid, acquired_at, renewed_at, expires_at
FROM jobrun.leases
WHERE lock_id {_EQ} ANY(%(lock_ids)s::bigint[]) AND owner {_NE} %(owner)s::pg_catalog.uuid
  AND expires_at {_GT} {_NOW}
ORDER BY lock_id
"""

#: Renew only what is still ours: a run whose lease was taken over can never extend it.
LEASE_RENEW = f"""
UPDATE jobrun.leases
SET renewed_at = {_NOW}, expires_at = {_TTL}
WHERE lock_id {_EQ} ANY(%(lock_ids)s::bigint[]) AND owner {_EQ} %(owner)s::pg_catalog.uuid
  -- An expired lease is not renewed: another run (of either mode) may have started on it.
  AND expires_at {_GT} {_NOW}
RETURNING lock_id
"""

#: The renewal alone, as one row: how many leases it renewed.
LEASE_RENEW_COUNT = f"WITH renewed AS ({LEASE_RENEW}) SELECT pg_catalog.count(*) FROM renewed"

#: A heartbeat with no renewal due: how many of the leases are still ours and unexpired.
LEASE_HELD = f"""
SELECT pg_catalog.count(*) FROM jobrun.leases
WHERE lock_id {_EQ} ANY(%(lock_ids)s::bigint[]) AND owner {_EQ} %(owner)s::pg_catalog.uuid
  AND expires_at {_GT} {_NOW}
"""

#: Release only what is still ours: a stale run can never release a newer run's lease.
LEASE_RELEASE = (
    f"DELETE FROM jobrun.leases WHERE lock_id {_EQ} ANY(%(lock_ids)s::bigint[]) "
    f"AND owner {_EQ} %(owner)s::pg_catalog.uuid"
)

#: One key's lease in ONE statement (autocommit: its own transaction), and who is in the
#: way when we did not get it: the transaction lock on the id that keeps session-mode runs
#: out ({free}, held until the statement commits), the lease written only where that lock
#: was free (LEASE_ACQUIRE), the lease-mode holder (a lease committed before this
#: statement began) and the session-mode holder (pg_locks, live). Several keys take the
#: transaction of LEASE_NO_SESSION_LOCK and LEASE_ACQUIRE: all or none of them.
_TAKE_ONE = f"""
WITH free AS ({{free}}), taken AS ({_WRITE_LEASES.format(rows="WHERE (SELECT ok FROM free)")})
SELECT f.ok, (SELECT pg_catalog.count(*) FROM taken) AS taken,
       h.key, h.owner, h.host, h.pid, h.acquired_at, h.expires_at,
       s.lock_id, s.pid, s.client_addr, s.application_name, s.backend_start, s.query
FROM free AS f
LEFT JOIN LATERAL (
    SELECT key, owner, host, pid, acquired_at, expires_at FROM jobrun.leases
    WHERE lock_id {_EQ} ANY(%(lock_ids)s::bigint[]) AND owner {_NE} %(owner)s::pg_catalog.uuid
      AND expires_at {_GT} {_NOW}
    ORDER BY lock_id LIMIT 1
) AS h ON f.ok
LEFT JOIN LATERAL (
    SELECT {_PG_LOCKS_ID} AS lock_id, l.pid,
           pg_catalog.host(a.client_addr) AS client_addr, a.application_name, a.backend_start,
           a.query
    FROM pg_catalog.pg_locks AS l
    LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid {_EQ} l.pid
    WHERE l.locktype {_EQ} 'advisory' AND l.granted AND l.objsubid {_EQ} 1
      AND l.database {_EQ} {_THIS_DATABASE}
      AND {_PG_LOCKS_ID} {_EQ} ANY(%(lock_ids)s::bigint[])
    LIMIT 1
) AS s ON NOT f.ok
"""
LEASE_TAKE_ONE = _TAKE_ONE.format(free=_NO_SESSION_LOCK)
#: The same past squatters (a database after ``jobrun init``: the function exists there).
LEASE_TAKE_ONE_PAST_SQUATTERS = _TAKE_ONE.format(free=_NO_SESSION_RUN)
