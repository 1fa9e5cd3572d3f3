"""``jobrun overlap``: two commands made to overlap N times, and their deadlocks reported."""

from __future__ import annotations

import shutil
import sys
from typing import TYPE_CHECKING

import click

from jobrun import flags
from jobrun.cli.group import Subcommand

if TYPE_CHECKING:
    from collections.abc import Callable

    from jobrun.analysis import overlap


@click.command("overlap", cls=Subcommand, takes=("dsn", "connect_timeout"))
@click.option("--first", metavar="CMD", help="Command A (shell-style quoting, no shell).")
@click.option("--second", metavar="CMD", help="Command B (shell-style quoting, no shell).")
@click.option(
    "--job",
    "jobs",
    multiple=True,
    metavar="CMD",
    help="Instead of --first/--second: one of several commands (give it 2+ times); every "
    "pair is run against each other in both orders, and a matrix printed.",
)
@flags.count("--runs", default=10, help_text="Attempts to make (with --job: per pair, at least 2).")
@flags.database
# No variable: JOBRUN_TIMEOUT bounds a run, not an attempt of two commands.
@flags.timeout.but(
    default="60s",
    help="Per attempt: then both commands' process groups are killed.",
    variable=False,
)
@click.option(
    "--start",
    default="hold",
    show_default=True,
    metavar="hold|inside|together|DURATION",
    help="hold: stop the first job (SIGSTOP) once it is inside a transaction, start the "
    "second, resume the first once the second waits for a lock; inside: start the second "
    "once the first is inside a transaction; together: both at once; DURATION: the second "
    "this long after the first.",
)
@click.option(
    "--order",
    type=click.Choice(["alternate", "as-given"]),
    default="alternate",
    show_default=True,
    help="alternate: A and B take turns going first; as-given: A always goes first.",
)
@flags.as_json
def overlap_command(
    *,
    first: str | None,
    second: str | None,
    jobs: tuple[str, ...],
    runs: int,
    dsn: str,
    connect_timeout: float,
    timeout: float,
    start: str,
    order: str,
    as_json: bool,
) -> int:
    """Run two commands against each other N times and report their deadlocks.

    \b
      jobrun overlap --first './transfer.py 1 2' --second './transfer.py 2 1' --runs 20

    Each attempt starts one job, holds it (SIGSTOP) once one of its database sessions is
    inside a transaction, starts the other, resumes the first once the other waits for a
    lock, and watches pg_locks / pg_blocking_pids until both exit. The jobs take turns
    going first, and attempts that find nothing hold the first job at later statements.
    The commands' sessions are found by application_name (PGAPPNAME=jobrun-overlap:A:<n>).
    Reports how many attempts deadlocked and the wait-for cycle: which job, which
    statement, which lock. Exit status: 0 when no attempt deadlocked, 1 when one did,
    128+N when stopped by signal N (both commands are killed, their sessions ended).

    With --job given three or more times (or twice), every pair of the commands is run
    that way, each in both orders, and a matrix says which pairs deadlocked, which were
    clean and which failed, with each cycle's suggested fix. Exit 1 if any pair deadlocked.

    WARNING: the commands run for real, N times: use a staging database.
    """
    import json

    from jobrun.analysis import overlap
    from jobrun.analysis.overlap import matrix
    from jobrun.exitcodes import UsageError

    if jobs and (first is not None or second is not None):
        raise UsageError("--job replaces --first and --second: give one form or the other")
    if not jobs and (first is None or second is None):
        missing = "--first" if first is None else "--second"
        raise UsageError(f"{missing} is missing: give --first and --second, or --job 2+ times")
    commands = [overlap.parse_command(job, option="--job") for job in jobs]
    start_mode, delay = overlap.parse_start(start)
    plan = overlap.Plan(
        first=commands[0] if commands else overlap.parse_command(str(first), option="--first"),
        second=commands[-1] if commands else overlap.parse_command(str(second), option="--second"),
        target=flags.target(dsn, connect_timeout),
        runs=runs,
        timeout=timeout,
        start=start_mode,
        delay=delay,
        alternate=order == "alternate",
    )
    if commands:
        found = matrix.run_matrix(
            plan, commands, progress=None if as_json else _pair_progress(runs)
        )
        click.echo(json.dumps(found.as_json(), indent=2) if as_json else matrix.text(found))
        return found.exit_status
    progress = None if as_json else _Progress(runs)
    try:
        report = overlap.run(plan, progress=progress)
    finally:
        if progress is not None:
            progress.end()
    if as_json:
        click.echo(json.dumps(report.as_json(), indent=2))
    else:
        click.echo(overlap.text(report))
    return report.exit_status


class _Progress:
    """A stderr line per finished attempt, so a long run shows it is alive.

    On a terminal each line replaces the one before and the last is erased at the end:
    the report lists every attempt, and a terminal shows stdout and stderr together.
    """

    #: Back to the start of the line, and erase it.
    ERASE = "\r\x1b[K"

    def __init__(self, runs: int) -> None:
        self._runs = runs
        self._terminal = sys.stderr.isatty()
        self._shown = False

    def __call__(self, attempt: overlap.Attempt) -> None:
        """Show how ``attempt`` ended."""
        from jobrun.analysis import overlap

        line = (
            f"jobrun overlap: attempt {attempt.number}/{self._runs}: {attempt.outcome} "
            f"({overlap.summary(attempt)})"
        )
        if self._terminal:
            # Cut to the width: a wrapped line could not be erased.
            width = shutil.get_terminal_size().columns - 1
            click.echo(f"{self.ERASE}{line[:width]}", nl=False, err=True)
            self._shown = True
        else:
            click.echo(line, err=True)

    def end(self) -> None:
        """Erase the terminal's progress line before the report."""
        if self._shown:
            click.echo(self.ERASE, nl=False, err=True)


def _pair_progress(runs: int) -> Callable[[int, int, overlap.Attempt], None]:
    """One stderr line per finished attempt of a pair of --job commands."""
    from jobrun.analysis import overlap

    def show(first: int, second: int, attempt: overlap.Attempt) -> None:
        click.echo(
            f"jobrun overlap: J{first + 1} (A) + J{second + 1} (B): attempt "
            f"{attempt.number}/{runs}: {attempt.outcome} ({overlap.summary(attempt)})",
            err=True,
        )

    return show
