"""``jobrun deadlocks``: find every deadlock in PostgreSQL server logs and name both sides."""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import itertools
import json
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, cast

from jobrun.exitcodes import Exit, JobrunError, OutputError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

#: jobrun names the sessions of a job it runs ``jobrun:<key>`` (PGAPPNAME).
JOB_PREFIX = "jobrun:"
DEADLOCK_MESSAGE = "deadlock detected"
DEADLOCK_SQLSTATE = "40P01"
#: Lines read to choose the stderr prefix layout before the real pass starts.
SNIFF_LINES = 2000
#: Longest csvlog field accepted (a statement of a bulk INSERT can be megabytes).
_CSV_FIELD_LIMIT = 64 * 1024 * 1024

#: ``log_line_prefix`` values seen in the wild, tried in this order when none is given: with
#: ``%a`` first, because a layout without it also matches part of a line that has it.
COMMON_PREFIXES: tuple[str, ...] = (
    "%m [%p] %q%u@%d %a ",  # Debian's default plus the application name
    "%m [%p] %q%a %u@%d ",
    "%m [%p] %a ",
    "%m [%p] %q[%a] %u@%d ",
    "%t [%p]: [%l-1] user=%u,db=%d,app=%a,client=%h ",  # the layout pgBadger documents
    "%t [%p]: user=%u,db=%d,app=%a,client=%h ",
    "%m [%p]: [%l-1] db=%d,user=%u ",  # Cloud SQL
    "%t:%r:%u@%d:[%p]:",  # Amazon RDS
    "%m [%p] %q%u@%d ",  # Debian and Ubuntu
    "%t [%p]: [%l-1] user=%u,db=%d,client=%h ",
    "%m [%p] ",  # PostgreSQL's own default
    "%t [%p] ",
)

_SEVERITIES = (
    "DEBUG1|DEBUG2|DEBUG3|DEBUG4|DEBUG5|INFO|NOTICE|WARNING|ERROR|LOG|FATAL|PANIC|"
    "DETAIL|HINT|QUERY|CONTEXT|LOCATION|STATEMENT"
)
_MESSAGE = re.compile(rf"(?P<severity>{_SEVERITIES}):  (?P<message>.*)\Z", re.DOTALL)
#: Escapes of log_line_prefix as regular expressions (a padding such as %-10a is allowed).
_ESCAPES = {
    "a": r"(?P<app>.*?)",
    "u": r"(?P<user>\S*?)",
    "d": r"(?P<db>\S*?)",
    "r": r"(?:\S*?)",
    "h": r"(?:\S*?)",
    "b": r"(?:.*?)",
    "p": r"(?P<pid>\d+)",
    "P": r"(?:\d*)",
    "t": r"(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?: ?[A-Za-z0-9+:-]+)?)",
    "m": r"(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+(?: ?[A-Za-z0-9+:-]+)?)",
    "n": r"(?P<time>\d+\.\d+)",
    "i": r"(?:.*?)",
    "e": r"(?:[0-9A-Z]{5})",
    "c": r"(?P<session>[0-9a-f]+\.[0-9a-f]+)",
    "l": r"(?:\d+)",
    "s": r"(?:\d{4}-\d\d-\d\d \d\d:\d\d:\d\d(?: ?[A-Za-z0-9+:-]+)?)",
    "v": r"(?:\S*?)",
    "x": r"(?:\d+)",
    "Q": r"(?:-?\d+)",
}
_ESCAPE = re.compile(r"%(-?\d*)([a-zA-Z%])")
_GROUP_NAME = re.compile(r"\?P<\w+>")
_WAITS = re.compile(
    r"Process (?P<pid>\d+) waits for (?P<lock>.+?); blocked by process (?P<blocker>\d+)\.\Z"
)
#: log_connections' line for a session, which carries its application_name from the start
#: (the %a of that line still reads [unknown]: the name is set just after it).
_AUTHORIZED = re.compile(
    r"connection authorized: .*?\bapplication_name=(?P<app>.*?)(?: SSL enabled| GSS|\Z)"
)
#: What %a (and csvlog/jsonlog) show before the startup packet has named the session.
_UNNAMED = frozenset({"", "[unknown]"})
_RUNS = re.compile(r"Process (?P<pid>\d+): (?P<statement>.*)\Z", re.DOTALL)


