"""Statements of tenancy: ``jobrun init``'s protections, ``jobrun grant`` and ``grants``."""

from __future__ import annotations

from jobrun.sql.control import TAKE_LOCK_AWAY_FUNCTION
from jobrun.sql.schema import SCHEMA_XACT_LOCK

#: The roles ``jobrun init`` makes where it may: members may control (operator) or read
#: (reader) every key of every database that was initialised.
OPERATOR_ROLE = "jobrun_operator"
READER_ROLE = "jobrun_reader"

#: Every table row-level security guards, and the column that names each row's key(s).
GUARDED_TABLES = ("runs", "leases", "stop_requests", "pauses", "expectations")

#: jobrun.runs' columns a reader may select: all but the kept output (stdout/stderr tails).
READER_RUN_COLUMNS = (
    "run_id, key, lock_ids, mode, host, pid, child_pid, program, started_at, finished_at, "
    "outcome, reason, exit_code, signal, duration, streak, streak_since, holder_ref, holder, "
    "alerted_at, deadlocks, slow_after"
    # and those of sql.history.RUNS_NOTED_COLUMNS
    ", queued_seconds, jitter_seconds, attempts, attempt_exit_codes"
)

#: Who may do what: one row per (role, kind, pattern). Written only by the owner (no
#: privilege but SELECT is ever granted on it); read by every role's policies.
GRANTS_TABLE = """
CREATE TABLE IF NOT EXISTS jobrun.grants (
    role       text NOT NULL,
    kind       text NOT NULL CHECK (kind IN ('job', 'operator', 'reader')),
    pattern    text NOT NULL,
    key_like   text NOT NULL,
    granted_at timestamptz NOT NULL DEFAULT clock_timestamp(),
    PRIMARY KEY (role, kind, pattern)
);
ALTER TABLE jobrun.grants ENABLE ROW LEVEL SECURITY;
DROP POLICY IF EXISTS everyone_reads ON jobrun.grants;
CREATE POLICY everyone_reads ON jobrun.grants FOR SELECT USING (true);
GRANT SELECT ON jobrun.grants TO PUBLIC;
"""

#: WARNING: a function body written in SQL is parsed when it runs, with the *caller's*
#: search_path: a role that puts a schema of its own first (``SET search_path = mine,
#: pg_catalog``) and defines ``mine.=`` or ``mine.~~`` (LIKE) there would have the policies
#: below call its operators, and see, change or delete every team's rows. So every
#: operator, function and non-keyword type in these bodies is schema-qualified
#: (``OPERATOR(pg_catalog.=)``, ``pg_catalog.unnest``, ``::pg_catalog.text``). Qualifying
#: costs nothing and keeps ``lock_id`` inlinable (``ids_fit`` calls it up to 257 times per
#: key); a ``SET search_path`` clause would do the same at the price of a configuration
#: switch on every call and no inlining, and ``BEGIN ATOMIC`` bodies need PostgreSQL 14.
#: Keywords (``coalesce``, ``bigint``, ``bit``, ``session_user``) are the grammar's own.
_EQ = "OPERATOR(pg_catalog.=)"
_NE = "OPERATOR(pg_catalog.<>)"
_LIKE = "OPERATOR(pg_catalog.~~)"
_CAT = "OPERATOR(pg_catalog.||)"

