"""Checks of what runs need room in: jobrun's schema and tables, connection slots, lock table."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobrun import sql
from jobrun.escape import printable
from jobrun.ops.doctor import query
from jobrun.ops.doctor.finding import FAIL, NOTE, OK, WARN, Finding

if TYPE_CHECKING:
    from jobrun.ops.doctor.query import Connection

#: Below this many free connection slots, a burst of jobs may be refused.
MIN_FREE_CONNECTIONS = 5
#: Advisory locks share the lock table with every other lock: one table for all of them.
LOCK_TABLE_WARN = 0.5
LOCK_TABLE_FAIL = 0.9
_PERCENT = 100


def _create_fix(conn: Connection) -> str:
    """What makes jobrun's schema and tables creatable, or created (docs/operations.md)."""
    role, database = (printable(name or "").replace('"', '""') for name in (
        conn.info.user, conn.info.dbname))  # fmt: skip
    return (
        f'fix: GRANT CREATE ON DATABASE "{database}" TO "{role}" (its first run creates them), '
        f"or have the owner run jobrun init, then jobrun grant {role} --keys PATTERN"
    )


def schema(conn: Connection, mode: str, *, read_only: bool) -> list[Finding]:
    """The jobrun schema and its tables: there, or creatable, and usable by this role."""
    exists, create_in_db, usage, create_in_schema = query.one(conn, sql.DOCTOR_SCHEMA)
    lease_needed = FAIL if mode == "lease" else WARN
    if not exists:
        if read_only:
            return [
                Finding(
                    lease_needed,
                    "schema",
                    "jobrun schema missing, and this role's sessions are read-only "
                    "(default_transaction_read_only = on): it cannot be created",
                )
            ]
        if create_in_db:
            return [Finding(OK, "schema", "jobrun schema not there yet; created on first use")]
        return [
            Finding(
                lease_needed,
                "schema",
                "jobrun schema missing and this role may not create it (no CREATE on the "
                "database): lease mode cannot work and run history is not kept; "
                + _create_fix(conn),
            )
        ]
    if not usage:
        return [
            Finding(
                lease_needed,
                "schema",
                "jobrun schema exists but this role lacks USAGE on it: jobrun grant <role> "
                "--keys PATTERN (after jobrun init), or GRANT USAGE ON SCHEMA jobrun TO <role>",
            )
        ]
    findings = [Finding(OK, "schema", "jobrun schema exists")]
    # What is lost without the table or its privileges. The operators' tables are made with
    # the history, often by an owner: a role granted only runs and leases loses these quietly.
    for table, purpose, severity in (
        ("leases", "lease mode", lease_needed if mode == "lease" else OK),
        ("runs", "run history", WARN),
        ("stop_requests", "jobrun stop (a run of this role cannot be reached)", WARN),
        ("pauses", "jobrun pause (runs of this role do not see a pause)", WARN),
        ("expectations", "--expect-every", WARN),
    ):
        present, *privileges = query.one(conn, sql.DOCTOR_TABLE, {"table": table})
        name = f"jobrun.{table}"
        if not present and create_in_schema and create_in_db:
            findings.append(Finding(OK, name, "not there yet; created on first use"))
            continue
        if not present:
            # WARNING: a run creates a missing table with CREATE SCHEMA IF NOT EXISTS first,
            # which asks for CREATE on the database even when the schema is there.
            lacks = "CREATE on the database" if create_in_schema else "CREATE on the schema"
            why = (
                f"missing, and this role may not create it (no {lacks}): {purpose} will "
                f"not work; {_create_fix(conn)}"
            )
            findings.append(Finding(severity, name, why))
            continue
        missing = [
            verb
            for verb, granted in zip(
                ("SELECT", "INSERT", "UPDATE", "DELETE"), privileges, strict=True
            )
            if not granted
        ]
        if missing:
            note = "" if severity != OK else " (not used in session mode)"
            findings.append(
                Finding(
                    severity,
                    name,
                    f"exists; this role lacks {', '.join(missing)}: {purpose} will fail{note}; "
                    "fix: jobrun grant <role> --keys PATTERN (after jobrun init)",
                )
            )
        else:
            findings.append(Finding(OK, name, "exists; SELECT, INSERT, UPDATE, DELETE granted"))
    return findings


def connections(conn: Connection) -> Finding:
    """Connection slots in use, reserved and free: a session-mode run holds one throughout."""
    max_connections, superuser_reserved, reserved, in_use = query.one(conn, sql.DOCTOR_CONNECTIONS)
    usable = int(max_connections) - int(superuser_reserved) - int(reserved)
    free = usable - int(in_use)
    detail = (
        f"{in_use} of {max_connections} in use, {superuser_reserved + reserved} reserved, "
        f"{free} free (a session-mode run holds one for its whole run)"
    )
    if free <= 0:
        return Finding(FAIL, "connections", f"{detail}: new runs will be refused")
    if free < max(MIN_FREE_CONNECTIONS, usable // 10):
        return Finding(WARN, "connections", f"{detail}: little headroom")
    return Finding(OK, "connections", detail)


def advisory(conn: Connection) -> list[Finding]:
    """Advisory locks held now, and their share of the lock table every lock draws on."""
    capacity = int(query.one(conn, sql.DOCTOR_LOCK_CAPACITY)[0])
    cluster, here, by_jobrun = (int(value) for value in query.one(conn, sql.DOCTOR_ADVISORY))
    held = Finding(
        OK,
        "advisory locks",
        f"{here} held in this database now, {by_jobrun} of them by jobrun sessions; "
        f"{cluster} in the whole cluster",
    )
    share = cluster / capacity if capacity else 1.0
    detail = (
        f"room for about {capacity} locks (max_locks_per_transaction x (max_connections + "
        f"max_prepared_transactions)), shared by every lock; advisory locks take "
        f"{share * _PERCENT:.1f}%"
    )
    status = FAIL if share >= LOCK_TABLE_FAIL else WARN if share >= LOCK_TABLE_WARN else OK
    return [held, *_foreign_holders(conn), Finding(status, "lock table", detail)]


#: How many sessions holding advisory locks outside jobrun the doctor names.
_NAMED_HOLDERS = 5


def _foreign_holders(conn: Connection) -> list[Finding]:
    """A NOTE naming sessions outside jobrun that hold locks in the keys' space, if any.

    An application's own advisory locks, or a role squatting a key's id (``jobrun key
    NAME`` prints it): session-mode runs of that key skip while it holds it; lease mode,
    after ``jobrun init``, goes past a role that may not run the key.
    """
    rows = conn.execute(sql.DOCTOR_FOREIGN_ADVISORY).fetchall()
    if not rows:
        return []
    named = ", ".join(
        f"role {printable(str(role))} (pid {pid}) holds lock id {lock_id}"
        for role, pid, lock_id in rows[:_NAMED_HOLDERS]
    )
    more = " and more" if len(rows) > _NAMED_HOLDERS else ""
    return [
        Finding(
            NOTE,
            "advisory locks outside jobrun",
            f"{named}{more}: a session-mode run of a key with such an id skips while it is "
            "held (jobrun key NAME prints a key's id)",
        )
    ]
