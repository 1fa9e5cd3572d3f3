"""``jobrun overlap``: run two commands against each other on purpose and catch their deadlocks."""

from __future__ import annotations

import collections
import contextlib
import os
import re
import shlex
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import IO, TYPE_CHECKING, Any

import psycopg

from jobrun import alerts, db, durations, sql
from jobrun.exitcodes import Exit, JobrunError, UsageError, from_wait_status
from jobrun.interrupts import Interrupts
from jobrun.supervise import ExecFailed

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Mapping, Sequence

#: The two jobs: A starts first, B once A is inside a transaction.
JOBS = ("A", "B")
#: How often the watcher looks at pg_stat_activity / pg_locks while the jobs run. A deadlock
#: lasts deadlock_timeout (1 s by default) before PostgreSQL breaks it, so this sees it; with
#: deadlock_timeout set far lower the cycle can go unseen (the error still counts).
POLL_INTERVAL = 0.025
#: Characters of a session's statement kept in a report.
QUERY_CHARS = 200
#: How much of each command's output (stdout and stderr, from the end) is searched for errors.
OUTPUT_SCAN_BYTES = 1 << 20
#: Lines of each command's output kept in a report.
TAIL_LINES = 10
#: Deadlock error lines kept per command and attempt.
ERROR_LINES = 8
#: How long to wait for the sessions of a killed attempt to be gone.
END_SESSIONS_WAIT = 5.0
#: Longest command shown in the human report (the JSON has every argument).
COMMAND_CHARS = 120

_DEADLOCK = re.compile(r"deadlock detected|40P01|DeadlockDetected", re.IGNORECASE)
#: The rest of PostgreSQL's deadlock report: who waited for what, and where.
_DEADLOCK_DETAIL = re.compile(r"Process \d+ waits for|while \w+ tuple", re.IGNORECASE)


def app_name(job: str, attempt: int) -> str:
    """The application_name the sessions of ``job`` get in ``attempt`` (through PGAPPNAME)."""
    return f"jobrun-overlap:{job}:{attempt}"


def parse_command(text: str, *, option: str) -> tuple[str, ...]:
    """``--first``/``--second`` as an argv (shell-style quoting, no shell), or UsageError."""
    if not text.strip():
        raise UsageError(f"{option} is empty: give a command, e.g. {option} './job.sh'")
    try:
        return alerts.parse_command(text)
    except UsageError as exc:
        message = str(exc).removeprefix("--on-alert")  # the text itself is left alone
        raise UsageError(f"{option}{message}") from None


def parse_start_after(text: str) -> float | None:
    """``--start-after``: None for ``inside`` (once A is inside a transaction), else seconds."""
    if text.strip().lower() == "inside":
        return None
    try:
        return durations.parse(text, option="--start-after")
    except UsageError:
        raise UsageError(
            f"--start-after: {text!r} is neither 'inside' nor a duration (examples: 200ms, 1s)"
        ) from None


@dataclass(frozen=True)
class Plan:
    """What to run, where to watch, and for how long."""

    first: tuple[str, ...]
    second: tuple[str, ...]
    target: db.Target
    runs: int = 10
    #: Seconds per attempt, from A's start; then both process groups are killed.
    timeout: float = 60.0
    #: Seconds from A's start to B's; None: as soon as A is seen inside a transaction.
    start_after: float | None = None
    poll_interval: float = POLL_INTERVAL

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise UsageError(f"--runs must be at least 1, not {self.runs}")
        if self.timeout <= 0:
            raise UsageError("--timeout must be longer than 0")
        if self.start_after is not None and self.start_after >= self.timeout:
            raise UsageError("--start-after must be shorter than --timeout")


