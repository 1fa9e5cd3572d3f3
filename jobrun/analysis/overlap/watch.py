"""The monitoring session of one attempt: the jobs' sessions, their statements, waits and cycle."""

from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING

import psycopg
from psycopg.rows import class_row, dict_row

from jobrun import db, sql
from jobrun.analysis.overlap import advice
from jobrun.analysis.overlap.model import JOBS, Session, SessionRow, find_cycle, waits

if TYPE_CHECKING:
    import datetime as dt

    from jobrun.analysis.overlap.report import Attempt

#: How often the watcher looks at pg_stat_activity / pg_locks while the jobs run. A deadlock
#: lasts deadlock_timeout (1 s by default) before PostgreSQL breaks it, so this sees it; with
#: deadlock_timeout set far lower the cycle can go unseen (the error still counts).
POLL_INTERVAL = 0.025
#: Characters of a session's statement kept in a report.
QUERY_CHARS = 200
#: How long to wait for the sessions of a killed attempt to be gone.
END_SESSIONS_WAIT = 5.0
#: Statements that open, name or tune a transaction without touching data: a job held
#: right after one of them holds nothing anybody could wait for, so they are not counted.
_CONTROL = re.compile(
    r"\s*(BEGIN|START\s+TRANSACTION|SAVEPOINT|RELEASE|SET|SHOW|RESET|DISCARD)\b", re.IGNORECASE
)


def app_name(job: str, attempt: int) -> str:
    """The application_name the sessions of ``job`` get in ``attempt`` (through PGAPPNAME)."""
    return f"jobrun-overlap:{job}:{attempt}"


def server_timeouts(
    conn: psycopg.Connection[tuple[object, ...]], target: db.Target
) -> dict[str, float]:
    """The server-side timeouts in force for the watching role here, in seconds (0: off)."""
    with db.translate_errors(target, "reading the server's timeouts"):
        cursor = conn.cursor(row_factory=dict_row)
        rows = cursor.execute(sql.OVERLAP_TIMEOUTS).fetchall()
    return {str(row["name"]): int(row["ms"]) / 1000 for row in rows}


class Watch:
    """The monitoring session's view of one attempt: its sessions, waits and first cycle."""

    def __init__(
        self,
        conn: psycopg.Connection[tuple[object, ...]],
        target: db.Target,
        attempt: Attempt,
    ) -> None:
        self.conn = conn
        self.target = target
        self.attempt = attempt
        self.names = {app_name(job, attempt.number): job for job in JOBS}
        self._edges: set[tuple[object, ...]] = set()
        #: Per job, every (backend pid, statement start) seen inside a transaction.
        self._statements: dict[str, set[tuple[int, dt.datetime]]] = {job: set() for job in JOBS}
        # Sessions already there under this attempt's names (a killed earlier run, another
        # overlap on the same database) belong to somebody else.
        self.ignored = frozenset(session.pid for session in self.sessions())
        if self.ignored:
            attempt.notes.append(
                f"ignored {len(self.ignored)} session(s) that already carried the attempt's "
                "application names (another jobrun overlap on this database?)"
            )

    def sessions(self) -> list[Session]:
        """One look at the server: this attempt's sessions, their blockers and awaited locks."""
        with db.translate_errors(self.target, "watching the sessions"):
            cursor = self.conn.cursor(row_factory=class_row(SessionRow))
            rows = cursor.execute(
                sql.OVERLAP_SESSIONS, {"names": list(self.names), "query_chars": QUERY_CHARS}
            ).fetchall()
        secrets = self.target.secrets
        return [
            Session.from_row(
                row, self.names[row.name], db.redact(" ".join((row.query or "").split()), secrets)
            )
            for row in rows
        ]

    def look(self) -> list[Session]:
        """Look once; record new waits, statements and the first cycle; the sessions seen."""
        sessions = [s for s in self.sessions() if s.pid not in self.ignored]
        self.attempt.seen.update(session.job for session in sessions)
        for wait in waits(sessions):
            if wait.edge() not in self._edges:
                self._edges.add(wait.edge())
                self.attempt.waits.append(wait)
        for session in sessions:
            # Outside a transaction only a session-level advisory lock outlives a statement:
            # a job in autocommit that takes one is as much "in the middle" as a transaction.
            if (
                (session.in_transaction or session.holds_lock)
                and session.query_start is not None
                and not _CONTROL.match(session.query)
            ):
                self._statements[session.job].add((session.pid, session.query_start))
        for job, seen in self._statements.items():
            self.attempt.statements[job] = len(seen)
        if self.attempt.cycle is None:
            self.attempt.cycle = find_cycle(sessions)
            if self.attempt.cycle is not None:  # now, while the rows are still held
                facts = advice.gather(self.conn, self.target, self.attempt.cycle)
                self.attempt.advice = advice.advise(self.attempt.cycle, facts)
        return sessions

    def statements(self, job: str) -> int:
        """Statements of ``job`` seen inside a transaction (or holding a lock) so far."""
        return len(self._statements[job])

    def end_sessions(self) -> None:
        """Terminate what is left of the attempt's sessions, and wait until they are gone."""
        with db.translate_errors(self.target, "ending the sessions of a killed attempt"):
            try:
                self.conn.execute(sql.OVERLAP_TERMINATE, {"names": list(self.names)})
            except psycopg.errors.InsufficientPrivilege:
                self.attempt.notes.append(
                    "could not terminate the killed commands' sessions (needs "
                    "pg_signal_backend): the next attempt may meet their locks"
                )
                return
        deadline = time.monotonic() + END_SESSIONS_WAIT
        while self.look() and time.monotonic() < deadline:
            time.sleep(POLL_INTERVAL)
