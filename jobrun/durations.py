"""Parse durations like ``90``, ``30s``, ``5m``, ``1h30m``, ``250ms``, ``1d`` into seconds."""

from __future__ import annotations

import re

from jobrun.exitcodes import UsageError

_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h|d)")
_WHOLE = re.compile(r"(?:\d+(?:\.\d+)?(?:ms|s|m|h|d))+")


def parse(text: str, *, option: str = "duration") -> float:
    """Seconds in ``text``; a bare number means seconds. Raise UsageError otherwise."""
    value = text.strip().lower()
    if re.fullmatch(r"\d+(?:\.\d+)?", value):
        return float(value)
    if not _WHOLE.fullmatch(value):
        raise UsageError(
            f"{option}: {text!r} is not a duration (examples: 90, 30s, 5m, 1h30m, 250ms, 1d)"
        )
    return sum(float(number) * _UNITS[unit] for number, unit in _PART.findall(value))


def format_seconds(seconds: float) -> str:
    """A short human form of a duration for messages: ``2.5s``, ``90s``, ``1h30m0s``."""
    if seconds < 60:  # noqa: PLR2004 - under a minute, plain seconds read best
        return f"{seconds:g}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{secs}s" if hours else f"{minutes}m{secs}s"
