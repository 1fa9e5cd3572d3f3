"""Operators in control: ask a run to stop, pause and resume a key, from any host."""

from __future__ import annotations

import getpass
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from psycopg import errors

from jobrun import sql
from jobrun.db import messages
from jobrun.escape import printable
from jobrun.exitcodes import Exit, JobrunError
from jobrun.history import schema
from jobrun.history.config import iso
from jobrun.locks.holders import StopRefused, candidate_ids
from jobrun.sql import control as control_statements

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import Sequence

    import psycopg

    from jobrun.locks import Holder

    Connection = psycopg.Connection[Any]

T = TypeVar("T")

#: How often ``stop`` looks whether the run has let go of its lock.
STOP_POLL = 0.2


def who_asks() -> dict[str, object]:
    """The operator behind a request: host, user name (a claim: $USER), pid.

    Who asked, for the record, is the database role (session_user), which the statements
    themselves write: the user name here is kept as ``claimed_user`` only.
    """
    try:
        user = getpass.getuser()
    except (OSError, KeyError):  # no name for our uid (a container): the number will do
        user = str(os.getuid())
    return {"host": socket.gethostname(), "user": user, "pid": os.getpid()}


def verify_run(
    conn: Connection, label: str, holder: Holder, *, labelled: bool | None = None
) -> str:
    """The key to address ``holder``'s stop request to; StopRefused if it is not ``label``'s.

    The key is one the run honours: ``label`` when it is one key; for several, the run's
    own label as the history has it (their order is the run's locking order), else the
    first of them.

    WARNING: a session-mode holder's run id comes from the comment its client wrote, which
    any role that can connect can forge (a session holding its own key's lock and naming
    another team's run). The server's record of that run, its history row, must then be a
    run of ``label``. A run without a history row (--no-history) cannot be checked here:
    the request carries a key of ``label``, and a run honours only requests for its own
    keys, so a request for a run of another key stops nothing.

    ``labelled``: whether ``jobrun init``'s run_label function is there (None: not known).
    """
    if holder.run_id is None:
        return label.split(",", maxsplit=1)[0]
    return _addressed(label, holder, _recorded_label(conn, holder.run_id, labelled=labelled))


def _addressed(label: str, holder: Holder, recorded: object) -> str:
    """verify_run's answer, from the label the history records for the run (None: no row)."""
    parts = label.split(",")
    if recorded is None:
        return parts[0]
    if not set(parts) <= set(str(recorded).split(",")):
        raise StopRefused(
            f"the holder of {printable(label)} names run {printable(holder.run_id)}, which the "
            "history records as a run of another key: not asked to stop (a session's own "
            "comment is not trusted)"
        )
    return label if len(parts) == 1 else str(recorded)


def _recorded_label(conn: Connection, run_id: str, *, labelled: bool | None) -> object:
    """The label the history records for ``run_id`` (None: no row this role can see).

    The owner's view first (``jobrun init``'s run_label, unless ``labelled`` says it is not
    there), else the table as this role sees it (no schema yet: no history).
    """
    if labelled is None:  # not asked yet: the catalog says (the function is init's)
        found = conn.execute(sql.RUN_LABEL_DEFINED).fetchone()
        labelled = bool(found and found[0])
    if labelled:
        try:
            row = conn.execute(sql.RUN_LABEL, (run_id,)).fetchone()
        except errors.InsufficientPrivilege:
            pass
        else:
            return None if row is None else row[0]

    def visible(check: tuple[str, ...]) -> list[tuple[Any, ...]]:
        return messages.results(conn, [*check, sql.RUN_LABEL_VISIBLE_NAMED], {"run_id": run_id})[-1]

    try:
        rows = schema.readable(conn, visible)
    except errors.InsufficientPrivilege:
        return None
    return rows[0][0] if rows else None


@dataclass(frozen=True)
class StopResult:
    """What ``stop`` saw: whether the run ended, how, and whether its lock was taken."""

    ended: bool
    outcome: str | None = None
    exit_code: int | None = None
    took_lock: bool = False


@dataclass(frozen=True)
class Requested:
    """A stop request written: the role recorded as who asked, and whether the run still held."""

    by: str
    #: The first look of ``wait_for_end``, taken in the request's own message.
    held: bool


