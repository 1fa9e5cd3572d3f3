"""Every SQL statement jobrun sends, named, in one place."""

from __future__ import annotations

BACKEND_PID = "SELECT pg_backend_pid()"

# --- session mode: advisory locks on a dedicated connection ---------------------------------

#: Make the lock session immune to server-side idle timeouts (PITFALLS 2). 14+ knows both.
SESSION_IMMUNE_14 = (
    "SET idle_in_transaction_session_timeout = 0; SET idle_session_timeout = 0; "
    "SET statement_timeout = 0; "
    # A --wait for the next key blocks the backend in pg_advisory_lock: without this it
    # would notice a killed jobrun only when the wait ends, holding the keys already taken.
    "SET client_connection_check_interval = '1s'"
)
SESSION_IMMUNE = "SET idle_in_transaction_session_timeout = 0; SET statement_timeout = 0"

#: Server-side keepalives for the lock session (idle seconds given; probes every 2 s, 3 of
#: them), so the server ends the session of a host that vanished (PITFALLS 3); and whether
#: the server is a standby (its advisory locks are its own: shared with nobody else).
SESSION_SETUP = """
SELECT set_config('tcp_keepalives_idle', %s, false),
       set_config('tcp_keepalives_interval', '2', false),
       set_config('tcp_keepalives_count', '3', false),
       pg_is_in_recovery()
"""

#: Session mode must also respect a lease-mode run of the same key: checked after the
#: advisory locks are ours, so a lease written before that is seen (see LEASE_NO_SESSION_LOCK).
SESSION_LEASED = """
SELECT key, owner, host, pid, acquired_at, expires_at FROM jobrun.leases
WHERE lock_id = ANY(%s::int8[]) AND expires_at > clock_timestamp()
ORDER BY lock_id
LIMIT 1
"""

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
WHERE lock_id = ANY(%(lock_ids)s) AND owner = %(owner)s
  -- An expired lease is not renewed: another run (of either mode) may have started on it.
  AND expires_at > clock_timestamp()
RETURNING lock_id
"""

#: Release only what is still ours: a stale run can never release a newer run's lease.
LEASE_RELEASE = "DELETE FROM jobrun.leases WHERE lock_id = ANY(%(lock_ids)s) AND owner = %(owner)s"

# --- jobrun drill: taking a lock away on purpose ----------------------------------------

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
SELECT l.owner::text, l.acquired_at, l.expires_at, clock_timestamp()
FROM (SELECT 1) AS one LEFT JOIN jobrun.leases AS l ON l.lock_id = %s
"""

#: A stranger takes the lease over: the holder's next owner-checked renewal must fail.
DRILL_STEAL_LEASE = "UPDATE jobrun.leases SET owner = %s WHERE lock_id = %s"

#: Only leases the drill's own runs (or its stranger) own: never a real job's.
DRILL_DELETE_LEASE = """
DELETE FROM jobrun.leases WHERE lock_id = %s AND owner::text = ANY(%s::text[])
"""

# --- run history (issue 4) --------------------------------------------------------------------

#: The run history; history.ensure_schema runs it under the same transaction-scoped lock as SCHEMA.
#: ``streak`` is what the row extends: a skip, this host's skips in a row by the same holder;
#: a failure, failures in a row; else 0. Kept in the row so that pruning never shortens it.
RUNS_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS jobrun;
CREATE TABLE IF NOT EXISTS jobrun.runs (
    run_id       uuid PRIMARY KEY,
    key          text NOT NULL,
    lock_ids     bigint[] NOT NULL,
    mode         text NOT NULL,
    host         text NOT NULL,
    pid          integer NOT NULL,
    child_pid    integer,
    program      text,
    started_at   timestamptz NOT NULL,
    finished_at  timestamptz,
    outcome      text NOT NULL,
    reason       text,
    exit_code    integer,
    signal       text,
    duration     double precision,
    streak       integer NOT NULL DEFAULT 0,
    streak_since timestamptz,
    holder_ref   text,
    holder       jsonb
);
CREATE INDEX IF NOT EXISTS runs_key_started_at ON jobrun.runs (key, started_at DESC);
CREATE INDEX IF NOT EXISTS runs_running_lock_ids ON jobrun.runs USING gin (lock_ids)
    WHERE outcome = 'running';
