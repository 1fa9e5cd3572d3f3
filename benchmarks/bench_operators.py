"""What --keep-output, --fence and --ping cost a run: figures, not a test.

  (a) --keep-output: throughput of a child writing to stdout through jobrun's pipes, against
      the same child inheriting jobrun's stdout (both into /dev/null)
  (b) --fence: wall time of ``jobrun -- true`` with and without a token (median, p90)
  (c) --ping: wall time of ``jobrun -- true`` with pings to a local server answering at once

Usage::

    .venv/bin/python benchmarks/bench_operators.py [--runs 10] [--mib 512] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
import uuid

import _path  # noqa: F401  (first: the root on sys.path, for harness/)

from harness.bench import ping_endpoint

JOBRUN = (sys.executable, "-m", "jobrun")


def timed(args: list[str], env: dict[str, str]) -> float:
    began = time.monotonic()
    subprocess.run(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return time.monotonic() - began


def summary(samples: list[float]) -> str:
    ordered = sorted(samples)
    p90 = ordered[min(len(ordered) - 1, int(len(ordered) * 0.9))]
    return f"median {statistics.median(ordered) * 1000:7.1f} ms   p90 {p90 * 1000:7.1f} ms"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=10)
    parser.add_argument("--mib", type=int, default=512)
    parser.add_argument("--dsn", default=os.environ.get("JOBRUN_DSN", ""))
    args = parser.parse_args()
    env = {**os.environ, "JOBRUN_DSN": args.dsn, "JOBRUN_LOG_LEVEL": "error"}
    key = f"bench-operators-{uuid.uuid4().hex[:8]}"

    writer = ["dd", "if=/dev/zero", "bs=64k", f"count={args.mib * 16}", "status=none"]
    print(f"(a) a child writing {args.mib} MiB to stdout (jobrun's stdout: /dev/null)")
    for label, extra in (("inherited", []), ("--keep-output 16KiB", ["--keep-output", "16KiB"])):
        seconds = min(timed([*JOBRUN, "--key", key, *extra, "--", *writer], env) for _ in range(3))
        print(f"    {label:22s} {args.mib / seconds:8.0f} MiB/s  (best of 3: {seconds:.2f} s)")

    print(f"(b) jobrun -- true, {args.runs} runs each")
    for label, extra in (("without --fence", []), ("--fence", ["--fence"])):
        samples = [
            timed([*JOBRUN, "--key", key, *extra, "--", "true"], env) for _ in range(args.runs)
        ]
        print(f"    {label:22s} {summary(samples)}")

    print(f"(c) jobrun -- true, {args.runs} runs each, pings answered at once (local server)")
    with ping_endpoint() as url:
        for label, extra in (("without --ping", []), ("--ping", ["--ping", url])):
            samples = [
                timed([*JOBRUN, "--key", key, *extra, "--", "true"], env) for _ in range(args.runs)
            ]
            print(f"    {label:22s} {summary(samples)}")


if __name__ == "__main__":
    main()
