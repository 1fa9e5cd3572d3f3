"""Run the attempts: start the two jobs, hold the first at its transaction, watch, clean up."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psycopg

from jobrun import db, durations
from jobrun.analysis.overlap.jobs import Job
from jobrun.analysis.overlap.model import JOBS
from jobrun.analysis.overlap.report import Attempt, Report
from jobrun.analysis.overlap.watch import POLL_INTERVAL, Watch, app_name, server_timeouts
from jobrun.exitcodes import Interrupted, JobrunError, UsageError
from jobrun.ops.interrupts import Interrupts
from jobrun.run import alerts

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator, Mapping

    from jobrun.analysis.overlap.model import Session

#: ``--start`` modes besides a fixed delay.
START_MODES = ("hold", "inside", "together")
#: A held job is resumed by this share of the attempt's remaining time at the latest, so
#: that both jobs still have time to finish.
HOLD_SHARE_OF_TIMEOUT = 0.5
#: ... and by this share of idle_in_transaction_session_timeout, which would end its session.
HOLD_SHARE_OF_IDLE_TIMEOUT = 0.8
#: A point of the sweep that found a deadlock is kept until it misses this many times in a row.
MISSES_BEFORE_MOVING_ON = 2
#: The sweep tries at most this many statements deep.
DEEPEST_HOLD = 50


def parse_command(text: str, *, option: str) -> tuple[str, ...]:
    """``--first``/``--second`` as an argv (shell-style quoting, no shell), or UsageError."""
    if not text.strip():
        raise UsageError(f"{option} is empty: give a command, e.g. {option} './job.sh'")
    try:
        return alerts.parse_command(text)
    except UsageError as exc:
        message = str(exc).removeprefix("--on-alert")  # the text itself is left alone
        raise UsageError(f"{option}{message}") from None


def parse_start(text: str) -> tuple[str, float]:
    """``--start``: (mode, delay): ``hold``, ``inside``, ``together``, or ``delay`` and seconds."""
    mode = text.strip().lower()
    if mode in START_MODES:
        return mode, 0.0
    try:
        return "delay", durations.parse(text, option="--start")
    except UsageError:
        raise UsageError(
            f"--start: {text!r} is none of hold, inside, together or a duration (e.g. 200ms)"
        ) from None


@dataclass(frozen=True)
class Plan:
    """What to run, where to watch, and for how long."""

    first: tuple[str, ...]
    second: tuple[str, ...]
    target: db.Target
    runs: int = 10
    #: Seconds per attempt, from the first job's start; then both process groups are killed.
    timeout: float = 60.0
    #: hold, inside, together or delay (see parse_start).
    start: str = "hold"
    #: With ``start="delay"``: seconds from the first job's start to the second's.
    delay: float = 0.0
    #: Alternate which job goes first (A in odd attempts of the sweep, B in even ones).
    alternate: bool = True
    poll_interval: float = POLL_INTERVAL

    def __post_init__(self) -> None:
        if self.runs < 1:
            raise UsageError(f"--runs must be at least 1, not {self.runs}")
        if self.timeout <= 0:
            raise UsageError("--timeout must be longer than 0")
        if self.start not in (*START_MODES, "delay"):
            raise UsageError(f"--start: unknown mode {self.start!r}")
        if self.start == "delay" and self.delay >= self.timeout:
            raise UsageError("--start: the delay must be shorter than --timeout")

    @property
    def start_text(self) -> str:
        """The --start value, as given (a delay in seconds)."""
        return f"{self.delay:g}s" if self.start == "delay" else self.start


class Schedule:
    """Which job goes first, and at which of its statements it is held, attempt after attempt.

    Holding the first job at its first statement finds a lock-order cycle whenever that
    statement takes the first lock of the cycle; when it does not, the sweep holds each job
    in turn at later statements (as many as it was seen to run). A point that found a
    deadlock is kept: the aim is a cycle in as few attempts as possible, then every time.
    """

    def __init__(self, plan: Plan) -> None:
        self.sweep = plan.start == "hold"
        self.order = JOBS if plan.alternate else ("A",)
        #: The most statements seen inside a transaction, per job: how deep to sweep.
        self.most = dict.fromkeys(JOBS, 1)
        self.position = 0
        self.found: tuple[str, int | None] | None = None
        self.misses = 0

    def points(self) -> list[tuple[str, int | None]]:
        """The sweep, in order: (job that goes first, statement to hold it at)."""
        if not self.sweep:
            return [(job, None) for job in self.order]
        depth = min(DEEPEST_HOLD, max(self.most[job] for job in self.order))
        return [(job, k) for k in range(1, depth + 1) for job in self.order if k <= self.most[job]]

    def next(self) -> tuple[str, int | None]:
        """The point of the next attempt."""
        if self.found is not None:
            return self.found
        points = self.points()
        return points[self.position % len(points)]

    def record(self, attempt: Attempt) -> None:
        """Learn from an attempt: keep a point that deadlocked, else move on."""
        for job in JOBS:
            self.most[job] = max(self.most[job], attempt.statements[job])
        point = (attempt.first, attempt.hold_at)
        if attempt.outcome == "deadlock" or attempt.cycle is not None:
            self.found, self.misses = point, 0
            return
        if self.found is not None:
            self.misses += 1
            if self.misses < MISSES_BEFORE_MOVING_ON:
                return
            self.found, self.misses = None, 0
        points = self.points()
        self.position = points.index(point) + 1 if point in points else self.position + 1


def environment(environ: Mapping[str, str], job: str, attempt: int) -> dict[str, str]:
    """``environ`` plus PGAPPNAME, JOBRUN_OVERLAP_ROLE and JOBRUN_OVERLAP_ATTEMPT for ``job``."""
    env = dict(environ)
    env["PGAPPNAME"] = app_name(job, attempt)
    env["JOBRUN_OVERLAP_ROLE"] = job
    env["JOBRUN_OVERLAP_ATTEMPT"] = str(attempt)
    return env


def _stop(signum: int, previous: object) -> None:
    """A stop signal as Interrupted (128+N); SIGINT as before this command (a quiet 130)."""
    if signum == signal.SIGINT:
        if callable(previous):  # jobrun's quiet exit 130, or KeyboardInterrupt
            previous(signal.SIGINT, None)
        raise KeyboardInterrupt
    raise Interrupted(signum, "the commands were killed and their database sessions ended")


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
        start=plan.start_text,
    )
    interrupts = Interrupts(_stop)
    schedule = Schedule(plan)
    # Connect first: with no database to watch, neither command is started (exit 69).
    with (
        interrupts.installed(),
        db.connect(plan.target, app_name="jobrun-overlap") as conn,
    ):
        try:
            idle_timeout = server_timeouts(conn, plan.target).get(
                "idle_in_transaction_session_timeout", 0.0
            )
            if plan.start == "hold" and idle_timeout:
                report.run_notes.append(
                    f"idle_in_transaction_session_timeout is {idle_timeout:g}s here: a held job "
                    f"is resumed within {HOLD_SHARE_OF_IDLE_TIMEOUT:.0%} of it (a job that sets "
                    "a shorter one may be ended while held: such attempts count as "
                    "server_timeout)"
                )
            for number in range(1, plan.runs + 1):
                first, hold_at = schedule.next()
                attempt = Attempt(number, first=first, hold_at=hold_at)
                _attempt(_Context(plan, conn, environ, interrupts, idle_timeout), attempt)
                schedule.record(attempt)
                report.attempts.append(attempt)
                if progress is not None:
                    progress(attempt)
        except BaseException:
            # A signal may have cut a statement short: close, no rollback on a busy connection.
            conn.close()
            raise
    return report


@dataclass(frozen=True)
class _Context:
    """What every attempt of one run shares."""

    plan: Plan
    conn: psycopg.Connection[tuple[object, ...]]
    environ: Mapping[str, str] = field(repr=False)  # the jobs' secrets are in it
    interrupts: Interrupts
    #: idle_in_transaction_session_timeout in seconds (0: off): it ends a job held too long.
    idle_timeout: float


def _attempt(ctx: _Context, attempt: Attempt) -> None:
    """Run one attempt, filling in ``attempt``."""
    plan = ctx.plan
    watch = Watch(ctx.conn, plan.target, attempt)
    argv = {"A": plan.first, "B": plan.second}
    jobs: dict[str, Job] = {}
    started = time.monotonic()
    deadline = started + plan.timeout
    finished = completed = False

    def start(job: str) -> Job:
        with ctx.interrupts.held():
            jobs[job] = Job(job, argv[job], environment(ctx.environ, job, attempt.number))
        attempt.pids[job] = jobs[job].pid
        return jobs[job]

    try:
        first = start(attempt.first)
        attempt.second_started = _until_second_may_start(plan, watch, first, deadline)
        if attempt.second_started == "held":
            _hold(ctx, watch, first, lambda: start(attempt.second), deadline)
        elif attempt.second_started != "not_started":
            start(attempt.second)
        if attempt.second_started != "not_started":
            finished = _watch_until_done(plan, watch, jobs.values(), deadline)
        completed = True
    finally:
        # Also on an exception, ^C or a stop signal: the commands run in sessions of their
        # own, so nobody else would stop them (or resume a held one); a killed command's
        # backend can keep its locks (and go on waiting) until it is terminated.
        with ctx.interrupts.held():
            outputs = {job: proc.finish() for job, proc in jobs.items()}
            if jobs and not finished:
                _end_sessions(watch, quietly=not completed)
    attempt.duration = time.monotonic() - started
    attempt.timed_out = not finished
    _add_notes(plan, attempt)
    secrets = plan.target.secrets
    for job, (status, text) in outputs.items():
        attempt.take_output(job, status, db.redact(text, secrets))
    attempt.decide()


def _hold(
    ctx: _Context, watch: Watch, first: Job, start_second: Callable[[], Job], deadline: float
) -> None:
    """Hold ``first`` where it is, start the second job, resume ``first`` once it caught up."""
    attempt = watch.attempt
    with ctx.interrupts.held():
        first.hold()
    held_at = time.monotonic()
    sessions = {s.pid for s in watch.look() if s.job == first.job}
    second = start_second()
    limit = (deadline - held_at) * HOLD_SHARE_OF_TIMEOUT
    if ctx.idle_timeout:
        limit = min(limit, ctx.idle_timeout * HOLD_SHARE_OF_IDLE_TIMEOUT)
    try:
        attempt.resumed = _until_caught_up(
            ctx.plan, watch, second, held=first.job, sessions=sessions, limit=held_at + limit
        )
    finally:
        with ctx.interrupts.held():
            first.resume()
    attempt.held_seconds = time.monotonic() - held_at
    attempt.ended_while_held = attempt.resumed == "session_ended"


def _add_notes(plan: Plan, attempt: Attempt) -> None:
    first, second = attempt.first, attempt.second
    if attempt.second_started == "after_first_finished":
        attempt.notes.append(_why_not_held(plan, attempt))
    if attempt.resumed == "session_ended":
        attempt.notes.append(
            f"a session of {first} ended while it was held (a server-side timeout such as "
            "idle_in_transaction_session_timeout?)"
        )
    elif attempt.resumed == "hold_limit":
        attempt.notes.append(
            f"{second} neither waited for a lock nor exited while {first} was held: "
            f"{first} was resumed at the hold limit"
        )


def _why_not_held(plan: Plan, attempt: Attempt) -> str:
    first, second = attempt.first, attempt.second
    if plan.start == "hold":
        what = f"its statement {attempt.hold_at} was seen inside a transaction"
    elif plan.start == "inside":
        what = "it was seen inside a transaction"
    else:
        what = "--start's delay ran out"
    return f"{first} finished before {what}; {second} was started anyway"


def _end_sessions(watch: Watch, *, quietly: bool) -> None:
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


def _until_second_may_start(plan: Plan, watch: Watch, first: Job, deadline: float) -> str:
    """Wait until the second job may start; how that was decided (see Attempt.second_started)."""
    if plan.start == "together":
        return "together"
    started = time.monotonic()
    hold_at = watch.attempt.hold_at or 1
    for tick, sessions in _looks(plan, watch, deadline):
        if plan.start == "hold":
            if watch.statements(first.job) >= hold_at:
                return "held"
        elif plan.start == "inside":
            if any(s.job == first.job and s.in_transaction for s in sessions):
                return "inside_transaction"
        elif tick - started >= plan.delay:
            return "after_delay"
        if first.exited():
            return "after_first_finished"
    return "not_started"


def _until_caught_up(
    plan: Plan, watch: Watch, second: Job, *, held: str, sessions: set[int], limit: float
) -> str:
    """Wait, while ``held`` is stopped, until the second job has caught up; why it ended.

    Caught up: one of its sessions waits for a lock (for the held job's, or anybody's):
    it went as far as it can before the held job moves again, holding whatever it took on
    the way. Also ``second_exited``; ``session_ended`` when a held session disappeared (a
    server-side timeout); ``hold_limit`` when the hold ran out of time.
    """
    for _, seen in _looks(plan, watch, limit):
        if any(s.job == second.job and s.waiting for s in seen):
            return "second_waits"
        if sessions - {s.pid for s in seen if s.job == held}:
            return "session_ended"
        if second.exited():
            return "second_exited"
    return "hold_limit"


def _watch_until_done(plan: Plan, watch: Watch, jobs: Iterable[Job], deadline: float) -> bool:
    """Watch until every command has exited (True) or the attempt's time ran out (False)."""
    jobs = list(jobs)
    # A look at a time (each records what it saw) until one finds every command exited.
    return any(all(job.exited() for job in jobs) for _ in _looks(plan, watch, deadline))


def _looks(plan: Plan, watch: Watch, until: float) -> Iterator[tuple[float, list[Session]]]:
    """A look at the sessions every poll interval: (when it began, the sessions seen).

    Ends after the look that began at or past ``until`` (the caller's time ran out); the
    pause before the last look is cut short to end at ``until``.
    """
    while True:
        tick = time.monotonic()
        yield tick, watch.look()
        if tick >= until:
            return
        time.sleep(max(0.0, min(tick + plan.poll_interval, until) - time.monotonic()))
