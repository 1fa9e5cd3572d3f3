"""Tenants of a shared database: `jobrun init` guards it, `jobrun grant` says who may do what."""

from __future__ import annotations

import unicodedata
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from psycopg import errors
from psycopg import sql as pgsql

from jobrun.escape import printable
from jobrun.exitcodes import JobrunError, LockStoreUnavailable, UsageError
from jobrun.history import schema
from jobrun.keys import LOCK_ID_PREFIX, validate_name
from jobrun.sql import schema as schema_sql
from jobrun.sql import tenants as statements

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    import psycopg

    Connection = psycopg.Connection[Any]

#: One statement, composed with quoted names and values (printable without a connection).
Statement = pgsql.Composed | pgsql.SQL
#: What a grant lets a role do (``allowed``'s needs: run, control, read, output).
KINDS = ("job", "operator", "reader")
#: PostgreSQL's limit on an identifier (NAMEDATALEN - 1), in bytes.
MAX_ROLE_BYTES = 63


class NotInitialised(LockStoreUnavailable):
    """``jobrun grant`` on a database where ``jobrun init`` was never run."""

    def __init__(self) -> None:
        super().__init__(
            "jobrun init was never run on this database (no jobrun.grants): have the "
            "database owner run jobrun init first",
            reason="not_initialised",
        )


class OutputRefused(JobrunError):
    """A role that may read the history but not the output runs kept (a reader)."""

    exit_code = LockStoreUnavailable.exit_code


@dataclass(frozen=True)
class Grant:
    """What ``jobrun grant`` is asked to do for one role."""

    role: str
    kind: str | None  # job, operator, reader; None: revoke
    patterns: tuple[str, ...]


def validate_role(name: str) -> str:
    """``name`` if it can name a role jobrun grants to, else UsageError saying why."""
    if not name:
        raise UsageError("role name is empty")
    if any(unicodedata.category(char) in {"Cc", "Cf", "Cs"} for char in name):
        raise UsageError(f"role name {printable(name)!r} contains a control character")
    if len(name.encode("utf-8", "surrogateescape")) > MAX_ROLE_BYTES:
        raise UsageError(f"role name {printable(name)!r} is longer than {MAX_ROLE_BYTES} bytes")
    if name.lower() == "public" or name.startswith("pg_"):
        raise UsageError(f"role name {name!r} is reserved by PostgreSQL: name a role of yours")
    return name


def validate_pattern(pattern: str) -> str:
    """``pattern`` (a glob: ``*`` any run of characters, ``?`` one) as a LIKE pattern.

    The pattern must be able to match a key: no comma (commas join keys in a label), and
    what is left once the wildcards are taken out follows the key-name rules.
    """
    where = f"--keys {printable(pattern)!r}"
    if pattern.startswith(LOCK_ID_PREFIX):
        # WARNING: only an exact id. The lock id of every named key is a ``lock-id:`` label
        # too (``jobrun key NAME`` prints it): a range such as ``lock-id:9*`` would let the
        # role write leases on the ids of other teams' named keys and block them.
        rest = pattern[len(LOCK_ID_PREFIX) :]
        if any(char in "*?" for char in rest):
            raise UsageError(
                f"{where}: a {LOCK_ID_PREFIX} grant names one exact id (a range would reach "
                "the lock ids of named keys); grant each id, or name the keys"
            )
        try:
            exact = int(rest)
        except ValueError:
            raise UsageError(f"{where}: after {LOCK_ID_PREFIX} a whole number") from None
        if not -(2**63) <= exact < 2**63 or rest != str(exact):
            raise UsageError(f"{where}: after {LOCK_ID_PREFIX} a signed 64-bit id as written")
    else:
        try:
            validate_name(pattern.replace("*", "x").replace("?", "x"))
        except UsageError as exc:
            raise UsageError(f"{where}: {exc}") from None
    if "," in pattern:
        raise UsageError(f"{where} contains a comma (commas join several keys)")
    escaped = pattern.replace("\\", "\\\\").replace("%", "\\%").replace("_", "\\_")
    return escaped.replace("*", "%").replace("?", "_")


