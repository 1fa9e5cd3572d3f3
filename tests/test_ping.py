"""--ping: Healthchecks-style pings that never change the exit status nor hold the job up."""

from __future__ import annotations

import contextlib
import datetime as dt
import json
import os
import signal
import socket
import string
import subprocess
import sys
import threading
import time
import urllib.parse
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from harness import jobrun_cli as cli
from jobrun import log
from jobrun.exitcodes import UsageError
from jobrun.run import ping
from tests.support import blocked_signals, started_threads

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

SECRET = "3f1a0c9e-5b7d-4e2a-9c61-8d2b7e4f0a15"  # noqa: S105 - a made-up ping key


@dataclass(frozen=True)
class Request:
    path: str
    query: dict[str, list[str]]
    body: bytes
    auth: str | None


class Monitor:
    """A local HTTP server standing in for Healthchecks: records requests, answers per mode."""

    def __init__(self, mode: str = "ok") -> None:
        self.mode = mode
        self.requests: list[Request] = []
        self.release = threading.Event()
        self.arrived = threading.Condition()
        monitor = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                parts = urllib.parse.urlsplit(self.path)
                request = Request(
                    parts.path,
                    urllib.parse.parse_qs(parts.query),
                    self.rfile.read(length),
                    self.headers.get("Authorization"),
                )
                with monitor.arrived:
                    monitor.requests.append(request)
                    monitor.arrived.notify_all()
                if monitor.mode == "hang" or (
                    monitor.mode == "hang_end" and not request.path.endswith("/start")
                ):
                    monitor.release.wait()
                    return
                status = 500 if monitor.mode == "fail" else 200
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"OK")

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://user:hunter2@127.0.0.1:{self.server.server_address[1]}/ping/{SECRET}"

    def paths(self) -> list[str]:
        with self.arrived:
            return [r.path.removeprefix(f"/ping/{SECRET}") for r in self.requests]

    def stop(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def monitor() -> Iterator[Any]:
    made: list[Monitor] = []

    def make(mode: str = "ok") -> Monitor:
        made.append(Monitor(mode))
        return made[-1]

    yield make
    for each in made:
        each.stop()


def refused_url() -> str:
    """A URL on a local port nobody listens on."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return f"http://127.0.0.1:{port}/ping/{SECRET}"


class Captured:
    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.log = log.configure(fmt="json", level="debug", fd=self._fd)

    def events(self, name: str) -> list[dict[str, Any]]:
        found = [json.loads(line) for line in self.path.read_text().splitlines() if line]
        return [e for e in found if e["event"] == name]

    def close(self) -> None:
        os.close(self._fd)


@pytest.fixture
def captured(tmp_path) -> Iterator[Captured]:
    made = Captured(tmp_path / "events.jsonl")
    yield made
    made.close()


def _no_secret(text: str) -> None:
    assert SECRET not in text
    assert "hunter2" not in text
    assert "user" not in text


class TestUrl:
    def test_mask_keeps_only_scheme_host_and_port(self):
        """Userinfo, the key in the path and the query are never shown."""
        url = f"https://me:pw@hc-ping.com:8443/{SECRET}?create=1"
        assert ping.mask(url) == "https://hc-ping.com:8443/***"

    def test_paths_and_rid_are_added_to_the_url(self):
        """URL/start?rid=..., keeping a query the URL already had."""
        assert (
            ping.with_path(f"https://hc-ping.com/{SECRET}/", "start", "r1")
            == f"https://hc-ping.com/{SECRET}/start?rid=r1"
        )
        assert (
            ping.with_path("https://hc-ping.com/key/slug?create=1", "0", "r1")
            == "https://hc-ping.com/key/slug/0?create=1&rid=r1"
        )

    @pytest.mark.parametrize(
        "url",
        [
            f"ftp://hc-ping.com/{SECRET}",
            f"hc-ping.com/{SECRET}",
            f"https:///{SECRET}",
            f"https://hc-ping.com/{SECRET} x",
            f"https://hc-ping.com:port/{SECRET}",
        ],
    )
    def test_bad_urls_are_refused_without_showing_the_key(self, url):
        """Not http(s), no host, spaces, a bad port: a usage error that masks the path."""
        with pytest.raises(UsageError) as raised:
            ping.parse_url(url)
        _no_secret(str(raised.value))


class TestMaskProperty:
    @given(
        user=st.text(alphabet=string.ascii_letters + string.digits, min_size=1, max_size=8),
        password=st.text(alphabet=string.ascii_letters + "!$&'()*+,;=", min_size=1, max_size=8),
        path=st.text(alphabet=string.ascii_letters + string.digits + "-_/", max_size=40),
        query=st.text(alphabet=string.ascii_letters + "=&", max_size=12),
    )
    def test_mask_shows_nothing_but_scheme_host_and_port(self, user, password, path, query):
        """Whatever the userinfo, path and query, the masked URL is scheme://host:port/***."""
        url = f"https://{user}:{password}@hc-ping.example:8443/{SECRET}/{path}?{query}"
        assert ping.mask(url) == "https://hc-ping.example:8443/***"

    @given(st.text(max_size=60))
    def test_any_text_is_a_url_or_a_usage_error(self, text):
        """parse_url never fails in any other way (no traceback for a bad --ping)."""
        with contextlib.suppress(UsageError):
            ping.parse_url(text)


class TestPinger:
    def test_start_then_exit_status_with_the_run_id(self, monitor, captured):
        """URL/start, then URL/<status> with the tails as body, both carrying rid."""
        server = monitor()
        pinger = ping.Pinger(server.url, "run-1", timeout=5.0, log=captured.log)
        pinger.start()
        pinger.finish(3, b"out\n", b"err\n")
        assert server.paths() == ["/start", "/3"]
        assert all(r.query == {"rid": ["run-1"]} for r in server.requests)
        assert server.requests[0].body == b""
        assert server.requests[0].auth == "Basic dXNlcjpodW50ZXIy"  # user:hunter2
        assert server.requests[1].body == (
            b"--- stdout (last 4 bytes)\nout\n--- stderr (last 4 bytes)\nerr\n"
        )
        assert [e["ping"] for e in captured.events("ping_sent")] == ["start", "3"]

    def test_the_sending_thread_leaves_every_signal_to_the_main_thread(self, monitor, captured):
        """Started with nothing blocked (the start ping), it still blocks SIGCHLD and the rest."""
        server = monitor()
        pinger = ping.Pinger(server.url, "run-6", timeout=5.0, log=captured.log)
        before = set(threading.enumerate())
        previous = signal.pthread_sigmask(signal.SIG_SETMASK, set())
        try:
            pinger.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)
        # The thread waits for the next ping until the process ends: alive to be looked at.
        blocked = blocked_signals(started_threads(before, "jobrun-ping"))
        pinger.finish(0)
        assert {signal.SIGCHLD, signal.SIGTERM, signal.SIGINT} <= blocked

        """A skip: no start, and URL/log (neither success nor failure) naming the holder."""
        server = monitor()
        pinger = ping.Pinger(server.url, "run-2", timeout=5.0, log=captured.log)
        pinger.skipped("locked", {"holder_host": "web1", "holder_pid": 42})
        pinger.finish(75)
        assert server.paths() == ["/log"]
        assert server.requests[0].body == b"skipped (locked) holder_host=web1 holder_pid=42"

    def test_a_failing_monitor_is_retried_then_warned_about(self, monitor, captured):
        """500 every time: ATTEMPTS tries, one ping_failed warning with the URL masked."""
        server = monitor("fail")
        pinger = ping.Pinger(server.url, "run-3", timeout=5.0, log=captured.log)
        pinger.finish(0)
        assert server.paths() == ["/0"] * ping.ATTEMPTS
        (failed,) = captured.events("ping_failed")
        assert failed["error"] == "HTTP 500"
        assert failed["attempts"] == ping.ATTEMPTS
        assert failed["url"] == f"http://127.0.0.1:{server.server.server_address[1]}/***"
        _no_secret(captured.path.read_text())

    def test_a_hanging_monitor_costs_at_most_the_timeout(self, monitor, captured):
        """Never answers: finish() returns once the timeout is spent, with a warning."""
        server = monitor("hang")
        timeout = 1.0
        pinger = ping.Pinger(server.url, "run-4", timeout=timeout, log=captured.log)
        began = time.monotonic()
        pinger.finish(0)
        elapsed = time.monotonic() - began
        assert elapsed < timeout * 1.5
        with server.arrived:
            server.arrived.wait_for(lambda: server.requests, timeout=timeout)
        assert server.paths()[0] == "/0"
        (failed,) = captured.events("ping_failed") or [None]
        assert failed is not None
        assert failed["error"].startswith("no answer within")

    def test_a_refused_connection_is_a_warning(self, captured):
        """Nobody listens: a ping_failed warning naming the error, not the URL."""
        url = refused_url()
        pinger = ping.Pinger(url, "run-5", timeout=2.0, log=captured.log)
        pinger.finish(0)
        (failed,) = captured.events("ping_failed")
        assert failed["error"] == "Connection refused"
        _no_secret(captured.path.read_text())

    def test_a_hung_start_ping_leaves_the_end_ping_its_own_deadline(self, monitor, captured):
        """The end ping waits behind a hung start, but finish() still returns within its timeout."""
        server = monitor("hang")
        timeout = 1.0
        pinger = ping.Pinger(server.url, "run-6", timeout=timeout, log=captured.log)
        pinger.start()
        began = time.monotonic()
        pinger.finish(0)
        assert time.monotonic() - began < timeout * 1.5