class NoInputError(JobrunError):
    """A log file is missing or unreadable."""

    exit_code = Exit.NO_INPUT
    event = "no_input"


class NotALogError(JobrunError):
    """Nothing in a log file looks like a PostgreSQL server log."""

    exit_code = Exit.DATA_ERROR
    event = "not_a_log"


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

    @property
    def job(self) -> str | None:
        """The jobrun key when the application name is ``jobrun:<key>``."""
        if self.application and self.application.startswith(JOB_PREFIX):
            return self.application[len(JOB_PREFIX) :]
        return None

    def as_json(self) -> dict[str, Any]:
        """The side for ``--json``."""
        return {
            "pid": self.pid,
            "application": self.application,
            "job": self.job,
            "named_by": self.named_by,
            "waits_for": self.waits_for,
            "blocked_by": self.blocked_by,
            "statement": self.statement,
        }


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
        }


@dataclass
class Found:
    """What the logs held: the deadlocks, and per file its format and lines read."""

    deadlocks: list[Deadlock] = field(default_factory=list)
    files: list[dict[str, Any]] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        """The whole result for ``--json``."""
        return {
            "deadlocks": [deadlock.as_json() for deadlock in self.deadlocks],
            "files": self.files,
        }


def run(
    paths: Iterable[str],
    *,
    prefix: str | None,
    as_json: bool,
    check: bool,
    echo: Callable[[str], None],
) -> int:
    """``jobrun deadlocks``: print what the logs hold; 1 with ``check`` when any deadlock."""
    paths = list(paths)
    for path in paths:  # every file checked before any output: no half a report
        if path != "-" and not (Path(path).is_file() and os.access(path, os.R_OK)):
            reason = "no such file" if not Path(path).exists() else "not a readable file"
            raise NoInputError(f"cannot read {path}: {reason}")
    found = find(paths, prefix=prefix)
    try:
        echo(json.dumps(found.as_json(), indent=2) if as_json else report(found))
        sys.stdout.flush()
    except OSError as exc:
        raise OutputError(f"cannot write the report: {exc.strerror or exc}") from None
    return 1 if check and found.deadlocks else 0


def prefix_pattern(prefix: str) -> re.Pattern[str]:
    """A regular expression for a stderr line written with ``log_line_prefix = prefix``.

    ``%q`` ends the part that non-session processes (the checkpointer...) leave out, so
    everything after it is optional.
    """
    parts: list[str] = []
    optional_from: int | None = None
    used: set[str] = set()
    position = 0
    for match in _ESCAPE.finditer(prefix):
        parts.append(re.escape(prefix[position : match.start()]))
        position = match.end()
        letter = match.group(2)
        if letter == "%":
            parts.append("%")
        elif letter == "q":
            optional_from = len(parts)
        elif letter in _ESCAPES:
            pattern = _ESCAPES[letter]
            names = set(_GROUP_NAME.findall(pattern))
            if names & used:  # a group name may appear once: a repeat is only matched
                pattern = _GROUP_NAME.sub("?:", pattern)
            used |= names
            if match.group(1):  # padded: spaces may surround the value
                pattern = rf"\s*{pattern}\s*"
            parts.append(pattern)
        else:
            parts.append(re.escape(match.group(0)))  # an escape PostgreSQL prints as is
    parts.append(re.escape(prefix[position:]))
    if optional_from is not None:
        head, tail = parts[:optional_from], parts[optional_from:]
        body = "".join(head) + "(?:" + "".join(tail) + ")?"
    else:
        body = "".join(parts)
    return re.compile(rf"\A{body}{_MESSAGE.pattern}", re.DOTALL)


