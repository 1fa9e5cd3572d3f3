"""Looking at and ending processes and process groups by pid (Linux /proc, POSIX fallbacks)."""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

#: How often poll() looks again.
POLL_INTERVAL = 0.02
_PR_SET_PDEATHSIG = 1


def _state_and_group(pid: int) -> tuple[str, int] | None:
    """(state letter, process group) from /proc/PID/stat, or None when it cannot be read."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return fields[0], int(fields[2])


def process_gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (a zombie counts as gone)."""
    found = _state_and_group(pid)
    if found is None:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:
            return False
        return False
    return found[0] in ("Z", "X")


def group_members(pgid: int) -> int:
    """How many live processes are in process group ``pgid``."""
    proc = Path("/proc")
    if not proc.is_dir():  # no /proc: at least tell "some" from "none"
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            return 0
        return 1
    count = 0
    for entry in proc.iterdir():
        if entry.name.isdigit():
            found = _state_and_group(int(entry.name))
            if found is not None and found[1] == pgid and found[0] not in ("Z", "X"):
                count += 1
    return count


def group_gone(pgid: int) -> bool:
    """Whether no live process is left in process group ``pgid``."""
    return group_members(pgid) == 0


def signal_group(pgid: int, signum: int) -> bool:
    """Send ``signum`` to process group ``pgid`` if it has live members; whether it was sent.

    A process group id stays taken while any member lives, so a group with members is
    still the one we started: never a stranger's that reused the number.
    """
    if pgid <= 1 or pgid == os.getpgrp() or not group_members(pgid):
        return False
    try:
        os.killpg(pgid, signum)
    except (ProcessLookupError, PermissionError):
        return False
    return True


def kill_group(pgid: int) -> None:
    """SIGKILL what is left of process group ``pgid``."""
    signal_group(pgid, signal.SIGKILL)


def pidfd(pid: int) -> int | None:
    """A descriptor that becomes readable when ``pid`` exits (Linux 5.3+), else None."""
    opener: Callable[[int], int] | None = getattr(os, "pidfd_open", None)
    if opener is None:
        return None
    try:
        return opener(pid)
    except OSError:
        return None


def poll(condition: Callable[[], bool], timeout: float) -> bool:
    """Look at ``condition`` until it holds (True) or ``timeout`` seconds passed (False)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_INTERVAL)
    return True


def exited_unreaped(pid: int) -> bool | None:
    """Whether our child ``pid`` has exited, without reaping it; None where that cannot be told.

    WNOWAIT leaves the zombie: its pid and group id stay ours, so a later killpg can never
    hit a stranger that reused the number.
    """
    if not hasattr(os, "waitid"):
        return None
    with contextlib.suppress(ChildProcessError):
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    return True


def dies_with_us() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the child get SIGKILL when we die (Linux), else None.

    For a child held with SIGSTOP this matters most: nobody else would ever resume it,
    and it would keep its transaction and its locks.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl: Callable[..., int] = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def in_child() -> None:
        # Between fork and exec: async-signal-safe calls only.
        prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # WARNING: if we died before prctl took effect, no signal will come: check.
        if os.getppid() != parent:
            os.kill(os.getpid(), signal.SIGKILL)

    return in_child
