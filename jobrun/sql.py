"""Every SQL statement jobrun sends, named, in one place."""

from __future__ import annotations

BACKEND_PID = "SELECT pg_backend_pid()"

# --- session mode: advisory locks on a dedicated connection ---------------------------------

#: Make the lock session immune to server-side idle timeouts (a role or database setting would
#: otherwise end the session, and with it the lock, while the child runs). 14+ knows both.
SESSION_IMMUNE_14 = (
    "SET idle_in_transaction_session_timeout = 0; SET idle_session_timeout = 0; "
    "SET statement_timeout = 0; "
    # A --wait for the next key blocks the backend in pg_advisory_lock: without this it
    # would notice a killed jobrun only when the wait ends, holding the keys already taken.
    "SET client_connection_check_interval = '1s'"
)
SESSION_IMMUNE = "SET idle_in_transaction_session_timeout = 0; SET statement_timeout = 0"

#: Server-side keepalives for the lock session (idle seconds given; probes every 2 s, 3 of
#: them), so the server ends the session of a host that vanished (the OS default keeps a
#: half-open connection, and the lock, for over 2 hours); and whether
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
#: classid (high 32 bits) and objid (low 32 bits) with objsubid 1 (an int4 pair would be
#: objsubid 2); the shift wraps, so negative ids come back exactly.
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
SELECT l.owner::text AS owner, l.acquired_at, l.expires_at, clock_timestamp() AS now
FROM (SELECT 1) AS one LEFT JOIN jobrun.leases AS l ON l.lock_id = %s
"""

#: A stranger takes the lease over: the holder's next owner-checked renewal must fail.
DRILL_STEAL_LEASE = "UPDATE jobrun.leases SET owner = %s WHERE lock_id = %s"

#: Only leases the drill's own runs (or its stranger) own: never a real job's.
DRILL_DELETE_LEASE = """
DELETE FROM jobrun.leases WHERE lock_id = %s AND owner::text = ANY(%s::text[])
"""

# --- operators in control: stop requests, pauses, expectations -------------------------------

#: ``jobrun stop`` writes a row for the run it stops, by run id (a request never reaches the
#: next run); that run's heartbeat reads it. ``jobrun pause`` writes one row per key label.
#: ``--expect-every`` keeps one row per key label: how often a successful run is expected.
#: Created with the run history (RUNS_SCHEMA), or by ``stop``/``pause`` themselves.
CONTROL_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS jobrun;
CREATE TABLE IF NOT EXISTS jobrun.stop_requests (
    run_id       uuid PRIMARY KEY,
    key          text NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    host         text NOT NULL,
    username     text NOT NULL,
    pid          integer NOT NULL,
    reason       text
);
CREATE TABLE IF NOT EXISTS jobrun.pauses (
    key       text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    until     timestamptz,
    host      text NOT NULL,
    username  text NOT NULL,
    pid       integer NOT NULL,
    reason    text
);
CREATE TABLE IF NOT EXISTS jobrun.expectations (
    key        text PRIMARY KEY,
    every      double precision NOT NULL,
    grace      double precision NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
)
"""

#: The lock session's heartbeat (HELD_BY_US) and a stop request for this run, in one statement.
HELD_BY_US_OR_STOP = """
SELECT (SELECT count(*) FROM pg_locks
        WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND pid = pg_backend_pid()
          AND ((classid::int8 << 32) | objid::int8) = ANY(%s)),
       (SELECT row_to_json(s)::text FROM (
            SELECT host, username, pid, reason, requested_at FROM jobrun.stop_requests
            WHERE run_id = %s::uuid) AS s)
"""

#: Lease mode's renewal (LEASE_RENEW) and a stop request for this run, in one statement.
LEASE_RENEW_OR_STOP = """
WITH renewed AS (
    UPDATE jobrun.leases
    SET renewed_at = clock_timestamp(),
        expires_at = clock_timestamp() + make_interval(secs => %(ttl)s)
    WHERE lock_id = ANY(%(lock_ids)s) AND owner = %(owner)s
      AND expires_at > clock_timestamp()
    RETURNING lock_id
)
SELECT (SELECT count(*) FROM renewed),
       (SELECT row_to_json(s)::text FROM (
            SELECT host, username, pid, reason, requested_at FROM jobrun.stop_requests
            WHERE run_id = %(owner)s::uuid) AS s)
"""