#: ``allowed_for(who, label, need)``: every key of ``label`` ("a,b" for a run of several
#: keys) matches a grant of a role ``who`` is a member of, of a kind fit for ``need`` (run:
#: job; control and output: job or operator; read: any). A ``lock-id:`` grant matches only
#: the one id it names, never by pattern: the id of a named key is a ``lock-id:`` label too
#: (``jobrun key NAME`` prints it), and a range of ids would reach into other teams' keys.
#: Joined to pg_roles, so a grant of a dropped role is simply no grant.
#: ``allowed(label, need)``: the same for the current user (what the policies ask).
#: ``patterns(need)``: the same grants as LIKE patterns, for the current user, once per
#: statement: a policy asks ``fits(key, (SELECT patterns(need)))``, whose subquery is
#: evaluated once (an InitPlan), leaving a LIKE per key of a row (a lock-id grant's pattern
#: escaped: it matches its one id exactly). ``allowed`` looked the grants up for every row
#: a statement scanned (about 45 us each: seconds for a large history); ``fits`` costs a
#: few microseconds, the same for every row, so a granted role's reads cost what the
#: owner's do. ``fits(label, patterns)``: every key of ``label`` matches one of
#: ``patterns`` (an empty or NULL label, or no pattern: no).
#: ``may_run_as(who, label)``: ``who`` may hold ``label``'s locks: granted it, or not bound
#: by the grants at all (a superuser, a BYPASSRLS role, a member of the tables' owner).
#: ``only_squatters(ids, label)``: every other session holding one of the advisory lock
#: ids ``ids`` in this database is of a role that may not run ``label`` (lease mode then
#: takes the key past it: such a lock guards no run of the key).
#: ``lock_id(name)``: keys.lock_id_for in SQL (the first 8 bytes of SHA-256, signed).
#: ``ids_fit(label, ids)``: every id is the lock id of a key of the label, of one of its
#: slots (--slots), of its queue slot (--coalesce), or the id a ``lock-id:N`` part names:
#: a row can only ever claim its own key's locks. ``stamp_requester``: who asked is the
#: database's word, never the client's.
#: SECURITY INVOKER all: each sees what its caller sees.
FUNCTIONS = f"""
CREATE OR REPLACE FUNCTION jobrun.allowed_for(who name, label text, need text) RETURNS boolean
LANGUAGE sql STABLE AS $$
SELECT coalesce(label, '') {_NE} '' AND NOT EXISTS (
    SELECT 1 FROM pg_catalog.unnest(pg_catalog.string_to_array(label, ',')) AS k (key)
    WHERE NOT EXISTS (
        SELECT 1 FROM jobrun.grants AS g
        JOIN pg_catalog.pg_roles AS r ON r.rolname {_EQ} g.role
        WHERE CASE WHEN pg_catalog.starts_with(g.pattern, 'lock-id:')
                   THEN k.key {_EQ} g.pattern
                   ELSE k.key {_LIKE} g.key_like END
          AND (need {_EQ} 'read' OR g.kind {_EQ} 'job'
               OR (need {_NE} 'run' AND g.kind {_EQ} 'operator'))
          AND pg_catalog.pg_has_role(who, r.oid, 'MEMBER')))
$$;
CREATE OR REPLACE FUNCTION jobrun.allowed(label text, need text) RETURNS boolean
LANGUAGE sql STABLE AS $$
SELECT jobrun.allowed_for(current_user, label, need)
$$;
CREATE OR REPLACE FUNCTION jobrun.patterns(need text) RETURNS text[]
LANGUAGE sql STABLE AS $$
SELECT coalesce(pg_catalog.array_agg(
           CASE WHEN pg_catalog.starts_with(g.pattern, 'lock-id:')
                THEN pg_catalog.replace(pg_catalog.replace(pg_catalog.replace(g.pattern,
                         pg_catalog.chr(92), pg_catalog.chr(92) {_CAT} pg_catalog.chr(92)),
                         pg_catalog.chr(37), pg_catalog.chr(92) {_CAT} pg_catalog.chr(37)),
                         '_', pg_catalog.chr(92) {_CAT} '_')
                ELSE g.key_like END),
       '{{}}'::pg_catalog.text[])
FROM jobrun.grants AS g
JOIN pg_catalog.pg_roles AS r ON r.rolname {_EQ} g.role
WHERE (need {_EQ} 'read' OR g.kind {_EQ} 'job' OR (need {_NE} 'run' AND g.kind {_EQ} 'operator'))
  AND pg_catalog.pg_has_role(current_user, r.oid, 'MEMBER')
$$;
CREATE OR REPLACE FUNCTION jobrun.fits(label text, patterns text[]) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
SELECT (SELECT pg_catalog.bool_and(k.key {_LIKE} ANY (patterns))
        FROM pg_catalog.unnest(pg_catalog.string_to_array(label, ',')) AS k (key))
$$;
CREATE OR REPLACE FUNCTION jobrun.may_run_as(who name, label text) RETURNS boolean
LANGUAGE sql STABLE AS $$
SELECT EXISTS (SELECT 1 FROM pg_catalog.pg_roles AS r
               WHERE r.rolname {_EQ} who AND (r.rolsuper OR r.rolbypassrls))
    OR pg_catalog.pg_has_role(who, (
           SELECT c.relowner FROM pg_catalog.pg_class AS c
           WHERE c.oid {_EQ} 'jobrun.runs'::pg_catalog.regclass), 'MEMBER')
    OR jobrun.allowed_for(who, label, 'run')
$$;
CREATE OR REPLACE FUNCTION jobrun.only_squatters(ids bigint[], label text) RETURNS boolean
LANGUAGE sql STABLE AS $$
SELECT NOT EXISTS (
    SELECT 1 FROM pg_catalog.pg_locks AS l
    LEFT JOIN pg_catalog.pg_stat_activity AS a ON a.pid {_EQ} l.pid
    WHERE l.locktype {_EQ} 'advisory' AND l.granted AND l.objsubid {_EQ} 1
      AND l.pid {_NE} pg_catalog.pg_backend_pid()
      AND l.database {_EQ} (SELECT d.oid FROM pg_catalog.pg_database AS d
                            WHERE d.datname {_EQ} pg_catalog.current_database())
      AND ((l.classid::bigint OPERATOR(pg_catalog.<<) 32)
           OPERATOR(pg_catalog.|) l.objid::bigint) {_EQ} ANY (ids)
      -- A holder whose role cannot be told (a prepared transaction, a session gone
      -- since) counts as a run: when in doubt, the lease run skips.
      AND (a.usename IS NULL OR jobrun.may_run_as(a.usename, label)))
$$;
CREATE OR REPLACE FUNCTION jobrun.lock_id(name text) RETURNS bigint
LANGUAGE sql IMMUTABLE STRICT AS $$
SELECT ('x' {_CAT} pg_catalog.encode(pg_catalog.substr(
            pg_catalog.sha256(pg_catalog.convert_to(name, 'UTF8')), 1, 8), 'hex'))::bit(64)::bigint
$$;
CREATE OR REPLACE FUNCTION jobrun.ids_fit(label text, ids bigint[]) RETURNS boolean
LANGUAGE sql IMMUTABLE AS $$
SELECT NOT EXISTS (
    SELECT 1 FROM pg_catalog.unnest(ids) AS i (id)
    WHERE NOT EXISTS (
        SELECT 1 FROM pg_catalog.unnest(pg_catalog.string_to_array(label, ',')) AS k (key)
        WHERE CASE WHEN pg_catalog.starts_with(k.key, 'lock-id:')
                   THEN pg_catalog.substr(k.key, 9) {_EQ} i.id::pg_catalog.text
                   ELSE jobrun.lock_id(k.key) {_EQ} i.id
                        OR EXISTS (SELECT 1 FROM pg_catalog.generate_series(0, 255) AS s (n)
                                   WHERE jobrun.lock_id(k.key {_CAT} E'\\nslot '
                                                        {_CAT} s.n::pg_catalog.text) {_EQ} i.id)
                        OR jobrun.lock_id(k.key {_CAT} E'\\nqueue') {_EQ} i.id
              END))
$$;
CREATE OR REPLACE FUNCTION jobrun.stamp_requester() RETURNS trigger
LANGUAGE plpgsql SET search_path = pg_catalog, pg_temp AS $$
BEGIN
    NEW.username := session_user;
    RETURN NEW;
END
$$;
"""


