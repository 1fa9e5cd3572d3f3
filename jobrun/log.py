"""structlog configuration: one event per line as JSON, logfmt or console, to stderr or a file."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, MutableMapping
from typing import Any, TextIO

import structlog

from jobrun.exitcodes import UsageError
from jobrun.masking import mask_text

FORMATS = ("auto", "json", "logfmt", "console")
LEVELS = ("debug", "info", "warning", "error")
_LEVEL_NUMBERS = {"debug": 10, "info": 20, "warning": 30, "error": 40}
STDERR = 2

Processor = Callable[[Any, str, MutableMapping[str, Any]], Any]


class LineWriter:
    """Write each rendered event with one ``write(2)``, so concurrent appenders never interleave.

    WARNING: a log file is opened with O_APPEND and written unbuffered on purpose: several
    jobrun processes (a crontab full of them) share one file.

    WARNING: a write that fails (a full disk, a closed or broken stderr) must never stop a
    guarded run halfway: the line goes to ``fallback`` (stderr when the log is a file), and
    when that fails too it is lost, but the run goes on and ends as it would have.
    """

    def __init__(self, fd: int, fallback: int | None = None) -> None:
        self._fds = (fd,) if fallback is None or fallback == fd else (fd, fallback)

    def msg(self, message: str) -> None:
        """Write one rendered event and its newline."""
        data = (message + "\n").encode("utf-8", "backslashreplace")
        for fd in self._fds:
            try:
                _write_all(fd, data)
            except OSError:
                continue
            return

    debug = info = warning = error = critical = exception = msg


def _write_all(fd: int, data: bytes) -> None:
    while data:
        written = os.write(fd, data)
        data = data[written:]


def open_log_file(path: str) -> int:
    """Open ``path`` for appending (created 0640 if new) or raise UsageError."""
    try:
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o640)
    except OSError as exc:
        raise UsageError(f"--log-file {path}: {exc.strerror}") from None


def safe_text(text: str) -> str:
    """``text`` with bytes that were not UTF-8 (lone surrogates U+DCxx) spelled ``\\xNN``.

    WARNING: argv, environment and file names that are not UTF-8 reach Python as lone
    surrogates (surrogateescape); encoding them strictly raises UnicodeEncodeError, so
    every text that leaves the process (log lines, database parameters) passes here.
    """
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raw = text.encode("utf-8", "surrogateescape")
        # Lone surrogates that did not come from bytes (U+D800..U+DC7F) stay escaped too.
        return raw.decode("utf-8", "backslashreplace")
    return text


#: Fields that name the event itself: never rewritten (alerting greps them).
_FIXED_FIELDS = frozenset({"timestamp", "level", "event"})


def redactor(secrets: Iterable[str]) -> Processor:
    """A processor that masks ``secrets`` where they occur as values: the last guard.

    Also the password of any URI and any ``password=`` value in a field, whoever wrote it
    there (a library's warning, a hook's stderr).
    """
    masked = tuple(secret for secret in secrets if secret)

    def redact(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
        for name, value in event_dict.items():
            if isinstance(value, str) and name not in _FIXED_FIELDS:
                event_dict[name] = mask_text(value, masked)
        return event_dict

    return redact


def _safe_strings(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
    """Make every string field encodable (see safe_text), nested ones included."""
    return {safe_text(str(name)): _safe_value(value) for name, value in event_dict.items()}


def _safe_value(value: Any) -> Any:
    if isinstance(value, str):
        return safe_text(value)
    if isinstance(value, list):
        return [_safe_value(item) for item in value]
    if isinstance(value, tuple):
        return tuple(_safe_value(item) for item in value)
    if isinstance(value, dict):
        return {safe_text(str(k)): _safe_value(v) for k, v in value.items()}
    return value


def _lead_with_time_level_event(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> Any:
    """Put ``timestamp``, ``level`` and ``event`` first: lines read well when grepped."""
    lead = {
        name: event_dict.pop(name) for name in ("timestamp", "level", "event") if name in event_dict
    }
    return {**lead, **event_dict}


class _LibraryWarnings(logging.Handler):
    """Turn warnings that libraries send to ``logging`` into our own event lines.

    Without it, Python prints them raw on stderr (psycopg's "error ignored in rollback"
    when a connection is cut), and a stray non-JSON line breaks log parsers.
    """

    def __init__(self, log: structlog.typing.FilteringBoundLogger) -> None:
        super().__init__(logging.WARNING)
        self._log = log

    def emit(self, record: logging.LogRecord) -> None:
        self._log.warning("library_warning", logger=record.name, message=record.getMessage())


def configure(
    *,
    fmt: str = "auto",
    level: str = "info",
    fd: int | None = None,
    secrets: Iterable[str] = (),
    stream: TextIO | None = None,
    fallback_fd: int | None = None,
) -> structlog.typing.FilteringBoundLogger:
    """Build the logger every module receives, and route psycopg's warnings into it.

    structlog's global configuration is not touched (the logger is passed around). The one
    process-wide change is the ``psycopg`` standard-library logger: its handlers are
    replaced, so a library warning becomes one of our event lines instead of a raw,
    non-JSON line on stderr. Lines go to ``fd`` (else ``stream``, else stderr); a line that
    cannot be written there goes to ``fallback_fd``.
    """
    target = fd if fd is not None else stream.fileno() if stream is not None else STDERR
    if fmt == "auto":
        fmt = "console" if fd is None and os.isatty(target) else "json"
    renderer: Processor
    if fmt == "json":
        renderer = structlog.processors.JSONRenderer()
    elif fmt == "logfmt":
        renderer = structlog.processors.LogfmtRenderer(
            key_order=["timestamp", "level", "event"], bool_as_flag=False
        )
    elif fmt == "console":
        renderer = structlog.dev.ConsoleRenderer(colors=os.isatty(target))
    else:  # pragma: no cover - click restricts the choices
        raise UsageError(f"unknown log format {fmt!r}")
    processors: list[Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _safe_strings,
        redactor(secrets),
        _lead_with_time_level_event,
        renderer,
    ]
    logger: structlog.typing.FilteringBoundLogger = structlog.wrap_logger(
        LineWriter(target, fallback_fd),
        processors=processors,
        wrapper_class=structlog.make_filtering_bound_logger(_LEVEL_NUMBERS[level]),
        cache_logger_on_first_use=True,
    )
    library = logging.getLogger("psycopg")
    library.handlers = [_LibraryWarnings(logger)]
    library.propagate = False
    return logger
