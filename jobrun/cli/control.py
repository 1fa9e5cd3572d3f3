"""``stop``, ``pause``, ``resume``: operators steer a key's runs from any host."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

import click

from jobrun import flags
from jobrun.cli.group import Subcommand
from jobrun.durations import format_seconds
from jobrun.exitcodes import Exit, UsageError

if TYPE_CHECKING:
    from jobrun.locks import Holder

#: ``stop --wait`` by default: the default --kill-after (10 s), the heartbeat that delivers
#: the request (the session confirmation lifetime, 10 s) and a margin.
STOP_WAIT = "30s"


reason_option = click.option(
    "--reason", metavar="TEXT", help="Why: logged by the run and shown by status."
)


@click.command("stop", cls=Subcommand, takes=("dsn", "connect_timeout"), keys_as="label")
@click.argument("key_label", metavar="KEY")
@reason_option
@click.option(
    "--wait",
    type=flags.Duration(),
    default=STOP_WAIT,
    show_default=True,
    metavar="DURATION",
    help="How long to wait for the run to end (its --kill-after plus its heartbeat, at least).",
)
@click.option(
    "--force",
    is_flag=True,
    help="If the run has not ended after --wait, take its lock away (terminate its lock "
    "session, delete its lease).",
)
@flags.database
def stop_command(  # noqa: PLR0917 - click passes one parameter per option
    key_label: str,
    reason: str | None,
    wait: float,
    force: bool,
    dsn: str,
    connect_timeout: float,
) -> int:
    """Stop the run holding KEY, wherever it runs, as if its lock were lost.

    The run reads the request at its next heartbeat, stops its child (SIGTERM to the group,
    SIGKILL after its --kill-after), logs who asked and ends with outcome stopped (exit 77).
    Exit status: 0 the run ended; 1 nothing held KEY (that this role may see), or no run of
    it was ever recorded; 3 it did not end within --wait (with --force: its lock was then
    taken away), or it was not asked: its holder could not be shown, from the server's
    records, to be a run of KEY. Recorded as who asked: this database role (session_user);
    $USER only as a claim.
    """
    from jobrun import keys
    from jobrun.escape import printable
    from jobrun.ops import control, records

    key_label = keys.normalized_label(key_label)
    with flags.connected(
        dsn, connect_timeout, app_name="jobrun-stop", doing="stopping the run"
    ) as conn:
        holder, labelled = records.held_if_recorded(conn, key_label)
        if holder is None:
            click.echo(f"jobrun: nothing holds {key_label}", err=True)
            return int(Exit.ATTENTION)
        who = printable(
            f"run {holder.run_id or '?'} on {holder.host or '?'} (pid {holder.pid or '?'})"
        )
        if holder.run_id is None:
            # No run id to address a request to: not a jobrun run, or one whose statements
            # (where a run announces itself) this role may not see.
            click.echo(f"jobrun: {key_label} is held by {_unaddressable(holder)}", err=True)
            if force:
                control.take_away(conn, holder, key_label)
                click.echo(f"jobrun: took the lock of {key_label} away (--force)", err=True)
            return int(Exit.NOT_ENDED)
        asked = control.ask_to_stop(conn, key_label, holder, reason, labelled=labelled)
        click.echo(f"asked {who} to stop (as role {printable(asked.by)})", err=True)
        result = control.wait_for_end(conn, key_label, holder, wait, force=force, held=asked.held)
    if result.ended:
        how = f": {result.outcome} (exit {result.exit_code})" if result.outcome else ""
        click.echo(f"{key_label}: {who} ended{how}")
        return 0
    if result.took_lock:
        click.echo(
            f"jobrun: {who} did not end within {format_seconds(wait)}; took its "
            "lock away (--force): it stops at its next heartbeat if it is still alive",
            err=True,
        )
    else:
        click.echo(
            f"jobrun: {who} did not end within {format_seconds(wait)} "
            "(--force takes its lock away)",
            err=True,
        )
    return int(Exit.NOT_ENDED)


@click.command("pause", cls=Subcommand, takes=("dsn", "connect_timeout"), keys_as="label")
@click.argument("key_label", metavar="KEY")
@click.option(
    "--for",
    "for_",
    type=flags.Duration(minimum="1s", why="a pause lasts a while"),
    metavar="DURATION",
    help="Pause for this long (default: until resumed).",
)
@click.option(
    "--until",
    metavar="TIME",
    help="Pause until this ISO 8601 time (without a zone: this machine's local time).",
)
@reason_option
@click.option("--new", is_flag=True, help="KEY has not run yet: pause it all the same.")
@flags.database
def pause_command(  # noqa: PLR0917 - click passes one parameter per option
    key_label: str,
    for_: float | None,
    until: str | None,
    reason: str | None,
    new: bool,
    dsn: str,
    connect_timeout: float,
) -> int:
    """Pause KEY: its runs skip (reason paused, the skip status) until resumed.

    A run already going is not affected; paused skips never build a skip streak. A KEY
    that never ran is refused (exit 1: a typo?) unless --new says it is a new job.
    """
    from psycopg import errors

    from jobrun import keys
    from jobrun.escape import printable
    from jobrun.ops import control, records

    key_label = keys.normalized_label(key_label)
    if for_ is not None and until is not None:
        raise UsageError("--for and --until exclude each other")
    until_at = _time(until) if until is not None else None
    with flags.connected(
        dsn, connect_timeout, app_name="jobrun-pause", doing="pausing the key"
    ) as conn:
        records.require_recorded(
            conn, key_label, need="control", unless=new, hint="; --new pauses a new job"
        )
        try:
            since, ends, by = control.pause(
                conn, key_label, seconds=for_, until=until_at, reason=reason
            )
        except errors.InsufficientPrivilege:
            # --new asked nothing first: a key of another team is refused as such here.
            records.refuse_unless_granted(conn, key_label, "control")
            raise
    role = printable(by or "?")
    click.echo(f"paused {key_label} since {since} until {ends or 'resumed'} (by role {role})")
    return 0


@click.command("resume", cls=Subcommand, takes=("dsn", "connect_timeout"), keys_as="label")
@click.argument("key_label", metavar="KEY")
@flags.database
def resume_command(key_label: str, dsn: str, connect_timeout: float) -> int:
    """End the pause of KEY: its next run goes ahead."""
    from jobrun import keys
    from jobrun.ops import records

    key_label = keys.normalized_label(key_label)
    with flags.connected(
        dsn, connect_timeout, app_name="jobrun-resume", doing="resuming the key"
    ) as conn:
        was_paused = records.resume_if_recorded(conn, key_label)
    click.echo(f"resumed {key_label}" if was_paused else f"{key_label} was not paused")
    return 0


def _time(text: str) -> dt.datetime:
    """``--until``: an ISO 8601 time in the future (no zone: local time)."""
    try:
        when = dt.datetime.fromisoformat(text)
    except ValueError:
        raise UsageError(
            f"--until {text!r}: not an ISO 8601 time (e.g. 2026-12-01T06:00:00+00:00)"
        ) from None
    if when.tzinfo is None:
        when = when.astimezone()
    if when <= dt.datetime.now(dt.timezone.utc):
        raise UsageError(f"--until {text!r} is in the past")
    return when


def _unaddressable(holder: Holder) -> str:
    """Who holds the key, for a holder without a run id, and why it cannot be asked."""
    name = holder.application_name or ""
    if name.startswith("jobrun:"):
        return (
            f"a jobrun session of another role (backend pid {holder.backend_pid}, "
            f"application_name {name}) whose run id this role cannot see, nor the history "
            "records: grant it pg_read_all_stats, or run stop as that role"
        )
    return (
        f"a session that is not a jobrun run (backend pid {holder.backend_pid}): "
        "it cannot be asked to stop"
    )
