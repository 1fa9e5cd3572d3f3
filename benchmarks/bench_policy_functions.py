"""What making the policy functions search_path-proof costs: qualified bodies vs SET search_path.

``jobrun init``'s functions (allowed, ids_fit, lock_id) run for every row row-level security
checks. Two ways make their bodies immune to a caller's search_path: every operator and
function schema-qualified (what jobrun does), or a ``SET search_path`` clause on each
function. This installs both side by side in a throwaway database and times, in the same
server session, N calls of each: ``allowed`` (a grant lookup) and ``ids_fit`` (a lease row's
check, which derives up to 257 lock ids per key). The figure to read is the ratio.

Usage::

    .venv/bin/python benchmarks/bench_policy_functions.py [--dsn DSN] [--calls 300]

Without ``--dsn`` (or ``JOBRUN_TEST_DSN``) it starts a private server.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import time
import uuid

import _path  # noqa: F401  (first: the root on sys.path, for harness/)
import psycopg
from psycopg.conninfo import make_conninfo

from harness.pgserver import PgServer
from harness.pgtools import create_database, drop_database
from jobrun.history import schema as jobrun_schema
from jobrun.sql import tenants

#: The SET-clause twin of a function: the same body, pinned instead of qualified.
_PINNED = " SET search_path = pg_catalog, pg_temp AS $$"


def pinned_twins(functions: str) -> str:
    """``functions`` recreated in schema ``pinned`` with a SET clause each (and unqualified)."""
    twins = functions.replace("jobrun.", "pinned.")
    twins = re.sub(r"OPERATOR\(pg_catalog\.([^)]+)\)", r"\1", twins)
    twins = twins.replace("pg_catalog.", "")
    return re.sub(r" AS \$\$", _PINNED, twins)


def timed(conn: psycopg.Connection[tuple[object, ...]], statement: str, rounds: int = 5) -> float:
    """Median seconds of ``statement`` over ``rounds`` runs."""
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        conn.execute(statement)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(dsn: str, calls: int) -> None:
    """Install both variants in a fresh database and print the per-call times."""
    name = f"jobrun_bench_{uuid.uuid4().hex[:8]}"
    create_database(dsn, name)
    try:
        with psycopg.connect(make_conninfo(dsn, dbname=name), autocommit=True) as conn:
            jobrun_schema.ensure(conn)  # the tables: INIT adds the protections only
            conn.execute(tenants.INIT)
            conn.execute("CREATE SCHEMA pinned")
            conn.execute("CREATE TABLE pinned.grants (LIKE jobrun.grants)")
            conn.execute("CREATE TABLE pinned.runs (LIKE jobrun.runs)")
            conn.execute("INSERT INTO jobrun.grants VALUES (current_user, 'job', 'a-*', 'a-%')")
            conn.execute("INSERT INTO pinned.grants SELECT * FROM jobrun.grants")
            conn.execute(pinned_twins(tenants.FUNCTIONS))
            # Each call's input varies with the row (g): a constant one would be folded
            # into one call for the whole statement.
            cases = {
                "allowed (a grant lookup)": "{s}.allowed('a-' || g, 'run')",
                "ids_fit (the key's own id)": (
                    "{s}.ids_fit('a-' || g, ARRAY[{s}.lock_id('a-' || g)])"
                ),
                "ids_fit (slot 200's id)": (
                    "{s}.ids_fit('a-' || g, ARRAY[{s}.lock_id('a-' || g || E'\\nslot 200')])"
                ),
            }
            print(f"| call ({calls} per round) | qualified µs | SET search_path µs | ratio |")
            print("|---|---|---|---|")
            for label, call in cases.items():
                each = {}
                for schema in ("jobrun", "pinned"):
                    expression = call.format(s=schema)
                    statement = (
                        f"SELECT count(*) FROM generate_series(1, {calls}) AS g "  # noqa: S608
                        f"WHERE {expression}"
                    )
                    conn.execute(statement)  # warm up
                    each[schema] = timed(conn, statement) / calls * 1e6
                ratio = each["pinned"] / each["jobrun"]
                print(f"| {label} | {each['jobrun']:.1f} | {each['pinned']:.1f} | {ratio:.2f} |")
    finally:
        drop_database(dsn, name)


def main() -> None:
    """Parse the arguments; measure against the given server or a private one."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dsn", default=os.environ.get("JOBRUN_TEST_DSN"))
    parser.add_argument("--calls", type=int, default=300)
    args = parser.parse_args()
    with contextlib.ExitStack() as stack:
        dsn = args.dsn or stack.enter_context(PgServer.start()).dsn()
        measure(dsn, args.calls)


if __name__ == "__main__":
    main()
