"""Find the deadlocks in each log file, name each side from the lines of its pid."""

from __future__ import annotations

import re
from typing import IO, TYPE_CHECKING

from jobrun.deadlocks.envelopes import ReadStopped
from jobrun.deadlocks.formats import read_entries
from jobrun.deadlocks.model import Deadlock, FileRead, Found, Side, parse_detail
from jobrun.deadlocks.sessions import SessionLog
from jobrun.deadlocks.sources import LINE_LIMIT, NoInputError, open_log
from jobrun.deadlocks.storms import storms
from jobrun.exitcodes import Exit

if TYPE_CHECKING:
    from collections.abc import Hashable, Iterable

    from jobrun.deadlocks.formats import Reading
    from jobrun.deadlocks.model import Entry

DEADLOCK_MESSAGE = "deadlock detected"
DEADLOCK_SQLSTATE = "40P01"
#: log_connections' line for a session, which carries its application_name from the start
#: (the %a of that line still reads [unknown]: the name is set just after it).
_AUTHORIZED = re.compile(
    r"connection authorized: .*?\bapplication_name=(?P<app>.*?)(?: SSL enabled| GSS|\Z)"
)
#: What %a (and csvlog/jsonlog) show before the startup packet has named the session.
_UNNAMED = frozenset({"", "[unknown]"})
#: A log time to the second, whatever the format wrote around it (``T``, a zone, millis).
_SECOND = re.compile(r"(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)")


def find(
    paths: Iterable[str],
    *,
    prefix: str | None = None,
    stdin: IO[bytes] | None = None,
    sessions: bool = False,
) -> Found:
    """Every deadlock in the logs at ``paths`` (``-``: ``stdin``), each file reported on.

    A file that cannot be understood is reported with the reason and the others are still
    read. The same deadlock logged in two files (a server's csvlog and jsonlog, a stderr
    log and its cloud export) is counted once, from the first file that has it. With
    ``sessions``, connection and disconnection lines are kept as sessions (a small record
    per line, which is why it is asked for).
    """
    found = Found()
    seen: dict[Hashable, Deadlock] = {}
    log = SessionLog() if sessions else None
    for path in paths:
        scanner = _read(path, prefix, stdin, log)
        found.files.append(scanner.file)
        for deadlock in scanner.deadlocks:
            key = _identity(deadlock)
            earlier = seen.get(key) if key is not None else None
            if earlier is not None and earlier.source != deadlock.source:
                earlier.also_in.append(deadlock.source)
                scanner.file.duplicates += 1
                continue
            if key is not None:
                seen[key] = deadlock
            found.deadlocks.append(deadlock)
    found.storms = storms(found.deadlocks)
    found.sessions = log.sessions() if log is not None else []
    return found


def _read(
    path: str, prefix: str | None, stdin: IO[bytes] | None, sessions: SessionLog | None
) -> _Scanner:
    """One file read to its end; its FileRead says what it was read as, or why not."""
    scanner = _Scanner(path if path != "-" else "(stdin)", sessions)
    reading: Reading | None = None
    stopped: str | None = None
    try:
        with open_log(path, stdin) as (text, packed):
            # What a crafted file can make the reader raise ends this file, not the command.
            try:
                reading = read_entries(text, scanner.source, prefix)
                for entry in reading.entries:
                    scanner.feed(entry)
            except ReadStopped as exc:
                stopped = str(exc)
            except RecursionError:
                stopped = "stopped: a value nested too deeply to read; the rest was not read"
            except MemoryError:
                stopped = "stopped: out of memory while reading it; the rest was not read"
    except NoInputError as exc:
        scanner.file.error, scanner.file.status = str(exc), NoInputError.exit_code
        return scanner
    read = scanner.file
    read.entries, read.deadlocks = scanner.entries, len(scanner.deadlocks)
    read.stopped = stopped or text.stopped
    read.lines_cut = text.cut + (reading.cut if reading is not None else 0)
    limits = [read.stopped] if read.stopped is not None else []
    if read.lines_cut:
        limits.append(
            f"{read.lines_cut} line(s) cut at {LINE_LIMIT // 1024} KiB (longer than a server "
            "writes: what was cut is not read)"
        )
    why = None
    if reading is not None:
        packing = f", {packed}" if packed is not None and reading.format is not None else ""
        read.format = reading.format and reading.format + packing
        read.prefix, read.reindented = reading.prefix, reading.reindented
        why = _not_read(reading, read.entries, prefix, stopped=bool(limits))
    if why is not None or limits:
        read.error = f"{scanner.source}: " + "; ".join([*limits, *([why] if why else [])])
        read.status = Exit.DATA_ERROR
    return scanner


