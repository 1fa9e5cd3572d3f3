"""A run assembled from its settings: logger, lock, history, listeners; then the runner."""

from __future__ import annotations

import dataclasses
import os
from typing import TYPE_CHECKING

from jobrun import __version__, keys
from jobrun.exitcodes import UsageError

if TYPE_CHECKING:
    from collections.abc import Callable

    from structlog.typing import FilteringBoundLogger

    from jobrun import db
    from jobrun.db.server_session import ServerSession
    from jobrun.locks import Identity, Lock
    from jobrun.run.notify import NoHistory
    from jobrun.run.recorder import Recorder, StartChecks
    from jobrun.run.settings import Settings
    from jobrun.run.waiting import WaitReporter

STDERR = 2


def run(argv: tuple[str, ...], settings: Settings) -> int:
    """Build the run ``settings`` describe, run it, and return its exit status.

    The heavy parts (the lock modes, the history, the operators' modules) are imported
    here, and only those the settings use.
    """
    from jobrun import db, log, masking
    from jobrun.locks import Identity, new_run_id
    from jobrun.run import extras, runner
    from jobrun.run.job import Job

    wanted = extras.validate(settings)

    run_keys = settings.run_keys
    target = db.Target(dsn=settings.dsn, connect_timeout=settings.connect_timeout)
    fd, log_file_error = None, None
    if settings.log_file:
        # A log file that cannot be opened never costs the job its run: stderr instead.
        try:
            fd = log.open_log_file(settings.log_file)
        except UsageError as exc:
            log_file_error = str(exc)
    # What kept output, pings and the alert hook never carry: the DSN's password and
    # PGPASSWORD, the ping URL's credentials, variables named like secrets or --mask-env,
    # the password file's passwords (and, once connected, the password libpq used).
    # Only runs that keep output or run a hook look through the environment for them.
    hidden = target.secrets
    if settings.keep_output or settings.on_alert:
        named = masking.named_secrets(os.environ, settings.mask_env)
        stored = masking.password_file_secrets(os.environ)
        pings = (*masking.url_secrets(settings.ping), *masking.url_secrets(settings.ping_base))
        hidden = (*target.secrets, *pings, *named, *stored)
    logger = log.configure(
        fmt=settings.log_format,
        level=settings.log_level,
        fd=fd,
        # The DSN's password, PGPASSWORD and --mask-env's variables (names guessed to be
        # secret are left out: a log line is jobrun's own text, not the job's).
        secrets=(
            *target.secrets,
            *masking.named_secrets(os.environ, settings.mask_env, guess=False),
        ),
        # A log file that cannot be written (disk full): the lines go to stderr instead.
        fallback_fd=STDERR if fd is not None else None,
    )
    identity = Identity(run_id=new_run_id(), pid=os.getpid())
    bound = logger.bind(
        key=keys.describe(run_keys),
        lock_id=run_keys[0].lock_id if len(run_keys) == 1 else [k.lock_id for k in run_keys],
        run_id=identity.run_id,
        host=identity.host,
        pid=identity.pid,
        mode=settings.mode,
        version=__version__,
    )
    target = dataclasses.replace(target, on_slow_connect=_still_connecting(target, bound))
    job = Job(
        argv=argv,
        keys=run_keys,
        wait=settings.wait,
        timeout=settings.timeout,
        kill_after=settings.kill_after,
        skip_exit_code=settings.skip_exit_code,
        on_db_error=settings.on_db_error,
        on_lock_lost=settings.on_lock_lost,
        heartbeat=_beat(settings),
        min_hold=settings.min_hold,
        once_per=settings.once_per,
        pass_env=settings.pass_env,
        warn_after=settings.warn_after,
        coalesce=settings.coalesce,
        jitter=settings.jitter,
        jitter_random=settings.jitter_random,
        retries=settings.retries,
        retry_delay=settings.retry_delay,
        retry_on=settings.retry_on,
    )
    session = _session(settings, target, identity)
    lock: Lock
    if settings.slots > 1:
        from jobrun.locks import slots

        slot_keys = slots.slot_keys(run_keys[0], settings.slots)
        lock = slots.SlotLock(
            [_lock(settings, (key,), session, identity, bound) for key in slot_keys],
            [key.lock_id for key in slot_keys],
        )
    elif settings.coalesce:
        lock = _coalescing(settings, session, identity, bound)
    else:
        lock = _lock(settings, run_keys, session, identity, bound)
    recorder = _recorder(
        settings, target, identity, program=argv[0], log=bound, session=session, hidden=hidden
    )
    if log_file_error is not None:
        bound.error("log_file_unavailable", error=log_file_error, note="events go to stderr")
    # Only now that every option is known to be valid: a usage error is one line, alone.
    from jobrun.flags import OLD_FENCE_VARIABLE  # the option's own module names it

    if OLD_FENCE_VARIABLE in os.environ:
        bound.warning(
            "deprecated_variable", variable=OLD_FENCE_VARIABLE, use_instead="JOBRUN_FENCE"
        )
    if settings.dsn_on_command_line and target.has_password:
        bound.warning(
            "password_on_command_line",
            hint="a password in --dsn is visible to every user in ps; "
            "use ~/.pgpass, PGPASSFILE or JOBRUN_DSN instead",
        )
    listeners = extras.listeners(
        wanted,
        target=target,
        lock=lock,
        session=session,
        identity=identity,
        recorder=recorder,
        log=bound,
        hidden=hidden,
    )
    return runner.run(
        job,
        lock=lock,
        session=session,
        identity=identity,
        environ=os.environ,
        log=bound,
        history=recorder,
        listeners=listeners,
        waiting=_waiting(settings, target, bound),
    )


