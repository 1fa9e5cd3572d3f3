"""Unwrap log lines carried by syslog, Heroku's logplex or a cloud export into stderr lines.

Each unwrapped line is ``(number, text, pid, time)``: its line (or record) in the file,
the server's own line, and the pid and time the envelope gives (None when it gives none).
"""

from __future__ import annotations

import itertools
import json
import re
from typing import TYPE_CHECKING, Any

from jobrun.analysis.deadlocks.sources import LINE_LIMIT

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

Line = tuple[int, str, int | None, str | None]

#: ``Dec  1 02:00:04 host postgres[1234]: [5-1] ...`` (BSD syslog, journalctl) or an
#: RFC 3339 time (rsyslog's high-precision format); ``[5-1]`` is absent when
#: ``syslog_sequence_numbers`` is off.
SYSLOG = re.compile(
    r"(?P<time>[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d(?:\.\d+)?"
    r"|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:?\d\d)?) "
    r"\S+ [^\s\[]+\[(?P<pid>\d+)\]: (?:\[(?P<seq>\d+)-(?P<chunk>\d+)\] ?)?(?P<text>.*)\Z",
    re.DOTALL,
)
#: ``heroku logs -p postgres``: ``2026-12-01T02:00:04.123456+00:00 app[postgres.1234]:
#: [DATABASE] [5-1] sql_error_code = 00000 LOG:  ...``; the dyno number is the pid.
LOGPLEX = re.compile(
    r"(?P<time>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)) (?:\S+ )?"
    r"app\[postgres\.(?P<pid>\d+)\]:? \[[^\]]*\] (?:\[(?P<seq>\d+)-(?P<chunk>\d+)\] ?)?"
    r"(?P<text>.*)\Z",
    re.DOTALL,
)
#: syslog writes a tab as ``#011`` (rsyslog's escape of control characters).
_TAB = "#011"
#: PostgreSQL cuts a line longer than this many bytes into chunks for syslog.
_SYSLOG_CHUNK = 900
_CONTINUED = re.compile(r".{0,200}?\b(?:DETAIL|HINT|CONTEXT|STATEMENT|QUERY|LOCATION):  ")


#: Any syslog line, with or without a pid: a whole /var/log/syslog holds other daemons too.
_ANY_SYSLOG = re.compile(
    r"(?:[A-Z][a-z]{2} [ \d]\d \d\d:\d\d:\d\d|\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\S*) \S+ [^\s:]+: "
)


def sniff_envelope(lines: list[str]) -> re.Pattern[str] | None:
    """SYSLOG or LOGPLEX when most of these lines are wrapped so, else None."""
    filled = [line.rstrip("\r\n") for line in lines if line.strip()]
    for envelope, shape in ((LOGPLEX, LOGPLEX), (SYSLOG, _ANY_SYSLOG)):
        wrapped = sum(1 for line in filled if shape.match(line))
        if filled and wrapped * 2 > len(filled) and any(map(envelope.match, filled)):
            return envelope
    return None


def unwrap(lines: Iterable[str], envelope: re.Pattern[str]) -> Iterator[Line]:
    """The server's lines inside syslog or logplex records, chunks joined again.

    A message is sent as numbered records ``[seq-1]``, ``[seq-2]``...: one per line of the
    message (a continuation line starts with a tab, written ``#011``), and a line longer
    than 900 bytes is cut into several records that are joined back here.
    """
    pending: Line | None = None
    chunks: list[str] = []  # the pending line's later chunks, joined once (not at each one)
    room = 0  # characters the pending line may still grow by
    last_chunk_bytes = 0
    last_seq: tuple[int, str] | None = None
    for number, raw in enumerate(lines, start=1):
        match = envelope.match(raw.rstrip("\r\n"))
        if match is None:
            continue
        text = match["text"].replace(_TAB, "\t")
        pid = int(match["pid"])
        seq = (pid, match["seq"]) if match["seq"] else None
        cut = (
            pending is not None
            and seq is not None
            and seq == last_seq
            and match["chunk"] != "1"
            and last_chunk_bytes >= _SYSLOG_CHUNK - 100
            and not text.startswith("\t")
            and not _CONTINUED.match(text)
        )
        last_chunk_bytes = len(match["text"].encode())
        last_seq = seq
        if cut:
            if len(text) <= room:  # past LINE_LIMIT a crafted run of chunks is dropped
                chunks.append(text)
                room -= len(text)
            continue
        if pending is not None:
            yield _joined(pending, chunks)
        pending, chunks, room = (number, text, pid, match["time"]), [], LINE_LIMIT - len(text)
    if pending is not None:
        yield _joined(pending, chunks)


