"""Counting the sessions a command opens and the statements they send, from a server's log."""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql

from .jobrun_cli import wait_until

if TYPE_CHECKING:
    from typing_extensions import Self

    from .pgserver import PgServer

#: What a private server must log for the counting (PgServer.start(LOG_SETTINGS)).
LOG_SETTINGS = {"log_statement": "all", "log_connections": "on"}

#: Each log entry starts with PgServer's log_line_prefix, "%m [%p] ...": a time, then the pid.
_ENTRY = re.compile(r"\n(?=\d{4}-\d\d-\d\d )")
_PID = re.compile(r"\A\d{4}-\d\d-\d\d [\d:.]+ \S+ \[(\d+)\]")
#: A simple query ("statement:") or an extended-protocol execute ("execute <unnamed>:");
#: a simple query holding several statements is one message, counted once.
_STATEMENT = re.compile(r"LOG:  (statement|execute [^:]*):")
#: Heartbeat checks, their own count: session mode's (HELD_BY_US, HELD_BY_US_OR_STOP), and
#: every message sent with a heartbeat's lock_timeout first (stops.bounded_row: lease mode's
#: beats, which a run's kept connection sends every second).
_CHECKS = ("AND pid = pg_backend_pid()", "SELECT set_config('lock_timeout',")


@dataclass(frozen=True)
class Calls:
    """What a command sent the server: sessions opened, statements over them."""

    sessions: int
    statements: int
    #: Heartbeat checks, apart: a cost per heartbeat, not per run, so they are not compared.
    #: (The heartbeat no longer wakes on a history call's answer: ``ServerSession.pause``
    #: looks again once the call is over; 40 runs of 40 under load sent none.)
    checks: int = field(default=0, compare=False)
    #: Each statement's entry, shortened (to say what changed when a count does).
    logged: tuple[str, ...] = field(default=(), compare=False, repr=False)

    def explain(self) -> str:
        """The counts, then one line per statement logged (checks included)."""
        lines = "\n".join(f"  {line}" for line in self.logged)
        return (
            f"{self.sessions} sessions, {self.statements} statements "
            f"(and {self.checks} heartbeat checks):\n{lines}"
        )


class StatementLog:
    """The part of a server's log written since ``mark()``: sessions and their statements.

    Only sessions that began after the mark count, with every statement they sent: a
    session that was open before (a holder's heartbeat, this class's own) is left out.
    """

    def __init__(self, server: PgServer, dbname: str = "postgres") -> None:
        self.path = server.log_path
        # Opened now, so that its own session began before any mark.
        self._conn = psycopg.connect(server.dsn(dbname), autocommit=True)
        self._offset = 0

    def mark(self) -> None:
        """Count from here."""
        self._offset = self.path.stat().st_size

    def calls(self) -> Calls:
        """Sessions and statements since ``mark()``, once the log holds everything sent so far.

        Call it after the command has exited: each statement is logged before the server
        answers it, so a marker statement of our own, once in the log, comes after all of
        them.
        """
        marker = f"statement-log-marker-{uuid.uuid4().hex}"
        self._conn.execute(sql.SQL("SELECT {}").format(sql.Literal(marker)))
        wait_until(lambda: marker in self._text(), what="the marker statement in the log")
        entries = _ENTRY.split(self._text())
        sessions = {
            pid for entry in entries if "connection authorized" in entry for pid in _pids(entry)
        }
        sent = [
            entry for entry in entries if _STATEMENT.search(entry) and set(_pids(entry)) & sessions
        ]
        checks = sum(any(check in entry for check in _CHECKS) for entry in sent)
        logged = tuple(_shortened(entry) for entry in sent)
        return Calls(len(sessions), len(sent) - checks, checks, logged)

    def close(self) -> None:
        """Close our own session."""
        self._conn.close()

    def _text(self) -> str:
        return self.path.read_bytes()[self._offset :].decode(errors="replace")

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def _shortened(entry: str) -> str:
    """One line: the pid and the statement, without the run's identifying comment."""
    text = re.sub(r"/\* jobrun-holder .*?\*/", "", " ".join(entry.split()))
    return text[text.find("[") :][:200]


def _pids(entry: str) -> list[int]:
    found = _PID.match(entry)
    return [int(found.group(1))] if found else []
