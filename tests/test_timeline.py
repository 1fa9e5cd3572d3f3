"""``jobrun timeline``: lanes of runs, overlap windows, deadlock marks, one self-contained file.

The model is tested on its own; the command against a real server's run history (real
overlapping jobrun runs, or rows inserted as the history tests do) and on hand-written cron,
journal and server logs; the file is opened in headless Chromium, whose DOM after the
scripts ran must hold the lanes, bars and marks, and whose screenshot must be a picture.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import struct
import subprocess
import uuid
import xml.etree.ElementTree as ET
from html.parser import HTMLParser
from typing import TYPE_CHECKING

import psycopg
import pytest

from harness import jobrun_cli, jobrun_inprocess
from jobrun.analysis.timeline import model
from support.history import ensure_runs_table

if TYPE_CHECKING:
    from pathlib import Path

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 12, 1, 2, 0, tzinfo=UTC)
CHROMIUM_HINT = "headless Chromium is needed to render the timeline (apt-get install chromium)"
#: A key and a host that try to break out of an attribute, an element and a script.
HOSTILE_KEY = 'k<script>alert("key")</script>\''
HOSTILE_HOST = "h\"><script>alert('host')</script>"
#: A cron command that marks the page (``data-pwned``) if its text is ever run as script.
HOSTILE_COMMAND = './refunds.py \'"><script>document.body.setAttribute("data-pwned", 1)</script>'


def at(minutes: float) -> dt.datetime:
    return T0 + dt.timedelta(minutes=minutes)


def bar(lane: str, start: float, end: float | None, outcome: str = "succeeded") -> model.Bar:
    return model.Bar(lane, at(start), at(end) if end is not None else None, outcome)


class Elements(HTMLParser):
    """Every element of a page: its tag and attributes, and the text of each script."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.found: list[tuple[str, dict[str, str]]] = []
        self.scripts: list[str] = []
        self._in_script = False
        self.feed(text)

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, {name: value or "" for name, value in attrs}))
        self._in_script = tag == "script"

    def handle_startendtag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.found.append((tag, {name: value or "" for name, value in attrs}))

    def handle_endtag(self, tag: str) -> None:  # noqa: ARG002 - HTMLParser's signature
        self._in_script = False

    def handle_data(self, data: str) -> None:
        if self._in_script:
            self.scripts.append(data)

    def with_id(self, prefix: str) -> list[dict[str, str]]:
        """The attributes of each element whose id starts with ``prefix`` (``run-``...)."""
        return [attrs for _, attrs in self.found if attrs.get("id", "").startswith(prefix)]

    def tag(self, name: str) -> list[dict[str, str]]:
        return [attrs for tag, attrs in self.found if tag == name]


def insert(
    dsn: str,
    key: str,
    start_ago: float,
    end_ago: float | None,
    *,
    outcome: str = "succeeded",
    host: str = "db1",
    exit_code: int | None = 0,
    deadlocks: int | None = 0,
) -> str:
    """A history row of ``key``, from ``start_ago`` to ``end_ago`` seconds before now."""
    ensure_runs_table(dsn)
    run_id = str(uuid.uuid4())
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO jobrun.runs (run_id, key, lock_ids, mode, host, pid, started_at,"
            " finished_at, outcome, exit_code, deadlocks)"
            " VALUES (%s, %s, '{1}', 'session', %s, 1, now() - make_interval(secs => %s),"
            " now() - make_interval(secs => %s), %s, %s, %s)",
            (run_id, key, host, start_ago, end_ago, outcome, exit_code, deadlocks),
        )
    return run_id


def draw(tmp_path: Path, *args: str, dsn: str | None) -> Elements:
    """``jobrun timeline ARGS --html FILE`` (in this process), which must exit 0; the elements."""
    page = tmp_path / f"timeline-{uuid.uuid4().hex[:6]}.html"
    result = jobrun_inprocess.run("timeline", *args, "--html", str(page), dsn=dsn)
    assert result.returncode == 0, result.stderr
    return Elements(page.read_text())