#: ``jobrun stop``: ask the run ``run_id`` to stop (a repeated request keeps the first).
STOP_REQUEST = """
INSERT INTO jobrun.stop_requests (run_id, key, host, username, pid, reason)
VALUES (%(run_id)s, %(key)s, %(host)s, %(user)s, %(pid)s, %(reason)s)
ON CONFLICT (run_id) DO NOTHING
"""

#: Stop requests whose run has ended (no lease or session of it can still read them).
STOP_REQUESTS_PRUNE = """
DELETE FROM jobrun.stop_requests WHERE requested_at < clock_timestamp() - interval '1 day'
"""

#: ``jobrun stop``: the lease-mode holder of a key (owner = run id).
STOP_LEASE_HOLDER = """
SELECT owner::text, host, pid FROM jobrun.leases
WHERE lock_id = ANY(%s::int8[]) AND expires_at > clock_timestamp()
ORDER BY lock_id LIMIT 1
"""

#: Whether the run still holds its lock: its lease (lease mode), or its lock session's
#: advisory lock (session mode: the backend that held it when the stop was asked).
STOP_STILL_LEASED = """
SELECT EXISTS (SELECT 1 FROM jobrun.leases WHERE owner = %(run_id)s::uuid
               AND expires_at > clock_timestamp())
"""
STOP_STILL_LOCKED = """
SELECT EXISTS (SELECT 1 FROM pg_locks
               WHERE locktype = 'advisory' AND granted AND objsubid = 1
                 AND pid = %(backend_pid)s
                 AND ((classid::int8 << 32) | objid::int8) = ANY(%(lock_ids)s::int8[]))
"""

#: ``jobrun stop --force``: take the lock away from a run that did not end.
STOP_TERMINATE = "SELECT pg_terminate_backend(%s)"
STOP_DELETE_LEASE = "DELETE FROM jobrun.leases WHERE owner = %s::uuid"

#: How the stopped run ended, from the history (None: no history row).
STOP_OUTCOME = "SELECT outcome, exit_code FROM jobrun.runs WHERE run_id = %s::uuid"

#: ``jobrun pause``: (re)place the pause of a key.
PAUSE = """
INSERT INTO jobrun.pauses (key, until, host, username, pid, reason)
VALUES (%(key)s, clock_timestamp() + make_interval(secs => %(for)s::float8), %(host)s,
        %(user)s, %(pid)s, %(reason)s)
ON CONFLICT (key) DO UPDATE
    SET paused_at = clock_timestamp(), until = excluded.until, host = excluded.host,
        username = excluded.username, pid = excluded.pid, reason = excluded.reason
RETURNING paused_at, until
"""
PAUSE_UNTIL = """
INSERT INTO jobrun.pauses (key, until, host, username, pid, reason)
VALUES (%(key)s, %(until)s::timestamptz, %(host)s, %(user)s, %(pid)s, %(reason)s)
ON CONFLICT (key) DO UPDATE
    SET paused_at = clock_timestamp(), until = excluded.until, host = excluded.host,
        username = excluded.username, pid = excluded.pid, reason = excluded.reason
RETURNING paused_at, until
"""

#: ``jobrun resume``: end the pause of a key (the row it deleted, if any).
RESUME = "DELETE FROM jobrun.pauses WHERE key = %s RETURNING paused_at, until"

#: The pauses in force for these keys (a history message's part, or a statement of its own).
PAUSES_IN_FORCE = """
SELECT key, paused_at, until, host, username, pid, reason FROM jobrun.pauses
WHERE key = ANY(%(pause_keys)s::text[])
  AND (until IS NULL OR until > clock_timestamp())
ORDER BY key LIMIT 1
"""

#: ``--expect-every``: how often this key is expected to succeed (NULL every: no change).
EXPECTATION = """
INSERT INTO jobrun.expectations (key, every, grace)
SELECT %(key)s, %(expect_every)s, %(expect_grace)s WHERE %(expect_every)s::float8 IS NOT NULL
ON CONFLICT (key) DO UPDATE
    SET every = excluded.every, grace = excluded.grace, updated_at = clock_timestamp()
"""

