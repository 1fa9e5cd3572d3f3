"""``--keep-output``: copy the child's output through live, keeping the last bytes of each."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import select
import threading
from dataclasses import KW_ONLY, dataclass, field
from typing import TYPE_CHECKING

from jobrun import threads
from jobrun.exitcodes import UsageError
from jobrun.run.listeners import Listener

if TYPE_CHECKING:
    from collections.abc import Mapping

    import psycopg
    from structlog.typing import FilteringBoundLogger

    from jobrun import db
    from jobrun.masking import Masker

STDOUT, STDERR = 1, 2
#: A tail is a tail: more than this per stream belongs in a log file, not in the history.
MAX_SIZE = 1024 * 1024
#: Once the child is gone, how long we still read from processes that left its group (a
#: daemon started with setsid) and keep its stdout or stderr open. Then we stop reading.
DRAIN_GRACE = 1.0
#: Most bytes of each tail in an ``--on-alert`` event: it is also passed in the environment,
#: and one variable may hold 128 KiB at most (the hook would not start).
ALERT_LIMIT = 4096
#: Bytes per read: the memory a read takes, whatever the length of the child's lines.
_CHUNK = 65536
_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kib": 1024,
    "kb": 1000,
    "m": 1024**2,
    "mib": 1024**2,
    "mb": 1000**2,
}
_SIZE = re.compile(r"([0-9]{1,12})\s*([a-z]*)")


def parse_size(text: str, *, option: str = "--keep-output") -> int:
    """Bytes in ``16KiB``, ``64k``, ``1MiB``, ``4096`` (0: keep nothing); UsageError otherwise."""
    match = _SIZE.fullmatch(text.strip().lower())
    if match is None or match.group(2) not in _UNITS:
        raise UsageError(f"{option}: {text!r} is not a size (examples: 4096, 16KiB, 64k, 1MiB)")
    size = int(match.group(1)) * _UNITS[match.group(2)]
    if size > MAX_SIZE:
        raise UsageError(f"{option}: {text!r} is too large (at most 1MiB per stream)")
    return size


class Ring:
    """The last ``size`` bytes written to it."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._buf = bytearray()
        self.total = 0

    def write(self, data: bytes) -> None:
        """Append ``data``, forgetting what falls out of the window."""
        self.total += len(data)
        if len(data) >= self.size:
            self._buf[:] = data[len(data) - self.size :]
            return
        self._buf += data
        excess = len(self._buf) - self.size
        if excess > 0:
            del self._buf[:excess]

    def value(self) -> bytes:
        """The kept bytes."""
        return bytes(self._buf)