def _allowed(right: str) -> str:
    """The policies' check that the role may use a row's key with ``right``.

    A key of its own (no comma): one LIKE against the grants' patterns (``patterns``: an
    InitPlan, read once per statement), no function call per row; a label of several keys:
    ``fits``.
    """
    patterns = f"(SELECT jobrun.patterns('{right}'))"
    return (
        f"CASE WHEN key {_EQ} '' THEN false"
        f" WHEN pg_catalog.strpos(key, ',') {_EQ} 0"
        f" THEN key {_LIKE} ANY ({patterns}::pg_catalog.text[])"
        f" ELSE jobrun.fits(key, {patterns}) END"
    )


#: The summary of the history (jobrun.run_keys, written only by its triggers): its rows are
#: read by who may read the runs of their key.
SUMMARY_POLICIES = f"""
DROP POLICY IF EXISTS readable ON jobrun.run_keys;
DROP POLICY IF EXISTS tenant_select ON jobrun.run_keys;
CREATE POLICY tenant_select ON jobrun.run_keys FOR SELECT
    USING ((SELECT pg_catalog.has_any_column_privilege('jobrun.runs', 'SELECT'))
           AND {_allowed("read")});
"""


def _policies(
    table: str, *, write: str, delete: str, fit: str = "", update: bool = True, stamp: bool = False
) -> str:
    """Row-level security on ``jobrun.{table}``: one policy per command, idempotent.

    Reading takes the ``read`` right; inserting (and updating, where rows are updated) the
    ``write`` right, and with ``fit`` also lock ids that belong to the row's key (a tenant
    cannot write a row of its own key that names another key's lock); deleting the
    ``delete`` right. ``stamp``: a trigger writes who asked (``session_user``) into the row.
    """
    check = _allowed(write) + (f" AND jobrun.ids_fit(key, {fit})" if fit else "")
    on = f"ON jobrun.{table}"
    lines = [f"ALTER TABLE jobrun.{table} ENABLE ROW LEVEL SECURITY;"]
    lines += [
        f"DROP POLICY IF EXISTS tenant_{c} {on};" for c in ("select", "insert", "update", "delete")
    ]
    lines += [
        f"CREATE POLICY tenant_select {on} FOR SELECT USING ({_allowed('read')});",
        f"CREATE POLICY tenant_insert {on} FOR INSERT WITH CHECK ({check});",
    ]
    if update:
        lines.append(
            f"CREATE POLICY tenant_update {on} FOR UPDATE USING ({_allowed(write)})"
            f" WITH CHECK ({check});"
        )
    lines.append(f"CREATE POLICY tenant_delete {on} FOR DELETE USING ({_allowed(delete)});")
    if stamp:
        trigger = "stamp_requester BEFORE INSERT OR UPDATE"
        stamp_it = "FOR EACH ROW EXECUTE FUNCTION jobrun.stamp_requester()"
        lines += [
            f"DROP TRIGGER IF EXISTS stamp_requester {on};",
            f"CREATE TRIGGER {trigger} {on} {stamp_it};",
        ]
    return "\n".join(lines)


