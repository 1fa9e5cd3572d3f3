"""The human ``jobrun overlap`` report: one line per attempt, the totals, the cycle, the errors."""

from __future__ import annotations

import shlex
from typing import TYPE_CHECKING

from jobrun.escape import printable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from jobrun.analysis.overlap.report import Attempt, Report

#: Longest command shown in the human report (the JSON has every argument).
COMMAND_CHARS = 120

_OUTCOME_WORDS = {
    "server_timeout": "with a server-side timeout while a job was held (not a clean attempt)",
    "timeout": "in a timeout (both commands killed)",
    "failed": "with a failed command",
}


def text(report: Report) -> str:
    """The whole human report, each line escaped.

    The commands' output, the server's error lines, the queries and relation names of the
    wait-for cycle, the database's name: none of it is ours, so none of it reaches the
    terminal raw (``--json`` has it exact).
    """
    total = len(report.attempts)
    lines = [
        f"jobrun overlap: {plural(total, 'attempt')} on {report.database} (--start {report.start})",
        f"  A: {_short(report.first)}",
        f"  B: {_short(report.second)}",
    ]
    lines += [f"  attempt {a.number}: {a.outcome:<9}{summary(a)}" for a in report.attempts]
    first = report.first_deadlock
    until = f"; the first in attempt {first}" if first is not None else ""
    lines.append(
        f"{plural(total, 'attempt')}, {plural(report.deadlocks, 'deadlock')} "
        f"({report.deadlocks}/{total}), {plural(report.waits_observed, 'wait')} observed{until}"
    )
    if report.silent_cycles:
        lines.append(
            f"{plural(report.silent_cycles, 'more attempt')} had a wait-for cycle but "
            "no deadlock error (did a command retry?)"
        )
    lines += [
        f"{plural(report.count(outcome), 'attempt')} ended {words}"
        for outcome, words in _OUTCOME_WORDS.items()
        if report.count(outcome)
    ]
    lines += _cycle_lines(report)
    lines += report.advice_lines()
    lines += _error_lines(report)
    lines += [f"note: {note}" for note in report.notes()]
    if report.exit_status:
        found = report.deadlocks + report.silent_cycles
        lines.append(f"deadlock in {found} of {plural(total, 'attempt')}")
    else:
        unclean = sum(report.count(outcome) for outcome in _OUTCOME_WORDS)
        but = f" (but {unclean} did not end cleanly: see above)" if unclean else ""
        lines.append(f"no deadlock in {plural(total, 'attempt')}{but}")
    return "\n".join(printable(line) for line in lines)


def summary(attempt: Attempt) -> str:
    """``A exit 1, B exit 0, 1.65s, A first held at statement 1 for 0.80s, cycle seen``."""
    parts = [attempt.exits(), f"{attempt.duration:.2f}s"]
    if attempt.held_seconds is not None:
        parts.append(
            f"{attempt.first} held at statement {attempt.hold_at} for {attempt.held_seconds:.2f}s"
        )
    else:
        parts.append(f"{attempt.first} first")
    if attempt.cycle:
        parts.append("cycle seen")
    return ", ".join(parts)


def _cycle_lines(report: Report) -> list[str]:
    cycles = report.cycles()
    if cycles:
        numbers, cycle = cycles[0]
        also = f"; the same cycle in {len(numbers)} of {plural(len(report.attempts), 'attempt')}"
        return [
            f"wait-for cycle (attempt {numbers[0]}{also}):",
            *(f"  {wait.describe()}" for wait in cycle),
        ]
    waited = next((a for a in report.attempts if a.waits), None)
    if waited is None:
        return []
    return [
        f"waits seen, no cycle (attempt {waited.number}):",
        *(f"  {wait.describe()}" for wait in waited.waits[:3]),
    ]


def _error_lines(report: Report) -> list[str]:
    deadlocked = next((a for a in report.attempts if a.outcome == "deadlock"), None)
    if deadlocked is not None:
        return [
            f"deadlock error (attempt {deadlocked.number}):",
            *(
                f"  {job}: {line}"
                for job, found in deadlocked.deadlock_lines.items()
                for line in found
            ),
        ]
    lines: list[str] = []
    ended = next((a for a in report.attempts if a.outcome == "server_timeout"), None)
    if ended is not None:
        lines.append(f"server-side timeout (attempt {ended.number}):")
        lines += [
            f"  {job}: {line}"
            for job, found in ended.server_timeout_lines.items()
            for line in found
        ] or [f"  {ended.first}'s session ended while it was held"]
    failed = next((a for a in report.attempts if a.outcome == "failed"), None)
    if failed is not None:
        for job, code in failed.exit_codes.items():
            if code:
                lines.append(f"last output of {job} (attempt {failed.number}, exit {code}):")
                lines += [f"  {line}" for line in failed.output_tail[job]] or ["  (none)"]
    return lines


def plural(count: int, noun: str) -> str:
    """``1 attempt``, ``2 attempts``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _short(argv: Sequence[str]) -> str:
    joined = " ".join(shlex.join(argv).split())
    return joined if len(joined) <= COMMAND_CHARS else joined[: COMMAND_CHARS - 3] + "..."
