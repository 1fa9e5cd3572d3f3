"""``log_line_prefix`` as a regular expression: a given prefix, or the common one that fits."""

from __future__ import annotations

import re

#: ``log_line_prefix`` values seen in the wild, tried in this order when none is given: with
#: ``%a`` first, because a layout without it also matches part of a line that has it.
COMMON_PREFIXES: tuple[str, ...] = (
    "%m [%p] %q%u@%d %a ",  # Debian's default plus the application name
    "%m [%p] %q%a %u@%d ",
    "%m [%p] %a ",
    "%m [%p] %q[%a] %u@%d ",
    "%t [%p]: [%l-1] user=%u,db=%d,app=%a,client=%h ",  # the layout pgBadger documents
    "%t [%p]: user=%u,db=%d,app=%a,client=%h ",
    "%m [%p]: [%l-1] db=%d,user=%u ",  # Cloud SQL
    "%t:%r:%u@%d:[%p]:",  # Amazon RDS
    "%m [%p] %q%u@%d ",  # Debian and Ubuntu
    "%t [%p]: [%l-1] user=%u,db=%d,client=%h ",
    "%m [%p] ",  # PostgreSQL's own default
    "%t [%p] ",
)

SEVERITIES = (
    "DEBUG1|DEBUG2|DEBUG3|DEBUG4|DEBUG5|INFO|NOTICE|WARNING|ERROR|LOG|FATAL|PANIC|"
    "DETAIL|HINT|QUERY|CONTEXT|LOCATION|STATEMENT"
)
_MESSAGE = re.compile(rf"(?P<severity>{SEVERITIES}):  (?P<message>.*)\Z", re.DOTALL)
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
_ESCAPE = re.compile(r"%(-?\d*)([a-zA-Z%])")
_GROUP_NAME = re.compile(r"\?P<\w+>")


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


def choose_prefix(lines: list[str]) -> re.Pattern[str] | None:
    """The common prefix that parses the most of these lines (with a pid), if any does."""
    best: tuple[int, re.Pattern[str] | None] = (0, None)
    for candidate in COMMON_PREFIXES:
        pattern = prefix_pattern(candidate)
        hits = 0
        for line in lines:
            match = pattern.match(line.rstrip("\n"))
            if match and match.groupdict().get("pid"):
                hits += 1
        if hits > best[0]:
            best = (hits, pattern)
    return best[1]
