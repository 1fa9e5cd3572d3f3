"""jobrun's schema, its one owner: every table, function and trigger, in numbered steps.

A database records the last step it ran in ``jobrun.schema_version`` (one row: version,
compatible_from, upgraded_at). ``upgrade_message`` runs the steps the database has not run
yet, in order, under the schema's advisory transaction lock (SCHEMA_XACT_LOCK), in ONE
message (one implicit transaction): fifty first runs at once make the schema once, and a
step that fails leaves the database as it was. Step 1 is everything jobrun made before the
schema had versions, written with ``IF NOT EXISTS`` throughout, so that a database an older
jobrun made (no version row) is brought up to date by it like an empty one. Later steps
append: never edit a step a release has shipped (CONTRIBUTING.md, "Changing the schema").

``check(writes)`` is the statement a connection's first message starts with (no round trip
of its own): it fails with SCHEMA_BEHIND where the database needs a step this jobrun has
(absent, or older), and, for a command that writes, with SCHEMA_AHEAD where the database's
``compatible_from`` is past this jobrun's VERSION (an older jobrun on a newer schema keeps
working until a step says it may not). Tenancy (``jobrun init``'s grants, functions and
policies: sql.tenants) is applied on top, by ``jobrun init`` only.
"""

from __future__ import annotations

import dataclasses

from jobrun.sql.session import SEARCH_PATH

#: Taken (transaction-scoped) around the DDL so that 50 first runs at once create it once.
#: WARNING: jobrun's own advisory locks live in the two-int4 space (pg_locks objsubid 2),
#: which no key can reach: every key, named or ``--lock-id``, locks a bigint (objsubid 1).
#: A key that maps to one of them could otherwise hold up every first run, or be held up.
#: classid 1785684594 is "jobr" in ASCII; objid 1 is the schema.
SCHEMA_XACT_LOCK = "SELECT pg_advisory_xact_lock(1785684594, 1)"

