"""``--jitter`` and ``--retries``: a run's delay before its lock, and its attempts under it.

Imported only by runs that use one of them: a plain run pays nothing for this module.
"""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import time
from pathlib import Path
from typing import TYPE_CHECKING

from jobrun.run import supervise

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from jobrun.run.job import Job
    from jobrun.run.watchdog import Watchdog

#: Where systemd keeps the machine's id (the fixed jitter's seed, with the host name).
MACHINE_ID = "/etc/machine-id"
#: ``--retry-delay`` doubles after each failed attempt, up to this many times itself.
RETRY_DELAY_CAP = 10


# --- --jitter -------------------------------------------------------------------------------


def machine_seed() -> str:
    """What makes this host's fixed delay its own: the machine id (where readable), host name.

    Both: containers cloned from one image may share a machine id, and two hosts may share
    a name, but seldom both.
    """
    try:
        machine = Path(MACHINE_ID).read_text(encoding="ascii", errors="replace").strip()
    except OSError:
        machine = ""
    return f"{machine}\n{socket.gethostname()}"


def jitter_delay(jitter: float, label: str, *, fresh: bool, seed: str | None = None) -> float:
    """The delay in [0, ``jitter``): the host's own for ``label`` (fixed), or a fresh draw.

    Fixed (as systemd's ``FixedRandomDelay``): the first 8 bytes of SHA-256 of the machine
    seed, a line feed and the key's label, as a fraction of 2**64, times ``jitter``. The same
    host and key wait the same delay every run; hosts of a fleet spread over the window.
    """
    if jitter <= 0:
        return 0.0
    if fresh:
        raw = os.urandom(8)
    else:
        text = f"{machine_seed() if seed is None else seed}\n{label}"
        raw = hashlib.sha256(text.encode("utf-8", "surrogateescape")).digest()[:8]
    return jitter * int.from_bytes(raw, "big") / 2**64


# --- --retries ------------------------------------------------------------------------------


def retry_delay(base: float, failed_attempt: int) -> float:
    """The pause after attempt ``failed_attempt`` (1-based).

    ``base`` doubled per attempt, at most RETRY_DELAY_CAP times ``base``.
    """
    return base * float(min(2 ** (failed_attempt - 1), RETRY_DELAY_CAP))


def retryable(job: Job, ending: supervise.Ending, *, attempts: int) -> bool:
    """Whether the run tries its child again after ``ending`` (its ``attempts``-th).

    Only a plain failing exit: non-zero, not killed by a signal, not stopped by jobrun
    (``--timeout``, a lost lock, ``jobrun stop``), no signal passed on to it (someone asked
    the job to end: it is not tried again), and the lock not known lost. ``--retry-on``:
    only those exit codes.
    """
    code = ending.returncode
    if attempts > job.retries or code <= 0:
        return False
    if ending.stopped_for is not None or ending.lost_reason is not None:
        return False
    if ending.forwarded is not None:
        return False
    return not job.retry_on or code in job.retry_on


def pause(
    seconds: float, watchdog: Watchdog | None, log: FilteringBoundLogger
) -> dict[str, object] | None:
    """Sleep ``seconds`` between two attempts, the lock still held and watched.

    None: slept; go on. Otherwise why the run ends here (logged): a signal for jobrun (its
    fields: ``signal``), a lost lock or a stop request; the run's status stays its last
    attempt's.
    """
    deadline = time.monotonic() + seconds
    while (now := time.monotonic()) < deadline:
        if watchdog is not None:
            why = _lock_trouble(watchdog, now)
            if why is not None:
                log.warning("retry_abandoned", **why)
                return why
        until = deadline if watchdog is None else min(deadline, watchdog.stop_at)
        info = signal.sigtimedwait(supervise.WAITED, max(0.0, until - now))
        if info is not None and info.si_signo in supervise.FORWARDED:
            why = {"signal": signal.Signals(info.si_signo).name}
            log.warning("retry_abandoned", **why)
            return why
    if watchdog is not None:
        why = _lock_trouble(watchdog, time.monotonic())
        if why is not None:
            log.warning("retry_abandoned", **why)
            return why
    return None


def _lock_trouble(watchdog: Watchdog, now: float) -> dict[str, object] | None:
    """Why the lock no longer lets the run try again (None: it does)."""
    if watchdog.lost is not None:
        return {"lock_lost": watchdog.lost}
    if now >= watchdog.stop_at:
        return {"lock_lost": "the lock could not be confirmed in time (no heartbeat answer)"}
    if watchdog.stop_request is not None:
        return {f"stop_requested_by_{k}": v for k, v in watchdog.stop_request.items()} or {
            "stop_requested": True
        }
    return None