def _session(settings: Settings, target: db.Target, identity: Identity) -> ServerSession:
    """The run's one server session, handed to the lock, the history and the fence.

    Session mode: the lock session, held from the acquisition to the release, every
    statement naming the holder. Lease mode: kept for the run (``--lease-connection
    kept``), or open only between the lock's statements (``per-renewal``); with ``--slots``
    each attempt closes its own (no slot's connection is anyone else's).
    """
    from jobrun import db
    from jobrun.db.server_session import ServerSession

    app_name = db.application_name(keys.describe(settings.run_keys))
    if settings.mode == "lease":
        return ServerSession(
            target,
            app_name=app_name,
            held=False,
            lends=settings.slots <= 1,
            keeps=settings.lease_connection == "kept",
        )
    from jobrun.locks.session import holder_comment

    return ServerSession(target, app_name=app_name, held=True, comment=holder_comment(identity))


def _beat(settings: Settings) -> float:
    """Seconds between two heartbeats: --heartbeat, but at most 1 s for a kept lease.

    A lease run over a kept connection renews every --heartbeat and beats more often.
    """
    if settings.mode != "lease":
        return settings.heartbeat
    from jobrun.locks import lease

    return lease.beat(settings.heartbeat, kept=settings.lease_connection == "kept")


def _lock(
    settings: Settings,
    run_keys: tuple[keys.Key, ...],
    session: ServerSession,
    identity: Identity,
    log: FilteringBoundLogger,
) -> Lock:
    """The lock of the run's mode on ``run_keys``, over the run's ``session``."""
    if settings.mode == "lease":
        from jobrun.locks import lease

        return lease.LeaseLock(
            run_keys,
            session,
            identity,
            log,
            ttl=settings.ttl,
            lifetime=settings.lifetime,
            heartbeat=_beat(settings),
            renew_every=settings.heartbeat,
        )
    from jobrun.locks.session import SessionLock

    return SessionLock(
        run_keys,
        session,
        identity,
        log,
        heartbeat=settings.heartbeat,
        kill_after=settings.kill_after,
        fence=settings.fence,
    )


def _coalescing(
    settings: Settings, session: ServerSession, identity: Identity, log: FilteringBoundLogger
) -> Lock:
    """--coalesce: the key's lock, and its queue slot's, in the run's mode (one named key)."""
    from jobrun.locks import queue

    key = settings.run_keys[0]
    return queue.CoalesceLock(
        _lock(settings, (key,), session, identity, log),
        _lock(settings, (queue.queue_key(key),), session, identity, log),
        session,
        key,
        log,
        lease=settings.mode == "lease",
    )


