"""structlog configuration: one event per line as JSON, logfmt or console, to stderr or a file."""

from __future__ import annotations

import dataclasses
import enum
import errno
import logging
import os
import re
from collections.abc import Callable, Iterable, Mapping, MutableMapping
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


def _plain(value: Any, *, console: bool) -> Any:  # noqa: PLR0911 - one return per kind
    """A field's value as a person reads it: never a Python repr, every character printable.

    ``None`` is left to the renderer (console lines drop it, logfmt writes ``name=``), and
    so are logfmt's booleans (``true``/``false``); a console line says ``yes``/``no``. An
    enum is its value (``exit_code=69``), a list its items joined by commas, a mapping
    compact JSON.
    """
    from jobrun.escape import printable  # noqa: PLC0415 - JSON lines (the default) skip it

    if value is None:
        return None
    if isinstance(value, bool):
        return ("yes" if value else "no") if console else value
    if isinstance(value, enum.Enum):
        return _plain(value.value, console=console)
    if isinstance(value, int):
        return str(int(value))
    if isinstance(value, float):
        return repr(value)
    if isinstance(value, (list, tuple)):
        items = (_plain(item, console=console) for item in value)
        return ",".join(_word(item) for item in items)
    if isinstance(value, dict):
        import json  # noqa: PLC0415 - a mapping in a field is rare

        text = json.dumps(value, default=str, ensure_ascii=False, separators=(",", ":"))
        return printable(text)
    return printable(one_failure(str(value)))


def _word(item: Any) -> str:
    """An item of a list field as text (``true``/``false`` for logfmt's booleans)."""
    if item is None:
        return ""
    if isinstance(item, bool):
        return "true" if item else "false"
    return str(item)