def init_statements(*, make_roles: Iterable[str], roles: Iterable[str]) -> list[Statement]:
    """``jobrun init``'s SQL: the tables and their protections, then jobrun's own roles.

    ``make_roles`` are made; ``roles`` (jobrun_operator, jobrun_reader: where they exist or
    are made) get their grant of every key.
    """
    composed: list[Statement] = [pgsql.SQL(statements.INIT)]
    composed += [_sql(statements.MAKE_ROLE, role=pgsql.Identifier(role)) for role in make_roles]
    for role in roles:
        kind = "operator" if role == statements.OPERATOR_ROLE else "reader"
        composed += grant_statements(Grant(role=role, kind=kind, patterns=("*",)))
    return composed


def grant_statements(grant: Grant) -> list[Statement]:
    """The SQL that carries out ``grant`` (its rows, then the privileges they need)."""
    names = {"role": pgsql.Identifier(grant.role), "role_literal": pgsql.Literal(grant.role)}
    if grant.kind is None:
        if grant.patterns:
            return [
                _sql(statements.REVOKE_PATTERN, **names, pattern=pgsql.Literal(pattern))
                for pattern in grant.patterns
            ]
        return [_sql(text, **names) for text in statements.REVOKE_ALL]
    composed = [
        _sql(
            statements.GRANT_ROW,
            **names,
            kind=pgsql.Literal(grant.kind),
            pattern=pgsql.Literal(pattern),
            key_like=pgsql.Literal(validate_pattern(pattern)),
        )
        for pattern in grant.patterns
    ]
    privileges = {
        "job": statements.GRANT_JOB,
        "operator": statements.GRANT_OPERATOR,
        "reader": statements.GRANT_READER,
    }[grant.kind]
    composed += [_sql(text, **names) for text in (statements.GRANT_SCHEMA, *privileges)]
    return composed


#: ``jobrun init --print-sql``'s head: who runs the script, and what comes before and after.
INIT_SCRIPT_HEAD = """\
-- jobrun init, as SQL (jobrun init --print-sql), for PostgreSQL 13 to 18. Names below are
-- examples; the whole recipe: docs/operations.md, "Preparing a database".
--
-- 1. Once, as a superuser (psql -d postgres):
--      CREATE ROLE jobrun_owner LOGIN PASSWORD 'change-me';  -- owns jobrun's tables
--      CREATE ROLE team_a LOGIN PASSWORD 'change-me';        -- runs jobs (one per team)
--      CREATE DATABASE ops;                                  -- or an existing database
--      GRANT CONNECT, CREATE ON DATABASE ops TO jobrun_owner;
--      GRANT CONNECT ON DATABASE ops TO team_a;
--      CREATE ROLE jobrun_operator NOLOGIN; CREATE ROLE jobrun_reader NOLOGIN;
--      (the last two: this script makes them if jobrun_owner has CREATEROLE)
-- 2. This script, as the tables' owner, in that database; it is safe to run again:
--      psql -v ON_ERROR_STOP=1 -U jobrun_owner -d ops -f jobrun-init.sql
-- 3. Each job role its keys (jobrun grant ... --print-sql prints that SQL too):
--      jobrun grant team_a --keys 'a-*'
-- A job role then needs nothing else: no CREATE on the database, no other grant.
BEGIN;
SET LOCAL search_path = pg_catalog, pg_temp;
"""

#: A role jobrun init makes, made only where it does not exist yet: a DBA's script run by
#: an owner without CREATEROLE must not stop at a role a superuser already made.
_MAKE_ROLE_IF_MISSING = """
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_catalog.pg_roles
                   WHERE rolname OPERATOR(pg_catalog.=) {literal}) THEN
        CREATE ROLE {role} NOLOGIN;
    END IF;
END
$$
"""


def init_script() -> str:
    """``jobrun init --print-sql``: init's SQL as one transaction, for psql, with its recipe."""
    ours = [statements.OPERATOR_ROLE, statements.READER_ROLE]
    composed: list[Statement] = [
        pgsql.SQL(schema_sql.upgrade_message(0)),  # 0: no statement timeout
        pgsql.SQL(schema_sql.CHECK_WRITE),  # a newer jobrun's schema: stop (ON_ERROR_STOP)
        pgsql.SQL(statements.INIT),
    ]
    composed += [
        _sql(_MAKE_ROLE_IF_MISSING, role=pgsql.Identifier(role), literal=pgsql.Literal(role))
        for role in ours
    ]
    for role in ours:
        kind = "operator" if role == statements.OPERATOR_ROLE else "reader"
        composed += grant_statements(Grant(role=role, kind=kind, patterns=("*",)))
    return INIT_SCRIPT_HEAD + as_text(composed) + "COMMIT;\n"


