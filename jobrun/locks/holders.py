"""Who holds a key, from what the server says: a session's comment, a lease row.

The one answer to "who holds key K" for every caller: a waiting run, stop, status, forget.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import re
from typing import TYPE_CHECKING, Any

from jobrun import db, sql
from jobrun.db import messages
from jobrun.escape import printable
from jobrun.exitcodes import Exit, JobrunError
from jobrun.keys import LOCK_ID_PREFIX, lock_ids_of
from jobrun.locks import Holder
from jobrun.locks.slots import MAX_SLOTS, slot_lock_id

if TYPE_CHECKING:
    from collections.abc import Sequence

    import psycopg

    Connection = psycopg.Connection[Any]

    from structlog.typing import FilteringBoundLogger

_ANNOUNCEMENT = re.compile(r"/\* jobrun-holder (\{[^*]*\}) \*/")


def announcement(query: object) -> dict[str, object]:
    """What a lock session's ``/* jobrun-holder {...} */`` comment says ({} if nothing usable).

    WARNING: any session can write such a comment: take nothing in it on trust (the values
    are checked by whoever reads them).
    """
    match = _ANNOUNCEMENT.search(str(query or ""))
    if match:
        with contextlib.suppress(ValueError, RecursionError):
            announced = json.loads(match.group(1))
            if isinstance(announced, dict):
                return announced
    return {}


def session_holder(label: str, row: Sequence[object]) -> Holder:
    """The session holding an advisory lock, from its pg_locks / pg_stat_activity ``row``.

    ``row``: backend pid, client address, application_name, backend_start, query; the
    holder's comment in the query (if any) names its host, pid, run id and start.
    """
    backend_pid, client_addr, app_name, backend_start, query = row
    announced = announcement(query)
    started = backend_start.isoformat(timespec="seconds") if backend_start else None  # type: ignore[attr-defined]
    return Holder(
        key=label,
        host=str_or_none(announced.get("host")),
        pid=int_or_none(announced.get("pid")),
        run_id=str_or_none(announced.get("run_id")),
        since=str_or_none(announced.get("since")) or started,
        backend_pid=int_or_none(backend_pid),
        client_addr=str_or_none(client_addr),
        application_name=str_or_none(app_name),
    )


def leased_holder(found: object, log: FilteringBoundLogger, target: db.Target) -> Holder | None:
    """The lease-mode run holding our key, from sql.SESSION_TAKE_AT_ONCE's JSON (or None)."""
    if found is None:
        return None
    if found == "unreadable":
        log.warning(
            "lease_check_failed",
            error=f"permission denied for jobrun.leases or its schema ({db.describe(target)})",
            note="lease-mode runs of this key (by other roles) cannot be seen",
        )
        return None
    row = json.loads(str(found))
    return Holder(
        key=str(row["key"]),
        host=str_or_none(row.get("host")),
        pid=int_or_none(row.get("pid")),
        run_id=str_or_none(row.get("owner")),
        since=_seconds(row.get("acquired_at")),
        expires_at=_seconds(row.get("expires_at")),
    )


def _seconds(stamp: object) -> str | None:
    """A JSON timestamp of the server's as ``isoformat(timespec="seconds")``."""
    if stamp is None:
        return None
    return dt.datetime.fromisoformat(str(stamp)).isoformat(timespec="seconds")


def str_or_none(value: object) -> str | None:
    """``value`` as text (None stays None)."""
    return None if value is None else str(value)


def int_or_none(value: object) -> int | None:
    """``value`` if it is an integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) else None


class StopRefused(JobrunError):
    """The run a key's holder names cannot be shown to be a run of that key: not asked."""

    exit_code = Exit.NOT_ENDED


def candidate_ids(label: str) -> list[int]:
    """The lock ids a run of ``label`` may hold: the key's own, and its slots' (``--slots``)."""
    lock_ids = lock_ids_of(label)
    if "," not in label and not label.startswith(LOCK_ID_PREFIX):
        lock_ids += [slot_lock_id(label, slot) for slot in range(MAX_SLOTS)]
    return lock_ids


def holder_of(conn: Connection, label: str) -> Holder | None:
    """The run holding ``label`` now: its lease (lease mode) or its advisory lock (session)."""
    params = {"lock_ids": candidate_ids(label)}
    *_, leases = messages.results(conn, sql.STOP_LEASE_HOLDER, params)
    row = leases[0] if leases else None
    if row is not None:
        return _lease_holder(label, row)
    found = conn.execute(sql.SESSION_HOLDER_OF_ANY, params).fetchone()
    return _session_holder(label, found)


def holder_among(
    label: str,
    lease: Sequence[Any] | None,
    session: Sequence[Any] | None,
    *,
    initialised: bool = False,
) -> Holder | None:
    """The holder of ``label`` from the rows of STOP_LEASE_HOLDER and STOP_SESSION_HOLDER.

    (For a caller that read both in one message with what else it needed.) ``initialised``:
    ``jobrun init`` ran, so a history row claims only its own key's lock ids, and the run it
    records on a session's lock may stand in for the run id the session hides (see
    _session_holder). Before that, whoever may write the history could claim any lock.
    """
    if lease is not None:
        return _lease_holder(label, lease)
    if session is not None and not initialised:
        session = session[:_ANNOUNCED]
    return _session_holder(label, session)


def _lease_holder(label: str, row: Sequence[Any]) -> Holder:
    """The lease-mode holder (a STOP_LEASE_HOLDER row); StopRefused if its key is not ours."""
    owner, host, pid, key = row
    if str(key) not in label.split(","):
        raise StopRefused(
            f"the lease on {printable(label)}'s lock names key {printable(key)}, not "
            f"{printable(label)}: not asked to stop (jobrun init binds a lease to its key)"
        )
    return Holder(key=label, mode="lease", host=str(host), pid=int(str(pid)), run_id=owner)


def _session_holder(label: str, found: Sequence[Any] | None) -> Holder | None:
    """The session-mode holder (a SESSION_HOLDER_OF_ANY or STOP_SESSION_HOLDER row), if any.

    A holder whose statements this role may not see announces no run id: the run the
    history records on the lock it holds (STOP_SESSION_HOLDER's last columns) stands in.
    That record is checked like an announcement before a request is written (verify_run:
    the run must be one of ``label``), and it names the run's host and pid.
    """
    if found is None:
        return None
    holder = dataclasses.replace(session_holder(label, found[1:6]), mode="session")
    if holder.run_id is None and len(found) > _ANNOUNCED and found[_ANNOUNCED] is not None:
        run_id, host, pid = found[_ANNOUNCED:]
        holder = dataclasses.replace(holder, run_id=str(run_id), host=str(host), pid=int(pid))
    return holder


#: Where STOP_SESSION_HOLDER's recorded run (run id, host, pid) starts in its row.
_ANNOUNCED = 6
