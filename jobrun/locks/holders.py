"""Who holds a key, from what the server says: a session's comment, a lease row."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import re
from typing import TYPE_CHECKING

from jobrun import db
from jobrun.locks import Holder

if TYPE_CHECKING:
    from collections.abc import Sequence

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
