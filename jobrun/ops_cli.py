"""The ``status``, ``history`` and ``doctor`` subcommands (click only; the rest loads lazily)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from jobrun.options import MODES, db_options

if TYPE_CHECKING:
    from jobrun import db


def register(group: click.Group) -> None:
    """Add the status, history and doctor subcommands to the jobrun group."""
    group.add_command(status_command)
    group.add_command(history_command)
    group.add_command(doctor_command)


def _json_option(command: Any) -> Any:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON for machines.")(command)


def _target(dsn: str, connect_timeout: str) -> db.Target:
    """The connection settings of a run, warning (on stderr) about a password in --dsn."""
    from jobrun import db, durations  # noqa: PLC0415 - keeps --help light

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


@click.command("status")
@click.argument("key_labels", nargs=-1, metavar="[KEY]...")
@db_options
@_json_option
def status_command(
    key_labels: tuple[str, ...], dsn: str, connect_timeout: str, as_json: bool
) -> int:
    """What is held right now, and how each key's runs went.

    Without KEY: every key in the run history, every key leased now, and every advisory
    lock held by a jobrun session. A multi-key run is one KEY, comma-joined in locking
    order (as its event lines show it).
    """
    import json  # noqa: PLC0415 - keeps --help light

    from jobrun import db, keys, status  # noqa: PLC0415 - keeps --help light

    for label in key_labels:
        for part in label.split(","):
            keys.validate_name(part)
    target = _target(dsn, connect_timeout)
    with (
        db.connect(target, app_name="jobrun-status") as conn,
        db.translate_errors(target, "reading the status"),
    ):
        found = status.collect(conn, key_labels)
    for note in found.notes:
        click.echo(f"jobrun: note: {note}", err=True)
    if as_json:
        click.echo(json.dumps([row.as_json() for row in found.keys], indent=2))
    elif found.keys:
        click.echo(status.status_table(found.keys))
    else:
        click.echo("nothing held, no run history")
    return 0


@click.command("history")
@click.argument("key_label", metavar="KEY")
@click.option(
    "--limit",
    type=click.IntRange(1, 100_000),
    default=20,
    show_default=True,
    help="Show this many runs, newest first.",
)
@click.option(
    "--overlapping",
    "other_label",
    metavar="OTHER",
    help="Only runs of KEY that overlapped a run of OTHER: both sides, and for how long.",
)
@click.option(
    "--since",
    metavar="DURATION",
    help="With --overlapping: only runs of KEY that started within this long, e.g. 30d.",
)
@db_options
@_json_option
def history_command(  # noqa: PLR0917 - click passes one parameter per option
    key_label: str,
    limit: int,
    other_label: str | None,
    since: str | None,
    dsn: str,
    connect_timeout: str,
    as_json: bool,
) -> int:
    """Recent runs and skips of KEY: outcome, exit code, duration, deadlocks, host, start.

    With --overlapping OTHER: the runs of KEY whose window intersected a run of OTHER,
    one line per pair, newest first (the nights two jobs ran at once).
    """
    import json  # noqa: PLC0415 - keeps --help light

    from jobrun import db, durations, keys, status  # noqa: PLC0415 - keeps --help light
    from jobrun.exitcodes import UsageError  # noqa: PLC0415 - keeps --help light

    for label in (key_label, other_label or ""):
        for part in filter(None, label.split(",")):
            keys.validate_name(part)
    if since is not None and other_label is None:
        raise UsageError("--since goes with --overlapping")
    since_seconds = None if since is None else durations.parse(since, option="--since")
    target = _target(dsn, connect_timeout)
    if other_label is not None:
        with (
            db.connect(target, app_name="jobrun-history") as conn,
            db.translate_errors(target, "reading the history"),
        ):
            pairs = status.overlapping(
                conn, key_label, other_label, since=since_seconds, limit=limit
            )
        if as_json:
            click.echo(json.dumps(pairs or [], indent=2, default=str))
        elif pairs:
            click.echo(status.overlap_table(pairs))
        else:
            click.echo(f"no run of {key_label} overlapped a run of {other_label}")
        return 0
    with (
        db.connect(target, app_name="jobrun-history") as conn,
        db.translate_errors(target, "reading the history"),
    ):
        runs = status.runs_of(conn, key_label, limit)
    if runs is None:
        click.echo(
            "jobrun: note: no run history yet (the jobrun.runs table does not exist)", err=True
        )
        runs = []
    if as_json:
        click.echo(json.dumps(runs, indent=2, default=str))
    elif runs:
        click.echo(status.history_table(runs))
    else:
        click.echo(f"no runs of {key_label} in the history")
    return 0


@click.command("doctor")
@db_options
@click.option(
    "--mode",
    envvar="JOBRUN_MODE",
    type=click.Choice(MODES),
    default="session",
    show_default=True,
    help="Judge the database for this lock mode.",
)
@_json_option
def doctor_command(dsn: str, connect_timeout: str, mode: str, as_json: bool) -> int:
    """Check what a run depends on: server, role, schema, pooler, settings, capacity.

    One line per check, OK / WARN / FAIL. Exit status: 0 when nothing FAILs, 1 when
    something does, 69 when the database cannot be reached at all.
    """
    import json  # noqa: PLC0415 - keeps --help light

    from jobrun import db, doctor  # noqa: PLC0415 - keeps --help light

    target = _target(dsn, connect_timeout)
    with db.connect(target, app_name="jobrun-doctor") as conn:
        findings = doctor.diagnose(conn, target, mode=mode)
    if as_json:
        click.echo(json.dumps([finding.as_json() for finding in findings], indent=2))
    else:
        click.echo(doctor.report(findings))
    return doctor.exit_status(findings)
