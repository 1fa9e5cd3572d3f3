"""A pure-Python TCP proxy that can reset, black-hole or refuse connections on demand."""

from __future__ import annotations

import contextlib
import errno
import queue
import selectors
import socket
import struct
import threading
from typing import TYPE_CHECKING, TypeVar, cast

from .managed import Managed
from .pgtools import dsn_through

T = TypeVar("T")

if TYPE_CHECKING:
    from collections.abc import Callable

_CHUNK = 65536
#: Backpressure: stop reading from one side while this much waits for the other side.
_MAX_PENDING = 1 << 20
_CALL_TIMEOUT = 10.0
_LISTEN_BACKLOG = 128

_WAKE = "wake"
_LISTEN = "listen"


def _reset(sock: socket.socket) -> None:
    """Close with RST rather than FIN, so that the peer sees the connection reset."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


class _Flow:
    """One direction of a proxied connection: bytes read from ``src`` wait to go to ``dst``."""

    __slots__ = ("dst", "eof", "pending", "shut", "src")

    def __init__(self, src: socket.socket, dst: socket.socket) -> None:
        self.src = src
        self.dst = dst
        self.pending = bytearray()
        self.eof = False  # src has sent FIN
        self.shut = False  # and we passed it on to dst


class _Link:
    """One client connection and ours to the target."""

    __slots__ = ("client", "closed", "connecting", "down", "server", "up")

    def __init__(self, client: socket.socket, server: socket.socket) -> None:
        self.client = client
        self.server = server
        self.up = _Flow(client, server)
        self.down = _Flow(server, client)
        self.connecting = True
        self.closed = False

    def flow_from(self, sock: socket.socket) -> _Flow:
        return self.up if sock is self.client else self.down

    def flow_to(self, sock: socket.socket) -> _Flow:
        return self.down if sock is self.client else self.up


class TcpProxy(Managed):
    """Forward 127.0.0.1:<port> to a target and break the path on demand.

    - drop_all(): reset every current connection (both sides); new ones are still accepted.
    - blackhole(): forward nothing and accept nothing, but keep every socket open, so clients
      hang as on a cut cable. Note: the proxy's kernel still ACKs, so client-side TCP
      keepalives and tcp_user_timeout do NOT fire; only application timeouts do.
    - refuse(): close the listening socket: new connections are refused, current ones live.
    - restore(): undo blackhole() and refuse().

    All sockets belong to one background thread; the methods above hand it a command and
    return once it has been carried out. A target host starting with "/" is a unix socket
    directory, as in libpq.
    """

    host = "127.0.0.1"

    def __init__(self, target_host: str, target_port: int, port: int = 0) -> None:
        self.target_host = target_host
        self.target_port = target_port
        self.port = port
        self.accepted = 0  # connections accepted so far (written by the proxy thread only)
        self._links: set[_Link] = set()
        self._blackholed = False
        self._stopping = False
        self._listener: socket.socket | None = None
        self._selector: selectors.BaseSelector | None = None
        self._thread: threading.Thread | None = None
        self._commands: queue.SimpleQueue[tuple[Callable[[], object], _Reply]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = socket.socketpair()

    # --- public API: called from test threads -------------------------------------------------

    def start(self) -> TcpProxy:
        """Listen and start forwarding in a background thread."""
        if self._thread is not None or self._cleaned:
            raise RuntimeError("the proxy was started already")
        return self._started(self._start)

    def _start(self) -> None:
        self._selector = selectors.DefaultSelector()
        self._wake_r.settimeout(0)  # non-blocking
        self._selector.register(self._wake_r, selectors.EVENT_READ, _WAKE)
        self._listen()
        self._thread = threading.Thread(target=self._run, name=f"TcpProxy-{self.port}", daemon=True)
        self._thread.start()

    def dsn_for(self, server_dsn: str) -> str:
        """``server_dsn`` with host and port pointing at this proxy."""
        return dsn_through(server_dsn, self.host, self.port)

    def drop_all(self) -> int:
        """Reset all current connections (clients see "connection reset"); return how many."""
        return self._call(self._drop_all)

    def blackhole(self) -> None:
        """Stop forwarding and accepting; keep every socket open."""
        self._call(self._set_blackhole)

    def restore(self) -> None:
        """Forward and accept again after blackhole() or refuse()."""
        self._call(self._restore)

    def refuse(self) -> None:
        """Stop listening: new connections are refused; existing ones keep working."""
        self._call(self._close_listener)

    @property
    def connections(self) -> int:
        """How many proxied connections are open right now."""
        return self._call(lambda: len(self._links))

    def stop(self) -> None:
        """Reset all connections, stop listening and end the thread. Safe to call twice."""
        self.cleanup()

    def _release(self) -> None:
        if self._thread is None:
            # Never ran (or failed to start): the thread's own shutdown did not happen.
            if self._selector is not None:
                self._selector.close()
            self._wake_r.close()
            self._wake_w.close()
            return
        if self._thread.is_alive():
            with contextlib.suppress(RuntimeError):
                self._call(self._request_stop)
            self._thread.join(_CALL_TIMEOUT)
        self._thread = None

    def __repr__(self) -> str:
        target = f"{self.target_host}:{self.target_port}"
        return f"<TcpProxy {self.host}:{self.port} -> {target}>"

    def _call(self, func: Callable[..., T], *args: object) -> T:
        """Run ``func`` on the proxy thread and return its result (or raise its error)."""
        if self._thread is None or not self._thread.is_alive():
            raise RuntimeError("the proxy is not running")
        reply = _Reply()
        self._commands.put((lambda: func(*args), reply))
        try:
            self._wake_w.send(b"\0")
        except OSError:
            raise RuntimeError("the proxy is not running") from None  # stopped meanwhile
        if not reply.done.wait(_CALL_TIMEOUT):
            raise TimeoutError("the proxy thread did not answer")
        if reply.error is not None:
            raise reply.error
        return cast("T", reply.value)

    # --- the proxy thread ---------------------------------------------------------------------

    def _run(self) -> None:
        assert self._selector is not None
        try:
            while not self._stopping:
                # No timeout: the thread sleeps until a socket or a command needs it.
                for key, mask in self._selector.select():
                    if key.data == _WAKE:
                        self._run_commands()
                    elif self._blackholed:
                        # blackhole() ran earlier in this batch: these events are stale.
                        continue
                    elif key.data == _LISTEN:
                        if self._listener is not None:  # refuse() may have run in this batch
                            self._accept()
                    else:
                        link, sock = key.data
                        if not link.closed:
                            self._service(link, sock, mask)
        finally:
            self._shutdown()

    def _run_commands(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while self._wake_r.recv(4096):
                pass
        while True:
            try:
                func, reply = self._commands.get_nowait()
            except queue.Empty:
                return
            try:
                reply.value = func()
            except Exception as exc:  # noqa: BLE001 - handed back to the calling thread
                reply.error = exc
            reply.done.set()

    def _shutdown(self) -> None:
        self._drop_all()
        self._close_listener()
        assert self._selector is not None
        self._selector.close()
        self._wake_r.close()
        self._wake_w.close()
        # Anyone still waiting gets an answer rather than a timeout.
        while True:
            try:
                _, reply = self._commands.get_nowait()
            except queue.Empty:
                break
            reply.error = RuntimeError("the proxy stopped")
            reply.done.set()

    def _request_stop(self) -> None:
        self._stopping = True

    def _listen(self) -> None:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        # refuse() then restore() binds the same port again while accepted sockets still use it.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            listener.bind((self.host, self.port))
            listener.listen(_LISTEN_BACKLOG)
        except OSError:
            listener.close()
            raise
        listener.settimeout(0)  # non-blocking
        self.port = int(listener.getsockname()[1])
        self._listener = listener
        self._watch_listener()

    def _watch_listener(self) -> None:
        if self._listener is not None:
            events = 0 if self._blackholed else selectors.EVENT_READ
            self._watch(self._listener, events, _LISTEN)

    def _close_listener(self) -> None:
        if self._listener is not None:
            self._watch(self._listener, 0, _LISTEN)
            self._listener.close()
            self._listener = None

    def _set_blackhole(self, *, on: bool = True) -> None:
        self._blackholed = on
        # While black-holed, new connections wait in the kernel's accept queue, unanswered.
        self._watch_listener()
        for link in self._links:
            self._update(link)

    def _restore(self) -> None:
        if self._listener is None:
            self._listen()
        self._set_blackhole(on=False)

    def _drop_all(self) -> int:
        links = list(self._links)
        for link in links:
            self._close(link, reset=True)
        return len(links)

    def _target(self) -> tuple[socket.AddressFamily, str | tuple[str, int]]:
        if self.target_host.startswith("/"):
            return socket.AF_UNIX, f"{self.target_host}/.s.PGSQL.{self.target_port}"
        return socket.AF_INET, (self.target_host, self.target_port)

    def _accept(self) -> None:
        assert self._listener is not None
        try:
            client, _ = self._listener.accept()
        except BlockingIOError:
            return
        self.accepted += 1
        client.settimeout(0)  # non-blocking
        family, address = self._target()
        server = socket.socket(family, socket.SOCK_STREAM)
        server.settimeout(0)  # non-blocking
        err = server.connect_ex(address)
        if err not in {0, errno.EINPROGRESS}:
            # The target is down: the client sees its connection reset, as a dead server's
            # host would do.
            server.close()
            _reset(client)
            return
        link = _Link(client, server)
        self._links.add(link)
        self._update(link)

    def _service(self, link: _Link, sock: socket.socket, mask: int) -> None:
        if link.connecting:
            if sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR):
                self._close(link, reset=True)
                return
            link.connecting = False
        else:
            try:
                if mask & selectors.EVENT_READ:
                    self._read(link.flow_from(sock))
                if mask & selectors.EVENT_WRITE:
                    self._flush(link.flow_to(sock))
            except OSError:
                # A reset (or any error) on one side is passed on to the other.
                self._close(link, reset=True)
                return
        if link.up.shut and link.down.shut:
            self._close(link, reset=False)
        else:
            self._update(link)

    def _read(self, flow: _Flow) -> None:
        try:
            data = flow.src.recv(_CHUNK)
        except BlockingIOError:
            return
        if data:
            flow.pending += data
        else:
            flow.eof = True
        self._flush(flow)

    def _flush(self, flow: _Flow) -> None:
        while flow.pending:
            try:
                sent = flow.dst.send(flow.pending)
            except BlockingIOError:
                return
            del flow.pending[:sent]
        if flow.eof and not flow.shut:
            # Pass the half-close on: PostgreSQL's client says goodbye with a FIN.
            flow.dst.shutdown(socket.SHUT_WR)
            flow.shut = True

    def _update(self, link: _Link) -> None:
        """Register the link's sockets for exactly the events it can handle now."""
        client_events = server_events = 0
        if self._blackholed:
            pass  # read nothing, write nothing: the bytes wait in the kernels' buffers
        elif link.connecting:
            server_events = selectors.EVENT_WRITE  # writable = connected (or failed)
        else:
            client_events = self._events(link.up, link.down)
            server_events = self._events(link.down, link.up)
        self._watch(link.client, client_events, (link, link.client))
        self._watch(link.server, server_events, (link, link.server))

    @staticmethod
    def _events(reading: _Flow, writing: _Flow) -> int:
        events = 0
        if not reading.eof and len(reading.pending) < _MAX_PENDING:
            events |= selectors.EVENT_READ
        if writing.pending:
            events |= selectors.EVENT_WRITE
        return events

    def _watch(self, sock: socket.socket, events: int, data: object) -> None:
        assert self._selector is not None
        try:
            key = self._selector.get_key(sock)
        except KeyError:
            if events:
                self._selector.register(sock, events, data)
            return
        if not events:
            self._selector.unregister(sock)
        elif key.events != events:
            self._selector.modify(sock, events, data)

    def _close(self, link: _Link, *, reset: bool) -> None:
        link.closed = True
        self._links.discard(link)
        for sock in (link.client, link.server):
            self._watch(sock, 0, None)
            if reset:
                _reset(sock)
            else:
                sock.close()


class _Reply:
    """The answer to one command run on the proxy thread."""

    __slots__ = ("done", "error", "value")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: object = None
        self.error: Exception | None = None
