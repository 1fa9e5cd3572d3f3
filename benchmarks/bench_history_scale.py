"""Every command against a history of a given size: server and wall time, owner and granted.

For each size, a database of its own (``jobrun_scale_bench_<keys>_<rows>``, dropped at the
end unless ``--keep-db``) gets jobrun's schema (the first run of the jobrun under test),
then ``rows`` history rows in ONE ``INSERT ... SELECT generate_series`` (with the
history's triggers off: the summary is filled by the upgrade after, as it would be for a
history written by an older version): ``keys`` keys (``k-0`` ...), each with runs from three
hosts, every fourth row a skip behind a holder (the run before it), one run in 17 failed,
one every 5 minutes back from now. Then the upgrade (timed: its concurrent index builds and
the summary's backfill), ``VACUUM ANALYZE``, ``jobrun init`` and a role granted ``k-1*``.

The run and the skip keep every row (``--keep 100000000``: a history kept on purpose, the
run path alone); "catching up" is a run with the default ``--keep 100`` under a larger
history, which also deletes its batch of the oldest rows. Each command is run ``--repeat``
times as the owner and as the granted role: wall time of the process, and server time as
``pg_stat_database.active_time`` of the database over the command (every statement of every
session, the command's own only: the database is private). Median of the repeats, in ms.

    python benchmarks/bench_history_scale.py --dsn 'host=127.0.0.1 user=postgres' \\
        --sizes 0,1000000,10000000 [--keys 500] [--repeat 3] [--python .venv/bin/python]

``--python`` runs another jobrun (an older checkout's venv: its schema, its statements); the
upgrade then runs only where that jobrun has it (``jobrun.history.upgrade``).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

import psycopg
from psycopg import sql

GRANTED = "jobrun_bench_granted"
PATTERN = "k-1*"
#: The key ``status KEY``, the run and the skip use (granted to the role by PATTERN).
KEY = "k-1"

FILL = """
INSERT INTO jobrun.runs
    (run_id, key, lock_ids, mode, host, pid, child_pid, program, started_at, finished_at,
     outcome, reason, exit_code, signal, duration, streak, streak_since, holder_ref, holder,
     alerted_at, deadlocks)
SELECT gen_random_uuid(), k.key, ARRAY[k.lock_id], 'session', 'host-' || (j %% 3),
       1000 + j %% 30000, CASE WHEN j %% 4 <> 3 THEN 2000 + j %% 30000 END, 'bench',
       t.at, t.at + make_interval(secs => t.took),
       CASE WHEN j %% 4 = 3 THEN 'skipped' WHEN j %% 17 = 0 THEN 'failed' ELSE 'succeeded' END,
       CASE WHEN j %% 4 = 3 THEN 'locked' END,
       CASE WHEN j %% 4 = 3 THEN 75 WHEN j %% 17 = 0 THEN 1 ELSE 0 END, NULL, t.took,
       CASE WHEN j %% 4 = 3 OR j %% 17 = 0 THEN 1 ELSE 0 END,
       CASE WHEN j %% 4 = 3 OR j %% 17 = 0 THEN t.at END,
       CASE WHEN j %% 4 = 3 THEN 'run-' || p.n || '-' || (j - 1) END,
       CASE WHEN j %% 4 = 3 THEN jsonb_build_object('holder_host', 'host-' || ((j - 1) %% 3),
                                                  'holder_pid', 1000 + (j - 1) %% 30000) END,
       NULL, 0
FROM generate_series(0, %(rows)s - 1) AS i,
     LATERAL (SELECT i %% %(keys)s AS n, i / %(keys)s AS j) AS p,
     LATERAL (SELECT 'k-' || p.n AS key,
                     ('x' || left(encode(sha256(convert_to('k-' || p.n, 'UTF8')), 'hex'), 16))
                         ::bit(64)::bigint AS lock_id) AS k,
     LATERAL (SELECT clock_timestamp() - make_interval(
                         mins => 5 * (%(per_key)s - p.j)) AS at,
                     1 + (p.j %% 29)::float8 AS took) AS t