#: Lease mode's table: one row per lock id a lease-mode run holds (or held: expired rows
#: stay until taken over).
LEASES_TABLE = """
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

#: ``jobrun stop`` writes a row for the run it stops, by run id (a request never reaches the
#: next run); that run's heartbeat reads it. ``jobrun pause`` writes one row per key label.
#: ``--expect-every`` keeps one row per key label: how often a successful run is expected.
#: Tables of older versions get the operator's claimed user name (``claimed_user``).
CONTROL_TABLES = """
CREATE TABLE IF NOT EXISTS jobrun.stop_requests (
    run_id       uuid PRIMARY KEY,
    key          text NOT NULL,
    requested_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    host         text NOT NULL,
    username     text NOT NULL,
    pid          integer NOT NULL,
    reason       text,
    claimed_user text
);
CREATE TABLE IF NOT EXISTS jobrun.pauses (
    key       text PRIMARY KEY,
    paused_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    until     timestamptz,
    host      text NOT NULL,
    username  text NOT NULL,
    pid       integer NOT NULL,
    reason    text,
    claimed_user text
);
CREATE TABLE IF NOT EXISTS jobrun.expectations (
    key        text PRIMARY KEY,
    every      double precision NOT NULL,
    grace      double precision NOT NULL,
    updated_at timestamptz NOT NULL DEFAULT clock_timestamp()
);
ALTER TABLE jobrun.stop_requests ADD COLUMN IF NOT EXISTS claimed_user text;
ALTER TABLE jobrun.pauses ADD COLUMN IF NOT EXISTS claimed_user text
"""

#: The history's indexes beyond the table's first two, by name: each statement the history
#: sends at a run's start and end, after a skip, and each read of ``status``, finds its rows
#: through one of them, so that none reads more rows of a key than it needs (the newest
#: one, the oldest few to prune), whatever the key's history holds. Partial: a row is in
#: the indexes of its kind only (a finished run in 2 or 3, a skip in 2 or 3). Built with the
#: table while it is small (step 1); on a table of an older version that is already
#: large, ``CREATE INDEX CONCURRENTLY`` by the upgrade (jobrun/history/upgrade.py), which
#: never holds runs up. Names and definitions are here only.
RUNS_INDEXES: tuple[tuple[str, str], ...] = (
    # The runs still going (status, abandoned runs).
    ("runs_key_running", "(key) WHERE outcome = 'running'"),
    # --once-per's window, the newest successes (status: typical duration, last success).
    (
        "runs_key_ran",
        "(key, started_at DESC) WHERE outcome IN ('running', 'succeeded')",
    ),
    # The oldest finished runs (prune) and the newest run that was no skip (skip streak).
    ("runs_key_not_skipped", "(key, started_at DESC) WHERE outcome <> 'skipped'"),
    # The last finished run and the failure streak it carries (a run's end, status).
    (
        "runs_key_finished",
        "(key, finished_at DESC NULLS LAST) WHERE outcome NOT IN ('running', 'skipped')",
    ),
    # The oldest skips (prune), the newest (status).
    ("runs_key_skipped", "(key, started_at DESC) WHERE outcome = 'skipped'"),
    # A host's skip chain behind one holder (a skip), a host's newest skip (prune).
    (
        "runs_key_host_skips",
        "(key, host, holder_ref, started_at DESC) WHERE outcome = 'skipped'",
    ),
    # Skip streaks that alerted: the last alert of a chain (a skip), the streaks a run ends.
    (
        "runs_key_alerted",
        "(key, holder_ref, alerted_at DESC) WHERE outcome = 'skipped' AND alerted_at IS NOT NULL",
    ),
)

#: The table is built under the schema's lock, in the message that creates or upgrades it,
#: only below this size: on a larger one a plain CREATE INDEX would hold every run's
#: history up for seconds (it blocks writes); the upgrade builds those concurrently.
INLINE_BUILD_BYTES = 32 * 1024 * 1024

#: What ``jobrun.run_keys``' comment says once every key of the history has its row
#: (``status`` reads the summary only then; before, the runs themselves).
SUMMARY_COMPLETE = "jobrun: one row per key of jobrun.runs (complete)"

#: The newest skips whose streaks the summary's skip streak is the largest of (it only
#: grows along a chain: the largest is among the newest rows of each host's chain).
_STREAK_WINDOW = 1000

_INDEX_BUILDS = "\n".join(
    f"    IF pg_catalog.to_regclass('jobrun.{name}') IS NULL THEN\n"
    f"      CREATE INDEX {name} ON jobrun.runs {definition};\n"
    "    END IF;"
    for name, definition in RUNS_INDEXES
)

#: ``jobrun.run_keys``: one row per key label of the history, kept by triggers on
#: jobrun.runs in the transaction that changed it (every writer: runs, skips, abandoned
#: runs, pruning, ``jobrun forget``, an operator's own UPDATE), so that ``status`` reads a
#: row per key instead of every run, and pruning knows how many rows a key has without
#: counting them. ``finished_count``/``skip_count``: rows of the key that are finished runs
#: (not running, not skipped) and skips, kept by delta. The rest is read back from the
#: runs, through the indexes above, after the row is locked (a fresh snapshot: what the
#: other writers of the key committed is seen): the last finished run, the last success,
#: the newest 20 successful durations, the failure and skip streaks, the last skip.
#: Read by whoever may read jobrun.runs (a policy; ``jobrun init`` narrows it to the keys
#: granted); written only by the triggers' function (SECURITY DEFINER: the owner's, so a
#: granted role's runs need no privilege on it).
SUMMARY_TABLE = """
CREATE TABLE jobrun.run_keys (
    key              text PRIMARY KEY,
    lock_ids         bigint[],
    finished_count   bigint NOT NULL DEFAULT 0,
    skip_count       bigint NOT NULL DEFAULT 0,
    last_run_id      uuid,
    outcome          text,
    exit_code        integer,
    started_at       timestamptz,
    finished_at      timestamptz,
    duration         double precision,
    deadlocks        bigint,
    last_success_at  timestamptz,
    last_success_started_at timestamptz,
    success_durations double precision[],
    failure_streak   integer NOT NULL DEFAULT 0,
    skip_streak      integer NOT NULL DEFAULT 0,
    last_skip_at     timestamptz,
    updated_at       timestamptz
);
ALTER TABLE jobrun.run_keys ENABLE ROW LEVEL SECURITY;
CREATE POLICY readable ON jobrun.run_keys FOR SELECT
    USING ((SELECT pg_catalog.has_any_column_privilege('jobrun.runs', 'SELECT')));
