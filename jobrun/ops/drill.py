"""``jobrun drill``: rehearse the crash paths against the user's own database, as a checklist."""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psycopg
from psycopg.rows import class_row

from jobrun import db, keys, procs, sql
from jobrun.exitcodes import Exit, Interrupted, LockStoreUnavailable, signal_status
from jobrun.ops.background import BackgroundRun
from jobrun.ops.interrupts import Interrupts

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import Callable, Iterator

#: How long any one step may take before it counts as failed (beyond the mode's own waits).
STEP_TIMEOUT = 30.0
#: Session mode: the server frees a killed jobrun's lock "at once", that is within this long.
AT_ONCE = 2.0
#: Lease mode: the next run (which retries every second) acquires within this long of the
#: lease's expiry; later is a failure too.
LEASE_LATE = 3.0
#: How long the next run may wait beyond the expected moment before the step fails.
NEXT_RUN_WAIT = 10.0
#: How long a killed jobrun's child gets to die (parent-death signal), then its group.
CHILD_DEATH_WAIT = 5.0
GROUP_DEATH_WAIT = 1.0
#: The command of the drill's own runs that must hold the lock for a while.
HOLD_COMMAND = ("sleep", "600")
APP_NAME = "jobrun:drill"


def _stop(signum: int, _previous: object) -> None:
    raise Interrupted(signum)


@dataclass
class Step:
    """One line of the checklist."""

    name: str
    passed: bool
    seconds: float
    detail: str = ""


@dataclass
class Drill:
    """Everything a drill needs: how to start jobrun, where the database is, the timings."""

    key: keys.Key
    mode: str
    target: db.Target
    command: tuple[str, ...]
    ttl: float
    kill_after: float
    heartbeat: float | None
    jobrun: tuple[str, ...] = (sys.executable, "-m", "jobrun")
    steps: list[Step] = field(default_factory=list)
    #: Every jobrun the drill started: whatever still runs is stopped at the end.
    runs: list[BackgroundRun] = field(default_factory=list)
    interrupts: Interrupts = field(default_factory=lambda: Interrupts(_stop))
    #: The step under way (name, start): an exception or a signal fails it.
    current: tuple[str, float] | None = None
    #: Lease owners the drill made up (the stranger it hands a lease to).
    owners: list[str] = field(default_factory=list)

    def args(self, *extra: str) -> list[str]:
        """Jobrun's argv for a run of this drill's key and mode."""
        argv = [*self.jobrun, "--key", self.key.label, "--mode", self.mode]
        argv += ["--kill-after", f"{self.kill_after}s", "--log-format", "json"]
        argv += ["--connect-timeout", f"{self.target.connect_timeout}s"]
        if self.mode == "lease":
            argv += ["--ttl", f"{self.ttl}s"]
        if self.heartbeat is not None:
            argv += ["--heartbeat", f"{self.heartbeat}s"]
        return [*argv, *extra]

    def env(self) -> dict[str, str]:
        """Our environment with the DSN passed on (never on a command line)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("JOBRUN_")}
        if self.target.dsn:
            env["JOBRUN_DSN"] = self.target.dsn
        return env

    def start(self, *extra: str) -> BackgroundRun:
        """A jobrun of this drill in the background, tracked (a signal cannot orphan it)."""
        with self.interrupts.held():
            run = BackgroundRun(self.args(*extra), self.env())
            self.runs.append(run)
        return run

    def complete(self, *extra: str, timeout: float) -> tuple[int | None, BackgroundRun]:
        """A jobrun of this drill to its end (killed after ``timeout``): its status."""
        run = self.start(*extra)
        return run.finish(timeout), run

    def begin(self, name: str) -> None:
        """A step starts."""
        self.current = (name, time.monotonic())

    def record(self, passed: bool, detail: str = "") -> bool:
        """The step under way ends: add its checklist line."""
        name, started = self.current or ("drill", time.monotonic())
        self.steps.append(Step(name, passed, time.monotonic() - started, detail))
        self.current = None
        return passed

    @contextlib.contextmanager
    def connect(self) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
        """The drill's own database session (autocommit), closed without a rollback.

        A signal may cut a statement short: a rollback on that busy connection would only
        add a warning.
        """
        conn = db.connect(self.target, app_name=APP_NAME)
        try:
            yield conn
        finally:
            conn.close()


def run_drill(drill: Drill, out: Callable[[str], None]) -> int:
    """Run every step, print the checklist; 0 only if every step passed.

    1 when a step failed (also when it raised: the checklist is printed all the same),
    128+N after signal N. An unreachable database raises LockStoreUnavailable (exit 69)
    before anything is started.
    """
    with drill.connect():
        pass
    out(
        f"jobrun drill: key {drill.key.label} (lock id {drill.key.lock_id}), "
        f"mode {drill.mode}, database {db.describe(drill.target)}"
    )
    with drill.interrupts.installed():
        failure: BaseException | None = None
        try:
            try:
                _steps(drill)
            except BaseException as exc:  # noqa: BLE001 - recorded below, once signals are held
                failure = exc
            # From here on a signal is only noted: the checklist and the cleanup run to the end.
            drill.interrupts.stop_raising()
            if isinstance(failure, Interrupted):
                drill.record(passed=False, detail=str(failure))
            elif isinstance(failure, Exception):  # a step that raised failed
                drill.record(passed=False, detail=f"error: {db.one_line(failure, drill.target)}")
        finally:
            # Even if a signal slipped in before stop_raising(): no run is left behind.
            drill.interrupts.stop_raising()
            _stop_runs(drill)
        if failure is not None and not isinstance(failure, Exception):
            raise failure  # KeyboardInterrupt from elsewhere, SystemExit: after the cleanup
    for step in drill.steps:
        mark = "PASS" if step.passed else "FAIL"
        detail = f"  {step.detail}" if step.detail else ""
        out(f"  [{mark}] {step.name:<48} {step.seconds:7.2f}s{detail}")
    if drill.interrupts.signum is not None:
        out(f"drill interrupted by {signal.Signals(drill.interrupts.signum).name}")
        return signal_status(drill.interrupts.signum)
    passed = bool(drill.steps) and all(step.passed for step in drill.steps)
    out("drill passed" if passed else "drill FAILED")
    return 0 if passed else 1


def _stop_runs(drill: Drill) -> None:
    """Stop every run still going and kill what is left of the jobs' process groups."""
    for run in drill.runs:
        run.stop(drill.kill_after + 5.0)
    for run in drill.runs:
        if run.child_pid is not None:
            procs.kill_group(run.child_pid)
    _cleanup(drill)


