"""``--ping URL``: Healthchecks-style start, exit-status and log pings that never hold a job up."""

from __future__ import annotations

import re
import threading
import time
import urllib.parse
import urllib.request
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from jobrun import __version__, threads
from jobrun.exitcodes import UsageError
from jobrun.run.listeners import Listener

if TYPE_CHECKING:
    from collections.abc import Mapping
    from http.client import HTTPMessage
    from typing import IO

    from structlog.typing import FilteringBoundLogger

    from jobrun.run.tail import Capture

#: Default of ``--ping-timeout``: the longest one ping (all its attempts) may take.
TIMEOUT = 5.0
#: Attempts per ping within its timeout (a monitor that answers 500 once gets another go).
ATTEMPTS = 3
#: Pause before the second attempt (doubled before the third), within the timeout.
BACKOFF = 0.2
#: Most bytes of each stream's tail in a ping body (Healthchecks keeps about 100 kB).
BODY_STREAM_LIMIT = 40_000
#: HTTP statuses worth another attempt: the monitor's own trouble, not our request's.
_RETRIED = frozenset({408, 425, 429, 500, 502, 503, 504})


#: What a ping body carries after a run (``--ping-body``): the --keep-output tails.
BODIES = ("always", "failure", "never")
#: A Healthchecks check's UUID, given alone to --ping.
_UUID = re.compile(r"[0-9a-fA-F]{8}(?:-[0-9a-fA-F]{4}){3}-[0-9a-fA-F]{12}")
#: A Healthchecks check's slug (lower-case letters, digits, hyphens, underscores).
_SLUG = re.compile(r"[a-z0-9][a-z0-9_-]*")
#: Where a bare UUID or slug goes: the variable of --ping-base, as errors name it.
BASE_VARIABLE = "JOBRUN_PING_BASE"


def resolve(value: str, base: str | None) -> str:
    """The ping URL of ``--ping``: a URL as it is; a check's UUID or slug appended to ``base``.

    Healthchecks pings ``<base>/<uuid>`` or ``<base>/<ping-key>/<slug>``: the base holds the
    ping key for slugs (``https://hc-ping.com/PING_KEY``). UsageError (never quoting the
    value: a UUID is the check's credential) without a base.
    """
    text = value.strip()
    is_uuid = _UUID.fullmatch(text) is not None
    if not is_uuid and _SLUG.fullmatch(text) is None:
        return parse_url(text)
    if not base:
        raise UsageError(
            f"--ping: a check's {'UUID' if is_uuid else 'slug'} alone needs {BASE_VARIABLE} "
            "(or --ping-base), the URL its pings go under: https://hc-ping.com for a UUID, "
            "https://hc-ping.com/PING_KEY for a slug"
        )
    parts = urllib.parse.urlsplit(parse_url(base, option="--ping-base"))
    return urllib.parse.urlunsplit(parts._replace(path=parts.path.rstrip("/") + "/" + text))


def parse_url(text: str, *, option: str = "--ping") -> str:
    """The ping URL, checked (http or https, a host, no spaces); UsageError otherwise."""
    url = text.strip()
    parts = urllib.parse.urlsplit(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UsageError(
            f"{option} {mask(url)!r}: not an http(s) URL with a host "
            "(example: https://hc-ping.com/<uuid>; a check's UUID or slug alone goes with "
            f"{BASE_VARIABLE})"
        )
    if any(char.isspace() or ord(char) < 0x20 or ord(char) == 0x7F for char in url):  # noqa: PLR2004 - control characters
        raise UsageError(f"{option} {mask(url)!r}: the URL contains spaces or control characters")
    try:
        _ = parts.port
    except ValueError:
        raise UsageError(f"{option} {mask(url)!r}: the port is not a number") from None
    return url


def mask(url: str) -> str:
    """``scheme://host[:port]/***``: the URL without what is secret in it.

    WARNING: a ping URL is a credential: Healthchecks puts the check's key in the path
    (anyone who has it can ping the check), and some monitors put a user and password
    before the host. Only the scheme, host and port are ever shown.
    """
    try:
        parts = urllib.parse.urlsplit(url.strip())
        host = parts.hostname or ""
        port = parts.port
    except ValueError:
        return "***"
    if not host:
        return "***"
    if ":" in host:  # IPv6
        host = f"[{host}]"
    netloc = f"{host}:{port}" if port else host
    return f"{parts.scheme}://{netloc}/***"


def with_path(url: str, suffix: str, run_id: str) -> str:
    """``url`` + ``/suffix``, with ``rid=run_id`` added to its query (kept as it was)."""
    parts = urllib.parse.urlsplit(url)
    path = parts.path.rstrip("/") + "/" + suffix
    query = urllib.parse.urlencode({"rid": run_id})
    query = f"{parts.query}&{query}" if parts.query else query
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, path, query, ""))


