"""The command line: parse, validate, wire the collaborators, exit. No SQL, no processes here."""

from __future__ import annotations

from jobrun.cli.main import main
from jobrun.cli.run import cli

__all__ = ["cli", "main"]