class TestOverlaps:
    """The windows where runs of two or more lanes were going at once."""

    def test_two_lanes_running_at_once_make_one_window(self):
        """refunds 02:00-02:20 and invoices 02:10-02:30: one window, 02:10 to 02:20."""
        found = model.overlaps([bar("refunds", 0, 20), bar("invoices", 10, 30)], now=at(60))
        assert found == [model.Overlap(at(10), at(20), ("invoices", "refunds"))]

    def test_runs_that_only_touch_do_not_overlap(self):
        """One ends the instant the other starts: no window."""
        assert model.overlaps([bar("a", 0, 10), bar("b", 10, 20)], now=at(60)) == []

    def test_two_runs_of_one_lane_are_no_overlap(self):
        """Overlap is between lanes: a key's own runs one over another are not shaded."""
        assert model.overlaps([bar("a", 0, 10), bar("a", 5, 20)], now=at(60)) == []

    def test_a_third_lane_joining_starts_a_window_naming_all_three(self):
        """a+b, then a+b+c, then a+b again: three windows, each naming its lanes."""
        found = model.overlaps([bar("a", 0, 30), bar("b", 5, 30), bar("c", 10, 20)], now=at(60))
        assert [(w.start, w.end, w.lanes) for w in found] == [
            (at(5), at(10), ("a", "b")),
            (at(10), at(20), ("a", "b", "c")),
            (at(20), at(30), ("a", "b")),
        ]

    def test_a_run_still_going_overlaps_until_now(self):
        """A run with no end counts until now."""
        found = model.overlaps([bar("a", 0, None, "running"), bar("b", 10, None)], now=at(15))
        assert found == [model.Overlap(at(10), at(15), ("a", "b"))]

    def test_skips_never_overlap(self):
        """A skip ran nothing (even with no end recorded): it makes no window."""
        skip = model.Bar("b", at(5), None, model.SKIPPED)
        assert model.overlaps([bar("a", 0, 10), skip], now=at(60)) == []


class TestBuild:
    """The picture's span, lanes and window."""

    def test_since_leaves_out_what_ended_before_the_window(self):
        """--since 1h: a run that ended two hours before now is not drawn."""
        drawn = model.build(
            ["a"], [bar("a", 0, 10), bar("a", 170, 175)], [], now=at(180), since=3600
        )
        assert [b.start for b in drawn.bars] == [at(170)]
        assert drawn.start == at(170)

    def test_a_key_with_no_runs_keeps_its_lane_and_a_note(self):
        """A KEY asked for is a lane even without runs, and the notes say so."""
        drawn = model.build(["a", "b"], [bar("a", 0, 10)], [], now=at(60))
        assert drawn.lanes == ["a", "b"]
        assert drawn.notes == ["b: no runs in this window"]

    def test_a_log_time_is_read_in_its_zone(self):
        """``02:10:00 +01`` is 01:10 UTC; no zone written: taken as UTC."""
        naive = dt.datetime(2026, 12, 1, 2, 10)  # noqa: DTZ001 - as a log reads
        assert model.log_time("2026-12-01 02:10:00.000 +01", naive) == at(-50)
        assert model.log_time("2026-12-01 02:10:00.000 -05:30", naive) == at(340)
        assert model.log_time("2026-12-01 02:10:00 UTC", naive) == at(10)
        assert model.log_time("2026-12-01 02:10:00", naive) == at(10)