"""

COMMANDS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("status", ("status",)),
    ("status --check", ("status", "--check")),
    ("status KEY", ("status", KEY)),
    # The history kept on purpose (nothing to prune): the run path alone.
    ("a run", ("--key", KEY, "--keep", "100000000", "--", "true")),
    ("a skip", ("--key", KEY, "--keep", "100000000", "--", "true")),
    # The default --keep 100 under a larger history: each run also deletes a batch.
    ("a run catching up (--keep 100)", ("--key", KEY, "--", "true")),
)


def main() -> int:
    """Fill, upgrade and time each size; print one markdown table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--dsn", default="host=127.0.0.1 port=5432 user=postgres")
    parser.add_argument("--sizes", default="0,1000000,10000000")
    parser.add_argument("--keys", type=int, default=500)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--keep-db", action="store_true")
    args = parser.parse_args()
    sizes = [int(size) for size in args.sizes.split(",")]
    header = (
        "| operation (wall / server ms) | "
        + " | ".join(f"{size:,} rows, {args.keys:,} keys" for size in sizes)
        + " |"
    )
    results: dict[str, list[str]] = {}
    notes: list[str] = []
    for size in sizes:
        for name, cell in bench_size(args, size, notes).items():
            results.setdefault(name, []).append(cell)
    print()
    print(header)
    print("|---" * (len(sizes) + 1) + "|")
    for name, cells in results.items():
        print(f"| {name} | " + " | ".join(cells) + " |")
    for note in notes:
        print(f"- {note}")
    return 0


