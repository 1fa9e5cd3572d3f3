"""Lines a person reads: plain values, 120 columns, one connection error, the journal's priority."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harness import jobrun_cli as cli
from jobrun import keys, log
from jobrun.exitcodes import Exit
from jobrun.locks import Holder
from jobrun.ops import status

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

WIDTH = 120
#: A host name as cloud machines have them.
LONG_HOST = "build-runner-0017.eu-west-1.compute.internal"
#: The run's fixed context, as a run binds it.
CONTEXT = {
    "key": "nightly-export",
    "lock_id": -5287385889299587548,
    "run_id": "72e34052-3aec-46db-b812-dc2cab459d5e",
    "host": "web1.example.internal",
    "pid": 14365,
    "mode": "session",
    "version": "0.1.0",
}


def rendered(fmt: str, level: str, event: str, **fields: Any) -> str:
    """One event line as ``fmt`` renders it (without its newline)."""
    reader, writer = os.pipe()
    try:
        logger = log.configure(fmt=fmt, level="debug", fd=writer).bind(**CONTEXT)
        getattr(logger, level)(event, **fields)
    finally:
        os.close(writer)
    with os.fdopen(reader, "rb") as pipe:
        return pipe.read().decode().rstrip("\n")


def console(stderr: str, event: str) -> str:
    """The one console line of ``event`` in ``stderr``."""
    (line,) = [each for each in stderr.splitlines() if f"] {event} " in each]
    return line


def closed_port() -> int:
    """A local TCP port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def hold_as(dsn: str, key: str, host: str, pid: int) -> psycopg.Connection[Any]:
    """A session holding ``key`` whose holder comment names ``host`` and ``pid``."""
    conn = psycopg.connect(dsn, autocommit=True)
    announced = json.dumps(
        {"host": host, "pid": pid, "run_id": "0c6d08eb-8b18", "since": "2026-12-04T10:26:20+00:00"}
    )
    conn.execute(
        f"/* jobrun-holder {announced} */ SELECT pg_advisory_lock(%s)",
        (keys.from_name(key).lock_id,),
    )
    return conn


@pytest.fixture
def held(dsn: str, key: str) -> Iterator[str]:
    """``key``, held by a session announcing a long host name; the key is returned."""
    with hold_as(dsn, key, LONG_HOST, 424242):
        yield key


