"""Statements of the run history, its fencing tokens and its kept output (DDL: sql.schema)."""

from __future__ import annotations

from jobrun.sql.control import PAUSES_IN_FORCE
from jobrun.sql.session import SEARCH_PATH

# Each history call is ONE message of the statements below, joined by ";" and bound on the
# client: the server runs it as one implicit transaction (the settings made local by
# RUNS_TIMEOUTS end with it). Literal percent signs must be doubled (client-side binding).

#: One statement a history message's prune deletes at most this many rows of a key per
#: kind (finished runs, skips): a history grown by a large --keep shrinks over the next
#: runs after --keep is lowered, none of them slower than this batch.
PRUNE_BATCH = 500

#: Every history message starts with this: a history statement never holds a job (or the
#: heartbeat sharing its session) up for longer than its share of the call's timeout.
#: It also pins the search_path for the rest of the message (sql.session.SEARCH_PATH): a
#: session's own pin may not follow a message through a transaction pooler.
RUNS_TIMEOUTS = f"""
SELECT pg_catalog.set_config('statement_timeout', %(ms)s, true),
       pg_catalog.set_config('lock_timeout', %(ms)s, true),
       pg_catalog.set_config('search_path', '{SEARCH_PATH}', true)
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
#: The window's start reaches the scan as a lateral parameter (an index condition on
#: runs_key_ran: the newest such run, one index entry); without --once-per (window NULL)
#: the statement is a constant false and reads nothing (as a NOT EXISTS in RUNS_ACQUIRED,
#: a join on a NULL start made the planner scan every row of the table).
#: --tz (``tz``, an IANA name, NULL: UTC): a window of whole days (1d, 2d, 7d) starts at a
#: local midnight of the zone (so a day is 23 or 25 hours long across a DST change), N-day
#: windows counted in local days from 1970-01-01; any other window (1h, 30m, 36h) is as
#: without --tz: fixed-length, aligned to the Unix epoch. ``{now}``: the instant asked about.
_WINDOW_START = """
CASE WHEN %(tz)s::text IS NOT NULL AND %(window)s::float8 >= 86400
          AND pg_catalog.mod(%(window)s::numeric, 86400) = 0
     THEN pg_catalog.timezone(%(tz)s::text, (DATE '1970-01-01' + (pg_catalog.floor(
              (pg_catalog.timezone(%(tz)s::text, {now})::date - DATE '1970-01-01')::float8
              / (%(window)s::float8 / 86400)) * (%(window)s::float8 / 86400))::int4)::timestamp)
     ELSE pg_catalog.to_timestamp(pg_catalog.floor(
              pg_catalog.date_part('epoch', {now}) / %(window)s::float8) * %(window)s::float8)
END"""
#: The start of the --once-per window ``%(at)s`` (timestamptz) falls in: the rule above, for
#: tests and for anyone checking a window by hand.
WINDOW_START_AT = "SELECT " + _WINDOW_START.format(now="%(at)s::timestamptz") + " AS start"

_EARLIER = f"""
SELECT r.run_id, r.host, r.pid, r.started_at, r.outcome, w.start AS window_start
FROM (SELECT {_WINDOW_START.format(now="pg_catalog.clock_timestamp()")} AS start) AS w
CROSS JOIN LATERAL (
    SELECT run_id, host, pid, started_at, outcome FROM jobrun.runs
    WHERE key = %(key)s AND run_id <> %(run_id)s AND outcome IN ('running', 'succeeded')
      AND started_at >= w.start
    ORDER BY started_at DESC
    LIMIT 1
) AS r
WHERE %(window)s::float8 IS NOT NULL
"""
RUNS_ALREADY_RAN = _EARLIER

_ACQUIRED = """
INSERT INTO jobrun.runs
    (run_id, key, lock_ids, mode, host, pid, program, started_at, outcome)
SELECT %(run_id)s, %(key)s, %(lock_ids)s::int8[], %(mode)s, %(host)s, %(pid)s, %(program)s,
       clock_timestamp(), 'running'
WHERE NOT EXISTS ({earlier}){unpaused}
ON CONFLICT (run_id) DO NOTHING
RETURNING started_at,
          (SELECT deadlocks FROM pg_stat_database WHERE datname = current_database())
              AS deadlocks
