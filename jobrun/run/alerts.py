"""The ``--on-alert`` hook: the event as JSON on its stdin and in JOBRUN_ALERT_* variables."""

from __future__ import annotations

import contextlib
import json
import os
import shlex
import signal
import subprocess
import time
from typing import TYPE_CHECKING

from jobrun import db
from jobrun.exitcodes import UsageError, from_wait_status
from jobrun.run import supervise

if TYPE_CHECKING:
    from collections.abc import Mapping

    from structlog.typing import FilteringBoundLogger

#: How much of a failed hook's stderr goes into the ``alert_failed`` line.
STDERR_TAIL = 300
ENV_PREFIX = "JOBRUN_ALERT_"


def parse_command(text: str) -> tuple[str, ...]:
    """``--on-alert`` as an argv (shell-style quoting, no shell), or UsageError."""
    try:
        argv = tuple(shlex.split(text))
    except ValueError as exc:
        # The text may hold a connection string: never echo its password.
        raise UsageError(f"--on-alert {db.redact(text)!r}: {exc}") from None
    if not argv:
        raise UsageError(
            "--on-alert is empty: give a command, e.g. --on-alert '/usr/local/bin/page'"
        )
    return argv


def environment(event: Mapping[str, object], environ: Mapping[str, str]) -> dict[str, str]:
    """``environ`` plus ``JOBRUN_ALERT_<FIELD>`` for every known field of ``event``.

    Lists become comma-joined; unknown (None) fields are left out rather than set empty.
    """
    env = {name: value for name, value in environ.items() if not name.startswith(ENV_PREFIX)}
    for name, value in event.items():
        if value is None:
            continue
        if isinstance(value, (list, tuple)):
            text = ",".join(str(item) for item in value)
        elif isinstance(value, bool):
            text = "true" if value else "false"
        else:
            text = str(value)
        env[ENV_PREFIX + name.upper()] = text
    return env


def deliver(
    argv: tuple[str, ...],
    event: Mapping[str, object],
    *,
    timeout: float,
    log: FilteringBoundLogger,
    environ: Mapping[str, str] | None = None,
    secrets: tuple[str, ...] = (),
) -> bool:
    """Run the hook for ``event``; log ``alert_sent`` or ``alert_failed``; never raise.

    The hook gets its own session (so a timeout kills everything it started), stdout
    discarded (jobrun's stderr carries event lines only) and stderr captured for the log,
    with ``secrets`` (the DSN's password, the run's other secrets), ``PGPASSWORD`` and
    passwords in URIs masked; the event on its stdin and in its variables is masked alike.
    """
    name = str(event.get("event"))
    base = os.environ if environ is None else environ
    hidden = (*secrets, base.get("PGPASSWORD", ""))
    # WARNING: the hook's stdin and variables are read by whoever runs the hook (a pager,
    # a chat webhook): the event's text (the output tails above all) is masked first.
    event = {
        field: value if field == "event" else _masked(value, hidden)
        for field, value in event.items()
    }
    payload = (json.dumps(event, default=str, ensure_ascii=True) + "\n").encode()
    env = environment(event, base)
    started = time.monotonic()
    try:
        # While the child runs (a slow run's hook, on a thread), the supervisor reaps what
        # exits under it: the hook is spared, this thread reaps it.
        with supervise.spawning() as spare:
            proc = subprocess.Popen(
                list(argv),
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                env=env,
                start_new_session=True,
                # WARNING: the runner blocks the signals it waits for, and a blocked mask is
                # inherited across exec; the hook must be killable like any other program.
                preexec_fn=_unblock_signals,  # noqa: PLW1509 - only resets the signal mask
            )
            spare(proc.pid)
    except OSError as exc:
        log.warning(
            "alert_failed", alert=name, reason="cannot_execute", command=argv[0], error=exc.strerror
        )
        return False
    try:
        try:
            _, stderr = proc.communicate(payload, timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            # Not communicate(): something that left the group may still hold the pipe open.
            for pipe in (proc.stdin, proc.stderr):
                if pipe is not None:
                    with contextlib.suppress(OSError):
                        pipe.close()
            log.warning(
                "alert_failed", alert=name, reason="timed_out", command=argv[0], timeout=timeout
            )
            return False
        duration = round(time.monotonic() - started, 3)
        if proc.returncode != 0:
            # WARNING: the hook has our environment (PGPASSWORD included) and may print it. Mask
            # before cutting the tail, or a secret cut in two would show its second half.
            text = db.redact(stderr.decode("utf-8", "replace"), hidden)
            log.warning(
                "alert_failed",
                alert=name,
                reason="exit_status",
                command=argv[0],
                exit_code=from_wait_status(proc.returncode),
                stderr=text[-STDERR_TAIL:].strip(),
                duration=duration,
            )
            return False
        log.info("alert_sent", alert=name, command=argv[0], duration=duration)
        return True
    finally:
        supervise.reaped_by_owner(proc.pid)


def _masked(value: object, secrets: tuple[str, ...]) -> object:
    """A field of the event with its text masked (lists item by item)."""
    if isinstance(value, str):
        return db.redact(value, secrets)
    if isinstance(value, (list, tuple)):
        return [_masked(item, secrets) for item in value]
    return value


def _unblock_signals() -> None:
    signal.pthread_sigmask(signal.SIG_SETMASK, ())
