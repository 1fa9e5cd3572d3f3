"""The ``status``, ``history`` and ``doctor`` subcommands (click only; the rest loads lazily)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import click
from click.core import ParameterSource

from jobrun.options import MODES, db_options

if TYPE_CHECKING:
    from jobrun import db


def register(group: click.Group) -> None:
    """Add the status, history, doctor and deadlocks subcommands to the jobrun group."""
    group.add_command(status_command)
    group.add_command(history_command)
    group.add_command(doctor_command)
    group.add_command(deadlocks_command)


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
@db_options
@_json_option
def history_command(
    key_label: str, limit: int, dsn: str, connect_timeout: str, as_json: bool
) -> int:
    """Recent runs and skips of KEY: outcome, exit code, duration, host, pid, start."""
    import json  # noqa: PLC0415 - keeps --help light

    from jobrun import db, keys, status  # noqa: PLC0415 - keeps --help light

    for part in key_label.split(","):
        keys.validate_name(part)
    target = _target(dsn, connect_timeout)
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
    """Check what a run depends on: server, role, schema, pooler, settings, capacity, logging.

    One line per check: OK, NOTE (worth knowing, e.g. deadlock logging), WARN, FAIL, or
    UNKNOWN (the check could not run). Exit status: 0 when every check ran and nothing
    FAILs, 1 when something FAILs or is UNKNOWN, 69 when the database cannot be reached.
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


@click.command("deadlocks")
@click.argument("logfiles", nargs=-1, required=True, metavar="LOGFILE...")
@click.option(
    "--log-line-prefix",
    "prefix",
    metavar="PREFIX",
    help="The server's log_line_prefix, for a stderr log whose layout is not guessed.",
)
@click.option("--check", is_flag=True, help="Exit 1 when the logs hold any deadlock.")
@_json_option
def deadlocks_command(
    logfiles: tuple[str, ...], prefix: str | None, check: bool, as_json: bool
) -> int:
    """Find every deadlock in PostgreSQL server logs and name both sides.

    LOGFILE: a stderr, csvlog or jsonlog file (.gz too), or - for stdin. With %a in
    log_line_prefix (or csvlog/jsonlog) each side is named by its application, which is
    jobrun:<key> for a job jobrun runs. Exit status: 0 when read (1 with --check when a
    deadlock was found), 66 when a file cannot be read, 65 when it is not a PostgreSQL log.
    """
    from jobrun import deadlocks  # noqa: PLC0415 - keeps --help light

    return deadlocks.run(logfiles, prefix=prefix, as_json=as_json, check=check, echo=click.echo)