def _split_userinfo(url: str) -> tuple[str, dict[str, str]]:
    """``url`` without ``user:password@`` (which urllib cannot send), and its Basic auth header."""
    import base64  # noqa: PLC0415 - only with --ping

    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url, {}
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    netloc = parts.netloc.rpartition("@")[2]
    token = base64.b64encode(f"{user}:{password}".encode()).decode("ascii")
    return urllib.parse.urlunsplit(parts._replace(netloc=netloc)), {
        "Authorization": f"Basic {token}"
    }


def body(stdout: bytes, stderr: bytes) -> bytes:
    """The end ping's body: the tail of each stream, under a header line each."""
    out, err = stdout[-BODY_STREAM_LIMIT:], stderr[-BODY_STREAM_LIMIT:]
    return (
        f"--- stdout (last {len(out)} bytes)\n".encode()
        + out
        + (b"" if not out or out.endswith(b"\n") else b"\n")
        + f"--- stderr (last {len(err)} bytes)\n".encode()
        + err
    )


@dataclass
class _Ping:
    kind: str  # "start", "log" or an exit status
    body: bytes
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    #: Held while a failure is being reported (by the sender, or finish() giving up).
    reporting: threading.Lock = field(default_factory=threading.Lock)
    reported: bool = False
    #: Attempts made so far, and the last one's error (None: none failed yet).
    attempts: int = 0
    error: str | None = None
    #: Set when no further attempt is wanted (the child exited before the start ping got through).
    given_up: threading.Event = field(default_factory=threading.Event)


