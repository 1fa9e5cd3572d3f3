"""The ``jobrun`` group: a run or a subcommand, and where the options written before it go."""

from __future__ import annotations

import importlib
import os
import sys
from typing import TYPE_CHECKING, Any

import click
from click import formatting

from jobrun.cli.subcommands import SUBCOMMANDS
from jobrun.exitcodes import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable, Collection

#: ctx.meta keys: the guarded command's argv; the group's options given before a subcommand;
#: set when jobrun was started with no argument at all.
ARGV = "jobrun.argv"
BEFORE = "jobrun.before"
BARE = "jobrun.bare"
#: Set while the group parses ``SUBCOMMAND ...``: nothing before it, no option to parse.
_ALONE = "jobrun.subcommand_alone"
#: The group's options that name the keys of a run.
KEY_OPTIONS = ("key_names", "lock_ids")

PLACEMENT_RULE = (
    "An option written before a subcommand applies to it when the subcommand has that "
    "option (jobrun --dsn D status is jobrun status --dsn D); any other option there is a "
    "usage error, never silently ignored."
)


def terminal_columns() -> int:
    """The terminal's width as ``shutil.get_terminal_size().columns`` says it (80 if unknown).

    Without importing shutil: it brings zlib, bz2 and lzma, a few milliseconds of
    ``jobrun --help`` for nothing. $COLUMNS first, then the terminal of stdout.
    """
    try:
        columns = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        columns = 0
    if columns <= 0:
        try:
            columns = os.get_terminal_size(sys.__stdout__.fileno()).columns  # type: ignore[union-attr]
        except (AttributeError, ValueError, OSError):
            columns = 0
    return columns or 80


class HelpFormatter(click.HelpFormatter):
    """click's help formatter, its width reckoned as click does but by terminal_columns()."""

    def __init__(
        self, indent_increment: int = 2, width: int | None = None, max_width: int | None = None
    ) -> None:
        if width is None and formatting.FORCED_WIDTH is None:
            width = max(min(terminal_columns(), max_width or 80) - 2, 50)
        super().__init__(indent_increment, width, max_width)


class Context(click.Context):
    """A context whose help is laid out by HelpFormatter."""

    formatter_class = HelpFormatter


