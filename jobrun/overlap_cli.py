"""Import path kept for callers of ``jobrun.overlap_cli.register``: see jobrun.cli.overlap."""

from jobrun.cli.overlap import register

__all__ = ["register"]
