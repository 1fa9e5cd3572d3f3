"""Children that record when they ran, and the check that no two of them overlapped."""

from __future__ import annotations

import itertools
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pathlib import Path


def span_child(
    log: Path, *, seconds: float = 0.0, exit_code: int = 0, until: Path | None = None
) -> list[str]:
    """A child that appends ``start`` and ``end`` lines (its pid, a time) around a sleep.

    ``until``: it waits for that file to exist (then sleeps ``seconds``). The clock is the
    wall clock of this one machine (time.time), shared by every child.
    """
    body = (
        "import os, sys, time\n"
        f"log = {str(log)!r}\n"
        "def note(what):\n"
        "    with open(log, 'a') as f:\n"
        "        f.write(f'{os.getpid()} {what} {time.time():.6f}\\n')\n"
        "note('start')\n"
        f"until = {None if until is None else str(until)!r}\n"
        "while until is not None and not os.path.exists(until):\n"
        "    time.sleep(0.02)\n"
        f"time.sleep({seconds})\n"
        "note('end')\n"
        f"sys.exit({exit_code})\n"
    )
    return [sys.executable, "-c", body]


def spans(log: Path) -> list[tuple[float, float]]:
    """Each child's (start, end), in order of start; a child without its end fails."""
    starts: dict[str, float] = {}
    ends: dict[str, float] = {}
    if not log.exists():
        return []
    for line in log.read_text().splitlines():
        pid, what, at = line.split()
        (starts if what == "start" else ends)[pid] = float(at)
    assert set(starts) == set(ends), f"a child never ended: {log.read_text()}"
    return sorted((starts[pid], ends[pid]) for pid in starts)


def assert_no_overlap(log: Path) -> list[tuple[float, float]]:
    """No child started before the one before it had ended; the spans."""
    found = spans(log)
    for (_, end), (start, _) in itertools.pairwise(found):
        assert start >= end, f"two children overlapped: {found}"
    return found


def started(log: Path) -> int:
    """How many children have started so far."""
    if not log.exists():
        return 0
    return sum(1 for line in log.read_text().splitlines() if line.split()[1] == "start")


def attempt_child(log: Path, counter: Path, codes: list[int], *, seconds: float = 0.0) -> list[str]:
    """A child whose Nth start (counted in ``counter``) ends with ``codes[N]`` (then 0).

    It records its span in ``log`` (as span_child). A negative code: it kills itself with
    that signal.
    """
    body = (
        "import os, signal, sys, time\n"
        f"log, counter, codes = {str(log)!r}, {str(counter)!r}, {codes!r}\n"
        "n = int(open(counter).read()) if os.path.exists(counter) else 0\n"
        "open(counter, 'w').write(str(n + 1))\n"
        "def note(what):\n"
        "    with open(log, 'a') as f:\n"
        "        f.write(f'{os.getpid()} {what} {time.time():.6f}\\n')\n"
        "note('start')\n"
        f"time.sleep({seconds})\n"
        "note('end')\n"
        "code = codes[n] if n < len(codes) else 0\n"
        "if code < 0:\n"
        "    os.kill(os.getpid(), -code)\n"
        "sys.exit(code)\n"
    )
    return [sys.executable, "-c", body]