def find(
    paths: Iterable[str], *, prefix: str | None = None, stdin: IO[bytes] | None = None
) -> Found:
    """Every deadlock in the logs at ``paths`` (``-``: ``stdin``), sides named where possible."""
    found = Found()
    for path in paths:
        with _open(path, stdin) as stream:
            scanner = _Scanner(path if path != "-" else "(stdin)")
            fmt, entries = _entries(stream, scanner.source, prefix)
            for entry in entries:
                scanner.feed(entry)
        if fmt is None:
            raise NotALogError(
                f"{scanner.source}: nothing in it looks like a PostgreSQL server log "
                "(stderr, csvlog or jsonlog); if the stderr prefix is unusual, pass "
                "--log-line-prefix as set in postgresql.conf"
            )
        found.deadlocks.extend(scanner.deadlocks)
        found.files.append(
            {
                "source": scanner.source,
                "format": fmt,
                "entries": scanner.entries,
                "deadlocks": len(scanner.deadlocks),
            }
        )
    return found


@contextlib.contextmanager
def _open(path: str, stdin: IO[bytes] | None) -> Iterator[IO[str]]:
    """The log as text: undecodable bytes replaced, never an error; ``.gz`` unpacked."""
    if path == "-":
        raw: IO[bytes] = stdin if stdin is not None else sys.stdin.buffer
        yield io.TextIOWrapper(raw, encoding="utf-8", errors="replace", newline="")
        return
    try:
        opened = cast(
            "IO[bytes]",
            gzip.GzipFile(path, "rb") if path.endswith(".gz") else Path(path).open("rb"),  # noqa: SIM115
        )
    except OSError as exc:
        raise NoInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    with opened:
        text = io.TextIOWrapper(opened, encoding="utf-8", errors="replace", newline="")
        try:
            yield text
        except (OSError, EOFError) as exc:  # a directory, a truncated .gz
            raise NoInputError(f"cannot read {path}: {exc}") from None


def _entries(
    stream: IO[str], source: str, prefix: str | None
) -> tuple[str | None, Iterator[Entry]]:
    """The log's format (None: not a PostgreSQL log) and its entries, streamed."""
    head: list[str] = []
    for line in stream:  # blank lines before the first entry are kept: line numbers count them
        head.append(line)
        if line.strip():
            break
    if not head or not head[-1].strip():
        return "empty", iter(())
    first = head[-1]
    lines = _chain(head, stream)
    if first.lstrip().startswith("{"):
        if _exported(first) is None:
            return "json", _json_entries(lines, source)
        # Log explorer exports (Cloud SQL): one JSON record per line of a stderr log.
        texts = (
            line + "\n"
            for text in map(_exported, lines)
            if text is not None
            for line in text.splitlines()
        )
        return _stderr("exported-json", texts, source, prefix)
    if _looks_like_csv(first):
        return "csv", _csv_entries(lines, source)
    return _stderr("stderr", lines, source, prefix)


def _stderr(
    fmt: str, lines: Iterator[str], source: str, prefix: str | None
) -> tuple[str | None, Iterator[Entry]]:
    """Entries of a stderr log, the prefix given or chosen from the first lines."""
    sniffed = list(itertools.islice(lines, SNIFF_LINES))
    pattern = prefix_pattern(prefix) if prefix is not None else _choose_prefix(sniffed)
    if pattern is None:
        return None, iter(())
    return fmt, _stderr_entries(_chain(sniffed, lines), source, pattern)


def _chain(head: list[str], stream: Iterable[str]) -> Iterator[str]:
    yield from head
    yield from stream


def _looks_like_csv(line: str) -> bool:
    try:
        row = next(csv.reader([line]))
    except (csv.Error, StopIteration):
        return False
    # A first line may be cut by a quoted newline: the leading columns are enough.
    return len(row) >= 12 and row[3].isdigit() and bool(re.fullmatch(_SEVERITIES, row[11]))  # noqa: PLR2004


