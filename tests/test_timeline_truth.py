"""``jobrun timeline`` shows what the logs say: tied deadlocks, aligned nights, true colours.

Ties are tested on the model; the page against a real server's run history (rows inserted,
or a real jobrun run), opened in headless Chromium, whose DOM and screenshot pixels must
show the marks on the tied runs only, each key in its place every night, and each bar in
its own colour under an overlap's shading.
"""

from __future__ import annotations

import colorsys
import datetime as dt
import struct
import uuid
import zlib
from typing import TYPE_CHECKING

import psycopg
from test_timeline import Elements, chromium, headless

from harness import jobrun_cli
from jobrun.analysis.timeline import model
from support.history import ensure_runs_table

if TYPE_CHECKING:
    from pathlib import Path

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
#: The deadlock mark's colour, as the page's style gives it.
MARK = (0xD5, 0x00, 0x00)
OUTCOMES = ("succeeded", "failed", "timed_out", "lock_lost", "stopped", "abandoned", "exec_failed")


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def history_bar(key: str, start: float, end: float) -> model.Bar:
    """A bar as the history gives it (its sessions named ``jobrun:<key>``)."""
    (bar,) = model.history_bars(
        [
            {
                "key": key,
                "started_at": at(start),
                "finished_at": at(end),
                "outcome": "succeeded",
                "run_id": str(uuid.uuid4()),
                "host": "db1",
                "exit_code": 0,
                "deadlocks": 0,
            }
        ]
    )
    return bar


def deadlock(minutes: float, *parties: model.Party) -> model.Mark:
    return model.Mark(at(minutes), "pg.log line 1", tuple(p.name for p in parties), parties)


# --- the database: rows, the clock, a server log at its times ----------------------------------


def db_now(dsn: str) -> dt.datetime:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT now()").fetchone()
    assert row is not None
    return row[0].astimezone(UTC)


def insert(
    dsn: str,
    key: str,
    start: dt.datetime,
    end: dt.datetime | None,
    *,
    outcome: str = "succeeded",
) -> str:
    """A history row of ``key`` from ``start`` to ``end``."""
    ensure_runs_table(dsn)
    run_id = str(uuid.uuid4())
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO jobrun.runs (run_id, key, lock_ids, mode, host, pid, started_at,"
            " finished_at, outcome, exit_code, deadlocks)"
            " VALUES (%s, %s, '{1}', 'session', 'db1', 1, %s, %s, %s, 0, 0)",
            (run_id, key, start, end, outcome),
        )
    return run_id


#: A server log (``%m [%p] %q%u@%d %a``): pid 100 (FIRST) and pid 200 (SECOND) deadlock.
DEADLOCK = (
    "WHEN [100] u@db FIRST ERROR:  deadlock detected\n"
    "WHEN [100] u@db FIRST DETAIL:  Process 100 waits for "
    "ShareLock on transaction 7; blocked by process 200.\n"
    "\tProcess 200 waits for ShareLock on transaction 8; blocked by process 100.\n"
    "\tProcess 100: UPDATE accounts SET x = 1\n"
    "\tProcess 200: UPDATE accounts SET x = 2\n"
    "WHEN [200] u@db SECOND LOG:  duration: 1.0 ms\n"
)


def server_log(when: dt.datetime, first: str, second: str) -> str:
    """DEADLOCK at ``when``, its sides' application names ``first`` and ``second``."""
    stamp = when.strftime("%Y-%m-%d %H:%M:%S.%f")[:-3] + " UTC"
    return DEADLOCK.replace("WHEN", stamp).replace("FIRST", first).replace("SECOND", second)


# --- the page in Chromium: its DOM, and its screenshot's pixels --------------------------------