def as_text(composed: Sequence[Statement]) -> str:
    """Statements as a script a person can read, or feed to psql."""
    return "".join(part.as_string(None).strip().rstrip(";") + ";\n" for part in composed)


#: How long ``jobrun init``'s upgrade may take per statement (and wait for a lock).
INIT_TIMEOUT_MS = 60_000


def init(conn: Connection) -> list[str]:
    """Run ``jobrun init`` as this connection's role; the notes to tell the person."""
    row = conn.execute(
        statements.ROLE_FACTS,
        {"operator": statements.OPERATOR_ROLE, "reader": statements.READER_ROLE},
    ).fetchone()
    may_create, *exist = row if row is not None else (False, False, False)
    ours = (statements.OPERATOR_ROLE, statements.READER_ROLE)
    missing = [role for role, there in zip(ours, exist, strict=True) if not there]
    notes = []
    if missing and not may_create:
        notes.append(
            f"this role may not create roles (no CREATEROLE): {' and '.join(missing)} not "
            "made; grant operators and readers with jobrun grant ROLE --operator / --reader"
        )
    make = missing if may_create else []
    roles = [role for role in ours if role not in missing or role in make]
    with conn.transaction():
        # The schema brought up to date first (SchemaTooNew where a newer jobrun's steps
        # forbid this one to write: its functions and policies must not be put back), in
        # the same transaction as the protections.
        schema.ensure(conn, timeout_ms=INIT_TIMEOUT_MS)
        for part in init_statements(make_roles=make, roles=roles):
            conn.execute(part)
    return notes


def grant(conn: Connection, request: Grant) -> None:
    """Carry out ``request`` (checked against the database first)."""
    _require_init(conn)
    found = conn.execute(statements.ROLE_EXISTS, (request.role,)).fetchone()
    if not (found and found[0]):
        raise UsageError(f"no role named {printable(request.role)!r} in this server")
    if request.kind is not None:
        kinds = {str(row[0]) for row in conn.execute(statements.KINDS_OF, (request.role,))}
        # WARNING: a reader may select jobrun.runs only without the kept output; a job or
        # operator grant gives it every column, of every key it may read.
        if (request.kind == "reader" and kinds - {"reader"}) or (
            request.kind != "reader" and "reader" in kinds
        ):
            raise UsageError(
                f"{printable(request.role)!r} already has {', '.join(sorted(kinds))} grants: a "
                "reader must be a role of its own (it would read kept output otherwise); "
                "revoke first (jobrun grant ROLE --revoke)"
            )
    with conn.transaction():
        for part in grant_statements(request):
            conn.execute(part)


def grants(conn: Connection) -> list[dict[str, object]]:
    """Every grant: role, kind, pattern, since, and whether the role still exists."""
    _require_init(conn)
    names = ("role", "kind", "pattern", "granted_at", "role_exists")
    return [dict(zip(names, row, strict=True)) for row in conn.execute(statements.GRANTS_LIST)]


def read_output(conn: Connection, run_id: str) -> Mapping[str, object] | None:
    """``jobrun show``'s run with its tails; OutputRefused for a role that may not read them."""
    from jobrun.run import tail  # noqa: PLC0415 - only show reads output

    try:
        return tail.read(conn, run_id)
    except errors.InsufficientPrivilege:
        user = conn.execute(statements.CURRENT_USER).fetchone()
        raise OutputRefused(
            f"role {printable(user[0] if user else '?')!r} may read the history but not the output "
            "runs kept: that needs jobrun grant ROLE --keys PATTERN or --operator"
        ) from None


def _require_init(conn: Connection) -> None:
    row = conn.execute(statements.GRANTS_EXIST).fetchone()
    if not (row and row[0]):
        raise NotInitialised


def _sql(text: str, **parts: pgsql.Composable) -> Statement:
    return pgsql.SQL(text.strip()).format(**parts)