class Pinger:
    """Sends the pings of one run, in order, on a thread of its own.

    ``start()`` returns at once (the child must not wait for a monitor); ``finish()`` waits
    for the last ping ``timeout`` seconds at most and is called after the lock is released,
    so a slow monitor delays jobrun's exit, never the next run. A ping that fails is one
    ``ping_failed`` warning; it never changes jobrun's exit status.
    """

    def __init__(
        self, url: str, run_id: str, *, timeout: float = TIMEOUT, log: FilteringBoundLogger
    ) -> None:
        self._opener = urllib.request.build_opener(KeepCredentialsAtOrigin)
        self.url, self._auth = _split_userinfo(url)
        if self._auth and urllib.parse.urlsplit(self.url).scheme == "http":
            log.warning(
                "ping_credentials_in_clear",
                url=mask(self.url),
                hint="credentials in an http:// URL cross the network readable: use https",
            )
        self.run_id = run_id
        self.timeout = timeout
        self._log = log
        self._pending: list[_Ping] = []
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._skip_body: bytes | None = None
        self._start: _Ping | None = None

    def start(self) -> None:
        """The child started: ``URL/start`` (in the background)."""
        self._start = self._enqueue("start", b"")

    def child_exited(self) -> None:
        """The child is gone: a start ping not through yet gets no further attempt.

        A start that arrives after the run is over tells the monitor nothing true. When an
        attempt has failed already, its ``ping_failed`` is written now, so the line comes
        before the run's ``finished``; an attempt still under way with no answer yet is
        reported when its answer (or its timeout) comes.
        """
        ping = self._start
        if ping is None or ping.done.is_set():
            return
        ping.given_up.set()
        if ping.error is not None:
            self._failed(ping, ping.error, attempts=ping.attempts)

    def skipped(self, reason: str, details: dict[str, object]) -> None:
        """The run skipped: its end ping will be ``URL/log`` (neither success nor failure)."""
        described = " ".join(f"{name}={value}" for name, value in details.items())
        self._skip_body = f"skipped ({reason}) {described}".strip().encode()

    def slow(self, fields: Mapping[str, object]) -> None:
        """--warn-after: ``URL/log`` now (in the background), saying the run is slow."""
        described = " ".join(f"{name}={value}" for name, value in fields.items())
        self._enqueue("log", f"slow_run {described}".encode())

    def finish(self, status: int, stdout: bytes = b"", stderr: bytes = b"") -> None:
        """The run is over: ``URL/<status>`` (or ``URL/log`` after a skip); wait for it."""
        if self._skip_body is not None:
            ping = self._enqueue("log", self._skip_body)
        else:
            content = body(stdout, stderr) if (stdout or stderr) else b""
            ping = self._enqueue(str(status), content)
        if not ping.done.wait(max(0.0, ping.deadline - time.monotonic())):
            # Still queued behind a hung start ping, or in flight: we go, it is abandoned.
            self._failed(ping, f"no answer within {self.timeout:g}s", attempts=None)

    def _enqueue(self, kind: str, content: bytes) -> _Ping:
        ping = _Ping(kind, content, time.monotonic() + self.timeout)
        with self._cond:
            self._pending.append(ping)
            self._cond.notify()
        if self._thread is None:
            # Every signal blocked in the thread, whoever sends the first ping: a skip's or a
            # run's that never started is sent outside the supervisor's blocked window.
            self._thread = threads.start(self._loop, name="jobrun-ping")
        return ping

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._pending:
                    self._cond.wait()
                ping = self._pending.pop(0)
            try:
                self._send(ping)
            finally:
                ping.done.set()

    def _send(self, ping: _Ping) -> None:
        """Up to ATTEMPTS tries, each with its share of what is left of the ping's timeout."""
        url = with_path(self.url, ping.kind, self.run_id)
        error: str | None = "no time left (an earlier ping took it)"
        attempt = 0
        while attempt < ATTEMPTS and not ping.given_up.is_set():
            remaining = ping.deadline - time.monotonic()
            if remaining <= 0:
                break
            attempt += 1
            ping.attempts = attempt
            retry, error = self._attempt(url, ping, remaining / (ATTEMPTS - attempt + 1))
            if error is None:
                if not ping.reported:  # not given up as failed meanwhile (child_exited)
                    self._log.debug("ping_sent", ping=ping.kind, attempts=attempt)
                return
            ping.error = error
            if not retry:
                break
            pause = min(BACKOFF * 2 ** (attempt - 1), ping.deadline - time.monotonic())
            if pause > 0 and attempt < ATTEMPTS:
                ping.given_up.wait(pause)
        if attempt == 0 and ping.given_up.is_set():
            return  # the run was over before it could go: not the monitor's failure
        self._failed(ping, error, attempts=attempt)

    def _failed(self, ping: _Ping, error: str | None, *, attempts: int | None) -> None:
        """One ``ping_failed`` warning per ping, whoever notices first.

        WARNING: the other one waits until the line is written: finish() must not return
        (and jobrun exit) while the sender is still writing it.
        """
        with ping.reporting:
            if ping.reported:
                return
            ping.reported = True
            self._log.warning(
                "ping_failed",
                ping=ping.kind,
                url=mask(self.url),
                error=error,
                attempts=attempts,
                timeout=self.timeout,
                note="the run's exit status is unchanged",
            )

    def _attempt(self, url: str, ping: _Ping, timeout: float) -> tuple[bool, str | None]:
        """One request: (worth retrying, error or None). Errors never quote the URL."""
        request = urllib.request.Request(  # noqa: S310 - parse_url admits http(s) only
            url,
            data=ping.body,
            method="POST",
            headers={
                "User-Agent": f"jobrun/{__version__}",
                "Content-Type": "text/plain; charset=utf-8",
                **self._auth,
            },
        )
        try:
            with self._opener.open(request, timeout=timeout) as response:
                response.read()
        except Exception as exc:  # noqa: BLE001 - whatever goes wrong, it is never the job's problem
            return _describe(exc, timeout)
        return False, None


