"""``key``, ``drill``, ``demo``, ``help`` and ``version``: the subcommands around a run."""

from __future__ import annotations

import click

from jobrun import __version__, flags, keys
from jobrun.cli.group import Subcommand
from jobrun.exitcodes import UsageError

#: What the drill's own runs hold the lock with, unless COMMAND is given.
DRILL_COMMAND = ("sleep", "600")


@click.command("key", cls=Subcommand)
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


@click.command(
    "drill",
    cls=Subcommand,
    takes=("dsn", "connect_timeout", "mode", "ttl", "kill_after", "heartbeat"),
    keys_as="option",
)
@click.option("--key", "key_name", required=True, metavar="NAME", help="Key to drill with.")
@flags.mode("Lock mode of the drill's runs.")
# The run's own options; a drill's runs are short, so its waits are too.
@flags.ttl.but(default="10s")
@flags.kill_after.but(default="2s")
@flags.heartbeat
@flags.database
@click.argument("command", nargs=-1, type=click.UNPROCESSED)
def drill_command(
    *,
    key_name: str,
    mode: str,
    ttl: float,
    kill_after: float,
    heartbeat: float | None,
    dsn: str,
    connect_timeout: float,
    command: tuple[str, ...],
) -> int:
    """Rehearse the crash paths on your database: skip, kill -9, lock taken away.

    \b
      jobrun drill --key drill-nightly-export [--mode lease] [-- COMMAND...]

    Starts a guarded run of COMMAND (default: sleep 600; it must keep running until the
    drill stops it), checks that a second instance skips, kills jobrun with SIGKILL (the
    child must die, the next run must acquire), then takes the lock away mid-run
    (terminates the backend in session mode, hands the lease to another owner in lease
    mode): the child must be stopped. Prints a checklist; exits 0 only if every step
    passed, 1 if one failed, 69 if the database cannot be reached, 128+N when stopped by
    signal N (its runs are stopped too). Use a key no real job uses.
    """
    from jobrun import _zipapp, db
    from jobrun.ops import drill

    key = keys.from_name(key_name)
    if mode == "lease":
        from jobrun.locks.lease import LeaseTiming

        LeaseTiming.from_options(ttl=ttl, kill_after=kill_after, heartbeat=heartbeat)
    plan = drill.Drill(
        key=key,
        mode=mode,
        target=flags.target(dsn, connect_timeout),
        command=command or DRILL_COMMAND,
        ttl=ttl,
        kill_after=kill_after,
        heartbeat=heartbeat,
        jobrun=tuple(_zipapp.command()),  # the single file starts its own runs, not -m jobrun
    )
    status = drill.run_drill(plan, click.echo)
    if status == 1 and command:
        click.echo(
            f"jobrun drill: note: COMMAND ({db.redact(command[0])}) must keep running until "
            "the drill stops it, like the default 'sleep 600'; a command that exits by "
            "itself fails the steps that need a running child",
            err=True,
        )
    return status


@click.command("demo", cls=Subcommand, takes=("dsn", "connect_timeout"))
@flags.database
def demo_command(dsn: str, connect_timeout: float) -> int:
    """See jobrun work: a run, a skip, a later run (a throwaway database unless one is named).

    Uses a database only when --dsn, JOBRUN_DSN, PGHOST, PGHOSTADDR, PGDATABASE or PGSERVICE
    names one, and deletes its rows there afterwards. Says which database it uses. A server
    that answers but refuses the connection (wrong user, password or database) is an error
    (exit 69), not a reason to use a throwaway one.
    """
    from jobrun.ops import demo, throwaway

    try:
        return demo.run(dsn, click.echo, connect_timeout=connect_timeout)
    except throwaway.NoPostgresError as exc:
        raise UsageError(str(exc)) from None


@click.command("help", cls=Subcommand)
@click.argument("subcommand", required=False)
@click.pass_context
def help_command(ctx: click.Context, subcommand: str | None) -> int:
    """Show the help of jobrun, or of SUBCOMMAND."""
    parent = ctx.parent
    group = parent.command if parent is not None else None
    if parent is None or not isinstance(group, click.Group):
        click.echo(ctx.get_help())
        return 0
    if subcommand is None:
        click.echo(group.get_help(parent))
        return 0
    command = group.get_command(parent, subcommand)
    if command is None:
        raise UsageError(
            f"no subcommand {subcommand!r}; the subcommands are: "
            + ", ".join(group.list_commands(parent))
        )
    with click.Context(command, info_name=subcommand, parent=parent) as sub:
        click.echo(command.get_help(sub))
    return 0


@click.command("version", cls=Subcommand)
def version_command() -> int:
    """Print jobrun's version (as --version does)."""
    click.echo(f"jobrun {__version__}")
    return 0
