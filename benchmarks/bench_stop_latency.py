"""From ``jobrun stop KEY`` to the child's SIGTERM, in session and lease mode, at default settings.

A run of each mode holds a key with a child that writes the time it got SIGTERM to a file;
after a random pause (so that the request lands anywhere in the heartbeat's cycle) the
benchmark starts ``jobrun stop KEY --wait 0s`` and takes the time just before. Latency =
the child's SIGTERM time - that start (both on this machine's wall clock), so it counts the
stop command's own start-up and round trips, the wait for the run's next heartbeat (the
request is read by the session check or the lease renewal) and the signal itself.

Usage::

    JOBRUN_DSN=postgresql://... .venv/bin/python benchmarks/bench_stop_latency.py [--trials 5]
        [--mode session lease] [-- RUN OPTIONS...]

Prints, per mode, the median time until the request was written (the stop command's
"asked ..." line) and the median, min and max until SIGTERM; exits 0. Not a test.
"""

from __future__ import annotations

import argparse
import os
import random
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from jobrun.ops.background import BackgroundRun

JOBRUN = (sys.executable, "-m", "jobrun")
#: The child: note the wall time of SIGTERM in the file named by argv[1], then exit.
CHILD = (
    "import signal, sys, time\n"
    "def term(*_):\n"
    "    open(sys.argv[1], 'w').write(repr(time.time()))\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, term)\n"
    "while True:\n"
    "    time.sleep(3600)\n"
)
TIMEOUT = 30.0


def one(mode: str, extra: list[str], env: dict[str, str], spread: float) -> tuple[float, float]:
    """Seconds from starting ``jobrun stop`` to its request written, and to the child's SIGTERM."""
    key = f"bench-stop-{mode}-{secrets.token_hex(3)}"
    with tempfile.TemporaryDirectory() as directory:
        mark = Path(directory) / "term"
        run = BackgroundRun(
            [*JOBRUN, "--mode", mode, *extra, "--key", key, "--", sys.executable, "-c", CHILD,
             str(mark)],
            env,
        )  # fmt: skip
        if run.wait_event("started", TIMEOUT) is None:
            run.stop(1.0)
            raise RuntimeError(f"{mode} run did not start: {run.why()}")
        time.sleep(random.uniform(0.0, spread))
        began = time.time()
        stop = subprocess.Popen(
            [*JOBRUN, "stop", key, "--wait", "0s"],
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        lines = stop.stderr or ()
        asked = next((time.time() for line in lines if line.startswith("asked ")), 0.0)
        stop.wait()
        deadline = time.monotonic() + TIMEOUT
        while not mark.exists() or not mark.read_text():
            if time.monotonic() > deadline:
                run.stop(1.0)
                raise RuntimeError(f"{mode}: the child never got SIGTERM")
            time.sleep(0.01)
        run.finish(TIMEOUT)
        return asked - began, float(mark.read_text()) - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=5)
    parser.add_argument("--mode", nargs="+", default=["session", "lease"])
    parser.add_argument(
        "--spread", type=float, default=6.0, help="longest random pause before stop (s)"
    )
    parser.add_argument("extra", nargs="*", help="options for the runs (after --)")
    args = parser.parse_args()
    env = {k: v for k, v in os.environ.items() if not k.startswith("JOBRUN_") or k == "JOBRUN_DSN"}
    env["JOBRUN_LOG_FORMAT"] = "json"
    print(f"load average: {Path('/proc/loadavg').read_text().strip()}")
    print("| mode | options | request written, median s | SIGTERM median s | min s | max s |")
    print("|---|---|---|---|---|---|")
    for mode in args.mode:
        pairs = [one(mode, args.extra, env, args.spread) for _ in range(args.trials)]
        figures = [term for _, term in pairs]
        print(
            f"| {mode} | {' '.join(args.extra) or '(defaults)'} "
            f"| {statistics.median(asked for asked, _ in pairs):.2f} "
            f"| {statistics.median(figures):.2f} | {min(figures):.2f} | {max(figures):.2f} |"
        )
    print(f"({args.trials} trials each)")


if __name__ == "__main__":
    main()
