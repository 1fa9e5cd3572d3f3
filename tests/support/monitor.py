"""A local HTTP server standing in for a Healthchecks-style monitor: keeps every request."""

from __future__ import annotations

import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


class Monitor:
    """Serves 200 to every POST (and GET) under ``url``; ``requests``: (path, body) in order."""

    def __init__(self, check: str = "check") -> None:
        self.requests: list[tuple[str, bytes]] = []
        monitor = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                path = urllib.parse.urlsplit(self.path).path
                monitor.requests.append((path, self.rfile.read(length)))
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def do_GET(self) -> None:
                self.do_POST()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/ping/{check}"

    @property
    def bodies(self) -> dict[str, bytes]:
        """The last body sent to each path."""
        return dict(self.requests)

    def close(self) -> None:
        """Stop serving."""
        self.server.shutdown()
        self.server.server_close()
