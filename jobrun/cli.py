"""The command line: parse, validate, wire the collaborators, exit. No SQL, no processes here."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any, NamedTuple, NoReturn

import click
from click.core import ParameterSource

from jobrun import __version__, durations, keys
from jobrun.exitcodes import Exit, JobrunError, UsageError
from jobrun.options import MODES, db_options, log_options

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from jobrun import db, history
    from jobrun.locks import Identity

_ARGV = "jobrun.argv"
STDIN, STDOUT, STDERR = 0, 1, 2
MIN_HEARTBEAT = 0.1


class _Lines(click.ParamType):  # type: ignore[type-arg]
    """A string option whose environment variable holds one value per line (key names)."""

    name = "text"
    envvar_list_splitter = "\n"

    def split_envvar_value(self, rv: str) -> list[str]:
        """The values in the variable; blank ones (a trailing newline) are not values."""
        return [part for part in rv.split(self.envvar_list_splitter) if part.strip()]

    def convert(
        self, value: Any, _param: click.Parameter | None, _ctx: click.Context | None
    ) -> Any:
        """Keep the text as it is; keys and lock ids are validated together later."""
        return str(value)


class _Commas(_Lines):
    """A string option whose environment variable holds comma-separated values (lock ids)."""

    envvar_list_splitter = ","


class JobrunGroup(click.Group):
    """A group that runs ``jobrun [OPTIONS] -- COMMAND...`` itself and also has subcommands."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        """Take ``-- COMMAND...`` aside when no subcommand comes before it."""
        if "--" in args:
            split = args.index("--")
            parser = self.make_parser(ctx)
            _, positional, _ = parser.parse_args(args=list(args[:split]))
            if not positional:  # no subcommand before "--": the guarded command follows
                ctx.meta[_ARGV] = tuple(args[split + 1 :])
                args = args[:split]
        return super().parse_args(ctx, args)

    def resolve_command(
        self, ctx: click.Context, args: list[str]
    ) -> tuple[str | None, click.Command | None, list[str]]:
        """Say how to run a command when someone forgot the ``--``."""
        if args and args[0] not in self.commands:
            raise click.UsageError(
                f"unknown subcommand {args[0]!r}; to run a command, put it after '--': "
                f"jobrun --key NAME -- {args[0]} ..."
            )
        return super().resolve_command(ctx, args)


def _duration(value: str | None, option: str) -> float | None:
    return None if value is None else durations.parse(value, option=option)


def _heartbeat(value: str | None) -> float | None:
    """``--heartbeat`` (None: the mode's default); each beat is a query, so not too often."""
    heartbeat = _duration(value, "--heartbeat")
    if heartbeat is not None and heartbeat < MIN_HEARTBEAT:
        raise UsageError("--heartbeat must be at least 100ms (each beat is a query)")
    return heartbeat


@click.group(
    cls=JobrunGroup,
    invoke_without_command=True,
    subcommand_metavar="-- COMMAND [ARGS]... | SUBCOMMAND [ARGS]...",
    context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 100},
)
@click.version_option(__version__, "--version", prog_name="jobrun", message="%(prog)s %(version)s")
@click.option(
    "--key",
    "key_names",
    multiple=True,
    envvar="JOBRUN_KEY",
    type=_Lines(),
    metavar="NAME",
    help="Lock name (repeatable: all or nothing, in ascending lock-id order).",
)
@click.option(
    "--lock-id",
    "lock_ids",
    multiple=True,
    envvar="JOBRUN_LOCK_ID",
    type=_Commas(),
    metavar="INT",
    help="Raw signed 64-bit lock id, for interop with code that locks numbers (repeatable).",
)
@db_options
@click.option(
    "--mode",
    envvar="JOBRUN_MODE",
    type=click.Choice(MODES),
    default="session",
    show_default=True,
    help="session: advisory lock on a held connection; lease: TTL row, works through poolers.",
)
@click.option(
    "--wait",
    envvar="JOBRUN_WAIT",
    default="0",
    show_default=True,
    metavar="DURATION",
    help="Wait this long for the lock before skipping.",
)
@click.option(
    "--timeout",
    envvar="JOBRUN_TIMEOUT",
    metavar="DURATION",
    help="Stop the child after this long (SIGTERM, then SIGKILL); exit 124.",
)
@click.option(
    "--kill-after",
    envvar="JOBRUN_KILL_AFTER",
    default="10s",
    show_default=True,
    metavar="DURATION",
    help="Grace between SIGTERM and SIGKILL when jobrun stops the child.",
)
@click.option(
    "--heartbeat",
    envvar="JOBRUN_HEARTBEAT",
    metavar="DURATION",
    help="How often the lock is checked (session, default 1s) or renewed (lease).",
)
@click.option(
    "--ttl",
    envvar="JOBRUN_TTL",
    default="30s",
    show_default=True,
    metavar="DURATION",
    help="Lease lifetime without renewal (lease mode).",
)
@click.option(
    "--skip-exit-code",
    envvar="JOBRUN_SKIP_EXIT_CODE",
    type=click.IntRange(0, 255),
    default=int(Exit.SKIPPED),
    show_default=True,
    help="Exit status when the lock is held elsewhere.",
)
@click.option(
    "--on-db-error",
    envvar="JOBRUN_ON_DB_ERROR",
    type=click.Choice(["fail", "run"]),
    default="fail",
    show_default=True,
    help="Database unreachable: fail (exit 69) or run the child unguarded.",
)
@click.option(
    "--on-lock-lost",
    envvar="JOBRUN_ON_LOCK_LOST",
    type=click.Choice(["terminate", "ignore"]),
    default="terminate",
    show_default=True,
    help="Lock lost mid-run: stop the child (exit 76) or log and let it finish.",
)
@click.option(
    "--min-hold",
    envvar="JOBRUN_MIN_HOLD",
    metavar="DURATION",
    help="Keep the lock at least this long after the start (hosts with skewed clocks skip).",
)
@click.option(
    "--once-per",
    envvar="JOBRUN_ONCE_PER",
    metavar="DURATION",
    help="Skip (already_ran) if the key already ran in this UTC-aligned window, e.g. 1d.",
)
@click.option(
    "--no-history",
    envvar="JOBRUN_NO_HISTORY",
    is_flag=True,
    help="Do not record runs in jobrun.runs (no streak alerts, no --once-per).",
)
@click.option(
    "--keep",
    envvar="JOBRUN_KEEP",
    type=click.IntRange(min=1),
    default=100,
    show_default=True,
    help="History kept per key: the newest N runs and N skips (and each host's newest skip).",
)
@click.option(
    "--alert-after",
    envvar="JOBRUN_ALERT_AFTER",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="Error line (and --on-alert) after N skips or failures in a row; 0 disables.",
)
@click.option(
    "--on-alert",
    envvar="JOBRUN_ON_ALERT",
    metavar="CMD",
    help="Command run on a streak alert (event JSON on stdin and in JOBRUN_ALERT_*).",
)
@click.option(
    "--metrics-file",
    envvar="JOBRUN_METRICS_FILE",
    metavar="PATH",
    help="Prometheus textfile written after each run or skip ({key} is replaced).",
)
# --- operators: --ping, --ping-timeout, --keep-output, --fence (jobrun.ping/tail/fence) ---
@click.option(
    "--ping",
    envvar="JOBRUN_PING",
    metavar="URL",
    help="Healthchecks-style monitor: URL/start, URL/<exit status>, URL/log on a skip.",
)
@click.option(
    "--ping-timeout",
    envvar="JOBRUN_PING_TIMEOUT",
    default="5s",
    show_default=True,
    metavar="DURATION",
    help="Longest one ping may take, retries included (never changes the exit status).",
)
@click.option(
    "--keep-output",
    envvar="JOBRUN_KEEP_OUTPUT",
    metavar="SIZE",
    help="Keep the last SIZE bytes (e.g. 16KiB) of stdout and stderr of failed runs.",
)
@click.option(
    "--fence",
    envvar="JOBRUN_FENCING",
    is_flag=True,
    help="Give the child a fencing token in JOBRUN_FENCE (greater than any earlier one).",
)
@log_options
@click.pass_context
def cli(ctx: click.Context, /, **options: Any) -> int | None:
    """Run COMMAND at most once at a time, guarded by a PostgreSQL lock.

    \b
      jobrun --key nightly-export -- ./export.sh
      jobrun key nightly-export          print the lock id of a key

    Every option can also be set from the environment (JOBRUN_KEY, JOBRUN_DSN, ...).
    Exit status: the child's own; 75 skipped; 69 database unavailable; 64 usage error;
    76 lock lost; 124 timed out; 126/127 command not executable / not found.
    """
    if ctx.invoked_subcommand is not None:
        return None
    argv: tuple[str, ...] | None = ctx.meta.get(_ARGV)
    if not argv:
        raise UsageError("no command given: jobrun --key NAME -- COMMAND [ARGS]...")
    if not argv[0]:
        raise UsageError("the command after '--' is an empty string")
    dsn_on_command_line = ctx.get_parameter_source("dsn") == ParameterSource.COMMANDLINE
    _keys_from_flags_only(ctx, options)
    return _run(argv, dsn_on_command_line=dsn_on_command_line, argv0=argv[0], **options)