GRANT SELECT ON jobrun.run_keys TO PUBLIC;
"""

#: ``run_keys_refresh(key, done, skips)``: bring the key's summary row up to date after a
#: change of its rows (``done``, ``skips``: how many finished runs and skips it gained).
#: A row it creates is counted in full (the upgrade's backfill, a key's first row).
#: WARNING: SECURITY DEFINER, and the counts decide what the prune deletes: nobody but the
#: owner (and the triggers, which run as the owner) may call it, or a tenant could inflate
#: another team's counts and have its history pruned away.
_REFRESH = f"""
CREATE OR REPLACE FUNCTION jobrun.run_keys_refresh(k text, done bigint, skips bigint)
RETURNS boolean LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $f$
DECLARE
  created boolean;
BEGIN
  INSERT INTO jobrun.run_keys AS s (key) VALUES (k) ON CONFLICT (key) DO NOTHING
  RETURNING true INTO created;
  IF created IS NULL THEN
    -- Locked before anything is read: the statements below take a snapshot after it.
    PERFORM 1 FROM jobrun.run_keys AS s WHERE s.key = k FOR UPDATE;
  END IF;
  IF NOT EXISTS (SELECT 1 FROM jobrun.runs AS r WHERE r.key = k) THEN
    DELETE FROM jobrun.run_keys AS s WHERE s.key = k;
    RETURN false;
  END IF;
  UPDATE jobrun.run_keys AS s SET
    finished_count = CASE WHEN created THEN (
        SELECT count(*) FROM jobrun.runs AS r
        WHERE r.key = k AND r.outcome <> 'skipped' AND r.outcome <> 'running')
      ELSE s.finished_count + done END,
    skip_count = CASE WHEN created THEN (
        SELECT count(*) FROM jobrun.runs AS r WHERE r.key = k AND r.outcome = 'skipped')
      ELSE s.skip_count + skips END,
    lock_ids = (SELECT r.lock_ids FROM jobrun.runs AS r WHERE r.key = k
                ORDER BY r.started_at DESC LIMIT 1),
    (last_run_id, outcome, exit_code, started_at, finished_at, duration, deadlocks) = (
        SELECT r.run_id, r.outcome, r.exit_code, r.started_at, r.finished_at, r.duration,
               r.deadlocks
        FROM jobrun.runs AS r
        WHERE r.key = k AND r.outcome NOT IN ('running', 'skipped')
        ORDER BY r.finished_at DESC NULLS LAST LIMIT 1),
    (last_success_at, last_success_started_at) = (
        SELECT r.finished_at, r.started_at FROM jobrun.runs AS r
        WHERE r.key = k AND r.outcome = 'succeeded'
        ORDER BY r.started_at DESC LIMIT 1),
    success_durations = ARRAY(
        SELECT r.duration FROM jobrun.runs AS r
        WHERE r.key = k AND r.outcome = 'succeeded' AND r.duration IS NOT NULL
        ORDER BY r.started_at DESC LIMIT 20),
    failure_streak = coalesce((
        SELECT CASE WHEN r.outcome = 'succeeded' THEN 0 ELSE r.streak END
        FROM jobrun.runs AS r
        WHERE r.key = k AND r.outcome NOT IN ('running', 'skipped') AND r.outcome <> 'abandoned'
        ORDER BY r.finished_at DESC NULLS LAST LIMIT 1), 0),
    skip_streak = coalesce((
        SELECT max(x.streak) FROM (
            SELECT r.streak FROM jobrun.runs AS r
            WHERE r.key = k AND r.outcome = 'skipped'
              AND r.started_at > coalesce((
                  SELECT y.started_at FROM jobrun.runs AS y
                  WHERE y.key = k AND y.outcome <> 'skipped'
                  ORDER BY y.started_at DESC LIMIT 1), '-infinity')
            ORDER BY r.started_at DESC LIMIT {_STREAK_WINDOW}) AS x), 0),
    last_skip_at = (SELECT r.started_at FROM jobrun.runs AS r
                    WHERE r.key = k AND r.outcome = 'skipped'
                    ORDER BY r.started_at DESC LIMIT 1),
    updated_at = clock_timestamp()
  WHERE s.key = k;
  RETURN true;
END
$f$;
REVOKE ALL ON FUNCTION jobrun.run_keys_refresh(text, bigint, bigint) FROM PUBLIC;
"""

#: The triggers' function: one refresh per key a statement changed, in key order (two
#: statements changing the same keys lock their summary rows in the same order).
_CHANGED = """
CREATE OR REPLACE FUNCTION jobrun.runs_changed() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $f$
DECLARE
  c record;
