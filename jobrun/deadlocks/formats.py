"""Tell a log's format from its first lines and read its entries, streamed.

Formats: stderr (any ``log_line_prefix``), csvlog, jsonlog, CloudNativePG and Azure JSON,
syslog, Heroku logplex, Cloud Logging exports (JSON lines or one array); each possibly
behind a ``docker compose logs`` or ``kubectl logs --prefix`` lead, or a time in front.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypeVar

from jobrun.deadlocks import envelopes, records
from jobrun.deadlocks.model import Entry
from jobrun.deadlocks.prefix import PREFIX_WINDOW, Layout, PrefixChooser, prefix_pattern
from jobrun.deadlocks.sources import LINE_LIMIT, container_lead, strip_lead

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from jobrun.deadlocks.envelopes import Line

#: Lines read to choose the stderr prefix layout before the real pass starts, and how far
#: that goes while the lines read cannot tell the best layouts apart.
SNIFF_LINES = 2000
MAX_SNIFF_LINES = 32000
#: Characters of those lines held at most: lines may each be LINE_LIMIT long.
SNIFF_CHARS = 16 * 2**20
#: JSON records read to tell their shape (CloudNativePG starts with the operator's own).
SNIFF_RECORDS = 1000
#: The start of a JSON array of records (``gcloud logging read --format=json``), as
#: opposed to a line that starts with ``[pid]`` (Cloud SQL's text without its time).
_ARRAY = re.compile(r"\[\s*(?:\{|\Z)")
#: A DETAIL line of a deadlock pasted with no indentation at all.
_BARE_PROCESS = re.compile(r"Process \d+(?: waits for |:)")
_T = TypeVar("_T", str, "Line")
_NOT_A_LOG = (
    "nothing in it looks like a PostgreSQL server log (stderr, csvlog, jsonlog, syslog, "
    "or a cloud export); if the stderr prefix is unusual, pass --log-line-prefix as set "
    "in postgresql.conf"
)


@dataclass
class Reading:
    """How a file is read: its format (None: not understood, and why) and its entries."""

    format: str | None
    entries: Iterator[Entry] = field(default_factory=lambda: iter(()))
    prefix: str | None = None
    why: str | None = None
    #: Continuation lines indented with spaces, counted while the entries are read.
    reindented: int = 0
    #: Messages (or csvlog records) that went past LINE_LIMIT: the text past it dropped.
    cut: int = 0

    def count_cut(self) -> None:
        """One more message cut."""
        self.cut += 1


def read_entries(stream: Iterable[str], source: str, prefix: str | None) -> Reading:
    """The log's format and its entries (streamed: read them before the next file)."""
    stream = iter(stream)
    blank = 0  # blank lines before the first entry: counted, not held; line numbers count them
    first = ""
    for line in stream:
        if line.strip():
            first = line
            break
        blank += 1
    if not first:
        return Reading("empty")
    lines: Iterator[str] = itertools.chain(itertools.repeat("\n", blank), [first], stream)
    lead = container_lead(first)
    if lead is not None:
        lines = strip_lead(lines, lead)
        first = next(strip_lead([first], lead))
    start = first.lstrip()
    if _ARRAY.match(start):
        return _json(envelopes.json_records(lines, array=True), source, prefix)
    if start.startswith("{"):
        return _json(envelopes.json_records(lines, array=False), source, prefix)
    if records.looks_like_csv(first):
        reading = Reading("csv")
        reading.entries = records.csv_entries(lines, source, on_cut=reading.count_cut)
        return reading
    sniffed = _head(lines, SNIFF_LINES)
    envelope = envelopes.sniff_envelope(sniffed)
    rest = itertools.chain(sniffed, lines)
    if envelope is not None:
        fmt = "logplex" if envelope is envelopes.LOGPLEX else "syslog"
        return _stderr(fmt, envelopes.unwrap(rest, envelope), source, prefix, pid_known=True)
    # zip, not a generator expression: tuples made in C, for the millions of lines of a log
    none = itertools.repeat(None)
    plain: Iterator[Line] = zip(itertools.count(1), rest, none, none)
    return _stderr("stderr", plain, source, prefix, pid_known=False)


def _json(
    found: Iterator[tuple[int, dict[str, object]]], source: str, prefix: str | None
) -> Reading:
    # The records before the first of a known shape are not kept: both readers skip them.
    for number, record in itertools.islice(found, SNIFF_RECORDS):
        rest = itertools.chain([(number, record)], found)
        shape = records.json_shape(record)
        if shape is not None:
            return Reading(shape, records.json_entries(rest, source))
        if envelopes.cloud_text(record) is not None:
            lines = envelopes.cloud_lines(rest)
            return _stderr("exported-json", lines, source, prefix, pid_known=False)
    return Reading(
        None,
        why="JSON, but no record is a PostgreSQL log record (jsonlog, CloudNativePG, "
        "Azure Log Analytics, or a Cloud Logging export with textPayload)",
    )


