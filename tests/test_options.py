"""Each option is said once: the run's in jobrun/run/settings.py, the shared ones in flags.py."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import click
import pytest

from jobrun import flags
from jobrun.cli import cli
from jobrun.cli.overlap import overlap_command
from jobrun.cli.tools import drill_command
from jobrun.exitcodes import UsageError
from jobrun.run.settings import KEY_NAMES, LOCK_IDS, OPTION, Settings

PACKAGE = Path(__file__).resolve().parents[1] / "jobrun"
#: The fields of Settings worked out from the options rather than read from one.
WORKED_OUT = {"run_keys", "dsn_on_command_line", "lifetime"}
#: Subcommands' options that share a run option's flag but not its meaning, by file.
OTHER_MEANING = {
    ("--key", "tools.py"),  # drill's one key name, required
    ("--wait", "control.py"),  # stop: how long to wait for the stopped run to end
    ("--alert-after", "ops.py"),  # status --check: when a key counts as failing
}


def run_options() -> dict[str, click.Option]:
    """The run command's options by parameter name (--version and --help left out)."""
    return {
        param.name: param
        for param in cli.params
        if isinstance(param, click.Option) and not param.is_eager and param.name
    }


def params(command: click.Command) -> dict[str, click.Parameter]:
    """A command's parameters by name."""
    return {param.name: param for param in command.params if param.name}


def declarations_of(flag: str) -> list[str]:
    """Where ``flag`` is declared in the package: each file, once per declaration."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        text = path.read_text()
        pattern = rf'(?:option|Option)\(\s*"{re.escape(flag)}"'
        if (flag, path.name) not in OTHER_MEANING:
            found += [path.name] * len(re.findall(pattern, text))
    return found


class TestSaidOnce:
    """A run option's flag, default and kind are written in one declaration."""

    def test_every_run_option_is_made_from_its_declaration(self):
        """The run command's options are the keys' and Settings' declarations, in that order."""
        declared = [KEY_NAMES, LOCK_IDS, *Settings.declarations()]
        assert list(run_options()) == [declaration.param_name for declaration in declared]

    def test_every_default_and_kind_is_the_declarations_own(self):
        """Each run option's default and kind of value are the very objects declared."""
        made = run_options()
        for declaration in (KEY_NAMES, LOCK_IDS, *Settings.declarations()):
            option = made[declaration.param_name]
            assert option.default is declaration.default, declaration.flag
            if declaration.kind is not None:
                assert option.type is declaration.kind, declaration.flag

    def test_every_settings_field_is_an_option_or_worked_out(self):
        """A field of Settings without a declaration is one of the few worked out."""
        bare = {
            field.name for field in dataclasses.fields(Settings) if OPTION not in field.metadata
        }
        assert bare == WORKED_OUT

    @pytest.mark.parametrize("name", sorted(run_options()))
    def test_every_run_flag_is_declared_in_one_place(self, name):
        """The package declares each run option's flag once (flags.py or settings.py)."""
        flag = run_options()[name].opts[0]
        assert len(declarations_of(flag)) == 1, declarations_of(flag)

    def test_the_run_command_names_no_option_it_does_not_handle_itself(self):
        """cli/run.py reads the keys, --fence and --dsn's source; every other option passes by."""
        source = (PACKAGE / "cli" / "run.py").read_text()
        handled = {"key_names", "lock_ids", "fence", "dsn"}
        named = {
            declaration.param_name
            for declaration in Settings.declarations()
            if re.search(rf"\b{declaration.param_name}\b", source)
        }
        assert named <= handled


class TestSharedDeclarations:
    """drill and overlap take the run's own declarations, with their own defaults."""

    @pytest.mark.parametrize(
        ("name", "declaration", "default"),
        [
            ("ttl", flags.ttl, "10s"),
            ("kill_after", flags.kill_after, "2s"),
            ("heartbeat", flags.heartbeat, None),
        ],
    )
    def test_drill_takes_the_runs_timing_options(self, name, declaration, default):
        """drill's --ttl, --kill-after and --heartbeat: the run's kind and variable."""
        param = params(drill_command)[name]
        assert isinstance(param, click.Option)
        assert param.type is declaration.kind
        assert param.envvar == declaration.envvar
        assert param.default == default

    def test_overlap_takes_the_runs_timeout(self):
        """overlap's --timeout: the run's kind, its own default, and no variable."""
        param = params(overlap_command)["timeout"]
        assert isinstance(param, click.Option)
        assert param.type is flags.timeout.kind
        assert param.default == "60s"
        assert param.envvar is None


class TestFromParams:
    """Settings.from_params: the parsed options, checked against each other."""

    def test_defaults_give_a_session_run(self):
        """The command's defaults make settings with a 1 s heartbeat and no timeout."""
        context = cli.make_context("jobrun", ["--key", "k"], resilient_parsing=True)
        settings = Settings.from_params(context.params, run_keys=(), dsn_on_command_line=False)
        assert (settings.mode, settings.heartbeat, settings.timeout) == ("session", 1.0, None)

    def test_a_rule_between_two_options_is_a_usage_error(self):
        """--expect-grace without --expect-every is refused (exit 64) by from_params."""
        context = cli.make_context(
            "jobrun", ["--key", "k", "--expect-grace", "1m"], resilient_parsing=True
        )
        with pytest.raises(UsageError, match="--expect-grace goes with --expect-every"):
            Settings.from_params(context.params, run_keys=(), dsn_on_command_line=False)
