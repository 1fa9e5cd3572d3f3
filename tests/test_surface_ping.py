"""--ping credentials stay with the monitor they were written for, and plain http is said."""

from __future__ import annotations

import threading
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

import pytest

from harness import jobrun_cli as cli
from jobrun.run import ping

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

SECRET = "hunter2-ping-password"  # noqa: S105 - made up


class Server:
    """A local HTTP server that records each request's path and Authorization header.

    With ``redirect_to`` it answers every request with a 302 there (and the same path).
    """

    def __init__(self, redirect_to: str | None = None) -> None:
        self.seen: list[tuple[str, str | None]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                server.seen.append((self.path, self.headers.get("Authorization")))
                if redirect_to is not None:
                    self.send_response(302)
                    self.send_header("Location", redirect_to + self.path)
                else:
                    self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                self.answer()

            def do_POST(self) -> None:
                self.answer()

            def log_message(self, *_args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.port = self.httpd.server_address[1]
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def server() -> Iterator[Callable[..., Server]]:
    """``server(redirect_to=None) -> Server``, stopped after the test."""
    made: list[Server] = []

    def make(redirect_to: str | None = None) -> Server:
        made.append(Server(redirect_to))
        return made[-1]

    yield make
    for each in made:
        each.stop()


class TestRedirects:
    """A monitor's redirect is followed, its credentials only to the same origin."""

    def test_a_redirect_to_another_port_arrives_without_credentials(self, dsn, key, server):
        """Redirected from one local port to another: the second sees no Authorization."""
        elsewhere = server()
        monitor = server(redirect_to=f"http://127.0.0.1:{elsewhere.port}")
        url = f"http://jobrun:{SECRET}@127.0.0.1:{monitor.port}/ping/check"
        result = cli.run("--key", key, "--ping", url, "--", "true", dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert [path.split("?")[0] for path, _ in elsewhere.seen] == [
            "/ping/check/start",
            "/ping/check/0",
        ]
        assert all(auth is not None and auth.startswith("Basic ") for _, auth in monitor.seen)
        assert [auth for _, auth in elsewhere.seen] == [None, None]

    def test_a_downgrade_to_plain_http_drops_the_credentials(self):
        """https -> http on the same host and port: the redirected request has no Authorization."""
        request = urllib.request.Request(
            "https://monitor.example:8443/ping/check",
            headers={"Authorization": "Basic c2VjcmV0"},
        )
        handler = ping.KeepCredentialsAtOrigin()
        redirected = handler.redirect_request(
            request, None, 302, "Found", {}, "http://monitor.example:8443/ping/check"
        )
        assert redirected is not None
        assert not redirected.has_header("Authorization")


class TestPlainHttp:
    def test_credentials_over_plain_http_are_one_warning(self, dsn, key, server):
        """A user and password in an http:// ping URL: one ping_credentials_in_clear line."""
        monitor = server()
        url = f"http://jobrun:{SECRET}@127.0.0.1:{monitor.port}/ping/check"
        result = cli.run("--key", key, "--ping", url, "--", "true", dsn=dsn)
        assert result.returncode == 0, result.stderr
        warned = cli.event(result.stderr, "ping_credentials_in_clear")
        assert warned["level"] == "warning"
        assert SECRET not in result.stderr
