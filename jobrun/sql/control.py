"""Statements of operators in control: stop requests, pauses, expectations."""

from __future__ import annotations

from jobrun.sql.lease import LEASE_HELD, LEASE_RENEW

#: The lock session's heartbeat (HELD_BY_US) and a stop request for this run, in one statement.
#: WARNING: a request counts only if it names one of the run's own keys (its label or a key
#: name): whoever may write a row for a key they were granted must not stop the run of
#: another key by writing its run id.
HELD_BY_US_OR_STOP = """
SELECT (SELECT count(*) FROM pg_locks
        WHERE locktype = 'advisory' AND granted AND objsubid = 1 AND pid = pg_backend_pid()
          AND ((classid::int8 << 32) | objid::int8) = ANY(%(lock_ids)s::int8[])),
       (SELECT row_to_json(s)::text FROM (
            SELECT host, username, pid, reason, requested_at FROM jobrun.stop_requests
            WHERE run_id = %(run_id)s::uuid AND key = ANY(%(stop_keys)s::text[])) AS s)
"""

#: The stop request for this run naming one of its keys (as above), as one JSON text, for
#: lease mode's heartbeat: qualified like lease mode's own statements (sql.lease), which
#: may reach the server through a transaction pooler.
_STOP_REQUEST_OF_LEASE = """
(SELECT pg_catalog.row_to_json(s)::pg_catalog.text FROM (
    SELECT host, username, pid, reason, requested_at FROM jobrun.stop_requests
    WHERE run_id OPERATOR(pg_catalog.=) %(owner)s::pg_catalog.uuid
      AND key OPERATOR(pg_catalog.=) ANY(%(stop_keys)s::pg_catalog.text[])) AS s)
"""

#: Lease mode's renewal (LEASE_RENEW itself, so the two cannot drift apart) and a stop
#: request for this run, in one statement.
LEASE_RENEW_OR_STOP = f"""
WITH renewed AS ({LEASE_RENEW})
SELECT (SELECT pg_catalog.count(*) FROM renewed), {_STOP_REQUEST_OF_LEASE}
"""

#: Lease mode's heartbeat when no renewal is due (LEASE_HELD: the leases still ours) and a
#: stop request for this run, in one statement.
LEASE_HELD_OR_STOP = f"""
SELECT ({LEASE_HELD}), {_STOP_REQUEST_OF_LEASE}
"""

#: ``jobrun stop``: ask the run ``run_id`` to stop (a repeated request keeps the first).
#: ``username`` is the database role (session_user: the server's word; after ``jobrun init``
#: a trigger sets it whatever a client writes); ``claimed_user`` is $USER, a claim only.
#: ``key``: the key (or label) that was asked for: the run honours requests for its own keys.
STOP_REQUEST = """
INSERT INTO jobrun.stop_requests (run_id, key, host, username, claimed_user, pid, reason)
VALUES (%(run_id)s, %(key)s, %(host)s, session_user, %(user)s, %(pid)s, %(reason)s)
ON CONFLICT (run_id) DO NOTHING
RETURNING username
"""

#: The request already written for this run (a repeat keeps the first), if this role sees it.
STOP_REQUEST_OF = "SELECT username, key FROM jobrun.stop_requests WHERE run_id = %s::uuid"

#: The label of a run, from the history: the owner's view (``jobrun init``'s run_label,
#: which row-level security does not narrow), or, before init, the table itself.
RUN_LABEL = "SELECT jobrun.run_label(%s::uuid)"
RUN_LABEL_VISIBLE_NAMED = "SELECT key FROM jobrun.runs WHERE run_id = %(run_id)s::uuid"
#: Whether ``jobrun init`` made run_label (else RUN_LABEL fails: the table itself is asked).
RUN_LABEL_DEFINED = "SELECT to_regprocedure('jobrun.run_label(uuid)') IS NOT NULL"

#: Stop requests whose run has ended (no lease or session of it can still read them).
STOP_REQUESTS_PRUNE = """
DELETE FROM jobrun.stop_requests WHERE requested_at < clock_timestamp() - interval '1 day'
"""

