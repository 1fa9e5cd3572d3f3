"""How often ``jobrun overlap`` reproduces a deadlock: figures per scenario, not a test.

Each scenario is a pair of small psycopg jobs (harness/overlap_scenarios.py) with
0.3 s of work between their statements: six that can deadlock (opposite row order; a
job that works 1.5 s before its first statement; a foreign key's key-share lock against
a change of the parent; FOR SHARE upgraded to UPDATE; advisory locks in opposite order;
a read before the locks in both jobs)
and their lock-ordering fixes plus two jobs that share nothing, which must never deadlock.
Each runs ``python -m jobrun overlap --runs N --json`` against a private server (or
--dsn), and the table shows the share of attempts that deadlocked and the first one that
did. Usage::

    .venv/bin/python benchmarks/bench_overlap.py [--runs 20] [--start hold] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _path  # noqa: F401  (first: the root on sys.path, for harness/)

from harness.overlap_scenarios import SCENARIOS, create_schema, drop_schema
from harness.pgserver import PgServer

ROOT = Path(__file__).resolve().parent.parent

if TYPE_CHECKING:
    from collections.abc import Iterator

    from harness.overlap_scenarios import Scenario


def overlap(dsn: str, scenario: Scenario, runs: int, start: str, order: str) -> dict[str, Any]:
    """One ``jobrun overlap`` of ``scenario``: its --json report."""
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    create_schema(dsn, schema)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBRUN_", "PGAPPNAME"))}
    try:
        result = subprocess.run(
            [sys.executable, "-m", "jobrun", "overlap", "--dsn", dsn, "--json",
             "--runs", str(runs), "--start", start, "--order", order, "--timeout", "60s",
             "--first", scenario.command(dsn, schema, "A"),
             "--second", scenario.command(dsn, schema, "B")],
            capture_output=True, text=True, env=env, check=False,
        )  # fmt: skip
    finally:
        drop_schema(dsn, schema)
    if result.returncode not in (0, 1):
        msg = f"jobrun overlap exited {result.returncode}: {result.stderr.strip()}"
        raise RuntimeError(msg)
    report: dict[str, Any] = json.loads(result.stdout)
    return report


@contextlib.contextmanager
def database(dsn: str | None) -> Iterator[str]:
    """``dsn``, or a private server's for the benchmark's duration."""
    if dsn:
        yield dsn
        return
    with PgServer.start() as server:
        yield server.dsn()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=20, help="attempts per scenario")
    parser.add_argument("--start", default="hold", help="jobrun overlap --start")
    parser.add_argument("--order", default="alternate", help="jobrun overlap --order")
    parser.add_argument("--dsn", help="an existing server (default: a private one)")
    parser.add_argument("--only", help="run only the scenarios whose name contains this")
    args = parser.parse_args()
    scenarios = [s for s in SCENARIOS if not args.only or args.only in s.name]
    print(
        f"# {dt.datetime.now(dt.timezone.utc):%Y-%m-%d %H:%M} UTC, {platform.node()}, "
        f"{os.cpu_count()} CPUs, load {os.getloadavg()[0]:.1f}; "
        f"--runs {args.runs} --start {args.start} --order {args.order}"
    )
    print(f"| {'scenario':<56} | can deadlock | {'deadlocked':<12} | first | unclean |")
    print(f"|{'-' * 58}|--------------|{'-' * 14}|-------|---------|")
    totals = {True: [0, 0], False: [0, 0]}
    with database(args.dsn) as dsn:
        for scenario in scenarios:
            report = overlap(dsn, scenario, args.runs, args.start, args.order)
            found = report["deadlocks"] + report["cycles_without_deadlock_error"]
            attempts = report["attempts_run"]
            unclean = report["timeouts"] + report["failed"] + report["server_timeouts"]
            totals[scenario.deadlocks][0] += found
            totals[scenario.deadlocks][1] += attempts
            first = report["first_deadlock"] or "-"
            print(
                f"| {scenario.name:<56} | {'yes' if scenario.deadlocks else 'no':<12} | "
                f"{found:>3}/{attempts:<3} {found / attempts:>4.0%} | {first!s:>5} | "
                f"{unclean:>7} |",
                flush=True,
            )
    for positive, (found, attempts) in totals.items():
        if attempts:
            kind = "can deadlock" if positive else "must not deadlock"
            print(
                f"overall, {kind}: {found}/{attempts} attempts deadlocked ({found / attempts:.0%})"
            )


if __name__ == "__main__":
    main()
