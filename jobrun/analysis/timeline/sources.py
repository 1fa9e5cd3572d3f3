"""Where a timeline's runs come from: jobrun's run history, or the logs a user already has."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from psycopg.rows import dict_row

from jobrun import sql
from jobrun.analysis.deadlocks.sources import NoInputError
from jobrun.analysis.timeline import model
from jobrun.db import messages
from jobrun.exitcodes import Exit, JobrunError
from jobrun.history import schema
from jobrun.sql.timeline import TIMELINE_NOW, TIMELINE_RUNS

if TYPE_CHECKING:
    import datetime as dt
    from collections.abc import Sequence

    import psycopg

    from jobrun.analysis.timeline.model import Bar, Mark

#: A read of the history never takes longer than this (the server cancels it), as status's.
STATEMENT_TIMEOUT_MS = "30000"


class NotALogError(JobrunError):
    """A file given as a server log that cannot be read as one."""

    exit_code = Exit.DATA_ERROR


@dataclass
class Read:
    """What the sources gave: bars, deadlock marks, the reader's now, and notes."""

    bars: list[Bar] = field(default_factory=list)
    marks: list[Mark] = field(default_factory=list)
    #: The database's clock when the history was read (None: no history read).
    now: dt.datetime | None = None
    notes: list[str] = field(default_factory=list)


def history(
    conn: psycopg.Connection[Any], keys: Sequence[str], *, since: float | None, limit: int
) -> Read:
    """The runs and skips of ``keys`` going within the last ``since`` seconds, at most ``limit``.

    One read, in a transaction of its own bounded by a statement timeout, so that a busy
    history table cannot hold the command (or the jobs' lock sessions) up.
    """
    read = Read()
    params = {"keys": list(keys), "since": since, "limit": limit}
    with conn.transaction():
        conn.execute(sql.RUNS_TIMEOUTS, {"ms": STATEMENT_TIMEOUT_MS})
        cursor = conn.cursor(row_factory=dict_row)

        def runs(check: tuple[str, ...]) -> list[dict[str, Any]]:
            with conn.transaction():  # a savepoint: a schema that lacks steps rolls it back
                return messages.dict_results(conn, [*check, TIMELINE_RUNS], params)[-1]

        found = schema.readable(conn, runs)
        if found is None:
            read.notes.append("no run history yet (the jobrun.runs table does not exist)")
        rows = found or []
        now_row = cursor.execute(TIMELINE_NOW).fetchone() if not rows else rows[-1]
    read.now = now_row["now"] if now_row is not None else None
    read.bars = model.history_bars(rows)
    if len(rows) >= limit:
        read.notes.append(f"only the newest {limit} runs and skips are shown (--limit)")
    return read


def logs(
    server_logs: Sequence[str],
    *,
    prefix: str | None,
    sessions_from: Sequence[str] = (),
    cron_logs: Sequence[str] = (),
    journals: Sequence[str] = (),
    assume: dt.timedelta,
) -> Read:
    """Deadlock marks from server logs; lanes from their sessions, cron's lines, the journal.

    ``sessions_from``: server logs whose log_connections/log_disconnections lines become a
    lane per application (their deadlocks are marked too). Cron's times are read as the
    deadlocks' year, as ``jobrun deadlocks --cron-log`` reads them.
    """
    from jobrun.analysis.deadlocks.scan import find  # noqa: PLC0415 - only when logs are given
    from jobrun.analysis.deadlocks.together import Asked  # noqa: PLC0415

    paths = list(dict.fromkeys([*server_logs, *sessions_from]))
    for path in [*paths, *cron_logs, *journals]:  # a typo: said before anything is read
        if not (Path(path).is_file() and os.access(path, os.R_OK)):
            reason = "no such file" if not Path(path).exists() else "not a readable file"
            raise NoInputError(f"cannot read {path}: {reason}")
    read = Read()
    found = find(paths, prefix=prefix, sessions=bool(sessions_from)) if paths else None
    deadlocks = found.deadlocks if found is not None else []
    if found is not None:
        for unread in found.unread:
            raise NotALogError(" ".join(str(unread.error).split()))
        read.marks = model.deadlock_marks(deadlocks)
    scheduled = model.scheduled_bars(
        Asked(tuple(cron_logs), tuple(journals), assume).runs(deadlocks)
    )
    sessions = found.sessions if found is not None else []
    last = max(
        [mark.at for mark in read.marks]
        + [bar.until(bar.start) for bar in scheduled]
        + [model.log_time("", when) for s in sessions for when in (s.start, s.end) if when],
        default=None,
    )
    read.bars = scheduled + model.session_bars(sessions, until=last)
    if sessions_from and not sessions:
        read.notes.append(
            "the server log has no connection lines: set log_connections = on and "
            "log_disconnections = on to see each application's sessions"
        )
    read.now = last
    return read