def _recorder(
    settings: Settings,
    target: db.Target,
    identity: Identity,
    *,
    program: str,
    log: FilteringBoundLogger,
    session: ServerSession,
    hidden: tuple[str, ...],
) -> Recorder | NoHistory:
    """The run's history recorder (a null one with --no-history, which still writes metrics).

    Its calls go over the run's session (session mode: the one server session of the run;
    lease mode: the kept connection, or those of the attempt and of the release).
    """
    from pathlib import Path

    from jobrun import masking
    from jobrun.history.config import HistoryConfig
    from jobrun.run import notify, recorder

    on_alert = None
    if settings.on_alert:
        from jobrun.run import alerts  # only a run with --on-alert pays for it (and shlex)

        on_alert = alerts.parse_command(settings.on_alert)
    config = HistoryConfig(
        keep=settings.keep,
        alert_after=settings.alert_after,
        alert_repeat=settings.alert_repeat,
        on_alert=on_alert,
        metrics_file=settings.metrics_file,
        expect_every=settings.expect_every,
        expect_grace=settings.expect_grace,
        timeout=_history_timeout(settings),
    )
    # The hook's environment: without jobrun's own secrets, as the child's.
    hook_environ = masking.passed_on(os.environ, settings.pass_env)
    if settings.no_history:
        notifier = notify.Notifier(
            keys.describe(settings.run_keys),
            [key.lock_id for key in settings.run_keys],
            identity,
            mode=settings.mode,
            config=config,
            log=log,
            environ=hook_environ,
            secrets=hidden,
        )
        return notify.NoHistory(notifier, pauses=_pause_check(settings, target, session, log))
    return recorder.Recorder(
        target,
        identity,
        settings.run_keys,
        mode=settings.mode,
        program=Path(program).name,
        config=config,
        log=log,
        environ=hook_environ,
        secrets=hidden,
        session=session,
        checks=_start_checks(settings),
    )


def _start_checks(settings: Settings) -> StartChecks | None:
    """--tz, --requires, --warn-after auto: what the history's start message also asks."""
    if settings.tz is None and not settings.requires and settings.warn_after != "auto":
        return None
    from jobrun.run import recorder

    return recorder.StartChecks(
        tz=settings.tz,
        requires=settings.requires,
        requires_within=settings.requires_within,
        durations=settings.warn_after == "auto",
    )


def _pause_check(
    settings: Settings, target: db.Target, session: ServerSession, log: FilteringBoundLogger
) -> Callable[[], dict[str, object] | None]:
    """Without history, the pause check: a statement of its own, after the lock is taken.

    Session mode: one more round trip on the lock session; lease mode: one more round trip
    on the connection that took the lease (as the history's calls).
    """
    from jobrun import sql
    from jobrun.history import calls
    from jobrun.run import recorder

    checker = calls.Calls(
        target,
        app_name="jobrun-pause-check",
        timeout=_history_timeout(settings),
        log=log,
        session=session,
        # --no-history: no pause table, no pause; never create the schema for it.
        create_schema=False,
    )

    def check() -> dict[str, object] | None:
        found = checker.run(
            "checking for a pause",
            (sql.PAUSES_IN_FORCE,),
            {"pause_keys": keys.names(settings.run_keys)},
        )
        return recorder.pause_fields(found[0][0]) if found and found[0] else None

    return check


def _history_timeout(settings: Settings) -> float:
    """Longest one history call (or pause check) may take.

    WARNING: a call holds the lock session (and so the heartbeat) up: its timeout plus one
    heartbeat stays within the session's 10 s confirmation lifetime; in lease mode it must
    never outlast half of what a renewal vouches for.
    """
    from jobrun.history.config import CALL_TIMEOUT

    return min(CALL_TIMEOUT, settings.lifetime / 2) if settings.mode == "lease" else CALL_TIMEOUT


def _waiting(
    settings: Settings, target: db.Target, log: FilteringBoundLogger
) -> WaitReporter | None:
    """--wait: the lines a run says while it waits for its lock (none without --wait)."""
    if settings.wait <= 0:
        return None
    from jobrun.run import waiting

    return waiting.WaitReporter(
        keys.describe(settings.run_keys), target, log, interval=settings.wait_report
    )


def _still_connecting(target: db.Target, log: FilteringBoundLogger) -> Callable[[], None]:
    """The run's line for a connection attempt with no answer yet (the address, no secret)."""
    from jobrun import db

    where = db.describe(target)  # masked: never a password
    return lambda: log.warning(
        "still_connecting",
        target=where,
        after=db.SLOW_CONNECT,
        give_up_after=target.connect_timeout,
    )