class JobrunGroup(click.Group):
    """Runs ``jobrun [OPTIONS] -- COMMAND...`` itself, and has subcommands.

    Options written before a subcommand are handed to it (see Subcommand); the group's
    environment variables are not read then, since they configure a run. A subcommand's
    module is imported when the subcommand is used (jobrun.cli.subcommands).

    ``run_options``: makes the run's options, the first time ``params`` is read. A
    subcommand written first (``jobrun key NAME``) is parsed without them: the many options
    of a run, and the settings they are declared in, are then never made.
    """

    context_class = Context

    def __init__(
        self,
        *args: Any,
        run_options: Callable[[], list[click.Parameter]] | None = None,
        **kwargs: Any,
    ) -> None:
        self._run_options = run_options
        self._params: list[click.Parameter] = []
        super().__init__(*args, **kwargs)

    @property
    def params(self) -> list[click.Parameter]:
        """The group's own options (--version), then the run's, made now if not yet."""
        if self._run_options is not None:
            made, self._run_options = self._run_options, None
            self._params.extend(made())
        return self._params

    @params.setter
    def params(self, value: list[click.Parameter]) -> None:
        self._params = value

    def get_params(self, ctx: click.Context) -> list[click.Parameter]:
        """The options to parse: none with a subcommand first (nothing precedes it)."""
        if ctx.meta.get(_ALONE):
            return []
        return super().get_params(ctx)

    def list_commands(self, ctx: click.Context) -> list[str]:  # noqa: ARG002 - click's signature
        """Every subcommand's name, none of them imported."""
        return sorted({*self.commands, *SUBCOMMANDS})

    def get_command(
        self,
        ctx: click.Context,  # noqa: ARG002 - click's signature
        cmd_name: str,
    ) -> click.Command | None:
        """The subcommand ``cmd_name``, imported now if it was not yet; None if there is none."""
        command = self.commands.get(cmd_name)
        lazy = SUBCOMMANDS.get(cmd_name)
        if command is None and lazy is not None:
            command = getattr(importlib.import_module(lazy.module), lazy.attribute)
            self.add_command(command, cmd_name)
        return command

    def format_commands(
        self,
        ctx: click.Context,  # noqa: ARG002 - click's signature
        formatter: click.HelpFormatter,
    ) -> None:
        """The subcommands' one-line help from the table, without importing them."""
        rows = [(name, SUBCOMMANDS[name].summary) for name in sorted(SUBCOMMANDS)]
        with formatter.section("Commands"):
            formatter.write_dl(rows)

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Take ``-- COMMAND...`` aside, or note the options given before a subcommand."""
        if not args:
            ctx.meta[BARE] = True
        elif args[0] in SUBCOMMANDS or args[0] in self.commands:
            # `jobrun SUBCOMMAND ...`: no option of the group's to parse, none to make.
            ctx.meta[_ALONE] = True
            try:
                return super().parse_args(ctx, args)
            finally:
                del ctx.meta[_ALONE]
        from jobrun.flags import SUBCOMMAND_FOLLOWS

        split = args.index("--") if "--" in args else len(args)
        opts, positional, _ = self.make_parser(ctx).parse_args(args=list(args[:split]))
        if positional:  # `jobrun [OPTIONS] SUBCOMMAND ...`
            ctx.meta[SUBCOMMAND_FOLLOWS] = ctx
            ctx.meta[BEFORE] = {
                param.name: (param, opts[param.name])
                for param in self.get_params(ctx)
                if param.name in opts and isinstance(param, click.Option) and not param.is_eager
            }
        elif split < len(args):  # no subcommand before "--": the guarded command follows
            ctx.meta[ARGV] = tuple(args[split + 1 :])
            args = args[:split]
        return super().parse_args(ctx, args)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """Say how to run a command when someone forgot the ``--``."""
        if args and self.get_command(ctx, args[0]) is None:
            raise click.UsageError(
                f"unknown subcommand {args[0]!r}; to run a command, put it after '--': "
                f"jobrun --key NAME -- {args[0]} ..."
            )
        return super().resolve_command(ctx, args)


class Subcommand(click.Command):
    """A subcommand that takes the group's options written before its name, or refuses them.

    ``takes`` names the group options it shares (they are passed on as if written after
    the subcommand's name); ``keys_as`` says what ``--key``/``--lock-id`` before it become:
    ``"option"`` (its own ``--key NAME``), ``"label"`` (a KEY argument: the run's label, as
    ``status`` prints it) or nothing (a usage error).
    """

    context_class = Context

    def __init__(
        self,
        *args: Any,
        takes: Collection[str] = (),
        keys_as: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.takes = frozenset(takes)
        self.keys_as = keys_as

    def make_context(
        self,
        info_name: str | None,
        args: list[str],
        parent: click.Context | None = None,
        **extra: Any,
    ) -> click.Context:
        """Parse ``args`` with the options given before the subcommand's name put in front."""
        before = parent.meta.get(BEFORE) if parent is not None else None
        if before:
            args = self._with_options_before(info_name or self.name or "", before, args, parent)
        return super().make_context(info_name, args, parent, **extra)

    def _with_options_before(
        self,
        name: str,
        before: dict[str, tuple[click.Option, Any]],
        args: list[str],
        parent: click.Context | None,
    ) -> list[str]:
        after_opts, after_positional = self._parse_alone(name, args, parent)
        front: list[str] = []
        for option_name, (param, raw) in before.items():
            flag = param.opts[0]
            if option_name in KEY_OPTIONS:
                continue
            if option_name not in self.takes:
                raise UsageError(_misplaced(flag, name, self))
            if option_name in after_opts:
                raise UsageError(f"{flag} is given both before and after {name!r}: give it once")
            values = raw if isinstance(raw, list) else [raw]
            for value in values:
                front += [flag] if param.is_flag else [flag, value]
        names = list(before.get("key_names", (None, []))[1])
        lock_ids = list(before.get("lock_ids", (None, []))[1])
        if names or lock_ids:
            return self._with_keys(
                name,
                names,
                lock_ids,
                front + args,
                given_after=set(after_opts),
                positional_after=bool(after_positional),
            )
        return front + args

    def _with_keys(
        self,
        name: str,
        names: list[str],
        lock_ids: list[str],
        args: list[str],
        *,
        given_after: set[str],
        positional_after: bool,
    ) -> list[str]:
        from jobrun import keys

        if self.keys_as == "option":
            if lock_ids or len(names) != 1:
                raise UsageError(
                    f"'jobrun {name}' takes one key name (--key NAME), "
                    + ("not --lock-id" if lock_ids else f"not {len(names)}")
                )
            if "key_name" in given_after:
                raise UsageError(f"--key is given both before and after {name!r}: give it once")
            return ["--key", names[0], *args]
        if self.keys_as == "label":
            if positional_after:
                raise UsageError(
                    f"the key is given both before {name!r} (--key/--lock-id) and after it"
                )
            label = keys.describe(keys.resolve(tuple(names), tuple(lock_ids)))
            return [*args, label] if "--" in args else [*args, "--", label]
        flag = "--key" if names else "--lock-id"
        raise UsageError(_misplaced(flag, name, self))

    def _parse_alone(
        self, name: str, args: list[str], parent: click.Context | None
    ) -> tuple[dict[str, Any], list[str]]:
        """The options and arguments written after the subcommand's name."""
        ctx = click.Context(self, info_name=name, parent=parent, resilient_parsing=True)
        try:
            opts, positional, _ = self.make_parser(ctx).parse_args(args=list(args))
        except click.UsageError:
            return {}, []  # the real parse reports it
        return opts, positional


def _misplaced(flag: str, name: str, command: click.Command) -> str:
    own = any(flag in param.opts for param in command.params)
    if own:
        return (
            f"{flag} before {name!r} is the run's option, not {name!r}'s: "
            f"put it after {name!r} (jobrun {name} {flag} ...)"
        )
    return (
        f"{flag} does not apply to 'jobrun {name}' (it is an option of a run: "
        f"jobrun {flag} ... -- COMMAND); see 'jobrun {name} --help'"
    )
