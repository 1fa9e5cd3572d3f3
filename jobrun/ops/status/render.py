"""The tables and ``status --check`` lines of ``jobrun status`` and ``history``."""

from __future__ import annotations

import contextlib
import contextvars
import datetime as dt
from typing import TYPE_CHECKING, Any

from jobrun.durations import format_seconds
from jobrun.escape import printable

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator, Mapping, Sequence

    from jobrun.locks import Holder
    from jobrun.ops.status.collect import KeyStatus

#: Run ids are UUIDs; the table shows their first 8 characters (``--json`` has them whole).
_SHORT_RUN_ID = 8


#: The width ``status`` keeps to without --wide (a terminal's, a mail's).
WIDTH = 120


def status_table(
    rows: Iterable[KeyStatus], *, wide: bool = False, now: dt.datetime | None = None
) -> str:
    """An aligned table, one line per key, in WIDTH columns unless ``wide``.

    The narrow table leaves the lock mode, the holder's run id, the typical duration and
    the deadlocks to --wide, writes times without seconds (and without the
    year when it is ``now``'s), and shortens the key, holder and note with ``…`` to fit.
    """
    rows = list(rows)
    if wide:
        return _align([_WIDE_HEADER, *(_wide_row(row) for row in rows)])
    year = (now or dt.datetime.now(dt.timezone.utc)).year
    lines = [
        _NARROW_HEADER,
        *(
            (
                row.key,
                _holder(row),
                _short_when(row.holder.since, year) if row.holder else "-",
                row.last_outcome or "-",
                _short_when(row.last_finished_at, year),
                _duration(row.last_duration),
                str(row.skip_streak),
                str(row.failure_streak),
                _note(row, year=year),
            )
            for row in rows
        ),
    ]
    return _align(lines, width=WIDTH, elastic={0: "both", 1: "pid", 8: "start"})


_WIDE_HEADER = (
    "KEY",
    "HELD",
    "HOLDER",
    "RUN",
    "SINCE",
    "LAST",
    "FINISHED",
    "DURATION",
    "TYPICAL",
    "DEADLOCKS",
    "SKIPS",
    "FAILS",
    "NOTE",
)
_NARROW_HEADER = (
    "KEY",
    "HOLDER",
    "SINCE",
    "LAST",
    "FINISHED",
    "DURATION",
    "SKIPS",
    "FAILS",
    "NOTE",
)


def _wide_row(row: KeyStatus) -> tuple[str, ...]:
    holder = row.holder
    return (
        row.key,
        (holder.mode or "-") if holder else "-",
        _holder(row),
        (holder.run_id or "-")[:_SHORT_RUN_ID] if holder else "-",
        _when(holder.since) if holder else "-",
        row.last_outcome or "-",
        _when(row.last_finished_at),
        _duration(row.last_duration),
        _duration(row.typical_duration),
        _count(row.last_deadlocks),
        str(row.skip_streak),
        str(row.failure_streak),
        _note(row),
    )


def _holder(row: KeyStatus) -> str:
    return _who(row.holder) + (f" (role {printable(row.holder_role)})" if row.holder_role else "")


def history_table(runs: Iterable[dict[str, Any]]) -> str:
    """An aligned table of runs, newest first."""
    lines: list[tuple[str, ...]] = [
        ("STARTED", "OUTCOME", "EXIT", "DURATION", "DEADLOCKS", "HOST", "PID", "RUN", "NOTE")
    ]
    for run in runs:
        note = run["reason"] or run["signal"] or ""
        holder = run.get("holder") or {}
        if run["outcome"] == "skipped" and holder.get("holder_host"):
            note = f"{note}, held by {holder['holder_host']} pid {holder.get('holder_pid')}"
        elif run["outcome"] == "skipped" and holder.get("previous_host"):
            note = (
                f"{note}, ran on {holder['previous_host']} at {holder.get('previous_started_at')}"
            )
        note = ", ".join(filter(None, [note, *_noted(run)]))
        lines.append(
            (
                _when(run["started_at"]),
                str(run["outcome"]),
                "-" if run["exit_code"] is None else str(run["exit_code"]),
                _duration(run["duration"]),
                _count(run["deadlocks"]),
                str(run["host"]),
                str(run["pid"]),
                str(run["run_id"])[:_SHORT_RUN_ID],
                note or "-",
            )
        )
    return _align(lines)


