"""What the attempts of one ``jobrun overlap`` saw, counted, and as stable JSON."""

from __future__ import annotations

import collections
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobrun.analysis.overlap.model import JOBS

if TYPE_CHECKING:
    from collections.abc import Sequence

    from jobrun.analysis.overlap.advice import Advice
    from jobrun.analysis.overlap.model import Wait

#: Deadlock error lines kept per command and attempt.
ERROR_LINES = 8
#: Lines of each command's output kept in a report.
TAIL_LINES = 10

_DEADLOCK = re.compile(r"deadlock detected|40P01|DeadlockDetected", re.IGNORECASE)
#: The rest of PostgreSQL's deadlock report: who waited for what, and where.
_DEADLOCK_DETAIL = re.compile(r"Process \d+ waits for|while \w+ tuple", re.IGNORECASE)
#: A server-side timeout that ended a statement or a session (SQLSTATEs 25P03, 57014, 55P03):
#: with a job held on purpose, the hold itself may have caused it.
_SERVER_TIMEOUT = re.compile(
    r"idle[- ]in[- ]transaction (session )?timeout|IdleInTransactionSessionTimeout|25P03"
    r"|canceling statement due to (statement|lock) timeout",
    re.IGNORECASE,
)


@dataclass
class Attempt:
    """One run of the two jobs against each other, and what was seen."""

    number: int
    #: The job started first (and held, with ``--start hold``): ``A`` or ``B``.
    first: str = "A"
    #: With ``--start hold``: at which of the first job's statements it was held (1 = first).
    hold_at: int | None = None
    #: ``clean``, ``deadlock``, ``server_timeout``, ``timeout`` or ``failed``.
    outcome: str = "clean"
    duration: float = 0.0
    #: How the second job's start was decided: ``held`` (the first job was stopped),
    #: ``inside_transaction``, ``after_delay``, ``together``, ``after_first_finished``, or
    #: ``not_started`` when the attempt timed out first.
    second_started: str = "not_started"
    #: The hold: how long the first job was stopped, and why it was resumed.
    held_seconds: float | None = None
    resumed: str | None = None
    timed_out: bool = False
    exit_codes: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(JOBS))
    pids: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(JOBS))
    #: Jobs of which at least one database session was seen.
    seen: set[str] = field(default_factory=set)
    #: Statements seen inside a transaction, per job (the sweep holds at later ones).
    statements: dict[str, int] = field(default_factory=lambda: dict.fromkeys(JOBS, 0))
    waits: list[Wait] = field(default_factory=list)
    cycle: tuple[Wait, ...] | None = None
    #: The cycle read as a lock order, with a suggested fix (from the first look at it).
    advice: Advice | None = None
    deadlock_lines: dict[str, list[str]] = field(default_factory=lambda: {j: [] for j in JOBS})
    server_timeout_lines: dict[str, list[str]] = field(
        default_factory=lambda: {j: [] for j in JOBS}
    )
    output_tail: dict[str, list[str]] = field(default_factory=lambda: {j: [] for j in JOBS})
    #: A session of the held job ended by the server while it was held.
    ended_while_held: bool = False
    notes: list[str] = field(default_factory=list)

    @property
    def second(self) -> str:
        """The job started second."""
        return "B" if self.first == "A" else "A"

    def take_output(self, job: str, status: int, text: str) -> None:
        """Record ``job``'s exit status and what its (already redacted) output reports."""
        self.exit_codes[job] = status
        self.deadlock_lines[job] = _matching(text, _DEADLOCK, _DEADLOCK_DETAIL)
        self.server_timeout_lines[job] = _matching(text, _SERVER_TIMEOUT)
        self.output_tail[job] = [line.rstrip() for line in text.splitlines()[-TAIL_LINES:]]

    def decide(self) -> None:
        """Set the outcome from what was recorded."""
        if any(self.deadlock_lines.values()):
            self.outcome = "deadlock"
        elif self.ended_while_held or (
            self.held_seconds is not None and any(self.server_timeout_lines.values())
        ):
            self.outcome = "server_timeout"
        elif self.timed_out:
            self.outcome = "timeout"
        elif any(code for code in self.exit_codes.values()):
            self.outcome = "failed"
        else:
            self.outcome = "clean"

    def exits(self) -> str:
        """``A exit 1, B exit 0`` (``B not started`` when it never ran)."""
        return ", ".join(
            f"{job} not started" if code is None else f"{job} exit {code}"
            for job, code in self.exit_codes.items()
        )

    def as_json(self) -> dict[str, Any]:
        """The attempt as stable JSON fields."""
        return {
            "attempt": self.number,
            "outcome": self.outcome,
            "first": self.first,
            "hold_at": self.hold_at,
            "second_started": self.second_started,
            "held_seconds": None if self.held_seconds is None else round(self.held_seconds, 3),
            "resumed": self.resumed,
            "timed_out": self.timed_out,
            "duration": round(self.duration, 3),
            "exit_codes": self.exit_codes,
            "pids": self.pids,
            "statements": self.statements,
            "cycle": [wait.as_json() for wait in self.cycle] if self.cycle else None,
            "advice": self.advice.as_json() if self.advice else None,
            "waits": [wait.as_json() for wait in self.waits],
            "deadlock_lines": self.deadlock_lines,
            "server_timeout_lines": self.server_timeout_lines,
            "output_tail": self.output_tail,
            "notes": self.notes,
        }


