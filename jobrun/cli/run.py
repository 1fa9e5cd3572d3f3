"""``jobrun [OPTIONS] -- COMMAND``: the run's options, checked, then handed to the runner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from jobrun import __version__
from jobrun.cli.group import ARGV, BARE, PLACEMENT_RULE, JobrunGroup
from jobrun.exitcodes import Exit, UsageError

if TYPE_CHECKING:
    from jobrun import keys  # here, not with the module: --help has no use for it

__all__ = ["cli", "run_options"]


def run_options() -> list[click.Parameter]:
    """The run's options, made from their declarations (jobrun.run.settings).

    Made when the group's options are first asked for: ``jobrun SUBCOMMAND ...`` with no
    option before the subcommand never needs them, and making them (with the settings they
    come from) is most of what ``jobrun key NAME`` would cost beyond click itself.
    """
    from jobrun import flags
    from jobrun.run.settings import KEY_NAMES, LOCK_IDS, declarations

    def holder() -> None:
        pass

    flags.stack(KEY_NAMES, LOCK_IDS, *declarations())(holder)
    # In the order written (click's own decorators collect them last first).
    return list(reversed(holder.__click_params__))  # type: ignore[attr-defined]


@click.group(
    cls=JobrunGroup,
    run_options=run_options,
    invoke_without_command=True,
    subcommand_metavar="-- COMMAND [ARGS]... | SUBCOMMAND [ARGS]...",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=PLACEMENT_RULE,
)
@click.version_option(__version__, "--version", prog_name="jobrun", message="%(prog)s %(version)s")
@click.pass_context
def cli(ctx: click.Context, /, **params: Any) -> int | None:
    """Run COMMAND at most once at a time, guarded by a PostgreSQL lock.

    \b
      jobrun --key nightly-export -- ./export.sh
      jobrun key nightly-export          print the lock id of a key
      jobrun help SUBCOMMAND             help on a subcommand

    Every option can also be set from the environment variable shown with it.
    Exit status: the child's own; 75 skipped; 69 database unavailable; 64 usage error;
    76 lock lost; 77 stopped (jobrun stop); 124 timed out; 126/127 command not executable /
    not found; 74 output error; 141 output pipe closed.
    """
    if ctx.invoked_subcommand is not None:
        return None
    argv: tuple[str, ...] | None = ctx.meta.get(ARGV)
    if ctx.meta.get(BARE):
        # A bare `jobrun` is someone finding out how to use it: the usage, not an error.
        click.echo(
            f"{ctx.get_usage()}\n\n{_EXAMPLES}\nTry 'jobrun --help' for every option.", err=True
        )
        return int(Exit.USAGE)
    if not argv:
        raise UsageError("no command given: jobrun --key NAME -- COMMAND [ARGS]...")
    if not argv[0]:
        raise UsageError("the command after '--' is an empty string")
    from jobrun.run.settings import Settings

    run_keys = _keys(ctx, params["key_names"], params["lock_ids"])
    fence = params["fence"] or _old_fence_variable(ctx)
    settings = Settings.from_params(
        {**params, "fence": fence},
        run_keys=run_keys,
        dsn_on_command_line=ctx.get_parameter_source("dsn") == ParameterSource.COMMANDLINE,
    )
    from jobrun.run import assemble  # a run's whole assembly: not imported for --help

    return assemble.run(argv, settings)


#: The short usage's examples (the same as the first lines of ``jobrun --help``).
_EXAMPLES = """\
  jobrun --key nightly-export -- ./export.sh   run a command, at most one at a time
  jobrun key nightly-export                    print the lock id of a key
  jobrun help SUBCOMMAND                       help on a subcommand
"""


def _old_fence_variable(ctx: click.Context) -> bool:
    """JOBRUN_FENCING, --fence's old variable: read when neither the flag nor JOBRUN_FENCE is.

    (The run logs a ``deprecated_variable`` warning while it is set.)
    """
    import os

    from jobrun import flags

    raw = os.environ.get(flags.OLD_FENCE_VARIABLE)
    if raw is None or ctx.get_parameter_source("fence") != ParameterSource.DEFAULT:
        return False
    try:
        return bool(click.BOOL.convert(raw, None, ctx))
    except click.BadParameter:
        raise UsageError(
            f"{flags.OLD_FENCE_VARIABLE} (the old variable for --fence): {raw!r} is not a boolean"
        ) from None


def _keys(
    ctx: click.Context, key_names: tuple[str, ...], lock_ids: tuple[str, ...]
) -> tuple[keys.Key, ...]:
    """The run's keys; with --key or --lock-id on the command line, the variables are ignored.

    A flag wins over its variable, and the two name one thing: the keys. This is what lets
    a jobrun inside a guarded child (which inherits JOBRUN_KEY and JOBRUN_LOCK_ID) take
    just the keys it is given. A bad value from a variable is reported under its name.
    """
    from jobrun import keys
    from jobrun.run.settings import KEY_NAMES, LOCK_IDS

    #: Variables of the run's keys, and the option each stands for.
    variables = {option.param_name: option.envvar for option in (KEY_NAMES, LOCK_IDS)}
    given = {"key_names": key_names, "lock_ids": lock_ids}
    sources = {name: ctx.get_parameter_source(name) for name in given}
    if ParameterSource.COMMANDLINE in sources.values():
        for name, source in sources.items():
            if source == ParameterSource.ENVIRONMENT:
                given[name] = ()
    for name, values in given.items():
        if sources[name] == ParameterSource.ENVIRONMENT and values:
            try:
                keys.resolve(*(values if n == name else () for n in variables))
            except UsageError as exc:
                raise UsageError(f"{variables[name]}: {exc}") from None
    return keys.resolve(given["key_names"], given["lock_ids"])