"""

#: Every history transaction starts with this: a history write must never hold a job up.
RUNS_LOCAL_TIMEOUTS = """
SELECT set_config('statement_timeout', %(ms)s, true), set_config('lock_timeout', %(ms)s, true)
"""

RUNS_NOW = "SELECT clock_timestamp()"

#: Runs still marked running on any of our lock ids are dead: we hold those locks now.
RUNS_ABANDON = """
UPDATE jobrun.runs SET outcome = 'abandoned', finished_at = clock_timestamp()
WHERE outcome = 'running' AND lock_ids && %(lock_ids)s::int8[] AND run_id <> %(run_id)s
RETURNING run_id, key, host, pid, started_at
"""

#: ``--once-per``: a run of this key that started in the current window, aligned to the Unix
#: epoch on the database's clock, and is running or succeeded.
RUNS_ALREADY_RAN = """
SELECT run_id, host, pid, started_at, outcome, w.start
FROM jobrun.runs,
     (SELECT to_timestamp(floor(extract(epoch FROM clock_timestamp())::float8
                                / %(window)s::float8) * %(window)s::float8) AS start) AS w
WHERE key = %(key)s AND run_id <> %(run_id)s AND outcome IN ('running', 'succeeded')
  AND started_at >= w.start
ORDER BY started_at DESC
LIMIT 1
"""

RUNS_START = """
INSERT INTO jobrun.runs
    (run_id, key, lock_ids, mode, host, pid, child_pid, program, started_at, outcome)
VALUES (%(run_id)s, %(key)s, %(lock_ids)s::int8[], %(mode)s, %(host)s, %(pid)s, %(child_pid)s,
        %(program)s, coalesce(%(started_at)s::timestamptz, clock_timestamp()), 'running')
ON CONFLICT (run_id) DO UPDATE SET child_pid = excluded.child_pid
"""

#: The run of this key that finished last (a success or a failure), for the failure streak:
#: ordered by the end, so a run that ended late (a frozen lease holder) counts where it ended.
RUNS_PREVIOUS_FINISHED = """
SELECT outcome, streak, streak_since FROM jobrun.runs
WHERE key = %(key)s AND run_id <> %(run_id)s
  AND outcome IN ('succeeded', 'failed', 'timed_out', 'lock_lost', 'exec_failed')
ORDER BY finished_at DESC
LIMIT 1
"""

#: Record how a run ended; inserts the row if its start was never recorded (a failed write).
RUNS_FINISH = """
INSERT INTO jobrun.runs AS r
    (run_id, key, lock_ids, mode, host, pid, program, started_at, finished_at, outcome,
     exit_code, signal, duration, streak, streak_since)
SELECT %(run_id)s, %(key)s, %(lock_ids)s::int8[], %(mode)s, %(host)s, %(pid)s, %(program)s, s.at,
       clock_timestamp(), %(outcome)s, %(exit_code)s, %(signal)s, %(duration)s, %(streak)s,
       CASE WHEN %(streak)s > 0 THEN coalesce(%(streak_since)s::timestamptz, s.at) END
FROM (SELECT coalesce(%(started_at)s::timestamptz,
                      clock_timestamp() - make_interval(secs => %(duration)s)) AS at) AS s
ON CONFLICT (run_id) DO UPDATE
    SET finished_at = excluded.finished_at, outcome = excluded.outcome,
        exit_code = excluded.exit_code, signal = excluded.signal, duration = excluded.duration,
        streak = excluded.streak,
        streak_since = CASE WHEN excluded.streak > 0
                            THEN coalesce(%(streak_since)s::timestamptz, r.started_at) END