def _joined(line: Line, chunks: list[str]) -> Line:
    return (line[0], "".join([line[1], *chunks]), line[2], line[3]) if chunks else line


def cloud_text(record: dict[str, Any]) -> str | None:
    """The server's text in a Cloud Logging record (``textPayload``, ``jsonPayload.message``)."""
    payload = record.get("jsonPayload")
    if isinstance(payload, dict) and isinstance(payload.get("message"), str):
        return str(payload["message"])
    text = record.get("textPayload")
    return text if isinstance(text, str) else None


def cloud_lines(records: Iterable[tuple[int, dict[str, Any]]]) -> Iterator[Line]:
    """The stderr lines of Cloud Logging records, oldest first, each with its record's time.

    ``gcloud logging read`` prints the newest record first; a message's DETAIL must come
    after its ERROR, so the records are put in time order (stable: one message's records
    share a time). An export is held in memory for that: the console and ``gcloud`` cap
    an export far below what memory allows.
    """
    held = [(number, record) for number, record in records if cloud_text(record) is not None]
    times = [str(record.get("timestamp") or "") for _, record in held]
    if times and times[0] > times[-1]:
        held.reverse()
    if all(times):
        held.sort(key=lambda item: str(item[1].get("timestamp")))
    for number, record in held:
        time = record.get("timestamp")
        for line in str(cloud_text(record)).splitlines():
            yield number, line, None, str(time) if time else None


def json_records(lines: Iterable[str], *, array: bool) -> Iterator[tuple[int, dict[str, Any]]]:
    """JSON objects, one per line or the elements of one array, with their line number."""
    if array:
        yield from _array_records(lines)
        return
    for number, line in enumerate(lines, start=1):
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):  # not JSON, or nested deeper than any record
            continue
        if isinstance(record, dict):
            yield number, record


class ReadStopped(Exception):
    """The rest of a file cannot be read (a JSON value that never ends); the reason says why."""


def _array_records(  # noqa: C901 - one pass over the text, each case a few lines
    lines: Iterable[str],
) -> Iterator[tuple[int, dict[str, Any]]]:
    """The objects of one JSON array (or several, one after the other), decoded as they arrive.

    An element is decoded again only once the text held has doubled since the last try:
    trying at every line would decode a long element over and over, which is quadratic.
    """
    decoder = json.JSONDecoder()
    parts: list[str] = []
    held = 0  # characters in parts
    tried = 0  # characters held when an element last failed to decode
    line_number = 1  # line number of the first character held
    started = False
    for line in itertools.chain(lines, [None]):
        if line is not None:
            parts.append(line)
            held += len(line)
            if held < min(2 * tried, LINE_LIMIT + 1):
                continue
        buffer = "".join(parts)
        while True:
            stripped = buffer.lstrip()
            line_number += buffer.count("\n", 0, len(buffer) - len(stripped))
            buffer, tried = stripped, 0
            if not buffer:
                break
            if not started:  # text after an array is dropped, never held
                buffer, started = (buffer[1:], True) if buffer[0] == "[" else ("", False)
                continue
            if buffer[0] in ",]":
                buffer, started = buffer[1:], buffer[0] == ","
                continue
            try:
                record, end = decoder.raw_decode(buffer)
            except ValueError:
                tried = len(buffer)  # an element not read to its end yet
                break
            except RecursionError:
                raise ReadStopped(
                    f"stopped at line {line_number}: a JSON value nested too deeply to "
                    "read; the rest was not read"
                ) from None
            if isinstance(record, dict):
                yield line_number, record
            line_number += buffer.count("\n", 0, end)
            buffer = buffer[end:]
        parts, held = ([buffer], len(buffer)) if buffer else ([], 0)
        if tried > LINE_LIMIT:
            raise ReadStopped(
                f"stopped at line {line_number}: a JSON value not ended within "
                f"{LINE_LIMIT // 1024} KiB; the rest was not read"
            )
    if parts:
        raise ReadStopped(f"the file ends inside the JSON value begun at line {line_number}")
