"""pytest-only helpers: shared fixtures, history rows, session counts (servers: harness)."""

import threading
from pathlib import Path

#: The user_properties name under which a property test reports how many examples it tried.
EXAMPLES_PROPERTY = "hypothesis_examples"


def started_threads(before: set[threading.Thread], name: str) -> threading.Thread:
    """The one thread called ``name`` alive now that was not among ``before``."""
    (thread,) = [t for t in threading.enumerate() if t.name == name and t not in before]
    return thread


def blocked_signals(thread: threading.Thread) -> set[int]:
    """The signals a live thread of this process blocks (its ``SigBlk`` in /proc)."""
    assert thread.native_id is not None
    with Path(f"/proc/self/task/{thread.native_id}/status").open() as status:
        for line in status:
            if line.startswith("SigBlk:"):
                mask = int(line.split()[1], 16)
                return {bit + 1 for bit in range(64) if mask >> bit & 1}
    raise AssertionError(f"no SigBlk line for thread {thread.name}")
