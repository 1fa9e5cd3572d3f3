"""Text from the database or another process made fit for a terminal: no raw control codes."""

from __future__ import annotations

import unicodedata

#: Categories spelled as escapes: control (Cc), format (Cf: bidi overrides, zero-width),
#: surrogates (Cs), line and paragraph separators, private use and unassigned code points.
_ESCAPED = frozenset({"Cc", "Cf", "Cs", "Zl", "Zp", "Co", "Cn"})


def shown(text: object) -> str:
    """``text`` with every control or invisible character spelled as a Python escape."""
    return "".join(
        char
        if unicodedata.category(char) not in _ESCAPED
        else char.encode("unicode_escape", "backslashreplace").decode("ascii")
        for char in str(text)
    )
