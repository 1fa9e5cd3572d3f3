"""What a run runs and the rules it runs by: the command line's settings, validated."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from jobrun.keys import Key


@dataclass(frozen=True)
class Job:
    """What to run and the rules to run it by (validated; the defaults are the options')."""

    argv: tuple[str, ...]
    keys: tuple[Key, ...]
    wait: float
    timeout: float | None
    kill_after: float
    skip_exit_code: int
    on_db_error: str
    on_lock_lost: str
    heartbeat: float
    min_hold: float | None
    once_per: float | None
    #: jobrun's secret-bearing variables the child (and the hook) may have (``--pass-env``).
    pass_env: tuple[str, ...]
    #: --warn-after: seconds, "auto", or None.
    warn_after: float | str | None = None
    # --- --coalesce, --jitter, --retries (off by default) -----------------------------------
    #: ``--coalesce``: when the key is held, wait as its one queued run.
    coalesce: bool = False
    #: ``--jitter``: longest delay before the first attempt (0: none); ``jitter_random``.
    jitter: float = 0.0
    jitter_random: bool = False
    #: ``--retries``, ``--retry-delay``, ``--retry-on`` (empty: any non-zero exit).
    retries: int = 0
    retry_delay: float = 1.0
    retry_on: tuple[int, ...] = ()
