"""``jobrun [OPTIONS] -- COMMAND``: the run's options, checked, then handed to the runner."""

from __future__ import annotations

import click
from click.core import ParameterSource

from jobrun import __version__, assemble, keys
from jobrun.cli import options
from jobrun.cli.group import ARGV, BARE, PLACEMENT_RULE, JobrunGroup
from jobrun.exitcodes import Exit, UsageError
from jobrun.settings import Settings

#: Variables of the run's keys, and the option each stands for.
KEY_VARIABLES = {"key_names": "JOBRUN_KEY", "lock_ids": "JOBRUN_LOCK_ID"}


@click.group(
    cls=JobrunGroup,
    invoke_without_command=True,
    subcommand_metavar="-- COMMAND [ARGS]... | SUBCOMMAND [ARGS]...",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
    epilog=PLACEMENT_RULE,
)
@click.version_option(__version__, "--version", prog_name="jobrun", message="%(prog)s %(version)s")
@options.option(
    "--key",
    "key_names",
    multiple=True,
    envvar="JOBRUN_KEY",
    type=options.Lines(),
    metavar="NAME",
    help="Lock name (repeatable: all or nothing, in ascending lock-id order).",
)
@options.option(
    "--lock-id",
    "lock_ids",
    multiple=True,
    envvar="JOBRUN_LOCK_ID",
    type=options.Commas(),
    metavar="INT",
    help="Raw signed 64-bit lock id, for interop with code that locks numbers (repeatable).",
)
@options.database
@options.mode("session: advisory lock on a held connection; lease: TTL row, works through poolers.")
@options.option(
    "--wait",
    envvar="JOBRUN_WAIT",
    type=options.Duration(),
    default="0",
    show_default=True,
    metavar="DURATION",
    help="Wait this long for the lock before skipping.",
)
@options.option(
    "--wait-report",
    envvar="JOBRUN_WAIT_REPORT",
    type=options.Duration(minimum="1s", why="each report looks the holder up"),
    default="1m",
    show_default=True,
    metavar="DURATION",
    help="While --wait lasts, say who holds the lock this often (still_waiting events).",
)
@options.option(
    "--timeout",
    envvar="JOBRUN_TIMEOUT",
    type=options.Duration(),
    metavar="DURATION",
    help="Stop the child after this long (SIGTERM, then SIGKILL); exit 124. 0: never.",
)
@options.kill_after
@options.heartbeat
@options.ttl
@options.option(
    "--skip-exit-code",
    envvar="JOBRUN_SKIP_EXIT_CODE",
    type=click.IntRange(0, 255),
    default=int(Exit.SKIPPED),
    show_default=True,
    help="Exit status when the lock is held elsewhere.",
)
@options.option(
    "--on-db-error",
    envvar="JOBRUN_ON_DB_ERROR",
    type=click.Choice(["fail", "run"]),
    default="fail",
    show_default=True,
    help="Database unreachable: fail (exit 69) or run the child unguarded.",
)
@options.option(
    "--on-lock-lost",
    envvar="JOBRUN_ON_LOCK_LOST",
    type=click.Choice(["terminate", "ignore"]),
    default="terminate",
    show_default=True,
    help="Lock lost mid-run: stop the child (exit 76) or log and let it finish.",
)
@options.option(
    "--min-hold",
    envvar="JOBRUN_MIN_HOLD",
    type=options.Duration(),
    metavar="DURATION",
    help="Keep the lock at least this long after the start (hosts with skewed clocks skip).",
)
@options.option(
    "--once-per",
    envvar="JOBRUN_ONCE_PER",
    type=options.Duration(minimum="1s", why="it names a window, e.g. 1h or 1d"),
    metavar="DURATION",
    help="Skip (already_ran) if the key already ran in this UTC-aligned window, e.g. 1d.",
)
@options.option(
    "--no-history",
    envvar="JOBRUN_NO_HISTORY",
    is_flag=True,
    help="Do not record runs in jobrun.runs (no streak alerts, no --once-per).",
)
@options.option(
    "--keep",
    envvar="JOBRUN_KEEP",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="History kept per key: the newest N runs and N skips (and each host's newest skip).",
)
@options.option(
    "--alert-after",
    envvar="JOBRUN_ALERT_AFTER",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Error line (and --on-alert) after N skips or failures in a row; 0 disables.",
)
@options.option(
    "--alert-repeat",
    envvar="JOBRUN_ALERT_REPEAT",
    type=options.Duration(minimum="1s", why="a streak alerts again at most this often"),
    default="1h",
    show_default=True,
    metavar="DURATION",
    help="While a streak lasts, alert again at most this often (then once: recovered).",
)
@options.option(
    "--on-alert",
    envvar="JOBRUN_ON_ALERT",
    metavar="CMD",
    help="Command run on a streak alert (event JSON on stdin and in JOBRUN_ALERT_*).",
)
@options.option(
    "--metrics-file",
    envvar="JOBRUN_METRICS_FILE",
    metavar="PATH",
    help="Prometheus textfile written after each run or skip ({key} is replaced).",
)
@options.option(
    "--expect-every",
    envvar="JOBRUN_EXPECT_EVERY",
    type=options.Duration(minimum="1s", why="it is how often the job should succeed"),
    metavar="DURATION",
    help="The key should succeed this often: status --check says overdue past it plus grace.",
)
@options.option(
    "--expect-grace",
    envvar="JOBRUN_EXPECT_GRACE",
    type=options.Duration(),
    metavar="DURATION",
    help="Slack past --expect-every before a key is overdue (default: 10% of it).",
)
@options.option(
    "--slots",
    envvar="JOBRUN_SLOTS",
    type=click.IntRange(1, 256),
    default=1,
    show_default=True,
    metavar="N",
    help="At most N runs of the key at once (the child gets JOBRUN_SLOT, 0-based).",
)
@options.option(
    "--ping",
    envvar="JOBRUN_PING",
    metavar="URL",
    help="Healthchecks-style monitor: URL/start, URL/<exit status>, URL/log on a skip.",
)
@options.option(
    "--ping-timeout",
    envvar="JOBRUN_PING_TIMEOUT",
    type=options.Duration(minimum="100ms", why="a ping needs time to reach the monitor"),
    default="5s",
    show_default=True,
    metavar="DURATION",
    help="Longest one ping may take, retries included (never changes the exit status).",
)
@options.option(
    "--keep-output",
    envvar="JOBRUN_KEEP_OUTPUT",
    metavar="SIZE",
    help="Keep the last SIZE bytes (e.g. 16KiB) of stdout and stderr of failed runs.",
)
@options.option(
    "--fence",
    envvar="JOBRUN_FENCE",
    is_flag=True,
    help="Give the child a fencing token in JOBRUN_FENCE_TOKEN (greater than any earlier one).",
)
@options.option(
    "--pass-env",
    "pass_env",
    multiple=True,
    envvar="JOBRUN_PASS_ENV",
    type=options.VariableName(),
    metavar="NAME",
    help="Give the child and the hook this variable of jobrun's own that can hold a secret "
    "(JOBRUN_DSN, JOBRUN_PING, JOBRUN_ON_ALERT): withheld otherwise (repeatable).",
)
@options.option(
    "--mask-env",
    "mask_env",
    multiple=True,
    envvar="JOBRUN_MASK_ENV",
    type=options.VariableName(),
    metavar="NAME",
    help="Mask this variable's value (as ***) in kept output, pings and the alert hook's "
    "event, like the DSN's password (repeatable).",
)
@options.log
@click.pass_context
def cli(
    ctx: click.Context,
    /,
    *,
    key_names: tuple[str, ...],
    lock_ids: tuple[str, ...],
    dsn: str,
    connect_timeout: float,
    mode: str,
    wait: float,
    wait_report: float,
    timeout: float | None,
    kill_after: float,
    heartbeat: float | None,
    ttl: float,
    skip_exit_code: int,
    on_db_error: str,
    on_lock_lost: str,
    min_hold: float | None,
    once_per: float | None,
    no_history: bool,
    keep: int,
    alert_after: int,
    alert_repeat: float,
    on_alert: str | None,
    metrics_file: str | None,
    expect_every: float | None,
    expect_grace: float | None,
    slots: int,
    ping: str | None,
    ping_timeout: float,
    keep_output: str | None,
    fence: bool,
    pass_env: tuple[str, ...],
    mask_env: tuple[str, ...],
    log_format: str,
    log_file: str | None,
    log_level: str,
) -> int | None:
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
    run_keys = _keys(ctx, key_names, lock_ids)
    fence = fence or _old_fence_variable(ctx)
    lifetime = 0.0
    if mode == "lease":
        from jobrun.locks.lease import LeaseTiming

        lease = LeaseTiming.from_options(ttl=ttl, kill_after=kill_after, heartbeat=heartbeat)
        heartbeat, lifetime = lease.heartbeat, lease.lifetime
    if once_per is not None and no_history:
        raise UsageError("--once-per needs the run history: drop --no-history")
    if expect_every is not None and no_history:
        raise UsageError("--expect-every is kept in the run history: drop --no-history")
    if slots > 1 and (len(run_keys) != 1 or run_keys[0].name is None):
        raise UsageError("--slots takes one key name (--key NAME)")
    if expect_grace is not None and expect_every is None:
        raise UsageError("--expect-grace goes with --expect-every")
    _check_pass_env(ctx, pass_env)
    settings = Settings(
        run_keys=run_keys,
        mode=mode,
        dsn=dsn,
        dsn_on_command_line=ctx.get_parameter_source("dsn") == ParameterSource.COMMANDLINE,
        connect_timeout=connect_timeout,
        wait=wait,
        wait_report=wait_report,
        timeout=timeout or None,
        kill_after=kill_after,
        heartbeat=heartbeat or 1.0,
        ttl=ttl,
        lifetime=lifetime,
        min_hold=min_hold or None,
        once_per=once_per,
        skip_exit_code=skip_exit_code,
        on_db_error=on_db_error,
        on_lock_lost=on_lock_lost,
        no_history=no_history,
        keep=keep,
        alert_after=alert_after,
        alert_repeat=alert_repeat,
        on_alert=on_alert,
        metrics_file=metrics_file,
        expect_every=expect_every,
        expect_grace=(
            None
            if expect_every is None
            else expect_grace
            if expect_grace is not None
            else expect_every / 10
        ),
        slots=slots,
        ping=ping,
        ping_timeout=ping_timeout,
        keep_output=keep_output,
        fence=fence,
        pass_env=pass_env,
        mask_env=mask_env,
        log_format=log_format,
        log_file=log_file,
        log_level=log_level,
    )
    return assemble.run(argv, settings)


