"""The small interface every lock mode (session advisory lock, lease) implements."""

from __future__ import annotations

import datetime as dt
import os
import socket
from dataclasses import dataclass, field
from typing import Any, ClassVar, Protocol


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

    #: Why a run that finds this holder skips (``--coalesce``: ``queued``, a subclass's).
    skip_reason: ClassVar[str] = "locked"

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


@dataclass(frozen=True)
class Taken:
    """What ``Lock.acquire`` returns once every key is ours (a ``Holder``: someone else's).

    ``confirmed_at``: the monotonic time the acquisition was sent (lease) or completed
    (session), the lock's first confirmation (the watchdog's deadline counts from it).
    ``slot``: with ``--slots``, the slot taken (0-based) and its lock id; otherwise None.
    """

    confirmed_at: float
    slot: tuple[int, int] | None = None


class Lock(Protocol):
    """A lock on a set of keys, held by one run at a time, over the session it is handed.

    Five members: ``acquire`` takes it (or names its holder), ``check`` confirms it (and
    reads a ``jobrun stop`` request), ``known_lost`` says what is known without asking,
    ``release`` gives it back, ``confirmation_lifetime`` says how long a check vouches.

    ``acquire`` raises LockStoreUnavailable when the store cannot be used; ``check`` raises
    LockLost when the lock is provably gone and LockStoreUnavailable when this check could
    not tell (the watchdog then retries until ``confirmation_lifetime`` runs out). The
    connection is not the lock's: the run opens its server session (``jobrun.db.server_session``)
    and hands it to the lock, the history and the fence alike.
    """

    @property
    def confirmation_lifetime(self) -> float:
        """Seconds, from when a successful check was *sent*, the child may run without another."""
        ...

    def acquire(self, wait: float) -> Taken | Holder:
        """Take every key (``Taken``) or none of them (who holds the first one we could not get)."""
        ...

    def check(self) -> dict[str, object] | None:
        """Confirm (session) or renew (lease) that the lock is still ours.

        Returns the ``jobrun stop`` request for this run that this check read (who asked,
        why), or None: none, or the lookup could not be made (the lock is checked anyway).
        """
        ...

    def known_lost(self) -> str | None:
        """Why the lock is gone, when that is known without asking the server (else None)."""
        ...

    def release(self) -> None:
        """Give the lock back; never raises."""
        ...
