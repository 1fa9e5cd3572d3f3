"""Text from the database or another process, made safe to print for a person."""

from __future__ import annotations


def printable(value: object) -> str:
    """``value`` as text with every character that is not printable escaped (``\\x1b``).

    A row another role wrote (a lease's host, a run's key) must not reach a terminal as
    raw control characters: an escape sequence could rewrite what the operator sees.
    """
    return "".join(
        char if char.isprintable() else char.encode("unicode_escape").decode("ascii")
        for char in str(value)
    )