def _choose_prefix(lines: list[str]) -> re.Pattern[str] | None:
    """The common prefix that parses the most of these lines (with a pid), if any does."""
    best: tuple[int, re.Pattern[str] | None] = (0, None)
    for candidate in COMMON_PREFIXES:
        pattern = prefix_pattern(candidate)
        hits = 0
        for line in lines:
            match = pattern.match(line.rstrip("\n"))
            if match and match.groupdict().get("pid"):
                hits += 1
        if hits > best[0]:
            best = (hits, pattern)
    return best[1]


def _stderr_entries(lines: Iterable[str], source: str, pattern: re.Pattern[str]) -> Iterator[Entry]:
    """Entries of a stderr log.

    An entry is a prefixed line, its tab-indented continuation lines, and the DETAIL,
    CONTEXT, STATEMENT... lines of the same process right after it.
    """
    current: Entry | None = None
    last_key: str | None = None
    for number, raw in enumerate(lines, start=1):
        line = raw.rstrip("\r\n")
        if line.startswith("\t") and current is not None:
            if last_key is None:
                current.message += "\n" + line[1:]
            else:
                current.extra[last_key] += "\n" + line[1:]
            continue
        match = pattern.match(line)
        if match is None:
            continue  # output of a crashed extension, a pg_ctl message...
        groups = match.groupdict()
        pid = int(groups["pid"]) if groups.get("pid") else None
        if pid is None and groups.get("session"):
            pid = int(str(groups["session"]).split(".")[1], 16)  # %c is <start>.<pid>, in hex
        severity = groups["severity"]
        if (
            severity in {"DETAIL", "HINT", "QUERY", "CONTEXT", "LOCATION", "STATEMENT"}
            and current is not None
            and current.pid == pid
        ):
            current.extra[severity.lower()] = groups["message"]
            last_key = severity.lower()
            continue
        if current is not None:
            yield current
        current = Entry(
            source=source,
            line=number,
            severity=severity,
            message=groups["message"],
            pid=pid,
            app=groups.get("app") or None,
            time=groups.get("time"),
            user=groups.get("user") or None,
            db=groups.get("db") or None,
        )
        last_key = None
    if current is not None:
        yield current


#: csvlog columns (stable since 9.0 up to application_name; later versions append more).
_CSV_COLUMNS = {
    "time": 0,
    "user": 1,
    "db": 2,
    "pid": 3,
    "severity": 11,
    "sqlstate": 12,
    "message": 13,
    "detail": 14,
    "context": 18,
    "statement": 19,
    "app": 22,
}


def _csv_entries(lines: Iterable[str], source: str) -> Iterator[Entry]:
    # WARNING: csv's default field limit (128 KiB) rejects a long statement; the limit is
    # process-wide, so it is only ever raised.
    csv.field_size_limit(max(csv.field_size_limit(), _CSV_FIELD_LIMIT))
    reader = csv.reader(lines)
    while True:
        start = reader.line_num + 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error:
            continue  # a damaged record: skip it, keep reading
        if len(row) <= _CSV_COLUMNS["severity"] or not row[3].isdigit():
            continue

        def column(name: str, row: list[str] = row) -> str | None:
            index = _CSV_COLUMNS[name]
            return row[index] or None if index < len(row) else None

        entry = Entry(
            source=source,
            line=start,
            severity=row[11],
            message=row[13] if len(row) > 13 else "",  # noqa: PLR2004
            pid=int(row[3]),
            app=column("app"),
            time=column("time"),
            user=column("user"),
            db=column("db"),
            sqlstate=column("sqlstate"),
        )
        for key in ("detail", "context", "statement"):
            value = column(key)
            if value is not None:
                entry.extra[key] = value
        yield entry


