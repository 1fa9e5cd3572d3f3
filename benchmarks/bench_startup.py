"""Startup cost of jobrun, measured against the imports it cannot do without.

jobrun is started by cron, systemd and CI many times a day, so what it adds on top of
"Python plus the libraries it needs" should stay small. This script times, as paired
runs, each jobrun command against a baseline that only imports the library doing the
real work:

  (a) ``jobrun --key bench-<random> -- true``  vs  the floor script below            (<= 1.10)
  (b) ``jobrun --help``                        vs  ``python -c 'import click'``     (<= 1.20)
  (c) ``jobrun key x``                         vs  ``python -c 'import click'``     (<= 1.20)

Each comparison is run twice: through the console script next to the interpreter (what
cron and systemd start; it is the fairer figure: no runpy) and through
``python -m jobrun``. Within a pair the order alternates (A,B then B,A) and the rounds go
over every comparison in turn, so drift in machine load touches all of them alike. The
ratio is the median of the per-pair ratios.

(a)'s floor is a hand-written script with jobrun's three dependencies that does the run
path's work by hand: import click, structlog and psycopg, connect, take an advisory lock,
run ``true``, release it. Anything above it is jobrun's own cost (its modules, history,
round trips). jobrun ends without the interpreter's teardown (jobrun/__main__.py: exit
handlers run, streams flushed, then ``os._exit``), which the floor does not; so a row for
information holds (a) against the floor ending the same way: that ratio is jobrun's own
work alone. Two more rows, for information only (no target): (a) against
``python -c 'import psycopg'``, and the three imports alone against psycopg alone.

The run's round trips (messages to the server) and sessions are counted by
``benchmarks/bench_server_calls.py`` (a private server that logs every statement).

Usage::

    .venv/bin/python benchmarks/bench_startup.py [--runs 30] [--dsn DSN]

The DSN comes from --dsn, else JOBRUN_DSN, else a local test server; it is handed to
jobrun in JOBRUN_DSN, never on its command line. Nothing is created in the database: (a)
takes and releases an advisory lock on a random key. The script prints figures and
always exits 0; it is not a test.

Bytecode: an editable install has no .pyc for jobrun, and with PYTHONDONTWRITEBYTECODE set
(as in some shells and containers) jobrun is compiled from source at every start while
psycopg and click load their installed .pyc: that is not what a user's ``pip install``
gets. By default every timed process therefore shares a private, temporary
PYTHONPYCACHEPREFIX (filled during the warm-up runs), so all modules, jobrun's and the
baselines', load from bytecode. ``--as-is`` keeps the inherited settings instead.
"""

from __future__ import annotations

import argparse
import os
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import _path  # noqa: F401  (first: the root on sys.path, for harness/)

from harness.bench import run_by_hand, run_once

DEFAULT_DSN = "host=127.0.0.1 user=postgres dbname=test"
WARMUP_RUNS = 2


@dataclass(frozen=True)
class Comparison:
    """A jobrun command, the baseline it is held against, and the ratio it should stay under."""

    label: str
    command: tuple[str, ...]
    baseline_label: str
    baseline: tuple[str, ...]
    target: float | None  # None: for information, no target


@dataclass
class Samples:
    """Wall times (ms) of the paired runs of one comparison, and what went wrong."""

    command_ms: list[float] = field(default_factory=list)
    baseline_ms: list[float] = field(default_factory=list)
    failures: dict[int, int] = field(default_factory=dict)  # exit status -> count

    def ratios(self) -> list[float]:
        """Per-pair ratios command / baseline."""
        return [c / b for c, b in zip(self.command_ms, self.baseline_ms, strict=True)]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Read the command line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--runs", type=int, default=30, help="paired runs per comparison (default: 30)"
    )
    parser.add_argument(
        "--dsn",
        default=os.environ.get("JOBRUN_DSN", DEFAULT_DSN),
        help="libpq DSN for (a); default: JOBRUN_DSN, else %(default)r",
    )
    parser.add_argument(
        "--as-is",
        action="store_true",
        help="keep the inherited bytecode settings (no private PYTHONPYCACHEPREFIX)",
    )
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    return args


