"""Text from a log or a database made safe for a terminal: control characters made visible."""

from __future__ import annotations

import re

#: C0 and C1 control characters but the tab, and DEL: a log's text never reaches a
#: terminal with them raw (an ESC could rewrite the screen, a CR hide a line).
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f-\x9f]")


def printable(text: str) -> str:
    """The text with every control character but the tab shown as a visible ``\\xNN``."""
    return _CONTROL.sub(lambda match: f"\\x{ord(match.group()):02x}", text)