@dataclass(frozen=True)
class Lock:
    """A lock a session waits for, as pg_locks shows it."""

    locktype: str
    mode: str
    relation: str | None = None
    #: The transaction id, tuple, page or advisory key: whatever the lock type names.
    ident: str | None = None
    #: For a wait on a transaction: the row (tuple lock) the waiter holds meanwhile.
    row: str | None = None
    row_relation: str | None = None

    def describe(self) -> str:
        """``ShareLock on transaction 456 (row (0,2) of accounts)``."""
        what = {
            "transactionid": f"transaction {self.ident}",
            "virtualxid": f"virtual transaction {self.ident}",
            "relation": f"relation {self.relation}",
            "tuple": f"row {self.ident} of {self.relation}",
            "page": f"page {self.ident} of {self.relation}",
            "extend": f"extension of {self.relation}",
            "advisory": f"advisory lock {self.ident}",
        }.get(self.locktype)
        if what is None:
            where = f" {self.relation}" if self.relation else ""
            what = f"{self.locktype} lock{where}" + (f" {self.ident}" if self.ident else "")
        row = f" (row {self.row} of {self.row_relation})" if self.row else ""
        return f"{self.mode} on {what}{row}"

    def as_json(self) -> dict[str, Any]:
        """The lock's pg_locks fields."""
        return {
            "locktype": self.locktype,
            "mode": self.mode,
            "relation": self.relation,
            "id": self.ident,
            "row": self.row,
            "row_relation": self.row_relation,
        }


@dataclass(frozen=True)
class Session:
    """One database session of a job, as one look at the server saw it."""

    job: str
    pid: int
    in_transaction: bool
    query: str
    blocked_by: tuple[int, ...] = ()
    lock: Lock | None = None


@dataclass(frozen=True)
class Wait:
    """One edge of the wait-for graph: a job's session blocked by another session."""

    job: str
    pid: int
    query: str
    lock: Lock | None
    #: ``A``, ``B``, or ``other`` for a session that belongs to neither command.
    holder_job: str
    holder_pid: int

    def describe(self) -> str:
        """``A (pid 1) waits for ShareLock on transaction 7 held by B (pid 2) while running: Q``."""
        lock = self.lock.describe() if self.lock else "a lock"
        return (
            f"{self.job} (pid {self.pid}) waits for {lock} held by {self.holder_job} "
            f"(pid {self.holder_pid}) while running: {self.query}"
        )

    def signature(self) -> tuple[str | None, ...]:
        """What makes two attempts' waits "the same": not pids, transaction ids or row positions."""
        lock = self.lock or Lock("", "")
        return (
            self.job,
            self.holder_job,
            lock.locktype,
            lock.mode,
            lock.relation,
            lock.row_relation,
            self.query,
        )

    def as_json(self) -> dict[str, Any]:
        """The edge, with the lock's fields and a ready-made sentence."""
        return {
            "job": self.job,
            "pid": self.pid,
            "query": self.query,
            "lock": self.lock.as_json() if self.lock else None,
            "held_by": {"job": self.holder_job, "pid": self.holder_pid},
            "text": self.describe(),
        }


def find_cycle(sessions: Sequence[Session]) -> tuple[Wait, ...] | None:
    """A wait-for cycle among ``sessions`` (starting at A's side when it can), or None."""
    by_pid = {session.pid: session for session in sessions}
    for start in sorted(sessions, key=lambda session: (session.job, session.pid)):
        path = _path_back_to(start.pid, start.pid, by_pid, {start.pid})
        if path is not None:
            return tuple(
                _wait(by_pid[pid], path[(i + 1) % len(path)], by_pid) for i, pid in enumerate(path)
            )
    return None


def _path_back_to(
    pid: int, start: int, by_pid: Mapping[int, Session], seen: set[int]
) -> list[int] | None:
    """The sessions from ``pid`` along blocked-by edges back to ``start``, or None."""
    for blocker in by_pid[pid].blocked_by:
        if blocker == start:
            return [pid]
        if blocker in by_pid and blocker not in seen:
            seen.add(blocker)
            rest = _path_back_to(blocker, start, by_pid, seen)
            if rest is not None:
                return [pid, *rest]
    return None


