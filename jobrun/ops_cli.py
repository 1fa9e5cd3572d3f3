"""Import path kept for callers of ``jobrun.ops_cli.register``: see jobrun.cli.ops."""

from jobrun.cli.ops import register

__all__ = ["register"]
