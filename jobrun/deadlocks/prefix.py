"""``log_line_prefix`` as a regular expression: a given prefix, or the common one that fits best."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

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
SEVERITIES = (
    "DEBUG1|DEBUG2|DEBUG3|DEBUG4|DEBUG5|INFO|NOTICE|WARNING|ERROR|LOG|FATAL|PANIC|"
    "DETAIL|HINT|QUERY|CONTEXT|LOCATION|STATEMENT"
)
#: The server writes two spaces after the severity; a copy through a chat or a ticket
#: often keeps one.
_MESSAGE = re.compile(rf"(?P<severity>{SEVERITIES}):  ?(?P<message>.*)\Z", re.DOTALL)
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


class PrefixChooser:
    """Scores the common layouts on a log's first lines; more lines can be added to settle a tie.

    Scored per layout, best first: the lines it parses (with a pid, unless the envelope
    carries it); then how many of their fields are pinned down (a timestamp, a pid, a
    ``user@db`` pair) rather than free text such as ``%a``, so that Debian's
    ``%m [%p] %q%u@%d`` reads ``postgres@postgres`` as a user and a database, not as an
    application name; then how many fields it names at all.
    """

    def __init__(self, *, pid_known: bool = False) -> None:
        self._pid_known = pid_known
        candidates = COMMON_PREFIXES + (ENVELOPED_PREFIXES if pid_known else ())
        self._scores = {Layout(c, prefix_pattern(c)): (0, 0, 0) for c in candidates}

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
