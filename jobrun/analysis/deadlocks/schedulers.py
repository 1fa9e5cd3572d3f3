"""Scheduled runs from the scheduler's own records: cron lines in syslog, systemd's journal."""

from __future__ import annotations

import datetime as dt
import json
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

#: How long a run whose end the scheduler does not log (Debian's cron) is taken to last,
#: unless the same command starts again sooner.
ASSUME_DURATION = dt.timedelta(hours=1)
_MONTHS = {
    name: number
    for number, name in enumerate(
        ("Jan", "Feb", "Mar", "Apr", "May", "Jun", "Jul", "Aug", "Sep", "Oct", "Nov", "Dec"),
        start=1,
    )
}
#: ``Dec  1 02:00:01 host CRON[4120]: (root) CMD (jobrun --key x -- ./x.py)`` (Debian and
#: Ubuntu cron, in /var/log/syslog or ``journalctl`` text), cronie's ``CROND[4120]`` with
#: its ``CMDEND`` line when the command ends; or an RFC 3339 time (rsyslog's high precision
#: format, ``journalctl -o short-iso``).
_CRON = re.compile(
    r"(?:(?P<mon>[A-Z][a-z]{2}) +(?P<day>\d{1,2}) (?P<clock>\d\d:\d\d:\d\d)"
    r"|(?P<iso>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?)(?:Z|[+-]\d\d:?\d\d)?) "
    r"\S+ (?i:crond?)\[(?P<pid>\d+)\]: \((?P<user>[^)]*)\) "
    r"(?P<what>CMD|CMDEND) \((?P<cmd>.*)\)\s*\Z"
)
#: systemd's messages about a unit: when its run starts, and when it is over.
_UNIT_STARTS = ("Starting ", "Started ")
_UNIT_ENDS = ("Deactivated successfully", "Failed with result", "Finished ", "Failed to start")


@dataclass
class Run:
    """One run of a scheduled command: what, from when, to when (if the scheduler said)."""

    label: str
    start: dt.datetime
    end: dt.datetime | None
    #: Where the run's start was read: ``file line N``.
    where: str
    #: Where the end comes from: ``logged``; ``assumed`` (cron's runs of unknown end, see
    #: ASSUME_DURATION); ``last line`` (a unit's own last line in the journal).
    end_from: str = "logged"

    @property
    def end_known(self) -> bool:
        """Whether the scheduler logged the end."""
        return self.end_from == "logged"

    def running_at(self, when: dt.datetime) -> bool:
        """Running at ``when`` (a run with no end yet: from its start on)."""
        return self.start <= when and (self.end is None or when <= self.end)

    def describe(self) -> str:
        """``cron (root) ./x.py, started 02:00:01, ended 02:00:05`` (or end unknown)."""
        if self.end is None:
            end = "no end logged"
        elif self.end_from == "assumed":
            end = f"end unknown (taken as up to {self.end:%H:%M:%S})"
        elif self.end_from == "last line":
            end = f"end unknown (its last line at {self.end:%H:%M:%S})"
        else:
            end = f"ended {self.end:%H:%M:%S}"
        return f"{self.label}, started {self.start:%H:%M:%S}, {end}"


def cron_runs(
    stream: Iterable[str], source: str, *, year: int, assume: dt.timedelta = ASSUME_DURATION
) -> list[Run]:
    """Runs from cron's lines; other lines (other daemons in a syslog) are skipped.

    A cronie ``CMDEND`` ends the run of the same pid; Debian's cron logs no end, so a run
    is taken to last ``assume``, or until the same command starts again if sooner.
    """
    runs: list[Run] = []
    open_: dict[tuple[str, str, str], Run] = {}
    for number, line in enumerate(stream, start=1):
        match = _CRON.match(line.rstrip("\r\n"))
        if match is None:
            continue
        when = _cron_time(match, year)
        if when is None:
            continue
        key = (match["pid"], match["user"], match["cmd"])
        if match["what"] == "CMDEND":
            run = open_.pop(key, None)
            if run is not None:
                run.end, run.end_from = when, "logged"
            continue
        run = Run(
            f"cron ({match['user']}) {match['cmd']}",
            when,
            when + assume,
            f"{source} line {number}",
            end_from="assumed",
        )
        open_[key] = run
        runs.append(run)
    _cap_at_next_start(runs)
    return runs


