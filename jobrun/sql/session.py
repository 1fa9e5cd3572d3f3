"""Statements of jobrun's own sessions: pinned settings and session mode's advisory locks."""

from __future__ import annotations

#: The search_path of jobrun's own sessions: PostgreSQL's own objects only. jobrun names
#: its tables ``jobrun.*``; nothing it sends may resolve to a function or operator another
#: role created in a schema on the path (a ``public.unnest(bigint[])`` beats pg_catalog's
#: ``unnest(anyarray)`` by its exact types, wherever pg_catalog sits: CVE-2018-1058).
#: ``pg_temp`` last: no temporary table or function can shadow a name either.
SEARCH_PATH = "pg_catalog, pg_temp"

BACKEND_PID = "SELECT pg_backend_pid()"

#: Make the lock session immune to server-side idle timeouts (a role or database setting would
#: otherwise end the session, and with it the lock, while the child runs). 14+ knows both.
#: The lock session's settings and facts, in one message: no timeout of the role or the
#: database may end it while the child runs (idle_session_timeout exists from PostgreSQL
#: 14); server-side keepalives (idle seconds given, an integer: probes every 2 s, 3 of
#: them), so the server ends the session of a host that vanished (the OS default keeps a
#: half-open connection, and the lock, for over 2 hours); whether the server is a standby
#: (its advisory locks are its own: shared with nobody else); and the backend that runs our
#: statements (a pooler announces a backend pid of its own: see db.detect_transaction_pooler).
#: The search_path is set here too, at no cost: the start-up options pin it, but a session
#: pooler may drop them, and a session lock needs the session anyway.
SESSION_IMMUNE = (
    "SET idle_in_transaction_session_timeout = 0; SET statement_timeout = 0; "
    f"SET search_path = {SEARCH_PATH}; "
)
SESSION_IMMUNE_14 = (
    SESSION_IMMUNE + "SET idle_session_timeout = 0; "
    # A --wait for the next key blocks the backend in pg_advisory_lock: without this it
    # would notice a killed jobrun only when the wait ends, holding the keys already taken.
    "SET client_connection_check_interval = '1s'; "
)
SESSION_SETUP = """
SELECT set_config('tcp_keepalives_idle', '{idle:d}', false),
       set_config('tcp_keepalives_interval', '2', false),
       set_config('tcp_keepalives_count', '3', false),
       pg_is_in_recovery(),
       pg_backend_pid()
"""

#: After the advisory locks are ours, in a DO block whose answer is the setting
#: ``jobrun.leased`` (local to the message): ``not granted`` when ``jobrun init`` guards
#: this database and the role may not run the label (``jobrun.label``, set earlier in the
#: same message; a role without USAGE on the schema was granted nothing); else the
#: lease-mode run of a key we took, as JSON (session mode must respect it: lease mode
#: takes a transaction lock on the same ids as it writes its lease, so a lease written
#: before our locks were granted is seen here); ``unreadable`` when the table is out of
#: reach. Every name qualified: the block runs with whatever search_path the session has.
_GRANTED_AND_LEASED = """
DO $jobrun$
BEGIN
  IF EXISTS (SELECT 1 FROM pg_catalog.pg_proc AS p
             JOIN pg_catalog.pg_namespace AS n ON n.oid OPERATOR(pg_catalog.=) p.pronamespace
             WHERE n.nspname OPERATOR(pg_catalog.=) 'jobrun'
               AND p.proname OPERATOR(pg_catalog.=) 'may_run_as') THEN
    IF NOT pg_catalog.has_schema_privilege('jobrun', 'USAGE') THEN
      PERFORM pg_catalog.set_config('jobrun.leased', 'not granted', true);
      RETURN;
    END IF;
    IF NOT jobrun.may_run_as(current_user, pg_catalog.current_setting('jobrun.label')) THEN
      PERFORM pg_catalog.set_config('jobrun.leased', 'not granted', true);
      RETURN;
    END IF;
  END IF;
  IF pg_catalog.to_regclass('jobrun.leases') IS NOT NULL THEN
    PERFORM pg_catalog.set_config('jobrun.leased', coalesce((
      SELECT pg_catalog.row_to_json(l)::pg_catalog.text FROM (
        SELECT key, owner, host, pid, acquired_at, expires_at FROM jobrun.leases
        WHERE expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp() AND lock_id IN (
          SELECT (classid::bigint OPERATOR(pg_catalog.<<) 32) OPERATOR(pg_catalog.|) objid::bigint
          FROM pg_catalog.pg_locks
          WHERE pid OPERATOR(pg_catalog.=) pg_catalog.pg_backend_pid()
            AND locktype OPERATOR(pg_catalog.=) 'advisory' AND granted
            AND objsubid OPERATOR(pg_catalog.=) 1)
        ORDER BY lock_id LIMIT 1) AS l), ''), true);
  END IF;
EXCEPTION WHEN insufficient_privilege THEN  -- the schema or the table
  PERFORM pg_catalog.set_config('jobrun.leased', 'unreadable', true);
END
$jobrun$;
"""
#: What _GRANTED_AND_LEASED found (NULL: nothing in the way).
_LEASED_ANSWER = "nullif(pg_catalog.current_setting('jobrun.leased', true), '')"