#: ``jobrun stop``: the lease-mode holder of a key (owner = run id), and the key of the row,
#: in three statements of one message (bound on the client), so that a database where lease
#: mode never ran (no ``jobrun.leases``) leaves no ERROR in the server's log: the ids in a
#: setting, a DO block that reads the table only where it exists, the row it found.
STOP_LEASE_HOLDER = (
    (
        "SELECT pg_catalog.set_config('jobrun.stop_ids', "
        "%(lock_ids)s::bigint[]::pg_catalog.text, true)"
    ),
    """
DO $jobrun$
BEGIN
  IF pg_catalog.to_regclass('jobrun.leases') IS NOT NULL THEN
    PERFORM pg_catalog.set_config('jobrun.stop_lease', coalesce((
      SELECT pg_catalog.row_to_json(l)::pg_catalog.text FROM (
        SELECT owner, host, pid, key FROM jobrun.leases
        WHERE lock_id OPERATOR(pg_catalog.=)
                  ANY (pg_catalog.current_setting('jobrun.stop_ids')::bigint[])
          AND expires_at OPERATOR(pg_catalog.>) pg_catalog.clock_timestamp()
        ORDER BY lock_id LIMIT 1) AS l), ''), true);
  END IF;
END
$jobrun$""",
    """
SELECT l.owner::pg_catalog.text, l.host, l.pid, l.key
FROM pg_catalog.json_to_record(
       nullif(pg_catalog.current_setting('jobrun.stop_lease', true), '')::pg_catalog.json)
     AS l(owner pg_catalog.uuid, host pg_catalog.text, pid pg_catalog.int4, key pg_catalog.text)
WHERE nullif(pg_catalog.current_setting('jobrun.stop_lease', true), '') IS NOT NULL
""",
)

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
#: ``username``: the database role, ``claimed_user``: $USER, as for STOP_REQUEST.
_PAUSE = """
INSERT INTO jobrun.pauses (key, until, host, username, {claim}pid, reason)
VALUES (%(key)s, {until}, %(host)s, session_user, {claimed}%(pid)s, %(reason)s)
ON CONFLICT (key) DO UPDATE
    SET paused_at = clock_timestamp(), until = excluded.until, host = excluded.host,
        username = excluded.username, {reclaim}pid = excluded.pid, reason = excluded.reason
RETURNING paused_at, until, username
"""
_FOR = "clock_timestamp() + make_interval(secs => %(for)s::float8)"
_UNTIL = "%(until)s::timestamptz"
_CLAIM = {
    "claim": "claimed_user, ",
    "claimed": "%(user)s, ",
    "reclaim": "claimed_user = excluded.claimed_user, ",
}
PAUSE = _PAUSE.format(until=_FOR, **_CLAIM)
PAUSE_UNTIL = _PAUSE.format(until=_UNTIL, **_CLAIM)

#: ``jobrun resume``: end the pause of a key (the row it deleted, if any).
RESUME = "DELETE FROM jobrun.pauses WHERE key = %s RETURNING paused_at, until"
RESUME_NAMED = "DELETE FROM jobrun.pauses WHERE key = %(key)s RETURNING paused_at, until"

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

#: The label the history records for the run %(run_id)s: the owner's view (``jobrun
#: init``'s run_label, which row-level security does not narrow), or the table itself (as
#: RUN_LABEL and RUN_LABEL_VISIBLE, as expressions).
RUN_LABEL_EXPR = "jobrun.run_label(%(run_id)s::uuid)"
RUN_LABEL_VISIBLE_EXPR = "(SELECT key FROM jobrun.runs WHERE run_id = %(run_id)s::uuid)"

#: ``jobrun stop``'s request (STOP_REQUEST) written only if the history does not record
#: the run as one of another key: control.verify_run's check in the same statement as the INSERT.
#: %(key)s is the first key asked for; with several (%(several)s) the run's recorded label,
#: whose order is the run's locking order, where there is one.
#: WARNING: the check must guard the INSERT itself, not merely come before it: a request
#: written for a run of another key is never read by that run, but it takes that run id's
#: row (the first request is kept), and the key's own operators could no longer stop it.
STOP_REQUEST_CHECKED = """
INSERT INTO jobrun.stop_requests (run_id, key, host, username, claimed_user, pid, reason)
SELECT %(run_id)s::uuid,
       CASE WHEN %(several)s AND recorded.label IS NOT NULL THEN recorded.label
            ELSE %(key)s END,
       %(host)s, session_user, %(user)s, %(pid)s, %(reason)s
FROM (SELECT {label} AS label) AS recorded
WHERE recorded.label IS NULL OR string_to_array(recorded.label, ',') @> %(parts)s::text[]
ON CONFLICT (run_id) DO NOTHING
RETURNING username
"""