def console_script() -> Path | None:
    """The ``jobrun`` script installed next to this interpreter, else the one on PATH."""
    beside = Path(sys.executable).parent / "jobrun"
    if beside.is_file():
        return beside
    found = shutil.which("jobrun")
    return Path(found) if found else None


def shebang(script: Path) -> str:
    """The interpreter line of a console script, to show which Python it really starts."""
    try:
        with script.open("rb") as handle:
            first = handle.readline(512).decode("utf-8", "replace").strip()
    except OSError:
        return "?"
    return first.removeprefix("#!") if first.startswith("#!") else "?"


def child_env(dsn: str, pycache: str | None) -> dict[str, str]:
    """The environment of every timed process: no stray JOBRUN_* option, the DSN given.

    With ``pycache``, bytecode is written to and read from that directory for every module.
    """
    env = {name: value for name, value in os.environ.items() if not name.startswith("JOBRUN_")}
    env["JOBRUN_DSN"] = dsn
    env["JOBRUN_LOG_FORMAT"] = "json"
    if pycache is not None:
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        env["PYTHONPYCACHEPREFIX"] = pycache
    return env


#: The floor for jobrun's run path: the same three imports, then the work done by hand.
BY_HAND = run_by_hand("click", "structlog")

#: The same, ending as jobrun does: exit handlers and stream flushes, then os._exit (no
#: interpreter teardown). Against this floor, what is left is jobrun's own work.
BY_HAND_NO_TEARDOWN = (
    BY_HAND + "import atexit, sys\natexit._run_exitfuncs()\nsys.stdout.flush()\nos._exit(0)\n"
)


def comparisons(script: Path | None, key: str) -> list[Comparison]:
    """Every jobrun command to time, through the console script and through ``-m``."""
    python = sys.executable
    import_psycopg = (python, "-c", "import psycopg")
    import_click = (python, "-c", "import click")
    launchers: list[tuple[str, tuple[str, ...]]] = []
    if script is not None:
        launchers.append(("jobrun", (str(script),)))
    launchers.append(("python -m jobrun", (python, "-m", "jobrun")))
    found: list[Comparison] = []
    for name, launcher in launchers:
        found.extend(
            (
                Comparison(
                    f"{name} --key bench-<rand> -- true",
                    (*launcher, "--key", key, "--", "true"),
                    "python: click, structlog, psycopg; connect, lock, run true",
                    (python, "-c", BY_HAND),
                    1.10,
                ),
                Comparison(
                    f"{name} --help",
                    (*launcher, "--help"),
                    "python -c 'import click'",
                    import_click,
                    1.20,
                ),
                Comparison(
                    f"{name} key x",
                    (*launcher, "key", "x"),
                    "python -c 'import click'",
                    import_click,
                    1.20,
                ),
            )
        )
    run = found[0]
    found.append(
        Comparison(
            run.label,
            run.command,
            "the floor, also ending without the interpreter's teardown",
            (python, "-c", BY_HAND_NO_TEARDOWN),
            None,
        )
    )
    found.append(
        Comparison(run.label, run.command, "python -c 'import psycopg'", import_psycopg, None)
    )
    # The floor the run path's three dependencies set, before jobrun does anything.
    found.append(
        Comparison(
            "python -c 'import click, structlog, psycopg'",
            (python, "-c", "import click, structlog, psycopg"),
            "python -c 'import psycopg'",
            import_psycopg,
            None,
        )
    )
    return found


def preflight(compared: list[Comparison], env: dict[str, str]) -> None:
    """Warm the caches, and say so when a command does not succeed (figures would mislead)."""
    for comparison in compared:
        for command in (comparison.command, comparison.baseline):
            for _ in range(WARMUP_RUNS):
                run_once(command, env)
            outcome = subprocess.run(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                check=False,
            )
            if outcome.returncode != 0:
                shown = " ".join(command)[:80]
                last = (outcome.stderr.strip().splitlines() or ["(no output)"])[-1][:300]
                print(f"warning: {shown!r} exits {outcome.returncode}: {last}", file=sys.stderr)


