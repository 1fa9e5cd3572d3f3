"""Draw a timeline as one self-contained SVG or HTML file: inline styles and script, no network.

Every text that came from the database or a log (keys, hosts, commands, run ids) goes
through ``_text``: control characters made visible, then HTML-escaped, in element text and
in attribute values alike, so a key named ``<script>`` is shown, never run. Ids of elements
are counters, never data. Elements carry classes and ``data-`` attributes (``lane``,
``run``, ``skip``, ``overlap``, ``run-deadlocks``, ``deadlock-mark``) that tests and
scripts can find.
"""

from __future__ import annotations

import datetime as dt
import html
import json
from typing import TYPE_CHECKING

from jobrun.durations import format_seconds
from jobrun.escape import printable
from jobrun.timeline import model
from jobrun.timeline.model import LOGGED, OUTCOMES, SKIPPED

if TYPE_CHECKING:
    from collections.abc import Iterable

    from jobrun.timeline.model import Bar, Mark, Overlap, Timeline

WIDTH = 1200
LABELS = 260
RIGHT = 20
TOP = 40
LANE = 30
BAR = 18
LEGEND = 56
NIGHT_GAP = 10
DAY = 86400
#: A run shorter than a pixel is still drawn this wide, so that no run is invisible.
MIN_BAR = 2.0
_COLOURS = {
    "succeeded": "#2e7d32",
    "failed": "#c62828",
    "timed_out": "#ef6c00",
    "lock_lost": "#6a1b9a",
    "stopped": "#455a64",
    "abandoned": "#8d6e63",
    "running": "#1565c0",
    "exec_failed": "#ad1457",
    LOGGED: "#607d8b",
    "other": "#9e9e9e",
}
#: Axis steps to choose from (seconds): the smallest that leaves at most a dozen ticks.
_STEPS = (60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 2 * 86400, 7 * 86400)
_MAX_TICKS = 12

_STYLE = """
svg.timeline { font: 12px sans-serif; background: #fff; }
svg.timeline .lane-bg { fill: #f5f5f5; }
svg.timeline .lane-label { fill: #212121; }
svg.timeline .axis line { stroke: #bdbdbd; }
svg.timeline .axis text { fill: #616161; font-size: 11px; }
svg.timeline .overlap { fill: #ffc107; fill-opacity: 0.28; stroke: #ffa000; stroke-opacity: 0.6; }
svg.timeline .skip { stroke: #212121; stroke-width: 2; }
svg.timeline .run-deadlocks path { fill: #d50000; stroke: #fff; stroke-width: 1; }
svg.timeline .run-deadlocks text { fill: #d50000; font-size: 10px; font-weight: bold; }
svg.timeline .deadlock-mark { stroke: #d50000; stroke-width: 1.5; stroke-dasharray: 4 3; }
svg.timeline .run:hover, svg.timeline .deadlock-mark:hover { stroke: #000; stroke-width: 2; }
"""
_STYLE += "".join(
    f"svg.timeline .outcome-{name} {{ fill: {colour}; }}\n" for name, colour in _COLOURS.items()
)

_PAGE_STYLE = """
body { font: 14px sans-serif; margin: 16px; color: #212121; }
#tip { position: absolute; white-space: pre; background: #212121; color: #fff; padding: 6px 8px;
       border-radius: 4px; font: 12px monospace; pointer-events: none; }
.notes { color: #616161; }
"""

#: Hover: the element's ``data-tip`` shown as text (textContent: never parsed as HTML).
_SCRIPT = """
(function () {
  var tip = document.getElementById("tip");
  var svg = document.getElementById("timeline");
  document.addEventListener("mousemove", function (event) {
    var target = event.target.closest ? event.target.closest("[data-tip]") : null;
    if (!target) { tip.hidden = true; return; }
    tip.textContent = target.getAttribute("data-tip");
    tip.style.left = (event.pageX + 14) + "px";
    tip.style.top = (event.pageY + 14) + "px";
    tip.hidden = false;
  });
  document.body.setAttribute("data-runs", String(svg.querySelectorAll(".run").length));
  document.body.setAttribute("data-ready", "true");
})();
"""


def _text(value: object) -> str:
    """Text from the database or a log, safe in element text and in a quoted attribute."""
    return html.escape(printable(value), quote=True)


def _tip(lines: list[str]) -> str:
    """A hover text: each line made safe on its own, joined by newlines (``&#10;``)."""
    return "&#10;".join(_text(line) for line in lines)


def _when(moment: dt.datetime) -> str:
    return moment.strftime("%Y-%m-%d %H:%M:%S UTC")


