"""--ping, --keep-output and --fence of one run: checked together, built as its listeners."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

    from jobrun import db
    from jobrun.db.server_session import ServerSession
    from jobrun.locks import Identity, Lock
    from jobrun.run.listeners import Listener
    from jobrun.run.notify import NoHistory
    from jobrun.run.recorder import Recorder
    from jobrun.run.settings import Settings


@dataclass(frozen=True)
class Options:
    """The operators' options of a run, checked."""

    #: Never in the repr: it may carry credentials.
    ping_url: str | None = field(repr=False)
    ping_timeout: float
    #: Which end pings carry the kept tails (--ping-body).
    ping_body: str
    #: Bytes of each stream's tail to keep (0: none).
    keep_output: int
    fence: bool
    history: bool


def validate(settings: Settings) -> Options:
    """Parse the run command's operators' options (usage errors: exit 64) before anything runs.

    How they go with the other options was checked with them (jobrun.run.settings.check).

    Each feature's module is imported only when its option is given: the run path stays lean.
    """
    url = None
    if settings.ping is not None:
        from jobrun.run import ping as pings  # noqa: PLC0415 - only with --ping

        url = pings.parse_url(settings.ping)
    keep = 0
    if settings.keep_output is not None:
        from jobrun.run import tail  # noqa: PLC0415 - only with --keep-output

        keep = tail.parse_size(settings.keep_output)
    return Options(
        ping_url=url,
        ping_timeout=settings.ping_timeout,
        ping_body=settings.ping_body,
        keep_output=keep,
        fence=settings.fence,
        history=not settings.no_history,
    )


def listeners(
    options: Options,
    *,
    target: db.Target,
    lock: Lock,
    session: ServerSession,
    identity: Identity,
    recorder: Recorder | NoHistory,
    log: FilteringBoundLogger,
    hidden: tuple[str, ...] = (),
) -> list[Listener]:
    """The listeners of a run's options, in the order they must hear of its steps.

    The kept output before the end ping (which sends its tails); the fencing token last,
    right before the child starts.
    """
    found: list[Listener] = []
    capture = None
    if options.keep_output:
        from jobrun.masking import Masker  # noqa: PLC0415
        from jobrun.run import tail  # noqa: PLC0415 - only with --keep-output

        # Masked as kept: the tails go to the history, the end ping and the hook.
        capture = tail.Capture(options.keep_output, masker=Masker(hidden))
        if recorder.notifier is not None:
            recorder.notifier.output = capture  # the alert hook's event: the tails
        found.append(
            tail.KeptOutput(capture, target, identity.run_id, history=options.history, log=log)
        )
    if options.ping_url:
        from jobrun.run import ping  # noqa: PLC0415 - only with --ping

        pinger = ping.Pinger(
            options.ping_url, identity.run_id, timeout=options.ping_timeout, log=log
        )
        found.append(ping.PingListener(pinger, capture, body=options.ping_body))
    if options.fence:
        from jobrun.run import fence  # noqa: PLC0415 - only with --fence

        found.append(fence.Fence(target, lock, session, log=log))
    return found
