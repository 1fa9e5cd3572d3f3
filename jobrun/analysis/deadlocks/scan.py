"""Find the deadlocks in each log file, name each side from the lines of its pid."""

from __future__ import annotations

import re
from typing import IO, TYPE_CHECKING

from jobrun.analysis.deadlocks import language
from jobrun.analysis.deadlocks.envelopes import ReadStopped
from jobrun.analysis.deadlocks.formats import read_entries
from jobrun.analysis.deadlocks.model import Deadlock, FileRead, Found, Side, parse_detail
from jobrun.analysis.deadlocks.sessions import SessionLog
from jobrun.analysis.deadlocks.sources import LINE_LIMIT, NoInputError, open_log
from jobrun.analysis.deadlocks.storms import storms
from jobrun.exitcodes import Exit

if TYPE_CHECKING:
    from collections.abc import Hashable, Iterable

    from jobrun.analysis.deadlocks.formats import Reading
    from jobrun.analysis.deadlocks.model import Entry

DEADLOCK_MESSAGE = "deadlock detected"
DEADLOCK_SQLSTATE = "40P01"
#: A log time to the second, whatever the format wrote around it (``T``, a zone, millis).
_SECOND = re.compile(r"(\d{4}-\d\d-\d\d)[ T](\d\d:\d\d:\d\d)")
#: Entries after a deadlock within which a DETAIL, CONTEXT or STATEMENT of its pid that
#: other lines separated from it (other sessions, a note in a paste) is still its own.
_ORPHAN_REACH = 200
#: Sides a cycle is followed to through lock waits when its DETAIL was cut.
_MAX_SIDES = 16
_UNNAMED = language.UNNAMED
_AUTHORIZED_FIRST = language.AUTHORIZED_FIRST
_LOCK_WAIT_FIRST = language.LOCK_WAIT_FIRST
_ERRORS = frozenset({"ERROR", "FATAL", "PANIC"})
#: The lines after a message that other lines may have parted from it.
_PARTS = frozenset({"DETAIL", "CONTEXT", "STATEMENT"})


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
    wording = [
        line
        for line in (scanner.wording_line, reading.wording_line if reading else None)
        if line is not None
    ]
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
        if why is None and not scanner.deadlocks and wording:
            read.deadlock_unread = min(wording)
            why = (
                f"line {min(wording)} reads like a deadlock (its wording), yet no deadlock "
                "could be read from the file: not counted as 0 deadlocks"
            )
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
        #: pid -> its latest lock wait (log_lock_waits), to complete a cut DETAIL with.
        self._lock_waits: dict[int | None, language.LockWait] = {}
        #: pid -> (entry number, deadlock) of its latest deadlock, for lines split from it.
        self._recent: dict[int | None, tuple[int, Deadlock]] = {}
        #: The first line with a deadlock's wording (a deadlock read or not).
        self.wording_line: int | None = None

    def feed(self, entry: Entry) -> None:  # noqa: C901, PLR0912 - a test per kind of line
        # WARNING: called for each of the millions of entries of a big log: each test here
        # is the cheapest that rules the common entry out (its first character, a dict).
        self.entries += 1
        if self.sessions is not None:
            self.sessions.feed(entry)
        if entry.app in _UNNAMED:
            entry.app = None
        message = entry.message
        first = message[:1]
        if first in _AUTHORIZED_FIRST:
            authorized = language.authorized_app(message)
            if authorized is not None and authorized not in _UNNAMED:
                entry.app = authorized
        if entry.pid is not None and entry.app:
            if self._waiting:  # tested here: most entries come when no side waits for a name
                self._name_later_sides(entry.pid, entry.line, entry.app)
            self._latest[entry.pid] = (entry.line, entry.app)
        severity = entry.severity
        if severity == "LOG":
            if first in _LOCK_WAIT_FIRST:
                self._lock_wait(entry)
        elif severity in _ERRORS:
            if entry.sqlstate == DEADLOCK_SQLSTATE or message.lstrip().startswith(
                language.DEADLOCK_TEXTS
            ):
                self._add(self._deadlock(entry))
            elif language.has_deadlock_wording(message):
                self._saw_wording(entry.line)
        elif severity in _PARTS:
            self._orphan(entry)
        if entry.extra and self.wording_line is None:
            detail = entry.extra.get("detail")
            if detail is not None and language.has_deadlock_wording(detail):
                self._saw_wording(entry.line)

    def _saw_wording(self, line: int) -> None:
        if self.wording_line is None:
            self.wording_line = line

    def _add(self, deadlock: Deadlock) -> None:
        self._saw_wording(deadlock.line)
        self.deadlocks.append(deadlock)
        self._recent[deadlock.victim] = (self.entries, deadlock)

    def _lock_wait(self, entry: Entry) -> None:
        """A log_lock_waits line: kept per pid, to complete a deadlock whose DETAIL was cut."""
        found = language.lock_wait(entry.message)
        if found is None:
            return
        what, pid, lock = found
        if what == "detected deadlock":
            self._saw_wording(entry.line)
        self._lock_waits[pid] = language.LockWait(
            line=entry.line,
            pid=pid,
            what=what,
            lock=lock,
            holders=language.holders(entry.extra.get("detail", "")),
            statement=entry.extra.get("statement"),
            context=language.context(entry.extra["context"]) if "context" in entry.extra else None,
        )

    def _orphan(self, entry: Entry) -> None:
        """A DETAIL, CONTEXT or STATEMENT that other lines parted from its message.

        The one of a deadlock of its pid a few entries before joins it; a DETAIL that shows
        a cycle without any such deadlock (its ERROR line lost) is a deadlock of its own.
        """
        recent = self._recent.get(entry.pid)
        deadlock = recent[1] if recent and self.entries - recent[0] <= _ORPHAN_REACH else None
        key = entry.severity.lower()
        if key == "detail":
            text = language.detail(entry.message)
            sides = parse_detail(text)
            if not any(side.waits_for for side in sides):
                return
            self._saw_wording(entry.line)
            if deadlock is not None and not deadlock.detailed:
                self._fill(deadlock, sides, entry)
                return
            deadlock = self._bare(entry)
            self._fill(deadlock, sides, entry)
            self._add(deadlock)
        elif deadlock is not None and key == "context" and deadlock.context is None:
            deadlock.context = language.context(entry.message)
        elif deadlock is not None and key == "statement" and deadlock.statement is None:
            deadlock.statement = entry.message

    def _name_later_sides(self, pid: int, line: int, app: str) -> None:
        """A later line names a pid: better than an earlier one if it is nearer."""
        for deadlock_line, side in self._waiting.pop(pid, []):
            if side.named_by is None or line - deadlock_line < deadlock_line - int(
                side.named_by.split()[-1]
            ):
                side.application = app
                side.named_by = f"line {line}"

    def _bare(
        self, entry: Entry, *, context: str | None = None, statement: str | None = None
    ) -> Deadlock:
        """The deadlock ``entry`` reports: where, when, who, the victim; no sides yet."""
        return Deadlock(
            source=self.source,
            line=entry.line,
            time=entry.time,
            user=entry.user,
            db=entry.db,
            victim=entry.pid,
            sides=[],
            context=context,
            statement=statement,
        )

    def _deadlock(self, entry: Entry) -> Deadlock:
        extra = entry.extra
        deadlock = self._bare(
            entry,
            context=language.context(extra["context"]) if "context" in extra else None,
            statement=extra.get("statement"),
        )
        sides = parse_detail(language.detail(entry.extra.get("detail", "")))
        self._fill(deadlock, sides, entry)
        return deadlock

    def _fill(self, deadlock: Deadlock, sides: list[Side], entry: Entry) -> None:
        """The deadlock's sides: its DETAIL's, completed from lock waits, each named."""
        deadlock.detailed = any(side.waits_for for side in sides)
        victim = deadlock.victim
        if deadlock.detailed and not any(side.pid == victim for side in sides):
            # The process that logs a cycle is in it: a number read from a prefix of an
            # unknown shape that is not in it was no pid (a line number, a count).
            deadlock.victim = victim = None
        if victim is not None and not any(side.pid == victim for side in sides):
            sides.insert(0, Side(victim))
        self._complete(deadlock, sides)
        deadlock.sides = sides
        for side in sides:
            if side.pid == victim and entry.pid == victim and entry.app:
                side.application, side.named_by = entry.app, "this line"
                continue
            earlier = self._latest.get(side.pid)
            if earlier is not None:
                side.application, side.named_by = earlier[1], f"line {earlier[0]}"
            # A later line may be nearer (a "still waiting" line comes after the error).
            self._waiting.setdefault(side.pid, []).append((deadlock.line, side))

    def _complete(self, deadlock: Deadlock, sides: list[Side]) -> None:
        """A cut DETAIL: each side's lock, blocker and statement from its pid's lock wait.

        ``process N still waiting for ...`` (or ``detected deadlock while waiting``) with
        ``Process holding the lock: M`` says what N waited for and who held it: the cycle
        is followed from side to side as far as those lines go.
        """
        by_pid = {side.pid: side for side in sides}
        queue = list(sides)
        while queue and len(by_pid) <= _MAX_SIDES:
            side = queue.pop(0)
            wait = self._lock_waits.get(side.pid)
            if wait is None or wait.line > deadlock.line:
                continue
            if side.waits_for is None:
                side.waits_for = wait.lock
            if side.blocked_by is None and wait.holders:
                side.blocked_by = wait.holders[0]
            if not side.statement and wait.statement:
                side.statement = wait.statement
            if wait.context is not None:
                side.context = wait.context
                if deadlock.context is None and side.pid == deadlock.victim:
                    deadlock.context = wait.context
            blocker = side.blocked_by
            if blocker is not None and blocker not in by_pid:
                by_pid[blocker] = Side(blocker)
                sides.append(by_pid[blocker])
                queue.append(by_pid[blocker])