def _noted(run: dict[str, Any]) -> list[str]:
    """--coalesce, --jitter, --retries: what the run's noted columns say (none: nothing)."""
    found = []
    if run.get("attempts"):
        codes = ",".join(str(code) for code in run.get("attempt_exit_codes") or [])
        found.append(f"{run['attempts']} attempts ({codes})")
    if run.get("queued_seconds") is not None:
        found.append(f"queued {_duration(run['queued_seconds'])}")
    if run.get("jitter_seconds") is not None:
        found.append(f"jitter {_duration(run['jitter_seconds'])}")
    return found


def overlap_table(pairs: Iterable[dict[str, Any]]) -> str:
    """An aligned table of overlapping runs, one line per pair, newest first."""
    lines: list[tuple[str, ...]] = [
        ("STARTED", "FINISHED", "HOST", "OUTCOME", "DEADLOCKS", "OVERLAP",
         "OTHER STARTED", "OTHER FINISHED", "OTHER HOST", "OTHER OUTCOME", "OTHER DEADLOCKS")
    ]  # fmt: skip
    lines.extend(
        (
            _when(pair["started_at"]),
            _when(pair["finished_at"]),
            str(pair["host"]),
            str(pair["outcome"]),
            _count(pair["deadlocks"]),
            _duration(pair["overlap"]),
            _when(pair["other_started_at"]),
            _when(pair["other_finished_at"]),
            str(pair["other_host"]),
            str(pair["other_outcome"]),
            _count(pair["other_deadlocks"]),
        )
        for pair in pairs
    )
    return _align(lines)


def _note(row: KeyStatus, *, year: int | None = None) -> str:
    """Paused (until when, by whom), overdue, stuck: what an operator should know at once.

    ``year``: the narrow table's shorter form.
    """
    notes = []
    if row.paused is not None:
        until = row.paused["until"]
        who = f"{row.paused['user']}@{row.paused['host']}"
        if year is None:
            notes.append(f"paused until {_when(str(until)) if until else 'resumed'} by {who}")
        else:
            notes.append(
                f"paused by {who}" + (f" to {_short_when(str(until), year)}" if until else "")
            )
    if row.slots_in_use:
        notes.append(f"{row.slots_in_use} slots in use")
    if row.overdue:
        notes.append("overdue")
    if row.stuck:
        notes.append("stuck")
    return ", ".join(notes) or "-"


def check_lines(rows: Iterable[KeyStatus], alert_after: int) -> list[str]:
    """``status --check``: one line per key that is overdue, failing or stuck."""
    lines = []
    for row in rows:
        for what in row.attention(alert_after):
            detail = {
                "overdue": f"last success started {_when(row.last_success_started_at)}, "
                f"expected every {_duration(row.expect_every)} "
                f"(grace {_duration(row.expect_grace)})",
                "failing": f"{row.failure_streak} failures in a row",
                "stuck": f"running for {_duration(row.running_for)}, typically "
                f"{_duration(row.typical_duration)}",
            }[what]
            lines.append(printable(f"{what}: {row.key}: {detail}"))
    return lines


def _count(value: int | None) -> str:
    return "-" if value is None else str(value)


#: The fewest columns a shortened cell keeps, by what it keeps.
_LEAST = {"both": 16, "pid": 20, "start": 10}
#: The most a holder's cell keeps for its pid and role: a role name is up to 63 bytes.
_MOST_FOR_A_HOLDER = 36
_GAP = "  "