def _plain_fields(_logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> Any:
    """Make every field of a logfmt line plain and escaped (see _plain).

    WARNING: a holder's host, a server's error message or a library's warning can carry
    ESC, OSC 52 (a clipboard write), BEL or CR, and the renderer writes a plain string as
    it is: whoever tails the log on a terminal would run them. JSON escapes them itself.
    """
    return {name: _plain(value, console=False) for name, value in event_dict.items()}


#: A libpq connection failure: one address's, once its "connection failed: " is gone.
_ONE_ADDRESS = re.compile(
    r'connection to server (?:at "(?P<host>[^"]*)"(?:, port (?P<port>[^ ]+))?'
    r'|on socket "(?P<socket>[^"]*)") failed: (?P<why>.*)'
)
#: What precedes each address's failure in psycopg's list of attempts.
_ATTEMPT = re.compile(r"\s*- host: '[^']*', port: '[^']*', hostaddr: (?:'[^']*'|None): ")
#: libpq's hint after a refused connection: the same sentence after every address.
_HINT = re.compile(r"\s*Is the server running [^?]*\?")
_ALL_FAILED = " Multiple connection attempts failed. All failures were:"
#: psycopg's words before libpq's message ("connection is bad" for a Unix socket).
_FAILED = re.compile(r"connection (?:failed|is bad): ")


def one_failure(text: str) -> str:
    """A connection error said once: each reason with the addresses that gave it.

    libpq (through psycopg) says a failure per address tried, each with the same hint,
    then all of them again in a list: ``localhost`` alone is two addresses, a multi-host
    DSN more. ``cannot connect to db:5432/ops: Connection refused (127.0.0.1:5432,
    [::1]:5432)`` says the same. Text that is not such an error is returned as it is.
    """
    found = _FAILED.search(text)
    if found is None:
        return text
    head, listed, attempts = text.partition(_ALL_FAILED)
    prefix, first = text[: found.start()], head[found.end() :]
    failures = [part for part in _ATTEMPT.split(attempts) if part.strip()] if listed else [first]
    reasons: dict[str, list[str]] = {}
    for failure in failures:
        said = _FAILED.sub("", _HINT.sub("", failure.strip()), count=1)
        match = _ONE_ADDRESS.fullmatch(said)
        if match is None:
            return text  # a shape of message not known here: said as it came
        where = match["socket"] or _address(match["host"], match["port"])
        addresses = reasons.setdefault(match["why"].strip(), [])
        if where not in addresses:
            addresses.append(where)
    return prefix + "; ".join(f"{why} ({', '.join(where)})" for why, where in reasons.items())


def _address(host: str, port: str | None) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"{shown}:{port}" if port else shown


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
#: The width a console line of a run's main events keeps to (a terminal's, a mail's).
CONSOLE_WIDTH = 120
#: What a shortened value ends (or starts) with.
ELLIPSIS = "\u2026"


def columns(text: str) -> int:
    """How many terminal columns ``text`` takes (wide East Asian characters two, marks none)."""
    if text.isascii():
        return len(text)
    import unicodedata  # noqa: PLC0415 - only for text that is not ASCII

    return sum(
        0 if unicodedata.combining(char) else 2 if unicodedata.east_asian_width(char) in "WF" else 1
        for char in text
    )


def shorten(text: str, width: int, *, keep: str = "start") -> str:
    """``text`` in at most ``width`` columns, ``…`` where the rest was.

    ``keep``: ``start`` (the beginning), ``end`` (a path's last part) or ``both`` (a key
    name's both ends, where keys of a family differ).
    """
    if columns(text) <= width:
        return text
    room = max(width - 1, 0)
    if keep == "end":
        return ELLIPSIS + _take(text[::-1], room)[::-1]
    if keep == "both":
        tail = _take(text[::-1], room // 2)[::-1]
        return _take(text, room - columns(tail)) + ELLIPSIS + tail
    return _take(text, room) + ELLIPSIS


def _take(text: str, width: int) -> str:
    """The longest start of ``text`` that fits ``width`` columns."""
    taken = 0
    for index, char in enumerate(text):
        taken += columns(char)
        if taken > width:
            return text[:index]
    return text


@dataclasses.dataclass
class _Field:
    """One ``name=value`` of a console line, and how its value may be shortened to fit."""

    name: str
    value: str
    #: None: never shortened; else what to keep (see shorten).
    keep: str | None = None
    #: The fewest columns it is shortened to.
    least: int = 12
    #: Said after the value, never shortened (`` pid 6815`` after a host).
    tail: str = ""
    #: When shortening is not enough, fields are left out, 1 first, then 2 (0: never).
    drop: int = 0

    def __str__(self) -> str:
        value = self.value + self.tail
        if value == "" or any(char in value for char in ' ="'):
            value = '"' + value.replace('"', '\\"') + '"'
        return f"{self.name}={value}"


def _text(value: object) -> str:
    from jobrun.escape import printable  # noqa: PLC0415 - console lines only

    return printable(str(value))


def _seconds(value: object) -> str:
    """A duration for a person: ``2.0s`` (tenths under a minute), ``20m35s``, ``1h2m0s``."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return _text(value)
    from jobrun.durations import format_seconds  # noqa: PLC0415 - console lines only

    return f"{value:.1f}s" if value < 60 else format_seconds(value)  # noqa: PLR2004 - a minute


def _clock(stamp: object, today: str) -> str:
    """``10:26:20Z`` for a time of the line's own day (``today``), else the whole ISO time."""
    import datetime as dt  # noqa: PLC0415 - console lines only

    try:
        parsed = dt.datetime.fromisoformat(str(stamp).replace("Z", "+00:00"))
    except ValueError:
        return _text(stamp)
    if parsed.tzinfo is not None:
        parsed = parsed.astimezone(dt.timezone.utc)
    if parsed.strftime("%Y-%m-%d") == today:
        return parsed.strftime("%H:%M:%SZ")
    return parsed.strftime("%Y-%m-%dT%H:%M:%SZ")


def _holder(fields: Mapping[str, Any], today: str, *, since_drop: int = 2) -> list[_Field]:
    """Who holds the key, as ``status`` names a holder: ``web1 pid 6815``, since when."""
    host, pid = fields.get("holder_host"), fields.get("holder_pid")
    backend, address = fields.get("holder_backend_pid"), fields.get("holder_client_addr")
    if host is not None:
        held_by = _Field("held_by", _text(host), keep="start", tail=_pid(pid))
    elif backend is not None:  # not a jobrun session, or its comment is hidden from us
        who = f"backend {backend}" + (f" from {address}" if address else "")
        held_by = _Field("held_by", _text(who), keep="start")
    else:
        return []
    found = [held_by]
    if fields.get("holder_since"):
        found.append(_Field("since", _clock(fields["holder_since"], today), drop=since_drop))
    return found


def _pid(pid: object) -> str:
    return "" if pid is None else f" pid {_text(pid)}"


def _started(fields: Mapping[str, Any], _today: str) -> list[_Field]:
    found = [
        _Field("command", _text(fields.get("command")), keep="end"),
        _Field("child_pid", _text(fields.get("child_pid"))),
    ]
    if fields.get("guarded") is False:
        found.append(_Field("guarded", "no"))
    if fields.get("attempt"):  # --retries: the second attempt on
        found.append(_Field("attempt", _text(fields["attempt"])))
    return found


#: Outcomes whose signal jobrun sent itself (its own line said so before ``finished``).
_SIGNALLED_BY_JOBRUN = frozenset({"timed_out", "lock_lost", "stopped"})


def _finished(fields: Mapping[str, Any], _today: str) -> list[_Field]:
    outcome = fields.get("outcome")
    found = [_Field("outcome", _text(outcome))]
    if outcome != "succeeded":  # a success's exit code is 0: said by the outcome
        found.append(_Field("exit_code", _text(_plain(fields.get("exit_code"), console=True))))
    child, signal = fields.get("child_exit_code"), fields.get("signal")
    if child is not None and child != fields.get("exit_code") and not signal:
        found.append(_Field("child_exit_code", _text(child)))
    if signal and outcome not in _SIGNALLED_BY_JOBRUN:
        found.append(_Field("signal", _text(signal), drop=1))
    found.append(_Field("duration", _seconds(fields.get("duration"))))
    if fields.get("lock_lost"):
        found.append(_Field("lock_lost", _text(fields["lock_lost"]), keep="start", drop=1))
    if fields.get("attempts"):  # --retries
        found.append(_Field("attempts", _text(fields["attempts"]), drop=1))
    return found


def _skipped(fields: Mapping[str, Any], today: str) -> list[_Field]:
    """``held_by``, ``paused_by``, ``ran_on`` each say the reason; else ``reason`` does."""
    reason = fields.get("reason")
    found = [_Field("exit_code", _text(_plain(fields.get("exit_code"), console=True)))]
    if reason == "locked":
        found += _holder(fields, today)
    elif reason == "paused":
        who = f"{fields.get('paused_by_user')}@{fields.get('paused_by_host')}"
        found.append(_Field("paused_by", _text(who), keep="start", least=8))
        if fields.get("paused_until"):
            found.append(_Field("until", _clock(fields["paused_until"], today), drop=2))
        if fields.get("paused_reason"):
            found.append(
                _Field("paused_reason", _text(fields["paused_reason"]), keep="start", drop=1)
            )
    elif reason == "already_ran" and fields.get("previous_host") is not None:
        found.append(_Field("ran_on", _text(fields["previous_host"]), keep="start"))
        if fields.get("previous_started_at"):
            found.append(_Field("at", _clock(fields["previous_started_at"], today), drop=1))
    if len(found) == 1:
        found.insert(0, _Field("reason", _text(reason)))
    return found


def _waiting(fields: Mapping[str, Any], today: str) -> list[_Field]:
    # While waiting, the key is worth more than when the holder began.
    remaining = _Field("remaining", _seconds(fields.get("remaining")))
    return [remaining, *_holder(fields, today, since_drop=1)]


def _stop(fields: Mapping[str, Any], _today: str) -> list[_Field]:
    who = f"{fields.get('requested_by_username')}@{fields.get('requested_by_host')}"
    # Who asked and why are the line's news: they keep more than a host does.
    found = [_Field("by", _text(who), keep="start", least=16)]
    if fields.get("requested_by_reason"):
        reason = _text(fields["requested_by_reason"])
        found.append(_Field("reason", reason, keep="start", least=24))
    return found


#: The events a person reads most, each with the fields that matter to them: a line of
#: these keeps to CONSOLE_WIDTH (the JSON line has every field). Whether a line carries the
#: run id: a skip's or a wait's is nobody's business at a terminal.
_LAYOUTS: dict[str, tuple[Callable[[Mapping[str, Any], str], list[_Field]], bool]] = {
    "started": (_started, True),
    "finished": (_finished, True),
    "skipped": (_skipped, False),
    "waiting_for_lock": (_waiting, False),
    "still_waiting": (_waiting, False),
    "stop_requested": (_stop, True),
}


def _every_field(fields: Mapping[str, Any]) -> list[_Field]:
    """Any other event: its own fields, plain, empty ones and ``no`` left out."""
    found = []
    for name, value in fields.items():
        if name in _CONTEXT_FOR_MACHINES or name == "run_id" or value is None or value is False:
            continue
        if name == "child_exit_code" and value == fields.get("exit_code"):
            continue  # said once is enough
        shown = _plain(value, console=True)
        if shown != "":
            found.append(_Field(name, shown))
    return found


#: The fewest columns a value is shortened to when nothing else makes a line fit.
_LAST_RESORT = 3


def _fit(head: str, found: list[_Field], width: int) -> str:
    """The line of ``head`` and ``found``, made to fit ``width`` columns.

    In turn, until it fits: the values that may be shortened lose a column each, the
    longest first, down to each one's ``least`` (the key's last); fields of ``drop`` 1 are
    left out before the key is shortened, those of ``drop`` 2 after.
    """
    whole = {id(each): each.value for each in found}
    room = {id(each): columns(each.value) for each in found}

    def line() -> str:
        return " ".join([head, *(str(each) for each in found)])

    def narrower(which: list[_Field], floor: int | None = None) -> bool:
        shrinking = [
            each
            for each in which
            if each.keep and room[id(each)] > (each.least if floor is None else floor)
        ]
        if not shrinking:
            return False
        longest = max(shrinking, key=lambda each: room[id(each)])
        room[id(longest)] -= 1
        longest.value = shorten(whole[id(longest)], room[id(longest)], keep=str(longest.keep))
        return True

    def dropped(rank: int) -> bool:
        for each in found:
            if each.drop == rank:
                found.remove(each)
                return True
        return False

    def others() -> bool:
        return narrower([each for each in found if each.name != "key"])

    steps: tuple[Callable[[], bool], ...] = (
        others,
        lambda: dropped(1),
        lambda: narrower(found),
        lambda: dropped(2),
        # The last resort (values full of characters that escaping doubles): a value may go
        # down to a few columns rather than the line past the width.
        lambda: narrower(found, _LAST_RESORT),
    )
    for step in steps:
        while columns(line()) > width and step():
            pass
    return line()


_COLOURS = {"error": "\x1b[31;1m", "warning": "\x1b[33m", "info": "\x1b[32m", "debug": "\x1b[34m"}
_BOLD, _RESET = "\x1b[1m", "\x1b[0m"


class ConsoleLine:
    """A console line, for a person at a terminal: what matters first, nothing empty.

    Time to the second, level, event and key lead; then the event's own fields. The run's
    fixed context is left out and the run id shortened. The lines of a run's main events
    (_LAYOUTS) keep to CONSOLE_WIDTH columns: they carry what a person needs (outcome, exit
    code, holder, duration), longer values shortened with ``…``; the rest is in JSON.
    """

    def __init__(self, *, colors: bool) -> None:
        self.colors = colors

    def __call__(self, _logger: Any, _method: str, event_dict: MutableMapping[str, Any]) -> str:
        """The line of ``event_dict``."""
        fields = dict(event_dict)
        stamp = str(fields.pop("timestamp", "")).split(".", 1)[0].rstrip("Z") + "Z"
        level, event = str(fields.pop("level", "")), _text(fields.pop("event", ""))
        key = fields.pop("key", None)
        run_id = fields.get("run_id")
        layout, with_run_id = _LAYOUTS.get(event, (None, True))
        found = layout(fields, stamp[:10]) if layout is not None else _every_field(fields)
        if key is not None:
            found.insert(0, _Field("key", _text(_plain(key, console=True)), keep="both", least=16))
        if run_id and with_run_id:
            found.append(_Field("run_id", _text(run_id)[:_SHORT_RUN_ID], drop=2))
        head = f"{stamp} [{level}] {event}"
        line = (
            _fit(head, found, CONSOLE_WIDTH)
            if layout is not None
            else " ".join([head, *(str(each) for each in found)])
        )
        if not self.colors:
            return line
        coloured = f"{stamp} {_COLOURS.get(level, '')}[{level}]{_RESET} {_BOLD}{event}{_RESET}"
        return coloured + line[len(head) :]


def colors_wanted(fd: int) -> bool:
    """Colour on a terminal, unless ``NO_COLOR`` is set to anything (no-color.org)."""
    return os.isatty(fd) and not os.environ.get("NO_COLOR")


#: sd-daemon(3)'s prefixes: the journal files a line under this priority (journalctl -p).
_PRIORITIES = {"error": 3, "warning": 4, "info": 6, "debug": 7}


def to_the_journal(fd: int) -> bool:
    """Whether ``fd`` is the stream systemd connected to the journal (``JOURNAL_STREAM``).

    systemd sets JOURNAL_STREAM to ``device:inode`` of the stream it gave the service; a
    child that inherited the variable but writes elsewhere (a pipe, a file) must not prefix.
    """
    stream = os.environ.get("JOURNAL_STREAM")
    if not stream:
        return False
    try:
        found = os.fstat(fd)
    except OSError:
        return False
    return stream == f"{found.st_dev}:{found.st_ino}"


def _with_priority(render: Processor) -> Processor:
    """``render``, each line led by its ``<N>`` syslog priority, which the journal takes off."""

    def prefixed(logger: Any, method: str, event_dict: MutableMapping[str, Any]) -> Any:
        priority = _PRIORITIES.get(str(event_dict.get("level", method)), 6)
        return f"<{priority}>" + render(logger, method, event_dict)

    return prefixed


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
        renderer = ConsoleLine(colors=colors_wanted(target))
    else:  # pragma: no cover - click restricts the choices
        raise UsageError(f"unknown log format {fmt!r}")
    if target == STDERR and to_the_journal(target):
        renderer = _with_priority(renderer)
    processors: list[Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _safe_strings,
        redactor(secrets),
        *((_plain_fields,) if fmt == "logfmt" else ()),
        *(() if fmt == "console" else (_lead_with_time_level_event,)),
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
