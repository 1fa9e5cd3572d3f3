"""The two commands of an attempt as processes: start, hold (SIGSTOP), resume, kill, read."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
from typing import IO, TYPE_CHECKING

from jobrun import procs
from jobrun.exitcodes import Exit, from_wait_status
from jobrun.run.supervise import ExecFailed

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

#: How much of each command's output (stdout and stderr, from the end) is searched for errors.
OUTPUT_SCAN_BYTES = 1 << 20


class Job:
    """One command of an attempt: a process in a session of its own, its output in a file.

    The command gets SIGKILL if jobrun dies (even by SIGKILL), so a held one is not left
    stopped; what it started itself is only reached through the process group, by us.
    """

    def __init__(self, job: str, argv: Sequence[str], env: Mapping[str, str]) -> None:
        self.job = job
        #: Stopped by hold() and not yet resumed.
        self.held = False
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
                preexec_fn=procs.dies_with_us(),  # noqa: PLW1509 - no thread runs in overlap
            )
        except OSError as exc:
            self.output.close()
            code = Exit.NOT_FOUND if isinstance(exc, FileNotFoundError) else Exit.NOT_EXECUTABLE
            raise ExecFailed(f"{option}: {argv[0]}: cannot run it ({exc.strerror})", code) from None

    @property
    def pid(self) -> int:
        """The command's pid, also its process group id."""
        return self.proc.pid

    def exited(self) -> bool:
        """Whether the command has exited, without reaping it (its group id stays ours)."""
        if self.proc.returncode is not None:
            return True
        exited = procs.exited_unreaped(self.pid)
        if exited is None:  # macOS: only reaping tells, and finish() then skips killpg
            return self.proc.poll() is not None
        return exited

    def hold(self) -> None:
        """Stop the command's whole process group where it is (SIGSTOP).

        WARNING: a held job holds its transaction and its locks; resume() it on every path.
        The flag is set first, so a signal between the two cannot leave it stopped unnoticed.
        """
        self.held = True
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        """Let a held command's process group carry on (SIGCONT); harmless when not held."""
        if self.held:
            self._signal(signal.SIGCONT)
            self.held = False

    def _signal(self, signum: int) -> None:
        if self.proc.returncode is None:  # not reaped: the group id is still ours
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.pid, signum)

    def finish(self) -> tuple[int, str]:
        """Kill whatever is left in the group, reap the command; its exit status and output."""
        if self.proc.returncode is None:
            self._signal(signal.SIGKILL)
        # SIGKILL ends stopped processes too; SIGCONT covers any the kill could not reach.
        self.resume()
        status = from_wait_status(self.proc.wait())
        with self.output:
            size = self.output.seek(0, os.SEEK_END)
            self.output.seek(max(0, size - OUTPUT_SCAN_BYTES))
            text = self.output.read().decode("utf-8", "replace")
        return status, text