#: The same check as a message of its own, once every key is ours (several keys, --wait,
#: the full probe): the label, the DO block, its answer.
SESSION_LEASED = (
    "SELECT pg_catalog.set_config('jobrun.label', %(label)s, true);"
    + _GRANTED_AND_LEASED
    + f"SELECT {_LEASED_ANSWER}"
)

#: What ``jobrun.leased`` says when the role may not run the label.
NOT_GRANTED = "not granted"

TRY_LOCK = "SELECT pg_try_advisory_lock(%s)"
LOCK = "SELECT pg_advisory_lock(%s)"
UNLOCK = "SELECT pg_advisory_unlock(%s)"
SET_LOCK_TIMEOUT = "SELECT set_config('lock_timeout', %s, false)"

#: First in a heartbeat's message (bound on the client: one message, one implicit
#: transaction, the setting local to it): how long its statement may wait for a table lock.
HEARTBEAT_LOCK_WAIT = "SELECT set_config('lock_timeout', %(lock_wait)s, true)"

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


#: Session settings jobrun pins on its own sessions (start-up options, else PIN_SETTINGS).
PINNED_SETTINGS: tuple[tuple[str, str], ...] = (
    ("DateStyle", "ISO"),
    ("IntervalStyle", "postgres"),
    ("TimeZone", "UTC"),
    ("client_encoding", "UTF8"),
    ("search_path", SEARCH_PATH),
    ("extra_float_digits", "1"),
    # No plan of jobrun's is worth compiling: JIT turns on by a plan's estimated cost, and
    # a misestimate (a key taken for hundreds) made status spend seconds compiling.
    ("jit", "off"),
)
#: The same as one statement, for a session that started without them (a pooler).
PIN_SETTINGS = (
    "SET DateStyle = 'ISO'; SET IntervalStyle = 'postgres'; SET TimeZone = 'UTC'; "
    "SET client_encoding = 'UTF8'; "
    f"SET search_path = {SEARCH_PATH}; "
    "SET extra_float_digits = 1; SET jit = off"
)

#: One key, no --wait: the lock session's settings, facts and lock in ONE message (after
#: SESSION_IMMUNE*, bound on the client). The lock is tried only where it cannot be
#: stranded or worthless: on the very backend the handshake announced (a pooler announces
#: a pid of its own: NULL, then the full probe) and on a primary (a standby's locks are its
#: own). Then, in statements of their own (a snapshot taken after the lock was granted: a
#: lease written before that is seen), the lease-mode run of a key we took (DO: the table
#: may not exist, or be out of reach (to_regclass itself fails without USAGE on the
#: schema); the answer in a setting local to the message), the
#: session holding the key when we did not get it, and with --fence a token (only while
#: we hold the key, and only where the sequence exists, is one, and may be used (read from
#: the catalog: no name lookup that a missing privilege turns into an error): else NULL,
#: and the token is taken the other way, which creates the sequence or says what is wrong).
#: No statement here may fail where lease or fence were never used: a failed message
#: undoes the settings, while a session lock it took outlives it (the session is closed).
SESSION_TAKE_AT_ONCE = f"""
SELECT set_config('tcp_keepalives_idle', %(idle)s, false),
       set_config('tcp_keepalives_interval', '2', false),
       set_config('tcp_keepalives_count', '3', false),
       pg_is_in_recovery(),
       pg_backend_pid(),
       CASE WHEN pg_backend_pid() = %(handshake)s AND NOT pg_is_in_recovery()
            THEN pg_try_advisory_lock(%(lock_id)s) END,
       pg_catalog.set_config('jobrun.label', %(label)s, true);
{_GRANTED_AND_LEASED}SELECT {_LEASED_ANSWER} AS leased,
       h.pid, h.client_addr, h.application_name, h.backend_start, h.query,
       CASE WHEN %(fence)s AND h.ours THEN (
           SELECT CASE WHEN has_schema_privilege(n.oid, 'USAGE')
                            AND has_sequence_privilege(c.oid, 'USAGE, UPDATE')
                       THEN nextval(c.oid::regclass) END
           FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
           WHERE n.nspname = 'jobrun' AND c.relname = 'fence' AND c.relkind = 'S'
       ) END AS fence
FROM (SELECT 1) AS one
LEFT JOIN LATERAL (
    SELECT l.pid = pg_backend_pid() AS ours, l.pid, host(a.client_addr) AS client_addr,
           a.application_name, a.backend_start, a.query
    FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
    WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
      AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
      AND l.classid = %(classid)s::int8::oid AND l.objid = %(objid)s::int8::oid
    LIMIT 1
) AS h ON true
"""