def journal_runs(stream: Iterable[str], source: str) -> list[Run]:
    """Runs of .service units from ``journalctl -o json`` (one JSON object per line).

    A run goes from systemd's ``Starting``/``Started`` message about the unit (``UNIT`` or
    ``USER_UNIT``) to its ``Deactivated``/``Finished``/``Failed`` one. A unit whose own
    lines (``_SYSTEMD_UNIT``) are there without any of systemd's messages about it (a
    journal filtered by ``_SYSTEMD_UNIT=``) gets one run per invocation, from its first
    line to its last: the real end is unknown.
    """
    runs: list[Run] = []
    open_: dict[str, Run] = {}
    told: set[str] = set()
    #: (unit, invocation id) -> the run its own lines span.
    spans: dict[tuple[str, str], Run] = {}
    for number, line in enumerate(stream, start=1):
        record = _record(line)
        if record is None:
            continue
        when, message = record
        unit = message.get("UNIT") or message.get("USER_UNIT")
        text = message.get("MESSAGE")
        if isinstance(unit, str) and unit.endswith(".service") and isinstance(text, str):
            told.add(unit)
            text = text.removeprefix(f"{unit}: ")
            if text.startswith(_UNIT_STARTS) and unit not in open_:
                open_[unit] = Run(f"systemd {unit}", when, None, f"{source} line {number}")
                runs.append(open_[unit])
            elif text.startswith(_UNIT_ENDS) and unit in open_:
                open_.pop(unit).end = when
            continue
        own = message.get("_SYSTEMD_UNIT") or message.get("_SYSTEMD_USER_UNIT")
        if isinstance(own, str) and own.endswith(".service"):
            invocation = str(message.get("_SYSTEMD_INVOCATION_ID") or "")
            span = spans.get((own, invocation))
            if span is None:
                where = f"{source} line {number}"
                spans[own, invocation] = Run(
                    f"systemd {own}", when, when, where, end_from="last line"
                )
            else:
                span.end = max(span.end or when, when)
    runs += [run for (unit, _), run in spans.items() if unit not in told]
    return sorted(runs, key=lambda run: run.start)


def _record(line: str) -> tuple[dt.datetime, dict[str, object]] | None:
    """A journal record and its time (UTC, naive), or None for a line that is not one."""
    try:
        record = json.loads(line)
        stamp = int(str(record["__REALTIME_TIMESTAMP"]))
    except (ValueError, KeyError, TypeError, RecursionError):  # RecursionError: nested deep
        return None
    if not isinstance(record, dict):
        return None
    when = dt.datetime.fromtimestamp(stamp / 1_000_000, dt.timezone.utc)
    return when.replace(tzinfo=None), record  # compared with logs written in UTC


def _cron_time(match: re.Match[str], year: int) -> dt.datetime | None:
    try:
        if match["iso"]:
            return dt.datetime.fromisoformat(match["iso"])
        hour, minute, second = (int(part) for part in match["clock"].split(":"))
        return dt.datetime(year, _MONTHS[match["mon"]], int(match["day"]), hour, minute, second)  # noqa: DTZ001 - syslog's local time
    except (KeyError, ValueError):
        return None


def _cap_at_next_start(runs: Iterable[Run]) -> None:
    """A run of unknown end is over, at the latest, when the same command starts again."""
    latest: dict[str, Run] = {}
    for run in sorted(runs, key=lambda run: run.start):
        earlier = latest.get(run.label)
        if (
            earlier is not None
            and not earlier.end_known
            and earlier.end
            and earlier.end > run.start
        ):
            earlier.end = run.start
        latest[run.label] = run
