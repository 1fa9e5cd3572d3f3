"""Entries from structured logs: csvlog, jsonlog, CloudNativePG and Azure Log Analytics JSON."""

from __future__ import annotations

import csv
from typing import TYPE_CHECKING, Any

from jobrun.analysis.deadlocks.language import SEVERITY_WORDS
from jobrun.analysis.deadlocks.model import Entry
from jobrun.analysis.deadlocks.sources import LINE_LIMIT

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator

#: Longest csvlog field accepted (a statement of a bulk INSERT can be megabytes): as long
#: as a line, since csv holds a field at 4 bytes a character while it reads it.
_CSV_FIELD_LIMIT = LINE_LIMIT
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
#: Field names of each JSON shape: jsonlog (PostgreSQL 15+); CloudNativePG's ``record``
#: (csvlog's column names); Azure Log Analytics (``AzureDiagnostics``, csvlog's names
#: with a ``record_`` prefix and a ``_s`` suffix).
_JSON_FIELDS = {
    "json": {
        "severity": "error_severity",
        "message": "message",
        "pid": "pid",
        "app": "application_name",
        "time": "timestamp",
        "user": "user",
        "db": "dbname",
        "sqlstate": "state_code",
        "detail": "detail",
        "context": "context",
        "statement": "statement",
    },
    "cloudnativepg": {
        "severity": "error_severity",
        "message": "message",
        "pid": "process_id",
        "app": "application_name",
        "time": "log_time",
        "user": "user_name",
        "db": "database_name",
        "sqlstate": "sql_state_code",
        "detail": "detail",
        "context": "context",
        "statement": "query",
    },
}
_JSON_FIELDS["azure"] = {
    key: f"record_{name}_s" for key, name in _JSON_FIELDS["cloudnativepg"].items()
}


def looks_like_csv(line: str) -> bool:
    """A csvlog record's first line: a pid in column 4 and a severity in column 12."""
    _allow_long_fields()
    try:
        row = next(csv.reader([line]))
    except (csv.Error, StopIteration):
        return False
    # A first line may be cut by a quoted newline: the leading columns are enough.
    # csvlog writes the severity in the server's language.
    return len(row) >= 12 and row[3].isdigit() and row[11] in SEVERITY_WORDS  # noqa: PLR2004


def csv_entries(
    lines: Iterable[str], source: str, on_cut: Callable[[], None] = lambda: None
) -> Iterator[Entry]:
    """Entries of a csvlog file: one CSV record per message, DETAIL in its own column.

    A record with a field longer than the limit is skipped, and ``on_cut`` called.
    """
    _allow_long_fields()
    reader = csv.reader(lines)
    while True:
        start = reader.line_num + 1
        try:
            row = next(reader)
        except StopIteration:
            return
        except csv.Error as exc:
            if "field limit" in str(exc):
                on_cut()
            continue  # a damaged record: skip it, keep reading
        if len(row) <= _CSV_COLUMNS["severity"] or not row[3].isdigit():
            continue

        def column(name: str, row: list[str] = row) -> str | None:
            index = _CSV_COLUMNS[name]
            return row[index] or None if index < len(row) else None

        entry = Entry(
            source=source,
            line=start,
            severity=_english(row[11]),
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


def _allow_long_fields() -> None:
    # WARNING: csv's default field limit (128 KiB) rejects a long statement; the limit is
    # process-wide, so it is only ever raised.
    csv.field_size_limit(max(csv.field_size_limit(), _CSV_FIELD_LIMIT))


def json_shape(record: dict[str, Any]) -> str | None:
    """Which structured shape a JSON record has: json, cloudnativepg, azure, or None."""
    if "error_severity" in record:
        return "json"
    inner = record.get("record")
    if isinstance(inner, dict) and "error_severity" in inner:
        return "cloudnativepg"
    if "record_error_severity_s" in record:
        return "azure"
    return None


def json_entries(records: Iterable[tuple[int, dict[str, Any]]], source: str) -> Iterator[Entry]:
    """Entries of JSON records of any structured shape (records of no known shape skipped)."""
    for number, record in records:
        shape = json_shape(record)
        if shape is None:
            continue  # CloudNativePG's other loggers, a record of another program
        fields = _JSON_FIELDS[shape]
        body: dict[str, Any] = record["record"] if shape == "cloudnativepg" else record
        pid = body.get(fields["pid"])
        entry = Entry(
            source=source,
            line=number,
            severity=_english(str(body.get(fields["severity"]))),
            message=str(body.get(fields["message"]) or ""),
            pid=int(pid)
            if isinstance(pid, int) or (isinstance(pid, str) and pid.isdigit())
            else None,
            app=_text(body.get(fields["app"])),
            time=_text(body.get(fields["time"])),
            user=_text(body.get(fields["user"])),
            db=_text(body.get(fields["db"])),
            sqlstate=_text(body.get(fields["sqlstate"])),
        )
        for key in ("detail", "context", "statement"):
            value = _text(body.get(fields[key]))
            if value is not None:
                entry.extra[key] = value
        yield entry


def _english(severity: str) -> str:
    """The severity in English (csvlog writes it in the server's language)."""
    return SEVERITY_WORDS.get(severity, severity)


def _text(value: object) -> str | None:
    return str(value) if value not in (None, "") else None
