"""The entry point: the one place exceptions and output errors become exit statuses."""

from __future__ import annotations

import contextlib
import errno
import io
import os
import sys
from typing import TYPE_CHECKING, Any, NoReturn, cast

import click

from jobrun.exitcodes import (
    Exit,
    JobrunError,
    OutputError,
    PipeClosed,
    interruption,
    signal_status,
)

if TYPE_CHECKING:
    from collections.abc import Iterator

STDIN, STDOUT, STDERR = 0, 1, 2
SIGINT = 2


def main(argv: list[str] | None = None) -> NoReturn:
    """Run the command line and exit with its status; never a traceback for bad input."""
    # Imported here, not with this module: jobrun.run.settings (which the command is made from)
    # uses jobrun.flags, whose package imports this module. Before _interruptible():
    # a Ctrl-C during the import still ends jobrun quietly (jobrun/__init__).
    from jobrun.cli.run import cli

    _interruptible()
    closed = _open_standard_fds()
    try:
        with _guarded_stdout(closed=STDOUT in closed):
            status = _status_of(cli, argv)
    except PipeClosed as exc:  # the reader went away (`| head -1`): quiet, as Unix tools are
        _silence_stdout()
        status = exc.exit_code
    except OutputError as exc:
        _silence_stdout()
        _error(str(exc))
        status = exc.exit_code
    sys.exit(status)


def _interruptible() -> None:
    """From here on a Ctrl-C raises SystemExit(130), so ``with`` blocks clean up (demo).

    Until now jobrun/__init__ ended the process at once on SIGINT (nothing was started).
    A SIGINT that was ignored when jobrun started (nohup) stays ignored.
    """
    # `_signal`, built into the interpreter, not `signal`: that module makes its enums when
    # imported, a few milliseconds of `jobrun key` and `jobrun --help` for nothing.
    import _signal  # type: ignore[import-not-found]

    if _signal.getsignal(SIGINT) not in (_signal.SIG_IGN, None):
        _signal.signal(SIGINT, _raise_exit)


def _raise_exit(signum: int, _frame: object) -> None:
    raise SystemExit(signal_status(signum))


def _status_of(cli: click.Group, argv: list[str] | None) -> int:
    try:
        status = cli.main(args=argv, prog_name="jobrun", standalone_mode=False)
    except click.exceptions.Exit as exc:  # --help, --version
        return exc.exit_code
    except click.ClickException as exc:
        _error(exc.format_message())
        return Exit.USAGE
    except (OutputError, PipeClosed):
        raise
    except JobrunError as exc:
        _error(str(exc))
        return exc.exit_code
    except click.Abort:
        return signal_status(SIGINT)
    except Exception as exc:  # a bug: one line, and the traceback only when asked for
        wrapped = _wrapped_signal_exit(exc)
        if wrapped is None and os.environ.get("JOBRUN_DEBUG"):
            raise
        return wrapped if wrapped is not None else _internal_error(exc)
    return int(status or 0)


def _internal_error(exc: Exception) -> int:
    _error(f"internal error: {type(exc).__name__}: {exc} (set JOBRUN_DEBUG=1 for details)")
    return Exit.INTERNAL


def _wrapped_signal_exit(exc: BaseException) -> int | None:
    """The status of a signal's exit that Python wrapped in another exception, if it was one.

    A stop signal's Interrupted, or a Ctrl-C's SystemExit (``_raise_exit``), raised inside a
    ``__set_name__`` arrives wrapped (see ``exitcodes.interruption``): not a bug.
    """
    interrupted = interruption(exc)
    if interrupted is not None:
        _error(str(interrupted))
        return interrupted.exit_code
    cause = exc.__cause__
    while cause is not None:
        if isinstance(cause, SystemExit):
            return cause.code if isinstance(cause.code, int) else Exit.INTERNAL
        cause = cause.__cause__
    return None


class _CheckedStdout(io.TextIOWrapper):
    """Standard output whose write errors are output errors (exit 74 / 141), not bugs.

    Characters its encoding cannot hold are written as backslash escapes.
    """

    closed_at_start = False

    def write(self, text: str) -> int:
        """Write, or raise OutputError / PipeClosed."""
        if self.closed_at_start:
            raise OutputError("cannot write to standard output: it was closed (>&-)")
        try:
            return super().write(text)
        except OSError as exc:
            raise output_error(exc) from None

    def flush(self) -> None:
        """Flush, or raise OutputError / PipeClosed."""
        try:
            super().flush()
        except OSError as exc:
            raise output_error(exc) from None


def output_error(exc: OSError) -> JobrunError:
    """An OSError writing standard output as what it is: a closed pipe (141) or 74."""
    if exc.errno == errno.EPIPE:
        return PipeClosed("standard output: the reader went away")
    return OutputError(f"cannot write to standard output: {exc.strerror or exc}")


@contextlib.contextmanager
def _guarded_stdout(*, closed: bool) -> Iterator[None]:
    """sys.stdout as a _CheckedStdout while the command runs (click.echo writes through it)."""
    original = sys.stdout
    buffer: Any = getattr(original, "buffer", None) if original is not None else None
    if closed or original is None:
        buffer = os.fdopen(STDOUT, "wb", closefd=False)
    if not isinstance(buffer, (io.BufferedIOBase, io.RawIOBase)) or not (
        closed or type(original) is io.TextIOWrapper
    ):
        yield  # an embedding (pytest's capture, CliRunner) has its own stdout: leave it
        return
    checked = _CheckedStdout(
        cast("Any", buffer),
        encoding=getattr(original, "encoding", None) or "utf-8",
        # A character the terminal's encoding lacks (PYTHONIOENCODING=latin-1, a C locale)
        # is shown escaped, never a failed command.
        errors="backslashreplace",
        line_buffering=bool(getattr(original, "line_buffering", False)),
    )
    checked.closed_at_start = closed
    sys.stdout = checked
    try:
        yield
        checked.flush()
    finally:
        sys.stdout = original
        checked.detach()  # the buffer stays open: it is the interpreter's


def _silence_stdout() -> None:
    """Point fd 1 at /dev/null, so the interpreter's last flush cannot fail again."""
    with contextlib.suppress(OSError):
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, STDOUT)
        os.close(null)


def _open_standard_fds() -> set[int]:
    """Point a closed stdin, stdout or stderr at /dev/null; return the ones that were closed.

    WARNING: a closed descriptor 0-2 (``2>&-`` in a crontab) is the first one the next
    ``open`` or ``socket`` returns: the lock session's socket would become "stderr" and our
    log lines would be written into the PostgreSQL protocol stream.
    """
    closed = set()
    for fd in (STDIN, STDOUT, STDERR):
        if not _is_open(fd):
            closed.add(fd)
            null = os.open(os.devnull, os.O_RDWR)
            if null == fd:
                # positional-only; the fds os.open returns are not inherited
                os.set_inheritable(fd, True)  # noqa: FBT003
            else:
                os.dup2(null, fd)  # inheritable, unlike os.open's
                os.close(null)
    return closed


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _error(message: str) -> None:
    from jobrun.escape import printable

    with contextlib.suppress(OSError):  # a closed or full stderr must not end in a traceback
        # A message can quote the server or a file: one line, and nothing it could
        # make a terminal do.
        click.echo(f"jobrun: error: {printable(' '.join(message.split()))}", err=True)
