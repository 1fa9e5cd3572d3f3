"""Every option and value type of the command line, declared once, and the database target."""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from jobrun import durations
from jobrun.exitcodes import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

    import psycopg

    from jobrun import db

MODES = ("session", "lease")
#: --fence's variable before it was named after the flag: still read, with a warning event.
OLD_FENCE_VARIABLE = "JOBRUN_FENCING"
#: ctx.meta key: the group's context, when a subcommand follows the group's options.
SUBCOMMAND_FOLLOWS = "jobrun.subcommand_follows"


def target(dsn: str, connect_timeout: float, *, warn: bool = True) -> db.Target:
    """The database a command uses; a password given in --dsn is warned about on stderr.

    (A run warns with its ``password_on_command_line`` event instead: ``warn=False``.)
    """
    from jobrun import db

    def still_connecting() -> None:
        click.echo(
            f"jobrun: still connecting to {db.describe(built)} (no answer yet; "
            f"giving up after --connect-timeout {durations.format_seconds(connect_timeout)})",
            err=True,
        )

    built = db.Target(dsn=dsn, connect_timeout=connect_timeout, on_slow_connect=still_connecting)
    context = click.get_current_context(silent=True)
    on_command_line = (
        context is not None and context.get_parameter_source("dsn") == ParameterSource.COMMANDLINE
    )
    if warn and on_command_line and built.has_password:
        click.echo(
            "jobrun: warning: a password in --dsn is visible to every user in ps; use "
            "~/.pgpass, PGPASSFILE or JOBRUN_DSN instead",
            err=True,
        )
    return built


@contextlib.contextmanager
def connected(
    dsn: str, connect_timeout: float, *, app_name: str, doing: str
) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """A subcommand's one connection; psycopg errors inside it become exit 69.

    ``doing`` names what was under way, for the error line.
    """
    from jobrun import db

    where = target(dsn, connect_timeout)
    with db.connect(where, app_name=app_name) as conn, db.translate_errors(where, doing):
        yield conn


def source_of(param: click.Parameter | None, ctx: click.Context | None) -> str:
    """Where a value came from, for an error message: ``--wait`` or ``JOBRUN_WAIT``."""
    if param is None:
        return "value"
    flag = param.opts[0] if param.opts else param.human_readable_name
    envvar = getattr(param, "envvar", None)
    if (
        ctx is not None
        and param.name is not None
        and isinstance(envvar, str)
        and ctx.get_parameter_source(param.name) == ParameterSource.ENVIRONMENT
    ):
        return f"{envvar} (the variable for {flag})"
    return flag


class JobrunOption(click.Option):
    """An option that shows its variable in ``--help`` and names it in errors it caused.

    On the group, the variables are not read when a subcommand follows: they configure a
    run, and a bad ``JOBRUN_WAIT`` must not break ``jobrun key`` or ``jobrun status``. The
    subcommands declare the options they use (``--dsn``...) and read those variables
    themselves.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("show_envvar", True)
        super().__init__(*args, **kwargs)

    def get_error_hint(self, ctx: click.Context | None) -> str:
        """``'--mode'``, or ``JOBRUN_MODE (the variable for --mode)`` if it came from there."""
        where = source_of(self, ctx)
        return where if where != self.opts[0] else f"'{where}'"

    def resolve_envvar_value(self, ctx: click.Context) -> str | None:
        """The variable's value, unless this is the group and a subcommand follows."""
        if ctx.meta.get(SUBCOMMAND_FOLLOWS) is ctx:
            return None
        return super().resolve_envvar_value(ctx)