class TestNights:
    """Each night's runs over one time-of-day axis, one night above another."""

    def test_runs_marks_and_windows_go_to_the_day_they_started(self):
        """Two nights: each has its own runs, its window and its deadlock."""
        day = dt.timedelta(days=1)
        bars = [bar("a", 0, 20), bar("b", 10, 30), bar("a", 1440, 1450), bar("b", 1460, 1470)]
        marks = [model.Mark(at(15), "log line 1", ("a", "b"))]
        found = model.nights(model.build(["a", "b"], bars, marks, now=at(3000)))
        assert [one.day for one in found] == [T0.date(), (T0 + day).date()]
        assert [len(one.bars) for one in found] == [2, 2]
        assert [len(one.overlaps) for one in found] == [1, 0]
        assert [len(one.marks) for one in found] == [1, 0]

    def test_a_run_past_midnight_stays_whole_on_its_night(self):
        """23:50 to 00:20: one bar on the night it started; the axis runs past 24:00."""
        late = model.Bar("a", at(21 * 60 + 50), at(22 * 60 + 20), "succeeded")
        (one,) = model.nights(model.build(["a"], [late], [], now=at(3000)))
        assert one.day == T0.date()
        low, high = model.hours_shown([one], at(3000))
        assert low < 23 * 3600 + 50 * 60
        assert high > 24 * 3600 + 20 * 60

    def test_the_page_draws_each_night_when_there_are_several(self, tmp_path):
        """Cron runs on two days: a night group per day, its bars and its mark."""
        cron = tmp_path / "syslog"
        cron.write_text(
            "Dec  1 02:00:01 db1 CROND[1]: (app) CMD (./a.sh)\n"
            "Dec  1 02:20:00 db1 CROND[1]: (app) CMDEND (./a.sh)\n"
            "Dec  2 02:00:01 db1 CROND[2]: (app) CMD (./a.sh)\n"
            "Dec  2 02:30:00 db1 CROND[2]: (app) CMDEND (./a.sh)\n"
        )
        log = tmp_path / "postgresql.log"
        log.write_text(deadlock_log("2026-12-02 02:25:00.000"))
        page = draw(tmp_path, "--cron-log", str(cron), "--log", str(log), dsn=None)
        assert [g["data-day"] for g in page.with_id("night-")] == ["2026-12-01", "2026-12-02"]
        assert len(page.with_id("night0-run-")) == len(page.with_id("night1-run-")) == 1
        assert [m["data-at"] for m in page.with_id("night1-deadlock-")] == [
            "2026-12-02 02:25:00 UTC"
        ]
        assert page.with_id("night0-deadlock-") == []


class TestHistory:
    """Lanes from the run history: one per KEY, a bar per run, shaded where they overlapped."""

    def test_runs_that_overlapped_under_jobrun_are_one_shaded_window(self, dsn, key, tmp_path):
        """A second key's run inside the first's: its lanes, both bars, and one window."""
        other = f"{key}-other"
        started, go = tmp_path / "started", tmp_path / "go"
        script = f"touch {started}; while [ ! -e {go} ]; do sleep 0.02; done"
        first = jobrun_cli.start("--key", key, "--", "sh", "-c", script, dsn=dsn)
        try:
            jobrun_cli.wait_until(started.exists, what="the first run to start")
            inside = jobrun_cli.run("--key", other, "--", "true", dsn=dsn)
            assert inside.returncode == 0, inside.stderr
        finally:
            go.touch()
            _, stderr = first.communicate(timeout=60)
        assert first.returncode == 0, stderr
        page = draw(tmp_path, key, other, dsn=dsn)
        assert [lane["data-lane"] for lane in page.with_id("lane-")] == [key, other]
        assert sorted(run["data-outcome"] for run in page.with_id("run-")) == ["succeeded"] * 2
        (window,) = page.with_id("overlap-")
        assert json.loads(window["data-lanes"]) == sorted([key, other])

    def test_every_outcome_has_its_colour_and_a_skip_is_a_tick(self, dsn, key, tmp_path):
        """Each outcome is the bar's class; a skip is a tick, not a bar."""
        outcomes = ["succeeded", "failed", "timed_out", "lock_lost", "stopped", "abandoned"]
        for number, outcome in enumerate(outcomes):
            insert(dsn, key, 600 - number * 60, 590 - number * 60, outcome=outcome)
        insert(dsn, key, 30, 30, outcome="skipped", exit_code=None)
        page = draw(tmp_path, key, dsn=dsn)
        classes = [run["class"] for run in page.with_id("run-")]
        assert classes == [f"run outcome-{outcome}" for outcome in outcomes]
        assert len(page.with_id("skip-")) == 1

    def test_the_databases_count_during_a_run_goes_on_the_database_lane(self, dsn, key, tmp_path):
        """deadlocks = 2 in the row (any session's): the count on the database lane, over it."""
        marked = insert(dsn, key, 300, 200, deadlocks=2)
        insert(dsn, key, 100, 50, deadlocks=0)
        page = draw(tmp_path, key, dsn=dsn)
        counts = [g for g in page.tag("g") if "database-count" in g.get("class", "")]
        runs = {run["id"]: run for run in page.with_id("run-")}
        assert [
            (runs[g["data-run"]]["data-run-id"], g["data-count"]) for g in counts if "data-run" in g
        ] == [(marked, "2")]
        assert [g["data-lane"] for g in page.with_id("database-lane")] == ["database"]

    def test_hover_text_names_run_host_exit_code_duration_outcome(self, dsn, key, tmp_path):
        """The bar's hover text: run id, host, exit code, duration, outcome."""
        run_id = insert(dsn, key, 200, 110, outcome="failed", exit_code=3, host="db7")
        (run,) = draw(tmp_path, key, dsn=dsn).with_id("run-")
        tip = run["data-tip"]
        for shown in (f"run {run_id}", "host db7", "outcome failed, exit code 3", "duration 1m30s"):
            assert shown in tip

    def test_since_leaves_older_runs_out(self, dsn, key, tmp_path):
        """--since 1d: a run of 40 days ago is not read."""
        insert(dsn, key, 40 * 86400, 40 * 86400 - 60)
        recent = insert(dsn, key, 120, 60)
        page = draw(tmp_path, key, "--since", "1d", dsn=dsn)
        assert [run["data-run-id"] for run in page.with_id("run-")] == [recent]