def _wait(session: Session, holder_pid: int, by_pid: Mapping[int, Session]) -> Wait:
    holder = by_pid.get(holder_pid)
    return Wait(
        job=session.job,
        pid=session.pid,
        query=session.query,
        lock=session.lock,
        holder_job=holder.job if holder else "other",
        holder_pid=holder_pid,
    )


@dataclass
class Attempt:
    """One run of A against B and what was seen."""

    number: int
    #: ``clean``, ``deadlock``, ``timeout`` or ``failed``.
    outcome: str = "clean"
    duration: float = 0.0
    #: How B's start was decided: ``inside_transaction``, ``after_delay``,
    #: ``after_a_finished``, or ``not_started`` when the attempt timed out first.
    b_started: str = "not_started"
    timed_out: bool = False
    exit_codes: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(JOBS))
    pids: dict[str, int | None] = field(default_factory=lambda: dict.fromkeys(JOBS))
    #: Jobs of which at least one database session was seen.
    seen: set[str] = field(default_factory=set)
    waits: list[Wait] = field(default_factory=list)
    cycle: tuple[Wait, ...] | None = None
    deadlock_lines: dict[str, list[str]] = field(default_factory=lambda: {j: [] for j in JOBS})
    output_tail: dict[str, list[str]] = field(default_factory=lambda: {j: [] for j in JOBS})
    notes: list[str] = field(default_factory=list)

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
            "timed_out": self.timed_out,
            "duration": round(self.duration, 3),
            "b_started": self.b_started,
            "exit_codes": self.exit_codes,
            "pids": self.pids,
            "cycle": [wait.as_json() for wait in self.cycle] if self.cycle else None,
            "waits": [wait.as_json() for wait in self.waits],
            "deadlock_lines": self.deadlock_lines,
            "output_tail": self.output_tail,
            "notes": self.notes,
        }


_OUTCOME_WORDS = {
    "timeout": "in a timeout (both commands killed)",
    "failed": "with a failed command",
}