def _keys_from_flags_only(ctx: click.Context, options: dict[str, Any]) -> None:
    """With --key or --lock-id on the command line, JOBRUN_KEY and JOBRUN_LOCK_ID are ignored.

    A flag wins over its variable, and the two name one thing: the keys. This is what lets
    a jobrun inside a guarded child (which inherits JOBRUN_KEY and JOBRUN_LOCK_ID) take
    just the keys it is given.
    """
    sources = {name: ctx.get_parameter_source(name) for name in ("key_names", "lock_ids")}
    if ParameterSource.COMMANDLINE in sources.values():
        for name, source in sources.items():
            if source == ParameterSource.ENVIRONMENT:
                options[name] = ()


class _Timing(NamedTuple):
    """Validated durations of a run."""

    min_hold: float | None
    once_per: float | None
    wait: float
    timeout: float | None
    kill_after: float
    heartbeat: float
    connect_timeout: float
    ttl: float
    lifetime: float  # lease: how long a renewal vouches for the lease (session: unused)


def _timing(o: dict[str, Any]) -> _Timing:
    """Parse every duration and check the invariants between them (usage errors: exit 64)."""
    kill_after = durations.parse(o["kill_after"], option="--kill-after")
    heartbeat = _heartbeat(o["heartbeat"])
    ttl = durations.parse(o["ttl"], option="--ttl")
    lifetime = 0.0
    if o["mode"] == "lease":
        from jobrun.locks.lease import timing

        heartbeat, lifetime = timing(ttl, kill_after, heartbeat)
    once_per = _duration(o["once_per"], "--once-per")
    if once_per is not None and once_per < 1:
        raise UsageError("--once-per must be at least 1s (it names a window, e.g. 1h or 1d)")
    if once_per is not None and o["no_history"]:
        raise UsageError("--once-per needs the run history: drop --no-history")
    return _Timing(
        min_hold=_duration(o["min_hold"], "--min-hold") or None,
        once_per=once_per,
        wait=durations.parse(o["wait"], option="--wait"),
        timeout=_duration(o["timeout"], "--timeout") or None,
        kill_after=kill_after,
        heartbeat=heartbeat or 1.0,
        connect_timeout=durations.parse(o["connect_timeout"], option="--connect-timeout"),
        ttl=ttl,
        lifetime=lifetime,
    )


