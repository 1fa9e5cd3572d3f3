"""``jobrun overlap --job A --job B --job C``: every pair run against each other, a matrix."""

from __future__ import annotations

import dataclasses
import itertools
import shlex
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobrun.analysis.overlap.render import COMMAND_CHARS
from jobrun.analysis.overlap.run import run
from jobrun.escape import printable
from jobrun.exitcodes import UsageError
from jobrun.run.supervise import ExecFailed

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence

    from jobrun.analysis.overlap.report import Attempt, Report
    from jobrun.analysis.overlap.run import Plan

#: The outcome of a pair: a deadlock (or a cycle) in any attempt, else a failed or timed
#: out attempt, else clean.
DEADLOCKED, FAILED, CLEAN = "deadlocked", "failed", "clean"
_UNCLEAN = ("failed", "timeout", "server_timeout")


@dataclass
class Pair:
    """Two of the jobs (indexes into the job list) and their ``jobrun overlap`` report."""

    first: int
    second: int
    report: Report

    @property
    def outcome(self) -> str:
        """``deadlocked``, ``failed`` or ``clean``."""
        if self.report.exit_status:
            return DEADLOCKED
        if any(self.report.count(outcome) for outcome in _UNCLEAN):
            return FAILED
        return CLEAN


@dataclass
class Matrix:
    """Every pair of the jobs, each run against the other in both orders."""

    jobs: list[tuple[str, ...]]
    database: str = ""
    pairs: list[Pair] = field(default_factory=list)

    @property
    def exit_status(self) -> int:
        """1 when any pair deadlocked, else 0."""
        return 1 if any(pair.outcome == DEADLOCKED for pair in self.pairs) else 0

    def as_json(self) -> dict[str, Any]:
        """The matrix as one JSON object: the jobs, and each pair with its whole report."""
        return {
            "database": self.database,
            "jobs": [list(job) for job in self.jobs],
            "exit_status": self.exit_status,
            "pairs": [
                {
                    "jobs": [pair.first + 1, pair.second + 1],
                    "outcome": pair.outcome,
                    "report": pair.report.as_json(),
                }
                for pair in self.pairs
            ],
        }


def run_matrix(
    plan: Plan,
    jobs: Sequence[tuple[str, ...]],
    *,
    environ: Mapping[str, str] | None = None,
    progress: Callable[[int, int, Attempt], None] | None = None,
) -> Matrix:
    """Run every pair of ``jobs`` against each other, ``plan.runs`` attempts per pair.

    The jobs of a pair take turns going first, so both orders are tried. ``plan`` gives
    the database, timeout and start mode; its commands are replaced pair by pair.
    """
    if len(jobs) < 2:  # noqa: PLR2004 - a pair
        raise UsageError("--job: give at least two jobs (or --first and --second)")
    if plan.runs < 2:  # noqa: PLR2004 - one attempt per order
        raise UsageError("--runs must be at least 2 with --job: each pair runs in both orders")
    matrix = Matrix([tuple(job) for job in jobs])
    for first, second in itertools.combinations(range(len(jobs)), 2):
        pair_plan = dataclasses.replace(
            plan, first=jobs[first], second=jobs[second], alternate=True
        )

        def show(attempt: Attempt, first: int = first, second: int = second) -> None:
            if progress is not None:
                progress(first, second, attempt)

        try:
            report = run(pair_plan, environ=environ, progress=show)
        except ExecFailed as exc:  # said of --first/--second: name the --job instead
            text = str(exc).replace("--first", f"--job J{first + 1}", 1)
            text = text.replace("--second", f"--job J{second + 1}", 1)
            raise ExecFailed(text, exc.exit_code) from None
        matrix.database = report.database
        matrix.jobs[first], matrix.jobs[second] = report.first, report.second  # redacted
        matrix.pairs.append(Pair(first, second, report))
    return matrix


def text(matrix: Matrix) -> str:
    """The matrix for people: the jobs, a table of pair outcomes, each deadlock's advice."""
    names = [f"J{number}" for number in range(1, len(matrix.jobs) + 1)]
    runs = matrix.pairs[0].report.runs if matrix.pairs else 0
    lines = [
        (
            f"jobrun overlap: {len(matrix.jobs)} jobs, every pair, {runs} attempts each (the "
            f"two taking turns going first) on {matrix.database}"
        ),
        *(f"  {name}: {_short(job)}" for name, job in zip(names, matrix.jobs, strict=True)),
    ]
    cell = {(p.first, p.second): p.outcome for p in matrix.pairs}
    cell.update({(p.second, p.first): p.outcome for p in matrix.pairs})
    width = max(len(DEADLOCKED), *(len(name) for name in names))
    lines.append("  " + " " * 4 + "".join(f"{name:<{width + 2}}" for name in names).rstrip())
    for row, name in enumerate(names):
        cells = [cell.get((row, col), "-") for col in range(len(names))]
        lines.append(f"  {name:<4}" + "".join(f"{c:<{width + 2}}" for c in cells).rstrip())
    for pair in matrix.pairs:
        report = pair.report
        total = len(report.attempts)
        found = report.deadlocks + report.silent_cycles
        unclean = sum(report.count(outcome) for outcome in _UNCLEAN)
        what = {
            DEADLOCKED: f"deadlocked in {found} of {total} attempts",
            FAILED: f"no deadlock, but {unclean} of {total} attempts did not end cleanly",
            CLEAN: f"no deadlock in {total} attempts",
        }[pair.outcome]
        lines.append(f"{names[pair.first]} (A) + {names[pair.second]} (B): {what}")
        cycles = report.cycles()
        if cycles:
            lines += [f"  {wait.describe()}" for wait in cycles[0][1]]
        lines += [f"  {line}" for line in report.advice_lines()]
    deadlocked = sum(pair.outcome == DEADLOCKED for pair in matrix.pairs)
    lines.append(
        f"deadlock in {deadlocked} of {len(matrix.pairs)} pairs"
        if deadlocked
        else f"no deadlock in any of {len(matrix.pairs)} pairs"
    )
    return "\n".join(printable(line) for line in lines)


def _short(argv: Sequence[str]) -> str:
    joined = " ".join(shlex.join(argv).split())
    return joined if len(joined) <= COMMAND_CHARS else joined[: COMMAND_CHARS - 3] + "..."