#: Row-level security on every jobrun table (ENABLE, not FORCE: the owner is trusted), and
#: the triggers that stamp who asked. Who may do what, table by table: a run writes its own
#: rows and leases; an operator's requests, pauses and deletions take the ``control`` right.
POLICIES = "\n\n".join(
    (
        _policies("runs", write="run", fit="lock_ids", delete="run"),
        _policies("leases", write="run", fit="ARRAY[lock_id]", delete="control"),
        _policies("stop_requests", write="control", update=False, delete="control", stamp=True),
        _policies("pauses", write="control", delete="control", stamp=True),
        _policies("expectations", write="run", delete="control"),
        SUMMARY_POLICIES,
    )
)

#: ``run_label(run_id)``: the label of any run, whoever may see its row. SECURITY DEFINER
#: (the owner's view), and it tells nothing but the label of a run id already known: what
#: ``jobrun stop`` needs to check that the run a session names is a run of the key asked for.
RUN_LABEL_FUNCTION = """
CREATE OR REPLACE FUNCTION jobrun.run_label(run uuid) RETURNS text
LANGUAGE sql STABLE SECURITY DEFINER SET search_path = pg_catalog, pg_temp AS $$
SELECT key FROM jobrun.runs WHERE run_id = run
$$;
"""

#: What ``jobrun init`` adds to the schema (history/schema.py's upgrade runs first, in the
#: same transaction), as the owner: the grants, the functions, the policies (the schema
#: lock first: a first run racing it waits). Composed of this package's constants only.
INIT = "\n".join(
    (
        SCHEMA_XACT_LOCK + ";",
        GRANTS_TABLE.strip(),
        FUNCTIONS.strip(),
        RUN_LABEL_FUNCTION.strip(),
        TAKE_LOCK_AWAY_FUNCTION.strip(),
        POLICIES.strip(),
    )
)