@dataclass(eq=False)
class Capture:
    """Pipes for the child's stdout and stderr, a thread copying them to ours, and two rings.

    Without a Capture the child inherits jobrun's descriptors directly (no copy at all).

    WARNING: once the child's group is gone, whatever still holds a pipe open (a process
    that left the group) is read for ``grace`` seconds more, then the pipes are closed:
    its next write then fails (EPIPE / SIGPIPE). jobrun never waits for such a process.
    """

    size: int
    _: KW_ONLY
    grace: float = DRAIN_GRACE
    #: Where the copies go: our own stdout and stderr.
    targets: tuple[int, int] = (STDOUT, STDERR)
    masker: Masker | None = None
    #: The tails went into the history row with the run's end (not to be stored again).
    stored: bool = field(default=False, init=False)
    #: Whether a child ran with these pipes (its tails mean something).
    used: bool = field(default=False, init=False)
    #: False when the pipes were closed before their end (see the class's warning).
    complete: bool = field(default=True, init=False)
    #: Why copying to our own stdout / stderr stopped, if it did (e.g. EPIPE).
    forward_errors: dict[int, str] = field(default_factory=dict, init=False)
    _read: list[int] = field(default_factory=list, init=False)
    _write: list[int] = field(default_factory=list, init=False)
    _stop_r: int = field(default=-1, init=False)
    _stop_w: int = field(default=-1, init=False)
    _thread: threading.Thread | None = field(default=None, init=False)
    _mutex: threading.Lock = field(default_factory=threading.Lock, init=False)

    def __post_init__(self) -> None:
        self._rings = (Ring(self.size), Ring(self.size))

    def child_fds(self) -> tuple[int, int]:
        """Open the pipes; the write ends, for the child's stdout and stderr."""
        for _ in self.targets:
            read_end, write_end = os.pipe()
            self._read.append(read_end)
            self._write.append(write_end)
        self._stop_r, self._stop_w = os.pipe()
        return self._write[0], self._write[1]

    def begin(self) -> None:
        """The child has them: drop our write ends (or EOF never comes) and start copying.

        The thread runs with every signal blocked, whoever calls this: a SIGCHLD it took
        would never reach the supervisor.
        """
        self.used = True
        self._close_write_ends()
        self._thread = threads.start(self._copy, name="jobrun-output")

    def finish(self) -> None:
        """The child's group is gone: read to the end, or for ``grace`` seconds at most."""
        thread = self._thread
        if thread is None:
            self.close()
            return
        thread.join(self.grace)
        if thread.is_alive():
            self.complete = False
            with contextlib.suppress(OSError):
                os.write(self._stop_w, b"x")
            # A copy blocked on our own full stdout cannot see the stop: leave it (a daemon
            # thread), the rings are read under the mutex.
            thread.join(self.grace)
        if not thread.is_alive():
            self.close()

    def close(self) -> None:
        """Close every pipe end we still have (spawning failed, or the copy is over)."""
        self._close_write_ends()
        for fd in (*self._read, self._stop_r, self._stop_w):
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._read = []
        self._stop_r = self._stop_w = -1

    @property
    def stdout_tail(self) -> bytes:
        """The last ``size`` bytes the child wrote to its stdout, secrets masked."""
        return self._tail(0)

    @property
    def stderr_tail(self) -> bytes:
        """The last ``size`` bytes the child wrote to its stderr, secrets masked."""
        return self._tail(1)

    def _tail(self, index: int) -> bytes:
        """A ring's bytes, masked as a whole.

        WARNING: never chunk by chunk: a secret the child wrote in two writes (or that one
        read split) lies across two chunks, and only the ring holds it whole. A ring that
        dropped its oldest bytes may start inside a secret: the masker is told so.
        """
        with self._mutex:
            ring = self._rings[index]
            data, cut = ring.value(), ring.total > ring.size
        return data if self.masker is None else self.masker.data(data, cut=cut)

    def _close_write_ends(self) -> None:
        for fd in self._write:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._write = []

    def _copy(self) -> None:
        """On the thread: copy every chunk to our stream and into its ring, until EOF or stop."""
        poller = select.poll()
        streams = {fd: index for index, fd in enumerate(self._read)}
        for fd in streams:
            poller.register(fd, select.POLLIN)
        poller.register(self._stop_r, select.POLLIN)
        while streams:
            for fd, _ in poller.poll():
                if fd == self._stop_r:
                    return
                if fd not in streams:
                    continue
                data = _read(fd)
                if not data:  # EOF: every writer closed it
                    poller.unregister(fd)
                    del streams[fd]
                    continue
                index = streams[fd]
                with self._mutex:
                    self._rings[index].write(data)
                self._forward(index, data)

    def _forward(self, index: int, data: bytes) -> None:
        target = self.targets[index]
        if target in self.forward_errors:
            return
        view = memoryview(data)
        while view:
            try:
                written = os.write(target, view)
            except InterruptedError:  # pragma: no cover - PEP 475 retries for us
                continue
            except OSError as exc:
                # Our own stdout is gone (a closed pipe, a full disk): keep capturing, so
                # the child never blocks on a pipe nobody reads.
                self.forward_errors[target] = errno.errorcode.get(exc.errno or 0, str(exc))
                return
            view = view[written:]


def _read(fd: int) -> bytes:
    try:
        return os.read(fd, _CHUNK)
    except OSError:
        return b""


def text(data: bytes | None) -> str:
    """Bytes as text for a terminal or JSON: invalid UTF-8 replaced, NULs made visible."""
    if not data:
        return ""
    return data.decode("utf-8", "replace").replace("\x00", "\ufffd")


def fields(capture: Capture, *, limit: int | None = None) -> dict[str, str]:
    """``stdout_tail`` / ``stderr_tail`` as text (the last ``limit`` bytes each) for events."""
    out, err = capture.stdout_tail, capture.stderr_tail
    if limit is not None:
        out, err = out[-limit:], err[-limit:]
    return {"stdout_tail": text(out), "stderr_tail": text(err)}


