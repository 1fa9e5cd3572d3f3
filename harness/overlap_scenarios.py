"""Pairs of small psycopg jobs that deadlock when they overlap, and their lock-ordering fixes."""

from __future__ import annotations

import shlex
import sys
from dataclasses import dataclass

import psycopg

#: Seconds of work between two statements of a job, as in a real job (a computation, a call).
GAP = 0.3
#: Seconds of work a slow job does before its first statement (imports, a file, an API).
SLOW_START = 1.5

#: The job: ``python -c JOB DSN SCHEMA SLOW MODE STATEMENT...``. It sleeps SLOW seconds, then
#: runs the statements with GAP seconds between them: in one transaction that it commits,
#: or each on its own with MODE ``autocommit``. ``{s}`` in
#: a statement is the scenario's schema. A deadlock error ends it with exit 1 and the error.
JOB = f"""
import sys, time
import psycopg

dsn, schema, slow, autocommit, *statements = sys.argv[1:]
time.sleep(float(slow))
with psycopg.connect(dsn, autocommit=autocommit == "autocommit") as conn:
    for i, statement in enumerate(statements):
        if i:
            time.sleep({GAP})
        conn.execute(statement.format(s=schema))
"""

#: Tables every scenario uses, in a schema of its own.
SCHEMA = """
CREATE SCHEMA {s};
CREATE TABLE {s}.accounts (id int PRIMARY KEY, balance int NOT NULL DEFAULT 0);
INSERT INTO {s}.accounts (id) SELECT generate_series(1, 4);
CREATE TABLE {s}.parents (id int PRIMARY KEY, note text);
INSERT INTO {s}.parents (id) VALUES (1), (2);
CREATE TABLE {s}.children (id serial PRIMARY KEY, parent_id int NOT NULL REFERENCES {s}.parents);
CREATE TABLE {s}.codes (code int PRIMARY KEY);
"""


def _update(row: int) -> str:
    return f"UPDATE {{s}}.accounts SET balance = balance + 1 WHERE id = {row}"  # noqa: S608


def _advisory(key: int) -> str:
    return f"SELECT pg_advisory_xact_lock({key})"


_READ = "SELECT sum(balance) FROM {s}.accounts"
_INSERT_CHILD = "INSERT INTO {s}.children (parent_id) VALUES (1)"
_TOUCH_PARENT_2 = "UPDATE {s}.parents SET note = 'touched' WHERE id = 2"
_LOCK_PARENT_1 = "SELECT * FROM {s}.parents WHERE id = 1 FOR UPDATE"
_CHANGE_PARENT_1 = "UPDATE {s}.parents SET note = 'changed' WHERE id = 1"
#: A migration's table lock (what ALTER TABLE takes), and a job's read of that table.
_LOCK_PARENTS = "LOCK TABLE {s}.parents IN ACCESS EXCLUSIVE MODE"
_READ_PARENTS = "SELECT count(*) FROM {s}.parents"


def _insert_code(code: int) -> str:
    return f"INSERT INTO {{s}}.codes VALUES ({code})"  # noqa: S608


@dataclass(frozen=True)
class Scenario:
    """Two jobs (their statements, and how slowly each starts) and whether they can deadlock."""

    name: str
    first: tuple[str, ...]
    second: tuple[str, ...]
    deadlocks: bool
    first_slow: float = 0.0
    second_slow: float = 0.0
    #: Each statement on its own (no transaction around them), as jobs that take
    #: session-level advisory locks often do.
    autocommit: bool = False

    def command(self, dsn: str, schema: str, job: str) -> str:
        """The ``--first`` / ``--second`` text of ``job`` (A or B)."""
        statements, slow = (
            (self.first, self.first_slow) if job == "A" else (self.second, self.second_slow)
        )
        mode = "autocommit" if self.autocommit else "transaction"
        return shlex.join([sys.executable, "-c", JOB, dsn, schema, str(slow), mode, *statements])


