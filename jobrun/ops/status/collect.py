"""What is held right now, and how each key's runs went: read from the server."""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import errors

from jobrun import db, keys, sql
from jobrun.db import messages
from jobrun.escape import printable
from jobrun.history import schema
from jobrun.history.config import iso, pause
from jobrun.locks import Holder
from jobrun.locks.session import announcement
from jobrun.locks.slots import MAX_SLOTS, slot_lock_id
from jobrun.sql import status as status_sql

if TYPE_CHECKING:
    from collections.abc import Iterable, Sequence

    Connection = psycopg.Connection[Any]
    Row = dict[str, Any]

_APP_PREFIX = "jobrun:"
#: History statements of ``status``/``history`` give up after this long.
_STATEMENT_TIMEOUT_MS = "30000"
#: A run is stuck past this many times its typical duration, and this many seconds past it.
STUCK_FACTOR = 3.0
STUCK_MINIMUM = 60.0


@dataclass
class KeyStatus:
    """One row of ``jobrun status``; ``as_json`` is the documented machine form."""

    key: str
    lock_ids: list[int]
    holder: Holder | None = None
    last_outcome: str | None = None
    last_exit_code: int | None = None
    last_started_at: str | None = None
    last_finished_at: str | None = None
    last_duration: float | None = None
    #: Deadlocks in the database while the last run ran (None: not recorded).
    last_deadlocks: int | None = None
    last_success_at: str | None = None
    typical_duration: float | None = None
    skip_streak: int = 0
    failure_streak: int = 0
    last_skip_at: str | None = None
    extra_lock_ids: list[int] = field(default_factory=list)
    #: ``jobrun pause``: by whom (host, user, pid), since, until, why (None: not paused).
    paused: dict[str, object] | None = None
    #: ``--expect-every`` and its grace, in seconds (None: no expectation).
    expect_every: float | None = None
    expect_grace: float | None = None
    #: The last success started longer ago than expect_every + expect_grace.
    overdue: bool = False
    last_success_started_at: str | None = None
    #: How long the run going now has run (None: none is going, per the history).
    running_for: float | None = None
    #: ``--slots``: how many slots of the key are held now (0: none, or no slots).
    slots_in_use: int = 0
    #: A session-mode holder's database role, as the server knows it (None: a lease, or
    #: not held). Any role that may connect can take a key's advisory lock: this says who.
    holder_role: str | None = None
    #: A run the history says is ``running`` whose lock is no longer held (it died: a crash,
    #: a server restart): run_id, host, pid, started_at, mode. None: no such run.
    abandoned_run: dict[str, object] | None = None

    @property
    def stuck(self) -> bool:
        """Held by a run going on for over STUCK_FACTOR times its typical duration.

        (And at least STUCK_MINIMUM seconds past it: a 2-second job is not stuck at 7 s.)
        A key with no successful run yet has no typical duration and is never stuck.
        """
        if self.holder is None or self.running_for is None or self.typical_duration is None:
            return False
        limit = max(STUCK_FACTOR * self.typical_duration, self.typical_duration + STUCK_MINIMUM)
        return self.running_for > limit

    def attention(self, alert_after: int) -> list[str]:
        """What ``status --check`` reports about this key: overdue, failing, stuck."""
        found = []
        if self.overdue:
            found.append("overdue")
        if alert_after > 0 and self.failure_streak >= alert_after:
            found.append("failing")
        if self.stuck:
            found.append("stuck")
        return found

    def as_json(self) -> dict[str, object]:
        """The stable JSON object (see docs/operations.md for every field)."""
        return {
            "key": self.key,
            "lock_ids": self.lock_ids,
            "held": self.holder is not None,
            "holder": None if self.holder is None else _holder_json(self.holder, self.holder_role),
            "last_outcome": self.last_outcome,
            "last_exit_code": self.last_exit_code,
            "last_started_at": self.last_started_at,
            "last_finished_at": self.last_finished_at,
            "last_duration": self.last_duration,
            "last_deadlocks": self.last_deadlocks,
            "last_success_at": self.last_success_at,
            "typical_duration": self.typical_duration,
            "skip_streak": self.skip_streak,
            "failure_streak": self.failure_streak,
            "last_skip_at": self.last_skip_at,
            "paused": self.paused,
            "expect_every": self.expect_every,
            "expect_grace": self.expect_grace,
            "overdue": self.overdue,
            "running_for": self.running_for,
            "stuck": self.stuck,
            "slots_in_use": self.slots_in_use,
            "abandoned_run": self.abandoned_run,
        }


def _holder_json(holder: Holder, role: str | None) -> dict[str, object]:
    """The holder as ``status --json`` documents it (the key is the row's own)."""
    return {**{name: value for name, value in vars(holder).items() if name != "key"}, "role": role}