#: ``jobrun stop``: the session holding one of the key's lock ids (the columns of
#: SESSION_HOLDER_OF_ANY but the first, which is the lock id), then the run the history
#: records on that lock id: the newest running session-mode row whose lock_ids hold it
#: (run id as text, host, pid). PostgreSQL hides another role's statements, and with them
#: the run id their comment announces, from all but members of pg_read_all_stats; jobrun's
#: own record of the run is what an operator reads instead. After ``jobrun init`` a row may
#: claim only its own key's lock ids, and a run that takes a lock marks every older running
#: row on it abandoned: the row is the holder's, unless the holder keeps no history (the
#: request then reaches nobody, and ``stop`` says so after --wait).
STOP_SESSION_HOLDER = """
SELECT h.lock_id, h.pid, h.client_addr, h.application_name, h.backend_start, h.query,
       r.run_id, r.host, r.pid
FROM (
    SELECT CAST(l.classid AS pg_catalog.int8) OPERATOR(pg_catalog.<<) 32
               OPERATOR(pg_catalog.|) CAST(l.objid AS pg_catalog.int8) AS lock_id,
           l.pid, pg_catalog.host(a.client_addr) AS client_addr, a.application_name,
           a.backend_start, a.query
    FROM pg_catalog.pg_locks AS l
    LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid OPERATOR(pg_catalog.=) l.pid
    WHERE l.locktype OPERATOR(pg_catalog.=) 'advisory' AND l.granted
      AND l.objsubid OPERATOR(pg_catalog.=) 1
      AND l.database OPERATOR(pg_catalog.=) (
          SELECT d.oid FROM pg_catalog.pg_database AS d
          WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
      AND (CAST(l.classid AS pg_catalog.int8) OPERATOR(pg_catalog.<<) 32
           OPERATOR(pg_catalog.|) CAST(l.objid AS pg_catalog.int8))
          OPERATOR(pg_catalog.=) ANY (CAST(%(lock_ids)s AS pg_catalog.int8[]))
    LIMIT 1
) AS h
LEFT JOIN LATERAL (
    SELECT CAST(x.run_id AS pg_catalog.text) AS run_id, x.host, x.pid FROM jobrun.runs AS x
    WHERE x.outcome OPERATOR(pg_catalog.=) 'running' AND x.mode OPERATOR(pg_catalog.=) 'session'
      AND x.lock_ids OPERATOR(pg_catalog.@>) ARRAY[h.lock_id]
    ORDER BY x.started_at DESC LIMIT 1
) AS r ON true
"""

