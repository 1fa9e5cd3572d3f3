"""Stop signals as exceptions, held back while a block must not be cut short (drill, overlap)."""

from __future__ import annotations

import contextlib
import signal
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from types import FrameType

#: The signals that stop a drill or an overlap run: every signal whose default action would
#: end jobrun on the spot, leaving what it started running (its commands run in process
#: groups of their own, so nothing else stops them).
STOP_SIGNALS = (
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
)


class Interrupts:
    """STOP_SIGNALS handed to ``stop(signum, previous_handler)``, which raises.

    While ``held()``, a signal is only noted and raised when the block is done: a process
    being started can then not be orphaned, nor a cleanup cut short. Only the first signal
    counts; a signal that was ignored (``nohup``) stays ignored.
    """

    def __init__(self, stop: Callable[[int, Any], None]) -> None:
        self.signum: int | None = None
        self._stop = stop
        self._held = 0
        self._pending = False
        self._previous: dict[int, Any] = {}

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        """Our handlers while the block runs (main thread only: elsewhere there are none)."""
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                if signal.getsignal(signum) != signal.SIG_IGN:
                    self._previous[signum] = signal.signal(signum, self._handler)
        try:
            yield
        finally:
            for stopped, handler in self._previous.items():
                signal.signal(stopped, handler)
            self._previous = {}

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Defer a signal until the block is done."""
        self._held += 1
        try:
            yield
        finally:
            self._held -= 1
        if not self._held and self._pending:
            self._pending = False
            self._raise()

    def stop_raising(self) -> None:
        """From now on a signal is only noted: what runs now runs to its end."""
        self._held += 1

    def _handler(self, signum: int, _frame: FrameType | None) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        if self._held:
            self._pending = True
        else:
            self._raise()

    def _raise(self) -> None:
        if self.signum is not None:
            self._stop(self.signum, self._previous.get(self.signum))