@dataclass(frozen=True)
class Report:
    """What ``collect`` found, and what it could not look at (said once, on stderr)."""

    keys: list[KeyStatus]
    notes: list[str]
    #: What this role was refused (run history, leases, pauses and expectations): a
    #: ``status --check`` that could not look must not say all is well.
    unreadable: list[str] = field(default_factory=list)


def collect(conn: Connection, labels: Sequence[str] = ()) -> Report:
    """Status of ``labels``, or of every key in history, leased or held by a jobrun session."""
    notes: list[str] = []
    unreadable: list[str] = []
    reads = _read_at_once(conn, labels, notes) or _read_apart(conn, labels, notes, unreadable)
    history = _history(reads.history)
    leases = _leases(reads.leases)
    advisory, roles = _advisory(reads.advisory)
    rows: dict[str, KeyStatus] = {}
    for label in labels or history:
        found = history.get(label)
        rows[label] = found if found is not None else KeyStatus(label, keys.lock_ids_of(label))
    controls = _controls(reads.pauses, reads.expectations, reads.running, reads.abandoned)
    if not labels:
        _add_unknown_holders(rows, leases, advisory)
        for label in controls:
            rows.setdefault(label, KeyStatus(label, keys.lock_ids_of(label)))
    for label, fields in controls.items():
        if label in rows:
            for name, value in fields.items():
                setattr(rows[label], name, value)
    for row in rows.values():
        for lock_id in sorted(row.lock_ids):
            holder = leases.get(lock_id, (None, None))[1] or advisory.get(lock_id, (None, None))[1]
            if holder is not None:
                row.holder = holder
                break
    _add_slots(rows.values(), {**advisory, **leases})
    _add_roles(rows.values(), roles)
    ordered = list(rows.values()) if labels else sorted(rows.values(), key=lambda row: row.key)
    return Report(keys=ordered, notes=notes, unreadable=unreadable)


@dataclass
class _Reads:
    """The rows status is made of, one list per read (empty: nothing there, or refused)."""

    history: list[Row] = field(default_factory=list)
    leases: list[Row] = field(default_factory=list)
    advisory: list[Row] = field(default_factory=list)
    pauses: list[Row] = field(default_factory=list)
    expectations: list[Row] = field(default_factory=list)
    running: list[Row] = field(default_factory=list)
    abandoned: list[Row] = field(default_factory=list)


#: The reads of ``status``, in the order of ``_Reads``' fields: each read's rows are its
#: last statement's (a DO block before it leaves them in a setting for it to read).
_ALL_READS: tuple[tuple[str, ...], ...] = (
    (sql.STATUS_HISTORY,),
    (status_sql.STATUS_LEASES_FIND, status_sql.STATUS_LEASES),
    (sql.STATUS_ADVISORY_LOCKS,),
    (sql.STATUS_PAUSES,),
    (sql.STATUS_EXPECTATIONS,),
    (sql.STATUS_RUNNING,),
    (status_sql.STATUS_ABANDONED_FIND, status_sql.STATUS_ABANDONED),
)


def _read_at_once(conn: Connection, labels: Sequence[str], notes: list[str]) -> _Reads | None:
    """Every read in ONE message (one round trip), or None when this role was refused one.

    The message starts with the schema's version check (once per connection): a database
    without jobrun's schema has only advisory locks to show (one more message, there
    only). A refusal is left to ``_read_apart``, which reads table by table, so that a
    missing grant costs only that table's part.
    """
    params = {"all": not labels, "keys": list(labels)}
    try:
        found = schema.readable(
            conn, lambda check: _read_groups(conn, _ALL_READS, params, check=check)
        )
    except errors.InsufficientPrivilege:
        return None
    if found is None:
        notes.append("no run history yet (the jobrun.runs table does not exist)")
        return _Reads(advisory=read_rows(conn, sql.STATUS_ADVISORY_LOCKS))
    return _Reads(*found)


def _read_groups(
    conn: Connection,
    groups: Sequence[Sequence[str]],
    params: dict[str, Any],
    *,
    check: tuple[str, ...] = (),
) -> list[list[Row]]:
    """The rows of each group of statements (its last statement's), in one message."""
    found = read_many(conn, [query for group in groups for query in group], params, check=check)
    rows: list[list[Row]] = []
    at = 0
    for group in groups:
        at += len(group)
        rows.append(found[at - 1])
    return rows


