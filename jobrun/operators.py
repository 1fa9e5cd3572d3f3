"""Wires --ping, --keep-output and --fence into one run: check them, build them, finish them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable

    from structlog.typing import FilteringBoundLogger

    from jobrun import db
    from jobrun.history.notify import NoHistory
    from jobrun.history.recorder import Recorder
    from jobrun.locks import Identity, Lock
    from jobrun.ping import Pinger
    from jobrun.tail import Capture


@dataclass(frozen=True)
class Options:
    """The operators' options of a run, checked."""

    ping_url: str | None = None
    ping_timeout: float = 5.0
    keep_output: int = 0
    fence: bool = False
    history: bool = True


def validate(
    *,
    ping: str | None,
    ping_timeout: float,
    keep_output: str | None,
    fence: bool,
    on_db_error: str,
    no_history: bool,
) -> Options:
    """Parse the run command's operators' options (usage errors: exit 64) before anything runs.

    How they go with the other options was checked with them (jobrun.settings.check).

    Each feature's module is imported only when its option is given: the run path stays lean.
    """
    url = None
    if ping is not None:
        from jobrun import ping as pings  # noqa: PLC0415 - only with --ping

        url = pings.parse_url(ping)
    keep = 0
    if keep_output is not None:
        from jobrun import tail  # noqa: PLC0415 - only with --keep-output

        keep = tail.parse_size(keep_output)
    del on_db_error  # checked with the other options, by jobrun.settings.check
    return Options(
        ping_url=url,
        ping_timeout=ping_timeout,
        keep_output=keep,
        fence=fence,
        history=not no_history,
    )


class Extras:
    """The collaborators the runner takes for one run, and what follows the release."""

    def __init__(
        self,
        options: Options,
        *,
        target: db.Target,
        lock: Lock,
        identity: Identity,
        recorder: Recorder | NoHistory,
        log: FilteringBoundLogger,
        hidden: tuple[str, ...] = (),
    ) -> None:
        self._options = options
        self._target = target
        self._run_id = identity.run_id
        self._log = log
        self.pinger: Pinger | None = None
        self.capture: Capture | None = None
        self.fencer: Callable[[], int] | None = None
        if options.ping_url:
            from jobrun import ping  # noqa: PLC0415 - only with --ping

            self.pinger = ping.Pinger(
                options.ping_url, identity.run_id, timeout=options.ping_timeout, log=log
            )
        if options.keep_output:
            from jobrun import tail  # noqa: PLC0415 - only with --keep-output
            from jobrun.masking import Masker  # noqa: PLC0415

            # Masked as kept: the tails go to the history, the end ping and the hook.
            self.capture = tail.Capture(options.keep_output, masker=Masker(hidden))
            if recorder.notifier is not None:
                recorder.notifier.output = self.capture  # the alert hook's event: the tails
        if options.fence:
            from jobrun import fence  # noqa: PLC0415 - only with --fence

            def fencer() -> int:
                return fence.issue(target, lock, app_name="jobrun-fence", log=log)

            self.fencer = fencer

    def after(self, status: int) -> None:
        """After the release: keep a failed run's output, then send the end ping.

        Neither holds the lock; each is bounded (5 s for the output, --ping-timeout for the
        ping) and neither changes ``status``.
        """
        capture = self.capture
        used = capture is not None and capture.used
        if capture is not None and used and status != 0 and self._options.history:
            from jobrun import tail  # noqa: PLC0415 - loaded already with --keep-output

            tail.store(self._target, self._run_id, capture, log=self._log)
        if self.pinger is not None:
            stdout = capture.stdout_tail if capture is not None and used else b""
            stderr = capture.stderr_tail if capture is not None and used else b""
            self.pinger.finish(status, stdout, stderr)
