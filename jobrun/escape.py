"""Make text from elsewhere (the database, a server log, another process) safe to print."""

from __future__ import annotations

import re

#: Characters that must never reach a terminal raw: the C0 controls (ESC starts every
#: terminal escape sequence, BEL ends OSC 52 clipboard writes, CR overwrites a line), DEL
#: and the C1 controls (U+009B alone is CSI to many terminals); the bidirectional controls,
#: which make a terminal show text in another order than it is; the line and paragraph
#: separators; and lone surrogates (bytes that were not UTF-8, which cannot be printed).
_OTHER_UNSAFE = "\x7f-\x9f\u061c\u200e\u200f\u2028-\u202e\u2066-\u2069\ud800-\udfff"
_UNSAFE = re.compile(f"[\x00-\x1f{_OTHER_UNSAFE}]")
#: The same, but tab and newline may stay: a program's output is shown as lines.
_UNSAFE_IN_LINES = re.compile(f"[\x00-\x08\x0b-\x1f{_OTHER_UNSAFE}]")
_SHORT = {"\t": "\\t", "\n": "\\n", "\r": "\\r"}
#: Surrogateescape's stand-ins for undecodable bytes (U+DC80..U+DCFF): shown as the byte.
_BYTE_SURROGATES = range(0xDC80, 0xDD00)
_LATIN1_END = 0xFF


def printable(text: object) -> str:
    r"""``text`` on one line, with every unsafe character written visibly: ``\x1b``, ``\n``.

    For a table cell, a log field or a line of a report: tab, CR and newline are escaped
    too, so a value cannot break its column or forge a line of its own. Backslashes are
    left as they are, so ordinary text reads as written (``--json`` is the exact form).
    """
    return _UNSAFE.sub(_visible, text if isinstance(text, str) else str(text))


def printable_lines(text: str) -> str:
    r"""``text`` as lines: like printable(), but newlines and tabs are kept as they are.

    For a program's output shown as it was written (``jobrun show``): a tab only moves the
    cursor right and a newline starts the next line, neither can hide or rewrite text.
    """
    return _UNSAFE_IN_LINES.sub(_visible, text)


def _visible(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    if char in _SHORT:
        return _SHORT[char]
    if code in _BYTE_SURROGATES:
        return f"\\x{code - 0xDC00:02x}"
    if code <= _LATIN1_END:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}"
