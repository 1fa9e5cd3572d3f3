"""A run's settings: its options, validated, as the assembly takes them."""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

if TYPE_CHECKING:
    from jobrun import keys


class Settings(NamedTuple):
    """A run's validated options (durations in seconds)."""

    run_keys: tuple[keys.Key, ...]
    mode: str
    dsn: str
    dsn_on_command_line: bool
    connect_timeout: float
    wait: float
    wait_report: float
    timeout: float | None
    kill_after: float
    heartbeat: float
    ttl: float
    #: lease: how long a renewal vouches for the lease (session: unused)
    lifetime: float
    min_hold: float | None
    once_per: float | None
    skip_exit_code: int
    on_db_error: str
    on_lock_lost: str
    no_history: bool
    keep: int
    alert_after: int
    alert_repeat: float
    on_alert: str | None
    metrics_file: str | None
    expect_every: float | None
    expect_grace: float | None
    slots: int
    ping: str | None
    ping_timeout: float
    keep_output: str | None
    fence: bool
    pass_env: tuple[str, ...]
    mask_env: tuple[str, ...]
    log_format: str
    log_file: str | None
    log_level: str