class TestEscaping:
    """Keys, hosts and commands are shown as text, never run as markup or script."""

    def test_a_key_and_host_with_script_and_quotes_stay_text(self, dsn, tmp_path):
        """The only script is jobrun's own; the hostile strings read back exactly."""
        insert(dsn, HOSTILE_KEY, 120, 60, host=HOSTILE_HOST)
        page = tmp_path / "hostile.html"
        result = jobrun_cli.run("timeline", HOSTILE_KEY, "--html", str(page), dsn=dsn)
        assert result.returncode == 0, result.stderr
        text = page.read_text()
        assert "alert(" not in "".join(Elements(text).scripts)
        assert text.count("<script") == 1
        found = Elements(text)
        assert [lane["data-lane"] for lane in found.with_id("lane-")] == [HOSTILE_KEY]
        assert [run["data-host"] for run in found.with_id("run-")] == [HOSTILE_HOST]

    def test_control_characters_in_a_command_are_shown_escaped(self, jobrun_here, tmp_path):
        """An escape sequence in a cron command is written ``\\x1b``, never raw."""
        cron = tmp_path / "syslog"
        cron.write_text("Dec  1 02:00:01 db1 CRON[4120]: (jobs) CMD (./x.sh \x1b[2J)\n")
        page = tmp_path / "c.html"
        result = jobrun_here.run("timeline", "--cron-log", str(cron), "--html", str(page), dsn=None)
        assert result.returncode == 0, result.stderr
        assert "\x1b" not in page.read_text()
        assert "./x.sh \\x1b[2J" in page.read_text()


#: A server log (stderr, ``%m [%p] %q%u@%d %a``) with one deadlock between two jobs at WHEN.
DEADLOCK_LOG = (
    "WHEN UTC [100] u@db jobrun:refunds ERROR:  deadlock detected\n"
    "WHEN UTC [100] u@db jobrun:refunds DETAIL:  Process 100 waits for "
    "ShareLock on transaction 7; blocked by process 200.\n"
    "\tProcess 200 waits for ShareLock on transaction 8; blocked by process 100.\n"
    "\tProcess 100: UPDATE accounts SET x = 1\n"
    "\tProcess 200: UPDATE accounts SET x = 2\n"
    "WHEN UTC [200] u@db jobrun:invoices LOG:  duration: 1.0 ms\n"
)


def deadlock_log(when: str) -> str:
    """DEADLOCK_LOG at ``when`` (``2026-12-01 02:10:00.000``)."""
    return DEADLOCK_LOG.replace("WHEN", when)


def journal_record(unit: str, message: str, when: dt.datetime) -> str:
    """One line of ``journalctl -o json``: what systemd logs about a unit."""
    micros = int(when.timestamp() * 1_000_000)
    return json.dumps(
        {"__REALTIME_TIMESTAMP": str(micros), "UNIT": unit, "MESSAGE": message, "_PID": "1"}
    )


