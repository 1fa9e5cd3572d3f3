"""``jobrun drill``: rehearse the crash paths against the user's own database, as a checklist."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import psycopg

from jobrun import db, keys, sql
from jobrun.exitcodes import Exit, LockStoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Callable, Sequence

#: How long any one step may take before it counts as failed (beyond the mode's own waits).
STEP_TIMEOUT = 30.0


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

    def args(self, *extra: str) -> list[str]:
        """Jobrun's argv for a run of this drill's key and mode."""
        argv = [*self.jobrun, "--key", self.key.label, "--mode", self.mode]
        argv += ["--kill-after", f"{self.kill_after}s", "--log-format", "json"]
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

    def record(self, name: str, passed: bool, started: float, detail: str = "") -> bool:
        """Add a checklist line."""
        self.steps.append(Step(name, passed, time.monotonic() - started, detail))
        return passed


class _Run:
    """A background jobrun whose event lines we can wait for."""

    def __init__(self, argv: Sequence[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.events: list[dict[str, Any]] = []

    def wait_event(self, name: str, timeout: float) -> dict[str, Any] | None:
        """Read event lines until ``name`` shows up, the process ends, or time runs out."""
        import selectors  # noqa: PLC0415 - drill only

        stream: IO[str] | None = self.proc.stderr
        assert stream is not None  # noqa: S101 - created with stderr=PIPE
        deadline = time.monotonic() + timeout
        with selectors.DefaultSelector() as selector:
            selector.register(stream, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if not selector.select(deadline - time.monotonic()):
                    break
                line = stream.readline()
                if not line:
                    break
                for event in _parse_events(line):
                    self.events.append(event)
                    if event.get("event") == name:
                        return event
        return None

    def finish(self, timeout: float) -> int | None:
        """Wait for the exit status (killing jobrun if it overruns), then read what is left."""
        try:
            status: int | None = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            status = None
        if self.proc.stderr is not None and not self.proc.stderr.closed:
            # WARNING: the child may still hold our pipe open: read only what is there.
            self.wait_event("", 0.2)
            self.proc.stderr.close()
        return status


def _parse_events(text: str) -> list[dict[str, Any]]:
    """The JSON event lines in ``text`` (anything else is not jobrun's and is ignored)."""
    events = []
    for line in text.splitlines():
        with contextlib.suppress(json.JSONDecodeError):
            parsed = json.loads(line)
            if isinstance(parsed, dict):
                events.append(parsed)
    return events


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    return state in ("Z", "X")


def _poll(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def run_drill(drill: Drill, out: Callable[[str], None]) -> int:
    """Run every step, print the checklist, return 0 only if every step passed."""
    out(
        f"jobrun drill: key {drill.key.label} (lock id {drill.key.lock_id}), "
        f"mode {drill.mode}, database {db.describe(drill.target)}"
    )
    try:
        _steps(drill)
    finally:
        for step in drill.steps:
            mark = "PASS" if step.passed else "FAIL"
            detail = f"  {step.detail}" if step.detail else ""
            out(f"  [{mark}] {step.name:<48} {step.seconds:7.2f}s{detail}")
    passed = bool(drill.steps) and all(step.passed for step in drill.steps)
    out("drill passed" if passed else "drill FAILED")
    return 0 if passed else 1


def _steps(drill: Drill) -> None:
    env = drill.env()
    # 1. A guarded run starts.
    t = time.monotonic()
    first = _Run(drill.args("--", *drill.command), env)
    started = first.wait_event("started", STEP_TIMEOUT)
    if not drill.record(
        "guarded run started", started is not None, t, "" if started else _why(first)
    ):
        first.proc.kill()
        first.finish(5)
        return
    assert started is not None  # noqa: S101 - checked just above
    child = int(started["child_pid"])

    # 2. A second instance skips.
    t = time.monotonic()
    second = subprocess.run(
        drill.args("--", "true"),
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=STEP_TIMEOUT,
    )
    drill.record(
        "second instance skipped (exit 75)",
        second.returncode == Exit.SKIPPED,
        t,
        f"exit {second.returncode}",
    )

    # 3. kill -9 of jobrun: the child must die.
    t = time.monotonic()
    first.proc.send_signal(signal.SIGKILL)
    first.finish(STEP_TIMEOUT)
    drill.record("kill -9 of jobrun: the child died", _poll(lambda: _gone(child), 5.0), t)

    # 4. The next run acquires: at once in session mode, after the TTL in lease mode.
    t = time.monotonic()
    expected = drill.ttl if drill.mode == "lease" else 0.0
    if drill.mode == "lease":
        early = subprocess.run(
            drill.args("--", "true"),
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=STEP_TIMEOUT,
        )
        drill.record(
            "lease still held right after the crash",
            early.returncode == Exit.SKIPPED,
            t,
            f"exit {early.returncode}",
        )
    t_next = time.monotonic()
    wait = expected + 10.0
    after = subprocess.run(
        drill.args("--wait", f"{wait}s", "--", "true"),
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=wait + STEP_TIMEOUT,
    )
    took = time.monotonic() - t
    expectation = f"about {expected:g}s" if expected else "at once"
    drill.record(
        "next run acquired after the crash",
        after.returncode == 0,
        t_next,
        f"{took:.2f}s after the kill (expected {expectation})",
    )

    # 5. The lock is taken away mid-run: the child must be stopped.
    t = time.monotonic()
    victim = _Run(drill.args("--", *drill.command), env)
    started = victim.wait_event("started", STEP_TIMEOUT)
    if started is None:
        drill.record(
            "lock taken away: child stopped (exit 76)", passed=False, started=t, detail=_why(victim)
        )
        victim.proc.kill()
        victim.finish(5)
        return
    t = time.monotonic()
    how = _take_lock_away(drill)
    lost = victim.wait_event("lock_lost", drill.ttl + STEP_TIMEOUT)
    detected = time.monotonic() - t
    status = victim.finish(drill.kill_after + STEP_TIMEOUT)
    child_gone = _gone(int(started["child_pid"]))
    drill.record(
        "lock taken away: child stopped (exit 76)",
        lost is not None and status == Exit.LOCK_LOST and child_gone,
        t,
        f"{how}; noticed after {detected:.2f}s, exit {status}",
    )
    _cleanup(drill)


def _why(run: _Run) -> str:
    status = run.finish(5) if run.proc.poll() is not None else None
    for event in reversed(run.events):
        if event.get("event") in ("skipped", "lockstore_unavailable", "exec_failed"):
            return f"{event['event']}: {event.get('error') or event.get('holder_pid') or ''}"
    return f"exit {status}"


def _take_lock_away(drill: Drill) -> str:
    """Terminate the lock's backend (session) or hand the lease to a stranger (lease)."""
    with db.connect(drill.target, app_name="jobrun:drill") as conn:
        if drill.mode == "session":
            classid, objid = drill.key.pg_locks_pair
            try:
                row = conn.execute(sql.DRILL_TERMINATE_HOLDER, (classid, objid)).fetchone()
            except psycopg.errors.InsufficientPrivilege:
                return "could not terminate the backend (needs pg_signal_backend)"
            return "backend terminated" if row and row[0] else "backend not found"
        conn.execute(sql.DRILL_STEAL_LEASE, (str(uuid.uuid4()), drill.key.lock_id))
        return "lease handed to another owner"


def _cleanup(drill: Drill) -> None:
    if drill.mode != "lease":
        return
    try:
        with db.connect(drill.target, app_name="jobrun:drill") as conn:
            conn.execute(sql.DRILL_DELETE_LEASE, (drill.key.lock_id,))
    except (psycopg.Error, LockStoreUnavailable):
        pass
