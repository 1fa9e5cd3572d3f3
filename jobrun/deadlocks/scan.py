"""Find the deadlocks in log entries and name each side from the lines of its pid."""

from __future__ import annotations

import re
from typing import IO, TYPE_CHECKING

from jobrun.deadlocks.formats import open_log, read_entries
from jobrun.deadlocks.model import Deadlock, Found, Side, parse_detail
from jobrun.exitcodes import Exit, JobrunError

if TYPE_CHECKING:
    from collections.abc import Iterable

    from jobrun.deadlocks.formats import Entry

DEADLOCK_MESSAGE = "deadlock detected"
DEADLOCK_SQLSTATE = "40P01"
#: log_connections' line for a session, which carries its application_name from the start
#: (the %a of that line still reads [unknown]: the name is set just after it).
_AUTHORIZED = re.compile(
    r"connection authorized: .*?\bapplication_name=(?P<app>.*?)(?: SSL enabled| GSS|\Z)"
)
#: What %a (and csvlog/jsonlog) show before the startup packet has named the session.
_UNNAMED = frozenset({"", "[unknown]"})


class NotALogError(JobrunError):
    """Nothing in a log file looks like a PostgreSQL server log."""

    exit_code = Exit.DATA_ERROR
    event = "not_a_log"


def find(
    paths: Iterable[str], *, prefix: str | None = None, stdin: IO[bytes] | None = None
) -> Found:
    """Every deadlock in the logs at ``paths`` (``-``: ``stdin``), sides named where possible."""
    found = Found()
    for path in paths:
        with open_log(path, stdin) as stream:
            scanner = _Scanner(path if path != "-" else "(stdin)")
            fmt, entries = read_entries(stream, scanner.source, prefix)
            for entry in entries:
                scanner.feed(entry)
        if fmt is None:
            raise NotALogError(
                f"{scanner.source}: nothing in it looks like a PostgreSQL server log "
                "(stderr, csvlog or jsonlog); if the stderr prefix is unusual, pass "
                "--log-line-prefix as set in postgresql.conf"
            )
        found.deadlocks.extend(scanner.deadlocks)
        found.files.append(
            {
                "source": scanner.source,
                "format": fmt,
                "entries": scanner.entries,
                "deadlocks": len(scanner.deadlocks),
            }
        )
    return found


class _Scanner:
    """Collects deadlocks, and application names per pid to name the other sides with."""

    def __init__(self, source: str) -> None:
        self.source = source
        self.entries = 0
        self.deadlocks: list[Deadlock] = []
        #: pid -> (line, application) of the latest entry of that pid that named it.
        self._latest: dict[int, tuple[int, str]] = {}
        #: Sides still unnamed, waiting for a later line of their pid: pid -> [(line, side)].
        self._waiting: dict[int, list[tuple[int, Side]]] = {}

    def feed(self, entry: Entry) -> None:
        self.entries += 1
        if entry.app in _UNNAMED:
            entry.app = None
        authorized = _AUTHORIZED.match(entry.message)
        if authorized and authorized["app"] not in _UNNAMED:
            entry.app = authorized["app"]
        if entry.pid is not None and entry.app:
            self._name_later_sides(entry.pid, entry.line, entry.app)
            self._latest[entry.pid] = (entry.line, entry.app)
        if entry.severity == "ERROR" and (
            entry.message == DEADLOCK_MESSAGE or entry.sqlstate == DEADLOCK_SQLSTATE
        ):
            self.deadlocks.append(self._deadlock(entry))

    def _name_later_sides(self, pid: int, line: int, app: str) -> None:
        """A later line names a pid: better than an earlier one if it is nearer."""
        for deadlock_line, side in self._waiting.pop(pid, []):
            if side.named_by is None or line - deadlock_line < deadlock_line - int(
                side.named_by.split()[-1]
            ):
                side.application = app
                side.named_by = f"line {line}"

    def _deadlock(self, entry: Entry) -> Deadlock:
        sides = parse_detail(entry.extra.get("detail", ""))
        if entry.pid is not None and not any(side.pid == entry.pid for side in sides):
            sides.insert(0, Side(entry.pid))
        for side in sides:
            if side.pid == entry.pid and entry.app:
                side.application, side.named_by = entry.app, "this line"
                continue
            earlier = self._latest.get(side.pid)
            if earlier is not None:
                side.application, side.named_by = earlier[1], f"line {earlier[0]}"
            # A later line may be nearer (a "still waiting" line comes after the error).
            self._waiting.setdefault(side.pid, []).append((entry.line, side))
        return Deadlock(
            source=self.source,
            line=entry.line,
            time=entry.time,
            user=entry.user,
            db=entry.db,
            victim=entry.pid,
            sides=sides,
            context=entry.extra.get("context"),
            statement=entry.extra.get("statement"),
        )
