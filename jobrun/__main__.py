"""The entry point (``jobrun`` and ``python -m jobrun``); jobrun/__init__ made Ctrl-C quiet."""

from __future__ import annotations


def main() -> None:
    """Run the command line (exceptions become exit statuses in jobrun.cli.main)."""
    from jobrun.cli import main as cli_main  # noqa: PLC0415 - as late as possible, on purpose

    cli_main()


if __name__ == "__main__":
    main()