RETURNING streak, streak_since
"""

#: Taken before RUNS_SKIP_CHAIN: hosts skipping behind the same holder at the same moment
#: take turns until their transactions end, so each reads the streaks the others wrote and
#: only the first to reach a count alerts. Two int4 halves (objsubid 2): never one of the
#: bigint lock ids jobs use, and never shown by ``jobrun status``.
RUNS_SKIP_SERIALIZE = """
SELECT pg_advisory_xact_lock(hashtext('jobrun.skip'),
                             hashtext(%(key)s::text || ':' || %(holder_ref)s::text))
"""

#: Skips of this key by the same holder: this host's longest chain, and anyone's.
RUNS_SKIP_CHAIN = """
SELECT max(streak) FILTER (WHERE host = %(host)s),
       min(streak_since) FILTER (WHERE host = %(host)s),
       max(streak)
FROM jobrun.runs
WHERE key = %(key)s AND outcome = 'skipped' AND holder_ref = %(holder_ref)s
"""

RUNS_SKIP = """
INSERT INTO jobrun.runs AS r
    (run_id, key, lock_ids, mode, host, pid, program, started_at, finished_at, outcome, reason,
     exit_code, duration, streak, streak_since, holder_ref, holder)
VALUES (%(run_id)s, %(key)s, %(lock_ids)s::int8[], %(mode)s, %(host)s, %(pid)s, %(program)s,
        clock_timestamp(), clock_timestamp(), 'skipped', %(reason)s, %(exit_code)s,
        %(duration)s, %(streak)s,
        CASE WHEN %(streak)s > 0 THEN coalesce(%(streak_since)s::timestamptz, clock_timestamp())
        END,
        %(holder_ref)s, %(holder)s)
ON CONFLICT (run_id) DO UPDATE
    SET finished_at = excluded.finished_at, outcome = excluded.outcome, reason = excluded.reason,
        exit_code = excluded.exit_code, duration = excluded.duration, streak = excluded.streak,
        streak_since = excluded.streak_since, holder_ref = excluded.holder_ref,
        holder = excluded.holder
RETURNING streak, streak_since
"""

#: Keep the newest N finished runs and the newest N skips of a key, and each host's newest
#: skip of it: that row carries the host's skip streak (RUNS_SKIP_CHAIN), which the skips of
#: a fleet larger than N would otherwise push out. So at most N + hosts skips; running rows
#: stay. SKIP LOCKED: a fleet of hosts pruning the same key at once neither waits nor deadlocks.
RUNS_PRUNE = """
DELETE FROM jobrun.runs WHERE run_id IN (
    SELECT run_id FROM jobrun.runs
    WHERE run_id IN (
        SELECT ranked.run_id FROM (
            SELECT run_id, outcome = 'skipped' AS skip,
                   row_number() OVER (PARTITION BY outcome = 'skipped'
                                      ORDER BY started_at DESC) AS n,
                   row_number() OVER (PARTITION BY outcome = 'skipped', host
                                      ORDER BY started_at DESC) AS of_host
            FROM jobrun.runs
            WHERE key = %(key)s AND outcome <> 'running'
        ) AS ranked
        WHERE ranked.n > %(keep)s AND NOT (ranked.skip AND ranked.of_host = 1)
    )
    FOR UPDATE SKIP LOCKED
)
"""

#: ``jobrun history KEY``.
RUNS_OF_KEY = """
SELECT run_id, key, lock_ids, mode, host, pid, child_pid, program, started_at, finished_at,
       outcome, reason, exit_code, signal, duration, streak, holder