def _steps(drill: Drill) -> None:
    first = _first_run(drill)
    if first is None:
        return
    _second_instance(drill)
    killed = _kill_jobrun(drill, first)
    if drill.mode == "lease":
        _next_run_lease(drill, killed)
    else:
        _next_run_session(drill, killed)
    _lock_taken_away(drill)


def _first_run(drill: Drill) -> BackgroundRun | None:
    """1. A guarded run starts."""
    drill.begin("guarded run started")
    first = _guarded_run(drill)
    if first is not None:
        drill.record(passed=True)
    return first


def _guarded_run(drill: Drill) -> BackgroundRun | None:
    """A run of the drill's command whose child started; None (step failed) otherwise."""
    run = drill.start("--", *drill.command)
    started = run.wait_event("started", STEP_TIMEOUT)
    if started is None or run.child_pid is None:
        run.finish(5)
        drill.record(passed=False, detail=run.why())
        return None
    return run


def _second_instance(drill: Drill) -> None:
    """2. A second instance skips."""
    drill.begin("second instance skipped (exit 75)")
    status, run = drill.complete("--", "true", timeout=STEP_TIMEOUT)
    detail = f"exit {status}" if status == Exit.SKIPPED else run.why()
    drill.record(passed=status == Exit.SKIPPED, detail=detail)


@dataclass(frozen=True)
class _Killed:
    """When jobrun was killed, and (lease mode) its lease as the database saw it just before."""

    at: float
    #: (expires_at, the database's clock) read right before the kill.
    lease: tuple[dt.datetime, dt.datetime] | None = None
    #: Session mode: seconds after the kill when the lock was seen free (None: not yet).
    freed: float | None = None