def _run(argv: tuple[str, ...], *, dsn_on_command_line: bool, **o: Any) -> int:
    """Validate everything, then hand over to the runner (which imports the heavy parts)."""
    run_keys = keys.resolve(o["key_names"], o["lock_ids"])
    timing = _timing(o)
    from jobrun import operators  # --- operators

    extras = operators.validate(o)  # --- operators

    from jobrun import db, log, runner
    from jobrun.locks import Identity, Lock, new_run_id

    target = db.Target(dsn=o["dsn"], connect_timeout=timing.connect_timeout)
    fd, log_file_error = None, None
    if o["log_file"]:
        # A log file that cannot be opened never costs the job its run: stderr instead.
        try:
            fd = log.open_log_file(o["log_file"])
        except UsageError as exc:
            log_file_error = str(exc)
    logger = log.configure(
        fmt=o["log_format"],
        level=o["log_level"],
        fd=fd,
        secrets=(*target.secrets, os.environ.get("PGPASSWORD", "")),
        # A log file that cannot be written (disk full): the lines go to stderr instead.
        fallback_fd=STDERR if fd is not None else None,
    )
    identity = Identity(run_id=new_run_id(), pid=os.getpid())
    bound = logger.bind(
        key=keys.describe(run_keys),
        lock_id=run_keys[0].lock_id if len(run_keys) == 1 else [k.lock_id for k in run_keys],
        run_id=identity.run_id,
        host=identity.host,
        pid=identity.pid,
        mode=o["mode"],
        version=__version__,
    )
    job = runner.Job(
        argv=argv,
        keys=run_keys,
        wait=timing.wait,
        timeout=timing.timeout,
        kill_after=timing.kill_after,
        skip_exit_code=o["skip_exit_code"],
        on_db_error=o["on_db_error"],
        on_lock_lost=o["on_lock_lost"],
        heartbeat=timing.heartbeat,
        min_hold=timing.min_hold,
        once_per=timing.once_per,
    )
    recorder = _recorder(o, target, identity, run_keys, log=bound, timing=timing)
    if log_file_error is not None:
        bound.error("log_file_unavailable", error=log_file_error, note="events go to stderr")
    # Only now that every option is known to be valid: a usage error is one line, alone.
    if dsn_on_command_line and target.has_password:
        bound.warning(
            "password_on_command_line",
            hint="a password in --dsn is visible to every user in ps; "
            "use ~/.pgpass, PGPASSFILE or JOBRUN_DSN instead",
        )
    lock: Lock
    if o["mode"] == "lease":
        from jobrun.locks import lease

        lock = lease.LeaseLock(
            run_keys, target, identity, bound, ttl=timing.ttl, lifetime=timing.lifetime
        )
    else:
        from jobrun.locks import session

        lock = session.SessionLock(
            run_keys,
            target,
            identity,
            bound,
            heartbeat=timing.heartbeat,
            kill_after=timing.kill_after,
        )
    wired = operators.Extras(  # --- operators
        extras, target=target, lock=lock, identity=identity, recorder=recorder, log=bound
    )
    status = runner.run(
        job,
        lock=lock,
        identity=identity,
        environ=os.environ,
        log=bound,
        recorder=recorder,
        pinger=wired.pinger,  # --- operators
        capture=wired.capture,  # --- operators
        fencer=wired.fencer,  # --- operators
    )
    wired.after(status)  # --- operators: output tail and end ping, after the release
    return status