FROM jobrun.runs
WHERE key = %(key)s
ORDER BY started_at DESC
LIMIT %(limit)s
"""

# --- status -----------------------------------------------------------------------------------

#: Every granted bigint advisory lock in this database, with whoever holds it.
STATUS_ADVISORY_LOCKS = """
SELECT (l.classid::int8 << 32) | l.objid::int8, l.pid, host(a.client_addr), a.application_name,
       a.backend_start, a.query
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
        ORDER BY x.started_at DESC LIMIT 1),
       last.outcome, last.exit_code, last.started_at, last.finished_at, last.duration,
       (SELECT max(x.finished_at) FROM jobrun.runs AS x
        WHERE x.key = k.key AND x.outcome = 'succeeded'),
       (SELECT percentile_cont(0.5) WITHIN GROUP (ORDER BY d.duration)
        FROM (SELECT x.duration FROM jobrun.runs AS x
              WHERE x.key = k.key AND x.outcome = 'succeeded' AND x.duration IS NOT NULL
              ORDER BY x.started_at DESC LIMIT 20) AS d),
       coalesce((SELECT max(x.streak) FROM jobrun.runs AS x
                 WHERE x.key = k.key AND x.outcome = 'skipped'
                   AND x.started_at > coalesce((SELECT max(y.started_at) FROM jobrun.runs AS y
                                                WHERE y.key = k.key AND y.outcome <> 'skipped'),
                                               '-infinity')), 0),
       coalesce((SELECT CASE WHEN x.outcome = 'succeeded' THEN 0 ELSE x.streak END
                 FROM jobrun.runs AS x
                 WHERE x.key = k.key
                   AND x.outcome IN ('succeeded', 'failed', 'timed_out', 'lock_lost',
                                     'exec_failed')
                 ORDER BY x.finished_at DESC LIMIT 1), 0),
       (SELECT max(x.started_at) FROM jobrun.runs AS x
        WHERE x.key = k.key AND x.outcome = 'skipped')
FROM (SELECT DISTINCT key FROM jobrun.runs WHERE %(all)s OR key = ANY(%(keys)s::text[])) AS k
LEFT JOIN LATERAL (
    SELECT x.outcome, x.exit_code, x.started_at, x.finished_at, x.duration
    FROM jobrun.runs AS x
    WHERE x.key = k.key AND x.outcome NOT IN ('running', 'skipped')
    ORDER BY x.finished_at DESC NULLS LAST LIMIT 1
) AS last ON true
ORDER BY k.key
"""

# --- doctor -----------------------------------------------------------------------------------

DOCTOR_SERVER = """
SELECT current_setting('server_version'), current_setting('server_version_num'),
       pg_is_in_recovery()
"""

DOCTOR_ROLE = """
SELECT current_user, r.rolsuper,
       pg_has_role(current_user, 'pg_signal_backend', 'MEMBER'),
       pg_has_role(current_user, 'pg_read_all_stats', 'MEMBER')
FROM pg_roles AS r WHERE r.rolname = current_user
"""

#: Whether the jobrun schema exists, and what this role may do about it.
DOCTOR_SCHEMA = """
SELECT n.oid IS NOT NULL,
       has_database_privilege(current_database(), 'CREATE'),
       CASE WHEN n.oid IS NOT NULL THEN has_schema_privilege(n.oid, 'USAGE') END,
       CASE WHEN n.oid IS NOT NULL THEN has_schema_privilege(n.oid, 'CREATE') END
FROM (SELECT 1) AS one LEFT JOIN pg_namespace AS n ON n.nspname = 'jobrun'
"""

#: One jobrun table: does it exist, and which of SELECT/INSERT/UPDATE/DELETE may we use.
DOCTOR_TABLE = """
SELECT c.oid IS NOT NULL,
       CASE WHEN c.oid IS NOT NULL THEN has_table_privilege(c.oid, 'SELECT') END,
       CASE WHEN c.oid IS NOT NULL THEN has_table_privilege(c.oid, 'INSERT') END,
       CASE WHEN c.oid IS NOT NULL THEN has_table_privilege(c.oid, 'UPDATE') END,
       CASE WHEN c.oid IS NOT NULL THEN has_table_privilege(c.oid, 'DELETE') END
FROM (SELECT 1) AS one
LEFT JOIN (pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace)
    ON n.nspname = 'jobrun' AND c.relname = %(table)s AND c.relkind IN ('r', 'p')