BEGIN
  IF TG_OP = 'INSERT' THEN
    FOR c IN
      SELECT n.key, count(*) FILTER (WHERE n.outcome NOT IN ('running', 'skipped')) AS done,
             count(*) FILTER (WHERE n.outcome = 'skipped') AS skips
      FROM new_rows AS n GROUP BY n.key ORDER BY n.key
    LOOP
      PERFORM jobrun.run_keys_refresh(c.key, c.done, c.skips);
    END LOOP;
  ELSIF TG_OP = 'UPDATE' THEN
    FOR c IN
      SELECT d.key, sum(d.done)::bigint AS done, sum(d.skips)::bigint AS skips FROM (
        SELECT n.key, (n.outcome NOT IN ('running', 'skipped'))::int AS done,
               (n.outcome = 'skipped')::int AS skips
        FROM new_rows AS n
        UNION ALL
        SELECT o.key, -(o.outcome NOT IN ('running', 'skipped'))::int,
               -(o.outcome = 'skipped')::int
        FROM old_rows AS o) AS d
      GROUP BY d.key ORDER BY d.key
    LOOP
      PERFORM jobrun.run_keys_refresh(c.key, c.done, c.skips);
    END LOOP;
  ELSE
    FOR c IN
      SELECT o.key, -count(*) FILTER (WHERE o.outcome NOT IN ('running', 'skipped')) AS done,
             -count(*) FILTER (WHERE o.outcome = 'skipped') AS skips
      FROM old_rows AS o GROUP BY o.key ORDER BY o.key
    LOOP
      PERFORM jobrun.run_keys_refresh(c.key, c.done, c.skips);
    END LOOP;
  END IF;
  RETURN NULL;
END
$f$;
CREATE OR REPLACE FUNCTION jobrun.runs_truncated() RETURNS trigger
LANGUAGE plpgsql SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $f$
BEGIN
  DELETE FROM jobrun.run_keys;
  RETURN NULL;
END
$f$;
"""

#: Every key of the history, one index probe each (a loose scan of runs_key_started_at).
RUNS_KEYS = """
WITH RECURSIVE k AS (
    (SELECT r.key FROM jobrun.runs AS r ORDER BY r.key LIMIT 1)
    UNION ALL
    SELECT (SELECT r.key FROM jobrun.runs AS r WHERE r.key > k.key ORDER BY r.key LIMIT 1)
    FROM k WHERE k.key IS NOT NULL
)
SELECT k.key FROM k WHERE k.key IS NOT NULL
"""

_TRIGGERS = """
    IF NOT EXISTS (SELECT 1 FROM pg_catalog.pg_trigger
                   WHERE tgrelid = 'jobrun.runs'::pg_catalog.regclass
                     AND tgname = 'runs_inserted') THEN
      CREATE TRIGGER runs_inserted AFTER INSERT ON jobrun.runs
          REFERENCING NEW TABLE AS new_rows
          FOR EACH STATEMENT EXECUTE FUNCTION jobrun.runs_changed();
      CREATE TRIGGER runs_updated AFTER UPDATE ON jobrun.runs
          REFERENCING OLD TABLE AS old_rows NEW TABLE AS new_rows
          FOR EACH STATEMENT EXECUTE FUNCTION jobrun.runs_changed();
      CREATE TRIGGER runs_deleted AFTER DELETE ON jobrun.runs
          REFERENCING OLD TABLE AS old_rows
          FOR EACH STATEMENT EXECUTE FUNCTION jobrun.runs_changed();
      CREATE TRIGGER runs_truncated AFTER TRUNCATE ON jobrun.runs
          FOR EACH STATEMENT EXECUTE FUNCTION jobrun.runs_truncated();
    END IF;"""

#: Fill the summary for every key that has no row yet, and say it is complete (the upgrade
#: does the same in batches, each its own transaction, on a large table).
SUMMARY_BACKFILL = f"""
SELECT pg_catalog.count(jobrun.run_keys_refresh(k.key, 0, 0)) FROM ({RUNS_KEYS}) AS k
WHERE NOT EXISTS (SELECT 1 FROM jobrun.run_keys AS s WHERE s.key = k.key)
"""
SUMMARY_MARK_COMPLETE = f"COMMENT ON TABLE jobrun.run_keys IS '{SUMMARY_COMPLETE}'"

#: The summary and the indexes, in the message that creates or upgrades the schema: the
#: table, its functions and triggers always (cheap: a trigger takes a short lock on
#: jobrun.runs); the indexes and the summary's backfill only while jobrun.runs is small
#: (INLINE_BUILD_BYTES), else they are left to the upgrade. ``jobrun init`` sends the same.
_SUMMARY_SCHEMA = (
    _REFRESH
    + _CHANGED
    + f"""