def _not_read(reading: Reading, entries: int, prefix: str | None, *, stopped: bool) -> str | None:
    """Why a file read to its end (or as far as it goes) gave nothing, or None."""
    if reading.format is None:
        return reading.why
    if entries == 0 and reading.format != "empty" and not stopped:
        how = (
            f"--log-line-prefix {prefix!r}"
            if prefix is not None
            else f"the {reading.format} format"
        )
        return (
            f"not empty, yet {how} reads no entry from it; "
            "check log_line_prefix in postgresql.conf (SHOW log_line_prefix)"
        )
    return None


def _identity(deadlock: Deadlock) -> Hashable | None:
    """The same deadlock in two formats of one server: same second, same victim, same pids."""
    second = _SECOND.search(deadlock.time or "")
    if second is None:
        return None
    return (second[1], second[2], deadlock.victim, frozenset(side.pid for side in deadlock.sides))


class _Scanner:
    """Collects deadlocks, and application names per pid to name the other sides with."""

    def __init__(self, source: str, sessions: SessionLog | None) -> None:
        self.source = source
        self.sessions = sessions
        self.file = FileRead(source)
        self.entries = 0
        self.deadlocks: list[Deadlock] = []
        #: pid -> (line, application) of the latest entry of that pid that named it.
        self._latest: dict[int, tuple[int, str]] = {}
        #: Sides still unnamed, waiting for a later line of their pid: pid -> [(line, side)].
        self._waiting: dict[int, list[tuple[int, Side]]] = {}

    def feed(self, entry: Entry) -> None:
        self.entries += 1
        if self.sessions is not None:
            self.sessions.feed(entry)
        if entry.app in _UNNAMED:
            entry.app = None
        authorized = _AUTHORIZED.match(entry.message)
        if authorized and authorized["app"] not in _UNNAMED:
            entry.app = authorized["app"]
        if entry.pid is not None and entry.app:
            self._name_later_sides(entry.pid, entry.line, entry.app)
            self._latest[entry.pid] = (entry.line, entry.app)
        if entry.severity == "ERROR" and (
            entry.message == DEADLOCK_MESSAGE or entry.sqlstate == DEADLOCK_SQLSTATE
        ):
            self.deadlocks.append(self._deadlock(entry))

    def _name_later_sides(self, pid: int, line: int, app: str) -> None:
        """A later line names a pid: better than an earlier one if it is nearer."""
        for deadlock_line, side in self._waiting.pop(pid, []):
            if side.named_by is None or line - deadlock_line < deadlock_line - int(
                side.named_by.split()[-1]
            ):
                side.application = app
                side.named_by = f"line {line}"

    def _deadlock(self, entry: Entry) -> Deadlock:
        sides = parse_detail(entry.extra.get("detail", ""))
        if entry.pid is not None and not any(side.pid == entry.pid for side in sides):
            sides.insert(0, Side(entry.pid))
        for side in sides:
            if side.pid == entry.pid and entry.app:
                side.application, side.named_by = entry.app, "this line"
                continue
            earlier = self._latest.get(side.pid)
            if earlier is not None:
                side.application, side.named_by = earlier[1], f"line {earlier[0]}"
            # A later line may be nearer (a "still waiting" line comes after the error).
            self._waiting.setdefault(side.pid, []).append((entry.line, side))
        return Deadlock(
            source=self.source,
            line=entry.line,
            time=entry.time,
            user=entry.user,
            db=entry.db,
            victim=entry.pid,
            sides=sides,
            context=entry.extra.get("context"),
            statement=entry.extra.get("statement"),
        )
