"""Runs of one key in session or lease mode, with short timings, and their event lines."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from harness import jobrun_cli

if TYPE_CHECKING:
    import subprocess

MODES = ("session", "lease")
#: Lease mode's short lease: the lock (or a queue slot) of a killed run frees within it.
LEASE_TTL = 5.0
TIMING = {
    "session": ("--heartbeat", "200ms"),
    "lease": ("--ttl", f"{LEASE_TTL:g}s", "--kill-after", "1s", "--heartbeat", "1s"),
}


def events_until(proc: subprocess.Popen[str], name: str) -> list[dict[str, Any]]:
    """The JSON lines ``proc`` writes to stderr up to and including event ``name``."""
    assert proc.stderr is not None
    seen = []
    for line in proc.stderr:
        seen.append(json.loads(line))
        if seen[-1]["event"] == name:
            return seen
    msg = f"jobrun ended (status {proc.wait()}) before {name!r}: {seen!r}"
    raise AssertionError(msg)


def run(key: str, mode: str, *args: str, dsn: str) -> subprocess.CompletedProcess[str]:
    """``jobrun --key KEY --mode MODE`` with the mode's timing, to completion."""
    return jobrun_cli.run("--key", key, "--mode", mode, *TIMING[mode], *args, dsn=dsn)


def start(key: str, mode: str, *args: str, dsn: str) -> subprocess.Popen[str]:
    """The same, in the background (stderr captured)."""
    return jobrun_cli.start("--key", key, "--mode", mode, *TIMING[mode], *args, dsn=dsn)