@dataclass
class KeptOutput(Listener):
    """``--keep-output`` as a run's listener: the child's pipes, then a failed run's tails."""

    capture: Capture
    target: db.Target
    run_id: str
    _: KW_ONLY
    #: False (``--no-history``): the tails go only to the end ping.
    history: bool
    log: FilteringBoundLogger

    def stdio(self) -> tuple[int, int]:
        """The pipes' write ends, for the child."""
        return self.capture.child_fds()

    def not_started(self, outcome: str, exit_code: int) -> None:
        """No child: close the pipes (if they were opened)."""
        del outcome, exit_code
        self.capture.close()

    def started(self, child_pid: int) -> None:
        """Start copying what the child writes."""
        del child_pid
        self.capture.begin()

    def exited(self) -> None:
        """The child's group is gone: read the pipes to their end."""
        self.capture.finish()

    def released(self, status: int) -> None:
        """A failed run's tails into its history row (bounded: STORE_TIMEOUT)."""
        # Normally the end row's message carried them; only if it could not, a session of
        # their own (the lock is free by now).
        if self.capture.used and status != 0 and self.history and not self.capture.stored:
            store(self.target, self.run_id, self.capture, log=self.log)


# --- the history ---------------------------------------------------------------------------

#: A tail write gives up after this long (connecting, and on the server).
STORE_TIMEOUT = 5.0


def store(target: db.Target, run_id: str, capture: Capture, *, log: FilteringBoundLogger) -> bool:
    """Put the tails into the run's history row (after the run: the lock is free by now).

    Never raises: a failure is one warning.
    """
    import dataclasses  # noqa: PLC0415 - only runs that kept output get here

    import psycopg  # noqa: PLC0415

    from jobrun import db, sql  # noqa: PLC0415
    from jobrun.exitcodes import LockStoreUnavailable  # noqa: PLC0415

    params = {"run_id": run_id, "stdout": capture.stdout_tail, "stderr": capture.stderr_tail}
    bounded = dataclasses.replace(
        target, connect_timeout=min(target.connect_timeout, STORE_TIMEOUT)
    )

    def attempt(conn: psycopg.Connection[tuple[object, ...]]) -> int:
        with conn.transaction():
            conn.execute(sql.RUNS_TIMEOUTS, {"ms": str(int(STORE_TIMEOUT * 1000))})
            return conn.execute(sql.RUNS_STORE_TAIL, params).rowcount

    # The run's row exists only where its history checked the schema's version (the tails'
    # columns are step 1's): nothing to make here.
    try:
        with db.connect(bounded, app_name="jobrun-output") as conn:
            stored = attempt(conn)
    except (psycopg.Error, LockStoreUnavailable) as exc:
        log.warning("output_not_stored", error=db.one_line(exc, target))
        return False
    if not stored:
        log.warning("output_not_stored", error="the run has no history row")
        return False
    log.info(
        "output_stored", stdout_bytes=len(params["stdout"]), stderr_bytes=len(params["stderr"])
    )
    return True


def read(conn: psycopg.Connection[tuple[object, ...]], run_id: str) -> Mapping[str, object] | None:
    """The run ``run_id`` with its tails, None where not kept (None: no such run)."""
    from jobrun import sql  # noqa: PLC0415
    from jobrun.history import schema  # noqa: PLC0415

    def attempt(check: tuple[str, ...]) -> list[tuple[object, ...]]:
        *_, rows = schema.results(conn, ";\n".join((*check, sql.RUNS_TAIL)), {"run_id": run_id})
        return rows

    found = schema.readable(conn, attempt)  # None: no schema yet, no run
    row = found[0] if found else None
    if row is None:
        return None
    names = ("run_id", "key", "host", "outcome", "exit_code", "started_at", "stdout", "stderr")
    return dict(zip(names, row, strict=True))


def render(run: Mapping[str, object]) -> str:
    """A run's tails for a terminal: a header line, then each stream (bytes made text)."""
    started = run["started_at"]
    when = started.isoformat(timespec="seconds") if hasattr(started, "isoformat") else started
    header = (
        f"run {run['run_id']}  key {run['key']}  host {run['host']}  started {when}  "
        f"outcome {run['outcome']}  exit {run['exit_code']}\n"
    )
    parts = [header]
    for name in ("stdout", "stderr"):
        data = run[name]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            parts.append(f"--- {name}: not kept\n")
            continue
        body = text(bytes(data))
        parts.append(f"--- {name} (last {len(data)} bytes)\n")
        parts.append(body if not body or body.endswith("\n") else body + "\n")
    return "".join(parts)
