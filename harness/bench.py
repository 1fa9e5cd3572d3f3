"""What several benchmarks share: a timed run, a ping endpoint that answers, a run by hand."""

from __future__ import annotations

import contextlib
import subprocess
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator


NS_PER_MS = 1_000_000


def run_once(command: tuple[str, ...], env: dict[str, str]) -> tuple[float, int]:
    """Wall time in ms and exit status of one run of ``command``, its output discarded."""
    started = time.perf_counter_ns()
    status = subprocess.run(
        command,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        check=False,
    ).returncode
    return (time.perf_counter_ns() - started) / NS_PER_MS, status


class _Ok(BaseHTTPRequestHandler):
    """Answers every POST at once: 200, ``OK``; logs nothing."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"OK")

    def log_message(self, *_args: Any) -> None:
        pass


@contextlib.contextmanager
def ping_endpoint() -> Iterator[str]:
    """A ``--ping`` URL on 127.0.0.1 that answers at once, served until the block ends.

    Against it a ping costs jobrun's own work and a local round trip, no monitor's delay.
    """
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Ok)
    threading.Thread(target=server.serve_forever, name="bench-ping", daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/ping/bench"
    finally:
        server.shutdown()
        server.server_close()


def run_by_hand(*imports: str) -> str:
    """A Python script that does a run's work by hand: the floor a run is held against.

    It imports ``imports`` (with psycopg; say which libraries the floor should pay for),
    connects to $JOBRUN_DSN, takes an advisory lock on a random id, runs ``true`` and
    releases the lock. Run it as ``python -c SCRIPT``.
    """
    modules = ", ".join(dict.fromkeys(["os", "secrets", "subprocess", *imports, "psycopg"]))
    return f"""
import {modules}
with psycopg.connect(os.environ["JOBRUN_DSN"], autocommit=True) as conn:
    lock_id = secrets.randbits(63)
    conn.execute("SELECT pg_try_advisory_lock(%s)", (lock_id,))
    subprocess.run(["true"], check=True)
    conn.execute("SELECT pg_advisory_unlock(%s)", (lock_id,))
"""
