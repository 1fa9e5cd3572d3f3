"""Where each subcommand is defined, and its line in ``jobrun --help``: loaded only when used.

A run imports none of the subcommands' modules and builds none of their options: cron,
systemd and CI start jobrun many times a day, and ``jobrun --help`` or ``jobrun key NAME``
should cost little more than click itself. tests/test_cli_edges.py checks this table against
the commands themselves.
"""

from __future__ import annotations

from typing import NamedTuple


class Lazy(NamedTuple):
    """A subcommand's module, the command's name in it, and its one-line help."""

    module: str
    attribute: str
    summary: str


SUBCOMMANDS: dict[str, Lazy] = {
    "deadlocks": Lazy(
        "jobrun.cli.ops",
        "deadlocks_command",
        "Find every deadlock in PostgreSQL server logs and name both sides.",
    ),
    "demo": Lazy(
        "jobrun.cli.tools",
        "demo_command",
        "See jobrun work: a run, a skip, a later run (a throwaway database unless one is named).",
    ),
    "doctor": Lazy(
        "jobrun.cli.ops",
        "doctor_command",
        "Check what a run depends on: server, role, schema, pooler, settings, capacity, logging.",
    ),
    "drill": Lazy(
        "jobrun.cli.tools",
        "drill_command",
        "Rehearse the crash paths on your database: skip, kill -9, lock taken away.",
    ),
    "forget": Lazy(
        "jobrun.cli.forget",
        "forget_command",
        "Remove all that is recorded of a retired KEY: runs, skips, kept output, pauses.",
    ),
    "grant": Lazy(
        "jobrun.cli.tenants",
        "grant_command",
        "Let ROLE use the keys it is granted, and only those (needs jobrun init; as owner).",
    ),
    "grants": Lazy(
        "jobrun.cli.tenants",
        "grants_command",
        "Who may do what: each role's grants (job, operator, reader) and their key patterns.",
    ),
    "help": Lazy("jobrun.cli.tools", "help_command", "Show the help of jobrun, or of SUBCOMMAND."),
    "history": Lazy(
        "jobrun.cli.ops",
        "history_command",
        "Recent runs and skips of KEY: outcome, exit code, duration, deadlocks, host, start.",
    ),
    "init": Lazy(
        "jobrun.cli.tenants",
        "init_command",
        "Protect jobrun's tables in a database shared by several teams (run once, as owner).",
    ),
    "key": Lazy(
        "jobrun.cli.tools",
        "key_command",
        "Print the lock id of each key NAME, and how pg_locks shows it.",
    ),
    "overlap": Lazy(
        "jobrun.cli.overlap",
        "overlap_command",
        "Run two commands against each other N times and report their deadlocks.",
    ),
    "pause": Lazy(
        "jobrun.cli.control",
        "pause_command",
        "Pause KEY: its runs skip (reason paused, the skip status) until resumed.",
    ),
    "resume": Lazy(
        "jobrun.cli.control",
        "resume_command",
        "End the pause of KEY: its next run goes ahead.",
    ),
    "show": Lazy(
        "jobrun.cli.ops",
        "show_command",
        "Print the output tails a failed run kept (--keep-output), by its run id or KEY.",
    ),
    "status": Lazy(
        "jobrun.cli.ops",
        "status_command",
        "What is held right now, and how each key's runs went.",
    ),
    "stop": Lazy(
        "jobrun.cli.control",
        "stop_command",
        "Stop the run holding KEY, wherever it runs, as if its lock were lost.",
    ),
    "timeline": Lazy(
        "jobrun.cli.timeline",
        "timeline_command",
        "Draw the runs of each KEY as a lane, their overlaps and deadlocks, to a file.",
    ),
    "version": Lazy(
        "jobrun.cli.tools",
        "version_command",
        "Print jobrun's version (as --version does).",
    ),
}