SCENARIOS = (
    Scenario(
        "opposite row order", (_update(1), _update(2)), (_update(2), _update(1)), deadlocks=True
    ),
    Scenario(
        "slow start (A works 1.5 s first)",
        (_update(1), _update(2)),
        (_update(2), _update(1)),
        deadlocks=True,
        first_slow=SLOW_START,
    ),
    Scenario(
        "foreign key: child's key-share lock vs parent change",
        (_INSERT_CHILD, _TOUCH_PARENT_2),
        (_TOUCH_PARENT_2, _LOCK_PARENT_1, _CHANGE_PARENT_1),
        deadlocks=True,
    ),
    Scenario(
        "lock upgrade: FOR SHARE, then UPDATE",
        ("SELECT * FROM {s}.accounts WHERE id = 1 FOR SHARE", _update(1)),
        ("SELECT * FROM {s}.accounts WHERE id = 1 FOR SHARE", _update(1)),
        deadlocks=True,
    ),
    Scenario(
        "advisory locks in opposite order",
        (_advisory(1), _advisory(2)),
        (_advisory(2), _advisory(1)),
        deadlocks=True,
    ),
    Scenario(
        "session advisory locks, opposite order, autocommit",
        ("SELECT pg_advisory_lock(1)", "SELECT pg_advisory_lock(2)"),
        ("SELECT pg_advisory_lock(2)", "SELECT pg_advisory_lock(1)"),
        deadlocks=True,
        autocommit=True,
    ),
    Scenario(
        "a read before the locks, in both jobs",
        (_READ, _update(1), _update(2)),
        (_READ, _update(2), _update(1)),
        deadlocks=True,
    ),
    Scenario(
        "unique keys inserted in opposite order",
        (_insert_code(1), _insert_code(2)),
        (_insert_code(2), _insert_code(1)),
        deadlocks=True,
    ),
    Scenario(
        "table lock (a migration) against row locks",
        (_update(1), _READ_PARENTS),
        (_LOCK_PARENTS, _update(1)),
        deadlocks=True,
    ),
    Scenario(
        "fixed: same row order", (_update(1), _update(2)), (_update(1), _update(2)), deadlocks=False
    ),
    Scenario(
        "fixed: slow start, same row order",
        (_update(1), _update(2)),
        (_update(1), _update(2)),
        deadlocks=False,
        first_slow=SLOW_START,
    ),
    Scenario(
        "fixed: parent locked first",
        (_INSERT_CHILD, _TOUCH_PARENT_2),
        (_LOCK_PARENT_1, _TOUCH_PARENT_2, _CHANGE_PARENT_1),
        deadlocks=False,
    ),
    Scenario(
        "fixed: FOR UPDATE instead of FOR SHARE",
        ("SELECT * FROM {s}.accounts WHERE id = 1 FOR UPDATE", _update(1)),
        ("SELECT * FROM {s}.accounts WHERE id = 1 FOR UPDATE", _update(1)),
        deadlocks=False,
    ),
    Scenario(
        "fixed: advisory locks in one order",
        (_advisory(1), _advisory(2)),
        (_advisory(1), _advisory(2)),
        deadlocks=False,
    ),
    Scenario(
        "fixed: session advisory locks in one order",
        ("SELECT pg_advisory_lock(1)", "SELECT pg_advisory_lock(2)"),
        ("SELECT pg_advisory_lock(1)", "SELECT pg_advisory_lock(2)"),
        deadlocks=False,
        autocommit=True,
    ),
    Scenario(
        "fixed: unique keys in one order",
        (_insert_code(1), _insert_code(2)),
        (_insert_code(1), _insert_code(2)),
        deadlocks=False,
    ),
    Scenario(
        "fixed: the migration takes its table locks first",
        (_update(1), _READ_PARENTS),
        ("LOCK TABLE {s}.accounts, {s}.parents IN ACCESS EXCLUSIVE MODE", _update(1)),
        deadlocks=False,
    ),
    Scenario("nothing shared", (_update(1), _update(2)), (_update(3), _update(4)), deadlocks=False),
)


def create_schema(dsn: str, schema: str) -> None:
    """The scenarios' tables, in ``schema`` (new)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(SCHEMA.format(s=schema).encode())


def drop_schema(dsn: str, schema: str) -> None:
    """Remove what create_schema made."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(f"DROP SCHEMA {schema} CASCADE".encode())
