"""Database errors as jobrun's: one masked line, LockStoreUnavailable, at this boundary."""

from __future__ import annotations

import contextlib
import re
from typing import TYPE_CHECKING

import psycopg

from jobrun.exitcodes import LockStoreUnavailable
from jobrun.log import safe_text

from .dsn import redact

if TYPE_CHECKING:
    from collections.abc import Iterator

    from .dsn import Target

# The patterns below are used on error paths only: plain strings, compiled (and cached by
# ``re``) the first time they are needed, not at every start of a run.
#: The position PostgreSQL adds under a statement's error ("LINE 4: FROM jobrun.runs", then a
#: line with a caret): jobrun's own SQL, which tells a user nothing.
_ERROR_POSITION = r"\nLINE \d+: [^\n]*\n[ \t]*\^[^\n]*"


def one_line(exc: BaseException, target: Target | None = None) -> str:
    """An exception as one line with passwords masked (and without the SQL's position)."""
    text = re.sub(_ERROR_POSITION, "", str(exc))
    text = " ".join(safe_text(text).split()) or type(exc).__name__
    return redact(text, target.secrets if target else ())


def unavailable(exc: BaseException, target: Target, doing: str = "") -> LockStoreUnavailable:
    """The LockStoreUnavailable for a psycopg error raised while ``doing`` something.

    The one place a database error becomes jobrun's: the message is one line with the
    secrets masked; a rollback that could not be sent (the session died mid-transaction)
    is a database error like any other.
    """
    if isinstance(exc, psycopg.Rollback):
        text = "the session broke before its transaction could be rolled back"
    else:
        text = one_line(exc, target)
    return LockStoreUnavailable(f"{doing}: {text}" if doing else text, reason="error")


@contextlib.contextmanager
def translate_errors(target: Target, doing: str) -> Iterator[None]:
    """Turn psycopg errors raised while ``doing`` something into LockStoreUnavailable.

    WARNING: ``psycopg.Rollback`` is not a ``psycopg.Error``; it escapes a transaction
    block when the ROLLBACK itself fails on a dead connection, and is caught here too.
    """
    try:
        yield
    except (psycopg.Error, psycopg.Rollback) as exc:
        raise unavailable(exc, target, doing) from None
