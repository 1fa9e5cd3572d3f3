"""Teams sharing one database (jobrun init, jobrun grant) and the runs their tests start."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import psycopg
from psycopg.conninfo import conninfo_to_dict

from harness import jobrun_cli
from harness.jobrun_cli import wait_for_file, wait_until

if TYPE_CHECKING:
    import subprocess
    from pathlib import Path

#: The heartbeat of the victims' runs: each beat reads its stop requests.
HEARTBEAT = "200ms"


@dataclass(frozen=True)
class Teams:
    """A database set up by its owner with jobrun init, and two teams granted a-* and b-*."""

    owner: str
    a: str
    b: str

    @staticmethod
    def role_of(dsn: str) -> str:
        """The role a DSN logs in as."""
        return str(conninfo_to_dict(dsn)["user"])


def ok(result: subprocess.CompletedProcess[str]) -> None:
    """The command exited 0 (else its output is the failure's message)."""
    assert result.returncode == 0, result.stdout + result.stderr


def victim(
    teams: Teams, mode: str, marker: Path, *args: str, key: str = "a-victim"
) -> subprocess.Popen[str]:
    """A guarded run of team_a whose child writes ``marker`` and sleeps."""
    proc = jobrun_cli.start(
        "--key", key, "--mode", mode, "--heartbeat", HEARTBEAT, *args, "--",
        *jobrun_cli.holder_marker(marker), dsn=teams.a,
    )  # fmt: skip
    wait_for_file(marker, proc=proc)
    return proc


def running_run_id(dsn: str, key: str) -> str:
    """The run id of ``key``'s run still going, as the history (the owner's view) has it."""
    found: list[str] = []

    def recorded() -> bool:
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT run_id::text FROM jobrun.runs WHERE key = %s AND outcome = 'running'",
                (key,),
            ).fetchone()
        if row:
            found.append(row[0])
        return bool(row)

    wait_until(recorded, what=f"the running row of {key}")
    return found[0]


def alone(teams: Teams, mode: str, key: str = "a-victim") -> None:
    """team_a's key is still held by its run: another run of it skips."""
    again = jobrun_cli.run("--key", key, "--mode", mode, "--", "true", dsn=teams.a)
    assert again.returncode == 75, again.stderr


def end(proc: subprocess.Popen[str]) -> str:
    """Stop a victim's jobrun (SIGTERM) and return its stderr."""
    return jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)