class _Scale:
    """Time to x, over the plot area: ``start`` at its left edge, ``span`` seconds across."""

    def __init__(self, start: dt.datetime, span: float) -> None:
        self.start = start
        self.span = span
        self.width = WIDTH - LABELS - RIGHT

    def x(self, moment: dt.datetime) -> float:
        share = (moment - self.start).total_seconds() / self.span
        return LABELS + min(max(share, 0.0), 1.0) * self.width


def _lane_opened(attributes: str, lane: str, label: str, y: float) -> str:
    """A lane's ``<g>`` opened at ``y``: its background and ``label`` (the whole name on hover).

    ``label`` is already escaped; the caller closes the group after the lane's bars.
    """
    return (
        f'<g {attributes} data-lane="{_text(lane)}">'
        f'<rect class="lane-bg" x="0" y="{y + 2}" width="{WIDTH}" height="{LANE - 4}"/>'
        f'<text class="lane-label" x="6" y="{y + LANE / 2 + 4}">'
        f"{label}<title>{_text(lane)}</title></text>"
    )


def _over_lanes(
    overlaps: Iterable[Overlap],
    marks: Iterable[Mark],
    prefix: str,
    scale: _Scale,
    span: tuple[float, float],
    *,
    inset: tuple[float, float] = (0, 0),
) -> list[str]:
    """Overlap windows and deadlock marks across lanes from ``span``'s top to its bottom.

    The marks are drawn ``inset`` in from the top and from the bottom.
    """
    top, bottom = span
    return [
        *(
            _overlap(window, f"{prefix}overlap-{number}", scale, top, bottom)
            for number, window in enumerate(overlaps)
        ),
        *(
            _mark(mark, f"{prefix}deadlock-{number}", scale, top + inset[0], bottom - inset[1])
            for number, mark in enumerate(marks)
        ),
    ]


def svg(timeline: Timeline) -> str:
    """The timeline as an ``<svg>`` element (valid on its own and inside HTML)."""
    scale = _Scale(timeline.start, (timeline.end - timeline.start).total_seconds())
    height = TOP + LANE * max(len(timeline.lanes), 1) + LEGEND
    lane_of = {lane: index for index, lane in enumerate(timeline.lanes)}
    parts = [
        (
            f'<svg id="timeline" class="timeline" xmlns="http://www.w3.org/2000/svg" '
            f'width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
            f'data-lanes="{len(timeline.lanes)}" data-start="{_when(timeline.start)}" '
            f'data-end="{_when(timeline.end)}">'
        ),
        f"<style>{_STYLE}</style>",
        *_axis(scale, height - LEGEND, "%m-%d %H:%M" if scale.span > DAY else "%H:%M"),
    ]
    for index, lane in enumerate(timeline.lanes):
        y = TOP + index * LANE
        parts.append(_lane_opened(f'class="lane" id="lane-{index}"', lane, _text(_short(lane)), y))
        parts += [
            _bar(bar, f"run-{number}", scale, timeline.now, y)
            for number, bar in enumerate(timeline.bars)
            if lane_of.get(bar.lane) == index
        ]
        parts.append("</g>")
    bottom = TOP + LANE * max(len(timeline.lanes), 1)
    parts += _over_lanes(timeline.overlaps, timeline.marks, "", scale, (TOP, bottom))
    parts += _legend(height - LEGEND + 18)
    parts.append("</svg>")
    return "\n".join(parts)


def nights_svg(timeline: Timeline) -> str:
    """The same hours of each night one above another (empty when all is on one day).

    Each night is a group of rows, one per lane busy that night, over one time-of-day axis:
    "the deadlocks are the nights refunds ran past 02:10" is seen at a glance.
    """
    found = model.nights(timeline)
    if len(found) < 2:  # noqa: PLR2004 - one night is the main picture already
        return ""
    low, high = model.hours_shown(found, timeline.now)
    rows = sum(len(one.lanes) or 1 for one in found)
    height = TOP + rows * LANE + NIGHT_GAP * len(found) + 10
    parts = [
        (
            f'<svg id="nights" class="timeline nights" xmlns="http://www.w3.org/2000/svg" '
            f'width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
            f'data-nights="{len(found)}">'
        ),
        f"<style>{_STYLE}</style>",
    ]
    reference = found[0].midnight
    parts += _axis(_Scale(reference + dt.timedelta(seconds=low), high - low), height - 10, "%H:%M")
    y = float(TOP)
    for night_number, one in enumerate(found):
        scale = _Scale(one.midnight + dt.timedelta(seconds=low), high - low)
        top, prefix = y, f"night{night_number}-"
        parts.append(
            f'<g class="night" id="night-{night_number}" data-day="{one.day.isoformat()}">'
        )
        for lane in one.lanes:
            label = f"{one.day:%m-%d} {_text(_short(lane, 30))}"
            parts.append(_lane_opened('class="night-lane"', lane, label, y))
            parts += [
                _bar(bar, f"{prefix}run-{number}", scale, timeline.now, y)
                for number, bar in enumerate(one.bars)
                if bar.lane == lane
            ]
            parts.append("</g>")
            y += LANE
        parts += _over_lanes(one.overlaps, one.marks, prefix, scale, (top, y), inset=(6, 4))
        parts.append("</g>")
        y += NIGHT_GAP
    parts.append("</svg>")
    return "\n".join(parts)


