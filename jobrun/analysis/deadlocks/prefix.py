"""``log_line_prefix`` as a regular expression (given, or a common one), or found per line."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

from jobrun.analysis.deadlocks.language import SEVERITY_WORDS

if TYPE_CHECKING:
    from collections.abc import Iterable

#: ``log_line_prefix`` values seen in the wild. When none is given, each is scored on the
#: first lines of the log (see :func:`choose_prefix`); their order here does not matter.
COMMON_PREFIXES: tuple[str, ...] = (
    "%m [%p] %q%u@%d %a ",  # Debian's default plus the application name
    "%m [%p] %q%a %u@%d ",
    "%m [%p] %a ",
    "%m [%p] %q[%a] %u@%d ",
    "%t [%p]: [%l-1] user=%u,db=%d,app=%a,client=%h ",  # the layout pgBadger documents
    "%t [%p]: user=%u,db=%d,app=%a,client=%h ",
    "%m [%p]: [%l-1] db=%d,user=%u ",  # Cloud SQL
    "[%p]: [%l-1] db=%d,user=%u ",  # Cloud SQL's textPayload: the time is the record's
    "%t:%r:%u@%d:[%p]:",  # Amazon RDS
    "%t-%c-",  # Azure Database for PostgreSQL
    "%m [%p] %q%u@%d ",  # Debian and Ubuntu
    "%t [%p]: [%l-1] user=%u,db=%d,client=%h ",
    "%m [%p] ",  # PostgreSQL's own default
    "%t [%p] ",
    "%t [%p]: db=%d,user=%u,app=%a,client=%h ",
    "%t [%p]: [%l-1] user=%u,db=%d,host=%h,app=%a ",
    "%m [%p]: [%l-1] user=%u,db=%d,app=%a,client=%h ",
)
#: Extra layouts for lines whose envelope (syslog, Heroku, a cloud export) carries the pid.
ENVELOPED_PREFIXES: tuple[str, ...] = (
    "sql_error_code = %e ",  # Heroku Postgres
    "",  # syslog with no log_line_prefix: syslog gives the time and the pid
)

#: Characters of a line that its prefix and severity must fit in (a real prefix takes a few
#: hundred at most): the lazy fields of a layout (``%u@%d %a``) backtrack, and on a crafted
#: line would do so over its whole length, in time that grows with its square.
PREFIX_WINDOW = 1024
#: The severity words, the most frequent first: the alternation tries them in this order.
SEVERITIES = (
    "LOG|ERROR|DETAIL|STATEMENT|CONTEXT|HINT|WARNING|NOTICE|INFO|FATAL|PANIC|QUERY|LOCATION|"
    "DEBUG1|DEBUG2|DEBUG3|DEBUG4|DEBUG5|DEBUG"
)
#: The server writes two spaces after the severity; a copy through a chat or a ticket
#: often keeps one. French labels put a space before the colon (``ASTUCE :``).
_MESSAGE = re.compile(rf"(?P<severity>{SEVERITIES}) ?:  ?(?P<message>.*)\Z", re.DOTALL)
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
#: Fields whose value the layout pins down (digits, a timestamp, a ``user@db`` pair, a
#: ``key=value``): a layout that reads them is more specific than one reading free text.
_TYPED = ("time", "pid", "session", "user", "db")
_ESCAPE = re.compile(r"%(-?\d*)([a-zA-Z%])")
_GROUP_NAME = re.compile(r"\?P<\w+>")


@dataclass(frozen=True)
class Layout:
    """A ``log_line_prefix`` and its regular expression."""

    prefix: str
    pattern: re.Pattern[str]


def prefix_pattern(prefix: str, words: Iterable[str] = ()) -> re.Pattern[str]:
    """A regular expression for a stderr line written with ``log_line_prefix = prefix``.

    ``%q`` ends the part that non-session processes (the checkpointer...) leave out, so
    everything after it is optional. ``words``: severity words of other languages to read
    as well (few: each one tried costs every line).
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
    message = _MESSAGE.pattern
    extra = sorted(set(words) - set(SEVERITIES.split("|")), key=len, reverse=True)
    if extra:
        message = message.replace(SEVERITIES, SEVERITIES + "|" + "|".join(map(re.escape, extra)))
    return re.compile(rf"\A{body}{message}", re.DOTALL)


