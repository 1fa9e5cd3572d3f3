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
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jobrun.analysis.timeline import model
from jobrun.analysis.timeline.model import LOGGED, OUTCOMES, SKIPPED
from jobrun.durations import format_seconds
from jobrun.escape import printable

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from jobrun.analysis.timeline.model import Bar, Mark, Overlap, Timeline

WIDTH = 1200
LABELS = 260
#: Where a lane's label starts; a night's track labels start further in, after the date.
LABEL_X = 6
TRACK_LABEL_X = 72
RIGHT = 20
TOP = 40
LANE = 30
BAR = 18
LEGEND = 76
DAY = 86400
#: The night-by-night overview: a row per night, in it a track per key (and the database's)
#: this high, a bar this high in it, rows this far apart.
TRACK = 15
TRACK_BAR = 9
ROW_PAD = 3
NIGHT_GAP = 6
#: A run shorter than a pixel is still drawn this wide, so that no run is invisible.
MIN_BAR = 2.0
#: The lane where deadlocks no run is tied to go, and the database's own counts.
DATABASE = "database"
DATABASE_LABEL = "database (deadlocks tied to no run shown)"
#: Each outcome's colour: at least 3:1 against the lane and against an overlap's shading
#: (SHADED), which is drawn under the bars so that a bar keeps its own colour in it.
COLOURS = {
    "succeeded": "#2e7d32",
    "failed": "#c62828",
    "timed_out": "#c75b00",
    "lock_lost": "#6a1b9a",
    "stopped": "#455a64",
    "abandoned": "#8d6e63",
    "running": "#1565c0",
    "exec_failed": "#ad1457",
    LOGGED: "#607d8b",
    "other": "#757575",
}
LANE_BG = "#f5f5f5"
SHADING = "#ffc107"
SHADING_OPACITY = 0.28
#: The lane's background under an overlap's shading, as the browser paints it.
SHADED = "#f8e6b2"
MARK = "#d50000"
#: Axis steps to choose from (seconds): the smallest that leaves at most a dozen ticks.
_STEPS = (60, 300, 900, 1800, 3600, 3 * 3600, 6 * 3600, 12 * 3600, 86400, 2 * 86400, 7 * 86400)
_MAX_TICKS = 12

