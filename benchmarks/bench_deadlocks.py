"""`jobrun deadlocks` on a large server log, side by side with pgBadger: time and peak memory.

Writes a synthetic stderr log (Debian's ``%m [%p] %q%u@%d`` prefix plus ``%a``, one statement
line per entry, a two-sided deadlock every 50,000 entries) of ``--size`` MB, then reads it with
``jobrun deadlocks`` and, when it is installed, ``pgbadger`` (``apt-get install pgbadger``),
each ``--runs`` times, alternating. Prints wall time, CPU time and peak RSS per tool, and
the deadlocks each found::

    .venv/bin/python benchmarks/bench_deadlocks.py --size 200 --runs 1

``--tree DIR`` (repeatable) runs the ``jobrun`` package found in DIR instead, each in turn,
alternating run by run, without pgBadger: two versions compared on one log, in one session
(``git archive main jobrun | tar -x -C /tmp/before``)::

    .venv/bin/python benchmarks/bench_deadlocks.py --runs 3 --tree /tmp/before --tree .

Prints figures; not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: One deadlock every this many entries.
EVERY = 50_000
#: The statements the log's entries quote (log text, never sent to a server).
ONE = "UPDATE accounts SET balance = balance + 5 WHERE id = 1"
TWO = "UPDATE accounts SET balance = balance + 10 WHERE id = 2"
READ = "SELECT * FROM accounts WHERE id = "


def write_log(path: Path, megabytes: int) -> int:
    """Write the synthetic log; return how many deadlocks it holds."""
    target = megabytes * 1024 * 1024
    size = entries = deadlocks = 0
    with path.open("w") as out:
        while size < target:
            entries += 1
            pid = 1000 + entries % 5000
            stamp = f"2026-12-01 02:{entries // 60000 % 60:02d}:{entries // 1000 % 60:02d}"
            stamp += f".{entries % 1000:03d} UTC"
            if entries % EVERY == 0:
                deadlocks += 1
                head = f"{stamp} [{pid}] jobs@staging jobrun:invoices"
                block = (
                    f"{head} ERROR:  deadlock detected\n"
                    f"{head} DETAIL:  Process {pid} waits for ShareLock on transaction 758; "
                    f"blocked by process {pid + 1}.\n"
                    f"\tProcess {pid + 1} waits for ShareLock on transaction 757; "
                    f"blocked by process {pid}.\n"
                    f"\tProcess {pid}: {ONE}\n"
                    f"\tProcess {pid + 1}: {TWO}\n"
                    f"{head} HINT:  See server log for query details.\n"
                    f"{head} STATEMENT:  {ONE}\n"
                )
            else:
                block = (
                    f"{stamp} [{pid}] jobs@staging jobrun:job-{entries % 7} LOG:  duration: "
                    f"0.{entries % 997} ms  statement: {READ}{entries}\n"
                )
            out.write(block)
            size += len(block)
    return deadlocks


def measure(argv: list[str]) -> tuple[float, float, int, str]:
    """Wall seconds, CPU seconds, peak RSS (MiB) and stdout of one command."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    done = subprocess.run(argv, capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    # ru_maxrss of RUSAGE_CHILDREN is the largest child so far: run the larger tool last
    # or read it per tool from separate processes (each tool below runs in its own wrapper).
    return wall, cpu, after.ru_maxrss // 1024, done.stdout


def in_child(argv: list[str], cwd: Path | None = None) -> tuple[float, float, int, str]:
    """measure() in a fresh process, so that the peak RSS is this command's alone.

    ``cwd``: where ``python -m jobrun`` finds its package (a tree to compare).
    """
    code = (
        "import json, sys; sys.path.insert(0, sys.argv[1]); import bench_deadlocks as b; "
        "print(json.dumps(b.measure(sys.argv[2:])))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).resolve().parent), *argv],
        capture_output=True,
        text=True,
        check=True,
        cwd=cwd,
    )
    wall, cpu, rss, stdout = json.loads(done.stdout.splitlines()[-1])
    return wall, cpu, rss, stdout


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", type=int, default=200, help="log size in MB (default 200)")
    parser.add_argument("--runs", type=int, default=1, help="runs per tool (default 1)")
    parser.add_argument(
        "--tree",
        action="append",
        type=Path,
        default=[],
        help="a directory holding a jobrun package to run instead (repeatable; no pgBadger)",
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jobrun-bench-deadlocks-"))
    try:
        log = work / "postgresql.log"
        expected = write_log(log, args.size)
        mib = log.stat().st_size / 2**20
        print(f"log: {mib:.0f} MiB, {expected} deadlocks; load {os.getloadavg()[0]:.1f}")
        argv = [sys.executable, "-m", "jobrun", "deadlocks", "--json", str(log)]
        tools = {"jobrun deadlocks": argv}
        trees = {f"jobrun {tree}": tree.resolve() for tree in args.tree}
        pgbadger = shutil.which("pgbadger")
        if trees:
            tools = dict.fromkeys(trees, argv)
        elif pgbadger:
            tools["pgbadger"] = [
                pgbadger, "--prefix", "%m [%p] %q%u@%d %a ", "-o", str(work / "out.txt"),
                "-x", "text", "--quiet", str(log),
            ]  # fmt: skip
        else:
            print("pgbadger: not installed (apt-get install pgbadger) - jobrun alone")
        for run in range(args.runs):
            for name, argv in tools.items():
                wall, cpu, rss, stdout = in_child(argv, trees.get(name))
                found = ""
                if name.startswith("jobrun"):
                    found = f", {len(json.loads(stdout)['deadlocks'])} deadlocks found"
                elif (work / "out.txt").exists():
                    text = (work / "out.txt").read_text(errors="replace")
                    found = f", report {len(text) // 1024} KiB"
                figures = f"wall {wall:7.1f} s  cpu {cpu:7.1f} s  peak {rss:5d} MiB"
                print(f"run {run + 1} {name:17} {figures}{found}", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
