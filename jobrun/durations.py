"""Parse durations like ``90``, ``30s``, ``5m``, ``1h30m``, ``250ms``, ``1d`` into seconds."""

from __future__ import annotations

import re

from jobrun.exitcodes import UsageError

#: Ten years: longer is a typo (and some of it would not fit PostgreSQL's intervals).
MAX_SECONDS = 3650 * 86400.0
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0}
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h|d)")
_WHOLE = re.compile(r"(?:[0-9]+(?:\.[0-9]+)?(?:ms|s|m|h|d))+")


def parse(text: str, *, option: str = "duration") -> float:
    """Seconds in ``text``; a bare number means seconds. Raise UsageError otherwise."""
    value = text.strip().lower()
    if re.fullmatch(r"[0-9]+(?:\.[0-9]+)?", value):
        seconds = float(value)
    elif _WHOLE.fullmatch(value):
        seconds = sum(float(number) * _UNITS[unit] for number, unit in _PART.findall(value))
    else:
        raise UsageError(
            f"{option}: {text!r} is not a duration (examples: 90, 30s, 5m, 1h30m, 250ms, 1d)"
        )
    if not seconds <= MAX_SECONDS:  # also false for inf: a run of 400 digits overflows
        raise UsageError(f"{option}: {text!r} is too long (at most 3650d)")
    return seconds


def format_seconds(seconds: float) -> str:
    """A short human form of a duration for messages: ``2.5s``, ``90s``, ``1h30m0s``."""
    if seconds < 60:  # noqa: PLR2004 - under a minute, plain seconds read best
        return f"{seconds:g}s"
    minutes, secs = divmod(round(seconds), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes}m{secs}s" if hours else f"{minutes}m{secs}s"
