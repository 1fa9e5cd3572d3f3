"""examples/deadlock/README.md, run as written: every command in it against a real server."""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest

from harness.pgserver import PgServer

if TYPE_CHECKING:
    from collections.abc import Iterator

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "deadlock"
README = EXAMPLE / "README.md"
#: The log path the README shows (Debian 12's PostgreSQL 15), replaced by the test server's.
README_LOG = "/var/log/postgresql/postgresql-15-main.log"
#: The syslog the README shows cron's lines in, replaced by one the test writes as
#: Debian's cron would have (no cron daemon runs in a test).
README_SYSLOG = "/var/log/syslog"
#: The user cron runs the README's crontab as, in those lines.
CRON_USER = "app"
#: Per command; the overlap commands make several attempts of a few seconds each.
COMMAND_TIMEOUT = 300
_FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)


@dataclass
class Command:
    """A ``$ `` line of a console block, the output shown under it, and its exit status."""

    line: str
    output: list[str] = field(default_factory=list)
    #: From a following ``$ echo $?``; without one, the command must exit 0.
    status: int = 0


def blocks() -> list[tuple[str, str]]:
    """The README's fenced code blocks, in order: (language, text)."""
    return [(lang, body) for lang, body in _FENCE.findall(README.read_text())]


def console(body: str) -> list[Command]:
    """The commands of a console block, with their shown output and expected status."""
    commands: list[Command] = []
    lines = body.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("$ echo $?"):
            commands[-1].status = int(lines[index + 1])
        elif line.startswith("$ "):
            commands.append(Command(line[2:]))
        elif commands and not (index and lines[index - 1].startswith("$ echo $?")):
            commands[-1].output.append(line)
    return commands


def settings() -> dict[str, str]:
    """The postgresql.conf lines the README asks for."""
    (ini,) = [body for lang, body in blocks() if lang == "ini"]
    pairs = (line.split("=", 1) for line in ini.splitlines() if "=" in line)
    return {name.strip(): value.strip().strip("'") for name, value in pairs}


def crontab_commands() -> list[str]:
    """The commands of the README's crontab lines (the five schedule fields dropped)."""
    (tab,) = [body for lang, body in blocks() if lang == "crontab"]
    return [line.split(None, 5)[5] for line in tab.splitlines() if line.strip()]


def syslog(server: PgServer) -> Path:
    """Where the test writes the cron lines the README reads from /var/log/syslog."""
    return server.data_dir / "syslog"


def pipx_path(directory: Path) -> str:
    """A PATH as on a host with jobrun from pipx: ``jobrun`` links to the venv's, system dirs.

    ``python3`` there is the system's, without psycopg: the example's jobs must make do
    with what jobrun's own installation brings.
    """
    directory.mkdir(exist_ok=True)
    link = directory / "jobrun"
    if not link.exists():
        link.symlink_to(Path(sys.executable).parent / "jobrun")
    return os.pathsep.join([str(directory), "/usr/local/bin", "/usr/bin", "/bin"])


