"""Retry storms: the same sides deadlocking again and again within moments."""

from __future__ import annotations

import datetime as dt
import re
from typing import TYPE_CHECKING

from jobrun.analysis.deadlocks.model import Storm

if TYPE_CHECKING:
    from jobrun.analysis.deadlocks.model import Deadlock

#: Two deadlocks of the same sides this close together are one attempt retrying into the
#: same cycle (a job that retries on 40P01 at once), not two nights that went wrong.
STORM_WINDOW = dt.timedelta(seconds=60)
_TIME = re.compile(r"(\d{4})-(\d\d)-(\d\d)[ T](\d\d):(\d\d):(\d\d)(?:\.(\d{1,6}))?")


def storms(deadlocks: list[Deadlock]) -> list[Storm]:
    """Runs of two or more deadlocks between the same sides, each within a minute of the last.

    The sides are the applications when every side is named, else the pids: a job that
    retries in the same session keeps its pid, one that reconnects keeps its name.
    """
    by_sides: dict[tuple[str, ...], list[tuple[dt.datetime, Deadlock]]] = {}
    for deadlock in deadlocks:
        when = moment(deadlock.time)
        if when is not None:
            by_sides.setdefault(_sides(deadlock), []).append((when, deadlock))
    found: list[Storm] = []
    for sides, timed in by_sides.items():
        timed.sort(key=lambda item: item[0])
        run: list[tuple[dt.datetime, Deadlock]] = []
        for when, deadlock in timed:
            if run and when - run[-1][0] > STORM_WINDOW:
                found.extend(_storm(sides, run))
                run = []
            run.append((when, deadlock))
        found.extend(_storm(sides, run))
    return found


def _storm(sides: tuple[str, ...], run: list[tuple[dt.datetime, Deadlock]]) -> list[Storm]:
    return [Storm(list(sides), [deadlock for _, deadlock in run])] if len(run) > 1 else []


def _sides(deadlock: Deadlock) -> tuple[str, ...]:
    if all(side.application for side in deadlock.sides):
        return tuple(sorted(str(side.application) for side in deadlock.sides))
    return tuple(sorted(f"pid {side.pid}" for side in deadlock.sides))


def moment(time: str | None) -> dt.datetime | None:
    """A log time as a naive datetime (one server logs in one zone), or None."""
    match = _TIME.search(time or "")
    if match is None:
        return None
    year, month, day, hour, minute, second = (int(part) for part in match.groups()[:6])
    micro = int((match[7] or "0").ljust(6, "0"))
    try:
        return dt.datetime(year, month, day, hour, minute, second, micro)  # noqa: DTZ001 - the log's own zone
    except ValueError:
        return None