def _align(
    rows: Sequence[tuple[str, ...]],
    *,
    width: int | None = None,
    elastic: Mapping[int, str] | None = None,
) -> str:
    """The rows as aligned columns; each cell escaped, as most come from the database.

    With ``width``: the ``elastic`` columns (index: what of a cell to keep, as
    jobrun.log.shorten takes it, or ``pid``: a holder, its host shortened first) are
    narrowed, the widest first and the first column (the key) last, until a line fits (or
    each is down to its _LEAST), and their cells shortened with ``…``.
    """
    from jobrun.log import columns  # noqa: PLC0415 - structlog is loaded anyway

    lines = [tuple(printable(cell) for cell in row) for row in rows]
    widths = [max(columns(line[i]) for line in lines) for i in range(len(lines[0]))]
    if width is not None and elastic:
        least = {i: max(columns(lines[0][i]), _LEAST[elastic[i]]) for i in elastic}
        # A holder keeps its pid and role while it can: how a squatter of a key is seen.
        kept = dict(least)
        for i in (i for i in elastic if elastic[i] == "pid"):
            tails = (columns(_tail(line[i])) + _LEAST["start"] // 2 for line in lines[1:])
            kept[i] = max(least[i], min(max(tails, default=0), _MOST_FOR_A_HOLDER))

        def too_wide() -> bool:
            return sum(widths) + len(_GAP) * (len(widths) - 1) > width

        # The key (column 0) names the row: the other columns give way first.
        others = [i for i in elastic if i != 0]
        for turn, floor in ((others, kept), ([0], least), (others, least)):
            while too_wide():
                narrower = [i for i in turn if widths[i] > floor[i]]
                if not narrower:
                    break
                widths[max(narrower, key=lambda i: widths[i])] -= 1
        lines = [
            tuple(
                _shortened(cell, widths[i], elastic[i]) if i in elastic else cell
                for i, cell in enumerate(line)
            )
            for line in lines
        ]
    return "\n".join(
        _GAP.join(
            cell + " " * (size - columns(cell)) for cell, size in zip(line, widths, strict=True)
        ).rstrip()
        for line in lines
    )


def _shortened(cell: str, width: int, keep: str) -> str:
    """``cell`` in ``width`` columns; ``keep`` ``pid``: a holder's host gives way first.

    Its `` pid N`` and `` (role R)`` stay: the role is how a squatter of a key is seen.
    """
    from jobrun.log import columns, shorten  # noqa: PLC0415 - structlog is loaded anyway

    tail = _tail(cell) if keep == "pid" else ""
    if tail and width - columns(tail) >= _LEAST["start"] // 2:
        return shorten(cell[: -len(tail)], width - columns(tail)) + tail
    return shorten(cell, width, keep="start" if keep == "pid" else keep)


def _tail(holder: str) -> str:
    """`` pid N (role R)`` of a holder's cell (or `` (role R)``): what never gives way."""
    cut = min((at for at in (holder.find(" pid "), holder.find(" (role ")) if at > 0), default=0)
    return holder[cut:] if cut else ""


def _who(holder: Holder | None) -> str:
    if holder is None:
        return "-"
    if holder.host is not None:
        return f"{holder.host} pid {holder.pid}"
    if holder.backend_pid is not None:  # not a jobrun session, or its query is hidden from us
        return f"backend {holder.backend_pid}" + (
            f" from {holder.client_addr}" if holder.client_addr else ""
        )
    return "?"


#: ``--tz``: the zone the tables show times in (None: UTC, written ``Z``). Set around one
#: command's rendering by ``shown_in``; ``--json`` keeps ISO 8601 times in UTC regardless.
_ZONE: contextvars.ContextVar[dt.tzinfo | None] = contextvars.ContextVar("zone", default=None)


@contextlib.contextmanager
def shown_in(zone: str | None) -> Iterator[None]:
    """Render the tables' times in the IANA ``zone`` (None: UTC), e.g. ``10:26 CET``."""
    if zone is None:
        yield
        return
    import zoneinfo  # noqa: PLC0415 - only with --tz

    token = _ZONE.set(zoneinfo.ZoneInfo(zone))
    try:
        yield
    finally:
        _ZONE.reset(token)


def _utc(stamp: str | None) -> dt.datetime | str:
    """An ISO 8601 timestamp in UTC (or --tz's zone); ``-`` for none, the text if not one."""
    if not stamp:
        return "-"
    try:
        parsed = dt.datetime.fromisoformat(stamp)
    except ValueError:
        return stamp
    if parsed.tzinfo is None:
        return parsed
    return parsed.astimezone(_ZONE.get() or dt.timezone.utc)


def _suffix() -> str:
    """``Z`` in UTC; `` %Z`` (CET, CEST, EST...) in a --tz zone."""
    return "Z" if _ZONE.get() is None else " %Z"


def _when(stamp: str | None) -> str:
    """``2026-11-29 10:26:20Z`` from an ISO 8601 timestamp (``... 11:26:20 CET`` with --tz)."""
    parsed = _utc(stamp)
    if isinstance(parsed, str):
        return parsed
    return parsed.strftime("%Y-%m-%d %H:%M:%S" + _suffix())


def _short_when(stamp: str | None, year: int) -> str:
    """``11-29 10:26Z`` from an ISO 8601 timestamp of ``year``, ``2025-11-29`` otherwise."""
    parsed = _utc(stamp)
    if isinstance(parsed, str):
        return parsed
    return parsed.strftime("%m-%d %H:%M" + _suffix() if parsed.year == year else "%Y-%m-%d")


def _duration(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    return format_seconds(round(seconds, 1) if seconds < 60 else seconds)  # noqa: PLR2004 - a minute
