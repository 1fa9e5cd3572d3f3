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

from jobrun.analysis.deadlocks import envelopes, structured
from jobrun.analysis.deadlocks.language import (
    SEVERITY_WORDS,
    TRANSLATED_WORDS,
    has_deadlock_wording,
)
from jobrun.analysis.deadlocks.model import Entry
from jobrun.analysis.deadlocks.prefix import (
    PREFIX_WINDOW,
    Layout,
    PrefixChooser,
    prefix_fields,
    prefix_pattern,
    split_line,
)
from jobrun.analysis.deadlocks.sources import LINE_LIMIT, container_lead, strip_lead

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

    from jobrun.analysis.deadlocks.envelopes import Line

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
#: syslog's numbering of a message's later lines (``[5-2]``), seen without its envelope.
_SYSLOG_MORE = re.compile(r"\[\d+-(?:[2-9]|\d\d+)\] ?(?:#011)?")
#: A physical line at least this long may have been wrapped by a terminal or a ticket.
_WRAPPED = 40
#: Terminal widths: a line wrapped at one was cut inside a word (joined with nothing).
_WIDTHS = frozenset({80, 100, 120, 132, 160, 200})
#: Marks, in a field's continuation lines, the rest of a wrapped line: joined to the line
#: before it, not after a newline (a noncharacter, which no server writes).
_GLUED = "\U0010fffe"
#: The start of a line of its own (a date, a syslog time): never the rest of a wrapped one.
_NEW = re.compile(r"\d{4}-\d\d-\d\d|[A-Z][a-z]{2} [ \d]\d \d\d:")
#: What the report names as the prefix of a log read line by line, with no one layout.
FOUND_PER_LINE = "(found per line)"
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
    #: The first line not read as part of an entry that holds a deadlock's wording.
    wording_line: int | None = None

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
    if structured.looks_like_csv(first):
        reading = Reading("csv")
        reading.entries = structured.csv_entries(lines, source, on_cut=reading.count_cut)
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
        shape = structured.json_shape(record)
        if shape is not None:
            return Reading(shape, structured.json_entries(rest, source))
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
    """Entries of a stderr log, the prefix given, chosen from the common ones, or found per line.

    Without ``--log-line-prefix``, a common layout that reads (nearly) every line a
    severity is found in is used, and the lines it misses are read line by line (a
    server reconfigured half-way); otherwise every line is.
    """
    sniffed = _head(lines, SNIFF_LINES)
    layout: Layout | None
    per_line = prefix is None
    translated = not per_line  # a given prefix reads every language's severity words
    if prefix is not None:
        layout = Layout(prefix, prefix_pattern(prefix, SEVERITY_WORDS))
    else:
        layout, found, translated = _choose(sniffed, lines, pid_known=pid_known)
        if layout is None and not found:
            return Reading(None, why=_NOT_A_LOG)
    reading = Reading(fmt, prefix=layout.prefix if layout is not None else FOUND_PER_LINE)
    reading.entries = _stderr_entries(
        itertools.chain(sniffed, lines),
        source,
        layout.pattern if layout is not None else None,
        reading,
        per_line=per_line,
        translated=translated,
    )
    return reading


def _choose(
    sniffed: list[Line], lines: Iterator[Line], *, pid_known: bool
) -> tuple[Layout | None, int, bool]:
    """The layout to read with (None: per line), lines with a severity, other languages read.

    The last: whether the layout reads severity words of another language than English.
    """
    # WARNING: the words of another language are added to the layouts only when seen: each
    # one is tried at every line, and after a lazy %a at every character of it.
    words: set[str] = set()
    for _, text, _, _ in sniffed:
        split = split_line(text.rstrip())
        if split is not None:
            word = text[split[0] : text.index(":", split[0])].strip()
            if word in TRANSLATED_WORDS:
                words.add(word)
    chooser = PrefixChooser(pid_known=pid_known, words=words)
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
    found = sum(1 for _, text, _, _ in sniffed if split_line(text.rstrip()) is not None)
    if layout is None:
        return None, found, False
    hits = sum(
        1 for _, text, _, _ in sniffed if layout.pattern.match(text.rstrip(), 0, PREFIX_WINDOW)
    )
    return (layout if hits * 10 >= found * 9 else None), found, bool(words)


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