def _jobrun(*args: str, dsn: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return cli.run(*args, dsn=dsn, timeout=timeout)


class TestEndToEnd:
    @pytest.mark.parametrize("status", [0, 3])
    def test_start_and_exit_status_pings_of_a_run(self, monitor, dsn, key, status):
        """The child's status is jobrun's; URL/start then URL/<status>, rid = the run id."""
        server = monitor()
        proc = _jobrun(
            "--key", key, "--ping", server.url, "--",
            sys.executable, "-c", f"import sys; sys.exit({status})", dsn=dsn,
        )  # fmt: skip
        assert proc.returncode == status, proc.stderr
        run_id = cli.event(proc.stderr, "started")["run_id"]
        assert server.paths() == ["/start", f"/{status}"]
        assert [r.query for r in server.requests] == [{"rid": [run_id]}] * 2
        _no_secret(proc.stderr)

    def test_the_end_ping_carries_the_kept_output(self, monitor, dsn, key):
        """--keep-output: the end ping's body is the tail of stdout and stderr."""
        server = monitor()
        script = "import sys; print('to out'); print('to err', file=sys.stderr); sys.exit(4)"
        proc = _jobrun(
            "--key", key, "--ping", server.url, "--keep-output", "1k",
            "--", sys.executable, "-c", script, dsn=dsn,
        )  # fmt: skip
        assert proc.returncode == 4, proc.stderr.splitlines()[-1]
        assert server.requests[-1].path.endswith("/4")
        assert server.requests[-1].body == (
            b"--- stdout (last 7 bytes)\nto out\n--- stderr (last 7 bytes)\nto err\n"
        )

    def test_a_skip_sends_a_log_ping(self, monitor, dsn, key, tmp_path):
        """The lock is held: exit 75 and URL/log, no start ping."""
        server = monitor()
        ready = tmp_path / "ready"
        holder = cli.start(
            "--key", key, "--", sys.executable, "-c",
            f"import time; open({str(ready)!r}, 'w').write('x\\n'); time.sleep(120)", dsn=dsn,
        )  # fmt: skip
        try:
            cli.wait_for_file(ready)
            proc = _jobrun("--key", key, "--ping", server.url, "--", "true", dsn=dsn)
        finally:
            holder.terminate()
            holder.communicate(timeout=60)
        assert proc.returncode == 75, proc.stderr
        assert server.paths() == ["/log"]
        run_id = cli.event(proc.stderr, "skipped")["run_id"]
        assert server.requests[0].query == {"rid": [run_id]}
        assert server.requests[0].body.startswith(b"skipped (locked)")

    @pytest.mark.parametrize("mode", ["fail", "hang", "refused"])
    def test_a_broken_monitor_never_changes_the_exit_status(self, monitor, dsn, key, mode):
        """500s, silence or a refused connection: the child's status, and ping_failed lines."""
        url = refused_url() if mode == "refused" else monitor(mode).url
        timeout = 1.0
        proc = _jobrun(
            "--key", key, "--ping", url, "--ping-timeout", f"{timeout}s", "--",
            sys.executable, "-c", "import sys; sys.exit(7)", dsn=dsn,
        )  # fmt: skip
        exited = time.time()
        assert proc.returncode == 7, proc.stderr
        failed = [e for e in cli.events(proc.stderr) if e["event"] == "ping_failed"]
        assert [e["ping"] for e in failed] == ["start", "7"], proc.stderr
        _no_secret(proc.stderr)
        # The end ping (sent after the release) costs one --ping-timeout at most, the start
        # ping still hanging before it included; the rest is the interpreter's exit.
        released = cli.event(proc.stderr, "finished")["timestamp"]
        since = exited - dt.datetime.fromisoformat(released.replace("Z", "+00:00")).timestamp()
        assert since < 3 * timeout

    def test_the_lock_is_free_while_the_end_ping_hangs(self, monitor, dsn, key):
        """The end ping is sent after the release: another run takes the key meanwhile."""
        server = monitor("hang_end")
        first = cli.start(
            "--key", key, "--ping", server.url, "--ping-timeout", "60s", "--", "true", dsn=dsn
        )
        try:
            with server.arrived:
                assert server.arrived.wait_for(
                    lambda: any(r.path.endswith("/0") for r in server.requests), timeout=60
                ), server.paths()
            second = _jobrun("--key", key, "--", "true", dsn=dsn)
            assert second.returncode == 0, second.stderr
            assert first.poll() is None  # still waiting for its end ping
        finally:
            first.terminate()
            first.communicate(timeout=60)

    @pytest.mark.parametrize(
        "args",
        [
            ("--ping", f"ftp://example.com/{SECRET}"),
            ("--ping", "https://hc-ping.com/x", "--ping-timeout", "0"),
            ("--ping", "https://hc-ping.com/x", "--ping-timeout", "soon"),
        ],
    )
    def test_bad_ping_options_are_usage_errors(self, dsn, key, args, tmp_path):
        """One line, exit 64, the child never started, the key never shown."""
        marker = tmp_path / "ran"
        proc = _jobrun("--key", key, *args, "--", "touch", str(marker), dsn=dsn)
        assert proc.returncode == 64
        assert proc.stderr.count("\n") == 1
        _no_secret(proc.stderr)
        assert not marker.exists()

    def test_the_run_path_loads_no_http_client_without_ping(self, dsn, key):
        """Without --ping, urllib.request and http.client are never imported."""
        script = (
            # jobrun ends the process itself: the exit handler reports what was imported.
            "import atexit, sys, runpy\nsys.argv = ['jobrun', '--key', sys.argv[1], '--', 'true']\n"
            "atexit.register(lambda: print(sorted(m for m in sys.modules if m in "
            "('urllib.request', 'http.client'))))\n"
            "runpy.run_module('jobrun', run_name='__main__')\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script, key],
            env=cli.environment(dsn),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stderr
