"""What a timeline shows: lanes of runs, the windows where lanes overlapped, deadlock moments.

Plain data, no database and no file: the command reads the run history or the logs, this
module turns them into bars, overlap windows and marks (tested without a browser), and
render.py draws them. Every time here is timezone-aware UTC.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from jobrun.deadlocks.model import Deadlock
    from jobrun.deadlocks.schedulers import Run
    from jobrun.deadlocks.sessions import Session

#: The outcomes a bar is coloured by; anything else is drawn as ``other``.
OUTCOMES = (
    "succeeded",
    "failed",
    "timed_out",
    "lock_lost",
    "stopped",
    "abandoned",
    "running",
    "exec_failed",
)
SKIPPED = "skipped"
#: A bar from a scheduler's or the server's log: its outcome is not known.
LOGGED = "logged"
UTC = dt.timezone.utc
#: A log time's zone as the server writes it after the time: ``UTC``, ``Z``, ``+01``, ``-0530``.
_ZONE = re.compile(
    r"\d\d:\d\d(?:\.\d+)?\s*(?:(?P<utc>UTC|GMT|Z)|(?P<offset>[+-]\d\d(?::?\d\d)?))\b"
)


@dataclass(frozen=True)
class Bar:
    """One run in a lane: from start to end (None: still running at ``now``), and its outcome."""

    lane: str
    start: dt.datetime
    end: dt.datetime | None
    outcome: str
    run_id: str | None = None
    host: str | None = None
    exit_code: int | None = None
    #: Deadlocks in the database while the run ran (the history's ``deadlocks`` column).
    deadlocks: int | None = None
    #: Where a bar from a log was read (``file line N``), and how its end is known.
    where: str | None = None
    end_from: str | None = None

    @property
    def skip(self) -> bool:
        """A skip: nothing ran, drawn as a tick at its moment."""
        return self.outcome == SKIPPED

    def until(self, now: dt.datetime) -> dt.datetime:
        """The bar's end as drawn: a run still going ends at ``now``."""
        return self.end if self.end is not None else max(now, self.start)

    def duration(self, now: dt.datetime) -> float:
        """Seconds from start to end (to ``now`` while running)."""
        return (self.until(now) - self.start).total_seconds()


@dataclass(frozen=True)
class Overlap:
    """A window where runs of two or more lanes were going at once, and which lanes."""

    start: dt.datetime
    end: dt.datetime
    lanes: tuple[str, ...]


@dataclass(frozen=True)
class Mark:
    """A deadlock's moment in a server log, and who its sides were."""

    at: dt.datetime
    where: str
    sides: tuple[str, ...]


@dataclass
class Timeline:
    """Everything drawn: lanes in order, their bars, the overlaps, the marks, the time span."""

    lanes: list[str]
    bars: list[Bar]
    overlaps: list[Overlap]
    marks: list[Mark]
    start: dt.datetime
    end: dt.datetime
    now: dt.datetime
    #: Things worth saying under the picture (a lane with no runs, rows left out...).
    notes: list[str] = field(default_factory=list)


def overlaps(bars: Iterable[Bar], now: dt.datetime) -> list[Overlap]:
    """The windows where runs of two or more different lanes were going at once.

    A sweep over every start and end: a window opens when a second lane becomes busy and
    closes when fewer than two are; a change in which lanes are busy starts a new window,
    so each window names exactly the lanes that overlapped in it. Skips never ran.
    """
    events: list[tuple[dt.datetime, int, str]] = []
    for bar in bars:
        if bar.skip or bar.until(now) <= bar.start:
            continue
        events.extend(((bar.start, 1, bar.lane), (bar.until(now), 0, bar.lane)))
    events.sort()
    busy: dict[str, int] = {}
    found: list[Overlap] = []
    opened: tuple[dt.datetime, tuple[str, ...]] | None = None
    index = 0
    while index < len(events):
        # Every start and end at one instant is applied before the busy lanes are looked
        # at: a run ending the moment another starts did not overlap it.
        when = events[index][0]
        while index < len(events) and events[index][0] == when:
            _, starts, lane = events[index]
            busy[lane] = busy.get(lane, 0) + (1 if starts else -1)
            index += 1
        lanes = tuple(sorted(lane for lane, count in busy.items() if count > 0))
        if opened is not None and opened[1] != lanes:
            found.append(Overlap(opened[0], when, opened[1]))
            opened = None
        if opened is None and len(lanes) >= 2:  # noqa: PLR2004 - two lanes make an overlap
            opened = (when, lanes)
    return found


def build(
    lanes: Sequence[str],
    bars: Sequence[Bar],
    marks: Sequence[Mark],
    *,
    now: dt.datetime,
    since: float | None = None,
) -> Timeline:
    """The timeline of ``bars`` and ``marks``, lanes in the order given (then any others).

    ``since``: only what was going in the last that many seconds before ``now``.
    """
    order = list(dict.fromkeys([*lanes, *(bar.lane for bar in bars)]))
    if since is not None:
        edge = now - dt.timedelta(seconds=since)
        bars = [bar for bar in bars if bar.until(now) >= edge]
        marks = [mark for mark in marks if mark.at >= edge]
    times = [bar.start for bar in bars] + [bar.until(now) for bar in bars]
    times += [mark.at for mark in marks]
    # The picture starts at the first thing shown, not at the window's edge: a month of
    # history with one night's runs is drawn as that night.
    start = min(times, default=now - dt.timedelta(seconds=since or 60))
    end = max([now if any(bar.end is None for bar in bars) else start, *times])
    if end <= start:
        end = start + dt.timedelta(minutes=1)
    notes = [f"{lane}: no runs in this window" for lane in order if lane not in _busy(bars)]
    return Timeline(
        lanes=order,
        bars=sorted(bars, key=lambda bar: (bar.start, bar.lane)),
        overlaps=overlaps(bars, now),
        marks=sorted(marks, key=lambda mark: mark.at),
        start=start,
        end=end,
        now=now,
        notes=notes,
    )