def page(timeline: Timeline, title: str) -> str:
    """The timeline as one HTML page: the SVG, a summary, notes, and the hover script."""
    shown = f"{_when(timeline.start)} to {_when(timeline.end)}: {summary(timeline)}"
    notes = "".join(f"<li>{_text(note)}</li>" for note in timeline.notes)
    nights = nights_svg(timeline)
    if nights:
        nights = f"<h2>Night by night (the same hours of each day, UTC)</h2>\n{nights}"
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_text(title)}</title><style>{_PAGE_STYLE}</style></head>\n"
        f"<body><h1>{_text(title)}</h1>\n"
        f'<p id="summary">{_text(shown)}</p>\n'
        f"{svg(timeline)}\n"
        f"{nights}\n"
        f'<ul class="notes">{notes}</ul>\n'
        '<div id="tip" hidden></div>\n'
        f"<script>{_SCRIPT}</script>\n"
        "</body></html>\n"
    )


def summary(timeline: Timeline) -> str:
    """``2 lane(s), 3 run(s), 0 skip(s), 1 overlap window(s), ...``: what the picture shows."""
    runs = [bar for bar in timeline.bars if not bar.skip]
    return (
        f"{len(timeline.lanes)} lane(s), {len(runs)} run(s), "
        f"{len(timeline.bars) - len(runs)} skip(s), {len(timeline.overlaps)} overlap window(s), "
        f"{sum(bar.deadlocks or 0 for bar in runs)} deadlock(s) counted during runs, "
        f"{len(timeline.marks)} deadlock(s) in the server log"
    )


def _short(lane: str, room: int = 38) -> str:
    """A lane's name cut in the middle to fit the label column (whole in its hover text).

    The middle goes: a cron lane's start (``cron (app) jobrun --key``) is the same in every
    lane, its end (the job) tells them apart.
    """
    if len(lane) <= room:
        return lane
    head = room // 3
    return lane[:head] + "\N{HORIZONTAL ELLIPSIS}" + lane[len(lane) - (room - head - 1) :]


def _bar(bar: Bar, ident: str, scale: _Scale, now: dt.datetime, lane_y: float) -> str:
    x = scale.x(bar.start)
    if bar.skip:
        tip = _tip([f"skipped: {bar.lane}", f"host {bar.host or '?'}", _when(bar.start)])
        skip = ident.replace("run-", "skip-")
        return (
            f'<line class="skip" id="{skip}" data-run-id="{_text(bar.run_id or "")}" '
            f'data-host="{_text(bar.host or "")}" x1="{x:.1f}" x2="{x:.1f}" '
            f'y1="{lane_y + 3}" y2="{lane_y + LANE - 3}" data-tip="{tip}">'
            f"<title>{tip}</title></line>"
        )
    width = max(scale.x(bar.until(now)) - x, MIN_BAR)
    outcome = bar.outcome if bar.outcome in _COLOURS else "other"
    tip = _tip(_bar_lines(bar, now))
    y = lane_y + (LANE - BAR) / 2
    drawn = [
        (
            f'<rect class="run outcome-{outcome}" id="{ident}" '
            f'data-run-id="{_text(bar.run_id or "")}" data-outcome="{_text(bar.outcome)}" '
            f'data-host="{_text(bar.host or "")}" '
            f'data-exit-code="{"" if bar.exit_code is None else bar.exit_code}" '
            f'data-duration="{bar.duration(now):.3f}" data-deadlocks="{bar.deadlocks or 0}" '
            f'x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{BAR}" data-tip="{tip}">'
            f"<title>{tip}</title></rect>"
        )
    ]
    if bar.deadlocks:
        cx, cy = x + width / 2, y - 1
        drawn.append(
            f'<g class="run-deadlocks" data-run="{ident}" data-count="{bar.deadlocks}" '
            f'data-tip="{tip}"><path d="M{cx:.1f} {cy - 6:.1f} l5 6 l-5 6 l-5 -6 z"/>'
            f'<text x="{cx + 6:.1f}" y="{cy:.1f}">{bar.deadlocks}</text>'
            f"<title>{tip}</title></g>"
        )
    return "".join(drawn)