_STYLE = f"""
svg.timeline {{ font: 12px sans-serif; background: #fff; }}
svg.timeline .lane-bg {{ fill: {LANE_BG}; }}
svg.timeline .lane-label {{ fill: #212121; }}
svg.timeline .track-label {{ fill: #616161; font-size: 10px; }}
svg.timeline .night-label {{ fill: #212121; font-weight: bold; }}
svg.timeline .night-bg {{ fill: #fff; stroke: #e0e0e0; }}
svg.timeline .axis line {{ stroke: #bdbdbd; }}
svg.timeline .axis text {{ fill: #616161; font-size: 11px; }}
svg.timeline .overlap {{ fill: {SHADING}; fill-opacity: {SHADING_OPACITY}; }}
svg.timeline .overlap rect {{ stroke: #ffa000; stroke-opacity: 0.6; }}
svg.timeline .skip {{ stroke: #212121; stroke-width: 2; }}
svg.timeline .database-count rect {{ fill: none; stroke: #757575; stroke-dasharray: 3 2; }}
svg.timeline .database-count text {{ fill: #424242; font-size: 10px; }}
svg.timeline .deadlock-mark {{ stroke: {MARK}; stroke-width: 2; }}
svg.timeline .deadlock-halo {{ stroke: #fff; stroke-width: 4; }}
svg.timeline .run:hover {{ stroke: #000; stroke-width: 2; }}
svg.timeline .deadlock:hover .deadlock-mark {{ stroke: #000; }}
"""
_STYLE += "".join(
    f"svg.timeline .outcome-{name} {{ fill: {colour}; }}\n" for name, colour in COLOURS.items()
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
  // Where each picture landed on the page, for a test that reads a screenshot's pixels.
  Array.prototype.forEach.call(document.querySelectorAll("svg.timeline"), function (one) {
    var box = one.getBoundingClientRect();
    one.setAttribute("data-page-left", String(Math.round(box.left + window.scrollX)));
    one.setAttribute("data-page-top", String(Math.round(box.top + window.scrollY)));
  });
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


@dataclass(frozen=True)
class _Row:
    """Where one lane (or the database's) is drawn: its top, its height, its bars' height."""

    y: float
    height: float
    bar: float


@dataclass
class _Drawn:
    """What one picture (or one night) put where: rows by lane, and each bar's id and row."""

    rows: dict[str, _Row] = field(default_factory=dict)
    runs: dict[Bar, tuple[str, _Row]] = field(default_factory=dict)
    database: _Row | None = None


def _lane_opened(
    attributes: str, lane: str, label: str, row: _Row, *, label_x: float = LABEL_X
) -> str:
    """A lane's ``<g>`` opened at ``row`` with its ``label`` (the whole name on hover).

    ``label`` is already escaped; the caller closes the group after the lane's bars.
    """
    return f'<g {attributes} data-lane="{_text(lane)}">' + _label(label, lane, row, label_x)


def _label(label: str, whole: str, row: _Row, label_x: float) -> str:
    """A row's ``label`` (escaped already), ``whole`` (raw) on hover; a track's is smaller."""
    cls = "track-label" if label_x > LABEL_X else "lane-label"
    return (
        f'<text class="{cls}" x="{label_x}" y="{row.y + row.height / 2 + 4:.1f}">'
        f"{label}<title>{_text(whole)}</title></text>"
    )


def _backgrounds(drawn: _Drawn) -> list[str]:
    """Every row's background, under the overlaps' shading, which is under the bars."""
    rows = [*drawn.rows.values(), *([drawn.database] if drawn.database else [])]
    inset = 2 if rows and rows[0].height >= LANE else 0
    return [
        f'<rect class="lane-bg" x="{LABELS if inset == 0 else 0}" y="{row.y + inset}" '
        f'width="{WIDTH - (LABELS if inset == 0 else 0)}" height="{row.height - 2 * inset}"/>'
        for row in rows
    ]


def _lanes(
    drawn: _Drawn,
    bars: Iterable[Bar],
    prefix: str,
    scale: _Scale,
    now: dt.datetime,
    *,
    label: Callable[[str], str],
    label_x: float = LABEL_X,
    cut: bool = False,
) -> list[str]:
    """Each lane's group: its label and its bars, each bar's id and row kept in ``drawn``."""
    parts = []
    numbered = list(enumerate(bars))
    for index, (lane, row) in enumerate(drawn.rows.items()):
        attributes = (
            f'class="lane" id="lane-{index}"'
            if not prefix
            else f'class="night-lane" data-track="{index}"'
        )
        parts.append(_lane_opened(attributes, lane, label(lane), row, label_x=label_x))
        for number, bar in numbered:
            if bar.lane != lane:
                continue
            ident = f"{prefix}run-{number}"
            drawn.runs[bar] = (ident, row)
            end = model.night_end(bar, now) if cut else bar.until(now)
            parts.append(_bar(bar, ident, scale, now, row, end))
        parts.append("</g>")
    return parts


def _database_lane(
    drawn: _Drawn,
    prefix: str,
    scale: _Scale,
    now: dt.datetime,
    *,
    label: str,
    label_x: float = LABEL_X,
) -> list[str]:
    """The database's lane: the counts of deadlocks the history saw while runs ran."""
    row = drawn.database
    if row is None:
        return []
    parts = [
        f'<g class="database-lane" id="{prefix}database-lane" data-lane="{DATABASE}">'
        + _label(label, DATABASE_LABEL, row, label_x)
    ]
    for bar, (ident, _) in drawn.runs.items():
        if bar.skip or not bar.deadlocks:
            continue
        parts.append(_count(bar, ident, scale, now, row))
    parts.append("</g>")
    return parts


def svg(timeline: Timeline) -> str:
    """The timeline as an ``<svg>`` element (valid on its own and inside HTML)."""
    scale = _Scale(timeline.start, (timeline.end - timeline.start).total_seconds())
    drawn = _Drawn()
    for index, lane in enumerate(timeline.lanes):
        drawn.rows[lane] = _Row(TOP + index * LANE, LANE, BAR)
    rows = max(len(timeline.lanes), 1)
    if timeline.database_lane:
        drawn.database = _Row(TOP + rows * LANE, LANE, BAR)
        rows += 1
    height = TOP + LANE * rows + LEGEND
    parts = [
        (
            f'<svg id="timeline" class="timeline" xmlns="http://www.w3.org/2000/svg" '
            f'width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
            f'data-lanes="{len(timeline.lanes)}" data-start="{_when(timeline.start)}" '
            f'data-end="{_when(timeline.end)}">'
        ),
        f"<style>{_STYLE}</style>",
        *_backgrounds(drawn),
        *_axis(scale, height - LEGEND, "%m-%d %H:%M" if scale.span > DAY else "%H:%M"),
        *(
            _overlap(window, f"overlap-{number}", scale, drawn)
            for number, window in enumerate(timeline.overlaps)
        ),
        *_lanes(
            drawn, timeline.bars, "", scale, timeline.now, label=lambda lane: _text(_short(lane))
        ),
        *_database_lane(drawn, "", scale, timeline.now, label=_text(DATABASE_LABEL)),
        *(
            _mark(mark, f"deadlock-{number}", scale, drawn)
            for number, mark in enumerate(timeline.marks)
        ),
        *_legend(height - LEGEND + 18),
        "</svg>",
    ]
    return "\n".join(parts)


def nights_svg(timeline: Timeline) -> str:
    """A row per night over one time-of-day axis, a track per key in it (empty: one day).

    Every night has the same tracks in the same order, a key that did not run that night
    leaving its track empty: "the deadlocks are the nights refunds ran past 02:10" is seen
    at a glance, a month of nights on one page.
    """
    found = model.nights(timeline)
    if len(found) < 2:  # noqa: PLR2004 - one night is the main picture already
        return ""
    low, high = model.hours_shown(found, timeline.now)
    tracks = len(timeline.lanes) + (1 if timeline.database_lane else 0)
    row_height = max(tracks, 1) * TRACK + 2 * ROW_PAD
    height = TOP + len(found) * (row_height + NIGHT_GAP) + 10
    parts = [
        (
            f'<svg id="nights" class="timeline nights" xmlns="http://www.w3.org/2000/svg" '
            f'width="{WIDTH}" height="{height}" viewBox="0 0 {WIDTH} {height}" '
            f'data-nights="{len(found)}" data-tracks="{tracks}">'
        ),
        f"<style>{_STYLE}</style>",
    ]
    reference = found[0].midnight
    parts += _axis(_Scale(reference + dt.timedelta(seconds=low), high - low), height - 10, "%H:%M")
    for night_number, one in enumerate(found):
        top = TOP + night_number * (row_height + NIGHT_GAP)
        scale = _Scale(one.midnight + dt.timedelta(seconds=low), high - low)
        prefix = f"night{night_number}-"
        drawn = _Drawn()
        for index, lane in enumerate(one.lanes):
            drawn.rows[lane] = _Row(top + ROW_PAD + index * TRACK, TRACK, TRACK_BAR)
        if timeline.database_lane:
            drawn.database = _Row(top + ROW_PAD + len(one.lanes) * TRACK, TRACK, TRACK_BAR)
        parts += [
            (
                f'<g class="night" id="night-{night_number}" data-day="{one.day.isoformat()}" '
                f'data-top="{top}" data-height="{row_height}">'
            ),
            (
                f'<rect class="night-bg" x="0.5" y="{top + 0.5}" width="{WIDTH - 1}" '
                f'height="{row_height - 1}"/>'
            ),
            f'<text class="night-label" x="6" y="{top + ROW_PAD + 11}">{one.day:%m-%d %a}</text>',
            *_backgrounds(drawn),
            *(
                _overlap(window, f"{prefix}overlap-{number}", scale, drawn)
                for number, window in enumerate(one.overlaps)
            ),
            *_lanes(
                drawn,
                one.bars,
                prefix,
                scale,
                timeline.now,
                label=lambda lane: _text(_short(lane, 30)),
                label_x=TRACK_LABEL_X,
                cut=True,
            ),
            *_database_lane(
                drawn, prefix, scale, timeline.now, label=_text(DATABASE), label_x=TRACK_LABEL_X
            ),
            *(
                _mark(mark, f"{prefix}deadlock-{number}", scale, drawn)
                for number, mark in enumerate(one.marks)
            ),
            "</g>",
        ]
    parts.append("</svg>")
    return "\n".join(parts)


def image(timeline: Timeline) -> str:
    """The one picture an SVG file holds: the nights one per row when there are several."""
    return nights_svg(timeline) or svg(timeline)


def page(timeline: Timeline, title: str) -> str:
    """The timeline as one HTML page: the nights, the whole span, a summary, notes, hover."""
    shown = f"{_when(timeline.start)} to {_when(timeline.end)}: {summary(timeline)}"
    notes = "".join(f"<li>{_text(note)}</li>" for note in timeline.notes)
    nights = nights_svg(timeline)
    whole = svg(timeline)
    if nights:
        days = len(model.nights(timeline))
        # A month on one axis makes each night a sliver: the nights come first.
        pictures = (
            f"<h2>Night by night (the same hours of each day, UTC)</h2>\n{nights}\n"
            f"<h2>All {days} days on one axis</h2>\n{whole}"
        )
    else:
        pictures = whole
    return (
        "<!DOCTYPE html>\n"
        '<html lang="en"><head><meta charset="utf-8">'
        f"<title>{_text(title)}</title><style>{_PAGE_STYLE}</style></head>\n"
        f"<body><h1>{_text(title)}</h1>\n"
        f'<p id="summary">{_text(shown)}</p>\n'
        f"{pictures}\n"
        f'<ul class="notes">{notes}</ul>\n'
        '<div id="tip" hidden></div>\n'
        f"<script>{_SCRIPT}</script>\n"
        "</body></html>\n"
    )


def summary(timeline: Timeline) -> str:
    """``2 lane(s), 3 run(s), 0 skip(s), 1 overlap window(s), ...``: what the picture shows."""
    runs = [bar for bar in timeline.bars if not bar.skip]
    tied = sum(1 for mark in timeline.marks if mark.tied)
    return (
        f"{len(timeline.lanes)} lane(s), {len(runs)} run(s), "
        f"{len(timeline.bars) - len(runs)} skip(s), {len(timeline.overlaps)} overlap window(s), "
        f"{sum(bar.deadlocks or 0 for bar in runs)} deadlock(s) counted in the database "
        f"during runs, {len(timeline.marks)} deadlock(s) in the server log "
        f"({tied} tied to a run)"
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


def _bar(  # noqa: PLR0917 - a bar and where it goes
    bar: Bar, ident: str, scale: _Scale, now: dt.datetime, row: _Row, end: dt.datetime
) -> str:
    x = scale.x(bar.start)
    if bar.skip:
        tip = _tip([f"skipped: {bar.lane}", f"host {bar.host or '?'}", _when(bar.start)])
        skip = ident.replace("run-", "skip-")
        return (
            f'<line class="skip" id="{skip}" data-run-id="{_text(bar.run_id or "")}" '
            f'data-host="{_text(bar.host or "")}" x1="{x:.1f}" x2="{x:.1f}" '
            f'y1="{row.y + 2}" y2="{row.y + row.height - 2}" data-tip="{tip}">'
            f"<title>{tip}</title></line>"
        )
    width = max(scale.x(end) - x, MIN_BAR)
    outcome = bar.outcome if bar.outcome in COLOURS else "other"
    tip = _tip(_bar_lines(bar, now))
    y = row.y + (row.height - row.bar) / 2
    cut = ' data-cut="true"' if end < bar.until(now) else ""
    return (
        f'<rect class="run outcome-{outcome}" id="{ident}" '
        f'data-run-id="{_text(bar.run_id or "")}" data-outcome="{_text(bar.outcome)}" '
        f'data-lane="{_text(bar.lane)}" data-host="{_text(bar.host or "")}" '
        f'data-exit-code="{"" if bar.exit_code is None else bar.exit_code}" '
        f'data-duration="{bar.duration(now):.3f}" data-deadlocks="{bar.deadlocks or 0}"{cut} '
        f'x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" height="{row.bar}" data-tip="{tip}">'
        f"<title>{tip}</title></rect>"
    )


def _count(bar: Bar, ident: str, scale: _Scale, now: dt.datetime, row: _Row) -> str:
    """The database's deadlocks while a run ran, over its span on the database's lane.

    Any session's deadlock counts: it is no mark on the run.
    """
    x = scale.x(bar.start)
    width = max(scale.x(bar.until(now)) - x, MIN_BAR)
    tip = _tip(
        [
            f"{bar.deadlocks} deadlock(s) in the database (any session's) while a run ran",
            f"run {bar.run_id or '?'} of {bar.lane}",
            f"{_when(bar.start)} to {_when(bar.until(now))}",
        ]
    )
    y = row.y + (row.height - row.bar) / 2
    return (
        f'<g class="database-count" data-run="{ident}" data-count="{bar.deadlocks}" '
        f'data-tip="{tip}"><rect x="{x:.1f}" y="{y:.1f}" width="{width:.1f}" '
        f'height="{row.bar}"/><text x="{x + 3:.1f}" y="{y + row.bar - 1:.1f}">'
        f"{bar.deadlocks}</text><title>{tip}</title></g>"
    )


def _overlap(window: Overlap, ident: str, scale: _Scale, drawn: _Drawn) -> str:
    """The window shaded on the rows of its lanes only, under their bars."""
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
    rows = [drawn.rows[lane] for lane in window.lanes if lane in drawn.rows]
    shaded = "".join(
        f'<rect x="{x:.1f}" y="{row.y}" width="{width:.1f}" height="{row.height}"/>' for row in rows
    )
    return (
        f'<g class="overlap" id="{ident}" data-lanes="{lanes}" '
        f'data-count="{len(window.lanes)}" data-x="{x:.1f}" data-width="{width:.1f}" '
        f'data-tip="{tip}">{shaded}<title>{tip}</title></g>'
    )


def _mark(mark: Mark, ident: str, scale: _Scale, drawn: _Drawn) -> str:
    """A deadlock: a short line on each run the log ties it to, else on the database's lane."""
    x = round(scale.x(mark.at))
    rows: list[tuple[str, _Row]] = []
    for tie in mark.ties:
        found = drawn.runs.get(tie.bar)
        if found is not None:
            rows.append(found)
    on = " ".join(ident for ident, _ in rows)
    if not rows and drawn.database is not None:
        rows.append((DATABASE, drawn.database))
    tip = _tip([f"deadlock at {_when(mark.at)}", *_sides(mark), mark.where])
    lines = "".join(
        f'<line class="deadlock-halo" x1="{x}" x2="{x}" y1="{row.y}" y2="{row.y + row.height}"/>'
        f'<line class="deadlock-mark" data-on="{target}" x1="{x}" x2="{x}" y1="{row.y}" '
        f'y2="{row.y + row.height}"/>'
        for target, row in rows
    )
    return (
        f'<g class="deadlock" id="{ident}" data-at="{_when(mark.at)}" '
        f'data-where="{_text(mark.where)}" data-runs="{on}" data-x="{x}" '
        f'data-tied="{"true" if mark.tied else "false"}" data-tip="{tip}">{lines}'
        f"<title>{tip}</title></g>"
    )


def _sides(mark: Mark) -> list[str]:
    """The hover lines of a deadlock's sides: each side, and the run it is tied to, if any."""
    if not mark.parties:
        return ["sides: " + ", ".join(mark.sides)]
    lines = ["sides: " + ", ".join(mark.sides)]
    for party in mark.parties:
        runs = [
            f"{tie.bar.lane}" + (f" run {tie.bar.run_id}" if tie.bar.run_id else "")
            for tie in mark.ties
            if tie.party == party
        ]
        lines.append(
            f"  {party.name} (pid {party.pid}): "
            + (", ".join(runs) if runs else "tied to no run shown")
        )
    return lines


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
        f'<g class="overlap"><rect x="90" y="{y - 10}" width="18" height="12"/></g>'
        f'<text x="112" y="{y}">overlap (on the lanes that overlapped)</text>'
        f'<line class="deadlock-mark" x1="370" x2="370" y1="{y - 12}" y2="{y + 2}"/>'
        f'<text x="378" y="{y}">deadlock the server log ties to that run (its '
        "application_name or backend pid)</text>"
    )
    y += 20
    parts.append(
        f'<g class="database-count"><rect x="6" y="{y - 10}" width="18" height="12"/></g>'
        f'<text x="30" y="{y}">on the database lane: deadlocks the database counted while a '
        "run ran (any session's), and the server log's deadlocks tied to no run shown</text></g>"
    )
    return parts