@dataclass
class Report:
    """Every attempt of one ``jobrun overlap``, and what they add up to."""

    database: str
    first: tuple[str, ...]
    second: tuple[str, ...]
    runs: int
    attempts: list[Attempt] = field(default_factory=list)

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

    def notes(self) -> list[str]:
        """Every note once, with the attempts that made it, plus what no attempt ever saw."""
        made: dict[str, list[int]] = {}
        for attempt in self.attempts:
            for note in attempt.notes:
                made.setdefault(note, []).append(attempt.number)
        notes = [f"{_attempts(numbers)}: {note}" for note, numbers in made.items()]
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
            "attempts_run": len(self.attempts),
            "deadlocks": self.deadlocks,
            "cycles_without_deadlock_error": self.silent_cycles,
            "timeouts": self.count("timeout"),
            "failed": self.count("failed"),
            "clean": self.count("clean"),
            "waits_observed": self.waits_observed,
            "exit_status": self.exit_status,
            "cycles": [
                {"attempts": numbers, "waits": [wait.as_json() for wait in cycle]}
                for numbers, cycle in self.cycles()
            ],
            "attempts": [attempt.as_json() for attempt in self.attempts],
            "notes": self.notes(),
        }

    def text(self) -> str:
        """The human report: one line per attempt, the totals, the cycle and its errors."""
        total = len(self.attempts)
        lines = [
            f"jobrun overlap: {_plural(total, 'attempt')} on {self.database}",
            f"  A: {_short(self.first)}",
            f"  B: {_short(self.second)}",
        ]
        for a in self.attempts:
            cycle = ", cycle seen" if a.cycle else ""
            lines.append(
                f"  attempt {a.number}: {a.outcome:<9}{a.exits()}, {a.duration:.2f}s{cycle}"
            )
        lines.append(
            f"{_plural(total, 'attempt')}, {_plural(self.deadlocks, 'deadlock')} "
            f"({self.deadlocks}/{total}), {_plural(self.waits_observed, 'wait')} observed"
        )
        if self.silent_cycles:
            lines.append(
                f"{_plural(self.silent_cycles, 'more attempt')} had a wait-for cycle but "
                "no deadlock error (did a command retry?)"
            )
        lines += [
            f"{_plural(self.count(outcome), 'attempt')} ended {words}"
            for outcome, words in _OUTCOME_WORDS.items()
            if self.count(outcome)
        ]
        lines += self._cycle_lines()
        lines += self._error_lines()
        lines += [f"note: {note}" for note in self.notes()]
        if self.exit_status:
            lines.append(
                f"deadlock in {self.deadlocks + self.silent_cycles} of {_plural(total, 'attempt')}"
            )
        else:
            unclean = self.count("timeout") + self.count("failed")
            but = f" (but {unclean} did not end cleanly: see above)" if unclean else ""
            lines.append(f"no deadlock in {_plural(total, 'attempt')}{but}")
        return "\n".join(lines)

    def _cycle_lines(self) -> list[str]:
        cycles = self.cycles()
        if cycles:
            numbers, cycle = cycles[0]
            also = f"; the same cycle in {len(numbers)} of {_plural(len(self.attempts), 'attempt')}"
            return [
                f"wait-for cycle (attempt {numbers[0]}{also}):",
                *(f"  {wait.describe()}" for wait in cycle),
            ]
        waited = next((a for a in self.attempts if a.waits), None)
        if waited is None:
            return []
        return [
            f"waits seen, no cycle (attempt {waited.number}):",
            *(f"  {wait.describe()}" for wait in waited.waits[:3]),
        ]

    def _error_lines(self) -> list[str]:
        deadlocked = next((a for a in self.attempts if a.outcome == "deadlock"), None)
        if deadlocked is not None:
            return [
                f"deadlock error (attempt {deadlocked.number}):",
                *(
                    f"  {job}: {line}"
                    for job, found in deadlocked.deadlock_lines.items()
                    for line in found
                ),
            ]
        failed = next((a for a in self.attempts if a.outcome == "failed"), None)
        if failed is None:
            return []
        lines = []
        for job, code in failed.exit_codes.items():
            if code:
                lines.append(f"last output of {job} (attempt {failed.number}, exit {code}):")
                lines += [f"  {line}" for line in failed.output_tail[job]] or ["  (none)"]
        return lines


def _plural(count: int, noun: str) -> str:
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def _attempts(numbers: Sequence[int]) -> str:
    """``attempt 3``, ``attempts 1-4, 7``."""
    spans: list[list[int]] = []
    for number in numbers:
        if spans and number == spans[-1][-1] + 1:
            spans[-1].append(number)
        else:
            spans.append([number])
    text = ", ".join(f"{s[0]}-{s[-1]}" if len(s) > 1 else str(s[0]) for s in spans)
    return f"attempt {text}" if len(numbers) == 1 else f"attempts {text}"


def _short(argv: Sequence[str]) -> str:
    text = " ".join(shlex.join(argv).split())
    return text if len(text) <= COMMAND_CHARS else text[: COMMAND_CHARS - 3] + "..."


class Interrupted(JobrunError):
    """SIGTERM or SIGHUP arrived: the commands were killed, their sessions ended."""

    def __init__(self, signum: int) -> None:
        super().__init__(
            f"interrupted by {signal.Signals(signum).name}: the commands were killed and "
            "their database sessions ended"
        )
        self.signum = signum
        self.exit_code = 128 + signum