class PingListener(Listener):
    """``--ping`` as a run's listener: start, skip and end pings (the end after the release)."""

    def __init__(self, pinger: Pinger, capture: Capture | None, *, body: str = "always") -> None:
        self._pinger = pinger
        #: ``--keep-output``: the end ping carries the tails (``--ping-body``: when).
        self._capture = capture
        self._body = body

    def skipped(self, reason: str, fields: Mapping[str, object], exit_code: int) -> None:
        """The end ping will say why the run skipped."""
        del exit_code
        self._pinger.skipped(reason, dict(fields))

    def started(self, child_pid: int) -> None:
        """The start ping (in the background: the child never waits for it)."""
        del child_pid
        self._pinger.start()

    def slow(self, fields: Mapping[str, object]) -> None:
        """--warn-after: a ``/log`` ping saying the run is slow (in the background)."""
        self._pinger.slow(fields)

    def exited(self) -> None:
        """Before the run's ``finished`` line: the start ping's fate, if already known."""
        self._pinger.child_exited()

    def released(self, status: int) -> None:
        """The end ping, with the tails if output was kept; waits --ping-timeout at most."""
        capture = self._capture
        wanted = self._body == "always" or (self._body == "failure" and status != 0)
        used = capture is not None and capture.used and wanted
        stdout = capture.stdout_tail if capture is not None and used else b""
        stderr = capture.stderr_tail if capture is not None and used else b""
        self._pinger.finish(status, stdout, stderr)


def origin(url: str) -> tuple[str, str, int | None]:
    """(scheme, host, port) of ``url``, the port made explicit: what credentials belong to."""
    parts = urllib.parse.urlsplit(url)
    scheme = parts.scheme.lower()
    return scheme, (parts.hostname or "").lower(), parts.port or _DEFAULT_PORTS.get(scheme)


_DEFAULT_PORTS = {"http": 80, "https": 443}


class KeepCredentialsAtOrigin(urllib.request.HTTPRedirectHandler):
    """Follow a monitor's redirects, its credentials only to the same origin.

    WARNING: urllib's own redirect handler copies every header to wherever a monitor (or
    whoever answers for it) redirects, Authorization included: to another host, and from
    https down to plain http. A redirect to another scheme, host or port goes without it.
    """

    def redirect_request(  # noqa: PLR0917 - urllib's signature
        self,
        req: urllib.request.Request,
        fp: IO[bytes],
        code: int,
        msg: str,
        headers: HTTPMessage,
        newurl: str,
    ) -> urllib.request.Request | None:
        """The redirected request, without Authorization when it leaves the origin."""
        new = super().redirect_request(req, fp, code, msg, headers, newurl)
        if new is not None and origin(new.full_url) != origin(req.full_url):
            new.remove_header("Authorization")
        return new


def _describe(exc: Exception, timeout: float) -> tuple[bool, str]:
    """(worth retrying, a one-line reason) for a failed request; never quotes the URL."""
    import urllib.error  # noqa: PLC0415 - loaded by urllib.request already

    if isinstance(exc, urllib.error.HTTPError):
        return exc.code in _RETRIED, f"HTTP {exc.code}"
    reason: object = exc.reason if isinstance(exc, urllib.error.URLError) else exc
    if isinstance(reason, TimeoutError):
        return True, f"no answer within {timeout:.3g}s"
    if isinstance(reason, OSError):  # refused, reset, unreachable, TLS
        return True, reason.strerror or type(reason).__name__
    # http.client's protocol errors and the like: the class says enough (a message could
    # quote the URL).
    return True, type(reason).__name__
