"""The edges of a command line: output that cannot be written, signals at start-up, help."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import click
import pytest

from harness import jobrun_cli
from jobrun import __version__
from jobrun.cli import cli
from jobrun.cli.subcommands import SUBCOMMANDS
from jobrun.exitcodes import TABLE
from jobrun.run import fence

CLOSED = "postgresql://postgres@127.0.0.1:1/closed"


def run_with_stdout(argv: list[str], stdout, dsn: str | None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*jobrun_cli.JOBRUN, *argv],
        env=jobrun_cli.environment(dsn),
        stdin=subprocess.DEVNULL,
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=60,
        check=False,
    )


class TestOutputErrors:
    """A full, closed or failing stdout is an I/O error (74); a closed pipe ends quietly (141)."""

    @pytest.mark.parametrize(
        "argv",
        [["status"], ["key", "a"], ["doctor"], ["--help"], ["--version"], ["help"], ["version"]],
        ids=" ".join,
    )
    def test_full_stdout_is_exit_74(self, dsn, argv):
        """`jobrun ... >/dev/full`: exit 74, one line on stderr, no "internal error"."""
        with Path("/dev/full").open("w") as full:
            result = run_with_stdout(argv, full, dsn)
        assert result.returncode == 74, result.stderr
        errors = [line for line in result.stderr.splitlines() if "error" in line]
        assert errors == ["jobrun: error: cannot write to standard output: No space left on device"]

    @pytest.mark.process  # the real process's descriptor 1
    def test_closed_stdout_is_exit_74(self):
        """`jobrun key a >&-`: nowhere to print the answer."""
        result = subprocess.run(
            ["sh", "-c", 'exec "$@" >&-', "sh", *jobrun_cli.JOBRUN, "key", "a"],
            capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 74, result.stderr
        assert "closed" in result.stderr

    @pytest.mark.process  # the real process's pipe
    @pytest.mark.parametrize("argv", [["key", "a", "b", "c"], ["--help"], ["version"]])
    def test_closed_pipe_ends_quietly_with_141(self, argv):
        """The reader went away (`| head -1` after its line): 128 + SIGPIPE, nothing on stderr."""
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            result = run_with_stdout(argv, write_end, None)
        finally:
            os.close(write_end)
        assert result.returncode == 141
        assert result.stderr == ""

    def test_drill_into_a_closed_pipe_ends_quietly_with_141(self, dsn):
        """`jobrun drill ... | head -1` once head is gone: 141, no traceback, no error line."""
        read_end, write_end = os.pipe()
        os.close(read_end)
        try:
            result = run_with_stdout(["drill", "--key", "drill-closed-pipe"], write_end, dsn)
        finally:
            os.close(write_end)
        assert result.returncode == 141, result.stderr
        assert result.stderr == ""

    def test_exit_codes_are_in_the_table(self):
        """74 and 141 are documented with the others."""
        assert {"74", "141"} <= {status for status, _ in TABLE}


#: A sitecustomize that sends SIGINT to its own process when a given module is imported.
SIGINT_AT_IMPORT = """
import os, sys, _signal
TARGET = os.environ.get("SIGINT_AT_IMPORT")

class SigintAtImport:
    def find_spec(self, name, path=None, target=None):
        if name == TARGET:
            os.kill(os.getpid(), _signal.SIGINT)
        return None

