"""The command line: parse, validate, wire the collaborators, exit. No SQL, no processes here."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from jobrun.cli.main import main

if TYPE_CHECKING:
    from jobrun.cli.run import cli

__all__ = ["cli", "main"]


def __getattr__(name: str) -> Any:
    """``cli``, the run command, imported when first asked for.

    WARNING: not with this package: the command is made from jobrun.run.settings, which uses
    jobrun.flags; importing it here would leave jobrun.run.settings half made whenever it
    is imported first.
    """
    if name == "cli":
        from jobrun.cli.run import cli

        return cli
    raise AttributeError(name)