def measure(compared: list[Comparison], runs: int, env: dict[str, str]) -> list[Samples]:
    """Paired runs, the order alternating within each pair, round-robin over comparisons."""
    samples = [Samples() for _ in compared]
    for round_no in range(runs):
        for comparison, sample in zip(compared, samples, strict=True):
            command_first = round_no % 2 == 0
            if command_first:
                command_ms, status = run_once(comparison.command, env)
                baseline_ms, _ = run_once(comparison.baseline, env)
            else:
                baseline_ms, _ = run_once(comparison.baseline, env)
                command_ms, status = run_once(comparison.command, env)
            sample.command_ms.append(command_ms)
            sample.baseline_ms.append(baseline_ms)
            if status != 0:
                sample.failures[status] = sample.failures.get(status, 0) + 1
    return samples


def p90(values: list[float]) -> float:
    """The 90th percentile (inclusive method; the value itself for a single run)."""
    if len(values) < 2:
        return values[0]
    return statistics.quantiles(values, n=10, method="inclusive")[-1]


def table(compared: list[Comparison], samples: list[Samples]) -> list[list[str]]:
    """Rows of the report: each command with its ratio, then its baseline."""
    rows = [["command", "median ms", "p90 ms", "ratio", "target", "result"]]
    for comparison, sample in zip(compared, samples, strict=True):
        ratio = statistics.median(sample.ratios())
        if comparison.target is None:
            target, verdict = "info", "-"
        else:
            target = f"<= {comparison.target:.2f}"
            verdict = "PASS" if ratio <= comparison.target else "MISS"
        if sample.failures:
            codes = ", ".join(f"exit {code} x{n}" for code, n in sorted(sample.failures.items()))
            verdict += f" ({codes}!)"
        rows.append(
            [
                comparison.label,
                f"{statistics.median(sample.command_ms):.1f}",
                f"{p90(sample.command_ms):.1f}",
                f"{ratio:.3f}",
                target,
                verdict,
            ]
        )
        rows.append(
            [
                f"  vs {comparison.baseline_label}",
                f"{statistics.median(sample.baseline_ms):.1f}",
                f"{p90(sample.baseline_ms):.1f}",
                "",
                "",
                "",
            ]
        )
    return rows


def render(rows: list[list[str]]) -> str:
    """Align the rows in columns: text left, figures right."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for index, row in enumerate(rows):
        cells = [
            cell.ljust(width) if column in {0, 5} else cell.rjust(width)
            for column, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if index == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Measure, print the table, exit 0."""
    args = parse_args(argv)
    if args.as_is:
        return bench(args, None)
    with tempfile.TemporaryDirectory(prefix="jobrun-bench-pycache-") as pycache:
        return bench(args, pycache)


def bench(args: argparse.Namespace, pycache: str | None) -> int:
    """Measure with the given bytecode cache (None: as inherited), print the table."""
    script = console_script()
    key = f"bench-{secrets.token_hex(6)}"
    env = child_env(args.dsn, pycache)
    compared = comparisons(script, key)

    print(f"python: {sys.executable} ({sys.version.split()[0]})")
    if script is None:
        print("console script: not found; timing python -m jobrun only")
    else:
        print(f"console script: {script} (#!{shebang(script)})")
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"runs: {args.runs} paired per comparison, key: {key}, load average: {load}")
    if pycache is None:
        dont_write = os.environ.get("PYTHONDONTWRITEBYTECODE") or "unset"
        print(f"bytecode: as inherited (PYTHONDONTWRITEBYTECODE={dont_write})")
    else:
        print("bytecode: private PYTHONPYCACHEPREFIX, every module loads from .pyc")
    print("ratio = median of per-pair (command / baseline) wall times\n")

    started = time.monotonic()
    preflight(compared, env)
    samples = measure(compared, args.runs, env)
    print(render(table(compared, samples)))
    print("\nround trips of (a), from a private server's statement log:")
    counted = subprocess.run(
        [sys.executable, str(Path(__file__).with_name("bench_server_calls.py"))],
        capture_output=True,
        text=True,
        check=False,
    )
    print(counted.stdout.rstrip() or counted.stderr.strip()[-300:])
    print(f"\n{time.monotonic() - started:.1f}s in all")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