sys.meta_path.insert(0, SigintAtImport())
"""


@pytest.mark.process  # a fresh interpreter's start-up
class TestSignalsAtStartUp:
    """Ctrl-C while jobrun is still importing: exit 130, no traceback."""

    @pytest.mark.parametrize(
        "module", ["jobrun.__main__", "click", "jobrun.cli.main", "jobrun.keys"]
    )
    @pytest.mark.parametrize("entry", ["module", "script"])
    def test_ctrl_c_during_an_import(self, tmp_path, module, entry):
        """SIGINT delivered at the import of MODULE ends jobrun with 130 and nothing printed."""
        (tmp_path / "sitecustomize.py").write_text(SIGINT_AT_IMPORT)
        script = Path(sys.executable).parent / "jobrun"
        argv = [*jobrun_cli.JOBRUN] if entry == "module" else [sys.executable, str(script)]
        env = jobrun_cli.environment(None, {"SIGINT_AT_IMPORT": module})
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(tmp_path), env.get("PYTHONPATH", "")])
        )
        result = subprocess.run(
            [*argv, "key", "a"], env=env, capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 128 + signal.SIGINT, result.stderr
        assert "Traceback" not in result.stderr
        assert "KeyboardInterrupt" not in result.stderr
        assert result.stdout == ""


#: A sitecustomize that sends SIGINT from inside dataclasses.Field.__set_name__, while a
#: class of module $SIGINT_AT_SET_NAME is created (the handler runs inside that call).
SIGINT_AT_SET_NAME = """
import dataclasses, os, _signal
TARGET = os.environ.get("SIGINT_AT_SET_NAME")
_set_name = dataclasses.Field.__set_name__

def __set_name__(self, owner, name):
    if owner.__module__ == TARGET:
        os.kill(os.getpid(), _signal.SIGINT)
        for _ in range(100_000):  # the handler runs at one of these bytecodes
            pass
    return _set_name(self, owner, name)

dataclasses.Field.__set_name__ = __set_name__
"""


class TestSignalsInsideAnImportedClass:
    """Python 3.10/3.11 wrap what __set_name__ raises in RuntimeError: still a signal's exit."""

    def test_ctrl_c_while_structlog_creates_a_dataclass(self, tmp_path, dsn, key):
        """Ctrl-C while structlog's tracebacks module builds its dataclasses (a run's start,
        found by the chaos soak as exit 70): 130, no internal error, the child never ran."""
        (tmp_path / "sitecustomize.py").write_text(SIGINT_AT_SET_NAME)
        env = jobrun_cli.environment(dsn, {"SIGINT_AT_SET_NAME": "structlog.tracebacks"})
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(tmp_path), env.get("PYTHONPATH", "")])
        )
        marker = tmp_path / "ran"
        result = subprocess.run(
            [*jobrun_cli.JOBRUN, "--key", key, "--", "touch", str(marker)],
            env=env, capture_output=True, text=True, timeout=60, check=False,
        )  # fmt: skip
        assert result.returncode == 128 + signal.SIGINT, result.stderr
        assert "internal error" not in result.stderr
        assert not marker.exists()


class TestHelpAndVersionSubcommands:
    """`jobrun help [SUBCOMMAND]` and `jobrun version` instead of "unknown subcommand"."""

    def test_help(self, jobrun_here):
        """`jobrun help` is `jobrun --help`."""
        assert (
            jobrun_here.run("help", dsn=None).stdout == jobrun_here.run("--help", dsn=None).stdout
        )

    @pytest.mark.parametrize("subcommand", ["status", "drill", "key", "overlap"])
    def test_help_on_a_subcommand(self, jobrun_here, subcommand):
        """`jobrun help SUB` is `jobrun SUB --help`."""
        result = jobrun_here.run("help", subcommand, dsn=None)
        assert result.returncode == 0, result.stderr
        assert result.stdout == jobrun_here.run(subcommand, "--help", dsn=None).stdout

    def test_help_on_an_unknown_subcommand(self, jobrun_here):
        """Exit 64, naming the subcommands there are."""
        result = jobrun_here.run("help", "frobnicate", dsn=None)
        assert result.returncode == 64
        assert "status" in result.stderr

    def test_version(self, jobrun_here):
        """`jobrun version` prints what --version prints."""
        result = jobrun_here.run("version", dsn=None)
        assert result.stdout.strip() == f"jobrun {__version__}"

    def test_a_real_command_still_gets_the_hint(self, jobrun_here):
        """`jobrun --key k make` still says to put the command after '--'."""
        result = jobrun_here.run("--key", "k", "make", dsn=None)
        assert result.returncode == 64
        assert "put it after '--'" in result.stderr


