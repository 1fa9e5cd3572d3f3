"""What a log entry and a deadlock are made of: entries, sides, deadlocks, files read."""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datetime as dt

#: jobrun names the sessions of a job it runs ``jobrun:<key>`` (PGAPPNAME).
JOB_PREFIX = "jobrun:"
_WAITS = re.compile(
    r"\s*Process (?P<pid>\d+) waits for (?P<lock>.+?); blocked by process (?P<blocker>\d+)\.\s*\Z"
)
#: A copy that strips trailing blanks leaves ``Process 4178:`` without its space.
_RUNS = re.compile(r"\s*Process (?P<pid>\d+):(?: (?P<statement>.*))?\Z", re.DOTALL)


@dataclass
class Entry:
    """One log message with the lines that belong to it (DETAIL, CONTEXT, STATEMENT...)."""

    source: str
    line: int
    severity: str
    message: str
    pid: int | None = None
    app: str | None = None
    time: str | None = None
    user: str | None = None
    db: str | None = None
    sqlstate: str | None = None
    extra: dict[str, str] = field(default_factory=dict)


@dataclass
class Side:
    """One process in a deadlock's wait-for cycle."""

    pid: int
    waits_for: str | None = None
    blocked_by: int | None = None
    statement: str | None = None
    application: str | None = None
    #: Where the application name came from: "this line", "line N" (another line of that
    #: pid), or None when the log never names it.
    named_by: str | None = None
    #: The CONTEXT of this side's lock wait (log_lock_waits), which names the relation.
    context: str | None = None

    @property
    def job(self) -> str | None:
        """The jobrun key when the application name is ``jobrun:<key>``."""
        if self.application and self.application.startswith(JOB_PREFIX):
            return self.application[len(JOB_PREFIX) :]
        return None

    def as_json(self) -> dict[str, Any]:
        """The side for ``--json``: its fields, and the job its application name names."""
        return {**asdict(self), "job": self.job}


@dataclass
class Deadlock:
    """A ``deadlock detected`` error and the processes whose cycle PostgreSQL broke."""

    source: str
    line: int
    time: str | None
    user: str | None
    db: str | None
    victim: int | None
    sides: list[Side]
    context: str | None = None
    statement: str | None = None
    #: Other files where the same deadlock was logged (the csvlog and jsonlog of one server).
    also_in: list[str] = field(default_factory=list)
    #: Whether a DETAIL showed its cycle (else the sides come from lock waits, or are unknown).
    detailed: bool = False

    def as_json(self) -> dict[str, Any]:
        """The deadlock for ``--json``."""
        return {
            "source": self.source,
            "line": self.line,
            "time": self.time,
            "user": self.user,
            "database": self.db,
            "victim_pid": self.victim,
            "sides": [side.as_json() for side in self.sides],
            "context": self.context,
            "statement": self.statement,
            "also_in": self.also_in,
        }


@dataclass
class FileRead:
    """What one file was read as, and what it held; or why it could not be read."""

    source: str
    format: str | None = None
    prefix: str | None = None
    entries: int = 0
    deadlocks: int = 0
    #: Deadlocks of this file already counted from another file.
    duplicates: int = 0
    #: Continuation lines indented with spaces instead of a tab.
    reindented: int = 0
    #: Lines (or messages) longer than the reader keeps, cut there.
    lines_cut: int = 0
    #: Why the file was not read to its end (a decompression bomb...), or None.
    stopped: str | None = None
    #: The line of a deadlock's wording in a file from which no deadlock could be read.
    deadlock_unread: int | None = None
    error: str | None = None
    #: The exit status this file alone calls for: 0, 65 (not understood, or read in part),
    #: 66 (unreadable).
    status: int = 0

    @property
    def partial(self) -> bool:
        """Read as a server log, entries and all, but not all of it (cut or stopped)."""
        return (
            self.error is not None
            and bool(self.format)
            and self.entries > 0
            and self.deadlock_unread is None
        )

    def as_json(self) -> dict[str, Any]:
        """The file for ``--json``."""
        return {
            "source": self.source,
            "format": self.format,
            "prefix": self.prefix,
            "entries": self.entries,
            "deadlocks": self.deadlocks,
            "duplicates": self.duplicates,
            "reindented_lines": self.reindented,
            "lines_cut": self.lines_cut,
            "stopped": self.stopped,
            "deadlock_unread": self.deadlock_unread,
            "error": self.error,
        }


@dataclass
class Storm:
    """Deadlocks of the same sides in quick succession: a job retrying into the same cycle."""

    sides: list[str]
    deadlocks: list[Deadlock]

    def as_json(self) -> dict[str, Any]:
        """The storm for ``--json``."""
        return {
            "sides": self.sides,
            "deadlocks": len(self.deadlocks),
            "first": self.deadlocks[0].time,
            "last": self.deadlocks[-1].time,
        }


@dataclass(slots=True)
class Session:
    """One server session: who (application, user, database, host) and from when to when."""

    pid: int
    start: dt.datetime
    #: None: still open when the log ends (or its disconnection was not logged).
    end: dt.datetime | None = None
    application: str | None = None
    user: str | None = None
    database: str | None = None
    host: str | None = None

    @property
    def label(self) -> str:
        """The application, or ``[no application_name] user@database``."""
        if self.application:
            return self.application
        return f"[no application_name] {self.user or '?'}@{self.database or '?'}"

    def open_at(self, when: dt.datetime) -> bool:
        """Connected at ``when``."""
        return self.start <= when and (self.end is None or when <= self.end)


@dataclass
class Found:
    """What the logs held: the deadlocks, and per file its format and lines read."""

    deadlocks: list[Deadlock] = field(default_factory=list)
    files: list[FileRead] = field(default_factory=list)
    storms: list[Storm] = field(default_factory=list)
    #: Sessions from log_connections / log_disconnections lines, every file together.
    sessions: list[Session] = field(default_factory=list)

    @property
    def unread(self) -> list[FileRead]:
        """The files that could not be read as a server log, or only in part."""
        return [read for read in self.files if read.error is not None]

    def as_json(self) -> dict[str, Any]:
        """The whole result for ``--json``."""
        return {
            "deadlocks": [deadlock.as_json() for deadlock in self.deadlocks],
            "files": [read.as_json() for read in self.files],
            "storms": [storm.as_json() for storm in self.storms],
        }


def parse_detail(detail: str) -> list[Side]:
    """The sides of a ``deadlock detected`` DETAIL: who waits for what, and what each ran.

    The DETAIL reads ``Process A waits for L1; blocked by process B.`` per process of the
    cycle, then ``Process A: <statement>`` per process, a statement going on over the
    following lines until the next ``Process N:``.
    """
    sides: dict[int, Side] = {}
    current: Side | None = None
    for line in detail.split("\n"):
        waits = _WAITS.match(line)
        if waits:
            pid = int(waits["pid"])
            side = sides.setdefault(pid, Side(pid))
            side.waits_for, side.blocked_by = waits["lock"], int(waits["blocker"])
            current = None
            continue
        runs = _RUNS.match(line)
        if runs and (int(runs["pid"]) in sides or not sides):
            current = sides.setdefault(int(runs["pid"]), Side(int(runs["pid"])))
            current.statement = runs["statement"] or ""
            continue
        if current is not None and current.statement is not None:
            current.statement = f"{current.statement}\n{line}" if current.statement else line
    return list(sides.values())