def _stderr_entries(  # noqa: C901, PLR0912, PLR0915 - one pass over the lines, each case a few lines
    lines: Iterable[Line],
    source: str,
    pattern: re.Pattern[str] | None,
    reading: Reading,
    *,
    per_line: bool = True,
    translated: bool = False,
) -> Iterator[Entry]:
    """Entries of a stderr log.

    An entry is a prefixed line, its tab-indented continuation lines, and the DETAIL,
    CONTEXT, STATEMENT... lines of the same process right after it. A log copied through a
    terminal, a ticket or a chat has its tabs turned into spaces: a line that starts with
    spaces and has no prefix continues the entry too, less the indentation of its first
    such line; a line wrapped at the terminal's width is joined again. Trailing blanks
    are dropped. ``pattern`` (a layout) reads a line first; else, or when it misses and
    ``per_line``, the prefix is found in the line itself. ``translated``: the layout reads
    severity words of other languages, to be put into English.
    """
    current: Entry | None = None
    last_key: str | None = None
    indent: int | None = None
    more: list[str] = []  # continuation lines of the field being read, joined at its end
    room = 0  # characters that field may still grow by
    previous = ""  # the previous physical line
    dangling: str | None = None  # a line that starts like one but holds no severity
    for number, raw, envelope_pid, envelope_time in lines:
        line = raw.rstrip(" \t\r\n")  # blanks a re-save or a paste left at the end
        before, previous = previous, raw  # the line before, as written
        if current is not None and raw.startswith("\t"):  # a tab, then maybe only blanks
            room = _more(more, line[1:], room, reading)
            dangling = None
            continue
        match = pattern.match(line, 0, PREFIX_WINDOW) if pattern is not None else None
        split: tuple[int, int, str] | None = None
        unsplit = True  # split_line not tried on this line yet
        if dangling is not None:
            if match is None and per_line:
                # A prefix that a wrap parted from its severity: the two lines are one.
                written = before.rstrip("\r\n")
                glue = "" if len(written) in _WIDTHS or written != dangling else " "
                joined = written + glue + line
                split, unsplit = split_line(line), False
                if split is None or split[0] == 0:
                    together = split_line(joined)
                    if together is not None:
                        line, split = joined, together
                        if pattern is not None:
                            match = pattern.match(line, 0, PREFIX_WINDOW)
            dangling = None
        if match is not None:
            groups = match.groupdict()
            if len(line) >= PREFIX_WINDOW:  # the match stopped there: the message goes on
                groups["message"] = line[match.start("message") :]
            severity = groups["severity"]
            if translated:  # tested here: a call per line costs a log of millions
                severity = SEVERITY_WORDS.get(severity, severity)
        else:
            if unsplit:
                split = split_line(line) if per_line and line else None
            if split is None:
                if per_line and _NEW.match(line):
                    dangling = line
                    if reading.wording_line is None and has_deadlock_wording(line):
                        reading.wording_line = number
                    continue
                if current is None or envelope_pid not in {None, current.pid}:
                    # Another process's line (syslog carries the pid): never a continuation.
                    if line and reading.wording_line is None and has_deadlock_wording(line):
                        reading.wording_line = number
                    continue  # output of a crashed extension, a pg_ctl message...
                spaces = len(line) - len(line.lstrip(" "))
                numbered = _SYSLOG_MORE.match(line)
                # The line before as written, and the blanks it ended in: a terminal may cut
                # just after one; a ticket may keep the one it broke the line at.
                written = before.rstrip("\r\n")
                length = len(written)
                tail = written[len(written.rstrip()) :]
                # Cut at a terminal's width: the rest starts with a space at most, or with
                # other spaces than the re-indented lines around it.
                cut = length in _WIDTHS and (
                    spaces <= 1 or (indent is not None and spaces != indent)
                )
                if numbered is not None:
                    room = _more(more, line[numbered.end() :], room, reading)
                elif last_key == "detail" and _BARE_PROCESS.match(line):
                    reading.reindented += 1
                    room = _more(more, line, room, reading)
                elif cut or (length >= _WRAPPED and line and not spaces and not _NEW.match(line)):
                    # The rest of a line a terminal or a ticket wrapped: joined again, with
                    # nothing where the terminal cut, a space where the ticket broke a line.
                    glue = tail if cut or tail else " "
                    room = _more(more, _GLUED + glue + line, room, reading)
                    if cut:  # the next piece is cut at the same width
                        previous = before
                elif spaces and line.strip():
                    indent = spaces if indent is None else indent
                    reading.reindented += 1
                    room = _more(more, line[min(indent, spaces) :], room, reading)
                elif line and reading.wording_line is None and has_deadlock_wording(line):
                    reading.wording_line = number
                continue
            groups = prefix_fields(line[: split[0]])
            groups["message"] = line[split[1] :]
            severity = split[2]
        found = groups.get("pid")
        pid: int | None
        if found:
            pid = int(found)
        elif groups.get("session"):
            pid = int(str(groups["session"]).split(".")[1], 16)  # %c is <start>.<pid>, in hex
        else:
            pid = envelope_pid
        if (
            severity in {"DETAIL", "HINT", "QUERY", "CONTEXT", "LOCATION", "STATEMENT"}
            and current is not None
            and current.pid == pid
            and severity.lower() not in current.extra
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
    base = entry.message if key is None else entry.extra[key]
    text = "\n".join([base, *more])
    if _GLUED in text:  # the rest of a wrapped line goes on its line, not on one of its own
        text = text.replace("\n" + _GLUED, "")
        if not base and more[0].startswith(_GLUED):
            text = text.lstrip(" \t")
    if key is None:
        entry.message = text
    else:
        entry.extra[key] = text
    more.clear()