#: ``jobrun init``'s ``take_lock_away(run, backend)``: ``jobrun stop --force`` for a caller
#: whose own role may not terminate the run's lock session (another role's; PostgreSQL lets
#: only that role and members of pg_signal_backend do it). SECURITY DEFINER: it acts with
#: its owner's rights, so it can do only what the owner could (a superuser, or a member of
#: pg_signal_backend; else PostgreSQL refuses, and ``stop`` says what is missing), and then
#: only this: terminate the backend ``backend`` if
#: - the history records ``run`` as a session-mode run going on (``runs``, whose rows claim
#:   only their own key's lock ids);
#: - the caller may control the run's key: ``jobrun.allowed_for(session_user, label,
#:   'control')``. WARNING: not ``jobrun.allowed``, which asks for current_user, and
#:   current_user is the owner in here. ``stop`` asks ``jobrun.allowed`` as the caller too,
#:   before the call (STOP_TAKE_AWAY_AS_OWNER);
#: - the caller asked that very run to stop: a stop request for it under one of its keys,
#:   in the caller's name (session_user, which a trigger writes; row-level security let
#:   the caller write it only with the ``control`` right);
#: - the backend holds, in this database, one of the lock ids the history records for the
#:   run, and is not a superuser's (as for pg_signal_backend);
#: - where the owner may read the backend's statement, it announces that very run (a
#:   session naming another run, or none, is not this run's).
#: True: terminated; false: nothing to take (the run let go, or the backend is not its).
#: WARNING: it runs with the owner's rights: search_path pinned, every name qualified, the
#: arguments compared only, never run as code. EXECUTE stays with PUBLIC (jobrun init runs
#: before any role is granted): the checks above are the guard, not the privilege.
TAKE_LOCK_AWAY_FUNCTION = """
CREATE OR REPLACE FUNCTION jobrun.take_lock_away(run uuid, backend integer) RETURNS boolean
LANGUAGE plpgsql VOLATILE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
DECLARE
    run_label text;
    run_ids bigint[];
    statement text;
    announced text;
BEGIN
    SELECT x.key, x.lock_ids INTO run_label, run_ids FROM jobrun.runs AS x
    WHERE x.run_id OPERATOR(pg_catalog.=) run AND x.outcome OPERATOR(pg_catalog.=) 'running'
      AND x.mode OPERATOR(pg_catalog.=) 'session';
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF NOT jobrun.allowed_for(session_user, run_label, 'control') THEN
        RAISE EXCEPTION 'role % may not control %', session_user, run_label
            USING ERRCODE = 'insufficient_privilege';
    END IF;
    IF NOT EXISTS (
        SELECT 1 FROM jobrun.stop_requests AS s
        WHERE s.run_id OPERATOR(pg_catalog.=) run
          AND s.username OPERATOR(pg_catalog.=) CAST(session_user AS pg_catalog.text)
          AND s.key OPERATOR(pg_catalog.=) ANY (pg_catalog.array_append(
              pg_catalog.string_to_array(run_label, ','), run_label))) THEN
        RAISE EXCEPTION 'role % asked run % of % to stop first: no stop request of its own',
            session_user, run, run_label USING ERRCODE = 'insufficient_privilege';
    END IF;
    SELECT a.query INTO statement
    FROM pg_catalog.pg_locks AS l
    JOIN pg_catalog.pg_stat_activity AS a ON a.pid OPERATOR(pg_catalog.=) l.pid
    JOIN pg_catalog.pg_roles AS o ON o.oid OPERATOR(pg_catalog.=) a.usesysid
    WHERE l.pid OPERATOR(pg_catalog.=) backend
      AND l.locktype OPERATOR(pg_catalog.=) 'advisory' AND l.granted
      AND l.objsubid OPERATOR(pg_catalog.=) 1
      AND l.database OPERATOR(pg_catalog.=) (
          SELECT d.oid FROM pg_catalog.pg_database AS d
          WHERE d.datname OPERATOR(pg_catalog.=) pg_catalog.current_database())
      AND (CAST(l.classid AS pg_catalog.int8) OPERATOR(pg_catalog.<<) 32
           OPERATOR(pg_catalog.|) CAST(l.objid AS pg_catalog.int8))
          OPERATOR(pg_catalog.=) ANY (run_ids)
      AND NOT o.rolsuper
    LIMIT 1;
    IF NOT FOUND THEN
        RETURN false;
    END IF;
    IF statement IS DISTINCT FROM '<insufficient privilege>' THEN
        announced := pg_catalog.substring(statement, '/\\* jobrun-holder (\\{[^*]*\\}) \\*/');
        BEGIN
            announced := CAST(announced AS pg_catalog.jsonb) OPERATOR(pg_catalog.->>) 'run_id';
        EXCEPTION WHEN invalid_text_representation THEN
            announced := NULL;
        END;
        IF announced IS DISTINCT FROM CAST(run AS pg_catalog.text) THEN
            RETURN false;
        END IF;
    END IF;
    RETURN pg_catalog.pg_terminate_backend(backend);
END
$$;
"""

#: Whether ``jobrun init`` made take_lock_away (a catalog lookup: nothing fails without it).
TAKE_LOCK_AWAY_DEFINED = (
    "SELECT pg_catalog.to_regprocedure('jobrun.take_lock_away(uuid, integer)') IS NOT NULL"
)

#: ``jobrun stop --force`` where the caller's own pg_terminate_backend was refused: the
#: caller's right to control the key, asked of jobrun.allowed as the caller, then
#: take_lock_away acting for it (NULL: not allowed; nothing is called).
STOP_TAKE_AWAY_AS_OWNER = """
SELECT CASE WHEN jobrun.allowed(%(key)s, 'control')
            THEN jobrun.take_lock_away(CAST(%(run_id)s AS pg_catalog.uuid), %(backend_pid)s)
       END
"""