@pytest.fixture(scope="module")
def staging(tmp_path_factory) -> Iterator[tuple[PgServer, dict[str, str]]]:
    """A private server configured as the README says, and the environment of its commands."""
    if shutil.which("psql") is None:
        pytest.skip("psql is not installed")
    server = PgServer.start(
        {
            **settings(),
            # Where Debian's pg_ctlcluster sends stderr, the logging collector writes here.
            "logging_collector": "on",
            "log_directory": "log",
            "log_filename": "postgresql.log",
        }
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBRUN_", "PG"))}
    env.update(
        PGHOST="127.0.0.1",
        PGPORT=str(server.port),
        PGUSER="postgres",
        PGDATABASE="postgres",
        PATH=pipx_path(tmp_path_factory.mktemp("pipx-bin")),
        PYTHONDONTWRITEBYTECODE="1",  # no __pycache__ of pgjob.py left in the tree
    )
    with server:
        yield server, env


def shell(server: PgServer, env: dict[str, str], line: str) -> subprocess.CompletedProcess[str]:
    """One README command, as a user would type it, in the example's directory."""
    line = line.replace(README_LOG, str(server.data_dir / "log" / "postgresql.log"))
    line = line.replace(README_SYSLOG, str(syslog(server)))
    return subprocess.run(
        ["bash", "-c", line],
        cwd=EXAMPLE,
        env=env,
        capture_output=True,
        text=True,
        timeout=COMMAND_TIMEOUT,
        check=False,
    )


def last_night(server: PgServer, env: dict[str, str]) -> list[int]:
    """The crontab lines, started at the same moment as cron would: their exit statuses.

    Each start is written to the syslog as Debian's cron logs it (``CRON[pid]: (user) CMD
    (command)``, no end line), in the server log's time zone.
    """
    with psycopg.connect(server.dsn()) as conn:
        row = conn.execute(
            "SELECT (now() AT TIME ZONE current_setting('log_timezone'))::timestamp"
        ).fetchone()
    assert row is not None
    when = row[0]
    stamp = f"{when:%b} {when.day:>2} {when:%H:%M:%S}"
    jobs = {
        command: subprocess.Popen(
            shlex.split(command),
            cwd=EXAMPLE,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        for command in crontab_commands()
    }
    syslog(server).write_text(
        "".join(
            f"{stamp} staging-db CRON[{job.pid}]: ({CRON_USER}) CMD ({command})\n"
            for command, job in jobs.items()
        )
    )
    for job in jobs.values():
        job.communicate(timeout=COMMAND_TIMEOUT)
    return sorted(job.returncode for job in jobs.values())


def is_history_overlapping(command: Command) -> bool:
    """The step that finds the nights both jobs ran (``history --overlapping``)."""
    return command.line.startswith("jobrun history") and "--overlapping" in command.line


def check_output(command: Command, result: subprocess.CompletedProcess[str]) -> None:
    """Every job name the README shows is printed, and every line without numbers, verbatim.

    Lines with numbers (pids, times, transaction ids, durations) differ from run to run.
    """
    actual = result.stdout.splitlines()
    shown = "\n".join(command.output)
    for name in set(re.findall(r"jobrun:[\w.-]+", shown)):
        assert name in result.stdout, f"{command.line}: {name} not in\n{result.stdout}"
    for line in command.output:
        if not re.search(r"\d", line):
            assert line.rstrip() in [a.rstrip() for a in actual], (
                f"{command.line}: {line!r} not in\n{result.stdout}"
            )


class TestWalkThrough:
    """The README's steps, in order, with the outputs and exit statuses it shows."""

    def test_the_walk_through_runs_as_written(self, staging):
        """Doctor, schema, last night's crontab, deadlocks, overlap before and after the fix."""
        server, env = staging
        ran: list[str] = []
        lines: list[str] = []
        for lang, body in blocks():
            if lang == "crontab":
                assert last_night(server, env) == [0, 1], "the two jobs did not deadlock"
                ran.append("crontab")
                continue
            if lang != "console":
                continue
            for command in console(body):
                result = shell(server, env, command.line)
                assert result.returncode == command.status, (
                    f"{command.line}: exit {result.returncode}\n{result.stdout}\n{result.stderr}"
                )
                check_output(command, result)
                if is_history_overlapping(command):  # last night: one pair, one side failed
                    header, *pairs = result.stdout.splitlines()
                    assert "OVERLAP" in header, result.stdout
                    assert len(pairs) == 1, result.stdout
                    assert "failed" in pairs[0], result.stdout
                if README_SYSLOG in command.line:  # both cron commands ran at the deadlock
                    running = [x for x in result.stdout.splitlines() if x.startswith("  running:")]
                    assert len(running) == len(crontab_commands()), result.stdout
                    assert all(f"cron ({CRON_USER}) jobrun --key " in x for x in running)
                lines.append(command.line)
                ran.append(command.line.split(" -")[0])
        assert ran[:1] == ["jobrun doctor | grep"]
        assert f"jobrun deadlocks {README_LOG}" in ran
        assert ran.count("jobrun overlap") == 2  # before and after the fix
        # The nights both jobs ran, without jobrun's history: sessions, then cron's log.
        assert any(line.startswith("jobrun deadlocks --sessions ") for line in lines)
        assert any(line.startswith("jobrun deadlocks --cron-log ") for line in lines)
        assert ran.index("crontab") < ran.index(f"jobrun deadlocks {README_LOG}")


class TestScripts:
    """The example's jobs run as ``./invoices.py``, the way a crontab or --first names them."""

    @pytest.mark.parametrize(
        "script",
        sorted(p for p in EXAMPLE.glob("*.py") if p.name != "pgjob.py"),
        ids=lambda p: p.name,
    )
    def test_script_is_executable_with_a_shebang(self, script):
        """Mode 755 and a ``#!`` line: running it by path does not fail with 126."""
        assert os.access(script, os.X_OK), f"{script.name} is not executable"
        assert script.read_text().startswith("#!/usr/bin/env python3\n"), script.name