class TestLogs:
    """Lanes from the logs a user already has, deadlocks of a server log as vertical marks."""

    def test_cron_commands_become_lanes_and_the_deadlock_a_mark(self, tmp_path):
        """Two cronie runs overlapping, a deadlock at 02:10: two lanes, a window, a mark."""
        cron = tmp_path / "syslog"
        cron.write_text(
            "Dec  1 02:00:01 db1 CROND[4120]: (app) CMD (./invoices.py)\n"
            "Dec  1 02:05:00 db1 CROND[4121]: (app) CMD (./refunds.py)\n"
            "Dec  1 02:12:00 db1 CROND[4120]: (app) CMDEND (./invoices.py)\n"
            "Dec  1 02:15:00 db1 CROND[4121]: (app) CMDEND (./refunds.py)\n"
        )
        log = tmp_path / "postgresql.log"
        log.write_text(deadlock_log("2026-12-01 02:10:00.000"))
        page = draw(tmp_path, "--cron-log", str(cron), "--log", str(log), dsn=None)
        lanes = [lane["data-lane"] for lane in page.with_id("lane-")]
        assert lanes == ["cron (app) ./invoices.py", "cron (app) ./refunds.py"]
        (window,) = page.with_id("overlap-")
        assert json.loads(window["data-lanes"]) == lanes
        (mark,) = page.with_id("deadlock-")
        assert mark["data-at"] == "2026-12-01 02:10:00 UTC"
        assert "jobrun:refunds, jobrun:invoices" in mark["data-tip"]

    def test_journal_units_become_lanes(self, tmp_path):
        """systemd units from Starting to Deactivated: a lane each, a bar per run."""
        journal = tmp_path / "journal.json"
        records = [
            ("refunds.service", "Starting refunds.service...", 0),
            ("invoices.service", "Starting invoices.service...", 5),
            ("invoices.service", "invoices.service: Deactivated successfully.", 12),
            ("refunds.service", "refunds.service: Deactivated successfully.", 15),
        ]
        journal.write_text("".join(f"{journal_record(u, m, at(n))}\n" for u, m, n in records))
        page = draw(tmp_path, "--journal", str(journal), dsn=None)
        runs = page.with_id("run-")
        assert sorted(run["data-tip"].split("\n")[0] for run in runs) == [
            "systemd invoices.service",
            "systemd refunds.service",
        ]
        assert [float(run["data-duration"]) for run in runs] == [900.0, 420.0]

    def test_server_sessions_become_lanes(self, tmp_path):
        """--sessions-from: each application's sessions, from connection to disconnection."""
        log = tmp_path / "postgresql.log"
        lines = [
            ("02:00:00", 100, "connection authorized: user=u database=db application_name=refunds"),
            (
                "02:20:00",
                100,
                "disconnection: session time: 0:20:00.000 user=u database=db host=[local]",
            ),
        ]
        log.write_text(
            "".join(
                f"2026-12-01 {t}.000 UTC [{pid}] u@db refunds LOG:  {m}\n" for t, pid, m in lines
            )
        )
        page = draw(tmp_path, "--sessions-from", str(log), dsn=None)
        assert [lane["data-lane"] for lane in page.with_id("lane-")] == ["refunds"]
        assert [float(run["data-duration"]) for run in page.with_id("run-")] == [1200.0]


class TestCommand:
    """What the command refuses, with its exit status."""

    def test_no_file_to_write_is_usage_64(self, jobrun_here):
        """Neither --html nor --svg: 64, saying what to give."""
        result = jobrun_here.run("timeline", "some-key", dsn=None)
        assert result.returncode == 64
        assert "--html FILE or --svg FILE" in result.stderr

    def test_nothing_to_draw_is_usage_64(self, jobrun_here, tmp_path):
        """No KEY and no log of runs (a --log alone has deadlocks, no runs): 64."""
        log = tmp_path / "postgresql.log"
        log.write_text(deadlock_log("2026-12-01 02:10:00.000"))
        result = jobrun_here.run(
            "timeline", "--log", str(log), "--html", str(tmp_path / "t.html"), dsn=None
        )
        assert result.returncode == 64
        assert "nothing to draw" in result.stderr

    def test_html_to_standard_output(self, jobrun_here, tmp_path):
        """--html -: the page on standard output, no file, no summary line."""
        cron = tmp_path / "syslog"
        cron.write_text("Dec  1 02:00:01 db1 CRON[1]: (app) CMD (./a.sh)\n")
        result = jobrun_here.run("timeline", "--cron-log", str(cron), "--html", "-", dsn=None)
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith("<!DOCTYPE html>")
        assert "wrote" not in result.stdout

    @pytest.mark.parametrize("flag", ["--log", "--cron-log", "--sessions-from"])
    def test_a_missing_log_is_66(self, jobrun_here, tmp_path, flag):
        """A log that does not exist: 66, nothing written."""
        page = tmp_path / "t.html"
        cron = tmp_path / "syslog"
        cron.write_text("Dec  1 02:00:01 db1 CRON[1]: (app) CMD (./a.sh)\n")
        result = jobrun_here.run(
            "timeline",
            "--cron-log",
            str(cron),
            flag,
            str(tmp_path / "nope"),
            "--html",
            str(page),
            dsn=None,
        )
        assert result.returncode == 66
        assert not page.exists()

    def test_svg_is_one_standalone_image(self, jobrun_here, tmp_path):
        """--svg: an SVG document of its own (XML), its styles inside."""
        cron = tmp_path / "syslog"
        cron.write_text('Dec  1 02:00:01 db1 CRON[1]: (app) CMD (./a.sh <&> "q")\n')
        image = tmp_path / "t.svg"
        result = jobrun_here.run("timeline", "--cron-log", str(cron), "--svg", str(image), dsn=None)
        assert result.returncode == 0, result.stderr
        root = ET.parse(image).getroot()  # noqa: S314 - our own output
        assert root.tag == "{http://www.w3.org/2000/svg}svg"