def _kill_jobrun(drill: Drill, first: BackgroundRun) -> _Killed:
    """3. kill -9 of jobrun: the child and everything in its process group must die."""
    drill.begin("kill -9 of jobrun: the child died")
    child = first.child_pid
    if child is None:  # pragma: no cover - _first_run checked it
        raise RuntimeError("the first run has no child")
    with drill.connect() as conn:
        # Lease: read before the kill. A renewal can only move the expiry later, never
        # earlier, so the next run must not get the lease before this expires_at.
        lease = _lease(conn, drill) if drill.mode == "lease" else None
        at = time.monotonic()
        first.proc.send_signal(signal.SIGKILL)
        first.finish(STEP_TIMEOUT)
        # Session: one look right away, before the waits below can blur the time.
        freed = None
        if drill.mode == "session" and not _lock_held(conn, drill):
            freed = time.monotonic() - at
    killed = _Killed(at=at, lease=lease, freed=freed)
    child_died = procs.poll(lambda: procs.process_gone(child), CHILD_DEATH_WAIT)
    procs.poll(lambda: not procs.group_members(child), GROUP_DEATH_WAIT)
    survivors = procs.group_members(child)
    if not child_died:
        drill.record(passed=False, detail=f"the child (pid {child}) survived jobrun's death")
    elif survivors:
        drill.record(
            passed=False,
            detail=f"{survivors} process{'es' if survivors != 1 else ''} of the job's group "
            "survived jobrun's death: use exec or systemd, see README",
        )
    else:
        drill.record(passed=True)
    # They run unguarded now: the lock is free, or will be.
    procs.kill_group(child)
    return killed


@dataclass(frozen=True)
class _LeaseRow:
    """sql.DRILL_LEASE's row: the key's lease (all None without one) and the database's clock."""

    owner: str | None
    acquired_at: dt.datetime | None
    expires_at: dt.datetime | None
    now: dt.datetime


def _lease_row(conn: psycopg.Connection[tuple[object, ...]], drill: Drill) -> _LeaseRow | None:
    cursor = conn.cursor(row_factory=class_row(_LeaseRow))
    return cursor.execute(sql.DRILL_LEASE, (drill.key.lock_id,)).fetchone()


def _lease(
    conn: psycopg.Connection[tuple[object, ...]], drill: Drill
) -> tuple[dt.datetime, dt.datetime] | None:
    """(expires_at, the database's clock now) of the key's lease, or None without one."""
    row = _lease_row(conn, drill)
    if row is None or row.expires_at is None:
        return None
    return row.expires_at, row.now


def _lock_held(conn: psycopg.Connection[tuple[object, ...]], drill: Drill) -> bool:
    """Whether a session of the drill's database holds the key's advisory lock."""
    row = conn.execute(sql.DRILL_LOCK_HELD, drill.key.pg_locks_pair).fetchone()
    return bool(row and row[0])


def _next_run_session(drill: Drill, killed: _Killed) -> None:
    """4. The next run acquires at once: the server ends a dead client's session at once."""
    drill.begin("next run acquired after the crash")
    freed_after = killed.freed
    if freed_after is None:
        with drill.connect() as conn:
            freed = procs.poll(
                lambda: not _lock_held(conn, drill), killed.at + NEXT_RUN_WAIT - time.monotonic()
            )
        freed_after = time.monotonic() - killed.at
    else:
        freed = True
    if not freed:
        drill.record(
            passed=False,
            detail=f"lock still held {freed_after:.2f}s after the kill (expected at once)",
        )
        return
    status, run = drill.complete("--wait", f"{NEXT_RUN_WAIT}s", "--", "true", timeout=STEP_TIMEOUT)
    took = time.monotonic() - killed.at
    in_time = freed_after <= AT_ONCE
    detail = (
        f"lock free {freed_after:.2f}s after the kill"
        + ("" if in_time else f" (expected at once: within {AT_ONCE:g}s)")
        + (f"; next run done {took:.2f}s after the kill" if status == 0 else f"; {run.why()}")
    )
    drill.record(passed=in_time and status == 0, detail=detail)