#: Make the NOLOGIN role ``{role}`` unless it exists (another database's init, at once).
MAKE_ROLE = """
DO $$
BEGIN
    CREATE ROLE {role} NOLOGIN;
EXCEPTION WHEN duplicate_object OR unique_violation THEN NULL;
END
$$
"""

#: Whether this role may create roles, and which of jobrun's own roles exist.
ROLE_FACTS = """
SELECT r.rolsuper OR r.rolcreaterole,
       EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %(operator)s),
       EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %(reader)s)
FROM pg_roles AS r WHERE r.rolname = current_user
"""

CURRENT_USER = "SELECT current_user"
ROLE_EXISTS = "SELECT EXISTS (SELECT 1 FROM pg_roles WHERE rolname = %s)"
GRANTS_EXIST = "SELECT to_regclass('jobrun.grants') IS NOT NULL"
KINDS_OF = "SELECT DISTINCT kind FROM jobrun.grants WHERE role = %s"

#: ``jobrun grants``: who may do what (a role that no longer exists says so).
GRANTS_LIST = """
SELECT g.role, g.kind, g.pattern, g.granted_at, r.oid IS NOT NULL AS role_exists
FROM jobrun.grants AS g LEFT JOIN pg_roles AS r ON r.rolname = g.role
ORDER BY g.role, g.kind, g.pattern
"""

#: ``jobrun grant``'s statements; ``{role}`` an identifier, the rest bound values.
GRANT_ROW = """
INSERT INTO jobrun.grants (role, kind, pattern, key_like)
VALUES ({role_literal}, {kind}, {pattern}, {key_like})
ON CONFLICT (role, kind, pattern) DO NOTHING
"""
GRANT_SCHEMA = "GRANT USAGE ON SCHEMA jobrun TO {role}"
#: What each kind of grant needs besides its rows (row-level security narrows it to keys).
GRANT_JOB = (
    (
        "GRANT SELECT, INSERT, UPDATE, DELETE "
        "ON jobrun.runs, jobrun.leases, jobrun.pauses, jobrun.expectations TO {role}"
    ),
    "GRANT SELECT, INSERT, UPDATE, DELETE ON jobrun.stop_requests TO {role}",
    "GRANT USAGE ON SEQUENCE jobrun.fence TO {role}",
)
GRANT_OPERATOR = (
    "GRANT SELECT ON jobrun.runs, jobrun.expectations TO {role}",
    "GRANT SELECT, DELETE ON jobrun.leases TO {role}",
    "GRANT SELECT, INSERT, DELETE ON jobrun.stop_requests TO {role}",
    "GRANT SELECT, INSERT, UPDATE, DELETE ON jobrun.pauses TO {role}",
)
GRANT_READER = (
    f"GRANT SELECT ({READER_RUN_COLUMNS}) ON jobrun.runs TO {{role}}",
    (
        "GRANT SELECT ON jobrun.leases, jobrun.pauses, jobrun.expectations, "
        "jobrun.stop_requests TO {role}"
    ),
)
#: ``jobrun grant ROLE --revoke``: every privilege and every row of ROLE.
REVOKE_ALL = (
    (
        "REVOKE ALL ON jobrun.runs, jobrun.leases, jobrun.stop_requests, jobrun.pauses, "
        "jobrun.expectations FROM {role}"
    ),
    "REVOKE ALL ON SEQUENCE jobrun.fence FROM {role}",
    "REVOKE ALL ON SCHEMA jobrun FROM {role}",
    "DELETE FROM jobrun.grants WHERE role = {role_literal}",
)
#: ``jobrun grant ROLE --revoke --keys PATTERN``: that pattern's rows only.
REVOKE_PATTERN = "DELETE FROM jobrun.grants WHERE role = {role_literal} AND pattern = {pattern}"