class PrefixChooser:
    """Scores the common layouts on a log's first lines; more lines can be added to settle a tie.

    Scored per layout, best first: the lines it parses (with a pid, unless the envelope
    carries it); then how many of their fields are pinned down (a timestamp, a pid, a
    ``user@db`` pair) rather than free text such as ``%a``, so that Debian's
    ``%m [%p] %q%u@%d`` reads ``postgres@postgres`` as a user and a database, not as an
    application name; then how many fields it names at all.
    """

    def __init__(self, *, pid_known: bool = False, words: Iterable[str] = ()) -> None:
        self._pid_known = pid_known
        candidates = COMMON_PREFIXES + (ENVELOPED_PREFIXES if pid_known else ())
        words = tuple(words)
        self._scores = {Layout(c, prefix_pattern(c, words)): (0, 0, 0) for c in candidates}

    def add(self, lines: Iterable[str]) -> None:
        """Score these lines (continuation lines, which carry no prefix, are skipped)."""
        stripped = [line.rstrip("\r\n") for line in lines if line[:1] not in {"\t", " ", ""}]
        for layout, score in self._scores.items():
            hits, typed, named = score
            for line in stripped:
                match = layout.pattern.match(line, 0, PREFIX_WINDOW)
                if match is None:
                    continue
                groups = match.groupdict()
                if not self._pid_known and not (groups.get("pid") or groups.get("session")):
                    continue
                hits += 1
                typed += sum(1 for name in _TYPED if groups.get(name))
                named += sum(1 for name, value in groups.items() if value and name != "message")
            self._scores[layout] = (hits, typed, named)

    def best(self) -> tuple[Layout | None, bool]:
        """The best layout (None if none reads a line), and whether another scores the same.

        A tie is broken by the order of COMMON_PREFIXES; it happens when the lines so far
        cannot tell the layouts apart (only background processes, which ``%q`` cuts short).
        """
        ranked = sorted(self._scores.items(), key=lambda item: item[1], reverse=True)
        (layout, score), *others = ranked
        if score[0] == 0:
            return None, False
        return layout, any(other == score for _, other in others)


def choose_prefix(lines: list[str], *, pid_known: bool = False) -> Layout | None:
    """The common layout that reads these lines best, if any reads one."""
    chooser = PrefixChooser(pid_known=pid_known)
    chooser.add(lines)
    return chooser.best()[0]


#: Lengths of the severity words of every language, longest first (a suffix is tried per length).
_WORD_LENGTHS = sorted({len(word) for word in SEVERITY_WORDS}, reverse=True)
#: A colon after a character a severity word ends with (a space between: French), then a
#: space or the line's end: searched in C, where a Python loop over every colon of a
#: crafted line would be slow.
_CANDIDATE = re.compile(
    "[" + re.escape("".join(sorted({word[-1] for word in SEVERITY_WORDS}))) + "] ?:(?= |\\Z)"
)
_FOUND_TIME = re.compile(
    r"(?P<time>\d{4}-\d\d-\d\d[ T]\d\d:\d\d:\d\d(?:[.,]\d+)?"
    r"(?: ?(?:[A-Z]{2,5}|[+-]\d\d(?::?\d\d)?|Z)(?![A-Za-z]))?)"
    r"|(?<![\d.])(?P<epoch>\d{10}\.\d{3})(?!\d)"
)
_FOUND_PID = re.compile(
    r"\[(?P<pid>\d+)\]|\bpid=(?P<keyed>\d+)|(?<![\w.])[0-9a-f]{8}\.(?P<session>[0-9a-f]{1,8})(?![\w.])"
)
_FOUND_BARE_PID = re.compile(r"(?:\A|[\s|:])(?P<pid>\d+)(?=[\s|:]|\Z)")
_FOUND_KEYS = re.compile(
    r"\b(?P<key>user|usr|db|database|dbname|app|application|application_name|appname)="
    r"(?P<value>[^,\s\]]*)"
)
_FOUND_USER_DB = re.compile(
    r"(?:\A|(?<=[\s\]:]))(?P<user>[^\s@\[\]:,=]*)@(?P<db>[^\s@\[\]:,=]*)"
    r"(?=[\s:,\]]|\Z)"
)
_KEY_FIELD = {
    "user": "user", "usr": "user", "db": "db", "database": "db", "dbname": "db",
    "app": "app", "application": "app", "application_name": "app", "appname": "app",
}  # fmt: skip