#: ``status``: every pause in force and every expectation (of the keys asked for, or all).
STATUS_PAUSES = """
SELECT key, paused_at, until, host, username, pid, reason FROM jobrun.pauses
WHERE (until IS NULL OR until > clock_timestamp()) AND (%(all)s OR key = ANY(%(keys)s::text[]))
"""
STATUS_EXPECTATIONS = """
SELECT e.key, e.every, e.grace,
       (SELECT max(x.started_at) FROM jobrun.runs AS x
        WHERE x.key = e.key AND x.outcome = 'succeeded') AS last_success_started_at,
       (SELECT max(x.started_at) FROM jobrun.runs AS x
        WHERE x.key = e.key AND x.outcome = 'succeeded')
           < clock_timestamp() - make_interval(secs => e.every + e.grace)
       OR NOT EXISTS (SELECT 1 FROM jobrun.runs AS x
                      WHERE x.key = e.key AND x.outcome = 'succeeded')
          AND e.updated_at < clock_timestamp() - make_interval(secs => e.every + e.grace)
           AS overdue
FROM jobrun.expectations AS e
WHERE %(all)s OR e.key = ANY(%(keys)s::text[])
"""

#: ``status``: runs still going, with how long they have run (for "stuck").
STATUS_RUNNING = """
SELECT key, run_id, extract(epoch FROM clock_timestamp() - started_at)::float8 AS running_for
FROM jobrun.runs WHERE outcome = 'running' AND (%(all)s OR key = ANY(%(keys)s::text[]))
"""

# --- run history ------------------------------------------------------------------------------
#
# Each history call is ONE message of the statements below, joined by ";" and bound on the
# client: the server runs it as one implicit transaction (the settings made local by
# RUNS_TIMEOUTS end with it). Literal percent signs must be doubled (client-side binding).

#: The run history, created (and brought up to date) under the schema's transaction lock.
#: ``streak`` is what the row extends: a skip, this host's skips in a row by the same holder;
#: a failure, failures in a row; else 0. Kept in the row so that pruning never shortens it.
#: ``alerted_at``: when the streak this row extends last alerted, carried from row to row (so
#: pruning never loses it) and agreed on by every host of a fleet: when the next reminder is
#: due, and which streaks still owe a ``recovered``. ``deadlocks``: deadlocks in the job's
#: database while the run ran (pg_stat_database at its start and at its end).
RUNS_SCHEMA = (
    """
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
    holder       jsonb,
    alerted_at   timestamptz,
    deadlocks    bigint
);
ALTER TABLE jobrun.runs ADD COLUMN IF NOT EXISTS alerted_at timestamptz,
                        ADD COLUMN IF NOT EXISTS deadlocks bigint;
CREATE INDEX IF NOT EXISTS runs_key_started_at ON jobrun.runs (key, started_at DESC);
CREATE INDEX IF NOT EXISTS runs_running_lock_ids ON jobrun.runs USING gin (lock_ids)
    WHERE outcome = 'running'
;
"""
    + CONTROL_SCHEMA
)

#: Serializes the schema's creation (transaction-scoped: released with the message).
RUNS_SCHEMA_LOCK = "SELECT pg_advisory_xact_lock(%(schema_lock)s)"

#: Every history message starts with this: a history statement never holds a job (or the
#: heartbeat sharing its session) up for longer than its share of the call's timeout.
RUNS_TIMEOUTS = """
SELECT set_config('statement_timeout', %(ms)s, true), set_config('lock_timeout', %(ms)s, true)
"""

#: Runs still marked running on any of our lock ids are dead: we hold those locks now.
RUNS_ABANDON = """
UPDATE jobrun.runs SET outcome = 'abandoned', finished_at = clock_timestamp()
WHERE outcome = 'running' AND lock_ids && %(lock_ids)s::int8[] AND run_id <> %(run_id)s
RETURNING run_id, key, host, pid, started_at
"""

#: The run of this key that makes ours redundant under ``--once-per`` (window NULL: none): it
#: started in the current window, aligned to the Unix epoch on the database's clock, and is
#: running or succeeded.
_EARLIER = """
SELECT run_id, host, pid, started_at, outcome, w.start AS window_start
FROM jobrun.runs,
     (SELECT to_timestamp(floor(extract(epoch FROM clock_timestamp())::float8
                                / %(window)s::float8) * %(window)s::float8) AS start) AS w
WHERE key = %(key)s AND run_id <> %(run_id)s AND outcome IN ('running', 'succeeded')
  AND started_at >= w.start
ORDER BY started_at DESC
LIMIT 1
"""
RUNS_ALREADY_RAN = _EARLIER

