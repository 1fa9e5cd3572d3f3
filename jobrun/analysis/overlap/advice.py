"""A wait-for cycle read as a lock order: what each job locked, and the one order that breaks it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql as pgsql
from psycopg.rows import dict_row

from jobrun import db, sql
from jobrun.escape import printable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from jobrun.analysis.overlap.model import Lock, Wait

#: Characters of one key value kept (a text key can be long).
VALUE_CHARS = 60
_INSERT = re.compile(r"\s*(WITH\b.*?\)\s*)?INSERT\b", re.IGNORECASE | re.DOTALL)
#: A row named by a cycle: (table, position ``(page,tuple)``).
Row = tuple[str, str]


@dataclass
class Facts:
    """What the database said about a cycle's rows while the jobs were held in it."""

    #: Row -> its key (``id=2``), read by ctid while the row was still visible.
    keys: dict[Row, str] = field(default_factory=dict)
    #: Table -> its key columns (primary key, else a unique index), empty when none.
    columns: dict[str, tuple[str, ...]] = field(default_factory=dict)
    #: (pid, child table, parent table): a foreign key from a table that pid wrote to.
    references: list[tuple[int, str, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Advice:
    """A cycle's shape, each job's lock order, the suggested fix, and what it is based on."""

    shape: str
    steps: tuple[str, ...]
    fix: str
    evidence: tuple[str, ...]
    #: The first ``waits`` items of the evidence are the cycle's waits.
    waits: int = 0

    def lines(self) -> list[str]:
        """The advice for people, every text from the database escaped.

        The waits of the evidence are the cycle the report prints just before: not twice.
        """
        return [
            printable(line)
            for line in (
                f"lock order ({self.shape}):",
                *(f"  {step}" for step in self.steps),
                f"suggested fix: {self.fix}",
                "  evidence: the wait-for cycle above",
                *(f"  evidence: {item}" for item in self.evidence[self.waits :]),
            )
        ]

    def as_json(self) -> dict[str, Any]:
        """The advice as stable JSON fields."""
        return {
            "shape": self.shape,
            "steps": list(self.steps),
            "suggested_fix": self.fix,
            "evidence": list(self.evidence),
        }


def gather(
    conn: psycopg.Connection[tuple[object, ...]], target: db.Target, cycle: Sequence[Wait]
) -> Facts:
    """Read the cycle's rows by ctid (their keys) and the foreign keys onto their tables.

    WARNING: called while the jobs are stuck in the cycle: a row a job updated is still
    visible by its old ctid only until that job commits, so this runs at the first look.
    """
    facts = Facts()
    rows = [row for row in (row_of(wait.lock) for wait in cycle) if row is not None]
    with db.translate_errors(target, "reading the rows of the wait-for cycle"):
        cursor = conn.cursor(row_factory=dict_row)
        for table in dict.fromkeys(table for table, _ in rows):
            try:
                found = cursor.execute(sql.OVERLAP_ROW_KEY, {"relation": table}).fetchone()
            except psycopg.errors.UndefinedTable:
                continue
            if found is None:
                continue
            facts.columns[table] = tuple(found["columns"])
            for row in (row for row in rows if row[0] == table):
                key = _key(conn, found, row[1])
                if key is not None:
                    facts.keys[row] = key
        if rows:
            references = cursor.execute(
                sql.OVERLAP_FOREIGN_KEYS,
                {
                    "pids": [wait.pid for wait in cycle],
                    "relations": list(dict.fromkeys(t for t, _ in rows)),
                },
            ).fetchall()
            facts.references = [(r["pid"], r["child"], r["parent"]) for r in references]
    return facts


def _key(
    conn: psycopg.Connection[tuple[object, ...]], table: dict[str, Any], ctid: str
) -> str | None:
    """``id=2`` for the row at ``ctid`` (None: no key columns, no privilege, not visible)."""
    columns: list[str] = table["columns"]
    if not columns:
        return None
    query = pgsql.SQL("SELECT {} FROM {} WHERE ctid = %s::tid").format(
        pgsql.SQL(", ").join(pgsql.Identifier(column) for column in columns),
        pgsql.Identifier(table["schema"], table["name"]),
    )
    try:
        # WARNING: a job's pending table lock (LOCK TABLE, DDL) would queue this read
        # behind it until the deadlock is broken: give up at once instead.
        with conn.transaction():
            conn.execute(sql.OVERLAP_KEY_LOCK_TIMEOUT)
            values = conn.execute(query, (ctid,)).fetchone()
    except (psycopg.errors.InsufficientPrivilege, psycopg.errors.LockNotAvailable):
        return None
    if values is None:
        return None
    shown = [str(value)[:VALUE_CHARS] for value in values]
    if len(columns) == 1:
        return f"{columns[0]}={shown[0]}"
    return f"({', '.join(columns)})=({', '.join(shown)})"


def row_of(lock: Lock | None) -> Row | None:
    """The row a wait is about: a tuple lock's, or the row a transaction wait holds meanwhile."""
    if lock is None:
        return None
    if lock.locktype == "tuple" and lock.relation and lock.ident:
        return lock.relation, lock.ident
    if lock.locktype == "transactionid" and lock.row and lock.row_relation:
        return lock.row_relation, lock.row
    return None


def advise(cycle: Sequence[Wait], facts: Facts) -> Advice:
    """The cycle's shape and the single lock order that breaks it (a suggestion)."""
    locks = [wait.lock for wait in cycle if wait.lock is not None]
    rows = [row for row in (row_of(lock) for lock in locks) if row is not None]
    tables = list(dict.fromkeys(table for table, _ in rows))
    parents = [ref for ref in facts.references if ref[2] in tables]
    evidence = [wait.describe() for wait in cycle]
    if facts.keys:
        evidence.append(
            "rows read by ctid while the jobs were held: "
            + ", ".join(f"{table} {pos} is {key}" for (table, pos), key in facts.keys.items())
        )
    evidence += [
        f"pid {pid} wrote to {child}, whose foreign key references {parent}"
        for pid, child, parent in parents
    ]
    if locks and all(lock.locktype == "advisory" for lock in locks):
        shape, fix = "advisory locks in opposite order", _ADVISORY
    elif any(lock.locktype == "relation" for lock in locks):
        shape, fix = "a table lock against row locks", _relation_fix(locks, tables)
    elif len(set(rows)) <= 1 and all(_upgrades(wait) or row_of(wait.lock) for wait in cycle):
        shape, fix = "a shared lock upgraded", _UPGRADE
    elif any(_inserts(wait) for wait in cycle):
        shape, fix = "the same unique key inserted", _UNIQUE
    elif parents:
        shape, fix = (
            "a foreign key's share lock against a parent change",
            _foreign_fix(parents, facts),
        )
    elif rows:
        shape, fix = "rows in opposite order", _rows_fix(tables, facts)
    else:
        shape, fix = "locks in opposite order", _ANY_ORDER
    return Advice(shape, tuple(_steps(cycle, facts)), fix, tuple(evidence), len(cycle))


def _inserts(wait: Wait) -> bool:
    """A wait of an INSERT for another transaction, on no row: a unique index's key check."""
    lock = wait.lock
    return bool(
        lock
        and lock.locktype == "transactionid"
        and row_of(lock) is None
        and _INSERT.match(wait.query)
    )


def _upgrades(wait: Wait) -> bool:
    """A change waiting for a transaction with no tuple lock: a lock upgrade.

    PostgreSQL skips the tuple lock when the waiter already shares a lock on the row.
    """
    lock = wait.lock
    return bool(
        lock
        and lock.locktype == "transactionid"
        and row_of(lock) is None
        and not _INSERT.match(wait.query)
    )


def _steps(cycle: Sequence[Wait], facts: Facts) -> list[str]:
    """Per job of the cycle: what it held (what the next one waits for), then what it awaited."""
    held = {wait.holder_pid: wait for wait in cycle}
    steps = []
    for wait in cycle:
        theirs, wanted = held.get(wait.pid), wait.lock
        mine = theirs.lock if theirs is not None else None
        same_row = mine is not None and row_of(mine) is not None and row_of(mine) == row_of(wanted)
        if same_row or _upgrades(wait):
            row = _thing(wanted, facts) if row_of(wanted) else "the row it changes"
            steps.append(
                f"{wait.job} (pid {wait.pid}) held a shared lock on {row}, then waited to "
                f"lock it exclusively: {wait.query}"
            )
            continue
        if _inserts(wait):
            steps.append(
                f"{wait.job} (pid {wait.pid}) inserted a key that {wait.holder_job} went on to "
                f"insert too, then waited for {wait.holder_job}'s uncommitted insert of the "
                f"same key: {wait.query}"
            )
            continue
        before = _thing(mine, facts) if mine is not None else "a lock"
        if mine is not None and mine.locktype == "relation":  # held: a mode in conflict
            before = f"table {mine.relation} (a lock in conflict with {mine.mode})"
        steps.append(
            f"{wait.job} (pid {wait.pid}) locked {before}, then waited for "
            f"{_thing(wanted, facts)}: {wait.query}"
        )
    return steps


def _thing(lock: Lock | None, facts: Facts) -> str:
    """A lock as what it protects: ``accounts id=2``, ``advisory lock 1``, ``table parents``."""
    if lock is None:
        return "a lock"
    row = row_of(lock)
    if row is not None:
        return f"{row[0]} {facts.keys.get(row, f'row {row[1]}')}"
    if lock.locktype == "advisory":
        return f"advisory lock {lock.ident}"
    if lock.locktype == "relation":
        return f"table {lock.relation} ({lock.mode})"
    return lock.describe()


def _rows_fix(tables: list[str], facts: Facts) -> str:
    parts = []
    # S608: the SQL below is advice printed for a person, never run.
    for table in tables:
        columns = facts.columns.get(table) or ("<key>",)
        order = ", ".join(columns)
        parts.append(
            f"lock {table} rows in ascending {order} in every job "  # noqa: S608
            f"(`SELECT ... FROM {table} WHERE ... ORDER BY {order} FOR UPDATE` first, "
            "then change them)"
        )
    also = (
        "; and the tables in one order (" + ", then ".join(tables) + ")" if len(tables) > 1 else ""
    )
    return "; ".join(parts) + also


def _foreign_fix(parents: list[tuple[int, str, str]], facts: Facts) -> str:
    _, child, parent = parents[0]
    order = ", ".join(facts.columns.get(parent) or ("<key>",))
    return (
        f"an insert into {child} takes FOR KEY SHARE on its {parent} row (the foreign key "  # noqa: S608 - printed
        f"check), which a change of that {parent} row must wait for: lock the {parent} rows "
        f"first, in ascending {order}, in every job, before inserting into {child} or "
        f"changing {parent} (`SELECT ... FROM {parent} WHERE ... ORDER BY {order} FOR UPDATE`)"
    )


def _relation_fix(locks: list[Lock], tables: list[str]) -> str:
    relations = list(dict.fromkeys(lock.relation for lock in locks if lock.relation))
    touched = ", ".join(dict.fromkeys([*tables, *relations])) or "the tables"
    return (
        "a table lock (LOCK TABLE, or DDL such as a migration's ALTER TABLE) taken while "
        "the other job holds rows: take the table locks first, in one order, at the start of "
        f"the transaction (`LOCK TABLE {touched}` before anything else), or run the "
        "migration when the job cannot run (under the job's jobrun --key), with a "
        "lock_timeout so it gives up instead of blocking"
    )


_ADVISORY = (
    "take advisory locks in ascending key order in every job "
    "(`pg_advisory_xact_lock(1)` before `pg_advisory_xact_lock(2)`), or one advisory lock "
    "for the whole set"
)
_UPGRADE = (
    "both jobs took a shared lock on the same row (FOR SHARE, FOR KEY SHARE) and then "
    "wanted to change it; neither can while the other shares it: take the strong lock at "
    "once where the row will be changed (`SELECT ... FOR UPDATE`, or FOR NO KEY UPDATE, "
    "instead of FOR SHARE)"
)
_UNIQUE = (
    "both jobs insert the same unique keys in different orders, each waiting for the "
    "other's uncommitted insert: insert in ascending key order in every job (sort the batch), "
    "or lock a parent row first; `INSERT ... ON CONFLICT` still waits, in the same order"
)
_ANY_ORDER = "the jobs take the same locks in different orders: take them in one order in every job"