def _read_apart(
    conn: Connection, labels: Sequence[str], notes: list[str], unreadable: list[str]
) -> _Reads:
    """Each table on its own (the schema was checked): what is refused is noted, left empty."""
    params = {"all": not labels, "keys": list(labels)}
    reads = _Reads()
    try:
        reads.history = read_rows(conn, sql.STATUS_HISTORY, params)
    except errors.InsufficientPrivilege as exc:
        _refused("run history", exc, notes, unreadable)
    try:
        [reads.leases] = _read_groups(conn, [_ALL_READS[1]], params)
    except errors.InsufficientPrivilege as exc:
        _refused("leases", exc, notes, unreadable)
    reads.advisory = read_rows(conn, sql.STATUS_ADVISORY_LOCKS)
    try:
        controls = read_many(
            conn, [sql.STATUS_PAUSES, sql.STATUS_EXPECTATIONS, sql.STATUS_RUNNING], params
        )
    except errors.InsufficientPrivilege as exc:
        _refused("pauses and expectations", exc, notes, unreadable)
    else:
        reads.pauses, reads.expectations, reads.running = controls
    if reads.history:
        with contextlib.suppress(errors.InsufficientPrivilege):
            [reads.abandoned] = _read_groups(conn, [_ALL_READS[-1]], params)
    return reads


def _add_roles(rows: Iterable[KeyStatus], roles: dict[int, str]) -> None:
    """Each session-mode holder's database role, from its backend pid."""
    for row in rows:
        if row.holder is not None and row.holder.mode == "session":
            row.holder_role = roles.get(row.holder.backend_pid or 0)


def _add_slots(rows: Iterable[KeyStatus], held: dict[int, tuple[str | None, Holder]]) -> None:
    """``--slots``: how many slots of each key are held, and a holder if none was found.

    Only the keys a held lock is labelled with are looked at: a key's slot ids are 256
    hashes, which for every key of a large history would cost seconds.
    """
    by_label: dict[str, list[tuple[int, Holder]]] = {}
    for lock_id, (label, holder) in held.items():
        if label is not None:
            by_label.setdefault(label, []).append((lock_id, holder))
    for row in rows:
        if "," in row.key or row.key.startswith(keys.LOCK_ID_PREFIX) or row.key not in by_label:
            continue
        slot_ids = _slot_ids(row.key)
        in_use = [holder for lock_id, holder in by_label[row.key] if lock_id in slot_ids]
        if in_use:
            row.slots_in_use = len(in_use)
            row.holder = row.holder or in_use[0]


def _add_unknown_holders(
    rows: dict[str, KeyStatus],
    leases: dict[int, tuple[str | None, Holder]],
    advisory: dict[int, tuple[str | None, Holder]],
) -> None:
    """Held locks that no history key covers get a row of their own."""
    covered = {lock_id for row in rows.values() for lock_id in row.lock_ids}
    for lock_id, (label, _) in sorted({**advisory, **leases}.items()):
        if lock_id in covered or label is None:
            continue
        row = rows.setdefault(label, KeyStatus(label, []))
        row.lock_ids.append(lock_id)
        covered.add(lock_id)


def _refused(what: str, exc: Exception, notes: list[str], unreadable: list[str]) -> None:
    """Note that ``what`` could not be read for want of a privilege."""
    notes.append(f"{what} not readable: {db.one_line(exc)}")
    unreadable.append(what)


def _history(rows: list[Row]) -> dict[str, KeyStatus]:
    """One KeyStatus per key of the history rows (STATUS_HISTORY)."""
    found: dict[str, KeyStatus] = {}
    for row in rows:
        label = row["key"]
        found[label] = KeyStatus(
            key=label,
            lock_ids=list(row["lock_ids"] or []) or keys.lock_ids_of(label),
            last_outcome=row["outcome"],
            last_exit_code=row["exit_code"],
            last_started_at=iso(row["started_at"]),
            last_finished_at=iso(row["finished_at"]),
            last_duration=rounded_seconds(row["duration"]),
            last_deadlocks=row["deadlocks"],
            last_success_at=iso(row["last_success_at"]),
            typical_duration=rounded_seconds(row["typical_duration"]),
            skip_streak=row["skip_streak"],
            failure_streak=row["failure_streak"],
            last_skip_at=iso(row["last_skip_at"]),
        )
    return found


def _abandoned(rows: list[Row]) -> dict[str, Row]:
    """Runs marked running whose lock is gone, by run id (the newest of a key last)."""
    return {
        str(row["run_id"]): {
            "key": row["key"],
            "run_id": str(row["run_id"]),
            "host": row["host"],
            "pid": row["pid"],
            "started_at": iso(row["started_at"]),
            "mode": row["mode"],
        }
        for row in rows
    }


def abandoned_lines(rows: Iterable[KeyStatus]) -> list[str]:
    """``status --check``: one line per key whose run is marked running but lost its lock."""
    lines = []
    for row in rows:
        run = row.abandoned_run
        if run is not None:
            lines.append(
                printable(
                    f"abandoned: {row.key}: run {run['run_id']} on {run['host']} pid "
                    f"{run['pid']}, started {run['started_at']}, is marked running but its "
                    f"lock is no longer held (it died: a crash, a server restart)"
                )
            )
    return lines


