"""jobrun: run a scheduled job at most once at a time, guarded by PostgreSQL."""

import sys as _sys

__version__ = "0.1.0"


def _started_as_jobrun() -> bool:
    """Whether this interpreter runs jobrun as its program (console script or -m jobrun)."""
    argv = list(getattr(_sys, "orig_argv", ()))
    as_module = any(argv[i : i + 2] == ["-m", "jobrun"] for i in range(len(argv)))
    return as_module or (len(argv) > 1 and argv[1].rsplit("/", 1)[-1] == "jobrun")


def _interrupted_starting(signum: int, _frame: object) -> None:
    """Exit 128 + N at once: nothing is started yet.

    An exception raised here instead could land in an import lock's callback, which
    prints it as "Exception ignored".
    """
    import os  # noqa: PLC0415 - already loaded by the interpreter's start-up

    os._exit(128 + signum)  # exitcodes.signal_status, which cannot be imported yet


if _started_as_jobrun():
    # WARNING: this runs before anything else of jobrun is imported, on purpose: a Ctrl-C
    # during an import (click alone takes tens of milliseconds) must not print a
    # KeyboardInterrupt traceback. `_signal` is built into the interpreter: no import
    # window of its own. A SIGINT the parent ignores (nohup) stays ignored.
    import _signal  # type: ignore[import-not-found]

    if _signal.getsignal(_signal.SIGINT) is _signal.default_int_handler:
        _signal.signal(_signal.SIGINT, _interrupted_starting)