def request_stop(
    conn: Connection, key: str, holder: Holder, reason: str | None, label: str
) -> Requested:
    """Write the stop request for ``holder``'s run (its heartbeat reads it), then look once.

    ``key``: what verify_run addressed it to (a key of the run, or its label); ``label``:
    the key asked for, whose lock the look checks. One message: the request, pruning the
    old ones, and whether the run still holds its lock.

    A request already there (a repeat) is kept. One this role may not see was written for
    another key by another role: StopRefused, for the run would never read ours.
    """
    params = {
        "run_id": holder.run_id,
        "key": key,
        "reason": reason,
        **who_asks(),
        **_look_params(label, holder),
    }
    found = _claimed(
        conn,
        sql.STOP_REQUEST,
        params,
        after=(sql.STOP_REQUESTS_PRUNE, _still_holding(holder)),
    )
    return _requested(conn, holder, found[0], found[-1])


def _requested(
    conn: Connection, holder: Holder, written: list[tuple[Any, ...]], look: list[tuple[Any, ...]]
) -> Requested:
    """What the request's message said: the rows its INSERT returned, and its look."""
    row = written[0] if written else None
    if row is None:
        row = conn.execute(sql.STOP_REQUEST_OF, (holder.run_id,)).fetchone()
        if row is None:
            raise StopRefused(
                f"another role's stop request for run {printable(holder.run_id)} is in the way "
                "(it names a key this role may not see): not asked to stop"
            )
    return Requested(by=str(row[0]), held=bool(look and look[0][0]))


def ask_to_stop(
    conn: Connection, label: str, holder: Holder, reason: str | None, *, labelled: bool | None
) -> Requested:
    """verify_run and request_stop in ONE message: one round trip less to a distant server.

    The message: the run's recorded label (only to say why a request was refused), the
    request written only where that label is ``label``'s (the check in the INSERT itself),
    the pruning and the first look. ``labelled`` (from records.held_if_recorded) says where
    the label is read. The message carries the schema's version check (the schema made or
    brought up to date first where it lacks steps). Where the label is not known, or a
    grant is missing (nothing was written: the message was one transaction), the two
    steps go one by one, as verify_run and request_stop handle each of those cases.
    """
    parts = label.split(",")
    if labelled is not None and holder.run_id is not None:
        recorded_label = sql.RUN_LABEL_EXPR if labelled else sql.RUN_LABEL_VISIBLE_EXPR
        params = {
            "run_id": holder.run_id,
            "key": parts[0],
            "several": len(parts) > 1,
            "parts": parts,
            "reason": reason,
            **who_asks(),
            **_look_params(label, holder),
        }
        statements = [
            f"SELECT {recorded_label}",
            sql.STOP_REQUEST_CHECKED.format(label=recorded_label),
            sql.STOP_REQUESTS_PRUNE,
            _still_holding(holder),
        ]
        try:
            recorded, written, _, look = schema.guarded(
                conn,
                lambda check: messages.results(conn, [*check, *statements], params)[len(check) :],
            )
        except errors.InsufficientPrivilege:
            pass
        else:
            _addressed(label, holder, recorded[0][0] if recorded else None)
            return _requested(conn, holder, written, look)
    addressed = verify_run(conn, label, holder, labelled=labelled)
    return request_stop(conn, addressed, holder, reason, label)


def _claimed(
    conn: Connection,
    statement: str,
    params: dict[str, object],
    *,
    after: Sequence[str] = (),
) -> list[list[tuple[Any, ...]]]:
    """The rows of ``statement``, then of each of ``after``: one message.

    After the schema's version check where this connection was not checked yet (in the
    same message); where the schema lacks steps (none yet, or an older one), they are run
    first, as a run does (history/schema.py).
    """

    def write(check: tuple[str, ...]) -> list[list[tuple[Any, ...]]]:
        return messages.results(conn, [*check, statement, *after], params)[len(check) :]

    return schema.guarded(conn, write)


def _look_params(label: str, holder: Holder) -> dict[str, object]:
    """The parameters of STOP_STILL_LEASED / STOP_STILL_LOCKED."""
    return {
        "run_id": holder.run_id,
        "backend_pid": holder.backend_pid or 0,
        "lock_ids": candidate_ids(label),
    }


def _still_holding(holder: Holder) -> str:
    return sql.STOP_STILL_LEASED if holder.mode == "lease" else sql.STOP_STILL_LOCKED


