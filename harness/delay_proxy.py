"""A TCP proxy that holds every chunk for half a round trip each way, as a distant network does."""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import contextlib
import threading
import time
from typing import TYPE_CHECKING

from .managed import Managed
from .pgtools import dsn_through

if TYPE_CHECKING:
    from collections.abc import Callable

    from typing_extensions import Self

_START_TIMEOUT = 10.0
#: Turns of the loop allowed for aborted connections to close their sockets.
_SHUTDOWN_TURNS = 100
_EOF = "eof"
_CLOSE = "close"


class _Exchange:
    """Round trips of one connection as the proxy sees them: a request, then its answer."""

    def __init__(self, proxy: DelayProxy) -> None:
        self.proxy = proxy
        self.number = proxy.accepted  # which connection, counting from 1
        self.asked = False  # the client spoke; the server has not answered yet

    def request(self, chunk: bytes) -> None:
        self._record(chunk, from_client=True)
        self.asked = True

    def answer(self, chunk: bytes) -> None:
        self._record(chunk, from_client=False)
        if self.asked:
            self.asked = False
            self.proxy.round_trips += 1

    def _record(self, chunk: bytes, *, from_client: bool) -> None:
        if self.proxy.trace is not None:
            self.proxy.trace.append((time.monotonic(), self.number, from_client, chunk))


class _Direction:
    """Chunks read from one side, each written to the other side RTT/2 after it arrived.

    One timer per direction and a queue in arrival order: chunks leave in the order they
    came, one write each (so the boundaries the sender made reach the receiver's kernel).
    ``not_before`` stands in for the TCP handshake: a client's first bytes cannot reach a
    distant server before the handshake's round trip is over.
    """

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        delay: float,
        not_before: float,
        seen: Callable[[bytes], None],
    ) -> None:
        self.loop = loop
        self.seen = seen  # told of each chunk: _Exchange.request or .answer
        self.delay = delay
        self.not_before = not_before
        self.queue: collections.deque[tuple[float, bytes | str]] = collections.deque()
        self.dst: asyncio.Transport | None = None
        self.timer: asyncio.TimerHandle | None = None

    def push(self, item: bytes | str) -> None:
        if isinstance(item, bytes):
            self.seen(item)
        due = max(self.loop.time(), self.not_before) + self.delay
        self.queue.append((due, item))
        self._schedule()

    def attach(self, dst: asyncio.Transport) -> None:
        self.dst = dst
        self._schedule()

    def _schedule(self) -> None:
        if self.timer is None and self.dst is not None and self.queue:
            self.timer = self.loop.call_at(self.queue[0][0], self._flush)

    def _flush(self) -> None:
        self.timer = None
        dst = self.dst
        assert dst is not None
        now = self.loop.time()
        while self.queue and self.queue[0][0] <= now:
            _, item = self.queue.popleft()
            if dst.is_closing():
                continue
            if isinstance(item, bytes):
                dst.write(item)
            elif item == _EOF:
                # The other side may be gone already (its close is on the way, queued).
                with contextlib.suppress(OSError):
                    dst.write_eof()
            else:
                dst.close()
        self._schedule()


class _Side(asyncio.Protocol):
    """One socket of a proxied connection: what it reads goes out, what comes in is written."""

    def __init__(
        self, outgoing: _Direction, incoming: _Direction, live: set[asyncio.Transport]
    ) -> None:
        self.outgoing = outgoing
        self.incoming = incoming
        self.live = live  # the proxy's open sockets, aborted when it stops
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.live.add(transport)
        self.incoming.attach(transport)

    def data_received(self, data: bytes) -> None:
        self.outgoing.push(data)

    def eof_received(self) -> bool:
        self.outgoing.push(_EOF)
        return True  # keep writing the other way: a half-close is passed on, not a close

    def connection_lost(self, exc: Exception | None) -> None:  # noqa: ARG002 - asyncio's signature
        if self.transport is not None:
            self.live.discard(self.transport)
        self.outgoing.push(_CLOSE)


