"""Sessions from the server log: log_connections and log_disconnections lines, start to end."""

from __future__ import annotations

import datetime as dt
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jobrun.analysis.deadlocks.model import Session
from jobrun.analysis.deadlocks.storms import moment

if TYPE_CHECKING:
    from collections.abc import Hashable

    from jobrun.analysis.deadlocks.model import Entry

#: ``connection received: host=10.0.0.5 port=41234`` (before the session is named).
_RECEIVED = re.compile(r"connection received: host=(?P<host>\S+)")
#: ``connection authorized: user=jobs database=staging application_name=jobrun:x`` and an
#: SSL or GSS tail (PostgreSQL 13 to 18 alike; application_name is left out when unset).
_AUTHORIZED = re.compile(
    r"connection authorized: user=(?P<user>\S*) database=(?P<db>\S*)"
    r"(?: application_name=(?P<app>.*?))?(?: SSL enabled| GSS|\Z)"
)
#: ``disconnection: session time: 0:00:01.234 user=jobs database=staging host=10.0.0.5
#: port=41234`` (hours may go past 24; ``host=[local]`` for a Unix socket).
_DISCONNECTION = re.compile(
    r"disconnection: session time: (?P<h>\d+):(?P<m>\d\d):(?P<s>\d\d(?:\.\d+)?) "
    r"user=(?P<user>\S*) database=(?P<db>\S*) host=(?P<host>\S*)"
)
_UNNAMED = frozenset({"", "[unknown]"})
#: The same second in two files: events keyed by whole seconds since this.
_EPOCH = dt.datetime(1970, 1, 1)  # noqa: DTZ001 - the log's own zone


def _shared(text: str | None) -> str | None:
    """One copy of a name repeated on thousands of lines (application, user, host)."""
    return sys.intern(text) if text is not None else None


@dataclass(frozen=True, slots=True)
class _Event:
    when: dt.datetime
    pid: int
    #: 0: a session starts (authorized), 1: it ends (disconnection).
    kind: int
    application: str | None
    user: str | None
    database: str | None
    host: str | None
    #: For an end: how long the session lasted.
    lasted: dt.timedelta | None = None


@dataclass
class SessionLog:
    """Connection and disconnection lines gathered over every file, made into sessions.

    The same line in two files (a server's csvlog and jsonlog) counts once; a session that
    starts in one file and ends in the next (a rotated log) is one session.
    """

    _events: dict[Hashable, _Event] = field(default_factory=dict)
    _hosts: dict[int, str] = field(default_factory=dict)
    lines: int = 0

    def feed(self, entry: Entry) -> None:
        """Take the entry if it is a connection or disconnection line."""
        if entry.pid is None or not entry.message.startswith(("connection ", "disconnection:")):
            return
        when = moment(entry.time)
        if when is None:
            return
        received = _RECEIVED.match(entry.message)
        if received:
            self._hosts[entry.pid] = sys.intern(received["host"])
            return
        app = entry.app if entry.app not in _UNNAMED else None
        authorized = _AUTHORIZED.match(entry.message)
        if authorized:
            named = authorized["app"]
            event = _Event(
                when,
                entry.pid,
                0,
                _shared(named if named not in _UNNAMED and named is not None else app),
                _shared(authorized["user"] or entry.user),
                _shared(authorized["db"] or entry.db),
                self._hosts.pop(entry.pid, None),
            )
        else:
            ended = _DISCONNECTION.match(entry.message)
            if ended is None:
                return
            lasted = dt.timedelta(
                hours=int(ended["h"]), minutes=int(ended["m"]), seconds=float(ended["s"])
            )
            event = _Event(
                when,
                entry.pid,
                1,
                _shared(app),
                _shared(ended["user"]),
                _shared(ended["db"]),
                _shared(ended["host"]),
                lasted,
            )
        self.lines += 1
        key = (int((event.when - _EPOCH).total_seconds()), event.pid, event.kind)
        self._events.setdefault(key, event)

    def sessions(self) -> list[Session]:
        """Every session, in order of start (a pid reused starts a new one); read once.

        The lines are let go as they are made into sessions.
        """
        done: list[Session] = []
        open_: dict[int, Session] = {}
        events = sorted(self._events.values(), key=lambda e: (e.when, e.kind))
        self._events.clear()
        for event in events:
            current = open_.pop(event.pid, None)
            if event.kind == 0:
                if current is not None:  # its disconnection was not logged
                    done.append(current)
                open_[event.pid] = Session(
                    event.pid,
                    event.when,
                    application=event.application,
                    user=event.user,
                    database=event.database,
                    host=event.host,
                )
                continue
            if current is None:  # started before the log does: its start from its length
                current = Session(
                    event.pid,
                    event.when - (event.lasted or dt.timedelta()),
                    user=event.user,
                    database=event.database,
                )
            current.end = event.when
            current.application = current.application or event.application
            current.host = current.host or event.host
            done.append(current)
        done.extend(open_.values())
        return sorted(done, key=lambda session: session.start)