def wait_for_end(
    conn: Connection,
    label: str,
    holder: Holder,
    wait: float,
    *,
    force: bool,
    held: bool | None = None,
) -> StopResult:
    """Poll until ``holder`` no longer holds ``label``'s lock, or ``wait`` runs out.

    ``held``: the first look, when it was already taken (request_stop's). With ``force``,
    a run still holding its lock then has it taken away: its backend terminated (session
    mode) or its lease deleted (lease mode).
    """
    params = _look_params(label, holder)
    deadline = time.monotonic() + wait
    while True:
        if held is None:
            row = conn.execute(_still_holding(holder), params).fetchone()
            held = bool(row and row[0])
        if not held:
            outcome = conn.execute(sql.STOP_OUTCOME, (holder.run_id,)).fetchone()
            if outcome is None:
                return StopResult(ended=True)
            return StopResult(ended=True, outcome=str(outcome[0]), exit_code=outcome[1])
        if time.monotonic() >= deadline:
            break
        time.sleep(STOP_POLL)
        held = None
    if not force:
        return StopResult(ended=False)
    take_away(conn, holder, label)
    return StopResult(ended=False, took_lock=True)


class CannotTakeAway(JobrunError):
    """``stop --force``: neither this role nor jobrun's owner may end the run's session."""

    exit_code = Exit.UNAVAILABLE


def take_away(conn: Connection, holder: Holder, label: str) -> None:
    """Take the lock from a run: terminate its lock session, or delete its lease.

    A session of another role, which this role may not terminate (PostgreSQL allows that
    to the same role and to members of pg_signal_backend), is terminated by ``jobrun
    init``'s take_lock_away acting for it, where this role may control ``label`` and asked
    that very run to stop: see control_statements.TAKE_LOCK_AWAY_FUNCTION. CannotTakeAway
    where that is refused too (the owner may not terminate it either), or not there.
    """
    if holder.mode == "lease":
        conn.execute(sql.STOP_DELETE_LEASE, (holder.run_id,))
        return
    if holder.backend_pid is None:
        return
    try:
        conn.execute(sql.STOP_TERMINATE, (holder.backend_pid,))
    except errors.InsufficientPrivilege as refused:
        if holder.run_id is None:
            raise
        _take_away_as_owner(conn, holder, label, refused)


def _take_away_as_owner(
    conn: Connection, holder: Holder, label: str, refused: errors.InsufficientPrivilege
) -> None:
    """take_lock_away for this role, after its own pg_terminate_backend was ``refused``."""
    params = {"key": label, "run_id": holder.run_id, "backend_pid": holder.backend_pid}
    there = conn.execute(control_statements.TAKE_LOCK_AWAY_DEFINED).fetchone()
    if not (there and there[0]):
        why = (
            f"{refused.diag.message_primary or refused} (jobrun init, whose take_lock_away "
            "acts for operators, was not run here)"
        )
    else:
        try:
            row = conn.execute(control_statements.STOP_TAKE_AWAY_AS_OWNER, params).fetchone()
        except errors.InsufficientPrivilege as exc:
            why = (
                "neither this role nor the owner of the jobrun schema may terminate another "
                f"role's session ({exc.diag.message_primary or exc}): grant pg_signal_backend "
                "to the owner, or run stop --force as the run's own role"
            )
        else:
            if row is not None and row[0]:
                return
            why = (
                "this role may not control the key"
                if row is None or row[0] is None
                else f"the backend holds no lock of run {holder.run_id} now, or is not its session"
            )
    raise CannotTakeAway(
        f"could not take the lock of {printable(label)} away from backend "
        f"{holder.backend_pid}: {printable(why)}"
    ) from None


def pause(
    conn: Connection,
    label: str,
    *,
    seconds: float | None,
    until: dt.datetime | None,
    reason: str | None,
) -> tuple[str | None, str | None, str | None]:
    """Pause ``label`` (for ``seconds``, until ``until``, or until resumed).

    (since, until, the database role recorded as who paused it).
    """
    params = {"key": label, "reason": reason, "for": seconds, "until": until, **who_asks()}
    if until is None:
        found = _claimed(conn, sql.PAUSE, params)
    else:
        found = _claimed(conn, sql.PAUSE_UNTIL, params)
    row = found[0][0] if found[0] else None
    return (iso(row[0]), iso(row[1]), str(row[2])) if row else (None, None, None)


def resume(conn: Connection, label: str) -> bool:
    """End the pause of ``label``; False if it was not paused."""
    found = schema.readable(
        conn, lambda check: messages.results(conn, [*check, sql.RESUME_NAMED], {"key": label})
    )
    return bool(found and found[-1])