def bench_size(args: argparse.Namespace, rows: int, notes: list[str]) -> dict[str, str]:
    """Every command against a history of ``rows`` rows: each cell, by row name."""
    name = f"jobrun_scale_bench_{args.keys}_{rows}"
    admin = psycopg.connect(args.dsn, autocommit=True)
    admin.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name)))
    admin.execute(sql.SQL("CREATE DATABASE {}").format(sql.Identifier(name)))
    with contextlib.suppress(psycopg.errors.DuplicateObject):
        admin.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(GRANTED)))
    owner_dsn = f"{args.dsn} dbname={name}"
    granted_dsn = f"{owner_dsn} user={GRANTED}"
    cells: dict[str, str] = {}
    try:
        jobrun(args, owner_dsn, "--key", "bench-schema", "--", "true")
        db = psycopg.connect(owner_dsn, autocommit=True)
        summary = db.execute("SELECT to_regclass('jobrun.run_keys') IS NOT NULL").fetchone()
        has_summary = bool(summary and summary[0])
        if has_summary:
            db.execute("DELETE FROM jobrun.runs")
            for index in _new_indexes(db):  # as a history of an older version has them
                db.execute(sql.SQL("DROP INDEX jobrun.{}").format(sql.Identifier(index)))
            db.execute("COMMENT ON TABLE jobrun.run_keys IS NULL")
        if rows:
            start = time.monotonic()
            with db.transaction():
                db.execute("SET LOCAL session_replication_role = replica")  # no triggers
                db.execute(
                    FILL, {"rows": rows, "keys": args.keys, "per_key": rows // args.keys + 1}
                )
            notes.append(f"{rows:,} rows: filled in {time.monotonic() - start:.0f} s")
        if has_summary:
            start = time.monotonic()
            upgraded = subprocess.run(
                [args.python, "-m", "jobrun.history.upgrade", owner_dsn],
                capture_output=True,
                text=True,
                check=True,
                cwd=tempfile.gettempdir(),
            )
            steps = " ".join(line for line in upgraded.stdout.splitlines() if ": " in line)
            notes.append(f"{rows:,} rows: upgrade took {time.monotonic() - start:.0f} s ({steps})")
        db.execute("VACUUM ANALYZE jobrun.runs")
        size = db.execute("SELECT pg_size_pretty(pg_total_relation_size('jobrun.runs'))")
        notes.append(f"{rows:,} rows: jobrun.runs and its indexes take {size.fetchone()[0]}")
        jobrun(args, owner_dsn, "init")
        jobrun(args, owner_dsn, "grant", GRANTED, "--keys", PATTERN)
        for label, command in COMMANDS:
            for who, dsn in (("owner", owner_dsn), ("granted", granted_dsn)):
                cells[f"{label}, {who}"] = measure(args, db, dsn, label, command)
        failed = db.execute(
            "SELECT count(*) FROM jobrun.runs WHERE key = %s AND outcome = 'running'", (KEY,)
        ).fetchone()
        if failed and failed[0]:
            notes.append(f"{rows:,} rows: {failed[0]} run(s) left running")
        db.close()
    finally:
        if not args.keep_db:
            admin.execute(
                sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(sql.Identifier(name))
            )
        admin.close()
    return cells


def _new_indexes(db: psycopg.Connection[Any]) -> list[str]:
    """The history's indexes beyond the first two (those an older version made)."""
    rows = db.execute(
        "SELECT c.relname FROM pg_class AS c JOIN pg_index AS i ON i.indexrelid = c.oid "
        "WHERE i.indrelid = 'jobrun.runs'::regclass AND NOT i.indisprimary "
        "AND c.relname NOT IN ('runs_key_started_at', 'runs_running_lock_ids')"
    ).fetchall()
    return [str(row[0]) for row in rows]


def measure(
    args: argparse.Namespace,
    db: psycopg.Connection[Any],
    dsn: str,
    label: str,
    command: tuple[str, ...],
) -> str:
    """``wall / server`` ms (medians) of ``command`` as the role of ``dsn``."""
    walls: list[float] = []
    servers: list[float] = []
    codes: set[int] = set()
    failures = 0
    for _ in range(args.repeat):
        holder = None
        if label == "a skip":  # the key is held by a session of our own: every try skips
            holder = psycopg.connect(args.dsn + f" dbname={db.info.dbname}", autocommit=True)
            holder.execute(
                "SELECT pg_advisory_lock(('x' || left(encode(sha256(convert_to("
                "%s, 'UTF8')), 'hex'), 16))::bit(64)::bigint)",
                (KEY,),
            )
        before = active_time(db)
        start = time.monotonic()
        done = jobrun(args, dsn, *command, check=False)
        walls.append((time.monotonic() - start) * 1000)
        if holder is not None:
            holder.close()
        time.sleep(0.6)  # every session of the command has gone and reported
        servers.append(active_time(db) - before)
        codes.add(done.returncode)
        failures += done.stderr.count("history_failed")
    cell = f"{statistics.median(walls):,.0f} / {statistics.median(servers):,.0f}"
    odd = sorted(code for code in codes if code not in (0, 1, 75))
    if odd or failures:
        cell += f" (exit {odd}, history_failed {failures})"
    return cell


def active_time(db: psycopg.Connection[Any]) -> float:
    """Milliseconds the database's sessions spent running statements, so far."""
    db.execute("SELECT pg_stat_clear_snapshot()")
    row = db.execute(
        "SELECT active_time FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()
    return float(row[0]) if row and row[0] is not None else 0.0


def jobrun(
    args: argparse.Namespace, dsn: str, *argv: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """One jobrun command of the jobrun under test."""
    env = {**os.environ, "JOBRUN_DSN": dsn}
    done = subprocess.run(
        [args.python, "-m", "jobrun", *argv],
        capture_output=True,
        text=True,
        env=env,
        check=False,
        cwd=tempfile.gettempdir(),  # not a checkout: the jobrun of --python's environment
    )
    if check and done.returncode != 0:
        raise SystemExit(f"jobrun {' '.join(argv)}: exit {done.returncode}: {done.stderr}")
    return done


if __name__ == "__main__":
    sys.exit(main())
