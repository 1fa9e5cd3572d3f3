"""--ping with a check's UUID or slug after JOBRUN_PING_BASE, and --ping-body."""

from __future__ import annotations

import sys
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from harness import jobrun_cli as cli
from jobrun.run import ping

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

UUID = "5b2d7f3e-9a41-4c0e-8e6b-2f9d1c7a4e60"
PING_KEY = "fqOOd6-F4MMNuCEnzTU01w"  # a made-up project ping key
#: A job that prints to both streams and exits with the status it is given.
NOISY = "import sys; print('to out'); print('to err', file=sys.stderr); sys.exit(int(sys.argv[1]))"
TAILS = b"--- stdout (last 7 bytes)\nto out\n--- stderr (last 7 bytes)\nto err\n"


class Monitor:
    """A local HTTP server standing in for Healthchecks: each request's path and body."""

    def __init__(self, status: int = 200) -> None:
        self.requests: list[tuple[str, bytes]] = []
        monitor = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                monitor.requests.append((urllib.parse.urlsplit(self.path).path, body))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}/ping"

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def monitor() -> Iterator[Callable[..., Monitor]]:
    """``monitor(status=200) -> Monitor``, stopped after the test."""
    made: list[Monitor] = []

    def make(status: int = 200) -> Monitor:
        made.append(Monitor(status))
        return made[-1]

    yield make
    for each in made:
        each.stop()


class TestResolve:
    """A bare value goes after the base, as Healthchecks' ping URLs are made."""

    def test_a_uuid_goes_after_the_base(self):
        """<base>/<uuid>."""
        assert ping.resolve(UUID, "https://hc-ping.com") == f"https://hc-ping.com/{UUID}"

    def test_a_slug_goes_after_the_ping_key_of_the_base(self):
        """<base>/<ping-key>/<slug>, the key from the base."""
        assert (
            ping.resolve("nightly-export", f"https://hc-ping.com/{PING_KEY}/")
            == f"https://hc-ping.com/{PING_KEY}/nightly-export"
        )

    def test_the_bases_query_is_kept(self):
        """?create=1 (Healthchecks creates a missing slug's check) stays a query."""
        assert (
            ping.resolve("nightly-export", f"https://hc-ping.com/{PING_KEY}?create=1")
            == f"https://hc-ping.com/{PING_KEY}/nightly-export?create=1"
        )