def _check_pass_env(ctx: click.Context, names: tuple[str, ...]) -> None:
    """Only a withheld variable can be passed: any other reaches the child already."""
    from jobrun.masking import WITHHELD

    for name in names:
        if name not in WITHHELD:
            param = next(param for param in ctx.command.params if param.name == "pass_env")
            where = options.source_of(param, ctx)
            raise UsageError(
                f"{where} {name}: only jobrun's own variables that can hold a secret are "
                f"withheld ({', '.join(WITHHELD)}); every other variable reaches the child"
            )


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

    raw = os.environ.get(options.OLD_FENCE_VARIABLE)
    if raw is None or ctx.get_parameter_source("fence") != ParameterSource.DEFAULT:
        return False
    try:
        return bool(click.BOOL.convert(raw, None, ctx))
    except click.BadParameter:
        raise UsageError(
            f"{options.OLD_FENCE_VARIABLE} (the old variable for --fence): {raw!r} is not a boolean"
        ) from None


def _keys(
    ctx: click.Context, key_names: tuple[str, ...], lock_ids: tuple[str, ...]
) -> tuple[keys.Key, ...]:
    """The run's keys; with --key or --lock-id on the command line, the variables are ignored.

    A flag wins over its variable, and the two name one thing: the keys. This is what lets
    a jobrun inside a guarded child (which inherits JOBRUN_KEY and JOBRUN_LOCK_ID) take
    just the keys it is given. A bad value from a variable is reported under its name.
    """
    given = {"key_names": key_names, "lock_ids": lock_ids}
    sources = {name: ctx.get_parameter_source(name) for name in given}
    if ParameterSource.COMMANDLINE in sources.values():
        for name, source in sources.items():
            if source == ParameterSource.ENVIRONMENT:
                given[name] = ()
    for name, values in given.items():
        if sources[name] == ParameterSource.ENVIRONMENT and values:
            try:
                keys.resolve(*(values if n == name else () for n in KEY_VARIABLES))
            except UsageError as exc:
                raise UsageError(f"{KEY_VARIABLES[name]}: {exc}") from None
    return keys.resolve(given["key_names"], given["lock_ids"])
