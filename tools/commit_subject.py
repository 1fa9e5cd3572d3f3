"""A commit-msg hook: the subject (first line) of a commit message is 72 characters or fewer."""

from __future__ import annotations

import sys
from pathlib import Path

#: Longest subject: what `git log --oneline` and most tools show without cutting it.
LIMIT = 72


def main(path: str) -> int:
    """0 when the message at ``path`` has a short enough subject, else 1 with one line."""
    with Path(path).open(encoding="utf-8", errors="replace") as message:
        subject = message.readline().rstrip("\n")
    if len(subject) > LIMIT:
        print(
            f"commit subject is {len(subject)} characters (at most {LIMIT}): "
            "put the detail in the body",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