def _next_run_lease(drill: Drill, killed: _Killed) -> None:
    """4. The lease outlives the crash, then the next run gets it: not before, not long after."""
    drill.begin("lease still held right after the crash")
    status, run = drill.complete("--", "true", timeout=STEP_TIMEOUT)
    drill.record(
        passed=status == Exit.SKIPPED,
        detail=f"exit {status}" if status in (0, Exit.SKIPPED) else run.why(),
    )
    drill.begin("next run acquired after the crash")
    if killed.lease is None:
        drill.record(passed=False, detail="the crashed run had no lease row before the kill")
        return
    expires_at, killed_on_db = killed.lease
    with drill.connect() as conn:
        # After the kill: a renewal sent just before it may have moved the expiry on.
        now_lease = _lease(conn, drill)
    latest = max(expires_at, now_lease[0]) if now_lease else expires_at
    expected = (expires_at - killed_on_db).total_seconds()
    wait = max(0.0, (latest - killed_on_db).total_seconds()) + NEXT_RUN_WAIT
    run = drill.start("--wait", f"{wait:.3f}s", "--", *HOLD_COMMAND)
    started = run.wait_event("started", wait + STEP_TIMEOUT)
    acquired_at = None
    if started is not None:
        with drill.connect() as conn:
            row = _lease_row(conn, drill)
        if row is not None and row.owner == started.get("run_id"):
            acquired_at = row.acquired_at
    run.stop(drill.kill_after + STEP_TIMEOUT)
    if started is None or acquired_at is None:
        why = run.why() if started is None else "its lease row was not found"
        drill.record(passed=False, detail=f"the next run did not acquire: {why}")
        return
    took = (acquired_at - killed_on_db).total_seconds()
    early = (expires_at - acquired_at).total_seconds()
    late = (acquired_at - latest).total_seconds()
    if early > 0:
        verdict = f"{early:.2f}s BEFORE the lease could expire"
    elif late > LEASE_LATE:
        verdict = f"{late:.2f}s after the lease expired (expected within {LEASE_LATE:g}s)"
    else:
        verdict = f"{max(0.0, late):.2f}s after the lease expired"
    drill.record(
        passed=early <= 0 and late <= LEASE_LATE,
        detail=f"{took:.2f}s after the kill, {verdict} (expected about {expected:.2f}s)",
    )


def _lock_taken_away(drill: Drill) -> None:
    """5. The lock is taken away mid-run: the child must be stopped."""
    drill.begin("lock taken away: child stopped (exit 76)")
    victim = _guarded_run(drill)
    if victim is None or victim.child_pid is None:
        return
    child = victim.child_pid
    t = time.monotonic()
    how = _take_lock_away(drill)
    lost = victim.wait_event("lock_lost", drill.ttl + STEP_TIMEOUT)
    detected = time.monotonic() - t
    status = victim.finish(drill.kill_after + STEP_TIMEOUT)
    child_gone = procs.process_gone(child)
    drill.record(
        passed=lost is not None and status == Exit.LOCK_LOST and child_gone,
        detail=f"{how}; noticed after {detected:.2f}s, exit {status}",
    )


def _take_lock_away(drill: Drill) -> str:
    """Terminate the lock's backend (session) or hand the lease to a stranger (lease)."""
    with drill.connect() as conn:
        if drill.mode == "session":
            classid, objid = drill.key.pg_locks_pair
            try:
                rows = conn.execute(sql.DRILL_TERMINATE_HOLDER, (classid, objid)).fetchall()
            except psycopg.errors.InsufficientPrivilege:
                return "could not terminate the backend (needs pg_signal_backend)"
            return "backend terminated" if any(row[0] for row in rows) else "backend not found"
        stranger = str(uuid.uuid4())
        drill.owners.append(stranger)
        conn.execute(sql.DRILL_STEAL_LEASE, (stranger, drill.key.lock_id))
        return "lease handed to another owner"


def _cleanup(drill: Drill) -> None:
    """Remove a lease the drill's runs left (a killed run's): never another job's lease."""
    if drill.mode != "lease":
        return
    owners = [*drill.owners]
    owners += [
        str(run.events[0]["run_id"])
        for run in drill.runs
        if run.events and "run_id" in run.events[0]
    ]
    try:
        with drill.connect() as conn:
            conn.execute(sql.DRILL_DELETE_LEASE, (drill.key.lock_id, owners))
    except (psycopg.Error, LockStoreUnavailable):
        pass
