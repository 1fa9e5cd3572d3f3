"""``jobrun timeline``: the runs of some jobs, their overlaps and deadlocks, drawn to a file."""

from __future__ import annotations

import click

from jobrun import flags
from jobrun.cli.group import Subcommand
from jobrun.escape import printable
from jobrun.exitcodes import UsageError

#: At most this many runs and skips are read from the history (newest first).
DEFAULT_LIMIT = 20_000


@click.command("timeline", cls=Subcommand, takes=("dsn", "connect_timeout"), keys_as="label")
@click.argument("key_labels", nargs=-1, metavar="[KEY]...")
@click.option(
    "--since",
    type=flags.Duration(minimum="1s"),
    default="30d",
    show_default=True,
    metavar="DURATION",
    help="Show this long, back from now (from the newest line, when only logs are read).",
)
@click.option("--html", "html_path", metavar="FILE", help="Write the picture as one HTML page.")
@click.option("--svg", "svg_path", metavar="FILE", help="Write the picture as one SVG image.")
@click.option(
    "--log",
    "server_logs",
    multiple=True,
    metavar="FILE",
    help="A PostgreSQL server log: each deadlock in it is marked on the runs its sides "
    "name (else on a database lane).",
)
@flags.log_line_prefix
@click.option(
    "--sessions-from",
    "sessions_from",
    multiple=True,
    metavar="LOG",
    help="A server log with log_connections/log_disconnections lines: a lane per "
    "application, a bar per session (its deadlocks are marked too).",
)
@click.option(
    "--cron-log",
    "cron_logs",
    multiple=True,
    metavar="FILE",
    help="cron's lines (a syslog, journalctl text): a lane per command, a bar per run.",
)
@click.option(
    "--journal",
    "journals",
    multiple=True,
    metavar="FILE",
    help="journalctl -o json of the jobs' units: a lane per unit, a bar per run.",
)
@flags.assume_duration
@click.option(
    "--limit",
    type=click.IntRange(1, 1_000_000),
    default=DEFAULT_LIMIT,
    show_default=True,
    help="Read at most this many runs and skips from the history (the newest).",
)
@flags.database
def timeline_command(  # noqa: PLR0917 - click passes one parameter per option
    key_labels: tuple[str, ...],
    since: float,
    html_path: str | None,
    svg_path: str | None,
    server_logs: tuple[str, ...],
    prefix: str | None,
    sessions_from: tuple[str, ...],
    cron_logs: tuple[str, ...],
    journals: tuple[str, ...],
    assume_duration: float,
    limit: int,
    dsn: str,
    connect_timeout: float,
) -> int:
    """Draw the runs of each KEY as a lane, their overlaps and deadlocks, to a file.

    A bar per run, coloured by outcome, a tick per skip; the windows where runs of two or
    more lanes overlapped shaded on those lanes, under the bars. A deadlock of a --log is
    marked on a run only when the log ties a side of it to that run (application_name
    jobrun:KEY, or a --sessions-from session's backend pid); else, and the database's own
    counts during runs, on a database lane. Several days: a row per night, each key in its
    own place every night. Hover shows run id, host, exit code, duration and outcome. KEY
    is read from the run history;
    jobs that did not run under jobrun come from --cron-log, --journal or --sessions-from
    (one lane per command, unit or application). The file is self-contained: no network.
    Exit status: 0 when written, 66 when a log cannot be read, 65 when a --log is not a
    PostgreSQL log, 69 when the database cannot be reached.
    """
    import datetime as dt

    from jobrun import keys
    from jobrun.analysis.timeline import model, render, sources

    if html_path is None and svg_path is None:
        raise UsageError("say where to draw it: --html FILE or --svg FILE")
    if not key_labels and not (sessions_from or cron_logs or journals):
        raise UsageError(
            "nothing to draw: give a KEY (from the run history), --cron-log, --journal "
            "or --sessions-from"
        )
    labels = [keys.normalized_label(label) for label in key_labels]
    read = sources.logs(
        server_logs,
        prefix=prefix,
        sessions_from=sessions_from,
        cron_logs=cron_logs,
        journals=journals,
        assume=dt.timedelta(seconds=assume_duration),
    )
    if labels:
        with flags.connected(
            dsn, connect_timeout, app_name="jobrun-timeline", doing="reading the history"
        ) as conn:
            history = sources.history(conn, labels, since=since, limit=limit)
        read.bars += history.bars
        read.notes += history.notes
        read.now = history.now
    now = read.now or dt.datetime.now(dt.timezone.utc)
    drawn = model.build(labels, read.bars, read.marks, now=now, since=since)
    drawn.notes = read.notes + drawn.notes
    title = "jobrun timeline: " + (", ".join(labels) or "scheduled jobs")
    for path, text in ((html_path, render.page(drawn, title)), (svg_path, render.image(drawn))):
        if path is not None:
            _write(path, text if text.endswith("\n") else text + "\n")
            if path != "-":
                click.echo(f"wrote {printable(path)}: {render.summary(drawn)}")
    return 0


def _write(path: str, text: str) -> None:
    """Write the file whole; a failure is the output error it is (74)."""
    import sys
    from pathlib import Path

    from jobrun.exitcodes import OutputError

    try:
        if path == "-":
            sys.stdout.write(text)
            sys.stdout.flush()
        else:
            Path(path).write_text(text, encoding="utf-8")
    except OSError as exc:
        raise OutputError(f"cannot write {path}: {exc.strerror or exc}") from None
