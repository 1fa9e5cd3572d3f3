"""`jobrun deadlocks` on crafted logs, each at two sizes: wall time and peak memory per file.

Builds in a temporary directory, each at ``--scale`` and at twice that (time should double
at most, memory stay flat):

- ``long-line.log.gz``: one line of 768 MiB packed about 380 to 1 (2 MiB on disk), as a
  log packs at most: read whole, the line cut;
- ``bomb.log.gz``: 768 MiB of zeros packed 1,000 to 1: stopped once past the floor;
- ``never-ends.json``: a 4 MB Cloud Logging array whose first object never closes;
- ``nested.json``: one jsonlog line nested 170,000 deep (1 MiB).

Each runs as ``python -m jobrun deadlocks FILE`` in a fresh process; its peak RSS is that
process's own (``wait4``)::

    .venv/bin/python benchmarks/bench_hostile_logs.py

Prints figures; not a test.
"""

from __future__ import annotations

import argparse
import gzip
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

#: Bytes between the random letters of the long line: gzip packs it about 380 to 1.
STRIDE = 1900


def long_line(path: Path, mebibytes: int) -> None:
    """One line of ``mebibytes`` MiB with no newline: one packed MiB repeated (gzip members)."""
    letters = random.Random(7).choices("abcdefghijklmnopqrstuvwxyz", k=2**20 // STRIDE + 1)
    block = "".join(("x" * (STRIDE - 1) + letter) for letter in letters)[: 2**20]
    member = gzip.compress(block.encode(), compresslevel=6)
    path.write_bytes(member * mebibytes)


def bomb(path: Path, mebibytes: int) -> None:
    """``mebibytes`` MiB of zeros, one packed MiB repeated."""
    path.write_bytes(gzip.compress(b"\0" * 2**20, compresslevel=9) * mebibytes)


def never_ends(path: Path, megabytes: int) -> None:
    """A JSON array whose first object opens a list that never closes."""
    with path.open("w") as out:
        out.write('[\n  {\n    "textPayload": [\n')
        item = '      "0123456789",\n'
        out.write(item * (megabytes * 10**6 // len(item)))


def nested(path: Path, depth: int) -> None:
    """One JSON line ``depth`` objects deep."""
    path.write_text('{"a":' * depth + "0" + "}" * depth + "\n")


def measure(argv: list[str], timeout: float) -> tuple[float, int, int | None, str]:
    """Wall seconds, peak RSS (MiB) and exit status (None: killed at ``timeout``), stdout."""
    with tempfile.TemporaryFile() as out:
        started = time.monotonic()
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.DEVNULL)
        status: int | None = None
        while True:
            pid, raw, usage = os.wait4(child.pid, os.WNOHANG)
            if pid:
                status = os.waitstatus_to_exitcode(raw)
                break
            if time.monotonic() - started > timeout:
                child.kill()
                _, _, usage = os.wait4(child.pid, 0)
                break
            time.sleep(0.02)
        wall = time.monotonic() - started
        child.returncode = status if status is not None else -9  # reaped here, not by Popen
        out.seek(0)
        return wall, usage.ru_maxrss // 1024, status, out.read().decode(errors="replace")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scale", type=int, default=1, help="size factor (default 1)")
    parser.add_argument(
        "--timeout", type=float, default=300, help="seconds before a run is killed (300)"
    )
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="jobrun-bench-hostile-"))
    try:
        files: list[Path] = []
        for factor in (args.scale, 2 * args.scale):
            for name, build, size in (
                ("long-line.log.gz", long_line, 768),
                ("bomb.log.gz", bomb, 768),
                ("never-ends.json", never_ends, 4),
                ("nested.json", nested, 170_000),
            ):
                path = work / f"x{factor}-{name}"
                build(path, size * factor)
                files.append(path)
        print(f"python {sys.version.split()[0]}; load {os.getloadavg()[0]:.1f}")
        for path in files:
            argv = [sys.executable, "-m", "jobrun", "deadlocks", str(path)]
            wall, rss, status, stdout = measure(argv, args.timeout)
            said = next((line.strip() for line in stdout.splitlines() if str(path) in line), "")
            said = said.replace(str(path), "").lstrip(": ")
            exited = f"exit {status}" if status is not None else f"killed at {args.timeout:.0f} s"
            size = f"{path.stat().st_size / 2**20:6.1f} MiB"
            print(f"{path.name:22} {size}  wall {wall:6.1f} s  peak {rss:5d} MiB  {exited}")
            print(f"{'':24}{said[:150]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
