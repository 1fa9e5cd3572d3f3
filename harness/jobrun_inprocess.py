"""The jobrun CLI called in this process: ``jobrun_cli.run``'s twin, without an interpreter start.

``run(*args, dsn=...)`` calls ``jobrun.cli.main`` with what ``python -m jobrun`` would get
(the environment ``jobrun_cli.variables`` makes, argv, descriptors 0-2 and the standard
streams over them) and answers as ``jobrun_cli.run`` does: a ``CompletedProcess`` with the
exit status and the text written to descriptors 1 and 2. jobrun's event lines are written
to descriptor 2 itself (jobrun.log), so both are captured at the descriptor, not in Python.

What the process would have dropped at exit is put back afterwards, so one call cannot leak
into the next test on the same worker: os.environ, every signal handler and the signal
mask, a subreaper flag, sys.argv and sys.std*, descriptors 0-2, the psycopg logger's
handlers, structlog's configuration, the passwords jobrun.masking learned, the working
directory and the umask. A thread the call started must have ended when it returns (a
process would have taken it along), unless the call is made in a fork (``forked``).

WARNING: a run that starts its child here waits for the child's exit signal in this thread
(jobrun.run.supervise); another thread of the test process (pytest-xdist's) may take that
signal, and the run then sees the child gone at its next idle wake-up, a second later at
most: slower, never wrong. ``forked`` calls have this thread alone.

WARNING: what only a process shows is not tested through here: signals sent to jobrun, its
start-up (imports, a Ctrl-C while importing), writing to a closed pipe or stdout, exit
statuses of the real entry point (``jobrun.__main__``), the console script, argv as raw
bytes, another locale. Those tests start the real entry point (harness/jobrun_cli.py) and
are marked ``process`` (tests/conftest.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import locale
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import jobrun
from harness import memory
from harness.jobrun_cli import variables
from jobrun import masking

if TYPE_CHECKING:
    from collections.abc import Iterator, Mapping

#: sys.argv[0] of ``python -m jobrun``.
MAIN = str(Path(jobrun.__file__).with_name("__main__.py"))
STDIN, STDOUT, STDERR = 0, 1, 2
#: prctl(2): read and set whether orphaned descendants are re-parented to this process.
_PR_SET_CHILD_SUBREAPER, _PR_GET_CHILD_SUBREAPER = 36, 37


def run(
    *args: str,
    dsn: str | None,
    env: Mapping[str, str] | None = None,
    timeout: float = 60,
    stdin: Any = subprocess.DEVNULL,
    forked: bool = False,
) -> subprocess.CompletedProcess[str]:
    """``jobrun ARGS...`` in this process, as ``jobrun_cli.run`` runs it in another.

    ``stdin``: DEVNULL, None (this process's own) or a file (or descriptor) to read.
    ``timeout``: as for the process, TimeoutExpired when the call took longer; a call cannot
    be interrupted here, so one that never ends is failed by pytest-timeout instead. A thread
    the call started must end within it too.

    ``forked``: the call is made in a fork of this process (no interpreter start, no
    import), for a run that leaves a helper thread to its process's exit by design (the
    pinger's, which waits for pings until the process ends): the fork's exit ends it.
    """
    if forked:
        # The fork ends whatever threads the call left: no wait for them there.
        return memory.forked(
            lambda: _run(args, dsn, env, timeout, stdin, threads_end=False), timeout=timeout
        )
    return _run(args, dsn, env, timeout, stdin, threads_end=True)


def _run(
    args: tuple[str, ...],
    dsn: str | None,
    env: Mapping[str, str] | None,
    timeout: float,
    stdin: Any,
    *,
    threads_end: bool,
) -> subprocess.CompletedProcess[str]:
    # What text=True decodes a child's output as (positional-only).
    encoding = locale.getpreferredencoding(False)  # noqa: FBT003
    argv = ["jobrun", *args]
    deadline = time.monotonic() + timeout
    with (
        _put_back(),
        _environment(variables(dsn, env)),
        _standard_fds(stdin, encoding) as captured,
        _threads_end(deadline) if threads_end else contextlib.nullcontext(),
    ):
        status = _call([MAIN, *args])
    if time.monotonic() > deadline:
        raise subprocess.TimeoutExpired(argv, timeout, *(part.encode() for part in captured))
    return subprocess.CompletedProcess(argv, status, *captured)


def _call(argv: list[str]) -> int:
    """``jobrun.cli.main`` on ``argv[1:]``; its exit status as the process would end with it."""
    from jobrun.cli import main  # noqa: PLC0415 - as the entry point does: when called

    saved = sys.argv
    sys.argv = argv
    try:
        main(argv[1:])
    except SystemExit as exc:
        code = exc.code
    finally:
        sys.argv = saved
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF  # as exit(3) truncates
    print(code, file=sys.stderr)  # as the interpreter ends on a message  # noqa: T201
    return 1


@contextlib.contextmanager
def _environment(env: Mapping[str, str]) -> Iterator[None]:
    """os.environ (and the C library's, which libpq reads) is ``env`` for the call."""
    saved = dict(os.environ)
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


@contextlib.contextmanager
def _standard_fds(stdin: Any, encoding: str) -> Iterator[list[str]]:
    """Descriptors 1 and 2 on files of their own, 0 on ``stdin``; sys.std* over them.

    Yields a list that holds what was written to 1 and to 2 (text) once the block is left.
    """
    captured: list[str] = []
    streams = sys.stdin, sys.stdout, sys.stderr
    for stream in streams[1:]:
        with contextlib.suppress(AttributeError, OSError, ValueError):
            stream.flush()
    saved = {fd: os.dup(fd) for fd in (STDIN, STDOUT, STDERR)}
    opened: list[IO[Any]] = []
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            _point_stdin(stdin)
            os.dup2(out.fileno(), STDOUT)
            os.dup2(err.fileno(), STDERR)
            # As the interpreter makes them: stdout strict, stderr backslash escapes, line by line.
            opened = [
                open(STDIN, encoding=encoding, closefd=False),  # noqa: SIM115 - closed below
                open(STDOUT, "w", encoding=encoding, closefd=False),  # noqa: SIM115
                open(  # noqa: SIM115
                    STDERR,
                    "w",
                    encoding=encoding,
                    errors="backslashreplace",
                    buffering=1,  # line by line
                    closefd=False,
                ),
            ]
            sys.stdin, sys.stdout, sys.stderr = opened
            yield captured
        finally:
            for stream in opened:
                with contextlib.suppress(OSError, ValueError):
                    stream.close()  # flushes; the descriptor stays
            sys.stdin, sys.stdout, sys.stderr = streams
            for fd, copy in saved.items():
                os.dup2(copy, fd)
                os.close(copy)
            captured[:] = [_text(out, encoding), _text(err, encoding)]


def _point_stdin(stdin: Any) -> None:
    if stdin is None:
        return
    if stdin == subprocess.DEVNULL:
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, STDIN)
        os.close(null)
        return
    os.dup2(stdin if isinstance(stdin, int) else stdin.fileno(), STDIN)


def _text(file: IO[bytes], encoding: str) -> str:
    """What ``text=True`` makes of a child's output: decoded, universal newlines."""
    file.seek(0)
    return file.read().decode(encoding).replace("\r\n", "\n").replace("\r", "\n")


@contextlib.contextmanager
def _put_back() -> Iterator[None]:
    """What a call may change in its process, as it was before: see the module's docstring."""
    handlers = {
        signum: handler
        for signum in signal.valid_signals()
        if signum not in {signal.SIGKILL, signal.SIGSTOP}
        and (handler := signal.getsignal(signum)) is not None
    }
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, ())
    library = logging.getLogger("psycopg")
    library_state = (list(library.handlers), library.propagate, library.level)
    structlog_state = _structlog_state()
    learned = _learned_passwords()
    subreaper = child_subreaper()
    cwd = Path.cwd()
    umask = os.umask(0o022)
    os.umask(umask)
    try:
        yield
    finally:
        os.umask(umask)
        os.chdir(cwd)
        _restore_structlog(structlog_state)
        _forget_passwords(learned)
        library.handlers, library.propagate = library_state[0], library_state[1]
        library.setLevel(library_state[2])
        if child_subreaper() != subreaper and subreaper is not None:
            _prctl(_PR_SET_CHILD_SUBREAPER, subreaper)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        for signum, handler in handlers.items():
            if signal.getsignal(signum) is not handler:
                signal.signal(signum, handler)