#: Our ``running`` row, unless an earlier run makes us redundant or the key is paused; with
#: the database's count of deadlocks so far, so that the end of the run can say how many
#: happened during it.
#: (Composed of constants only: no input is ever formatted into SQL.)
RUNS_ACQUIRED = f"""
INSERT INTO jobrun.runs
    (run_id, key, lock_ids, mode, host, pid, program, started_at, outcome)
SELECT %(run_id)s, %(key)s, %(lock_ids)s::int8[], %(mode)s, %(host)s, %(pid)s, %(program)s,
       clock_timestamp(), 'running'
WHERE NOT EXISTS ({_EARLIER}) AND NOT EXISTS ({PAUSES_IN_FORCE})
ON CONFLICT (run_id) DO NOTHING
RETURNING started_at,
          (SELECT deadlocks FROM pg_stat_database WHERE datname = current_database())
              AS deadlocks
"""  # noqa: S608 - constants only

#: The skip streaks of this key that alerted end now (a run got the lock): claimed by exactly
#: one run, which reports each one's length and start once (``recovered``).
RUNS_SKIPS_RECOVERED = """
WITH claimed AS (
    UPDATE jobrun.runs SET alerted_at = NULL
    WHERE key = %(key)s AND outcome = 'skipped' AND alerted_at IS NOT NULL
    RETURNING holder_ref
)
SELECT max(r.streak) AS count, min(r.streak_since) AS since, clock_timestamp() AS ended
FROM jobrun.runs AS r
WHERE r.key = %(key)s AND r.outcome = 'skipped' AND r.holder_ref IN (SELECT holder_ref FROM claimed)
GROUP BY r.holder_ref
"""

#: Record how a run ended (inserting the row if its start was never recorded), with the
#: failure streak it extends and whether that streak alerts now: at ``alert_after`` failures
#: in a row, then again once ``repeat`` seconds have passed since its last alert. A success
#: after a streak that alerted reports that streak (``recovered_*``).
RUNS_FINISH = """
WITH previous AS (
    SELECT outcome, streak, streak_since, alerted_at FROM jobrun.runs
    WHERE key = %(key)s AND run_id <> %(run_id)s
      AND outcome IN ('succeeded', 'failed', 'timed_out', 'lock_lost', 'exec_failed')
    ORDER BY finished_at DESC
    LIMIT 1
), chain AS (
    SELECT p.outcome IN ('failed', 'timed_out', 'lock_lost', 'exec_failed') AS failing, p.*
    FROM (SELECT 1) AS one LEFT JOIN previous AS p ON true
), s AS (
    SELECT CASE WHEN NOT %(failed)s THEN 0
                WHEN coalesce(c.failing, false) THEN c.streak + 1 ELSE 1 END AS streak,
           CASE WHEN %(failed)s AND coalesce(c.failing, false) THEN c.streak_since END AS since,
           CASE WHEN %(failed)s AND coalesce(c.failing, false) THEN c.alerted_at END AS last_alert,
           CASE WHEN NOT %(failed)s AND coalesce(c.failing, false) AND c.alerted_at IS NOT NULL
                THEN c.streak END AS recovered_count,
           c.streak_since AS recovered_since,
           coalesce(%(started_at)s::timestamptz,
                    clock_timestamp() - make_interval(secs => %(duration)s)) AS at
    FROM chain AS c
), d AS (
    SELECT s.*,
           %(alert_after)s > 0 AND s.streak >= %(alert_after)s
           AND (s.last_alert IS NULL
                OR s.last_alert <= clock_timestamp() - make_interval(secs => %(repeat)s))
               AS alert
    FROM s
)
INSERT INTO jobrun.runs AS r
    (run_id, key, lock_ids, mode, host, pid, child_pid, program, started_at, finished_at,
     outcome, exit_code, signal, duration, streak, streak_since, alerted_at, deadlocks)
SELECT %(run_id)s, %(key)s, %(lock_ids)s::int8[], %(mode)s, %(host)s, %(pid)s, %(child_pid)s,
       %(program)s, d.at, clock_timestamp(), %(outcome)s, %(exit_code)s, %(signal)s,
       %(duration)s, d.streak,
       CASE WHEN d.streak > 0 THEN coalesce(d.since, d.at) END,
       CASE WHEN d.alert THEN clock_timestamp() ELSE d.last_alert END,
       (SELECT deadlocks FROM pg_stat_database WHERE datname = current_database())
           - %(deadlocks_at_start)s
FROM d
ON CONFLICT (run_id) DO UPDATE
    SET finished_at = excluded.finished_at, outcome = excluded.outcome,
        child_pid = excluded.child_pid, exit_code = excluded.exit_code,
        signal = excluded.signal, duration = excluded.duration, streak = excluded.streak,
        streak_since = CASE WHEN excluded.streak > 0
                            THEN coalesce((SELECT since FROM d), r.started_at) END,
        alerted_at = excluded.alerted_at, deadlocks = excluded.deadlocks
RETURNING streak, streak_since, finished_at, deadlocks,
          (SELECT alert FROM d) AS alert,
          (SELECT recovered_count FROM d) AS recovered_count,
          (SELECT recovered_since FROM d) AS recovered_since
"""

