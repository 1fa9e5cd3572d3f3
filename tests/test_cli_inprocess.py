"""The fast tier's jobrun (harness/jobrun_inprocess.py): the process's answers, nothing left."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

import pytest

from harness import jobrun_cli, jobrun_inprocess
from jobrun import masking

CLOSED = "host=127.0.0.1 port=1 connect_timeout=2"

#: Command lines through each way out: help, a table, a usage error, a run that cannot
#: connect (event lines on descriptor 2), a subcommand that cannot, a missing file, and
#: an unguarded child writing to both descriptors and exiting with its own status.
LINES = {
    "help": ["--help"],
    "key": ["key", "a", "b"],
    "usage error": ["--key", "k", "--wait", "5x", "--", "true"],
    "run, no server": ["--key", "k", "--", "true"],
    "status, no server": ["status"],
    "missing file": ["deadlocks", "/nonexistent/jobrun.log"],
    "unguarded child": [
        *("--key", "k", "--on-db-error", "run", "--"),
        *("sh", "-c", "echo out; echo err >&2; exit 3"),
    ],
}


def comparable(stderr: str) -> tuple[list[object], list[str]]:
    """stderr's event lines as (event, level) in order, and the child's own lines, sorted.

    Times, ids and pids differ between two runs; and the child writes to the same stderr as
    jobrun while it runs, so where its lines fall among jobrun's is a race, not an answer.
    """
    lines = [as_event(line) for line in stderr.splitlines()]
    events = [line for line in lines if not isinstance(line, str)]
    return events, sorted(line for line in lines if isinstance(line, str))


def as_event(line: str) -> object:
    try:
        event = json.loads(line)
    except ValueError:
        return line
    return (event["event"], event["level"])


@pytest.mark.process  # the real entry point, to compare with
@pytest.mark.parametrize("argv", LINES.values(), ids=LINES.keys())
def test_the_same_answer_as_the_process(argv):
    """Exit status, stdout and stderr (event lines by name and level) as ``python -m jobrun``."""
    here = jobrun_inprocess.run(*argv, dsn=CLOSED)
    there = jobrun_cli.run(*argv, dsn=CLOSED)
    assert here.returncode == there.returncode, (here.stderr, there.stderr)
    assert here.stdout == there.stdout
    assert comparable(here.stderr) == comparable(there.stderr)


def state() -> dict[str, object]:
    """What a call could change in the process that made it."""
    return {
        "handlers": {
            signum: signal.getsignal(signum)
            for signum in signal.valid_signals()
            if signum not in {signal.SIGKILL, signal.SIGSTOP}
        },
        "mask": signal.pthread_sigmask(signal.SIG_BLOCK, ()),
        "environ": dict(os.environ),
        "streams": (sys.stdin, sys.stdout, sys.stderr, sys.argv),
        "fds": [(found.st_dev, found.st_ino) for found in map(os.fstat, (0, 1, 2))],
        "cwd": Path.cwd(),
        "psycopg": list(logging.getLogger("psycopg").handlers),
        "subreaper": jobrun_inprocess.child_subreaper(),
        "threads": set(threading.enumerate()),
    }


@pytest.mark.parametrize("argv", LINES.values(), ids=LINES.keys())
def test_a_call_leaves_this_process_as_it_was(jobrun_here, argv):
    """A run installs signal handlers and becomes a subreaper; main reads the environment."""
    before = state()
    jobrun_here.run(*argv, dsn=CLOSED, env={"JOBRUN_DEBUG": "1"})
    assert state() == before


def test_a_password_a_run_connected_with_stays_with_the_call(jobrun_here, dsn, key):
    """jobrun.masking learns it for the rest of its process: here, that is the call alone."""
    secret = "in-process-Secret-7191"  # noqa: S105 - the server trusts; libpq still holds it
    result = jobrun_here.run("--key", key, "--", "true", dsn=f"{dsn} password={secret}")
    assert result.returncode == 0, result.stderr
    assert masking.mask_text(secret) == secret


def test_a_forked_call_takes_the_threads_it_left_with_it(jobrun_here):
    """--ping's sender waits for pings until its process ends: the fork's end, not ours."""
    before = set(threading.enumerate())
    result = jobrun_here.run(
        "--key", "k", "--ping", "http://127.0.0.1:1/ping", "--ping-timeout", "1s", "--", "true",
        dsn=CLOSED, forked=True,
    )  # fmt: skip
    assert result.returncode == 69, result.stderr
    assert "ping_failed" in result.stderr  # the pinger ran there
    assert set(threading.enumerate()) == before


def test_the_fast_tier_starts_no_jobrun_process():
    """harness/jobrun_cli refuses, naming the way out (tests/conftest.py)."""
    with pytest.raises(AssertionError, match="jobrun_here fixture"):
        jobrun_cli.run("version", dsn=None)


@pytest.mark.process  # marked so, and nothing else
def test_a_process_test_is_left_out_of_the_fast_tier(request):
    """``-m "not pg"`` leaves it out: conftest marks it pg."""
    assert request.node.get_closest_marker("pg") is not None
