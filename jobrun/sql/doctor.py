"""Statements jobrun doctor inspects the server with."""

from __future__ import annotations

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

#: Sessions in this database, other than jobrun's, holding advisory locks in the space keys
#: use (a bigint: objsubid 1): an application's own locks, or a squatter on a key's id
#: (session-mode runs of that key skip while it holds it). Role, pid and lock id, a few.
DOCTOR_FOREIGN_ADVISORY = """
SELECT a.usename, l.pid, (l.classid::bigint << 32) | l.objid::bigint
FROM pg_locks AS l
LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid
WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
  AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())
  AND coalesce(a.application_name, '') NOT LIKE 'jobrun:%'
ORDER BY a.usename, l.pid
LIMIT 6
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

#: Tenancy: who this role is, whether ``jobrun init`` ran, which jobrun tables are shared
#: with other roles without row-level security, which it owns (the owner is not bound by
#: row-level security), and whether it may take fencing tokens.
DOCTOR_TENANCY = """
SELECT current_user, r.rolsuper, r.rolbypassrls,
       to_regclass('jobrun.grants') IS NOT NULL,
       coalesce((SELECT array_agg(c.relname::text ORDER BY c.relname)
                 FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
                 WHERE n.nspname = 'jobrun' AND c.relname = ANY(%(tables)s)
                   AND c.relkind IN ('r', 'p') AND NOT c.relrowsecurity
                   AND EXISTS (SELECT 1 FROM aclexplode(c.relacl) AS a
                               WHERE a.grantee <> c.relowner)), '{}'),
       coalesce((SELECT array_agg(c.relname::text ORDER BY c.relname)
                 FROM pg_class AS c JOIN pg_namespace AS n ON n.oid = c.relnamespace
                 WHERE n.nspname = 'jobrun' AND c.relname = ANY(%(tables)s)
                   AND c.relkind IN ('r', 'p')
                   AND pg_has_role(current_user, c.relowner, 'MEMBER')), '{}'),
       to_regclass('jobrun.fence') IS NOT NULL
           AND NOT has_sequence_privilege(to_regclass('jobrun.fence'), 'USAGE')
           AND to_regclass('jobrun.runs') IS NOT NULL
           AND has_table_privilege(to_regclass('jobrun.runs'), 'INSERT')
FROM pg_roles AS r WHERE r.rolname = current_user
"""

#: The grants this role has, itself or through a role it is a member of (after init).
DOCTOR_GRANTS = """
SELECT g.kind, g.pattern FROM jobrun.grants AS g JOIN pg_roles AS r ON r.rolname = g.role
WHERE pg_has_role(current_user, r.oid, 'MEMBER')
ORDER BY g.kind, g.pattern
"""

#: The doctor's probes (jobrun.ops.doctor.probe) send a run's own statements, in a transaction
#: that is always rolled back; these few are their own. Whether ``jobrun init`` ran (then a
#: role may only write rows of the keys it was granted).
DOCTOR_PROBE_INITIALISED = "SELECT pg_catalog.to_regclass('jobrun.grants') IS NOT NULL"

#: This role's job grants, patterns with a wildcard first: filled in, they give a key of
#: its own that no real job is likely to use.
DOCTOR_PROBE_PATTERNS = """
SELECT g.pattern FROM jobrun.grants AS g
JOIN pg_catalog.pg_roles AS r ON r.rolname OPERATOR(pg_catalog.=) g.role
WHERE g.kind OPERATOR(pg_catalog.=) 'job'
  AND pg_catalog.pg_has_role(current_user, r.oid, 'MEMBER')
ORDER BY pg_catalog.strpos(g.pattern, '*') OPERATOR(pg_catalog.=) 0, g.pattern
"""

#: The probe's history row read back, as ``jobrun status`` reads a run.
DOCTOR_PROBE_READ = """
SELECT run_id FROM jobrun.runs WHERE run_id OPERATOR(pg_catalog.=) %(run_id)s::pg_catalog.uuid
"""

#: The probe's history row finished, as a run's end updates it.
DOCTOR_PROBE_FINISH = """
UPDATE jobrun.runs
SET outcome = 'succeeded', exit_code = 0, finished_at = pg_catalog.clock_timestamp()
WHERE run_id OPERATOR(pg_catalog.=) %(run_id)s::pg_catalog.uuid
RETURNING run_id
"""

#: The history's size and shape: whether jobrun.runs exists, its size with its indexes, its
#: estimated rows, whether the summary exists and is complete, and which of the history's
#: indexes (RUNS_INDEXES' names) are missing or invalid.
DOCTOR_HISTORY_SCALE = """
SELECT c.oid IS NOT NULL,
       CASE WHEN c.oid IS NOT NULL THEN pg_total_relation_size(c.oid) END,
       greatest(c.reltuples, 0)::int8,
       to_regclass('jobrun.run_keys') IS NOT NULL,
       obj_description(to_regclass('jobrun.run_keys'), 'pg_class')
           IS NOT DISTINCT FROM %(complete)s,
       ARRAY(SELECT name FROM unnest(%(indexes)s::text[]) AS name
             WHERE NOT EXISTS (SELECT 1 FROM pg_class AS x
                               JOIN pg_namespace AS n ON n.oid = x.relnamespace
                               JOIN pg_index AS i ON i.indexrelid = x.oid
                               WHERE n.nspname = 'jobrun' AND x.relname = name
                                 AND i.indisvalid))
FROM (SELECT 1) AS one
LEFT JOIN pg_class AS c ON c.oid = to_regclass('jobrun.runs')
"""

#: The keys of the summary this role sees, and the most rows one of them holds.
DOCTOR_HISTORY_KEYS = """
SELECT count(*), coalesce(max(finished_count + skip_count), 0) FROM jobrun.run_keys
"""