def _structlog_state() -> tuple[bool, dict[str, Any]] | None:
    structlog = sys.modules.get("structlog")
    if structlog is None:
        return None
    return structlog.is_configured(), structlog.get_config()


def _restore_structlog(state: tuple[bool, dict[str, Any]] | None) -> None:
    structlog = sys.modules.get("structlog")
    if structlog is None:
        return
    if state is None or not state[0]:
        structlog.reset_defaults()
    else:
        structlog.configure(**state[1])


def _learned_passwords() -> tuple[tuple[str, ...], set[tuple[str, str]]]:
    return masking._learned, set(masking._seen)  # noqa: SLF001 - put back after the call


def _forget_passwords(learned: tuple[tuple[str, ...], set[tuple[str, str]]]) -> None:
    """The passwords a run learned stay with its process (jobrun.masking), not with ours.

    WARNING: left in place, a password one call connected with would be masked in every
    later call on this worker, and a test that a call masks it could pass for the wrong
    reason.
    """
    masking._learned, masking._seen = learned  # noqa: SLF001


def child_subreaper() -> int | None:
    """The subreaper flag of this process (a run sets it: prctl(2)); None if it cannot be read."""
    flag = ctypes.c_int(0)
    if not _prctl(_PR_GET_CHILD_SUBREAPER, ctypes.addressof(flag)):
        return None
    return flag.value


def _prctl(option: int, argument: int) -> bool:
    """prctl(option, argument): whether it succeeded (False off Linux)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return False
    prctl = getattr(libc, "prctl", None)
    return prctl is not None and prctl(option, ctypes.c_ulong(argument), 0, 0, 0) == 0


@contextlib.contextmanager
def _threads_end(deadline: float) -> Iterator[None]:
    """Fail when a thread the call started is still running at ``deadline`` (monotonic)."""
    before = set(threading.enumerate())
    yield
    for thread in set(threading.enumerate()) - before:
        thread.join(max(0.0, deadline - time.monotonic()))
        if thread.is_alive():
            msg = f"jobrun, called in this process, left thread {thread.name!r} running"
            raise AssertionError(msg)