# --- headless Chromium -------------------------------------------------------------------------


def chromium() -> str:
    """The chromium binary, or skip; on CI (CI=true) fail instead of skipping."""
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if found is not None:
        return found
    if os.environ.get("CI") == "true":
        pytest.fail(f"{CHROMIUM_HINT}; CI must run the rendering test, not skip it")
    pytest.skip(CHROMIUM_HINT)


def headless(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """One headless Chromium run, offline, with a throwaway profile."""
    return subprocess.run(
        [
            binary,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            f"--user-data-dir={profile}",
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.fixture(scope="module")
def rendered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A timeline page from a cron log and a server log: 2 lanes, 1 window, 1 mark.

    One command carries a script that would mark the page if it ever ran.
    """
    where = tmp_path_factory.mktemp("rendered")
    cron = where / "syslog"
    cron.write_text(
        "Dec  1 02:00:01 db1 CROND[4120]: (app) CMD (./invoices.py)\n"
        f"Dec  1 02:05:00 db1 CROND[4121]: (app) CMD ({HOSTILE_COMMAND})\n"
        "Dec  1 02:12:00 db1 CROND[4120]: (app) CMDEND (./invoices.py)\n"
        f"Dec  1 02:15:00 db1 CROND[4121]: (app) CMDEND ({HOSTILE_COMMAND})\n"
    )
    log = where / "postgresql.log"
    log.write_text(deadlock_log("2026-12-01 02:10:00.000"))
    page = where / "timeline.html"
    result = jobrun_inprocess.run(
        "timeline", "--cron-log", str(cron), "--log", str(log), "--html", str(page), dsn=None
    )
    assert result.returncode == 0, result.stderr
    return page


class TestInChromium:
    """The page as a browser sees it: elements after its script ran, and a picture."""

    def test_the_dom_has_lanes_bars_the_window_and_the_mark(self, rendered, tmp_path):
        """--dump-dom: 2 lanes, 2 bars, 1 overlap, 1 deadlock mark; only jobrun's script ran."""
        dumped = headless(chromium(), tmp_path / "profile", "--dump-dom", rendered.as_uri())
        assert dumped.returncode == 0, dumped.stderr
        dom = Elements(dumped.stdout)
        (body,) = dom.tag("body")
        assert body.get("data-ready") == "true", "the page's script did not run"
        assert body.get("data-runs") == "2"
        assert "data-pwned" not in body, "a command's text ran as script"
        assert len(dom.tag("script")) == 1
        assert len(dom.with_id("lane-")) == 2
        assert len(dom.with_id("run-")) == 2
        assert len(dom.with_id("overlap-")) == 1
        assert len(dom.with_id("deadlock-")) == 1

    def test_the_screenshot_is_a_picture_of_the_window_size(self, rendered, tmp_path):
        """--screenshot: a PNG of 1200x800 that is not one flat colour."""
        shot = tmp_path / "timeline.png"
        done = headless(
            chromium(),
            tmp_path / "profile",
            f"--screenshot={shot}",
            "--window-size=1200,800",
            "--hide-scrollbars",
            rendered.as_uri(),
        )
        assert done.returncode == 0, done.stderr
        data = shot.read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n"
        assert struct.unpack(">II", data[16:24]) == (1200, 800)
        assert len(data) > 10_000, "a blank page compresses to almost nothing"