class Duration(click.ParamType):  # type: ignore[type-arg]
    """``90``, ``30s``, ``5m``, ``1h30m``, ``250ms``, ``1d`` -> seconds (float)."""

    name = "duration"

    def __init__(self, minimum: str = "0", why: str = "") -> None:
        #: As written in messages (``100ms``), and in seconds.
        self.minimum_text = minimum
        self.minimum = durations.parse(minimum)
        self.why = why

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Seconds; a usage error that names the flag or the variable the text came from."""
        if isinstance(value, float):
            return value
        where = source_of(param, ctx)
        seconds = durations.parse(str(value), option=where)
        if seconds < self.minimum:
            raise UsageError(
                f"{where} must be at least {self.minimum_text}"
                + (f" ({self.why})" if self.why else "")
            )
        return seconds


class WarnAfter(Duration):
    """``--warn-after``: a duration, or ``auto`` (derived from the key's past successes)."""

    name = "duration|auto"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """Seconds, or the text ``auto``."""
        if isinstance(value, str) and value.strip().lower() == "auto":
            return "auto"
        try:
            return super().convert(value, param, ctx)
        except UsageError as exc:
            raise UsageError(f"{exc}; or auto") from None


class Zone(click.ParamType):  # type: ignore[type-arg]
    """An IANA time zone name (``Europe/Berlin``), checked against the zone database."""

    name = "zone"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The name; a usage error naming the flag or variable when no zone has it."""
        import zoneinfo  # only when a zone is given

        text = str(value).strip()
        try:
            # A path (``../etc``) or an empty name is no zone: zoneinfo raises ValueError.
            zoneinfo.ZoneInfo(text)
        except (zoneinfo.ZoneInfoNotFoundError, ValueError):
            raise UsageError(
                f"{source_of(param, ctx)}: {text!r} is not a time zone name "
                "(an IANA name such as UTC, Europe/Berlin or America/New_York)"
            ) from None
        return text


class Lines(click.ParamType):  # type: ignore[type-arg]
    """Text whose environment variable holds one value per line (key names)."""

    name = "text"
    envvar_list_splitter = "\n"

    def split_envvar_value(self, rv: str) -> list[str]:
        """The values in the variable; blank ones (a trailing newline) are not values."""
        return [part for part in rv.split(self.envvar_list_splitter) if part.strip()]

    def convert(
        self, value: Any, _param: click.Parameter | None, _ctx: click.Context | None
    ) -> Any:
        """Keep the text; keys are validated together, once the flags have won."""
        return str(value)


class VariableName(click.ParamType):  # type: ignore[type-arg]
    """The name of an environment variable (letters, digits, ``_``; not a digit first)."""

    name = "name"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The name; a usage error naming the flag or variable when it cannot be one."""
        text = str(value)
        if re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", text) is None:
            where = source_of(param, ctx)
            raise UsageError(f"{where}: {text!r} is not an environment variable name")
        return text


class PassedName(VariableName):
    """The name of one of jobrun's own variables that are withheld from the child (--pass-env).

    Only a withheld variable can be passed: any other reaches the child already.
    """

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        """The name; a usage error naming the flag or variable when it is not withheld."""
        from jobrun.masking import WITHHELD

        name = super().convert(value, param, ctx)
        # Before a subcommand, --pass-env is misplaced: the subcommand says so instead.
        subcommand_follows = ctx is not None and ctx.meta.get(SUBCOMMAND_FOLLOWS) is ctx
        if name not in WITHHELD and not subcommand_follows:
            raise UsageError(
                f"{source_of(param, ctx)} {name}: only jobrun's own variables that can hold a "
                f"secret are withheld ({', '.join(WITHHELD)}); every other variable reaches "
                "the child"
            )
        return name


class Commas(Lines):
    """Text whose environment variable holds comma-separated values (lock ids)."""

    envvar_list_splitter = ","


def option(*names: str, **kwargs: Any) -> Callable[[Any], Any]:
    """``click.option`` with JobrunOption: variables shown in help, named in errors."""
    return click.option(*names, cls=JobrunOption, **kwargs)


#: Option's fields, in the order of its arguments.
_FIELDS = ("flag", "kind", "default", "help", "name", "metavar", "multiple", "is_flag", "variable")


class Option:
    """One option declared once: flag, kind of value, default, help; its variable follows.

    The variable is JOBRUN_ and the flag's name (``--kill-after``: JOBRUN_KILL_AFTER). A
    command that needs another default or help says so with :meth:`but`, on the same
    declaration. Used as a decorator, it adds itself to a click command. Immutable.

    A class of its own rather than a dataclass: making a dataclass compiles its generated
    methods, a few milliseconds of every start (``jobrun key``, ``--help``) for nothing.
    """

    __slots__ = _FIELDS

    flag: str
    #: The kind of value (None: text; ``is_flag``: a boolean switch).
    kind: click.ParamType[Any] | None
    default: Any
    help: str
    #: The parameter's name, where it is not the flag's (``--key``: ``key_names``).
    name: str | None
    metavar: str | None
    multiple: bool
    is_flag: bool
    #: False: no environment variable (an option whose value means something else there).
    variable: bool

    def __init__(
        self,
        flag: str,
        kind: click.ParamType[Any] | None = None,
        *,
        default: Any = None,
        help: str = "",  # noqa: A002 - click's name for it
        name: str | None = None,
        metavar: str | None = None,
        multiple: bool = False,
        is_flag: bool = False,
        variable: bool = True,
    ) -> None:
        values = (flag, kind, default, help, name, metavar, multiple, is_flag, variable)
        for field, value in zip(_FIELDS, values, strict=True):
            object.__setattr__(self, field, value)

    def _values(self) -> tuple[Any, ...]:
        return tuple(getattr(self, field) for field in _FIELDS)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"Option is immutable: {name} is set with but()")

    def __eq__(self, other: object) -> bool:
        return type(other) is Option and self._values() == other._values()

    def __hash__(self) -> int:
        return hash(self._values())

    def __repr__(self) -> str:
        fields = ", ".join(f"{f}={getattr(self, f)!r}" for f in _FIELDS)
        return f"Option({fields})"

    @property
    def envvar(self) -> str | None:
        """``JOBRUN_`` and the flag's name, upper case; None without a variable."""
        if not self.variable:
            return None
        return "JOBRUN_" + self.flag.removeprefix("--").upper().replace("-", "_")

    @property
    def param_name(self) -> str:
        """The name click hands the value over under (``kill_after``)."""
        return self.name or self.flag.removeprefix("--").replace("-", "_")

    def but(self, **changes: Any) -> Option:
        """The same option with another default, help... for one command."""
        return Option(**{**dict(zip(_FIELDS, self._values(), strict=True)), **changes})

    def __call__(self, command: Any) -> Any:
        """Add the option to ``command`` (a click command, or its function)."""
        shown = self.default is not None and self.default != "" and not self.is_flag
        metavar = self.metavar
        if metavar is None and isinstance(self.kind, Duration):
            metavar = "DURATION"
        return click.option(
            self.flag,
            *([self.name] if self.name else []),
            cls=JobrunOption,
            envvar=self.envvar,
            type=self.kind,
            default=self.default,
            show_default=shown,
            metavar=metavar,
            multiple=self.multiple,
            is_flag=self.is_flag,
            help=self.help,
        )(command)


