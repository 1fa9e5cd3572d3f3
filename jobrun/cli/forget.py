"""``forget``: remove all that is recorded of a retired key."""

from __future__ import annotations

import sys

import click

from jobrun import flags
from jobrun.cli.group import Subcommand
from jobrun.exitcodes import UsageError


@click.command("forget", cls=Subcommand, takes=("dsn", "connect_timeout"), keys_as="label")
@click.argument("key_label", metavar="KEY")
@click.option("--yes", is_flag=True, help="Do not ask: needed when stdin is not a terminal.")
@flags.database
def forget_command(key_label: str, yes: bool, dsn: str, connect_timeout: float) -> int:
    """Remove all that is recorded of a retired KEY: runs, skips, kept output, pauses.

    Also its --expect-every expectation, its stop requests and the expired leases of runs
    that died. Refused (exit 1) while a run holds KEY, and when nothing of KEY was ever
    recorded. Asks first on a terminal; elsewhere --yes is required (exit 64 without it).
    """
    from jobrun import keys
    from jobrun.ops import records

    key_label = keys.normalized_label(key_label)
    if not yes and not sys.stdin.isatty():
        raise UsageError(
            f"forget removes the whole history of {key_label}: add --yes "
            "(standard input is not a terminal to ask on)"
        )
    with flags.connected(
        dsn, connect_timeout, app_name="jobrun-forget", doing="forgetting the key"
    ) as conn:
        records.require_recorded(conn, key_label, need="run", hint="; nothing to forget")
        if not yes and not click.confirm(
            f"Forget every run, skip, kept output, pause and expectation of {key_label}?"
        ):
            click.echo("jobrun: nothing removed", err=True)
            return 1
        forgotten = records.forget(conn, key_label)
    click.echo(f"forgot {key_label}: {forgotten.describe()}")
    return 0
