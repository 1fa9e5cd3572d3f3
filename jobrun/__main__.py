"""The entry point (``jobrun`` and ``python -m jobrun``): quiet on Ctrl-C from the start."""

from __future__ import annotations

import signal
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from types import FrameType


def main() -> None:
    """Run the command line; a Ctrl-C while it starts up ends it with 130, no traceback."""
    # Until jobrun sets up its own signal handling, SIGINT must not surface as a
    # KeyboardInterrupt traceback from the middle of an import (or as click's blank line).
    signal.signal(signal.SIGINT, _interrupted)
    from jobrun.cli import main as cli_main  # noqa: PLC0415 - after the handler, on purpose

    cli_main()


def _interrupted(signum: int, _frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
