"""The entry point (``jobrun`` and ``python -m jobrun``); jobrun/__init__ made Ctrl-C quiet."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import NoReturn


def main() -> NoReturn:
    """Run the command line (exceptions become exit statuses in jobrun.cli.main), then leave."""
    from jobrun.cli import main as cli_main  # noqa: PLC0415 - as late as possible, on purpose

    try:
        cli_main()
    except SystemExit as exc:
        _leave(exc.code)
    _leave(0)  # cli_main always exits; this is for the type checker


def _leave(code: str | int | None) -> NoReturn:
    """Exit with ``code`` without tearing the interpreter down, when nothing is left to do.

    The interpreter's teardown frees every object of psycopg, click and structlog one by one:
    60-130 ms on a 2-CPU VM, more than the rest of a run of ``true`` after the imports. A
    process that is about to end need not tidy its own memory: exit handlers still run and
    the standard streams are flushed, then the process ends at once. Where something may
    still be working (a non-daemon thread, an exit message that is not a number), the
    ordinary exit does it.
    """
    import atexit  # noqa: PLC0415 - built in: no import cost
    import threading  # noqa: PLC0415 - already loaded (click, psycopg)

    main_thread = threading.main_thread()
    busy = any(
        thread is not main_thread and not thread.daemon and thread.is_alive()
        for thread in threading.enumerate()
    )
    if code is None:
        code = 0
    if busy or not isinstance(code, int):
        sys.exit(code)
    atexit._run_exitfuncs()  # noqa: SLF001 - what the ordinary exit would run next
    for stream in (sys.stdout, sys.stderr):
        # closed or broken: jobrun.cli.main has already said so where it could
        with contextlib.suppress(OSError, ValueError, AttributeError):
            stream.flush()
    os._exit(code & 0xFF)  # as exit(3) truncates


if __name__ == "__main__":
    main()
