"""structlog configuration: one event per line as JSON, logfmt or console, to stderr or a file."""

from __future__ import annotations

import errno
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
    """Open ``path`` for appending (created 0640 if new) or raise UsageError.

    WARNING: a log file often lives in a directory others can write (/tmp, a shared log
    directory). A symbolic link planted there would make jobrun append to whatever it points
    at, with jobrun's rights, so the last component is never followed (O_NOFOLLOW). As root,
    a file that another user owns (theirs to read, and to make whatever they like) or that
    has other hard links (one may be a file of root's elsewhere) is refused as well.
    """
    # O_NONBLOCK: a FIFO planted there with no reader is an error, not a hang (cleared next).
    flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK
    try:
        fd = os.open(path, flags, 0o640)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(
                f"--log-file {path}: is a symbolic link, which jobrun does not follow "
                "(give the path it points to)"
            ) from None
        raise UsageError(f"--log-file {path}: {exc.strerror}") from None
    os.set_blocking(fd, True)
    refusal = _foreign(os.fstat(fd))
    if refusal is not None:
        os.close(fd)
        raise UsageError(f"--log-file {path}: {refusal}")
    return fd


def _foreign(found: os.stat_result) -> str | None:
    """Why root must not append to this file, or None: another owner, another name."""
    if os.geteuid() != 0:
        return None
    if found.st_uid != 0:
        owner = _user_name(found.st_uid)
        return f"owned by {owner}, not root: jobrun as root appends only to root's files"
    if found.st_nlink > 1:
        return "has other hard links: jobrun as root appends only to a file of one name"
    return None


def _user_name(uid: int) -> str:
    import pwd  # noqa: PLC0415 - only when a log file is refused

    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return f"uid {uid}"


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


#: Values the console and logfmt renderers write through repr(), which escapes every
#: character that is not printable: left to them.
_REPRESENTED = (bool, int, float, list, tuple, dict, type(None))


class _Shown(str):
    r"""Text escaped already (printable): repr() quotes it without escaping it again.

    The console renderer quotes a string with repr() when it holds a space or a quote, and
    repr() would turn each escape ``\x1b`` into ``\\x1b``; the logfmt renderer uses str().
    Either way the text is escaped exactly once.
    """

    __slots__ = ()

    def __repr__(self) -> str:
        if "'" in self and '"' not in self:
            return f'"{self}"'
        return "'" + self.replace("'", "\\'") + "'"


def _printable_fields(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
    """Escape control characters in every field's text (console and logfmt lines).

    WARNING: a holder's host, a server's error message or a library's warning can carry
    ESC, OSC 52 (a clipboard write), BEL or CR, and both renderers write a plain string as
    it is: whoever tails the log on a terminal would run them. JSON escapes them itself.
    """
    from jobrun.escape import printable  # noqa: PLC0415 - JSON lines (the default) skip it

    return {
        name: value if isinstance(value, _REPRESENTED) else _Shown(printable(str(value)))
        for name, value in event_dict.items()
    }


def _lead_with_time_level_event(
    _logger: Any, _method: str, event_dict: MutableMapping[str, Any]
) -> Any:
    """Put ``timestamp``, ``level`` and ``event`` first: lines read well when grepped."""
    lead = {
        name: event_dict.pop(name) for name in ("timestamp", "level", "event") if name in event_dict
    }
    return {**lead, **event_dict}


#: Fields every line of a run carries, which a person at a terminal does not need on each
#: line (the JSON and logfmt lines keep them): the lock id, this host, jobrun's pid, the
#: lock mode and jobrun's version.
_CONTEXT_FOR_MACHINES = frozenset({"lock_id", "host", "pid", "mode", "version"})
#: A run id on a console line: the characters `jobrun history` shows and `jobrun show` takes.
_SHORT_RUN_ID = 8


def _for_a_person(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
    """Console lines: time to the second, the key after the event, no empty fields.

    A line leads with what a person scans for (when, how bad, what, which job) and fits a
    120-column terminal: the run's fixed context is left out, and the run id shortened.
    """
    lead: dict[str, Any] = {}
    if "timestamp" in event_dict:
        lead["timestamp"] = str(event_dict.pop("timestamp")).split(".", 1)[0].rstrip("Z") + "Z"
    for name in ("level", "event", "key"):
        if name in event_dict:
            lead[name] = event_dict.pop(name)
    run_id = event_dict.pop("run_id", None)
    if event_dict.get("child_exit_code") == event_dict.get("exit_code"):
        event_dict.pop("child_exit_code", None)  # said once is enough
    rest = {
        name: value
        for name, value in event_dict.items()
        if name not in _CONTEXT_FOR_MACHINES and value is not None and value != ""
    }
    if run_id:
        rest["run_id"] = str(run_id)[:_SHORT_RUN_ID]
    return {**lead, **rest}


def colors_wanted(fd: int) -> bool:
    """Colour on a terminal, unless ``NO_COLOR`` is set to anything (no-color.org)."""
    return os.isatty(fd) and not os.environ.get("NO_COLOR")


def _console_renderer(*, colors: bool) -> Processor:
    """The console renderer, unpadded: a 120-column line holds the fields."""
    try:
        return structlog.dev.ConsoleRenderer(
            colors=colors, sort_keys=False, pad_event_to=0, pad_level=False
        )
    except TypeError:  # structlog before 25 names it pad_event and cannot unpad the level
        return structlog.dev.ConsoleRenderer(colors=colors, sort_keys=False, pad_event=0)


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
        renderer = _console_renderer(colors=colors_wanted(target))
    else:  # pragma: no cover - click restricts the choices
        raise UsageError(f"unknown log format {fmt!r}")
    processors: list[Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _safe_strings,
        redactor(secrets),
        *(() if fmt == "json" else (_printable_fields,)),
        _for_a_person if fmt == "console" else _lead_with_time_level_event,
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
