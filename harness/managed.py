"""The one lifecycle of everything a test starts: cleanup on a failed start, at exit, twice-safe."""

from __future__ import annotations

import atexit
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable
    from types import TracebackType

    from typing_extensions import Self


class Managed:
    """A server, pooler or proxy that a test starts and must not leave behind.

    Subclasses start through _started(setup) and say in _release() how to stop and remove
    themselves; cleanup() runs that once, whether called by the test, by ``with``, by a
    start that failed half-way, or at interpreter exit.
    """

    _cleaned = False

    def _started(self, setup: Callable[[], object]) -> Self:
        """Run ``setup``; if it fails, release what it left behind; then guard by atexit."""
        try:
            setup()
        except BaseException:
            self.cleanup()
            raise
        atexit.register(self.cleanup)
        return self

    def _release(self) -> None:
        """Stop and remove whatever was started (also a half-started one)."""
        raise NotImplementedError

    def cleanup(self) -> None:
        """Stop and remove everything. Safe to call twice."""
        if self._cleaned:
            return
        self._cleaned = True
        try:
            self._release()
        finally:
            atexit.unregister(self.cleanup)

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.cleanup()
