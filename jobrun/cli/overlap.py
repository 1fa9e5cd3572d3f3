"""``jobrun overlap``: two commands made to overlap N times, and their deadlocks reported."""

from __future__ import annotations

from typing import TYPE_CHECKING

import click

from jobrun.cli import options
from jobrun.cli.group import Subcommand

if TYPE_CHECKING:
    from collections.abc import Callable

    from jobrun import overlap


def register(group: click.Group) -> None:
    """Add the overlap subcommand to a group."""
    group.add_command(overlap_command)


@click.command("overlap", cls=Subcommand, takes=("dsn", "connect_timeout"))
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
@options.database
@click.option(
    "--timeout",
    type=options.Duration(),
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
@options.as_json
def overlap_command(
    *,
    first: str,
    second: str,
    runs: int,
    dsn: str,
    connect_timeout: float,
    timeout: float,
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
    import json

    from jobrun import overlap

    plan = overlap.Plan(
        first=overlap.parse_command(first, option="--first"),
        second=overlap.parse_command(second, option="--second"),
        target=options.target(dsn, connect_timeout),
        runs=runs,
        timeout=timeout,
        start_after=overlap.parse_start_after(start_after),
    )
    report = overlap.run(plan, progress=None if as_json else _progress(runs))
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2))
    else:
        click.echo(report.text())
    return report.exit_status


def _progress(runs: int) -> Callable[[overlap.Attempt], None]:
    """One stderr line per finished attempt, so a long run shows it is alive."""

    def show(attempt: overlap.Attempt) -> None:
        click.echo(
            f"jobrun overlap: attempt {attempt.number}/{runs}: {attempt.outcome} "
            f"({attempt.exits()}, {attempt.duration:.2f}s)",
            err=True,
        )

    return show