def _recorder(
    o: dict[str, Any],
    target: db.Target,
    identity: Identity,
    run_keys: tuple[keys.Key, ...],
    *,
    log: FilteringBoundLogger,
    timing: _Timing,
) -> history.Recorder | history.NullRecorder:
    """The run's history recorder (a null one with --no-history, which still writes metrics)."""
    from pathlib import Path

    from jobrun import alerts, history

    config = history.HistoryConfig(
        keep=o["keep"],
        alert_after=o["alert_after"],
        on_alert=alerts.parse_command(o["on_alert"]) if o["on_alert"] else None,
        metrics_file=o["metrics_file"],
        # WARNING: history is written while the lock is held and unwatched (right after the
        # acquisition): in lease mode it must never outlast half of what the lease vouches.
        timeout=min(5.0, timing.lifetime / 2) if o["mode"] == "lease" else 5.0,
    )
    if o["no_history"]:
        return history.NullRecorder(run_keys, config=config, log=log)
    return history.Recorder(
        target,
        identity,
        run_keys,
        mode=o["mode"],
        program=Path(o["argv0"]).name,
        config=config,
        log=log,
        environ=os.environ,
    )


@cli.command("key")
@click.argument("names", nargs=-1, required=True)
def key_command(names: tuple[str, ...]) -> int:
    """Print the lock id of each key NAME, and how pg_locks shows it.

    A bigint advisory lock appears in pg_locks as classid (high 32 bits), objid (low 32
    bits) and objsubid 1.
    """
    rows = [("KEY", "LOCK_ID", "CLASSID", "OBJID")]
    for name in names:
        key = keys.from_name(name)
        classid, objid = key.pg_locks_pair
        rows.append((name, str(key.lock_id), str(classid), str(objid)))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        click.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=False))
            + "  "
            + row[3]
        )
    return 0


@cli.command("drill", context_settings={"ignore_unknown_options": False})
@click.option("--key", "key_name", required=True, metavar="NAME", help="Key to drill with.")
@click.option("--mode", type=click.Choice(MODES), default="session", show_default=True)
@click.option("--ttl", default="10s", show_default=True, metavar="DURATION", help="Lease TTL.")
@click.option("--kill-after", default="2s", show_default=True, metavar="DURATION")
@click.option("--heartbeat", metavar="DURATION", help="As for a run.")
@db_options
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def drill_command(key_name: str, command: tuple[str, ...], **o: Any) -> int:
    """Rehearse the crash paths on your database: skip, kill -9, lock taken away.

    \b
      jobrun drill --key drill-nightly-export [--mode lease] [-- COMMAND...]

    Starts a guarded run of COMMAND (default: sleep 600), checks that a second instance
    skips, kills jobrun with SIGKILL (the child must die, the next run must acquire), then
    takes the lock away mid-run (terminates the backend in session mode, hands the lease
    to another owner in lease mode): the child must be stopped. Prints a checklist; exits 0
    only if every step passed, 1 if one failed, 69 if the database cannot be reached,
    128+N when stopped by signal N (its runs are stopped too). Use a key no real job uses.
    """
    from jobrun import db, drill
    from jobrun.locks.lease import timing

    key = keys.from_name(key_name)
    kill_after = durations.parse(o["kill_after"], option="--kill-after")
    heartbeat = _heartbeat(o["heartbeat"])
    ttl = durations.parse(o["ttl"], option="--ttl")
    if o["mode"] == "lease":
        timing(ttl, kill_after, heartbeat)
    target = db.Target(
        dsn=o["dsn"],
        connect_timeout=durations.parse(o["connect_timeout"], option="--connect-timeout"),
    )
    plan = drill.Drill(
        key=key,
        mode=o["mode"],
        target=target,
        command=command or ("sleep", "600"),
        ttl=ttl,
        kill_after=kill_after,
        heartbeat=heartbeat,
    )
    return drill.run_drill(plan, click.echo)