"""

#: Our ``running`` row, unless an earlier run makes us redundant or the key is paused; with
#: the database's count of deadlocks so far, so that the end of the run can say how many
#: happened during it.
#: (Composed of constants only: no input is ever formatted into SQL.)
RUNS_ACQUIRED = _ACQUIRED.format(earlier=_EARLIER, unpaused=f" AND NOT EXISTS ({PAUSES_IN_FORCE})")
#: The same for a role that cannot use the pauses' table (it sees no pause).
RUNS_ACQUIRED_UNPAUSED = _ACQUIRED.format(earlier=_EARLIER, unpaused="")
#: A statement that returns no rows: holds a result's place in a message.
NO_ROWS = "SELECT WHERE false"

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
      AND outcome NOT IN ('running', 'skipped')
      AND outcome IN ('succeeded', 'failed', 'timed_out', 'lock_lost', 'exec_failed')
    ORDER BY finished_at DESC NULLS LAST
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
WITH mine AS (
    SELECT streak, streak_since FROM jobrun.runs
    WHERE key = %(key)s AND outcome = 'skipped' AND host = %(host)s
      AND holder_ref = %(holder_ref)s
    ORDER BY started_at DESC
    LIMIT 1
), chain AS (
    SELECT (SELECT streak FROM mine) AS mine, (SELECT streak_since FROM mine) AS since,
           (SELECT alerted_at FROM jobrun.runs
            WHERE key = %(key)s AND outcome = 'skipped' AND holder_ref = %(holder_ref)s
              AND alerted_at IS NOT NULL
            ORDER BY alerted_at DESC
            LIMIT 1) AS last_alert
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
#: The summary row (jobrun.run_keys, kept by the triggers) says how many of each the key
#: has: a key within N reads no run at all, and one over it deletes its oldest rows, at
#: most PRUNE_BATCH of each kind (a history grown by a larger --keep shrinks over the next
#: runs, each as quick as the last), each found through its index from the oldest end.
#: A skip that is its host's newest stays (and is counted: the next skip of that host
#: lets it go). A key without a summary row (written before the triggers) prunes nothing
#: until its next row makes one.
#: SKIP LOCKED: a fleet of hosts pruning the same key at once neither waits nor deadlocks. A
#: role that may not delete prunes nothing (and its history is still written).
RUNS_PRUNE = f"""
WITH over AS (
    SELECT coalesce((SELECT s.finished_count - %(keep)s FROM jobrun.run_keys AS s
                     WHERE s.key = %(key)s), 0) AS done,
           coalesce((SELECT s.skip_count - %(keep)s FROM jobrun.run_keys AS s
                     WHERE s.key = %(key)s), 0) AS skips
), doomed AS (
    SELECT d.run_id FROM (
        SELECT r.run_id FROM jobrun.runs AS r
        WHERE r.key = %(key)s AND r.outcome <> 'skipped' AND r.outcome <> 'running'
        ORDER BY r.started_at
        LIMIT greatest(0, least({PRUNE_BATCH}, (SELECT done FROM over)))
    ) AS d
    UNION ALL
    SELECT s.run_id FROM (
        SELECT r.run_id, r.host, r.started_at FROM jobrun.runs AS r
        WHERE r.key = %(key)s AND r.outcome = 'skipped'
        ORDER BY r.started_at
        LIMIT greatest(0, least({PRUNE_BATCH}, (SELECT skips FROM over)))
    ) AS s
    WHERE EXISTS (SELECT 1 FROM jobrun.runs AS y
                  WHERE y.key = %(key)s AND y.outcome = 'skipped' AND y.host = s.host
                    AND y.started_at > s.started_at)
)
DELETE FROM jobrun.runs WHERE has_table_privilege('jobrun.runs', 'DELETE') AND run_id IN (
    SELECT run_id FROM jobrun.runs
    WHERE run_id IN (SELECT run_id FROM doomed)
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

FENCE_NEXT = "SELECT nextval('jobrun.fence')"

RUNS_STORE_TAIL = """
UPDATE jobrun.runs SET stdout_tail = %(stdout)s, stderr_tail = %(stderr)s
WHERE run_id = %(run_id)s
RETURNING true AS tails_stored
"""

RUNS_TAIL = """
SELECT run_id, key, host, outcome, exit_code, started_at, stdout_tail, stderr_tail
FROM jobrun.runs WHERE run_id = %(run_id)s
"""


# --warn-after and --requires (watching a run): statements that ride on the history's
# messages a run sends anyway (its start, its end); none is sent without its option.

#: ``--warn-after auto``: how many of the key's last 30 successes have a duration, and their
#: 95th percentile (runs_key_ran: the newest successes, 30 index entries at most). In the
#: history's start message, so the bound costs no round trip of its own.
RUNS_RECENT_DURATIONS = """
SELECT pg_catalog.count(d.duration) AS runs,
       pg_catalog.percentile_cont(0.95::float8) WITHIN GROUP (ORDER BY d.duration) AS p95
FROM (SELECT r.duration FROM jobrun.runs AS r
      WHERE r.key = %(key)s AND r.outcome = 'succeeded' AND r.duration IS NOT NULL
      ORDER BY r.started_at DESC
      LIMIT 30) AS d
"""

#: ``--warn-after``: the run went past this bound (seconds); NULL: it did not (or none was
#: set). In the end row's message (no round trip of its own), only for a slow run.
RUNS_MARK_SLOW = """
UPDATE jobrun.runs SET slow_after = %(slow_after)s WHERE run_id = %(run_id)s
"""

#: ``--requires``: for each required key label (in the order given), its last finished run
#: (outcome, when; runs_key_finished), whether that was a success within
#: ``requires_within`` seconds, and a run of it in progress (a ``running`` row; a session
#: mode one only while its advisory lock is held, so a run that died is not "running").
#: ``guarded``: row-level security hides keys from this role (``jobrun init``): a key that
#: shows no row may then be one it cannot read (RUNS_REQUIRES_UNREADABLE says). Sent in the
#: history's start message, after the lock is taken: the decision and the run agree.
RUNS_REQUIREMENTS = """
SELECT q.key, l.outcome, l.finished_at,
       coalesce(l.outcome = 'succeeded'
                AND l.finished_at >= pg_catalog.clock_timestamp()
                                     - pg_catalog.make_interval(secs => %(requires_within)s),
                false) AS fresh,
       g.run_id AS running_run_id, g.host AS running_host, g.pid AS running_pid,
       g.started_at AS running_since,
       (SELECT c.relrowsecurity AND NOT pg_catalog.pg_has_role(c.relowner, 'MEMBER')
               AND NOT EXISTS (SELECT 1 FROM pg_catalog.pg_roles AS o
                               WHERE o.rolname = current_user
                                 AND (o.rolsuper OR o.rolbypassrls))
        FROM pg_catalog.pg_class AS c
        WHERE c.oid = 'jobrun.runs'::pg_catalog.regclass) AS guarded
FROM pg_catalog.unnest(%(requires)s::text[]) WITH ORDINALITY AS q (key, n)
LEFT JOIN LATERAL (
    SELECT r.outcome, r.finished_at FROM jobrun.runs AS r
    WHERE r.key = q.key AND r.outcome NOT IN ('running', 'skipped')
    ORDER BY r.finished_at DESC NULLS LAST
    LIMIT 1
) AS l ON true
LEFT JOIN LATERAL (
    SELECT r.run_id, r.host, r.pid, r.started_at FROM jobrun.runs AS r
    WHERE r.key = q.key AND r.outcome = 'running' AND r.run_id <> %(run_id)s
      AND (r.mode <> 'session' OR EXISTS (
          SELECT 1 FROM pg_catalog.pg_locks AS k
          WHERE k.locktype = 'advisory' AND k.granted AND k.objsubid = 1
            AND k.database = (SELECT d.oid FROM pg_catalog.pg_database AS d
                              WHERE d.datname = pg_catalog.current_database())
            AND ((k.classid::int8 << 32) | k.objid::int8) = ANY (r.lock_ids)))
    ORDER BY r.started_at DESC
    LIMIT 1
) AS g ON true
ORDER BY q.n
"""

#: ``--requires`` under row-level security, asked only when a required key showed no row:
#: the required labels this role may not read (``jobrun grant``), refused rather than taken
#: for keys that never ran. (Only sent where RUNS_REQUIREMENTS said ``guarded``: the
#: function exists wherever ``jobrun init`` turned row-level security on.)
RUNS_REQUIRES_UNREADABLE = """
SELECT q.key FROM pg_catalog.unnest(%(requires)s::text[]) WITH ORDINALITY AS q (key, n)
WHERE NOT jobrun.allowed_for(current_user, q.key, 'read')
ORDER BY q.n
"""


# --- --coalesce, --jitter, --retries: the columns they add to a run's row ---------------------

#: ``queued_seconds``: how long a ``--coalesce`` run waited as the key's queued run;
#: ``jitter_seconds``: the ``--jitter`` delay slept before the lock was tried;
#: ``attempts`` and ``attempt_exit_codes``: a ``--retries`` run's attempts, each one's exit
#: status in order (the run's own ``exit_code`` is the last one's). NULL in a run that used
#: none of these options: only such runs send RUNS_NOTE, in their end row's message.
RUNS_NOTED_COLUMNS = ("queued_seconds", "jitter_seconds", "attempts", "attempt_exit_codes")


def runs_note(columns: tuple[str, ...]) -> str:
    """The UPDATE that writes ``columns`` (of RUNS_NOTED_COLUMNS) into the run's row.

    Their values are bound as ``note_<column>``; a name not in RUNS_NOTED_COLUMNS is refused.
    """
    unknown = set(columns) - set(RUNS_NOTED_COLUMNS)
    if unknown:
        raise ValueError(f"not a noted column: {sorted(unknown)}")
    sets = ", ".join(f"{column} = %(note_{column})s" for column in columns)
    return f"UPDATE jobrun.runs SET {sets} WHERE run_id = %(run_id)s"


#: ``jobrun history KEY``: RUNS_OF_KEY with the noted columns (a history from before them:
#: RUNS_OF_KEY alone, jobrun.ops.status.runs). Joined by the primary key, whatever
#: RUNS_OF_KEY selects.
RUNS_OF_KEY_NOTED = f"""
SELECT r.*, {", ".join(f"n.{column}" for column in RUNS_NOTED_COLUMNS)}
FROM ({RUNS_OF_KEY.strip()}) AS r
JOIN jobrun.runs AS n ON n.run_id = r.run_id
ORDER BY r.started_at DESC
"""
