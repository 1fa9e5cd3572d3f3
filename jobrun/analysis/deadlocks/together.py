"""Who was there at each deadlock: sessions connected, scheduled runs running; pairs across them."""

from __future__ import annotations

import collections
import datetime as dt
import itertools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from jobrun.analysis.deadlocks.schedulers import ASSUME_DURATION, cron_runs, journal_runs
from jobrun.analysis.deadlocks.sources import open_log
from jobrun.analysis.deadlocks.storms import moment
from jobrun.escape import printable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from jobrun.analysis.deadlocks.model import Deadlock, Session
    from jobrun.analysis.deadlocks.schedulers import Run

#: Pairs shown in the report (``--json`` has them all).
PAIRS_SHOWN = 20


@dataclass
class Moment:
    """One deadlock, and what was connected and running when it happened."""

    deadlock: Deadlock
    #: Application (or ``[no application_name] user@db``) -> sessions open at that moment.
    connected: dict[str, int] = field(default_factory=dict)
    running: list[Run] = field(default_factory=list)

    @property
    def present(self) -> set[str]:
        """Everything there: the applications and the scheduled commands."""
        return set(self.connected) | {run.label for run in self.running}


@dataclass(frozen=True)
class Pair:
    """Two applications or commands, and at how many deadlocks (and nights) both were there."""

    names: tuple[str, str]
    deadlocks: int
    nights: int


@dataclass
class Together:
    """Every deadlock's moment, and the pairs that were there together across them."""

    moments: list[Moment]
    pairs: list[Pair]
    #: Whether the logs had any connection line.
    sessions_logged: bool

    def as_json(self) -> dict[str, Any]:
        """``sessions`` of ``--json``."""
        return {
            "deadlocks": [
                {
                    "source": m.deadlock.source,
                    "line": m.deadlock.line,
                    "time": m.deadlock.time,
                    "connected": m.connected,
                    "running": [
                        {
                            "command": run.label,
                            "start": run.start.isoformat(sep=" "),
                            "end": run.end.isoformat(sep=" ") if run.end else None,
                            "end_known": run.end_known,
                            "end_from": run.end_from,
                            "where": run.where,
                        }
                        for run in m.running
                    ],
                }
                for m in self.moments
            ],
            "pairs": [
                {"pair": list(p.names), "deadlocks": p.deadlocks, "nights": p.nights}
                for p in self.pairs
            ],
        }


def gather(
    deadlocks: Sequence[Deadlock], sessions: Sequence[Session], runs: Sequence[Run]
) -> Together:
    """Who was connected and what was running at each deadlock; pairs, most often first."""
    moments = []
    for deadlock in deadlocks:
        here = Moment(deadlock)
        when = moment(deadlock.time)
        if when is not None:
            labels = [s.label for s in sessions if s.open_at(when)]
            here.connected = dict(sorted(collections.Counter(labels).items()))
            here.running = [run for run in runs if run.running_at(when)]
        moments.append(here)
    together: dict[tuple[str, str], list[Moment]] = {}
    for here in moments:
        for pair in itertools.combinations(sorted(here.present), 2):
            together.setdefault(pair, []).append(here)
    pairs = [
        Pair(names, len(seen), len({str(moment(m.deadlock.time) or "")[:10] for m in seen}))
        for names, seen in together.items()
    ]
    pairs.sort(key=lambda pair: (-pair.deadlocks, -pair.nights, pair.names))
    return Together(moments, pairs, sessions_logged=bool(sessions))


def moment_lines(here: Moment, together: Together) -> list[str]:
    """The lines under a deadlock's block: who was connected, what was running."""
    out = []
    if together.sessions_logged:
        connected = ", ".join(f"{name} ({count})" for name, count in here.connected.items())
        out.append(f"  connected at that moment: {connected or 'nothing the log shows'}")
    out.extend(f"  running: {run.describe()} ({run.where})" for run in here.running)
    return [printable(line) for line in out]


def table_lines(together: Together) -> list[str]:
    """The pairs that were there together: at how many of the deadlocks, on how many nights."""
    total = len(together.moments)
    nights = len({str(moment(m.deadlock.time) or "")[:10] for m in together.moments})
    out = []
    if not together.sessions_logged:
        out.append(
            "sessions: the log has no connection lines: set log_connections = on and "
            "log_disconnections = on to see which applications were connected"
        )
    if not total:
        return out
    out.append(
        f"there together, of {total} deadlock(s) on {nights} night(s) "
        "(sessions connected, scheduled commands running):"
    )
    out.append("  DEADLOCKS  NIGHTS  PAIR")
    for pair in together.pairs[:PAIRS_SHOWN]:
        every = "  (at every deadlock)" if pair.deadlocks == total else ""
        out.append(
            f"  {f'{pair.deadlocks}/{total}':<9}  {f'{pair.nights}/{nights}':<6}  "
            f"{pair.names[0]} + {pair.names[1]}{every}"
        )
    if len(together.pairs) > PAIRS_SHOWN:
        out.append(f"  ... {len(together.pairs) - PAIRS_SHOWN} more pair(s) (--json lists all)")
    if not together.pairs:
        out.append("  (no two applications or commands were there together)")
    return [printable(line) for line in out]


@dataclass(frozen=True)
class Asked:
    """``--sessions``, and the scheduler records given (``--cron-log``, ``--journal``)."""

    cron_logs: tuple[str, ...] = ()
    journals: tuple[str, ...] = ()
    assume: dt.timedelta = ASSUME_DURATION

    @property
    def files(self) -> tuple[str, ...]:
        """Every scheduler file given."""
        return (*self.cron_logs, *self.journals)

    def runs(self, deadlocks: Sequence[Deadlock]) -> list[Run]:
        """The runs every file given records (cron's times get the deadlocks' year)."""
        when = next((moment(d.time) for d in deadlocks if moment(d.time)), None)
        year = when.year if when is not None else dt.datetime.now().year  # noqa: DTZ005 - a log's local year
        runs: list[Run] = []
        for path in self.cron_logs:
            with open_log(path, None) as (stream, _):
                runs += cron_runs(stream, path, year=year, assume=self.assume)
        for path in self.journals:
            with open_log(path, None) as (stream, _):
                runs += journal_runs(stream, path)
        return runs
