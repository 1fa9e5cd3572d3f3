"""Run the real jobrun CLI as a subprocess and read its JSON event lines."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time
from typing import TYPE_CHECKING, Any

from jobrun import procs

if TYPE_CHECKING:
    from collections.abc import Callable, Mapping, Sequence
    from pathlib import Path

JOBRUN = (sys.executable, "-m", "jobrun")

#: How long a test waits for a process it started to reach a step before it calls it hung.
#: Not a timing claim (those live in benchmarks, or are derived from the run's own
#: timeouts): two cores at load 10 take more than 20 s to start Python and connect.
HANG_GUARD = 60.0


@functools.cache
def start_allowance() -> float:
    """Seconds a jobrun process may take to start and import here: 10x a measured start, >= 5.

    For bounds built from a run's own deadlines (connect, history timeout), which begin only
    once the process is up: measured on this machine, at the load it has now.
    """
    started = time.monotonic()
    subprocess.run([*JOBRUN, "--version"], capture_output=True, check=False, timeout=HANG_GUARD)
    return max(5.0, 10 * (time.monotonic() - started))


def environment(dsn: str | None, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """Our environment minus any JOBRUN_* and PGAPPNAME, plus the test DSN and JSON logs."""
    env = {
        name: value
        for name, value in os.environ.items()
        if not name.startswith("JOBRUN_") and name != "PGAPPNAME"
    }
    env["JOBRUN_LOG_FORMAT"] = "json"
    if dsn is not None:
        env["JOBRUN_DSN"] = dsn
    env.update(extra or {})
    return env


def run(
    *args: str,
    dsn: str | None,
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    stdin: Any = subprocess.DEVNULL,
) -> subprocess.CompletedProcess[str]:
    """``jobrun ARGS...`` to completion, capturing output as text."""
    return subprocess.run(
        [*JOBRUN, *args],
        env=environment(dsn, env),
        capture_output=True,
        text=True,
        timeout=timeout,
        stdin=stdin,
        check=False,
    )


def start(
    *args: str, dsn: str | None, env: Mapping[str, str] | None = None
) -> subprocess.Popen[str]:
    """``jobrun ARGS...`` in the background, stderr captured."""
    return subprocess.Popen(
        [*JOBRUN, *args],
        env=environment(dsn, env),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
    )


def events(stderr: str) -> list[dict[str, Any]]:
    """Every stderr line parsed as JSON (a line that is not JSON fails the test)."""
    return [json.loads(line) for line in stderr.splitlines() if line.strip()]


def event(stderr: str, name: str) -> dict[str, Any]:
    """The one event called ``name``."""
    found = [e for e in events(stderr) if e["event"] == name]
    assert len(found) == 1, f"expected one {name!r} event, got {found!r} in {stderr!r}"
    return found[0]


def wait_until(
    condition: Callable[[], bool], *, timeout: float = HANG_GUARD, what: str = "condition"
) -> None:
    """Poll ``condition`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            msg = f"timed out after {timeout}s waiting for {what}"
            raise AssertionError(msg)
        time.sleep(0.02)


def wait_for_file(
    path: Path, *, timeout: float = HANG_GUARD, proc: subprocess.Popen[str] | None = None
) -> str:
    """Wait for ``path`` to exist with a complete first line; return its content.

    With ``proc`` (the jobrun whose child writes ``path``), fail at once, with its stderr,
    when it exits first, and show its stderr on a timeout too.
    """

    def written() -> bool:
        if path.exists() and path.read_text().endswith("\n"):
            return True
        if proc is not None and proc.poll() is not None:
            _, stderr = proc.communicate()
            msg = f"jobrun exited {proc.returncode} before {path} was written:\n{stderr}"
            raise AssertionError(msg)
        return False

    try:
        wait_until(written, timeout=timeout, what=str(path))
    except AssertionError:
        if proc is not None and proc.poll() is None:
            proc.kill()
            _, stderr = proc.communicate()
            msg = f"{path} was not written within {timeout}s; jobrun's stderr:\n{stderr}"
            raise AssertionError(msg) from None
        raise
    return path.read_text()


#: The same looks at processes as jobrun's own (drill, overlap): one definition.
process_gone = procs.process_gone
group_gone = procs.group_gone


def child_script(body: str) -> list[str]:
    """A Python child process running ``body`` (argv for after ``--``)."""
    return [sys.executable, "-c", body]


def signal_and_wait(proc: subprocess.Popen[str], signum: int, timeout: float = 30) -> str:
    """Send ``signum`` to ``proc`` and return its stderr once it exits."""
    proc.send_signal(signum)
    try:
        _, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, stderr = proc.communicate()
        msg = f"jobrun did not exit within {timeout}s of signal {signum}; its stderr:\n{stderr}"
        raise AssertionError(msg) from None
    return stderr


def holder_marker(path: Path) -> Sequence[str]:
    """A child that writes its pid to ``path`` and then sleeps until killed."""
    return ["sh", "-c", f'echo $$ > "{path}"; exec sleep 300']


SIGTERM = signal.SIGTERM