def _stderr(
    fmt: str, lines: Iterator[Line], source: str, prefix: str | None, *, pid_known: bool
) -> Reading:
    """Entries of a stderr log, the prefix given or chosen from the first lines."""
    sniffed = _head(lines, SNIFF_LINES)
    if prefix is not None:
        layout: Layout | None = Layout(prefix, prefix_pattern(prefix))
    else:
        chooser = PrefixChooser(pid_known=pid_known)
        chooser.add(text for _, text, _, _ in sniffed)
        layout, tied = chooser.best()
        # A quiet server's log can open with thousands of checkpoint lines, which every
        # layout with %q reads alike: read on until a session's line tells them apart.
        while tied and len(sniffed) < MAX_SNIFF_LINES and _chars(sniffed) < SNIFF_CHARS:
            more = _head(lines, len(sniffed))
            if not more:
                break
            sniffed += more
            chooser.add(text for _, text, _, _ in more)
            layout, tied = chooser.best()
    if layout is None:
        return Reading(None, why=_NOT_A_LOG)
    reading = Reading(fmt, prefix=layout.prefix)
    reading.entries = _stderr_entries(
        itertools.chain(sniffed, lines), source, layout.pattern, reading
    )
    return reading


def _head(lines: Iterator[_T], count: int) -> list[_T]:
    """The next ``count`` lines, fewer once they hold SNIFF_CHARS characters."""
    taken: list[_T] = []
    held = 0
    for line in itertools.islice(lines, count):
        taken.append(line)
        held += _size(line)
        if held >= SNIFF_CHARS:
            break
    return taken


def _size(line: str | Line) -> int:
    return len(line) if isinstance(line, str) else len(line[1])


def _chars(lines: list[_T]) -> int:
    return sum(map(_size, lines))


def _stderr_entries(  # noqa: C901, PLR0912 - one pass over the lines, each case a few lines
    lines: Iterable[Line], source: str, pattern: re.Pattern[str], reading: Reading
) -> Iterator[Entry]:
    """Entries of a stderr log.

    An entry is a prefixed line, its tab-indented continuation lines, and the DETAIL,
    CONTEXT, STATEMENT... lines of the same process right after it. A log copied through a
    terminal, a ticket or a chat has its tabs turned into spaces: a line that starts with
    spaces and has no prefix continues the entry too, less the indentation of its first
    such line.
    """
    current: Entry | None = None
    last_key: str | None = None
    indent: int | None = None
    more: list[str] = []  # continuation lines of the field being read, joined at its end
    room = 0  # characters that field may still grow by
    for number, raw, envelope_pid, envelope_time in lines:
        line = raw.rstrip("\r\n")
        if current is not None and line.startswith("\t"):
            room = _more(more, line[1:], room, reading)
            continue
        match = pattern.match(line, 0, PREFIX_WINDOW)  # the message runs on past it
        if match is None:
            if current is None:
                continue  # output of a crashed extension, a pg_ctl message...
            spaces = len(line) - len(line.lstrip(" "))
            if spaces and line.strip():
                indent = spaces if indent is None else indent
                reading.reindented += 1
                room = _more(more, line[min(indent, spaces) :], room, reading)
            elif last_key == "detail" and _BARE_PROCESS.match(line):
                reading.reindented += 1
                room = _more(more, line, room, reading)
            continue
        groups = match.groupdict()
        if len(line) >= PREFIX_WINDOW:  # the match stopped there: the message goes on
            groups["message"] = line[match.start("message") :]
        pid = int(groups["pid"]) if groups.get("pid") else envelope_pid
        if groups.get("session") and not groups.get("pid"):
            pid = int(str(groups["session"]).split(".")[1], 16)  # %c is <start>.<pid>, in hex
        severity = groups["severity"]
        if (
            severity in {"DETAIL", "HINT", "QUERY", "CONTEXT", "LOCATION", "STATEMENT"}
            and current is not None
            and current.pid == pid
        ):
            if more:  # tested here: a call per entry costs a log of millions
                _join(current, last_key, more)
            current.extra[severity.lower()] = groups["message"]
            last_key = severity.lower()
            indent = None
            room = LINE_LIMIT  # past the field's first line, which a line's limit bounds
            continue
        if current is not None:
            if more:  # tested here: a call per entry costs a log of millions
                _join(current, last_key, more)
            yield current
        current = Entry(
            source=source,
            line=number,
            severity=severity,
            message=groups["message"],
            pid=pid,
            app=groups.get("app") or None,
            time=groups.get("time") or envelope_time,
            user=groups.get("user") or None,
            db=groups.get("db") or None,
        )
        last_key = None
        indent = None
        room = LINE_LIMIT
    if current is not None:
        _join(current, last_key, more)
        yield current


def _more(more: list[str], text: str, room: int, reading: Reading) -> int:
    """Keep a continuation line while its field has room; the room left (-1: cut, counted)."""
    if len(text) < room:
        more.append(text)
        return room - len(text) - 1
    if room >= 0:
        reading.cut += 1
    return -1


def _join(entry: Entry, key: str | None, more: list[str]) -> None:
    """The field's continuation lines added to it, in one join (adding each is quadratic)."""
    if not more:
        return
    if key is None:
        entry.message = "\n".join([entry.message, *more])
    else:
        entry.extra[key] = "\n".join([entry.extra[key], *more])
    more.clear()
