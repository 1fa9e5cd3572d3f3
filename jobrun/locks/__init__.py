"""The small interface every lock mode (session advisory lock, lease) implements."""

from __future__ import annotations

import datetime as dt
import os
import socket
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from jobrun.history.calls import SharedSession


def new_run_id() -> str:
    """A random (version 4) UUID as text, without importing ``uuid`` (and ``platform``)."""
    raw = bytearray(os.urandom(16))
    raw[6] = (raw[6] & 0x0F) | 0x40  # version 4
    raw[8] = (raw[8] & 0x3F) | 0x80  # RFC 4122 variant
    text = raw.hex()
    return f"{text[:8]}-{text[8:12]}-{text[12:16]}-{text[16:20]}-{text[20:]}"


@dataclass(frozen=True)
class Identity:
    """Who we are, as other runs and ``status`` will see us."""

    run_id: str
    host: str = field(default_factory=socket.gethostname)
    pid: int = 0
    started: dt.datetime = field(default_factory=lambda: dt.datetime.now(dt.timezone.utc))


@dataclass(frozen=True)
class Holder:
    """Whoever holds a lock: a run that skipped names it, ``status`` shows it.

    Every field but the key is optional (privileges, foreign holders); ``mode`` is how it
    holds the lock (``session`` or ``lease``) where that is said.
    """

    key: str
    mode: str | None = None
    host: str | None = None
    pid: int | None = None
    run_id: str | None = None
    since: str | None = None
    backend_pid: int | None = None
    client_addr: str | None = None
    application_name: str | None = None
    expires_at: str | None = None

    def fields(self) -> dict[str, Any]:
        """``holder_*`` log fields, leaving out what we do not know."""
        return {f"holder_{name}": value for name, value in vars(self).items() if value is not None}


class Lock(Protocol):
    """A lock on a set of keys, held by one run at a time.

    ``acquire`` raises LockStoreUnavailable when the store cannot be used; ``check`` raises
    LockLost when the lock is provably gone and LockStoreUnavailable when this check could
    not tell (the watchdog then retries until ``confirmation_lifetime`` runs out).
    """

    #: Seconds, counted from when a successful check was *sent*, that the child may go on
    #: running without another successful check.
    confirmation_lifetime: float
    #: Monotonic time the successful acquisition was sent (lease) or completed (session).
    confirmed_at: float
    #: A ``jobrun stop`` request for this run (host, username, pid, reason, requested_at),
    #: set by the ``check`` that first read it.
    stop_request: dict[str, object] | None

    def acquire(self, wait: float) -> Holder | None:
        """Take every key (None) or none of them (who holds the first one we could not get)."""
        ...

    def check(self) -> None:
        """Confirm (session) or renew (lease) that the lock is still ours."""
        ...

    def pause(self, seconds: float, stop_fd: int) -> None:
        """Sleep up to ``seconds``; return early when ``stop_fd`` is readable or trouble shows."""
        ...

    def interrupt(self) -> None:
        """Make a check that hangs on a dead network fail now (called from another thread)."""
        ...

    def shared(self) -> SharedSession | None:
        """The connection this lock lends the history's calls (None: they connect on their own).

        Session mode: the lock session itself, for the whole run. Lease mode: the loan of
        the attempt's and the release's connections (see ``lend``).
        """
        ...

    def slot_taken(self) -> tuple[int, int] | None:
        """With ``--slots``: the slot taken (0-based) and its lock id; otherwise None."""
        ...

    def lend(self) -> None:
        """Lease mode: open the release's connection now, lent to the history's end row.

        Session mode: nothing (the lock session is lent all along). Never raises.
        """
        ...

    def end_loan(self) -> None:
        """Lease mode: close the connection lent to the history (before the child starts).

        Session mode: nothing.
        """
        ...

    def release(self) -> None:
        """Give the lock back (and close a connection lent to the history); never raises."""
        ...

    def known_lost(self) -> str | None:
        """Why the lock is gone, when that is known without asking the server (else None)."""
        ...