def _controls(
    pauses: list[Row], expectations: list[Row], running: list[Row], dead: list[Row]
) -> dict[str, Row]:
    """Pauses, expectations, running runs and abandoned ones: status fields by key label.

    A run marked running whose lock is gone is not running: it counts as abandoned only.
    """
    found: dict[str, Row] = {}
    abandoned = _abandoned(dead)
    for run in abandoned.values():
        found.setdefault(str(run["key"]), {})["abandoned_run"] = {
            name: value for name, value in run.items() if name != "key"
        }
    running = [run for run in running if str(run["run_id"]) not in abandoned]
    for row in pauses:
        found.setdefault(row["key"], {})["paused"] = pause(row)
    for expected in expectations:
        found.setdefault(expected["key"], {}).update(
            expect_every=expected["every"],
            expect_grace=expected["grace"],
            overdue=bool(expected["overdue"]),
            last_success_started_at=iso(expected["last_success_started_at"]),
        )
    for run in running:
        found.setdefault(run["key"], {})["running_for"] = rounded_seconds(run["running_for"])
    return found


def read_rows(conn: Connection, query: str, params: dict[str, Any] | None = None) -> list[Row]:
    """The rows of one read, with the history's timeouts: one message, one round trip."""
    return read_many(conn, [query], params or {})[0]


def read_many(
    conn: Connection,
    queries: Sequence[str],
    params: dict[str, Any],
    *,
    check: tuple[str, ...] = (),
) -> list[list[Row]]:
    """The rows of each query, sent as ONE message with the history's timeouts first.

    One implicit transaction: the timeouts (local to it) end with it, and an error in any
    statement fails the whole. ``check``: the schema's version check, after the timeouts
    (history/schema.py).
    """
    found = messages.dict_results(
        conn, [sql.RUNS_TIMEOUTS, *check, *queries], {**params, "ms": _STATEMENT_TIMEOUT_MS}
    )
    return found[1 + len(check) :]


def _leases(rows: list[Row]) -> dict[int, tuple[str | None, Holder]]:
    """Unexpired leases by lock id, with the key label each was taken under."""
    return {
        row["lock_id"]: (
            row["key"],
            Holder(
                key=row["key"],
                mode="lease",
                host=row["host"],
                pid=row["pid"],
                run_id=str(row["owner"]),
                since=iso(row["acquired_at"]),
                expires_at=iso(row["expires_at"]),
            ),
        )
        for row in rows
    }


def _advisory(rows: list[Row]) -> tuple[dict[int, tuple[str | None, Holder]], dict[int, str]]:
    """Granted advisory locks by lock id, and each holding backend's database role.

    The label is known for jobrun sessions only.
    """
    held: dict[int, tuple[str | None, Holder]] = {}
    roles: dict[int, str] = {}
    for row in rows:
        if row["usename"] is not None:
            roles[row["pid"]] = str(row["usename"])
        lock_id: int = row["lock_id"]
        label = _label_from_app(lock_id, row["application_name"])
        announced = announcement(row["query"])
        holder = Holder(
            key=label or f"lock-id:{lock_id}",
            mode="session",
            host=_str(announced.get("host")),
            pid=_int(announced.get("pid")),
            run_id=_str(announced.get("run_id")),
            since=_str(announced.get("since")) or iso(row["backend_start"]),
            backend_pid=row["pid"],
            client_addr=row["client_addr"],
            application_name=row["application_name"],
        )
        held.setdefault(lock_id, (label, holder))
    return held, roles


def _label_from_app(lock_id: int, app_name: object) -> str | None:
    """The key a jobrun session (``application_name`` = ``jobrun:<label>``) holds this id for."""
    name = str(app_name or "")
    if not name.startswith(_APP_PREFIX):
        return None
    label = name[len(_APP_PREFIX) :]
    # One key, or one of a comma-joined group; a trimmed name or a raw --lock-id that does
    # not match is named by its number.
    for candidate in (label, *label.split(",")):
        if candidate and keys.lock_id_of(candidate) == lock_id:
            return candidate
    # A run with --slots holds a slot's lock under its key's name.
    if not label.startswith(keys.LOCK_ID_PREFIX) and lock_id in _slot_ids(label):
        return label
    return f"lock-id:{lock_id}"


@functools.cache
def _slot_ids(name: str) -> frozenset[int]:
    """Every slot lock id a key may have (``--slots`` up to MAX_SLOTS)."""
    return frozenset(slot_lock_id(name, slot) for slot in range(MAX_SLOTS))


def rounded_seconds(value: float | None) -> float | None:
    """Seconds to the millisecond, as status and history show them."""
    return None if value is None else round(value, 3)


def _str(value: object) -> str | None:
    return None if value is None else str(value)


def _int(value: object) -> int | None:
    """An integer as it is, anything else (a malformed holder comment's pid) None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None
