"""Read a server log's entries from its stderr, csvlog or jsonlog lines, plain or gzipped."""

from __future__ import annotations

import contextlib
import csv
import gzip
import io
import itertools
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

from jobrun.deadlocks.prefix import SEVERITIES, choose_prefix, prefix_pattern
from jobrun.exitcodes import Exit, JobrunError

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

#: Lines read to choose the stderr prefix layout before the real pass starts.
SNIFF_LINES = 2000
#: Longest csvlog field accepted (a statement of a bulk INSERT can be megabytes).
_CSV_FIELD_LIMIT = 64 * 1024 * 1024


class NoInputError(JobrunError):
    """A log file is missing or unreadable."""

    exit_code = Exit.NO_INPUT
    event = "no_input"


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


@contextlib.contextmanager
def open_log(path: str, stdin: IO[bytes] | None) -> Iterator[IO[str]]:
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


def read_entries(
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
    pattern = prefix_pattern(prefix) if prefix is not None else choose_prefix(sniffed)
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
    return len(row) >= 12 and row[3].isdigit() and bool(re.fullmatch(SEVERITIES, row[11]))  # noqa: PLR2004


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