class DelayProxy(Managed):
    """Forward 127.0.0.1:<port> to a target, each chunk delayed by ``rtt / 2`` each way.

    Connecting costs one round trip too (the client's first bytes are held until ``rtt``
    after the accept, then another ``rtt / 2``), so a request sent right after connecting
    is answered two round trips later, as over a real distant TCP path. ``rtt`` (seconds)
    may be changed between connections; a connection keeps the one it started with.
    ``accepted`` counts the connections accepted so far; ``round_trips`` the handshakes and
    the client's requests that the server answered (a burst of chunks from the client, then
    one from the server: pipelined statements are one; the goodbye, never answered, none).
    Summed over connections, it is the latency on the critical path only when they do not
    overlap. ``trace``, when set to a list, gets each chunk read: (time.monotonic() when it
    arrived, the connection's number as ``accepted`` counted it, whether from the client,
    its bytes). Everything runs in one background thread's event loop.
    """

    host = "127.0.0.1"

    def __init__(self, target_host: str, target_port: int, rtt: float) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.rtt = rtt
        self.port = 0
        self.accepted = 0  # written by the proxy thread only
        self.round_trips = 0  # the same
        self.trace: list[tuple[float, int, bool, bytes]] | None = None
        self._loop = asyncio.new_event_loop()
        self._server: asyncio.Server | None = None
        self._thread: threading.Thread | None = None
        self._transports: set[asyncio.Transport] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def start(self) -> Self:
        """Listen, and forward in a background thread."""
        return self._started(self._start)

    def stop(self) -> None:
        """Abort every connection, stop listening and end the thread. Safe to call twice."""
        self.cleanup()

    def dsn_for(self, server_dsn: str) -> str:
        """``server_dsn`` with host and port pointing at this proxy."""
        return dsn_through(server_dsn, self.host, self.port)

    def _start(self) -> None:
        ready: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._thread = threading.Thread(
            target=self._run, args=(ready,), name="DelayProxy", daemon=True
        )
        self._thread.start()
        ready.result(_START_TIMEOUT)

    def _run(self, ready: concurrent.futures.Future[None]) -> None:
        asyncio.set_event_loop(self._loop)
        try:
            self._server = self._loop.run_until_complete(
                self._loop.create_server(self._client_side, self.host, 0)
            )
            self.port = int(self._server.sockets[0].getsockname()[1])
        except BaseException as exc:  # noqa: BLE001 - handed to the thread that waits
            ready.set_exception(exc)
            return
        ready.set_result(None)
        self._loop.run_forever()

    def _client_side(self) -> _Side:
        """A new client connection: its two directions, and our connection to the target."""
        self.accepted += 1
        self.round_trips += 1  # the TCP handshake's
        now = self._loop.time()
        exchange = _Exchange(self)
        up = _Direction(self._loop, self.rtt / 2, now + self.rtt, exchange.request)
        down = _Direction(self._loop, self.rtt / 2, now, exchange.answer)
        client = _Side(up, down, self._transports)
        task = self._loop.create_task(self._connect(client, up, down))
        self._tasks.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._tasks.discard)
        return client

    async def _connect(self, client: _Side, up: _Direction, down: _Direction) -> None:
        try:
            if self.target_host.startswith("/"):
                path = f"{self.target_host}/.s.PGSQL.{self.target_port}"
                await self._loop.create_unix_connection(
                    lambda: _Side(down, up, self._transports), path
                )
            else:
                await self._loop.create_connection(
                    lambda: _Side(down, up, self._transports), self.target_host, self.target_port
                )
        except OSError:
            if client.transport is not None:
                client.transport.abort()  # the target is down: the client sees a reset

    def _release(self) -> None:
        if self._thread is None:
            self._loop.close()
            return
        if self._thread.is_alive():
            done = asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop)
            with contextlib.suppress(concurrent.futures.TimeoutError):
                done.result(_START_TIMEOUT)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(_START_TIMEOUT)
        if not self._loop.is_running():
            self._loop.close()
        self._thread = None

    async def _shutdown(self) -> None:
        """Stop listening, abort every connection, and let the loop close their sockets."""
        if self._server is not None:
            self._server.close()
        for task in list(self._tasks):
            task.cancel()
        for transport in list(self._transports):
            transport.abort()
        # An abort closes its socket on a later turn of the loop (connection_lost).
        for _ in range(_SHUTDOWN_TURNS):
            if not (self._transports or self._tasks):
                break
            await asyncio.sleep(0)

    def __repr__(self) -> str:
        target = f"{self.target_host}:{self.target_port}"
        return f"<DelayProxy {self.host}:{self.port} -> {target}, rtt {self.rtt * 1000:.0f} ms>"