class Tree(Elements):
    """Elements, each with the ids of the groups (``<g id=...>``) it is inside."""

    def __init__(self, text: str) -> None:
        self.inside: list[tuple[str, dict[str, str], tuple[str, ...]]] = []
        self._open: list[str] = []
        super().__init__(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        super().handle_starttag(tag, attrs)
        found = {name: value or "" for name, value in attrs}
        self.inside.append((tag, found, tuple(self._open)))
        if tag in {"g", "svg"}:
            self._open.append(found.get("id", ""))

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        super().handle_startendtag(tag, attrs)
        self.inside.append((tag, {n: v or "" for n, v in attrs}, tuple(self._open)))

    def handle_endtag(self, tag: str) -> None:
        super().handle_endtag(tag)
        if tag in {"g", "svg"} and self._open:
            self._open.pop()

    def within(self, group: str, tag: str) -> list[dict[str, str]]:
        """The ``tag`` elements inside the group (or svg) of id ``group``."""
        return [attrs for t, attrs, path in self.inside if t == tag and group in path]


class Png:
    """A screenshot's pixels: an 8-bit RGB or RGBA PNG, as Chromium writes it."""

    def __init__(self, data: bytes) -> None:
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        chunks, offset, head = [], 8, b""
        while offset < len(data):
            (length,) = struct.unpack(">I", data[offset : offset + 4])
            kind = data[offset + 4 : offset + 8]
            body = data[offset + 8 : offset + 8 + length]
            if kind == b"IHDR":
                head = body
            elif kind == b"IDAT":
                chunks.append(body)
            offset += 12 + length
        self.width, self.height, depth, colour = struct.unpack(">IIBB", head[:10])
        assert depth == 8, "an 8-bit screenshot"
        self.step = {2: 3, 6: 4}[colour]
        raw = zlib.decompress(b"".join(chunks))
        stride = self.width * self.step
        rows: list[bytearray] = []
        previous = bytearray(stride)
        for y in range(self.height):
            start = y * (stride + 1)
            kind, line = raw[start], bytearray(raw[start + 1 : start + 1 + stride])
            for i in range(stride):
                left = line[i - self.step] if i >= self.step else 0
                up, corner = previous[i], previous[i - self.step] if i >= self.step else 0
                if kind == 1:
                    line[i] = (line[i] + left) & 0xFF
                elif kind == 2:
                    line[i] = (line[i] + up) & 0xFF
                elif kind == 3:
                    line[i] = (line[i] + (left + up) // 2) & 0xFF
                elif kind == 4:
                    guess = left + up - corner
                    near = min(
                        (abs(guess - left), 0), (abs(guess - up), 1), (abs(guess - corner), 2)
                    )
                    line[i] = (line[i] + (left, up, corner)[near[1]]) & 0xFF
            rows.append(line)
            previous = line
        self.rows = rows

    def at(self, x: int, y: int) -> tuple[int, int, int]:
        row, i = self.rows[y], x * self.step
        return row[i], row[i + 1], row[i + 2]


def near(pixel: tuple[int, int, int], colour: tuple[int, int, int], within: int = 40) -> bool:
    return sum(abs(a - b) for a, b in zip(pixel, colour, strict=True)) <= within


def hue(pixel: tuple[int, int, int]) -> float:
    return colorsys.rgb_to_hls(*(part / 255 for part in pixel))[0] * 360


def luminance(pixel: tuple[int, int, int]) -> float:
    """WCAG relative luminance."""
    parts = [c / 255 for c in pixel]
    linear = [c / 12.92 if c <= 0.03928 else ((c + 0.055) / 1.055) ** 2.4 for c in parts]
    return 0.2126 * linear[0] + 0.7152 * linear[1] + 0.0722 * linear[2]


def contrast(one: tuple[int, int, int], other: tuple[int, int, int]) -> float:
    high, low = sorted((luminance(one), luminance(other)), reverse=True)
    return (high + 0.05) / (low + 0.05)


def in_chromium(page: Path, tmp_path: Path, height: int = 1400) -> tuple[Tree, Png]:
    """The page's DOM after its script ran, and a screenshot of it, in one window size."""
    binary, size = chromium(), f"--window-size=1200,{height}"
    dumped = headless(binary, tmp_path / "dom", size, "--dump-dom", page.as_uri())
    assert dumped.returncode == 0, dumped.stderr
    shot = tmp_path / "shot.png"
    done = headless(
        binary, tmp_path / "shot", f"--screenshot={shot}", size, "--hide-scrollbars", page.as_uri()
    )
    assert done.returncode == 0, done.stderr
    return Tree(dumped.stdout), Png(shot.read_bytes())


def draw(tmp_path: Path, *args: str, dsn: str | None) -> Path:
    page = tmp_path / "timeline.html"
    result = jobrun_cli.run("timeline", *args, "--html", str(page), dsn=dsn)
    assert result.returncode == 0, result.stderr
    return page


def origin(dom: Tree, svg_id: str) -> tuple[int, int]:
    """Where the picture ``svg_id`` sits on the page (the page's script says)."""
    (svg,) = [attrs for attrs in dom.tag("svg") if attrs.get("id") == svg_id]
    return int(svg["data-page-left"]), int(svg["data-page-top"])


def band(rect: dict[str, str], left: int, top: int) -> tuple[range, range]:
    """The pixels (x, y) of an SVG rect on the page."""
    x, y = left + float(rect["x"]), top + float(rect["y"])
    return (
        range(round(x), round(x + float(rect["width"]))),
        range(round(y), round(y + float(rect["height"]))),
    )


class TestTies:
    """A deadlock is on a run only when a side of it, in the log, is that run."""

    def test_a_side_named_jobrun_key_is_tied_to_that_keys_run(self):
        """A side whose application_name is ``jobrun:refunds``: tied to refunds' run then."""
        refunds = history_bar("refunds", 0, 20)
        mark = deadlock(10, model.Party(100, "jobrun:refunds"), model.Party(200, None))
        (tied,) = model.tie([mark], [refunds], now=at(60))
        assert [(t.bar, t.by) for t in tied.ties] == [(refunds, "application_name jobrun:refunds")]

    def test_a_run_that_only_slept_then_is_not_tied(self):
        """invoices was running at the deadlock but no side names it: not tied to it."""
        refunds, invoices = history_bar("refunds", 0, 20), history_bar("invoices", 0, 30)
        mark = deadlock(10, model.Party(100, "jobrun:refunds"), model.Party(200, "psql"))
        (tied,) = model.tie([mark], [refunds, invoices], now=at(60))
        assert [t.bar.lane for t in tied.ties] == ["refunds"]

    def test_a_run_of_that_key_on_another_night_is_not_tied(self):
        """The name ties only the run going at the moment: not yesterday's run of the key."""
        yesterday = history_bar("refunds", -1440, -1420)
        mark = deadlock(10, model.Party(100, "jobrun:refunds"))
        (tied,) = model.tie([mark], [yesterday], now=at(60))
        assert tied.ties == ()

    def test_a_session_of_the_log_is_tied_by_its_backend_pid(self):
        """--sessions-from bars: the session with the side's pid, not another of its name."""
        session = model.Bar("app", at(0), at(20), model.LOGGED, app="app", pid=200)
        other = model.Bar("app", at(0), at(20), model.LOGGED, app="app", pid=300)
        mark = deadlock(10, model.Party(200, "app"))
        (tied,) = model.tie([mark], [session, other], now=at(60))
        assert [(t.bar.pid, t.by) for t in tied.ties] == [(200, "backend pid 200")]

    def test_a_deadlock_tied_to_no_run_opens_the_database_lane(self):
        """No side names a run shown: the timeline has a database lane for it."""
        drawn = model.build(
            ["refunds"],
            [history_bar("refunds", 0, 20)],
            [deadlock(10, model.Party(100, "psql"), model.Party(200, None))],
            now=at(60),
        )
        assert drawn.database_lane
        assert not drawn.marks[0].tied


class TestNightsModel:
    """The nights' rows, without a browser."""

    def test_every_night_has_every_key_in_the_same_order(self):
        """b did not run the second night: it keeps its place there, between a and c."""
        bars = [
            history_bar("a", 0, 10),
            history_bar("b", 0, 10),
            history_bar("c", 0, 10),
            history_bar("a", 1440, 1450),
            history_bar("c", 1440, 1450),
        ]
        found = model.nights(model.build(["a", "b", "c"], bars, [], now=at(3000)))
        assert [one.lanes for one in found] == [["a", "b", "c"], ["a", "b", "c"]]

    def test_a_run_left_running_for_days_does_not_stretch_the_hours(self):
        """A run with no end since the first night: the axis stays within hours, not days."""
        bars = [model.Bar("a", at(0), None, "running")] + [
            history_bar("b", day * 1440, day * 1440 + 20) for day in range(1, 30)
        ]
        found = model.nights(model.build(["a", "b"], bars, [], now=at(30 * 1440)))
        low, high = model.hours_shown(found, at(30 * 1440))
        assert high - low <= 7 * 3600


class TestTiedMarksInChromium:
    """The page as a browser draws it: a deadlock's mark on its tied run, nowhere else."""

    def test_the_mark_is_on_the_run_the_log_names_and_not_on_the_sleeper(self, dsn, key, tmp_path):
        """refunds and a sleeper both ran; the log names refunds: red pixels on refunds only."""
        now = db_now(dsn)
        sleeper = f"{key}-sleeper"
        insert(dsn, key, now - dt.timedelta(minutes=30), now - dt.timedelta(minutes=5))
        insert(dsn, sleeper, now - dt.timedelta(minutes=40), now - dt.timedelta(minutes=1))
        log = tmp_path / "postgresql.log"
        log.write_text(server_log(now - dt.timedelta(minutes=15), f"jobrun:{key}", "psql"))
        page = draw(tmp_path, key, sleeper, "--log", str(log), dsn=dsn)
        dom, shot = in_chromium(page, tmp_path)
        left, top = origin(dom, "timeline")
        runs = {
            run["data-lane"]: run
            for run in dom.within("timeline", "rect")
            if "run" in run.get("class", "").split()
        }
        marked = {
            lane: sum(
                near(shot.at(x, y), MARK)
                for x in band(run, left, top)[0]
                for y in band(run, left, top)[1]
            )
            for lane, run in runs.items()
        }
        assert marked[key] > 0, "no mark on the run the log names"
        assert marked[sleeper] == 0, "a mark on a run the log does not name"

    def test_a_deadlock_tied_to_no_run_is_drawn_on_the_database_lane(self, dsn, key, tmp_path):
        """The log names only psql: the mark is on the database lane, none on the run."""
        now = db_now(dsn)
        insert(dsn, key, now - dt.timedelta(minutes=30), now - dt.timedelta(minutes=5))
        log = tmp_path / "postgresql.log"
        log.write_text(server_log(now - dt.timedelta(minutes=15), "psql", "psql"))
        dom, _ = in_chromium(draw(tmp_path, key, "--log", str(log), dsn=dsn), tmp_path)
        marks = [
            m
            for m in dom.within("timeline", "line")
            if "deadlock-mark" in m.get("class", "") and "data-on" in m
        ]
        assert [m["data-on"] for m in marks] == ["database"]

    def test_a_real_run_is_tied_by_the_name_jobrun_gives_its_child(self, dsn, key, tmp_path):
        """jobrun sets PGAPPNAME for the child; a deadlock of that name mid-run marks it."""
        named = tmp_path / "appname"
        script = f'printf %s "$PGAPPNAME" > {named}; sleep 1'
        ran = jobrun_cli.run("--key", key, "--", "sh", "-c", script, dsn=dsn)
        assert ran.returncode == 0, ran.stderr
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT started_at + (finished_at - started_at) / 2"
                " FROM jobrun.runs WHERE key = %s",
                (key,),
            ).fetchone()
        assert row is not None
        log = tmp_path / "postgresql.log"
        log.write_text(server_log(row[0].astimezone(UTC), named.read_text(), "psql"))
        dom, _ = in_chromium(draw(tmp_path, key, "--log", str(log), dsn=dsn), tmp_path)
        (run,) = [r for r in dom.within("timeline", "rect") if r.get("id", "").startswith("run-")]
        (mark,) = dom.with_id("deadlock-")
        assert mark["data-runs"] == run["id"]


class TestNightsInChromium:
    """Thirty nights as one row each, every key in its own place each night."""

    def test_thirty_nights_are_thirty_rows_with_each_key_at_one_offset(self, dsn, key, tmp_path):
        """b skips every third night: its track stays, and c's bars sit at one offset."""
        now = db_now(dsn)
        midnight = dt.datetime.combine(now.date(), dt.time(), tzinfo=UTC)
        keys = [f"{key}-a", f"{key}-b", f"{key}-c"]
        for night in range(1, 31):
            two = midnight - dt.timedelta(days=night) + dt.timedelta(hours=2)
            for number, one in enumerate(keys):
                if number == 1 and night % 3 == 0:
                    continue
                start = two + dt.timedelta(minutes=5 * number)
                insert(dsn, one, start, start + dt.timedelta(minutes=25))
        page = draw(tmp_path, *keys, "--since", "31d", dsn=dsn)
        dom, _ = in_chromium(page, tmp_path, height=800)
        nights = [g for g in dom.tag("g") if g.get("class") == "night"]
        assert len(nights) == 30
        offsets: dict[str, set[float]] = {one: set() for one in keys}
        for night in nights:
            rects = dom.within(night["id"], "rect")
            top = min(float(r["y"]) for r in rects)
            for run in rects:
                if "run" in run.get("class", "").split():
                    offsets[run["data-lane"]].add(float(run["y"]) - top)
        assert all(len(found) == 1 for found in offsets.values()), offsets
        assert len({found.pop() for found in offsets.values()}) == 3

    def test_the_first_picture_shows_each_nights_run_wide(self, dsn, key, tmp_path):
        """Thirty nights of 25-minute runs: the page's first picture draws each over 100px."""
        now = db_now(dsn)
        midnight = dt.datetime.combine(now.date(), dt.time(), tzinfo=UTC)
        for night in range(1, 31):
            start = midnight - dt.timedelta(days=night) + dt.timedelta(hours=2)
            insert(dsn, key, start, start + dt.timedelta(minutes=25))
        dom, _ = in_chromium(draw(tmp_path, key, "--since", "31d", dsn=dsn), tmp_path, 800)
        first = dom.tag("svg")[0]["id"]
        widths = [
            float(r["width"])
            for r in dom.within(first, "rect")
            if "run" in r.get("class", "").split()
        ]
        assert len(widths) == 30
        assert min(widths) > 100


class TestColoursInChromium:
    """Under an overlap's shading each bar keeps its own colour, readable against it."""

    def test_every_outcome_keeps_its_hue_and_contrast_under_the_shading(self, dsn, key, tmp_path):
        """Each outcome inside an overlap window: its hue as in the legend, 3:1 to the shade."""
        now = db_now(dsn)
        other = f"{key}-long"
        insert(dsn, other, now - dt.timedelta(minutes=60), now - dt.timedelta(minutes=1))
        for number, outcome in enumerate(OUTCOMES):
            start = now - dt.timedelta(minutes=55 - 7 * number)
            insert(dsn, key, start, start + dt.timedelta(minutes=5), outcome=outcome)
        dom, shot = in_chromium(draw(tmp_path, key, other, dsn=dsn), tmp_path)
        left, top = origin(dom, "timeline")
        swatches = {
            r["class"].removeprefix("outcome-"): r
            for r in dom.within("timeline", "rect")
            if r.get("class", "").startswith("outcome-")
        }
        for run in dom.within("timeline", "rect"):
            if "run" not in run.get("class", "").split() or run["data-lane"] != key:
                continue
            xs, ys = band(run, left, top)
            drawn = shot.at(xs[len(xs) // 2], ys[len(ys) // 2])
            # The shading just above the bar, inside the window, in the bar's lane.
            shade = shot.at(xs[len(xs) // 2], ys.start - 2)
            sx, sy = band(swatches[run["data-outcome"]], left, top)
            own = shot.at(sx[len(sx) // 2], sy[len(sy) // 2])
            outcome = run["data-outcome"]
            assert abs(hue(drawn) - hue(own)) < 8, f"{outcome}: {drawn} drawn, {own} its own"
            assert contrast(drawn, shade) >= 3, f"{outcome}: {drawn} against {shade}"