"""

#: Settings as a fresh session sees them (server file, ALTER DATABASE / ROLE ... SET).
DOCTOR_SETTINGS = """
SELECT name, setting, unit, current_setting(name) FROM pg_settings WHERE name = ANY(%(names)s)
"""

#: Whether we came over TCP (server-side keepalives apply) or a Unix-domain socket.
DOCTOR_OVER_TCP = "SELECT inet_server_addr() IS NOT NULL"

DOCTOR_CONNECTIONS = """
SELECT current_setting('max_connections')::int,
       current_setting('superuser_reserved_connections')::int,
       coalesce(current_setting('reserved_connections', true), '0')::int,
       (SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend')
"""

DOCTOR_LOCK_CAPACITY = """
SELECT current_setting('max_locks_per_transaction')::int8
       * (current_setting('max_connections')::int8
          + current_setting('max_prepared_transactions')::int8)
"""

#: Advisory locks held now: in the whole cluster (they share the lock table), in this
#: database, and in this database by jobrun's lock sessions.
DOCTOR_ADVISORY = """
SELECT count(*),
       count(*) FILTER (WHERE l.database = d.oid),
       count(*) FILTER (WHERE l.database = d.oid AND a.application_name LIKE 'jobrun:%')
FROM pg_locks AS l
LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
CROSS JOIN (SELECT oid FROM pg_database WHERE datname = current_database()) AS d
WHERE l.locktype = 'advisory' AND l.granted
"""

# --- history transactions -------------------------------------------------------------------

#: History transactions are opened and closed by hand: a connection cut on purpose (a silent
#: network) is then simply closed, where psycopg's transaction block would try to roll back
#: and log a non-JSON warning line on stderr.
BEGIN = "BEGIN"
COMMIT = "COMMIT"
ROLLBACK = "ROLLBACK"
SAVEPOINT_PRUNE = "SAVEPOINT prune"
ROLLBACK_TO_PRUNE = "ROLLBACK TO SAVEPOINT prune"
RELEASE_PRUNE = "RELEASE SAVEPOINT prune"

# --- jobrun overlap ---

#: The sessions of one ``jobrun overlap`` attempt (by application_name, in this database):
#: the statement each runs, whether it is inside a transaction, who blocks it, and the lock it
#: waits for. One pg_locks snapshot serves every row. A wait for a row shows as a wait for the
#: holder's transaction; the tuple lock the waiter holds meanwhile names the row and its table.
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
SELECT a.pid, a.application_name,
       a.xact_start IS NOT NULL AND a.state IN ('active', 'idle in transaction'),
       a.wait_event_type, a.wait_event, left(a.query, %(query_chars)s),
       pg_blocking_pids(a.pid),
       w.locktype, w.mode, w.relation, w.ident, t.relation, t.ident
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

#: End what is left of an attempt's sessions after its commands were killed: a killed
#: client's backend keeps its locks until it notices, which can take until the lock it
#: waits for is granted.
OVERLAP_TERMINATE = """
SELECT pg_terminate_backend(pid) FROM pg_stat_activity
WHERE application_name = ANY(%(names)s)
  AND datid = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND pid <> pg_backend_pid()
"""

#: Session settings jobrun pins on its own sessions (start-up options, else PIN_SETTINGS).
PINNED_SETTINGS: tuple[tuple[str, str], ...] = (
    ("DateStyle", "ISO"),
    ("IntervalStyle", "postgres"),
    ("TimeZone", "UTC"),
    ("client_encoding", "UTF8"),
    ("search_path", '"$user", public'),
    ("extra_float_digits", "1"),
)
#: The same as one statement, for a session that started without them (a pooler).
PIN_SETTINGS = (
    "SET DateStyle = 'ISO'; SET IntervalStyle = 'postgres'; SET TimeZone = 'UTC'; "
    "SET client_encoding = 'UTF8'; "
    'SET search_path = "$user", public; '
    "SET extra_float_digits = 1"
)