class TestRuns:
    """Real runs pinging a local monitor through the shortcuts."""

    def test_a_slug_pings_under_the_bases_ping_key(self, dsn, key, monitor):
        """JOBRUN_PING_BASE with the ping key, --ping SLUG: KEY/SLUG/start and KEY/SLUG/0."""
        server = monitor()
        base = f"{server.base}/{PING_KEY}"
        result = cli.run(
            "--key", key, "--ping", "nightly-export", "--", "true",
            dsn=dsn, env={"JOBRUN_PING_BASE": base},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert server.paths() == [
            f"/ping/{PING_KEY}/nightly-export/start",
            f"/ping/{PING_KEY}/nightly-export/0",
        ]

    def test_a_uuid_from_the_environment_pings_under_the_base(self, dsn, key, monitor):
        """JOBRUN_PING=<uuid> and JOBRUN_PING_BASE: <base>/<uuid>/start and /<status>."""
        server = monitor()
        result = cli.run(
            "--key", key, "--", sys.executable, "-c", "raise SystemExit(3)",
            dsn=dsn, env={"JOBRUN_PING": UUID, "JOBRUN_PING_BASE": server.base},
        )  # fmt: skip
        assert result.returncode == 3, result.stderr
        assert server.paths() == [f"/ping/{UUID}/start", f"/ping/{UUID}/3"]

    @pytest.mark.parametrize("value", [UUID, "nightly-export"])
    def test_a_bare_value_without_a_base_is_a_usage_error(self, dsn, key, value, tmp_path):
        """No JOBRUN_PING_BASE: exit 64, one line naming it, the child never started."""
        marker = tmp_path / "ran"
        result = cli.run("--key", key, "--ping", value, "--", "touch", str(marker), dsn=dsn)
        assert result.returncode == 64
        assert result.stderr.count("\n") == 1, result.stderr
        assert "JOBRUN_PING_BASE" in result.stderr
        assert UUID not in result.stderr
        assert not marker.exists()

    def test_a_bad_base_is_a_usage_error_without_its_key(self, dsn, key):
        """A base that is no http(s) URL: exit 64 naming --ping-base, the ping key masked."""
        result = cli.run(
            "--key", key, "--ping", "nightly-export", "--", "true",
            dsn=dsn, env={"JOBRUN_PING_BASE": f"ftp://hc-ping.com/{PING_KEY}"},
        )  # fmt: skip
        assert result.returncode == 64
        assert "--ping-base" in result.stderr
        assert PING_KEY not in result.stderr

    def test_the_ping_key_never_reaches_a_log_line(self, dsn, key, monitor):
        """A monitor answering 500: ping_failed lines, debug ones too, without the key or slug."""
        server = monitor(500)
        result = cli.run(
            "--key", key, "--ping", "nightly-export", "--ping-timeout", "2s",
            "--log-level", "debug", "--", "true",
            dsn=dsn, env={"JOBRUN_PING_BASE": f"{server.base}/{PING_KEY}"},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        failed = [e for e in cli.events(result.stderr) if e["event"] == "ping_failed"]
        assert [e["ping"] for e in failed][-1] == "0", result.stderr
        assert PING_KEY not in result.stderr
        assert "nightly-export" not in result.stderr


class TestPingBody:
    """--ping-body: which end pings carry the --keep-output tails."""

    def run(self, dsn: str, key: str, server: Monitor, status: int, *args: str) -> bytes:
        """A run exiting ``status`` with ``args``; the body of its end ping."""
        result = cli.run(
            "--key", key, "--ping", f"{server.base}/{UUID}", "--keep-output", "1k", *args,
            "--", sys.executable, "-c", NOISY, str(status), dsn=dsn,
        )  # fmt: skip
        assert result.returncode == status, result.stderr
        path, body = server.requests[-1]
        assert path == f"/ping/{UUID}/{status}"
        return body

    def test_always_sends_a_successs_tails(self, dsn, key, monitor):
        """--ping-body always (the default, as before): a success's end ping has the tails."""
        assert self.run(dsn, key, monitor(), 0, "--ping-body", "always") == TAILS

    def test_failure_leaves_a_success_without_tails(self, dsn, key, monitor):
        """--ping-body failure: a success's end ping is empty."""
        assert self.run(dsn, key, monitor(), 0, "--ping-body", "failure") == b""

    def test_failure_sends_a_failures_tails(self, dsn, key, monitor):
        """--ping-body failure: exit 3's end ping has the tails."""
        assert self.run(dsn, key, monitor(), 3, "--ping-body", "failure") == TAILS

    def test_never_sends_no_tails(self, dsn, key, monitor):
        """--ping-body never: even a failure's end ping is empty."""
        assert self.run(dsn, key, monitor(), 3, "--ping-body", "never") == b""

    def test_the_variable_chooses_too(self, dsn, key, monitor):
        """JOBRUN_PING_BODY=never: as --ping-body never."""
        server = monitor()
        result = cli.run(
            "--key", key, "--ping", f"{server.base}/{UUID}", "--keep-output", "1k",
            "--", sys.executable, "-c", NOISY, "3", dsn=dsn, env={"JOBRUN_PING_BODY": "never"},
        )  # fmt: skip
        assert result.returncode == 3, result.stderr
        assert server.requests[-1] == (f"/ping/{UUID}/3", b"")


class TestPingBaseWithheld:
    """The project ping key in JOBRUN_PING_BASE reaches neither the child nor kept output."""

    def test_the_child_does_not_get_the_ping_base(self, dsn, key, monitor, tmp_path):
        """The child's environment has no JOBRUN_PING_BASE unless --pass-env names it."""
        server = monitor()
        seen = tmp_path / "env"
        script = (
            "import os, sys; "
            f"open({str(seen)!r}, 'w').write(os.environ.get('JOBRUN_PING_BASE', 'absent'))"
        )
        result = cli.run(
            "--key", key, "--ping", "nightly-export", "--", sys.executable, "-c", script,
            dsn=dsn, env={"JOBRUN_PING_BASE": f"{server.base}/{PING_KEY}"},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert seen.read_text() == "absent"

    def test_the_ping_key_printed_by_the_job_is_masked_in_kept_output(self, dsn, key, monitor):
        """A failed job that prints the base's ping key keeps ``***`` in its stored tail."""
        server = monitor()
        result = cli.run(
            "--key", key, "--keep-output", "4KiB", "--ping", "nightly-export", "--",
            sys.executable, "-c", f"print('key is {PING_KEY}'); raise SystemExit(3)",
            dsn=dsn, env={"JOBRUN_PING_BASE": f"{server.base}/{PING_KEY}"},
        )  # fmt: skip
        assert result.returncode == 3, result.stderr
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT stdout_tail FROM jobrun.runs WHERE key = %s AND outcome = 'failed'",
                (key,),
            ).fetchone()
        assert row is not None
        assert PING_KEY.encode() not in bytes(row[0])
        assert b"***" in bytes(row[0])
