"""A jobrun started in the background whose JSON event lines can be awaited (for the drill)."""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import time
from typing import TYPE_CHECKING, Any

from jobrun import procs

if TYPE_CHECKING:
    from collections.abc import Sequence

#: Output read at most, in one go, from a run that has exited (its child may still write).
DRAIN_SECONDS = 0.2


class BackgroundRun:
    """A background jobrun whose event lines we can wait for.

    WARNING: stderr is read straight from the pipe (os.read, lines split here): a buffered
    reader would keep lines that select() no longer reports, and the drill would wait them
    out.
    """

    def __init__(self, argv: Sequence[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        stream = self.proc.stderr
        if stream is None:  # pragma: no cover - created with stderr=PIPE
            raise RuntimeError("no stderr pipe")
        self._stream = stream
        self._fd = stream.fileno()
        self._open = True
        self._partial = b""
        self.events: list[dict[str, Any]] = []
        #: jobrun's own lines that are not events (a usage error), newest last. The child's
        #: output (same pipe) is never kept: it could hold anything, a password included.
        self.other: list[str] = []
        #: The child's pid (and process group) once jobrun said it started it.
        self.child_pid: int | None = None

    def _read(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for output and take it in; whether there was any."""
        if not self._open:
            return False
        ready, _, _ = select.select([self._fd], [], [], max(0.0, timeout))
        if not ready:
            return False
        chunk = os.read(self._fd, 65536)
        if not chunk:
            self._open = False
            chunk = b"\n"  # the last line, even without its newline
        *lines, self._partial = (self._partial + chunk).split(b"\n")
        for line in lines:
            self._take(line.decode("utf-8", "replace"))
        return True

    def _take(self, line: str) -> None:
        if not line.strip():
            return
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            event = None
        if not isinstance(event, dict):
            if line.startswith("jobrun: "):
                self.other = [*self.other[-9:], line.strip()]
            return
        self.events.append(event)
        if event.get("event") == "started" and self.child_pid is None:
            with contextlib.suppress(TypeError, ValueError):
                self.child_pid = int(event["child_pid"])

    def wait_event(self, name: str, timeout: float) -> dict[str, Any] | None:
        """Read event lines until ``name`` shows up, the output ends, or time runs out."""
        deadline = time.monotonic() + timeout
        checked = 0
        while True:
            for event in self.events[checked:]:
                if event.get("event") == name:
                    return event
            checked = len(self.events)
            remaining = deadline - time.monotonic()
            if not self._open or remaining <= 0:
                return None
            self._read(remaining)

    def _wait(self, timeout: float) -> int | None:
        """Wait for jobrun's exit status, taking its output in meanwhile (None: time ran out)."""
        deadline = time.monotonic() + timeout
        pidfd = procs.pidfd(self.proc.pid)
        try:
            while (status := self.proc.poll()) is None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                if not self._open:
                    if pidfd is None:
                        with contextlib.suppress(subprocess.TimeoutExpired):
                            return self.proc.wait(timeout=remaining)
                        return None
                    select.select([pidfd], [], [], remaining)
                elif pidfd is None:  # no pidfd (not Linux): look again now and then
                    self._read(min(remaining, 0.05))
                else:
                    ready, _, _ = select.select([pidfd, self._fd], [], [], remaining)
                    if self._fd in ready:
                        self._read(0)
            return status
        finally:
            if pidfd is not None:
                os.close(pidfd)

    def finish(self, timeout: float) -> int | None:
        """Wait for the exit status (killing jobrun if it overruns), then read what is left."""
        status = self._wait(timeout)
        if status is None:
            self.proc.kill()
            self.proc.wait()
        self._close()
        return status

    def stop(self, grace: float) -> None:
        """SIGTERM (jobrun passes it to the child's group and releases the lock), then SIGKILL."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(signal.SIGTERM)
            if self._wait(grace) is None:
                self.proc.kill()
                self.proc.wait()
        self._close()

    def _close(self) -> None:
        # WARNING: the child may still hold our pipe open: read only what is there.
        deadline = time.monotonic() + DRAIN_SECONDS
        while self._open and time.monotonic() < deadline and self._read(0):
            pass
        self._open = False
        self._stream.close()

    def why(self) -> str:
        """Why a run did not do what it should: its last telling event or line."""
        for event in reversed(self.events):
            if event.get("event") in (
                "skipped",
                "lockstore_unavailable",
                "exec_failed",
                "lock_lost",
            ):
                return f"{event['event']}: {event.get('error') or event.get('holder_pid') or ''}"
        status = self.proc.returncode
        last = f": {self.other[-1]}" if self.other else ""
        return f"exit {status}{last}" if status is not None else "no answer"