DO $jobrun$
BEGIN
  IF pg_catalog.to_regclass('jobrun.run_keys') IS NULL THEN
{SUMMARY_TABLE.strip()}
  END IF;
{_TRIGGERS}
  IF pg_catalog.pg_relation_size('jobrun.runs') < {INLINE_BUILD_BYTES} THEN
{_INDEX_BUILDS}
    IF pg_catalog.obj_description('jobrun.run_keys'::pg_catalog.regclass, 'pg_class')
           IS DISTINCT FROM '{SUMMARY_COMPLETE}' THEN
      PERFORM pg_catalog.count(jobrun.run_keys_refresh(k.key, 0, 0)) FROM ({RUNS_KEYS}) AS k
      WHERE NOT EXISTS (SELECT 1 FROM jobrun.run_keys AS s WHERE s.key = k.key);
      {SUMMARY_MARK_COMPLETE};
    END IF;
  END IF;
END
$jobrun$
"""
)

#: The run history (step 1; later columns: a step of their own, see STEPS).
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
                        ADD COLUMN IF NOT EXISTS deadlocks bigint,
                        ADD COLUMN IF NOT EXISTS stdout_tail bytea,
                        ADD COLUMN IF NOT EXISTS stderr_tail bytea;
CREATE INDEX IF NOT EXISTS runs_key_started_at ON jobrun.runs (key, started_at DESC);
CREATE INDEX IF NOT EXISTS runs_running_lock_ids ON jobrun.runs USING gin (lock_ids)
    WHERE outcome = 'running'
;
"""
    + CONTROL_TABLES
    + ";\n"
    + _SUMMARY_SCHEMA
)


#: One sequence for every key: a token is greater than every token handed out before it,
#: whichever key, host or lock mode took it. CACHE 1 (the default, spelled out): a session
#: that cached values would hand out numbers smaller than ones another session already used.
FENCE_SEQUENCE = """
CREATE SEQUENCE IF NOT EXISTS jobrun.fence AS bigint MINVALUE 1 NO CYCLE CACHE 1;
"""


@dataclasses.dataclass(frozen=True)
class Step:
    """One numbered change of the schema: its DDL, and who may still write after it.

    ``compatible_from``: the oldest schema version whose jobrun may still write once this
    step ran. A step that only adds (a nullable column, a table, an index, a function an
    older jobrun never calls) keeps the previous step's; a step that changes what an older
    jobrun's writes would mean raises it to its own number, and older jobruns then refuse
    to write (``schema_too_new``) instead of writing wrong rows.
    """

    number: int
    ddl: str
    compatible_from: int


#: Every step, in order; STEPS[n - 1].number == n. Append only.
STEPS: tuple[Step, ...] = (
    Step(1, RUNS_SCHEMA + ";\n" + LEASES_TABLE + FENCE_SEQUENCE, compatible_from=1),
    # --warn-after's bound, --coalesce's wait, --jitter's delay and --retries' attempts:
    # nullable columns only the runs that use those options write, so a jobrun of step 1
    # may go on writing (compatible_from stays 1).
    Step(
        2,
        """ALTER TABLE jobrun.runs ADD COLUMN IF NOT EXISTS slow_after double precision,
                        ADD COLUMN IF NOT EXISTS queued_seconds double precision,
                        ADD COLUMN IF NOT EXISTS jitter_seconds double precision,
                        ADD COLUMN IF NOT EXISTS attempts integer,
                        ADD COLUMN IF NOT EXISTS attempt_exit_codes integer[]""",
        compatible_from=1,
    ),
)

#: The schema version this jobrun writes and reads: its last step.
VERSION = STEPS[-1].number

#: Errors the version check raises (SQLSTATEs of jobrun's own class "JR", which PostgreSQL
#: never uses). BEHIND: the database needs steps this jobrun has (absent, or older); its
#: DETAIL is "absent" where there is no jobrun schema at all. AHEAD: a newer jobrun made
#: it, and its compatible_from is past VERSION; DETAIL "version compatible_from".
SCHEMA_BEHIND = "JRS01"
SCHEMA_AHEAD = "JRS02"