def _bar_lines(bar: Bar, now: dt.datetime) -> list[str]:
    """The hover text of a run: run id, host, exit code, duration, outcome, deadlocks."""
    ended = f"ended {_when(bar.end)}" if bar.end is not None else f"still running at {_when(now)}"
    if bar.end_from not in {None, "logged"}:
        ended += f" (end not logged: {bar.end_from})"
    lines = [bar.lane]
    if bar.run_id is not None:
        lines.append(f"run {bar.run_id}")
    lines += [
        f"host {bar.host or '?'}",
        f"outcome {bar.outcome}"
        + ("" if bar.exit_code is None else f", exit code {bar.exit_code}"),
        f"duration {format_seconds(round(bar.duration(now), 1))}",
        f"started {_when(bar.start)}, {ended}",
    ]
    if bar.deadlocks is not None:
        lines.append(f"deadlocks in the database while it ran: {bar.deadlocks}")
    if bar.where is not None:
        lines.append(f"from {bar.where}")
    return lines


def _overlap(window: Overlap, ident: str, scale: _Scale, top: float, bottom: float) -> str:
    x = scale.x(window.start)
    width = max(scale.x(window.end) - x, MIN_BAR)
    seconds = (window.end - window.start).total_seconds()
    tip = _tip(
        [
            "overlap: " + " + ".join(window.lanes),
            f"{_when(window.start)} to {_when(window.end)} ({format_seconds(round(seconds, 1))})",
        ]
    )
    lanes = _text(json.dumps(window.lanes, ensure_ascii=False))
    return (
        f'<rect class="overlap" id="{ident}" data-lanes="{lanes}" '
        f'data-count="{len(window.lanes)}" x="{x:.1f}" y="{top}" width="{width:.1f}" '
        f'height="{bottom - top}" data-tip="{tip}"><title>{tip}</title></rect>'
    )


def _mark(mark: Mark, ident: str, scale: _Scale, top: float, bottom: float) -> str:
    x = scale.x(mark.at)
    tip = _tip([f"deadlock at {_when(mark.at)}", "sides: " + ", ".join(mark.sides), mark.where])
    return (
        f'<line class="deadlock-mark" id="{ident}" data-at="{_when(mark.at)}" '
        f'data-where="{_text(mark.where)}" x1="{x:.1f}" x2="{x:.1f}" y1="{top - 6}" '
        f'y2="{bottom + 4}" data-tip="{tip}"><title>{tip}</title></line>'
    )


def _axis(scale: _Scale, bottom: float, fmt: str) -> list[str]:
    step = next((s for s in _STEPS if scale.span / s <= _MAX_TICKS), _STEPS[-1])
    epoch = dt.datetime(1970, 1, 1, tzinfo=scale.start.tzinfo)
    first = int(-(-(scale.start - epoch).total_seconds() // step) * step)
    parts = ['<g class="axis">']
    tick = epoch + dt.timedelta(seconds=first)
    end = scale.start + dt.timedelta(seconds=scale.span)
    while tick <= end:
        x = scale.x(tick)
        parts.append(
            f'<line x1="{x:.1f}" x2="{x:.1f}" y1="{TOP - 4}" y2="{bottom}"/>'
            f'<text x="{x:.1f}" y="{TOP - 10}" text-anchor="middle">{tick.strftime(fmt)}</text>'
        )
        tick += dt.timedelta(seconds=step)
    parts.append(f'<text x="6" y="{TOP - 10}">UTC</text></g>')
    return parts


def _legend(y: float) -> list[str]:
    parts = ['<g class="legend">']
    x = 6.0
    for name in (*OUTCOMES, LOGGED):
        parts.append(
            f'<rect class="outcome-{name}" x="{x}" y="{y - 10}" width="12" height="12"/>'
            f'<text x="{x + 16}" y="{y}">{name}</text>'
        )
        x += 24 + 7 * len(name)
    y += 20
    parts.append(
        f'<line class="skip" x1="10" x2="10" y1="{y - 11}" y2="{y + 1}"/>'
        f'<text x="18" y="{y}">{SKIPPED}</text>'
        f'<rect class="overlap" x="90" y="{y - 10}" width="18" height="12"/>'
        f'<text x="112" y="{y}">overlap</text>'
        f'<g class="run-deadlocks"><path d="M200 {y - 11} l5 6 l-5 6 l-5 -6 z"/></g>'
        f'<text x="210" y="{y}">deadlocks during a run (count)</text>'
        f'<line class="deadlock-mark" x1="420" x2="420" y1="{y - 12}" y2="{y + 2}"/>'
        f'<text x="428" y="{y}">deadlock in the server log</text></g>'
    )
    return parts