#: Taken before RUNS_SKIP (its own statement, so RUNS_SKIP's snapshot comes after it): hosts
#: skipping behind the same holder at the same moment take turns until their transactions
#: end, so each reads the streaks the others wrote. Two int4 halves (objsubid 2): never one
#: of the bigint lock ids jobs use, and never shown by ``jobrun status``. Without a holder
#: (NULL) no lock is taken.
RUNS_SKIP_SERIALIZE = """
SELECT pg_advisory_xact_lock(hashtext('jobrun.skip'),
                             hashtext(%(key)s::text || ':' || %(holder_ref)s::text))
"""

#: Record a skip. Behind a known holder it extends this host's chain of skips behind that
#: holder; the chain alerts at ``alert_after``, then again once ``repeat`` seconds have passed
#: since any host's last alert of it: one reminder per period for the whole fleet.
RUNS_SKIP = """
WITH chain AS (
    SELECT max(streak) FILTER (WHERE host = %(host)s) AS mine,
           min(streak_since) FILTER (WHERE host = %(host)s) AS since,
           max(alerted_at) AS last_alert
    FROM jobrun.runs
    WHERE key = %(key)s AND outcome = 'skipped' AND holder_ref = %(holder_ref)s
), d AS (
    SELECT CASE WHEN %(locked)s THEN coalesce(c.mine, 0) + 1 ELSE 0 END AS streak, c.since,
           c.last_alert,
           %(locked)s AND %(alert_after)s > 0
           AND coalesce(c.mine, 0) + 1 >= %(alert_after)s
           AND (c.last_alert IS NULL
                OR c.last_alert <= clock_timestamp() - make_interval(secs => %(repeat)s))
               AS alert
    FROM chain AS c
)
INSERT INTO jobrun.runs AS r
    (run_id, key, lock_ids, mode, host, pid, program, started_at, finished_at, outcome, reason,
     exit_code, duration, streak, streak_since, holder_ref, holder, alerted_at)
SELECT %(run_id)s, %(key)s, %(lock_ids)s::int8[], %(mode)s, %(host)s, %(pid)s, %(program)s,
       clock_timestamp(), clock_timestamp(), 'skipped', %(reason)s, %(exit_code)s,
       %(duration)s, d.streak,
       CASE WHEN d.streak > 0 THEN coalesce(d.since, clock_timestamp()) END,
       %(holder_ref)s, %(holder)s,
       CASE WHEN d.alert THEN clock_timestamp() ELSE d.last_alert END
FROM d
ON CONFLICT (run_id) DO UPDATE
    SET finished_at = excluded.finished_at, outcome = excluded.outcome, reason = excluded.reason,
        exit_code = excluded.exit_code, duration = excluded.duration, streak = excluded.streak,
        streak_since = excluded.streak_since, holder_ref = excluded.holder_ref,
        holder = excluded.holder, alerted_at = excluded.alerted_at
RETURNING streak, streak_since, (SELECT alert FROM d) AS alert
"""

#: Keep the newest N finished runs and the newest N skips of a key, and each host's newest
#: skip of it: that row carries the host's skip streak (RUNS_SKIP), which the skips of a fleet
#: larger than N would otherwise push out. So at most N + hosts skips; running rows stay.
#: SKIP LOCKED: a fleet of hosts pruning the same key at once neither waits nor deadlocks. A
#: role that may not delete prunes nothing (and its history is still written).
RUNS_PRUNE = """
DELETE FROM jobrun.runs WHERE has_table_privilege('jobrun.runs', 'DELETE') AND run_id IN (
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
       outcome, reason, exit_code, signal, duration, streak, deadlocks, holder
FROM jobrun.runs
WHERE key = %(key)s
ORDER BY started_at DESC
LIMIT %(limit)s
"""

