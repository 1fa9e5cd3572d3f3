"""A run as a person names it: a run id, the first digits of one, or a key's newest output."""

from __future__ import annotations

import re
import uuid
from typing import TYPE_CHECKING, Any

from jobrun import keys
from jobrun.escape import printable
from jobrun.exitcodes import Exit, JobrunError, UsageError
from jobrun.history import schema
from jobrun.sql import runids as statements

if TYPE_CHECKING:
    import psycopg

    Connection = psycopg.Connection[Any]

#: The shortest prefix taken: 4 hex digits (``jobrun history`` shows 8).
MIN_PREFIX = 4
#: Runs an ambiguous prefix lists.
LISTED = 5
_PREFIX = re.compile(r"[0-9a-f]+")
_HEX_DIGITS = 32


class NoSuchRun(JobrunError):
    """Nothing in the history matches what was given (exit 1)."""

    exit_code = Exit.ATTENTION


def prefix_of(text: str) -> str | None:
    """The hex digits of ``text`` if it can be (the start of) a run id, else None."""
    digits = text.strip().lower().replace("-", "")
    if MIN_PREFIX <= len(digits) <= _HEX_DIGITS and _PREFIX.fullmatch(digits):
        return digits
    return None


def resolve(conn: Connection, text: str) -> str:
    """The full run id that ``text`` names: a run id, a unique prefix of one, or a KEY.

    A KEY names its newest run that kept output. Text that could be both is first read as
    a run id prefix. Raises UsageError (exit 64) for an ambiguous prefix, NoSuchRun when
    nothing matches.
    """
    digits = prefix_of(text)
    if digits is not None:
        found = _by_prefix(conn, digits)
        if len(found) == 1:
            return str(found[0][0])
        if found:
            listed = "; ".join(
                f"{run_id} ({printable(key)}, {_iso(started)})"
                for run_id, key, started in found[:LISTED]
            )
            more = ", and more" if len(found) > LISTED else ""
            raise UsageError(
                f"run id {text!r} is ambiguous: it starts {listed}{more}; give more digits"
            )
    try:
        label = keys.normalized_label(text)
    except UsageError:
        label = None
    run_id = _newest_kept(conn, label) if label is not None else None
    if run_id is not None:
        return run_id
    raise NoSuchRun(
        f"no run id starting with {text!r} and no kept output of a key {text!r} in the history"
        if digits is not None
        else f"no run of {text} kept output (--keep-output) in the history"
    )


def _by_prefix(conn: Connection, digits: str) -> list[tuple[Any, ...]]:
    low, high = (_as_uuid(digits.ljust(_HEX_DIGITS, pad)) for pad in "0f")
    found = _read(
        conn, statements.RUN_IDS_BY_PREFIX, {"low": low, "high": high, "limit": LISTED + 1}
    )
    return found or []


def _newest_kept(conn: Connection, label: str) -> str | None:
    found = _read(conn, statements.NEWEST_KEPT_OF_KEY, {"key": label})
    return str(found[0][0]) if found else None


def _read(conn: Connection, statement: str, params: dict[str, Any]) -> list[tuple[Any, ...]] | None:
    """The rows of ``statement`` (after the schema's version check); None: no schema yet."""

    def attempt(check: tuple[str, ...]) -> list[tuple[Any, ...]]:
        *_, rows = schema.results(conn, ";\n".join((*check, statement)), params)
        return rows

    return schema.readable(conn, attempt)


def _as_uuid(digits: str) -> str:
    return str(uuid.UUID(hex=digits))


def _iso(value: object) -> str:
    return value.isoformat(timespec="seconds") if hasattr(value, "isoformat") else str(value)
