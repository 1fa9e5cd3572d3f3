"""``status``, ``history``, ``show``, ``doctor``, ``deadlocks``: what is held, ran, broke."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click

from jobrun import flags
from jobrun.cli.group import Subcommand
from jobrun.escape import printable
from jobrun.exitcodes import Exit, UsageError

if TYPE_CHECKING:
    import psycopg


@click.command("status", cls=Subcommand, takes=("dsn", "connect_timeout"), keys_as="label")
@click.argument("key_labels", nargs=-1, metavar="[KEY]...")
@click.option(
    "--check",
    is_flag=True,
    help="Exit 1 if a key is overdue, failing or stuck, or the history cannot be read "
    "(each named on stderr).",
)
@click.option(
    "--alert-after",
    type=click.IntRange(min=0),
    default=3,
    show_default=True,
    help="With --check: a key failing this many times in a row is failing; 0: never.",
)
@flags.wide
@flags.tz
@flags.database
@flags.as_json
def status_command(  # noqa: PLR0917 - click passes one parameter per option
    key_labels: tuple[str, ...],
    check: bool,
    alert_after: int,
    wide: bool,
    tz: str | None,
    dsn: str,
    connect_timeout: float,
    as_json: bool,
) -> int:
    """What is held right now, and how each key's runs went.

    Without KEY: every key in the run history, every key leased now, and every advisory
    lock held by a jobrun session. A multi-key run is one KEY, its keys joined by commas in
    any order (shown in locking order, as in its event lines); lock-id:N names a --lock-id key.
    """
    import json

    from jobrun import keys
    from jobrun.ops import records, status

    key_labels = tuple(keys.normalized_label(label) for label in key_labels)
    with flags.connected(
        dsn, connect_timeout, app_name="jobrun-status", doing="reading the status"
    ) as conn:
        found = status.collect(conn, key_labels)
        unknown = [
            label for label in key_labels if check and not records.ever_recorded(conn, label)
        ]
    for note in found.notes:
        click.echo(f"jobrun: note: {printable(note)}", err=True)
    # A key never recorded and not held has no row to show: an empty one would look real.
    rows = [row for row in found.keys if row.key not in unknown or row.holder is not None]
    if as_json:
        click.echo(json.dumps([row.as_json() for row in rows], indent=2))
    elif rows:
        with status.shown_in(tz):
            click.echo(status.status_table(rows, wide=wide))
    elif found.unreadable:
        click.echo(f"nothing to show: {', '.join(found.unreadable)} not readable")
    elif not unknown:
        click.echo("nothing held, no run history")
    if check:
        # A check that could not look is no all-clear (the notes above say what was refused).
        problems = [f"cannot check: {what} not readable" for what in found.unreadable]
        with status.shown_in(tz):
            problems += status.check_lines(found.keys, alert_after)
        problems += [str(records.NeverRecorded(label)) for label in unknown]
        for line in problems:
            click.echo(f"jobrun: {line}", err=True)
        return int(Exit.ATTENTION) if problems else 0
    return 0


@click.command("history", cls=Subcommand, takes=("dsn", "connect_timeout"), keys_as="label")
@click.argument("key_label", metavar="KEY")
@flags.count("--limit", default=20, help_text="Show this many runs, newest first.")
@click.option(
    "--overlapping",
    "other_label",
    metavar="OTHER",
    help="Only runs of KEY that overlapped a run of OTHER: both sides, and for how long.",
)
@click.option(
    "--since",
    type=flags.Duration(),
    metavar="DURATION",
    help="With --overlapping: only runs of KEY that started within this long, e.g. 30d.",
)
@flags.tz
@flags.database
@flags.as_json
def history_command(  # noqa: PLR0917 - click passes one parameter per option
    key_label: str,
    limit: int,
    other_label: str | None,
    since: float | None,
    tz: str | None,
    dsn: str,
    connect_timeout: float,
    as_json: bool,
) -> int:
    """Recent runs and skips of KEY: outcome, exit code, duration, deadlocks, host, start.

    KEY is a run's label as status prints it: a key name, lock-id:N, or several joined by
    commas. With --overlapping OTHER: the runs of KEY whose window intersected a run of
    OTHER, one line per pair, newest first (the nights two jobs ran at once).
    """
    import json

    from jobrun import keys
    from jobrun.ops import status

    key_label = keys.normalized_label(key_label)
    if other_label is not None:
        other_label = keys.normalized_label(other_label)
    elif since is not None:
        raise UsageError("--since goes with --overlapping")
    if other_label is not None:
        with flags.connected(
            dsn, connect_timeout, app_name="jobrun-history", doing="reading the history"
        ) as conn:
            pairs = status.overlapping(conn, key_label, other_label, since=since, limit=limit)
        if as_json:
            click.echo(json.dumps(pairs or [], indent=2, default=str))
        elif pairs:
            with status.shown_in(tz):
                click.echo(status.overlap_table(pairs))
        else:
            click.echo(f"no run of {key_label} overlapped a run of {other_label}")
        return 0
    with flags.connected(
        dsn, connect_timeout, app_name="jobrun-history", doing="reading the history"
    ) as conn:
        runs = status.runs_of(conn, key_label, limit)
    if runs is None:
        click.echo(
            "jobrun: note: no run history yet (the jobrun.runs table does not exist)", err=True
        )
        runs = []
    if as_json:
        click.echo(json.dumps(runs, indent=2, default=str))
    elif runs:
        with status.shown_in(tz):
            click.echo(status.history_table(runs))
    else:
        click.echo(f"no runs of {key_label} in the history")
    return 0


@click.command("doctor", cls=Subcommand, takes=("dsn", "connect_timeout", "mode"))
@flags.database
@flags.mode("Judge the database for this lock mode.")
@flags.as_json
def doctor_command(dsn: str, connect_timeout: float, mode: str, as_json: bool) -> int:
    """Check what a run depends on: server, role, schema, pooler, settings, capacity, logging.

    One line per check: OK, NOTE (worth knowing, e.g. deadlock logging), WARN, FAIL, or
    UNKNOWN (the check could not run). Exit status: 0 when every check ran and nothing
    FAILs, 1 when something FAILs or is UNKNOWN, 69 when the database cannot be reached.
    """
    import json

    from jobrun import db
    from jobrun.ops import doctor

    where = flags.target(dsn, connect_timeout)
    with db.connect(where, app_name="jobrun-doctor") as conn:
        findings = doctor.diagnose(conn, where, mode=mode)
    if as_json:
        click.echo(json.dumps([finding.as_json() for finding in findings], indent=2))
    else:
        click.echo(doctor.report(findings))
    return doctor.exit_status(findings)


@click.command("deadlocks", cls=Subcommand)
@click.argument("logfiles", nargs=-1, required=True, metavar="LOGFILE...")
@flags.log_line_prefix
@click.option("--check", is_flag=True, help="Exit 1 when the logs hold any deadlock.")
@click.option(
    "--sessions",
    is_flag=True,
    help="Under each deadlock, the applications connected at that moment (from "
    "log_connections/log_disconnections lines), and the pairs there together across them.",
)
@click.option(
    "--cron-log",
    "cron_logs",
    multiple=True,
    metavar="FILE",
    help="cron's lines (a syslog, journalctl text): the commands running at each deadlock. "
    "Implies --sessions.",
)
@click.option(
    "--journal",
    "journals",
    multiple=True,
    metavar="FILE",
    help="journalctl -o json of the jobs' units: the units running at each deadlock. "
    "Implies --sessions.",
)
@flags.assume_duration
@flags.as_json
def deadlocks_command(  # noqa: PLR0917 - click passes one parameter per option
    logfiles: tuple[str, ...],
    prefix: str | None,
    check: bool,
    sessions: bool,
    cron_logs: tuple[str, ...],
    journals: tuple[str, ...],
    assume_duration: float,
    as_json: bool,
) -> int:
    """Find every deadlock in PostgreSQL server logs and name both sides.

    LOGFILE: a server log as stderr (any log_line_prefix), csvlog, jsonlog, syslog, or a
    cloud download or export (RDS, Azure, Cloud SQL, Heroku, CloudNativePG); gzip, bzip2
    or xz packed; - for stdin. With %a in log_line_prefix (or csvlog/jsonlog) each side is
    named by its application, which is jobrun:<key> for a job jobrun runs. --sessions,
    --cron-log and --journal say who else was there at each deadlock. Exit status: 0 when
    read (1 with --check when a deadlock was found), 66 when a file cannot be read, 65
    when it is not a PostgreSQL log.
    """
    import datetime as dt

    from jobrun.analysis import deadlocks
    from jobrun.analysis.deadlocks.together import Asked

    asked = (
        Asked(cron_logs, journals, dt.timedelta(seconds=assume_duration))
        if sessions or cron_logs or journals
        else None
    )
    return deadlocks.run(
        logfiles, prefix=prefix, as_json=as_json, check=check, echo=click.echo, asked=asked
    )


@click.command("show", cls=Subcommand, takes=("dsn", "connect_timeout"))
@click.argument("run_id", metavar="RUN_ID|KEY")
@click.option(
    "--raw",
    is_flag=True,
    help="The kept bytes exactly as the job wrote them, terminal escapes included; "
    "refused (64) when standard output is a terminal.",
)
@flags.tz
@flags.database
def show_command(run_id: str, raw: bool, tz: str | None, dsn: str, connect_timeout: float) -> int:
    """Print the output tails a failed run kept (--keep-output), by its run id or KEY.

    RUN_ID: the run id of its event lines, or its first digits as `jobrun history` shows
    them (at least 4; exit 64 if they start more than one run). KEY: the newest run of KEY
    that kept output. Bytes that are not UTF-8 are shown as U+FFFD, and control characters
    other than newline and tab as escapes (\\x1b): the output cannot drive the terminal.
    Exit 1 if the run kept no output or nothing matches.
    """
    import sys

    from jobrun.ops import runids, tenants
    from jobrun.ops.status import kept

    if raw and sys.stdout.isatty():
        raise UsageError(
            "--raw writes the job's bytes as they are, terminal escapes included: "
            "not to a terminal (redirect it to a file or a pipe)"
        )
    with flags.connected(
        dsn, connect_timeout, app_name="jobrun-show", doing="reading the run"
    ) as conn:
        try:
            run_id = runids.resolve(conn, run_id)
        except runids.NoSuchRun:
            _refuse_unless_granted(conn, run_id)
            raise
        run = tenants.read_output(conn, run_id)
    if run is None:
        click.echo(f"jobrun: no run {run_id} in the history", err=True)
        return 1
    _write_bytes(kept.render(run, raw=raw, zone=tz))
    return 0 if run["stdout"] is not None or run["stderr"] is not None else 1


def _refuse_unless_granted(conn: psycopg.Connection[Any], text: str) -> None:
    """``show KEY`` found nothing: NotGranted if KEY is a key this role may not read.

    (A run id names no key: a run this role may not see stays "no such run".)
    """
    from jobrun import keys
    from jobrun.ops import records

    try:
        label = keys.normalized_label(text)
    except UsageError:
        return
    records.refuse_unless_granted(conn, label, "read")


def _write_bytes(data: bytes) -> None:
    """Write ``data`` to standard output as it is; a failure is the output error it is."""
    import sys

    from jobrun.cli.main import output_error

    try:
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()
    except OSError as exc:
        raise output_error(exc) from None