def _busy(bars: Iterable[Bar]) -> set[str]:
    return {bar.lane for bar in bars}


def history_bars(rows: Iterable[Mapping[str, Any]]) -> list[Bar]:
    """Bars from rows of jobrun.runs (``key``, ``started_at``, ``finished_at``, ``outcome``...)."""
    return [
        Bar(
            lane=str(row["key"]),
            start=_utc(row["started_at"]),
            end=_utc(row["finished_at"]) if row["finished_at"] is not None else None,
            outcome=str(row["outcome"]),
            run_id=str(row["run_id"]),
            host=row["host"],
            exit_code=row["exit_code"],
            deadlocks=row["deadlocks"],
        )
        for row in rows
    ]


def _logged(
    lane: str,
    start: dt.datetime,
    end: dt.datetime | None,
    *,
    where: str,
    end_from: str | None,
    host: str | None = None,
) -> Bar:
    """A bar read from a log (outcome LOGGED), its times in UTC; ``end`` None: no end seen."""
    return Bar(
        lane=lane,
        start=_utc(start),
        end=_utc(end) if end is not None else None,
        outcome=LOGGED,
        host=host,
        where=where,
        end_from=end_from,
    )


def scheduled_bars(runs: Iterable[Run]) -> list[Bar]:
    """Bars from cron's or systemd's records: one lane per command or unit."""
    return [
        _logged(run.label, run.start, run.end, where=run.where, end_from=run.end_from)
        for run in runs
    ]


def session_bars(sessions: Iterable[Session], *, until: dt.datetime | None = None) -> list[Bar]:
    """Bars from the server log's sessions: one lane per application (or user@database).

    A session the log never saw end is drawn until ``until`` (the log's last moment).
    """
    return [
        _logged(
            session.label,
            session.start,
            session.end or until,
            host=session.host,
            end_from="logged" if session.end is not None else "end of log",
            where=f"pid {session.pid}",
        )
        for session in sessions
    ]


def deadlock_marks(deadlocks: Iterable[Deadlock]) -> list[Mark]:
    """A mark per deadlock whose time the log gives."""
    from jobrun.deadlocks.storms import moment  # noqa: PLC0415 - only with --log

    marks = []
    for deadlock in deadlocks:
        when = moment(deadlock.time)
        if when is None:
            continue
        sides = tuple(side.application or f"pid {side.pid}" for side in deadlock.sides)
        marks.append(
            Mark(
                log_time(deadlock.time or "", when),
                f"{deadlock.source} line {deadlock.line}",
                sides,
            )
        )
    return marks


def log_time(text: str, naive: dt.datetime) -> dt.datetime:
    """A log's naive time in UTC, by the zone written after it (none written: taken as UTC)."""
    zone = _ZONE.search(text)
    if zone is None or zone["utc"]:
        return naive.replace(tzinfo=UTC)
    sign = -1 if zone["offset"][0] == "-" else 1
    digits = zone["offset"][1:].replace(":", "")
    offset = dt.timedelta(hours=int(digits[:2]), minutes=int(digits[2:] or 0))
    return (naive - sign * offset).replace(tzinfo=UTC)


def _utc(when: dt.datetime) -> dt.datetime:
    """An aware time in UTC; a naive one (a log's) taken as UTC."""
    return when.astimezone(UTC) if when.tzinfo is not None else when.replace(tzinfo=UTC)


@dataclass
class Night:
    """One day's runs (by the UTC day they started on), to be drawn over one time-of-day axis."""

    day: dt.date
    lanes: list[str]
    bars: list[Bar]
    overlaps: list[Overlap]
    marks: list[Mark]

    @property
    def midnight(self) -> dt.datetime:
        """The start of the day, that times of day are counted from."""
        return dt.datetime.combine(self.day, dt.time(), tzinfo=UTC)


def nights(timeline: Timeline) -> list[Night]:
    """The timeline cut into days: the same hours of each night one above another.

    A run belongs to the day it started (one past midnight stays whole); an overlap window
    to the day it opened; a mark to its own day. Days with nothing on them are left out.
    """
    days: dict[dt.date, Night] = {}

    def night(when: dt.datetime) -> Night:
        day = when.date()
        return days.setdefault(day, Night(day, [], [], [], []))

    for bar in timeline.bars:
        night(bar.start).bars.append(bar)
    for window in timeline.overlaps:
        night(window.start).overlaps.append(window)
    for mark in timeline.marks:
        night(mark.at).marks.append(mark)
    for one in days.values():
        busy = {bar.lane for bar in one.bars}
        one.lanes = [lane for lane in timeline.lanes if lane in busy]
    return [days[day] for day in sorted(days)]


def hours_shown(found: Sequence[Night], now: dt.datetime) -> tuple[float, float]:
    """The seconds after midnight the nights' axis runs from and to (everything on it)."""
    offsets = [
        (moment - one.midnight).total_seconds()
        for one in found
        for moment in [
            *(bar.start for bar in one.bars),
            *(bar.until(now) for bar in one.bars),
            *(mark.at for mark in one.marks),
        ]
    ]
    low, high = min(offsets, default=0.0), max(offsets, default=86400.0)
    margin = max((high - low) * 0.03, 60.0)
    return max(low - margin, 0.0), high + margin
