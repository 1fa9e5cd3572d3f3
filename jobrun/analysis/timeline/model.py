"""What a timeline shows: lanes of runs, the windows where lanes overlapped, deadlock moments.

Plain data, no database and no file: the command reads the run history or the logs, this
module turns them into bars, overlap windows and marks (tested without a browser), and
render.py draws them. Every time here is timezone-aware UTC.

A deadlock is tied to a run only by what the server log says of its sides: the
application name a run's sessions carry (``jobrun:<key>``), or the backend pid of a
session drawn from the log. Being busy at that moment ties nothing: a deadlock no side of
which names a run shown goes to the database lane.
"""

from __future__ import annotations

import datetime as dt
import re
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from jobrun.db.connecting import application_name

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, Sequence

    from jobrun.analysis.deadlocks.model import Deadlock, Session
    from jobrun.analysis.deadlocks.schedulers import Run

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
#: A log's time and the history's are the same server's clock, but ``%t`` logs whole
#: seconds: a side is tied to a run going within this much of the deadlock's moment.
TIE_SLACK = dt.timedelta(seconds=1)
#: On the night-by-night axis a run's end counts this long after its start at most: one
#: run left ``running`` for days must not stretch every night's hours to a sliver.
LONGEST_NIGHT_RUN = dt.timedelta(hours=6)
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
    #: The application_name its sessions carry (``jobrun:<key>`` for a run of the history).
    app: str | None = None
    #: The server's backend pid, for a bar that is one session of the server log.
    pid: int | None = None

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

    def going_at(self, when: dt.datetime, now: dt.datetime) -> bool:
        """Ran at ``when``, give or take TIE_SLACK (a skip ran nothing)."""
        return not self.skip and self.start - TIE_SLACK <= when <= self.until(now) + TIE_SLACK


@dataclass(frozen=True)
class Overlap:
    """A window where runs of two or more lanes were going at once, and which lanes."""

    start: dt.datetime
    end: dt.datetime
    lanes: tuple[str, ...]


@dataclass(frozen=True)
class Party:
    """One side of a deadlock as the log names it: backend pid, application name if any."""

    pid: int | None
    application: str | None = None

    @property
    def name(self) -> str:
        """The application name, else ``pid N``."""
        return self.application or f"pid {self.pid}"


@dataclass(frozen=True)
class Tie:
    """A run the log ties to a deadlock, and by what (``application_name jobrun:x``...)."""

    bar: Bar
    by: str
    #: The side of the deadlock that is this run.
    party: Party | None = None


@dataclass(frozen=True)
class Mark:
    """A deadlock's moment in a server log, who its sides were, and the runs they tie to."""

    at: dt.datetime
    where: str
    sides: tuple[str, ...]
    parties: tuple[Party, ...] = ()
    #: Filled by ``build``: the runs shown that a side of the deadlock was (none: the
    #: deadlock goes to the database lane).
    ties: tuple[Tie, ...] = ()

    @property
    def tied(self) -> bool:
        """Some run shown is tied to it."""
        return bool(self.ties)


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

    @property
    def database_lane(self) -> bool:
        """Whether the database has a lane: for deadlocks tied to no run, or counted in runs.

        A run's history counts the database's deadlocks (any session's) while it ran: that
        count is the database's, drawn on its lane, not a mark on the run.
        """
        return any(not mark.tied for mark in self.marks) or any(
            bar.deadlocks for bar in self.bars if not bar.skip
        )


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
        marks=sorted(tie(marks, bars, now), key=lambda mark: mark.at),
        start=start,
        end=end,
        now=now,
        notes=notes,
    )


def _busy(bars: Iterable[Bar]) -> set[str]:
    return {bar.lane for bar in bars}


def tie(marks: Iterable[Mark], bars: Sequence[Bar], now: dt.datetime) -> list[Mark]:
    """Each mark with the runs its sides were, by what the log says of each side.

    A session from the server log is tied by its backend pid; a run of the history (or any
    bar whose sessions carry a known application_name) by that name. Both only while the
    bar was going: pids and names are reused.
    """
    tied = []
    for mark in marks:
        ties: dict[Bar, tuple[str, Party]] = {}
        for party in mark.parties:
            for bar in bars:
                if bar in ties or not bar.going_at(mark.at, now):
                    continue
                if bar.pid is not None:
                    # A session bar is that one session: its pid, not its name, says so.
                    if bar.pid == party.pid:
                        ties[bar] = (f"backend pid {party.pid}", party)
                elif bar.app is not None and bar.app == party.application:
                    ties[bar] = (f"application_name {party.application}", party)
        tied.append(
            replace(mark, ties=tuple(Tie(bar, by, party) for bar, (by, party) in ties.items()))
        )
    return tied


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
            # What jobrun names the child's sessions (PGAPPNAME) and its own.
            app=application_name(str(row["key"])),
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
    pid: int | None = None,
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
        pid=pid,
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
            pid=session.pid,
        )
        for session in sessions
    ]


def deadlock_marks(deadlocks: Iterable[Deadlock]) -> list[Mark]:
    """A mark per deadlock whose time the log gives."""
    from jobrun.analysis.deadlocks.storms import moment  # noqa: PLC0415 - only with --log

    marks = []
    for deadlock in deadlocks:
        when = moment(deadlock.time)
        if when is None:
            continue
        parties = tuple(Party(side.pid, side.application) for side in deadlock.sides)
        marks.append(
            Mark(
                log_time(deadlock.time or "", when),
                f"{deadlock.source} line {deadlock.line}",
                tuple(party.name for party in parties),
                parties,
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
    to the day it opened; a mark to the day of the run it is tied to (so that it sits on
    that run past midnight), or its own day. Days with nothing on them are left out.
    Every night has every lane, in the timeline's order, busy or not: a key keeps its
    place from one night to the next.
    """
    days: dict[dt.date, Night] = {}

    def night(when: dt.datetime) -> Night:
        day = when.date()
        return days.setdefault(day, Night(day, list(timeline.lanes), [], [], []))

    for bar in timeline.bars:
        night(bar.start).bars.append(bar)
    for window in timeline.overlaps:
        night(window.start).overlaps.append(window)
    for mark in timeline.marks:
        night(mark.ties[0].bar.start if mark.ties else mark.at).marks.append(mark)
    return [days[day] for day in sorted(days)]


def night_end(bar: Bar, now: dt.datetime) -> dt.datetime:
    """Where a bar ends on the night-by-night axis: LONGEST_NIGHT_RUN after its start at most."""
    return min(bar.until(now), bar.start + LONGEST_NIGHT_RUN)


def hours_shown(found: Sequence[Night], now: dt.datetime) -> tuple[float, float]:
    """The seconds after midnight the nights' axis runs from and to (everything on it).

    A run longer than LONGEST_NIGHT_RUN counts only that far: it is drawn cut at the edge.
    """
    offsets = [
        (moment - one.midnight).total_seconds()
        for one in found
        for moment in [
            *(bar.start for bar in one.bars),
            *(night_end(bar, now) for bar in one.bars),
            *(mark.at for mark in one.marks),
        ]
    ]
    low, high = min(offsets, default=0.0), max(offsets, default=86400.0)
    margin = max((high - low) * 0.03, 60.0)
    return max(low - margin, 0.0), high + margin
