"""The wait-for graph of one look at the jobs' sessions, and the cycles in it."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import Mapping, Sequence

#: The two jobs, as the user named them: A is ``--first``, B ``--second``.
JOBS = ("A", "B")


def other(job: str) -> str:
    """The other job."""
    return "B" if job == "A" else "A"


@dataclass(frozen=True)
class Lock:
    """A lock a session waits for, as pg_locks shows it."""

    locktype: str
    mode: str
    relation: str | None = None
    #: The transaction id, tuple, page or advisory key: whatever the lock type names.
    ident: str | None = None
    #: For a wait on a transaction: the row (tuple lock) the waiter holds meanwhile.
    row: str | None = None
    row_relation: str | None = None

    def describe(self) -> str:
        """``ShareLock on transaction 456 (row (0,2) of accounts)``."""
        what = {
            "transactionid": f"transaction {self.ident}",
            "virtualxid": f"virtual transaction {self.ident}",
            "relation": f"relation {self.relation}",
            "tuple": f"row {self.ident} of {self.relation}",
            "page": f"page {self.ident} of {self.relation}",
            "extend": f"extension of {self.relation}",
            "advisory": f"advisory lock {self.ident}",
        }.get(self.locktype)
        if what is None:
            where = f" {self.relation}" if self.relation else ""
            what = f"{self.locktype} lock{where}" + (f" {self.ident}" if self.ident else "")
        row = f" (row {self.row} of {self.row_relation})" if self.row else ""
        return f"{self.mode} on {what}{row}"

    def as_json(self) -> dict[str, Any]:
        """The lock's pg_locks fields (``ident`` as ``id``)."""
        fields = asdict(self)
        fields["id"] = fields.pop("ident")
        return fields


@dataclass(frozen=True)
class SessionRow:
    """One row of sql.OVERLAP_SESSIONS, by column name (psycopg's class_row builds it)."""

    pid: int
    name: str
    in_transaction: bool
    holds_lock: bool
    waiting: bool
    query_start: dt.datetime | None
    query: str | None
    blocked_by: list[int] | None
    locktype: str | None
    mode: str | None
    relation: str | None
    ident: str | None
    row_relation: str | None
    row: str | None


@dataclass(frozen=True)
class Session:
    """One database session of a job, as one look at the server saw it."""

    job: str
    pid: int
    in_transaction: bool
    query: str
    blocked_by: tuple[int, ...] = ()
    lock: Lock | None = None
    #: Holding a write, row, advisory or table lock beyond a read: inside a transaction, or
    #: a session-level advisory lock outside one.
    holds_lock: bool = False
    #: Waiting for a lock (any holder, also one outside the two jobs).
    waiting: bool = False
    #: When its current (or last) statement began: a new value is a new statement.
    query_start: dt.datetime | None = None

    @classmethod
    def from_row(cls, row: SessionRow, job: str, query: str) -> Session:
        """The session of ``job`` that ``row`` shows (``query`` already cleaned for display)."""
        # pg_stat_activity's columns come from one snapshot of the backends, pg_locks and
        # pg_blocking_pids() from moments later: a session that began to wait in between
        # shows its new blockers beside its previous statement. Only a session its own
        # activity row shows waiting for a lock gets a wait; the next look sees it whole.
        consistent = row.waiting
        lock = None
        if row.locktype and consistent:
            on_row = row.locktype == "transactionid"
            lock = Lock(
                row.locktype,
                row.mode or "",
                row.relation,
                row.ident,
                row.row if on_row else None,
                row.row_relation if on_row else None,
            )
        return cls(
            job=job,
            pid=row.pid,
            in_transaction=row.in_transaction,
            query=query,
            blocked_by=tuple(row.blocked_by or ()) if consistent else (),
            lock=lock,
            holds_lock=row.holds_lock,
            waiting=row.waiting,
            query_start=row.query_start,
        )


@dataclass(frozen=True)
class Wait:
    """One edge of the wait-for graph: a job's session blocked by another session."""

    job: str
    pid: int
    query: str
    lock: Lock | None
    #: ``A``, ``B``, or ``other`` for a session that belongs to neither command.
    holder_job: str
    holder_pid: int

    def describe(self) -> str:
        """``A (pid 1) waits for ShareLock on transaction 7 held by B (pid 2) while running: Q``."""
        lock = self.lock.describe() if self.lock else "a lock"
        return (
            f"{self.job} (pid {self.pid}) waits for {lock} held by {self.holder_job} "
            f"(pid {self.holder_pid}) while running: {self.query}"
        )

    def edge(self) -> tuple[object, ...]:
        """What makes two looks' waits the same wait: sessions and the lock awaited."""
        lock = self.lock or Lock("", "")
        return (self.pid, self.holder_pid, lock.locktype, lock.mode, lock.relation, lock.ident)

    def signature(self) -> tuple[str | None, ...]:
        """What makes two attempts' waits "the same": not pids, transaction ids or row positions."""
        lock = self.lock or Lock("", "")
        return (
            self.job,
            self.holder_job,
            lock.locktype,
            lock.mode,
            lock.relation,
            lock.row_relation,
            self.query,
        )

    def as_json(self) -> dict[str, Any]:
        """The edge, with the lock's fields and a ready-made sentence."""
        return {
            "job": self.job,
            "pid": self.pid,
            "query": self.query,
            "lock": self.lock.as_json() if self.lock else None,
            "held_by": {"job": self.holder_job, "pid": self.holder_pid},
            "text": self.describe(),
        }


def waits(sessions: Sequence[Session]) -> list[Wait]:
    """Every edge of the wait-for graph among ``sessions`` (a blocker may be an outsider)."""
    by_pid = {session.pid: session for session in sessions}
    return [wait_of(s, blocker, by_pid) for s in sessions for blocker in s.blocked_by]


def find_cycle(sessions: Sequence[Session]) -> tuple[Wait, ...] | None:
    """A wait-for cycle among ``sessions`` (starting at A's side when it can), or None."""
    by_pid = {session.pid: session for session in sessions}
    for start in sorted(sessions, key=lambda session: (session.job, session.pid)):
        path = _path_back_to(start.pid, start.pid, by_pid, {start.pid})
        if path is not None:
            return tuple(
                wait_of(by_pid[pid], path[(i + 1) % len(path)], by_pid)
                for i, pid in enumerate(path)
            )
    return None


def _path_back_to(
    pid: int, start: int, by_pid: Mapping[int, Session], seen: set[int]
) -> list[int] | None:
    """The sessions from ``pid`` along blocked-by edges back to ``start``, or None."""
    for blocker in by_pid[pid].blocked_by:
        if blocker == start:
            return [pid]
        if blocker in by_pid and blocker not in seen:
            seen.add(blocker)
            rest = _path_back_to(blocker, start, by_pid, seen)
            if rest is not None:
                return [pid, *rest]
    return None


def wait_of(session: Session, holder_pid: int, by_pid: Mapping[int, Session]) -> Wait:
    """The edge from ``session`` to the session ``holder_pid`` that blocks it."""
    holder = by_pid.get(holder_pid)
    return Wait(
        job=session.job,
        pid=session.pid,
        query=session.query,
        lock=session.lock,
        holder_job=holder.job if holder else "other",
        holder_pid=holder_pid,
    )