class TestSubcommandsLoadWhenUsed:
    """A run, `key` and `--help` import no other subcommand's module; the table matches them."""

    SUBCOMMAND_MODULES = ("jobrun.cli.ops", "jobrun.cli.control", "jobrun.cli.overlap")

    #: Prints, as the process ends, every jobrun module it imported.
    REPORT_MODULES = (
        "import atexit, sys\n"
        "atexit.register(lambda: print(*[m for m in sys.modules"
        " if m.startswith(('jobrun', 'harness'))], sep='\\n', file=sys.stderr))\n"
        "sys.argv = ['jobrun', *sys.argv[1:]]\n"
        "from jobrun.__main__ import main\n"
        "main()\n"
    )

    def _imported(self, *argv: str, dsn: str | None = None) -> set[str]:
        """The jobrun and harness modules ``jobrun ARGV`` imported (event lines left out)."""
        result = subprocess.run(
            [sys.executable, "-c", self.REPORT_MODULES, *argv],
            env=jobrun_cli.environment(dsn),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        return {word for word in result.stderr.split() if word.startswith(("jobrun", "harness"))}

    @pytest.mark.process  # what a fresh interpreter imports
    @pytest.mark.parametrize("argv", [("--help",), ("key", "x")])
    def test_no_other_subcommand_is_imported(self, argv):
        """Only the subcommand asked for (and for --help none) is imported."""
        imported = self._imported(*argv)
        assert not imported & set(self.SUBCOMMAND_MODULES)
        assert ("jobrun.cli.tools" in imported) == (argv[0] == "key")
        # A subcommand written first parses none of the run's options: they are not made.
        assert ("jobrun.run.settings" in imported) == (argv[0] == "--help")

    #: Modules only some runs need: each is imported by the option (or mode) that uses it.
    OPTIONAL_RUN_MODULES = (
        "jobrun.run.alerts",  # --on-alert
        "jobrun.run.metrics",  # --metrics-file
        "jobrun.run.ping",  # --ping
        "jobrun.run.tail",  # --keep-output
        "jobrun.run.fence",  # --fence
        "jobrun.locks.slots",  # --slots
        "jobrun.locks.lease",  # --mode lease
    )

    def test_a_plain_run_imports_only_what_it_uses(self, dsn, key):
        """A session-mode run with history imports no subcommand and no optional module."""
        imported = self._imported("--key", key, "--", "true", dsn=dsn)
        assert "jobrun.run.runner" in imported  # the report did see the run's own modules
        assert not imported & {*self.SUBCOMMAND_MODULES, *self.OPTIONAL_RUN_MODULES}

    def test_a_run_never_imports_the_test_harness(self, dsn, key):
        """harness/ is the tests' and benchmarks' alone (not installed); a run leaves it be."""
        imported = self._imported("--key", key, "--wait", "1s", "--", "true", dsn=dsn)
        assert "jobrun.db" in imported
        assert not {m for m in imported if m.split(".")[0] == "harness"}

    def test_each_option_imports_its_module(self, dsn, key, tmp_path):
        """The optional modules are the ones those options use (the list above is not stale)."""
        imported = self._imported(
            *("--key", key, "--mode", "lease", "--fence", "--keep-output", "1KiB"),
            *("--metrics-file", str(tmp_path / "m.prom"), "--on-alert", "true"),
            *("--ping", "http://127.0.0.1:9/", "--ping-timeout", "100ms", "--", "true"),
            dsn=dsn,
        )
        assert set(self.OPTIONAL_RUN_MODULES) - imported == {"jobrun.locks.slots"}
        assert "jobrun.locks.slots" in self._imported(
            "--key", key, "--slots", "2", "--", "true", dsn=dsn
        )

    def test_every_summary_is_the_commands_own(self):
        """The one-line help --help shows without importing is each command's own."""
        context = click.Context(cli)
        for name, lazy in SUBCOMMANDS.items():
            command = cli.get_command(context, name)
            assert command is not None, name
            assert command.name == name
            assert command.get_short_help_str(limit=1000) == lazy.summary, name


class TestExitWithoutTeardown:
    """The console script ends the process itself, and loses nothing on the way."""

    def test_output_and_status_survive(self, tmp_path, dsn, key):
        """stdout written through a pipe, the log file flushed, the status kept (300 -> 44)."""
        log = tmp_path / "jobrun.log"
        result = subprocess.run(
            [
                *jobrun_cli.JOBRUN,
                "--key",
                key,
                "--log-file",
                str(log),
                "--",
                sys.executable,
                "-c",
                "print('out'); raise SystemExit(300)",
            ],
            env=jobrun_cli.environment(dsn),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 300 % 256, result.stderr
        assert result.stdout == "out\n"
        assert '"event": "finished"' in log.read_text()


class TestDrillAndDemoSay:
    """What the drill and the demo tell their user."""

    def test_drill_with_a_command_that_exits_says_it_must_keep_running(self, dsn, key):
        """`jobrun drill -- true` fails, and says why."""
        result = jobrun_cli.run("drill", "--key", key, "--", "true", dsn=dsn, timeout=180)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "must keep running" in result.stderr

    def test_demo_says_which_database(self, dsn):
        """The demo names the database it uses."""
        result = jobrun_cli.run("demo", dsn=dsn, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "using the database at 127.0.0.1:" in result.stdout


class TestBareJobrun:
    """A bare ``jobrun`` shows how to use it."""

    def test_bare_jobrun_prints_the_short_usage(self, jobrun_here):
        """The usage line and the first examples on stderr, exit 64 (not "no command given")."""
        result = jobrun_here.run(dsn=None)
        assert result.returncode == 64
        assert result.stderr.startswith("Usage: jobrun [OPTIONS] -- COMMAND")
        assert "jobrun --key nightly-export -- ./export.sh" in result.stderr
        assert "error" not in result.stderr


class TestUnencodableOutput:
    """A stdout whose encoding lacks a character gets an escape, never exit 70."""

    @pytest.mark.parametrize("command", ["key", "status"])
    def test_a_character_outside_latin_1_is_escaped(self, dsn, command):
        """PYTHONIOENCODING=latin-1:strict and a key with the euro sign: exit 0, \\u20ac."""
        result = jobrun_cli.run(
            command, "price-\u20ac", dsn=dsn, env={"PYTHONIOENCODING": "latin-1:strict"}
        )
        assert result.returncode == 0, result.stderr
        assert "price-\\u20ac" in result.stdout


#: Options whose variable is not JOBRUN_ + the flag's name (none today: keep it so).
VARIABLE_EXCEPTIONS: dict[str, str] = {}


class TestVariableNames:
    """Every option's variable is JOBRUN_ and its flag's name, upper-cased, - as _."""

    def test_every_variable_is_named_after_its_flag(self):
        """--fence is JOBRUN_FENCE, --connect-timeout JOBRUN_CONNECT_TIMEOUT, and so on."""
        context = click.Context(cli, info_name="jobrun")
        commands = [cli, *(cli.get_command(context, name) for name in cli.list_commands(context))]
        wrong = {}
        for command in commands:
            assert command is not None
            for param in command.params:
                if not isinstance(param, click.Option) or param.envvar is None:
                    continue
                flag = param.opts[0]
                expected = VARIABLE_EXCEPTIONS.get(
                    flag, "JOBRUN_" + flag.lstrip("-").upper().replace("-", "_")
                )
                if param.envvar != expected:
                    wrong[f"{command.name} {flag}"] = param.envvar
        assert wrong == {}

    def test_the_childs_token_variable_is_no_options_variable(self):
        """A jobrun inside a fenced child must not read its parent's token as an option."""
        variables = {param.envvar for param in cli.params if isinstance(param, click.Option)}
        assert fence.ENV not in variables
