"""A herd: N jobruns of one key released at one instant against a server with few slots.

Starts a private PostgreSQL with ``max_connections = 20`` (3 of them reserved for the
superuser that watches pg_stat_activity), preloads N ``python -m jobrun --key K -- JOB``
processes that all block on one pipe, closes the pipe so they start together, and prints,
per mode and history setting: how many ran, skipped (75), exited 69 or otherwise, how many
``history_failed`` lines they wrote, the peak number of client sessions on the server, and
the wall time until the last one exited. The target: one run, every other one 75, no 69,
no history_failed. JOB lasts until every other run has exited (on a loaded machine a
herd takes longer to arrive than any fixed sleep). Figures, not a test::

    .venv/bin/python benchmarks/bench_herd.py [--runs 60 200] [--modes session lease]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import _path  # noqa: F401  (first: the root on sys.path, for harness/)
import psycopg

from harness.pgserver import PgServer

ROLE = "herd"
JOBRUN = (sys.executable, "-m", "jobrun")
#: What a herd member does before the barrier: import everything a run needs, then wait.
LAUNCHER = """
import os, sys
import jobrun.cli.run, jobrun.db, jobrun.history, jobrun.locks.session, jobrun.locks.lease
os.read(int(sys.argv[1]), 1)
sys.argv = ["jobrun", *sys.argv[2:]]
jobrun.cli.main()
"""


def prepare(server: PgServer) -> str:
    """A login role that is not a superuser (so the reserved slots stay free), its DSN."""
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE ROLE {ROLE} LOGIN")
        conn.execute(f"GRANT CREATE ON DATABASE postgres TO {ROLE}")
    dsn = server.dsn().replace("user=postgres", f"user={ROLE}")
    for mode in ("session", "lease"):  # the schema exists before the herd arrives
        subprocess.run(
            [*JOBRUN, "--dsn", dsn, "--mode", mode, "--key", "warm-up", "--", "true"],
            check=True,
            capture_output=True,
        )
    return dsn


def herd(server: PgServer, dsn: str, *, runs: int, mode: str, history: bool) -> dict[str, object]:
    """Release ``runs`` jobruns of one key at once; what became of them."""
    key = f"herd-{mode}-{runs}-{'h' if history else 'n'}-{time.time_ns()}"
    args = ["--dsn", dsn, "--mode", mode, "--key", key, "--connect-timeout", "30s"]
    if not history:
        args.append("--no-history")
    barrier_r, barrier_w = os.pipe()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBRUN_", "PG"))}
    env["JOBRUN_LOG_FORMAT"] = "json"
    with tempfile.TemporaryDirectory() as tmp:
        logs = [Path(tmp) / f"{i}.log" for i in range(runs)]
        release = Path(tmp) / "release"
        job = ["sh", "-c", f'while [ ! -e "{release}" ]; do sleep 0.05; done']
        procs = []
        for path in logs:
            with path.open("w") as err:
                procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", LAUNCHER, str(barrier_r), *args, "--", *job],
                        pass_fds=(barrier_r,),
                        stdout=subprocess.DEVNULL,
                        stderr=err,
                        env=env,
                    )
                )
        os.close(barrier_r)
        time.sleep(min(30.0, 0.1 * runs))  # let every one finish its imports and block
        peak = [0]
        done = threading.Event()
        watcher = threading.Thread(target=watch, args=(server, peak, done))
        watcher.start()
        began = time.monotonic()
        os.close(barrier_w)  # EOF for all of them at once
        left = set(range(runs))
        while len(left) > 1:
            left = {i for i in left if procs[i].poll() is None}
            time.sleep(0.01)
        herd_wall = time.monotonic() - began
        release.touch()
        statuses = [proc.wait() for proc in procs]
        wall = time.monotonic() - began
        done.set()
        watcher.join()
        events: collections.Counter[str] = collections.Counter()
        why_69: collections.Counter[str] = collections.Counter()
        other_lines: list[str] = []
        for status, path in zip(statuses, logs, strict=True):
            if status not in (0, 75, 69):
                other_lines.append(path.read_text(errors="replace")[-600:])
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    parsed = json.loads(line)
                    events[parsed["event"]] += 1
                    if parsed["event"] == "lockstore_unavailable":
                        why_69[f"{parsed['reason']}: {parsed['error'][:160]}"] += 1
    counts = collections.Counter(statuses)
    met = counts[0] == 1 and counts[75] == runs - 1 and events["history_failed"] == 0
    return {
        "target": "met" if met else "MISSED",
        "mode": mode,
        "runs": runs,
        "history": history,
        "ran": counts[0],
        "skipped_75": counts[75],
        "unavailable_69": counts[69],
        "other": {status: n for status, n in counts.items() if status not in (0, 75, 69)},
        "history_failed": events["history_failed"],
        "peak_sessions": peak[0],
        "all_but_one_exited_s": round(herd_wall, 2),
        "last_exited_s": round(wall, 2),
        "server_refusals": refusals(server),
        "why_69": dict(why_69.most_common(3)),
        "other_stderr": other_lines[:3],
    }


def refusals(server: PgServer) -> int:
    """Connections the server turned away so far (too many clients)."""
    return server.log_path.read_text(errors="replace").count("too many clients")


def watch(server: PgServer, peak: list[int], done: threading.Event) -> None:
    """Poll the client sessions on the server from a superuser (reserved) connection."""
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        while not done.is_set():
            row = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE backend_type = 'client backend' "
                "AND pid <> pg_backend_pid()"
            ).fetchone()
            peak[0] = max(peak[0], int(row[0]) if row else 0)
            time.sleep(0.005)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, nargs="+", default=[60, 200])
    parser.add_argument("--modes", nargs="+", default=["session", "lease"])
    parser.add_argument("--history", choices=["both", "on", "off"], default="both")
    args = parser.parse_args()
    settings = {"max_connections": "20", "superuser_reserved_connections": "3"}
    histories = {"both": [True, False], "on": [True], "off": [False]}[args.history]
    with PgServer.start(settings) as server:
        dsn = prepare(server)
        print(
            f"max_connections=20 (3 reserved for the watcher); load average {os.getloadavg()}; "
            "server_refusals is cumulative"
        )
        for runs in args.runs:
            for mode in args.modes:
                for history in histories:
                    print(json.dumps(herd(server, dsn, runs=runs, mode=mode, history=history)))
                    sys.stdout.flush()


if __name__ == "__main__":
    main()
