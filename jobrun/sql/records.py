"""Statements about all that is recorded of one key: whether anything is, and forgetting it."""

from __future__ import annotations

#: Whether the run history has any row (a run or a skip) of the key label.
RECORDED_IN_HISTORY = "SELECT EXISTS (SELECT 1 FROM jobrun.runs WHERE key = %(key)s)"

#: Whether the key label is paused or has an expectation (``pause --new`` before any run).
RECORDED_IN_CONTROL = """
SELECT EXISTS (SELECT 1 FROM jobrun.pauses WHERE key = %(key)s)
    OR EXISTS (SELECT 1 FROM jobrun.expectations WHERE key = %(key)s)
"""

#: Both of the above in one statement: where every table is there and readable.
RECORDED_ANYWHERE = """
SELECT EXISTS (SELECT 1 FROM jobrun.runs WHERE key = %(key)s)
    OR EXISTS (SELECT 1 FROM jobrun.pauses WHERE key = %(key)s)
    OR EXISTS (SELECT 1 FROM jobrun.expectations WHERE key = %(key)s)
"""

#: ``forget``: inside its transaction, every lock id of the key (and of its slots) taken
#: transaction-scoped. It fails while a session-mode run holds one, and while it is held
#: no run of the key can start in either mode (lease mode takes the same ids first).
FORGET_LOCK_IDS = """
SELECT bool_and(pg_try_advisory_xact_lock(id)) FROM unnest(%(lock_ids)s::int8[]) AS id
"""

#: ``forget``: a live lease of the key (lease mode) refuses it.
FORGET_LIVE_LEASE = """
SELECT owner, host, pid FROM jobrun.leases
WHERE lock_id = ANY(%(lock_ids)s::int8[]) AND expires_at > clock_timestamp()
LIMIT 1
"""

#: ``forget``, one table at a time: the rows removed, counted.
FORGET_RUNS = """
WITH gone AS (DELETE FROM jobrun.runs WHERE key = %(key)s RETURNING outcome,
    stdout_tail IS NOT NULL OR stderr_tail IS NOT NULL AS kept)
SELECT count(*) FILTER (WHERE outcome <> 'skipped'), count(*) FILTER (WHERE outcome = 'skipped'),
       count(*) FILTER (WHERE kept)
FROM gone
"""
FORGET_PAUSES = """
WITH gone AS (DELETE FROM jobrun.pauses WHERE key = %(key)s RETURNING 1)
SELECT count(*) FROM gone
"""
FORGET_EXPECTATIONS = """
WITH gone AS (DELETE FROM jobrun.expectations WHERE key = %(key)s RETURNING 1)
SELECT count(*) FROM gone
"""
FORGET_STOP_REQUESTS = """
WITH gone AS (DELETE FROM jobrun.stop_requests WHERE key = %(key)s RETURNING 1)
SELECT count(*) FROM gone
"""
#: Expired leases of the key left behind by runs that died (a live one refused the forget).
FORGET_LEASES = """
WITH gone AS (DELETE FROM jobrun.leases WHERE lock_id = ANY(%(lock_ids)s::int8[])
              AND expires_at <= clock_timestamp() RETURNING 1)
SELECT count(*) FROM gone
"""

#: Whether this role is granted the key label %(key)s for %(need)s (run, control, read,
#: output), as ``jobrun init``'s ``jobrun.allowed`` answers it: the same function that its
#: row-level security asks, so the answer is the database's, never the client's guess.
#: Three statements that go first in a message (GRANT_ASK, GRANT_EVAL, then GRANTED's row:
#: the answer as text, 'true' or 'false', else NULL or '' where there is no ``jobrun init``;
#: and the role asking). The DO block
#: names the function only where it exists: a database without ``jobrun init`` (or a role
#: without USAGE on the schema, where looking the function up is refused) answers NULL
#: instead of failing the message. The key and the need reach the block as settings local
#: to the message, never spliced into its code.
GRANT_ASK = """
SELECT pg_catalog.set_config('jobrun.grant_key', %(key)s, true),
       pg_catalog.set_config('jobrun.grant_need', %(need)s, true)
"""
GRANT_EVAL = """
DO $jobrun$
BEGIN
  IF pg_catalog.to_regprocedure('jobrun.allowed(text,text)') IS NOT NULL THEN
    PERFORM pg_catalog.set_config('jobrun.granted', CAST(jobrun.allowed(
        pg_catalog.current_setting('jobrun.grant_key'),
        pg_catalog.current_setting('jobrun.grant_need')) AS pg_catalog.text), true);
  END IF;
EXCEPTION WHEN insufficient_privilege THEN
  NULL;
END
$jobrun$
"""
GRANTED = "SELECT pg_catalog.current_setting('jobrun.granted', true), current_user"
#: The three as one tuple, in their order.
GRANT_CHECK = (GRANT_ASK, GRANT_EVAL, GRANTED)