def _matching(
    text: str, marker: re.Pattern[str], detail: re.Pattern[str] | None = None
) -> list[str]:
    """The lines of ``text`` that ``marker`` (or, once it matched, ``detail``) finds, last ones."""
    if not marker.search(text):
        return []
    found = [
        line.strip()
        for line in text.splitlines()
        if marker.search(line) or (detail is not None and detail.search(line))
    ]
    # The last report is the one that matters when a command printed several.
    return list(collections.deque(found, maxlen=ERROR_LINES))


@dataclass
class Report:
    """Every attempt of one ``jobrun overlap``, and what they add up to."""

    database: str
    first: tuple[str, ...]
    second: tuple[str, ...]
    runs: int
    start: str = "hold"
    attempts: list[Attempt] = field(default_factory=list)
    #: Notes about the whole run (server settings that can end a held session).
    run_notes: list[str] = field(default_factory=list)

    def count(self, outcome: str) -> int:
        """Attempts that ended with ``outcome``."""
        return sum(attempt.outcome == outcome for attempt in self.attempts)

    @property
    def deadlocks(self) -> int:
        """Attempts in which a command reported a deadlock error."""
        return self.count("deadlock")

    @property
    def silent_cycles(self) -> int:
        """Attempts with a wait-for cycle but no deadlock error (a command retried, say)."""
        return sum(a.cycle is not None and a.outcome != "deadlock" for a in self.attempts)

    @property
    def waits_observed(self) -> int:
        """Distinct waits of a job's session on another session, over all attempts."""
        return sum(len(attempt.waits) for attempt in self.attempts)

    @property
    def first_deadlock(self) -> int | None:
        """The number of the first attempt that deadlocked (or showed a cycle), or None."""
        return next((a.number for a in self.attempts if a.outcome == "deadlock" or a.cycle), None)

    @property
    def exit_status(self) -> int:
        """0 with no deadlock in any attempt, 1 otherwise (a silent cycle is a deadlock too)."""
        return 1 if self.deadlocks or self.silent_cycles else 0

    def cycles(self) -> list[tuple[list[int], tuple[Wait, ...]]]:
        """Distinct cycles, most common first: the attempts that saw each, and its first sight."""
        found: dict[tuple[tuple[str | None, ...], ...], tuple[list[int], tuple[Wait, ...]]] = {}
        for attempt in self.attempts:
            if attempt.cycle is not None:
                # Sorted: the same cycle found from B's side is still the same cycle.
                signature = tuple(sorted(wait.signature() for wait in attempt.cycle))
                found.setdefault(signature, ([], attempt.cycle))[0].append(attempt.number)
        return sorted(found.values(), key=lambda seen: (-len(seen[0]), seen[0][0]))

    def advice_lines(self) -> list[str]:
        """The advice of the most common cycle, for the human report."""
        cycles = self.cycles()
        if not cycles:
            return []
        numbers = cycles[0][0]
        attempt = next(a for a in self.attempts if a.number == numbers[0])
        return attempt.advice.lines() if attempt.advice is not None else []

    def advice_of(self, number: int) -> dict[str, Any] | None:
        """The advice (as JSON) of attempt ``number``'s cycle."""
        attempt = next(a for a in self.attempts if a.number == number)
        return attempt.advice.as_json() if attempt.advice else None

    def notes(self) -> list[str]:
        """Every note once, with the attempts that made it, plus what no attempt ever saw."""
        made: dict[str, list[int]] = {}
        for attempt in self.attempts:
            for note in attempt.notes:
                made.setdefault(note, []).append(attempt.number)
        notes = [*self.run_notes]
        notes += [f"{attempts_text(numbers)}: {note}" for note, numbers in made.items()]
        for job in JOBS:
            started = [a for a in self.attempts if a.exit_codes[job] is not None]
            if started and not any(job in a.seen for a in started):
                notes.append(
                    f"no database session of {job} was seen in {self.database}: the command must "
                    "connect to that database through libpq and leave application_name unset "
                    "(PGAPPNAME names its sessions)"
                )
        return notes

    def as_json(self) -> dict[str, Any]:
        """The report as one stable JSON object."""
        return {
            "database": self.database,
            "first": list(self.first),
            "second": list(self.second),
            "runs": self.runs,
            "start": self.start,
            "attempts_run": len(self.attempts),
            "deadlocks": self.deadlocks,
            "first_deadlock": self.first_deadlock,
            "cycles_without_deadlock_error": self.silent_cycles,
            "server_timeouts": self.count("server_timeout"),
            "timeouts": self.count("timeout"),
            "failed": self.count("failed"),
            "clean": self.count("clean"),
            "waits_observed": self.waits_observed,
            "exit_status": self.exit_status,
            "cycles": [
                {
                    "attempts": numbers,
                    "waits": [wait.as_json() for wait in cycle],
                    "advice": self.advice_of(numbers[0]),
                }
                for numbers, cycle in self.cycles()
            ],
            "attempts": [attempt.as_json() for attempt in self.attempts],
            "notes": self.notes(),
        }


def attempts_text(numbers: Sequence[int]) -> str:
    """``attempt 3``, ``attempts 1-4, 7``."""
    spans: list[list[int]] = []
    for number in numbers:
        if spans and number == spans[-1][-1] + 1:
            spans[-1].append(number)
        else:
            spans.append([number])
    text = ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in spans)
    return f"attempt {text}" if len(numbers) == 1 else f"attempts {text}"
