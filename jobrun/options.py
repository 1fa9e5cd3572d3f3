"""Options shared by several commands (click only: imported on every path)."""

from __future__ import annotations

from typing import Any

import click

MODES = ("session", "lease")


def log_options(command: Any) -> Any:
    """--log-format, --log-file, --log-level (and their JOBRUN_* variables)."""
    for decorator in reversed(
        (
            click.option(
                "--log-format",
                envvar="JOBRUN_LOG_FORMAT",
                type=click.Choice(["auto", "json", "logfmt", "console"]),
                default="auto",
                show_default=True,
                help="Event line format; auto = console on a terminal, JSON otherwise.",
            ),
            click.option(
                "--log-file",
                envvar="JOBRUN_LOG_FILE",
                metavar="PATH",
                help="Append events here instead of stderr (safe with concurrent writers).",
            ),
            click.option(
                "--log-level",
                envvar="JOBRUN_LOG_LEVEL",
                type=click.Choice(["debug", "info", "warning", "error"]),
                default="info",
                show_default=True,
                help="Least severe event to write.",
            ),
        )
    ):
        command = decorator(command)
    return command


def db_options(command: Any) -> Any:
    """--dsn and --connect-timeout (and their JOBRUN_* variables)."""
    for decorator in reversed(
        (
            click.option(
                "--dsn",
                envvar="JOBRUN_DSN",
                default="",
                metavar="DSN",
                help="libpq connection string or URI; default: PG* variables, service "
                "file, ~/.pgpass. Prefer JOBRUN_DSN or .pgpass for passwords.",
            ),
            click.option(
                "--connect-timeout",
                envvar="JOBRUN_CONNECT_TIMEOUT",
                default="10s",
                show_default=True,
                metavar="DURATION",
                help="Give up connecting after this long.",
            ),
        )
    ):
        command = decorator(command)
    return command
