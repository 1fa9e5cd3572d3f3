"""jobrun's helper threads, started so that every signal stays with the main thread."""

from __future__ import annotations

import signal
import threading
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable


def start(target: Callable[..., object], *args: object, name: str) -> threading.Thread:
    """A started daemon thread running ``target(*args)`` with every signal blocked in it.

    WARNING: a signal delivered to a thread runs the main thread's Python handler at once,
    even while the main thread blocks that signal (a guarded child runs): the thread
    inherits a mask that blocks every signal, so they all stay with the main thread.
    """
    thread = threading.Thread(target=target, args=args, name=name, daemon=True)
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, signal.valid_signals())
    try:
        thread.start()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    return thread
