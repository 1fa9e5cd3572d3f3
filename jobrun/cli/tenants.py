"""``init``, ``grant``, ``grants``: who may run, stop, pause and read which keys."""

from __future__ import annotations

import click

from jobrun import flags
from jobrun.cli.group import Subcommand
from jobrun.exitcodes import UsageError

print_sql_option = click.option(
    "--print-sql", is_flag=True, help="Print the SQL instead of running it (executes nothing)."
)


@click.command("init", cls=Subcommand, takes=("dsn", "connect_timeout"))
@print_sql_option
@flags.database
def init_command(print_sql: bool, dsn: str, connect_timeout: float) -> int:
    """Protect jobrun's tables in a database shared by several teams (run once, as owner).

    Creates the jobrun schema and every table, the grants table, row-level security on
    every table (each role sees and changes only the keys it was granted: jobrun grant)
    and the NOLOGIN roles jobrun_operator and jobrun_reader where this role may create
    roles. Safe to run again; history written before stays, readable by those granted it.
    """
    from jobrun.ops import tenants

    if print_sql:
        click.echo(tenants.init_script(), nl=False)
        return 0
    with flags.connected(
        dsn, connect_timeout, app_name="jobrun-init", doing="initialising jobrun's schema"
    ) as conn:
        notes = tenants.init(conn)
    for note in notes:
        click.echo(f"jobrun: note: {note}", err=True)
    click.echo("jobrun init: schema, tables and row-level security in place")
    return 0


@click.command("grant", cls=Subcommand, takes=("dsn", "connect_timeout"))
@click.argument("role")
@click.option(
    "--keys",
    "patterns",
    multiple=True,
    metavar="PATTERN",
    help="Keys matching this glob (a-*, nightly-?): run them and stop, pause, resume, show "
    "and read them. Repeatable. With --operator, --reader or --revoke: only these keys.",
)
@click.option("--operator", is_flag=True, help="Stop, pause, resume, show and read (every key).")
@click.option("--reader", is_flag=True, help="Read status and history, never kept output.")
@click.option("--revoke", is_flag=True, help="Take back every grant of ROLE (or of --keys).")
@print_sql_option
@flags.database
def grant_command(  # noqa: PLR0917 - click passes one parameter per option
    role: str,
    patterns: tuple[str, ...],
    operator: bool,
    reader: bool,
    revoke: bool,
    print_sql: bool,
    dsn: str,
    connect_timeout: float,
) -> int:
    """Let ROLE use the keys it is granted, and only those (needs jobrun init; as owner).

    PostgreSQL enforces it: the role cannot see, write, stop, pause or take the lock of
    another key's runs in any jobrun table.
    """
    from jobrun.escape import printable
    from jobrun.ops import tenants

    if sum((operator, reader, revoke)) > 1:
        raise UsageError("--operator, --reader and --revoke exclude each other")
    if not (patterns or operator or reader or revoke):
        raise UsageError("say what to grant: --keys PATTERN, --operator, --reader or --revoke")
    kind = None if revoke else "operator" if operator else "reader" if reader else "job"
    for pattern in patterns:
        tenants.validate_pattern(pattern)
    request = tenants.Grant(
        role=tenants.validate_role(role),
        kind=kind,
        patterns=tuple(dict.fromkeys(patterns)) or (() if revoke else ("*",)),
    )
    if print_sql:
        click.echo(tenants.as_text(tenants.grant_statements(request)), nl=False)
        return 0
    with flags.connected(dsn, connect_timeout, app_name="jobrun-grant", doing="granting") as conn:
        tenants.grant(conn, request)
    what = "revoked" if revoke else f"granted {kind}"
    keys = f" keys {', '.join(request.patterns)}" if request.patterns else ""
    click.echo(f"{what}{keys} {'from' if revoke else 'to'} {printable(role)}")
    return 0


@click.command("grants", cls=Subcommand, takes=("dsn", "connect_timeout"))
@flags.database
@flags.as_json
def grants_command(dsn: str, connect_timeout: float, as_json: bool) -> int:
    """Who may do what: each role's grants (job, operator, reader) and their key patterns."""
    import json

    from jobrun.escape import printable
    from jobrun.ops import tenants

    with flags.connected(
        dsn, connect_timeout, app_name="jobrun-grants", doing="reading the grants"
    ) as conn:
        rows = tenants.grants(conn)
    if as_json:
        click.echo(json.dumps(rows, indent=2, default=str))
        return 0
    lines = [("ROLE", "KIND", "KEYS", "SINCE")]
    for row in rows:
        gone = "" if row["role_exists"] else " (no such role)"
        since = row["granted_at"]
        when = since.isoformat(timespec="seconds") if hasattr(since, "isoformat") else since
        lines.append(
            (
                printable(row["role"]) + gone,
                str(row["kind"]),
                printable(row["pattern"]),
                str(when),
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(3)]
    for line in lines:
        cells = [cell.ljust(width) for cell, width in zip(line, widths, strict=False)]
        click.echo("  ".join((*cells, line[3])))
    return 0