class TestPlainValues:
    """Console and logfmt lines show values as a person writes them, never Python's reprs."""

    def test_an_exit_code_is_its_number_on_a_console_line(self):
        """exit_code=69, not <Exit.UNAVAILABLE: 69>."""
        line = rendered(
            "console",
            "error",
            "lockstore_unavailable",
            reason="refused",
            exit_code=Exit.UNAVAILABLE,
        )
        assert "exit_code=69" in line.split()

    def test_a_true_flag_says_yes_on_a_console_line(self):
        """running_unguarded=yes, not True."""
        line = rendered("console", "error", "lockstore_unavailable", running_unguarded=True)
        assert "running_unguarded=yes" in line.split()

    def test_a_list_is_its_items_on_a_logfmt_line(self):
        """The lock ids of a multi-key run: lock_id=1,2, not "[1, 2]"."""
        line = rendered("logfmt", "info", "finished", lock_id=[1, 2], outcome="succeeded")
        assert "lock_id=1,2" in line.split()

    def test_a_guarded_start_says_nothing_of_it(self, dsn, key):
        """A run with its lock: the console started line has no guarded field."""
        result = cli.run("--key", key, "--log-format", "console", "--", "true", dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert "guarded" not in console(result.stderr, "started")


class TestWidths:
    """The lines of a run's main events fit 120 columns, with what a person needs."""

    def test_a_skip_names_the_holder_within_120_columns(self, dsn, key, tmp_path):
        """Skipped beside a real run: exit code, its host, pid and since, in 120 columns."""
        ready = tmp_path / "ready"
        holder = cli.start(
            "--key", key, "--", "sh", "-c", f"echo $$ > {ready}; exec sleep 120", dsn=dsn
        )  # fmt: skip
        try:
            cli.wait_for_file(ready, proc=holder)
            result = cli.run("--key", key, "--log-format", "console", "--", "true", dsn=dsn)
        finally:
            holder.terminate()
            _, holder_err = holder.communicate(timeout=60)
        assert result.returncode == 75, result.stderr
        line = console(result.stderr, "skipped")
        started = cli.event(holder_err, "started")
        assert len(line) <= WIDTH, line
        assert f'held_by="{socket.gethostname()} pid {started["pid"]}"' in line
        assert "exit_code=75" in line.split()
        assert " since=" in line

    def test_a_long_host_is_shortened_to_keep_the_pid(self, dsn, held):
        """A cloud host name and a long key: the line still fits, the pid whole."""
        result = cli.run("--key", held, "--log-format", "console", "--", "true", dsn=dsn)
        assert result.returncode == 75, result.stderr
        line = console(result.stderr, "skipped")
        assert log.columns(line) <= WIDTH, line
        assert " pid 424242" in line
        assert "since=2026-12-04T10:26:20Z" in line or "since=10:26:20Z" in line

    def test_a_wait_names_the_holder_within_120_columns(self, dsn, held):
        """--wait behind a held key: the waiting_for_lock line fits, with remaining and holder."""
        result = cli.run(
            "--key", held, "--wait", "2s", "--log-format", "console", "--", "true", dsn=dsn
        )  # fmt: skip
        assert result.returncode == 75, result.stderr
        line = console(result.stderr, "waiting_for_lock")
        assert log.columns(line) <= WIDTH, line
        assert " remaining=" in line
        assert " pid 424242" in line

    def test_a_run_of_a_long_key_fits(self, dsn, key):
        """A 60-character key: started and finished each fit, the run id on both."""
        long_key = f"{key}-{'customer-reports-eu-west'}"[:60]
        result = cli.run("--key", long_key, "--log-format", "console", "--", "true", dsn=dsn)
        assert result.returncode == 0, result.stderr
        for event in ("started", "finished"):
            line = console(result.stderr, event)
            assert log.columns(line) <= WIDTH, line
            assert " run_id=" in line

    def test_a_stop_request_fits(self, dsn, key, tmp_path):
        """jobrun stop with a long reason: the stop_requested line fits, saying by whom."""
        ready = tmp_path / "ready"
        run = cli.start(
            "--key", key, "--heartbeat", "200ms", "--log-format", "console", "--",
            "sh", "-c", f"echo $$ > {ready}; exec sleep 120", dsn=dsn,
        )  # fmt: skip
        cli.wait_for_file(ready, proc=run)
        reason = "the export writes to the wrong bucket since the deploy of 14:02, see INC-4242"
        stopped = cli.run("stop", key, "--reason", reason, dsn=dsn)
        _, stderr = run.communicate(timeout=60)
        assert stopped.returncode == 0, stopped.stderr
        assert run.returncode == Exit.STOPPED, stderr
        line = console(stderr, "stop_requested")
        assert log.columns(line) <= WIDTH, line
        assert " by=" in line
        assert 'reason="the export' in line


class TestConnectionErrors:
    """A server nobody answers for is said once, without libpq's repetitions."""

    @pytest.mark.parametrize("fmt", ["console", "logfmt"])
    def test_each_address_refusing_is_said_once(self, jobrun_here, key, fmt):
        """Two host names, one closed port: Connection refused once, no hint, exit 69."""
        dsn = f"host=127.0.0.1,localhost port={closed_port()} user=nobody dbname=ops"
        result = jobrun_here.run("--key", key, "--log-format", fmt, "--", "true", dsn=dsn)
        assert result.returncode == 69, result.stderr
        (line,) = result.stderr.splitlines()
        assert line.count("Connection refused") == 1, line
        assert "Is the server running" not in line
        error = line.split('error="', 1)[1].split('"', 1)[0]
        assert len(error) <= WIDTH, error

    def test_each_reason_is_said_with_its_addresses(self, jobrun_here, key, tmp_path):
        """A socket that is not there and a closed port: each reason once, with its address."""
        port = closed_port()
        dsn = f"host={tmp_path},127.0.0.1 port={port} user=nobody dbname=ops"
        result = jobrun_here.run("--key", key, "--log-format", "console", "--", "true", dsn=dsn)
        assert result.returncode == 69, result.stderr
        (line,) = result.stderr.splitlines()
        assert f"No such file or directory ({tmp_path}/.s.PGSQL.{port})" in line, line
        assert f"Connection refused (127.0.0.1:{port})" in line, line
        assert line.count("No such file") == line.count("Connection refused") == 1, line


class TestJournal:
    """On the journal's stream, each line starts with its syslog priority."""

    def test_lines_on_the_journal_stream_carry_their_priority(self, dsn, key, tmp_path):
        """JOURNAL_STREAM names stderr: <6> for started and finished, <3> for exec_failed."""
        path = tmp_path / "journal"
        with path.open("w") as stream:
            found = os.fstat(stream.fileno())
            env = cli.environment(dsn, {"JOURNAL_STREAM": f"{found.st_dev}:{found.st_ino}"})
            for argv in (["true"], [str(tmp_path / "no-such-program")]):
                subprocess.run(
                    [*cli.JOBRUN, "--key", key, "--", *argv],
                    env=env, stderr=stream, stdout=subprocess.DEVNULL, timeout=60, check=False,
                )  # fmt: skip
        lines = path.read_text().splitlines()
        assert [line[:3] for line in lines] == ["<6>", "<6>", "<3>"], lines
        assert json.loads(lines[-1][3:])["event"] == "exec_failed"

    def test_another_stream_is_not_the_journal(self, tmp_path, monkeypatch):
        """A JOURNAL_STREAM inherited by a process writing elsewhere: no prefix there."""
        with (tmp_path / "a").open("w") as one, (tmp_path / "b").open("w") as other:
            found = os.fstat(one.fileno())
            monkeypatch.setenv("JOURNAL_STREAM", f"{found.st_dev}:{found.st_ino}")
            assert log.to_the_journal(one.fileno())
            assert not log.to_the_journal(other.fileno())


class StartFailsThenHangs:
    """A monitor answering the first start ping 500 and holding the second until released.

    It writes ``marker`` when the second start attempt arrives: by then the first one's
    failure is known to jobrun.
    """

    def __init__(self, marker: Path) -> None:
        self.release = threading.Event()
        self.starts = 0
        monitor = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = 200
                if urllib.parse.urlsplit(self.path).path.endswith("/start"):
                    monitor.starts += 1
                    if monitor.starts == 1:
                        status = 500
                    else:
                        marker.write_text("second\n")
                        monitor.release.wait(60)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/ping/check"

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


class TestStartPingFailure:
    """A start ping that failed is said when it is known, not after the run's end."""

    def test_the_start_pings_failure_comes_before_finished(self, dsn, key, tmp_path):
        """500, then a retry still unanswered when the child exits: ping_failed, then finished."""
        marker = tmp_path / "second-start"
        monitor = StartFailsThenHangs(marker)
        waits = f"import os, time\nwhile not os.path.exists({str(marker)!r}): time.sleep(0.01)"
        try:
            with subprocess.Popen(
                [*cli.JOBRUN, "--key", key, "--ping", monitor.url, "--ping-timeout", "20s",
                 "--", sys.executable, "-c", waits],
                env=cli.environment(dsn), stderr=subprocess.PIPE, stdout=subprocess.DEVNULL,
                text=True,
            ) as run:  # fmt: skip
                assert run.stderr is not None
                lines = []
                for line in run.stderr:
                    lines.append(line)
                    if json.loads(line)["event"] == "finished":
                        monitor.release.set()  # the retry is answered once the run is over
                run.wait(timeout=60)
        finally:
            monitor.stop()
        names = [json.loads(line)["event"] for line in lines]
        assert "ping_failed" in names, names
        assert names.index("ping_failed") < names.index("finished"), names
        failed = json.loads(lines[names.index("ping_failed")])
        assert (failed["ping"], failed["error"]) == ("start", "HTTP 500")


#: Text a key, host, user or reason can hold: any printable characters, wide ones too.
any_text = st.text(
    st.characters(blacklist_categories=("Cc", "Cs", "Co", "Cn", "Zl", "Zp")), min_size=1
)
a_key = st.text(
    st.characters(blacklist_categories=("Cc", "Cf", "Cs", "Co", "Cn", "Zl", "Zp")),
    min_size=1,
    max_size=200,
)
seconds = st.floats(min_value=0, max_value=10 * 86400, allow_nan=False)


class TestWidthProperty:
    """Whatever the key, host, command and reason, the main events' console lines fit."""

    @settings(max_examples=60, deadline=None)
    @given(key=a_key, host=any_text, pid=st.integers(1, 2**22), command=any_text, took=seconds)
    def test_run_and_skip_lines_fit(self, key, host, pid, command, took):
        """started, finished, skipped, waiting_for_lock: 120 columns, exit code and pid whole."""
        holder = {"holder_host": host, "holder_pid": pid, "holder_since": "2026-12-04T10:26:20Z"}
        events = (
            ("started", "info", {"command": command, "child_pid": pid, "guarded": True}),
            ("finished", "error", {"outcome": "timed_out", "exit_code": 124,
                                   "child_exit_code": 143, "signal": "SIGTERM",
                                   "duration": took}),
            ("skipped", "info", {"reason": "locked", "exit_code": 75, **holder}),
            ("waiting_for_lock", "info", {"wait": took, "waited": 1.0, "remaining": took,
                                          **holder}),
        )  # fmt: skip
        lines = [
            rendered("console", level, event, **{**fields, "key": key})
            for event, level, fields in events
        ]
        for line in lines:
            assert log.columns(line) <= WIDTH, line
            assert "\n" not in line
        assert "exit_code=124" in lines[1].split()
        assert "exit_code=75" in lines[2].split()
        assert f" pid {pid}" in lines[2]

    @settings(max_examples=60, deadline=None)
    @given(key=a_key, user=any_text, host=any_text, reason=any_text)
    def test_pause_and_stop_lines_fit(self, key, user, host, reason):
        """A paused skip and a stop request: 120 columns, whatever who and why."""
        paused = rendered(
            "console", "info", "skipped", key=key, reason="paused", exit_code=75,
            paused_by_user=user, paused_by_host=host, paused_until=None, paused_reason=reason,
        )  # fmt: skip
        stop = rendered(
            "console", "warning", "stop_requested", key=key, requested_by_username=user,
            requested_by_host=host, requested_by_pid=7, requested_by_reason=reason,
        )  # fmt: skip
        for line in (paused, stop):
            assert log.columns(line) <= WIDTH, line

    @settings(max_examples=60, deadline=None)
    @given(
        rows=st.lists(
            st.tuples(a_key, any_text, any_text, seconds, st.integers(0, 10**6)),
            min_size=1,
            max_size=4,
        )
    )
    def test_status_fits(self, rows):
        """status without --wide: every line in 120 columns, whatever the keys, hosts, notes."""
        table = status.status_table(
            [
                status.KeyStatus(
                    key=key,
                    lock_ids=[1],
                    holder=Holder(key=key, mode="session", host=host, pid=7, since="2026-12-04"),
                    last_outcome="exec_failed",
                    last_finished_at="2025-12-04T10:00:00+00:00",
                    last_duration=took,
                    skip_streak=streak,
                    failure_streak=streak,
                    paused={"until": "2026-12-05T10:00:00+00:00", "user": user, "host": host},
                    holder_role=user,
                )
                for key, host, user, took, streak in rows
            ]
        )
        for line in table.splitlines():
            assert log.columns(line) <= WIDTH, line


class TestStatusWidth:
    """status of several keys with long names and holders fits 120 columns."""

    def test_long_keys_and_hosts_fit_and_wide_shows_them(self, dsn, key):
        """Three held keys of 70 characters on a cloud host: 120 columns; --wide has them whole."""
        names = [f"{key}-customer-reports-{region}".ljust(70, "x") for region in ("eu", "us", "ap")]
        holders = [hold_as(dsn, name, LONG_HOST, 4000 + n) for n, name in enumerate(names)]
        try:
            narrow = cli.run("status", *names, dsn=dsn)
            wide = cli.run("status", "--wide", *names, dsn=dsn)
        finally:
            for conn in holders:
                conn.close()
        assert narrow.returncode == 0, narrow.stderr
        lines = narrow.stdout.splitlines()
        assert len(lines) == 4, narrow.stdout
        assert all(log.columns(line) <= WIDTH for line in lines), narrow.stdout
        assert all(name in wide.stdout for name in names), wide.stdout
        assert f"{LONG_HOST} pid 4000" in wide.stdout