def split_line(line: str, window: int = PREFIX_WINDOW) -> tuple[int, int, str] | None:
    """Where a line's severity word starts, where its message starts, and the severity in English.

    Found from the line alone, whatever its prefix: the first colon within ``window``
    preceded by a severity word of any language (the longest) and followed by the two
    spaces the server writes. One space, or none at the end of the line, is taken only
    after a prefix that starts like one (a time, a ``[pid]``), or none: a copy keeps one.
    """
    for candidate in _CANDIDATE.finditer(line, 0, min(len(line), window)):
        head_end = candidate.start() + 1  # just after the word's last character
        after = candidate.end()  # just after the colon
        spaces = 2 if line.startswith("  ", after) else 1 if line.startswith(" ", after) else 0
        if not spaces and after != len(line):
            continue
        for length in _WORD_LENGTHS:
            start = head_end - length
            if start < 0:
                continue
            english = SEVERITY_WORDS.get(line[start:head_end])
            if english is None:
                continue
            if spaces < 2 and start and line[0] not in "0123456789[":  # noqa: PLR2004
                break
            return start, after + spaces, english
    return None


def prefix_fields(prefix: str) -> dict[str, str]:
    """pid, time, user, database and application, wherever a prefix shows them recognisably.

    A time (``%m``, ``%t``, ``%n``), a pid in brackets, ``pid=``, or in a session id (``%c``),
    else a lone number; ``user=``, ``db=``, ``app=`` and their longer names; ``user@db``, and
    the text after it (Debian's ``%u@%d %a``) or between the pid and it (``%a %u@%d``) as the
    application. Never a guess of free text elsewhere: a literal word is not an application.
    """
    fields: dict[str, str] = {}
    time = _FOUND_TIME.search(prefix)
    rest = prefix
    if time is not None:
        fields["time"] = time["time"] or time["epoch"]
        rest = prefix[: time.start()] + " " + prefix[time.end() :]
    pid = _FOUND_PID.search(rest)
    pid_end = 0
    if pid is not None:
        if pid["session"]:
            fields["pid"] = str(int(pid["session"], 16))
        else:
            fields["pid"] = pid["pid"] or pid["keyed"]
        pid_end = pid.end()
    else:
        bare = _FOUND_BARE_PID.search(rest)
        if bare is not None:
            fields["pid"], pid_end = bare["pid"], bare.end()
    for keyed in _FOUND_KEYS.finditer(rest):
        if keyed["value"]:
            fields.setdefault(_KEY_FIELD[keyed["key"]], keyed["value"])
    pair = _FOUND_USER_DB.search(rest, pid_end)
    if pair is not None and "user" not in fields:
        fields["user"], fields["db"] = pair["user"], pair["db"]
        after = rest[pair.end() :].strip(" :")
        before = rest[pid_end : pair.start()].strip(" :")
        app = after or (before if pid_end and "=" not in before and "[" not in before else "")
        if app and "app" not in fields:
            fields["app"] = app
    return {name: value for name, value in fields.items() if value}
