"""The ``overlap`` subcommand (click only; jobrun.overlap and psycopg load when it runs)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click
from click.core import ParameterSource

from jobrun import durations

if TYPE_CHECKING:
    from collections.abc import Callable

    from jobrun import db, overlap


def register(group: click.Group) -> None:
    """Add the overlap subcommand to the jobrun group."""
    group.add_command(overlap_command)


@click.command("overlap")
@click.option(
    "--first", required=True, metavar="CMD", help="Command A (shell-style quoting, no shell)."
)
@click.option(
    "--second",
    required=True,
    metavar="CMD",
    help="Command B, started once A is inside a transaction.",
)
@click.option(
    "--runs",
    type=click.IntRange(1, 100_000),
    default=10,
    show_default=True,
    help="Attempts to make.",
)
@click.option(
    "--dsn",
    envvar="JOBRUN_DSN",
    default="",
    metavar="DSN",
    help="The database the commands use (to watch); default: PG* variables, service file, "
    "~/.pgpass.",
)
@click.option(
    "--connect-timeout",
    envvar="JOBRUN_CONNECT_TIMEOUT",
    default="10s",
    show_default=True,
    metavar="DURATION",
    help="Give up connecting after this long (exit 69).",
)
@click.option(
    "--timeout",
    default="60s",
    show_default=True,
    metavar="DURATION",
    help="Per attempt: then both commands' process groups are killed.",
)
@click.option(
    "--start-after",
    default="inside",
    show_default=True,
    metavar="inside|DURATION",
    help="Start B once A is inside a transaction, or this long after A.",
)
@click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")
def overlap_command(  # click passes options by keyword
    *,
    first: str,
    second: str,
    runs: int,
    dsn: str,
    connect_timeout: str,
    timeout: str,
    start_after: str,
    as_json: bool,
) -> int:
    """Run two commands against each other N times and report their deadlocks.

    \b
      jobrun overlap --first './transfer.py 1 2' --second './transfer.py 2 1' --runs 20

    Each attempt starts A, waits until one of A's database sessions is inside a
    transaction, starts B, and watches pg_locks / pg_blocking_pids until both exit. The
    commands' sessions are found by application_name (PGAPPNAME=jobrun-overlap:A:<n>).
    Reports how many attempts deadlocked and the wait-for cycle: which job, which
    statement, which lock. Exit status: 0 when no attempt deadlocked, 1 when one did,
    128+N when stopped by signal N (both commands are killed, their sessions ended).

    WARNING: the commands run for real, N times: use a staging database.
    """
    import json  # noqa: PLC0415 - keeps --help light

    from jobrun import overlap  # noqa: PLC0415 - keeps --help light and psycopg unloaded

    plan = overlap.Plan(
        first=overlap.parse_command(first, option="--first"),
        second=overlap.parse_command(second, option="--second"),
        target=_target(dsn, connect_timeout),
        runs=runs,
        timeout=durations.parse(timeout, option="--timeout"),
        start_after=overlap.parse_start_after(start_after),
    )
    report = overlap.run(plan, progress=None if as_json else _progress(runs))
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2))
    else:
        click.echo(report.text())
    return report.exit_status


def _target(dsn: str, connect_timeout: str) -> db.Target:
    """The watched database, warning (on stderr) about a password in --dsn."""
    from jobrun import db  # noqa: PLC0415 - keeps --help light and psycopg unloaded

    target = db.Target(
        dsn=dsn, connect_timeout=durations.parse(connect_timeout, option="--connect-timeout")
    )
    context = click.get_current_context()
    if target.has_password and context.get_parameter_source("dsn") == ParameterSource.COMMANDLINE:
        click.echo(
            "jobrun: warning: a password in --dsn is visible to every user in ps; use "
            "~/.pgpass, PGPASSFILE or JOBRUN_DSN instead",
            err=True,
        )
    return target


def _progress(runs: int) -> Callable[[overlap.Attempt], None]:
    """One stderr line per finished attempt, so a long run shows it is alive."""

    def show(attempt: overlap.Attempt) -> None:
        click.echo(
            f"jobrun overlap: attempt {attempt.number}/{runs}: {attempt.outcome} "
            f"({attempt.exits()}, {attempt.duration:.2f}s)",
            err=True,
        )

    return show