#: ``jobrun history KEY --overlapping OTHER``: every pair of a run of KEY and a run of OTHER
#: whose windows intersected (a run still going counts until now), newest first; ``since``:
#: only runs of KEY that started that many seconds ago or later. Skips never ran anything.
RUNS_OVERLAPPING = """
SELECT a.run_id, a.host, a.pid, a.started_at, a.finished_at, a.outcome, a.exit_code,
       a.deadlocks,
       b.run_id AS other_run_id, b.host AS other_host, b.pid AS other_pid,
       b.started_at AS other_started_at, b.finished_at AS other_finished_at,
       b.outcome AS other_outcome, b.exit_code AS other_exit_code,
       b.deadlocks AS other_deadlocks,
       extract(epoch FROM least(coalesce(a.finished_at, clock_timestamp()),
                                coalesce(b.finished_at, clock_timestamp()))
                          - greatest(a.started_at, b.started_at))::float8 AS overlap
FROM jobrun.runs AS a
JOIN jobrun.runs AS b
  ON b.key = %(other)s AND b.outcome <> 'skipped'
 AND b.started_at < coalesce(a.finished_at, clock_timestamp())
 AND a.started_at < coalesce(b.finished_at, clock_timestamp())
WHERE a.key = %(key)s AND a.outcome <> 'skipped'
  AND (%(since)s::float8 IS NULL
       OR a.started_at >= clock_timestamp() - make_interval(secs => %(since)s::float8))
ORDER BY a.started_at DESC, b.started_at DESC
LIMIT %(limit)s
"""

# --- status -----------------------------------------------------------------------------------

#: Every granted bigint advisory lock in this database, with whoever holds it.
STATUS_ADVISORY_LOCKS = """
SELECT (l.classid::int8 << 32) | l.objid::int8 AS lock_id, l.pid,
       host(a.client_addr) AS client_addr, a.application_name, a.backend_start, a.query
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

#: The doctor's own session must not be cut short by the role's statement_timeout: it reads
#: the role's value from pg_settings.reset_val (the value a new session starts with) instead.
#: SHOW and SET touch no catalog, so they finish even under a 1 ms timeout on a busy server.
DOCTOR_STATEMENT_TIMEOUT = "SHOW statement_timeout"
DOCTOR_IMMUNE = "SET statement_timeout = 0"
DOCTOR_IMMUNE_END = "RESET statement_timeout"

#: Settings as every new session of this role starts with them (server file, ALTER
#: DATABASE / ROLE ... SET), even after this session changed them for itself.
DOCTOR_SESSION_DEFAULTS = """
SELECT name, reset_val, unit FROM pg_settings WHERE name = ANY(%(names)s)
"""

# --- jobrun overlap ---

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

# --- fencing tokens, kept output ---------------------------------------------------------------

#: One sequence for every key: a token is greater than every token handed out before it,
#: whichever key, host or lock mode took it. CACHE 1 (the default, spelled out): a session
#: that cached values would hand out numbers smaller than ones another session already used.
FENCE_SCHEMA = """
CREATE SCHEMA IF NOT EXISTS jobrun;
CREATE SEQUENCE IF NOT EXISTS jobrun.fence AS bigint MINVALUE 1 NO CYCLE CACHE 1;
"""

FENCE_NEXT = "SELECT nextval('jobrun.fence')"

#: The output tails of a run, in its history row (nullable: only runs that kept output).
RUNS_TAIL_COLUMNS = """
ALTER TABLE jobrun.runs ADD COLUMN IF NOT EXISTS stdout_tail bytea;
ALTER TABLE jobrun.runs ADD COLUMN IF NOT EXISTS stderr_tail bytea;
"""

RUNS_STORE_TAIL = """
UPDATE jobrun.runs SET stdout_tail = %(stdout)s, stderr_tail = %(stderr)s
WHERE run_id = %(run_id)s
"""

RUNS_TAIL = """
SELECT run_id, key, host, outcome, exit_code, started_at, stdout_tail, stderr_tail
FROM jobrun.runs WHERE run_id = %(run_id)s
"""

#: The run without tails, in a history that never kept any (the columns do not exist yet).
RUNS_TAIL_NONE = """
SELECT run_id, key, host, outcome, exit_code, started_at, NULL::bytea, NULL::bytea
FROM jobrun.runs WHERE run_id = %(run_id)s
"""