def stack(*decorators: Callable[[Any], Any]) -> Callable[[Any], Any]:
    """One decorator that applies ``decorators`` as if written one above the other."""

    def apply(command: Any) -> Any:
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


dsn = Option(
    "--dsn",
    default="",
    metavar="DSN",
    help="libpq connection string or URI; default: PG* variables, service file, ~/.pgpass. "
    "Prefer JOBRUN_DSN or .pgpass for passwords.",
)
connect_timeout = Option(
    "--connect-timeout",
    Duration(),
    default="10s",
    help="Give up connecting after this long (exit 69).",
)
#: --dsn and --connect-timeout: every command that talks to the database.
database = stack(dsn, connect_timeout)

#: --mode; each command says what the mode is for (see :func:`mode`).
lock_mode = Option("--mode", click.Choice(MODES), default="session")


def mode(help_text: str) -> Option:
    """--mode session|lease (JOBRUN_MODE), with the command's own help."""
    return lock_mode.but(help=help_text)


def count(flag: str, *, default: int, help_text: str) -> Option:
    """A subcommand's count (``history --limit``, ``overlap --runs``): 1 to 100 000, no variable."""
    return Option(flag, click.IntRange(1, 100_000), default=default, help=help_text, variable=False)


as_json = click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
#: A table in full: every column, nothing shortened (without it: 120 columns at most).
wide = Option(
    "--wide",
    is_flag=True,
    variable=False,
    help="Every column, nothing shortened (without it the table fits 120 columns: long "
    "keys, holders and notes end in …).",
)

#: Times shown in a zone (``status``, ``history``): UTC unless given.
tz = Option(
    "--tz",
    Zone(),
    metavar="ZONE",
    help="Show times in this IANA time zone (e.g. Europe/Berlin) instead of UTC.",
)

#: Reading server and scheduler logs (``deadlocks`` and ``timeline``).
log_line_prefix = click.option(
    "--log-line-prefix",
    "prefix",
    metavar="PREFIX",
    help="The server's log_line_prefix, for a stderr log whose layout is not guessed.",
)
assume_duration = click.option(
    "--assume-duration",
    type=Duration(minimum="1s"),
    default="1h",
    show_default=True,
    metavar="DURATION",
    help="How long a cron run whose end is not logged (Debian's cron) is taken to last, "
    "unless the same command starts again sooner.",
)

log_format = Option(
    "--log-format",
    click.Choice(["auto", "json", "logfmt", "console"]),
    default="auto",
    help="Event line format; auto = console on a terminal, JSON otherwise.",
)
log_file = Option(
    "--log-file",
    metavar="PATH",
    help="Append events here instead of stderr (safe with concurrent writers).",
)
log_level = Option(
    "--log-level",
    click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    help="Least severe event to write.",
)
log = stack(log_format, log_file, log_level)

#: Each beat is a query: not more often than this.
MIN_HEARTBEAT = "100ms"
timeout = Option(
    "--timeout",
    Duration(),
    help="Stop the child after this long (SIGTERM, then SIGKILL); exit 124. 0: never.",
)
kill_after = Option(
    "--kill-after",
    Duration(),
    default="10s",
    help="Grace between SIGTERM and SIGKILL when jobrun stops the child.",
)
heartbeat = Option(
    "--heartbeat",
    Duration(minimum=MIN_HEARTBEAT, why="each beat is a query"),
    help="How often the lock is checked (session, default 1s) or renewed (lease).",
)
ttl = Option(
    "--ttl",
    Duration(),
    default="30s",
    help="Lease lifetime without renewal (lease mode).",
)