def _json_entries(lines: Iterable[str], source: str) -> Iterator[Entry]:
    """Entries of a jsonlog file (PostgreSQL 15+): one JSON object per message."""
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        if not isinstance(record, dict):
            continue
        if "error_severity" not in record:
            continue
        pid = record.get("pid")
        entry = Entry(
            source=source,
            line=number,
            severity=str(record.get("error_severity")),
            message=str(record.get("message") or ""),
            pid=pid if isinstance(pid, int) else None,
            app=_text(record.get("application_name")),
            time=_text(record.get("timestamp")),
            user=_text(record.get("user")),
            db=_text(record.get("dbname")),
            sqlstate=_text(record.get("state_code")),
        )
        for key, name in (("detail", "detail"), ("context", "context"), ("statement", "statement")):
            value = _text(record.get(name))
            if value is not None:
                entry.extra[key] = value
        yield entry


def _exported(line: str) -> str | None:
    """The stderr line in a Cloud Logging export record (textPayload, jsonPayload.message)."""
    try:
        record = json.loads(line)
    except ValueError:
        return None
    if not isinstance(record, dict):
        return None
    payload = record.get("jsonPayload")
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return str(payload["message"])
    text = record.get("textPayload")
    return text if isinstance(text, str) else None


def _text(value: object) -> str | None:
    return str(value) if value not in (None, "") else None


class _Scanner:
    """Collects deadlocks, and application names per pid to name the other sides with."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.entries = 0
        self.deadlocks: list[Deadlock] = []
        #: pid -> (line, application) of the latest entry of that pid that named it.
        self._latest: dict[int, tuple[int, str]] = {}
        #: Sides still unnamed, waiting for a later line of their pid: pid -> [(line, side)].
        self._waiting: dict[int, list[tuple[int, Side]]] = {}

    def feed(self, entry: Entry) -> None:
        self.entries += 1
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
            current.statement = runs["statement"]
            continue
        if current is not None and current.statement is not None:
            current.statement += "\n" + line
    return list(sides.values())


def describe(side: Side) -> str:
    """``process 123 (jobrun:job-a, job job-a)``, saying where the name came from or why not."""
    if side.application is None:
        return f"process {side.pid} (application unknown: no line of this pid names it)"
    job = f", job {side.job}" if side.job else ""
    source = "" if side.named_by == "this line" else f", named on {side.named_by}"
    return f"process {side.pid} ({side.application}{job}{source})"


def report(found: Found) -> str:
    """The deadlocks for people: each side's process, application, lock and statement."""
    out: list[str] = []
    for deadlock in found.deadlocks:
        when = f" at {deadlock.time}" if deadlock.time else ""
        where = f" in database {deadlock.db}" if deadlock.db else ""
        out.append(f"deadlock{when}{where} ({deadlock.source} line {deadlock.line})")
        for side in deadlock.sides:
            victim = " [aborted by PostgreSQL]" if side.pid == deadlock.victim else ""
            out.append(f"  {describe(side)}{victim}")
            if side.waits_for:
                out.append(f"    waits for {side.waits_for}, held by process {side.blocked_by}")
            if side.statement:
                statement = " ".join(side.statement.split())
                out.append(f"    running: {statement}")
        if deadlock.context:
            out.append(f"  context: {' '.join(deadlock.context.split())}")
        if not any(side.application for side in deadlock.sides):
            out.append(
                "  note: the log does not carry application names: add %a to "
                "log_line_prefix (or use csvlog/jsonlog) to see which jobs these were"
            )
    pairs = _pairs(found.deadlocks)
    files = ", ".join(f"{f['source']} ({f['format']}, {f['entries']} entries)" for f in found.files)
    out.append(f"{len(found.deadlocks)} deadlock(s) in {files}")
    out.extend(f"  {count} x {pair}" for pair, count in pairs.items())
    return "\n".join(out)


def _pairs(deadlocks: Iterable[Deadlock]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for deadlock in deadlocks:
        names = sorted(side.application or f"pid {side.pid}" for side in deadlock.sides)
        label = " <-> ".join(names)
        counts[label] = counts.get(label, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))