#: The version row: one row (``one`` is its key), readable by every role (a role granted
#: only its keys must be able to check the version).
VERSION_TABLE = """
CREATE TABLE IF NOT EXISTS jobrun.schema_version (
    one             boolean PRIMARY KEY DEFAULT true CHECK (one),
    version         integer NOT NULL,
    compatible_from integer NOT NULL,
    upgraded_at     timestamptz NOT NULL
)"""

_LT = "OPERATOR(pg_catalog.<)"
_GT = "OPERATOR(pg_catalog.>)"

#: The version row as it is now (version, compatible_from): the upgrade's answer.
VERSION_ROW = "SELECT s.version, s.compatible_from FROM jobrun.schema_version AS s"


def _step(step: Step) -> str:
    """``step`` where the database has not run it yet, and the version row moved past it."""
    tag = f"$jobrun_step_{step.number}$"
    return f"""
DO $jobrun_upgrade$
BEGIN
  IF coalesce((SELECT s.version FROM jobrun.schema_version AS s), 0) {_LT} {step.number} THEN
    EXECUTE {tag}{step.ddl}{tag};
    INSERT INTO jobrun.schema_version AS s (one, version, compatible_from, upgraded_at)
    VALUES (true, {step.number}, {step.compatible_from}, pg_catalog.clock_timestamp())
    ON CONFLICT (one) DO UPDATE
      SET version = excluded.version,
          compatible_from = GREATEST(s.compatible_from, excluded.compatible_from),
          upgraded_at = excluded.upgraded_at;
  END IF;
END
$jobrun_upgrade$"""


def upgrade_message(timeout_ms: int) -> str:
    """Every step the database lacks, as ONE message; its last result is VERSION_ROW.

    Send it unbound (no parameters: its percent signs are literal). ``timeout_ms`` bounds
    each statement and each lock wait, local to the message's transaction.
    """
    ms = int(timeout_ms)
    return ";\n".join(
        (
            (
                f"SELECT pg_catalog.set_config('statement_timeout', '{ms}', true), "
                f"pg_catalog.set_config('lock_timeout', '{ms}', true), "
                f"pg_catalog.set_config('search_path', '{SEARCH_PATH}', true)"
            ),
            SCHEMA_XACT_LOCK,
            "CREATE SCHEMA IF NOT EXISTS jobrun",
            VERSION_TABLE,
            # WARNING: GRANT by a role that does not own the table is a no-op with a
            # warning; the owner made it, and granted it, in the same transaction.
            "GRANT SELECT ON jobrun.schema_version TO PUBLIC",
            *(_step(step) for step in STEPS),
            VERSION_ROW,
        )
    )


def check(*, writes: bool) -> str:
    """The version check: no rows; fails with SCHEMA_BEHIND or (``writes``) SCHEMA_AHEAD.

    A DO block (nothing in it is planned unless reached: a missing table is looked up, not
    named) whose literal texts hold no percent sign: it rides in messages bound on the
    client.
    """
    ahead = (
        f"""
  IF c {_GT} {VERSION} THEN
    RAISE EXCEPTION USING ERRCODE = '{SCHEMA_AHEAD}',
      MESSAGE = 'jobrun schema is newer than this jobrun',
      DETAIL = pg_catalog.concat_ws(' ', v, c);
  END IF;"""
        if writes
        else ""
    )
    return f"""DO $jobrun_check$
DECLARE
  v integer;
  c integer;
BEGIN
  IF pg_catalog.to_regclass('jobrun.schema_version') IS NULL THEN
    RAISE EXCEPTION USING ERRCODE = '{SCHEMA_BEHIND}', MESSAGE = 'jobrun schema needs steps',
      DETAIL = CASE WHEN pg_catalog.to_regnamespace('jobrun') IS NULL THEN 'absent'
                    ELSE '0' END;
  END IF;
  SELECT s.version, s.compatible_from INTO v, c FROM jobrun.schema_version AS s;{ahead}
  IF coalesce(v, 0) {_LT} {VERSION} THEN
    RAISE EXCEPTION USING ERRCODE = '{SCHEMA_BEHIND}', MESSAGE = 'jobrun schema needs steps',
      DETAIL = coalesce(v, 0)::pg_catalog.text;
  END IF;
END
$jobrun_check$"""


CHECK_WRITE = check(writes=True)
CHECK_READ = check(writes=False)
