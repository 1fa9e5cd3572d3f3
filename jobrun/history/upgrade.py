"""Bring a large history up to date without holding runs up: indexes, then the summary.

This is also the explicit upgrade command: it runs the schema's numbered steps first
(jobrun/sql/schema.py, as a run's first use and ``jobrun init`` do). Step 1 builds the
history's indexes and fills its summary (``jobrun.run_keys``) only while ``jobrun.runs`` is
small: on a large table a plain ``CREATE INDEX`` blocks every run's writes for as long as
it takes. This does the rest, each in a transaction of its own (or none):

1. the schema's steps (tables, columns, functions, triggers: from now on every change
   keeps the summary row of its key up to date), and the version row;
2. each missing index with ``CREATE INDEX CONCURRENTLY`` (an invalid one, left by an
   interrupted build, is dropped first), which lets runs write meanwhile;
3. a summary row for every key that has none yet, a batch of keys per transaction (a run
   writing the same key waits for one batch at most), then the summary is marked complete:
   ``status`` reads it from then on.

Run it as the tables' owner: ``python -m jobrun.history.upgrade [DSN]`` (else
``JOBRUN_DSN``). Safe to repeat and to interrupt: each step looks before it acts.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

import psycopg

from jobrun.history import schema
from jobrun.sql import schema as schema_sql
from jobrun.sql.session import SEARCH_PATH

if TYPE_CHECKING:
    from collections.abc import Callable

    Connection = psycopg.Connection[Any]

#: Keys whose summary rows one transaction of the backfill makes.
BACKFILL_KEYS = 50

#: Whether an index exists, and whether it is valid (an interrupted concurrent build
#: leaves an invalid one behind: dropped and built again).
_INDEX_STATE = """
SELECT i.indisvalid FROM pg_catalog.pg_class AS c
JOIN pg_catalog.pg_namespace AS n ON n.oid = c.relnamespace
JOIN pg_catalog.pg_index AS i ON i.indexrelid = c.oid
WHERE n.nspname = 'jobrun' AND c.relname = %s
"""

_BACKFILL_BATCH = f"""
SELECT pg_catalog.count(jobrun.run_keys_refresh(m.key, 0, 0)) FROM (
    SELECT k.key FROM ({schema_sql.RUNS_KEYS}) AS k
    WHERE NOT EXISTS (SELECT 1 FROM jobrun.run_keys AS s WHERE s.key = k.key)
    LIMIT {BACKFILL_KEYS}
) AS m
"""  # noqa: S608 - constants only


def upgrade(conn: Connection, say: Callable[[str], None] = print) -> dict[str, float]:
    """Every step on ``conn`` (autocommit); the seconds each step took, by name."""
    took: dict[str, float] = {}
    conn.autocommit = True
    conn.execute(
        "SET statement_timeout = 0; SET lock_timeout = 0; "
        f"SET search_path = {SEARCH_PATH}; SET jit = off"
    )
    start = time.monotonic()
    version, _ = schema.ensure(conn, timeout_ms=0)  # 0: no statement timeout
    took["schema"] = time.monotonic() - start
    say(f"schema: version {version}")
    # Then the indexes step 1 left out on a large table (they name its later columns), and
    # the summary's backfill, which reads through them.
    for name, definition in schema_sql.RUNS_INDEXES:
        row = conn.execute(_INDEX_STATE, (name,)).fetchone()
        if row is not None and row[0]:
            continue
        start = time.monotonic()
        if row is not None:
            say(f"dropping the invalid index jobrun.{name} (an interrupted build)")
            conn.execute(f"DROP INDEX CONCURRENTLY IF EXISTS jobrun.{name}")
        say(f"building jobrun.{name} concurrently")
        conn.execute(f"CREATE INDEX CONCURRENTLY IF NOT EXISTS {name} ON jobrun.runs {definition}")
        took[name] = time.monotonic() - start
    start = time.monotonic()
    made = 0
    while True:
        row = conn.execute(_BACKFILL_BATCH).fetchone()
        count = int(row[0]) if row else 0
        if not count:
            break
        made += count
    conn.execute(schema_sql.SUMMARY_MARK_COMPLETE)
    took["summary"] = time.monotonic() - start
    say(f"summary: {made} key(s) filled in; complete")
    return took


def main(argv: list[str] | None = None) -> int:
    """``python -m jobrun.history.upgrade [DSN]``."""
    args = sys.argv[1:] if argv is None else argv
    dsn = args[0] if args else os.environ.get("JOBRUN_DSN", "")
    try:
        with psycopg.connect(dsn, autocommit=True, application_name="jobrun:upgrade") as conn:
            took = upgrade(conn)
    except schema.SchemaTooNew as exc:
        sys.stderr.write(f"jobrun: {exc} (reason {exc.reason})\n")
        return exc.exit_code
    for step, seconds in took.items():
        sys.stdout.write(f"{step}: {seconds:.1f} s\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