def _stop(signum: int, previous: object) -> None:
    """SIGTERM and SIGHUP as Interrupted; SIGINT as before this command (a quiet 130)."""
    if signum == signal.SIGINT:
        if callable(previous):  # jobrun's quiet exit 130, or KeyboardInterrupt
            previous(signal.SIGINT, None)
        raise KeyboardInterrupt
    raise Interrupted(signum)


class _Job:
    """One command of an attempt: a process in a session of its own, its output in a file."""

    def __init__(self, job: str, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.job = job
        self.output: IO[bytes] = tempfile.TemporaryFile()  # noqa: SIM115 - closed in finish()
        option = "--first" if job == "A" else "--second"
        try:
            self.proc = subprocess.Popen(
                list(argv),
                env=dict(env),
                stdin=subprocess.DEVNULL,
                stdout=self.output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as exc:
            self.output.close()
            code = Exit.NOT_FOUND if isinstance(exc, FileNotFoundError) else Exit.NOT_EXECUTABLE
            raise ExecFailed(f"{option}: {argv[0]}: cannot run it ({exc.strerror})", code) from None

    def exited(self) -> bool:
        """Whether the command has exited, without reaping it (its group id stays ours)."""
        if self.proc.returncode is not None:
            return True
        if not hasattr(os, "waitid"):  # macOS: only reaping tells, and finish() then skips killpg
            return self.proc.poll() is not None
        # WNOWAIT: the zombie keeps the pid, so os.killpg below can never hit a stranger.
        return os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None

    def finish(self) -> tuple[int, str]:
        """Kill whatever is left in the group, reap the command; its exit status and output."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        status = from_wait_status(self.proc.wait())
        with self.output:
            size = self.output.seek(0, os.SEEK_END)
            self.output.seek(max(0, size - OUTPUT_SCAN_BYTES))
            text = self.output.read().decode("utf-8", "replace")
        return status, text


class _Watch:
    """The monitoring session's view of one attempt: its sessions, waits and first cycle."""

    def __init__(
        self,
        conn: psycopg.Connection[tuple[object, ...]],
        target: db.Target,
        attempt: Attempt,
    ) -> None:
        self.conn = conn
        self.target = target
        self.attempt = attempt
        self.names = {app_name(job, attempt.number): job for job in JOBS}
        self._waits: dict[tuple[object, ...], Wait] = {}
        # Sessions already there under this attempt's names (a killed earlier run, another
        # overlap on the same database) belong to somebody else.
        self.ignored = frozenset(session.pid for session in self.sessions())
        if self.ignored:
            attempt.notes.append(
                f"ignored {len(self.ignored)} session(s) that already carried the attempt's "
                "application names (another jobrun overlap on this database?)"
            )

    def sessions(self) -> list[Session]:
        """One look at the server: this attempt's sessions, their blockers and awaited locks."""
        with db.translate_errors(self.target, "watching the sessions"):
            rows = self.conn.execute(
                sql.OVERLAP_SESSIONS, {"names": list(self.names), "query_chars": QUERY_CHARS}
            ).fetchall()
        secrets = self.target.secrets
        return [_session(row, self.names, secrets) for row in rows]

    def look(self) -> list[Session]:
        """Look once and record new waits and the first cycle."""
        sessions = [s for s in self.sessions() if s.pid not in self.ignored]
        self.attempt.seen.update(session.job for session in sessions)
        by_pid = {session.pid: session for session in sessions}
        for session in sessions:
            for blocker in session.blocked_by:
                wait = _wait(session, blocker, by_pid)
                lock = wait.lock or Lock("", "")
                edge = (wait.pid, blocker, lock.locktype, lock.mode, lock.relation, lock.ident)
                if edge not in self._waits:
                    self._waits[edge] = wait
                    self.attempt.waits.append(wait)
        if self.attempt.cycle is None:
            self.attempt.cycle = find_cycle(sessions)
        return sessions

    def end_sessions(self) -> None:
        """Terminate what is left of the attempt's sessions, and wait until they are gone."""
        with db.translate_errors(self.target, "ending the sessions of a killed attempt"):
            try:
                self.conn.execute(sql.OVERLAP_TERMINATE, {"names": list(self.names)})
            except psycopg.errors.InsufficientPrivilege:
                self.attempt.notes.append(
                    "could not terminate the killed commands' sessions (needs "
                    "pg_signal_backend): the next attempt may meet their locks"
                )
                return
        deadline = time.monotonic() + END_SESSIONS_WAIT
        while self.look() and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL)


def _session(row: Sequence[object], names: Mapping[str, str], secrets: tuple[str, ...]) -> Session:
    (pid, name, in_xact, _wait_type, _wait_event, query, blockers, *lock) = row
    locktype, mode, relation, ident, row_relation, tuple_id = (_text(v) for v in lock)
    blocked_by = blockers if isinstance(blockers, list) else []
    return Session(
        job=names[str(name)],
        pid=int(str(pid)),
        in_transaction=bool(in_xact),
        query=db.redact(" ".join(str(query or "").split()), secrets),
        blocked_by=tuple(int(str(blocker)) for blocker in blocked_by),
        lock=(
            Lock(
                locktype,
                mode or "",
                relation,
                ident,
                tuple_id if locktype == "transactionid" else None,
                row_relation if locktype == "transactionid" else None,
            )
            if locktype
            else None
        ),
    )


def _text(value: object) -> str | None:
    return None if value is None else str(value)


def environment(environ: Mapping[str, str], job: str, attempt: int) -> dict[str, str]:
    """``environ`` plus PGAPPNAME, JOBRUN_OVERLAP_ROLE and JOBRUN_OVERLAP_ATTEMPT for ``job``."""
    env = dict(environ)
    env["PGAPPNAME"] = app_name(job, attempt)
    env["JOBRUN_OVERLAP_ROLE"] = job
    env["JOBRUN_OVERLAP_ATTEMPT"] = str(attempt)
    return env


def run(
    plan: Plan,
    *,
    environ: Mapping[str, str] | None = None,
    progress: Callable[[Attempt], None] | None = None,
) -> Report:
    """Run ``plan.runs`` attempts of A against B, watching the database; the report.

    WARNING: both commands run for real, ``runs`` times: point them at a staging database.
    """
    environ = os.environ if environ is None else environ
    secrets = plan.target.secrets
    report = Report(
        database=db.describe(plan.target),
        first=tuple(db.redact(arg, secrets) for arg in plan.first),
        second=tuple(db.redact(arg, secrets) for arg in plan.second),
        runs=plan.runs,
    )
    interrupts = Interrupts(_stop)
    # Connect first: with no database to watch, neither command is started (exit 69).
    with (
        interrupts.installed(),
        db.connect(plan.target, app_name="jobrun-overlap") as conn,
    ):
        try:
            for number in range(1, plan.runs + 1):
                attempt = _attempt(plan, conn, number, environ, interrupts)
                report.attempts.append(attempt)
                if progress is not None:
                    progress(attempt)
        except BaseException:
            # A signal may have cut a statement short: close, no rollback on a busy connection.
            conn.close()
            raise
    return report


def _attempt(
    plan: Plan,
    conn: psycopg.Connection[tuple[object, ...]],
    number: int,
    environ: Mapping[str, str],
    interrupts: Interrupts | None = None,
) -> Attempt:
    interrupts = interrupts or Interrupts(_stop)
    attempt = Attempt(number)
    watch = _Watch(conn, plan.target, attempt)
    jobs: dict[str, _Job] = {}
    started = time.monotonic()
    deadline = started + plan.timeout
    finished = completed = False
    try:
        with interrupts.held():
            jobs["A"] = _Job("A", plan.first, environment(environ, "A", number))
        attempt.pids["A"] = jobs["A"].proc.pid
        attempt.b_started = _wait_for_b(plan, watch, jobs["A"], deadline)
        if attempt.b_started != "not_started":
            with interrupts.held():
                jobs["B"] = _Job("B", plan.second, environment(environ, "B", number))
            attempt.pids["B"] = jobs["B"].proc.pid
            finished = _watch_until_done(plan, watch, jobs.values(), deadline)
        completed = True
    finally:
        # Also on an exception, ^C, SIGTERM or SIGHUP: the commands run in sessions of their
        # own, so nobody else would stop them; a killed command's backend can keep its locks
        # (and go on waiting) until it is terminated.
        with interrupts.held():
            outputs = {job: proc.finish() for job, proc in jobs.items()}
            if jobs and not finished:
                _end_sessions(watch, quietly=not completed)
    attempt.duration = time.monotonic() - started
    attempt.timed_out = not finished
    if attempt.b_started == "after_a_finished":
        when = "it was seen inside a transaction" if plan.start_after is None else "--start-after"
        attempt.notes.append(f"A finished before {when}; B was started anyway")
    secrets = plan.target.secrets
    for job, (status, text) in outputs.items():
        attempt.exit_codes[job] = status
        safe = db.redact(text, secrets)
        attempt.deadlock_lines[job] = _deadlock_lines(safe)
        attempt.output_tail[job] = [line.rstrip() for line in safe.splitlines()[-TAIL_LINES:]]
    attempt.outcome = _outcome(attempt)
    return attempt


def _end_sessions(watch: _Watch, *, quietly: bool) -> None:
    """End the attempt's sessions; ``quietly``: on the way out of a failure, best effort.

    On that way the watching connection may be broken, or stuck in the statement a signal
    cut short: a fresh one does the work.
    """
    if not quietly:
        watch.end_sessions()
        return
    with (
        contextlib.suppress(JobrunError, psycopg.Error),
        db.connect(watch.target, app_name="jobrun-overlap") as conn,
    ):
        watch.conn = conn
        watch.end_sessions()


def _wait_for_b(plan: Plan, watch: _Watch, first: _Job, deadline: float) -> str:
    """Wait until B may start; how that was decided (``not_started``: the time ran out)."""
    started = time.monotonic()
    while True:
        tick = time.monotonic()
        sessions = watch.look()
        if plan.start_after is None:
            if any(s.job == "A" and s.in_transaction for s in sessions):
                return "inside_transaction"
        elif tick - started >= plan.start_after:
            return "after_delay"
        if first.exited():
            return "after_a_finished"
        if tick >= deadline:
            return "not_started"
        _sleep_until(tick + plan.poll_interval, deadline)


def _watch_until_done(plan: Plan, watch: _Watch, jobs: Iterable[_Job], deadline: float) -> bool:
    """Watch until every command has exited (True) or the attempt's time ran out (False)."""
    jobs = list(jobs)
    while True:
        tick = time.monotonic()
        watch.look()
        if all(job.exited() for job in jobs):
            return True
        if tick >= deadline:
            return False
        _sleep_until(tick + plan.poll_interval, deadline)


def _sleep_until(moment: float, deadline: float) -> None:
    time.sleep(max(0.0, min(moment, deadline) - time.monotonic()))


def _deadlock_lines(text: str) -> list[str]:
    """The lines of a command's output that report a deadlock (empty: it reported none)."""
    if not _DEADLOCK.search(text):
        return []
    found = [
        line.strip()
        for line in text.splitlines()
        if _DEADLOCK.search(line) or _DEADLOCK_DETAIL.search(line)
    ]
    # The last report is the one that matters when a command printed several.
    return list(collections.deque(found, maxlen=ERROR_LINES))


def _outcome(attempt: Attempt) -> str:
    if any(attempt.deadlock_lines.values()):
        return "deadlock"
    if attempt.timed_out:
        return "timeout"
    if any(code for code in attempt.exit_codes.values()):
        return "failed"
    return "clean"