@cli.command("demo")
@click.option("--dsn", envvar="JOBRUN_DSN", default="", metavar="DSN", help="Database to use.")
def demo_command(dsn: str) -> int:
    """See jobrun work: a run, a skip, a later run (throwaway database if none answers)."""
    from jobrun import demo, throwaway

    try:
        return demo.run(dsn, click.echo)
    except throwaway.NoPostgresError as exc:
        raise UsageError(str(exc)) from None


# --- operators: jobrun show RUN_ID (the output tails kept by --keep-output) ---
@cli.command("show")
@click.argument("run_id")
@db_options
def show_command(run_id: str, dsn: str, connect_timeout: str) -> int:
    """Print the output tails a failed run kept (--keep-output), by its run id.

    The run id is in every event line of the run (run_id) and in `jobrun history`.
    Bytes that are not UTF-8 are shown as U+FFFD. Exit 1 if the run kept no output.
    """
    import uuid

    from jobrun import db, tail

    try:
        run_id = str(uuid.UUID(run_id))
    except ValueError:
        raise UsageError(f"{run_id!r} is not a run id (a UUID, as in the run's events)") from None
    target = db.Target(
        dsn=dsn, connect_timeout=durations.parse(connect_timeout, option="--connect-timeout")
    )
    with (
        db.connect(target, app_name="jobrun-show") as conn,
        db.translate_errors(target, "reading the run"),
    ):
        run = tail.read(conn, run_id)
    if run is None:
        click.echo(f"jobrun: no run {run_id} in the history", err=True)
        return 1
    click.echo(tail.render(run), nl=False)
    return 0 if run["stdout"] is not None or run["stderr"] is not None else 1


def _register_operations() -> None:
    from jobrun import ops_cli, overlap_cli

    ops_cli.register(cli)
    overlap_cli.register(cli)


_register_operations()


def main(argv: list[str] | None = None) -> NoReturn:
    """Console entry point: the one place exceptions become exit statuses."""
    _open_standard_fds()
    try:
        status = cli.main(args=argv, prog_name="jobrun", standalone_mode=False)
    except click.exceptions.Exit as exc:  # --help, --version
        status = exc.exit_code
    except click.ClickException as exc:
        _error(exc.format_message())
        status = Exit.USAGE
    except JobrunError as exc:
        _error(str(exc))
        status = exc.exit_code
    except click.Abort:
        status = 128 + 2
    except Exception as exc:  # a bug: one line, and the traceback only when asked for
        if os.environ.get("JOBRUN_DEBUG"):
            raise
        _error(f"internal error: {type(exc).__name__}: {exc} (set JOBRUN_DEBUG=1 for details)")
        status = Exit.INTERNAL
    sys.exit(int(status or 0))


def _open_standard_fds() -> None:
    """Point a closed stdin, stdout or stderr at /dev/null.

    WARNING: a closed descriptor 0-2 (``2>&-`` in a crontab) is the first one the next
    ``open`` or ``socket`` returns: the lock session's socket would become "stderr" and our
    log lines would be written into the PostgreSQL protocol stream.
    """
    for fd in (STDIN, STDOUT, STDERR):
        if not _is_open(fd):
            null = os.open(os.devnull, os.O_RDWR)
            if null == fd:
                # positional-only; the fds os.open returns are not inherited
                os.set_inheritable(fd, True)  # noqa: FBT003
            else:
                os.dup2(null, fd)  # inheritable, unlike os.open's
                os.close(null)


def _is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


def _error(message: str) -> None:
    with contextlib.suppress(OSError):  # a closed or full stderr must not end in a traceback
        click.echo(f"jobrun: error: {' '.join(message.split())}", err=True)
