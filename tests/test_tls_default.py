"""Over a network, no sslmode means TLS or nothing: a stripped TLS never gets the password."""

from __future__ import annotations

import contextlib
import ipaddress
import socket
import struct
import subprocess
import threading
from typing import TYPE_CHECKING

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harness import jobrun_cli, jobrun_inprocess
from harness.jobrun_cli import event
from harness.proxy import TcpProxy

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

PASSWORD = "Never-In-Clear-7f3a9c"  # noqa: S105 - the bait, for a fake server
#: The wire protocol's request codes (PostgreSQL's pqcomm.h).
SSL_REQUEST = 80877103
GSSENC_REQUEST = 80877104
#: How long the fake server waits for one more byte of a client it is talking to: libpq
#: answers each message at once, so this bounds only a test that is already failing.
CLIENT_READ_TIMEOUT = 30.0
#: libpq's variables that choose the server or how the connection is protected.
CHOICES = (
    "PGHOST", "PGHOSTADDR", "PGPORT", "PGSERVICE", "PGSSLMODE", "PGREQUIRESSL", "PGREQUIREAUTH",
    "PGGSSENCMODE", "PGSSLROOTCERT", "PGSSLNEGOTIATION", "PGCHANNELBINDING", "PGPASSWORD",
)  # fmt: skip


def outward_address(family: int) -> str | None:
    """An address of this machine that is not loopback (nor link-local), or None."""
    try:
        words = subprocess.run(
            ["hostname", "-I"], capture_output=True, text=True, timeout=10, check=False
        ).stdout.split()
    except OSError:
        words = []
    for word in words:
        with contextlib.suppress(ValueError):
            address = ipaddress.ip_address(word.split("%")[0])
            wanted = 4 if family == socket.AF_INET else 6
            if address.version == wanted and not (address.is_loopback or address.is_link_local):
                return str(address)
    return None


def needs_outward_address(family: int = socket.AF_INET) -> str:
    address = outward_address(family)
    if address is None:
        kind = "IPv4" if family == socket.AF_INET else "IPv6"
        pytest.skip(f"this machine has no non-loopback {kind} address (hostname -I)")
    return address


class DecliningServer:
    """A fake PostgreSQL server that declines TLS, then asks for a cleartext password.

    It records every byte each client sent, answers a password with "authentication
    failed", and takes any number of connections until stopped.
    """

    def __init__(self, address: str) -> None:
        family = socket.AF_INET6 if ":" in address else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.bind((address, 0))
        self._listener.listen(8)
        self.address = address
        self.port = int(self._listener.getsockname()[1])
        self.received = bytearray()
        self.tls_requests = 0
        self.passwords = 0
        self._lock = threading.Lock()
        self._thread = threading.Thread(target=self._serve, name="declining-server", daemon=True)
        self._thread.start()

    def dsn(self, **params: str) -> str:
        return make_conninfo(
            "", host=self.address, port=str(self.port), user="someone", dbname="jobs",
            password=PASSWORD, **params,
        )  # fmt: skip

    def close(self) -> None:
        # shutdown wakes the accept() below; the thread then ends.
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(CLIENT_READ_TIMEOUT)

    def _serve(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with client, contextlib.suppress(OSError, EOFError):
                client.settimeout(CLIENT_READ_TIMEOUT)
                self._talk(client)

    def _read(self, client: socket.socket, count: int) -> bytes:
        data = b""
        while len(data) < count:
            chunk = client.recv(count - len(data))
            if not chunk:
                raise EOFError
            with self._lock:
                self.received += chunk
            data += chunk
        return data

    def _talk(self, client: socket.socket) -> None:
        while True:  # SSL and GSSAPI requests come first, each declined with "N"
            (length,) = struct.unpack("!i", self._read(client, 4))
            body = self._read(client, length - 4)
            (code,) = struct.unpack("!i", body[:4])
            if code not in (SSL_REQUEST, GSSENC_REQUEST):
                break  # the start-up message
            if code == SSL_REQUEST:
                self.tls_requests += 1
            client.sendall(b"N")
        client.sendall(b"R" + struct.pack("!ii", 8, 3))  # AuthenticationCleartextPassword
        kind = self._read(client, 1)
        (length,) = struct.unpack("!i", self._read(client, 4))
        self._read(client, length - 4)
        if kind == b"p":
            self.passwords += 1
            fields = b"SFATAL\0VFATAL\0C28P01\0Mpassword authentication failed\0\0"
            client.sendall(b"E" + struct.pack("!i", 4 + len(fields)) + fields)

    @property
    def saw_password(self) -> bool:
        with self._lock:
            return PASSWORD.encode() in self.received


@pytest.fixture(autouse=True)
def neutral_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """No PG* variable of the machine's says where to connect or how to protect it."""
    for name in CHOICES:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture
def declining() -> Iterator[DecliningServer]:
    server = DecliningServer(needs_outward_address())
    try:
        yield server
    finally:
        server.close()


def run_guarded(
    dsn: str, key: str, tmp_path: Path, env: dict[str, str] | None = None, *unguarded: str
) -> tuple[subprocess.CompletedProcess[str], Path]:
    """A run (in this process) whose child makes a file; ``unguarded``: ``--on-db-error run``."""
    marker = tmp_path / "ran"
    result = jobrun_inprocess.run(
        "--key", key, *unguarded, "--", "touch", str(marker), dsn=dsn,
        env=env,
    )  # fmt: skip
    return result, marker


class TestDowngradeOverTheNetwork:
    """A non-loopback server that declines TLS is a `tls` failure before any password."""

    @pytest.mark.parametrize("given", ["host", "hostaddr behind localhost", "PGHOST"])
    def test_a_server_that_declines_tls_never_gets_the_password(
        self, declining, key, tmp_path, given
    ):
        """Declined TLS, then a cleartext password asked for: 69, tls, no child, no password.

        Even with ``--on-db-error run``: a path that strips TLS is an attack, not an outage.
        """
        env: dict[str, str] = {}
        if given == "host":
            dsn = declining.dsn()
        elif given == "hostaddr behind localhost":  # the name looks local; the address is not
            params = conninfo_to_dict(declining.dsn())
            dsn = make_conninfo(
                "", **{**params, "host": "localhost", "hostaddr": declining.address}
            )
        else:
            params = conninfo_to_dict(declining.dsn())
            env = {"PGHOST": params.pop("host"), "PGPORT": params.pop("port")}
            dsn = make_conninfo("", **params)
        result, marker = run_guarded(dsn, key, tmp_path, env, "--on-db-error", "run")
        assert declining.tls_requests >= 1, "the fake server was never reached"
        assert not declining.saw_password
        assert declining.passwords == 0
        assert result.returncode == 69, result.stderr
        failed = event(result.stderr, "lockstore_unavailable")
        assert (failed["reason"], failed["running_unguarded"]) == ("tls", False)
        assert "sslmode=prefer" in failed["error"]
        assert not marker.exists()
        assert PASSWORD not in result.stderr

    def test_an_ipv6_server_that_declines_tls_never_gets_the_password(self, key, tmp_path):
        """The same over IPv6 (a global or unique-local address, not ::1)."""
        server = DecliningServer(needs_outward_address(socket.AF_INET6))
        try:
            result, marker = run_guarded(server.dsn(), key, tmp_path, None, "--on-db-error", "run")
        finally:
            server.close()
        assert server.tls_requests >= 1, "the fake server was never reached"
        assert not server.saw_password
        assert result.returncode == 69, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["reason"] == "tls"
        assert not marker.exists()

    def test_a_real_server_without_tls_over_the_network_names_the_way_out(
        self, dsn, pg_address, key, tmp_path
    ):
        """A real server reached at a non-loopback address, without TLS: tls, until opted out.

        The run says which line to add; with ``sslmode=prefer`` the same server runs the job.
        """
        address = needs_outward_address()
        path = TcpProxy(*pg_address)
        path.host = address  # listen where a network peer would reach it, not on 127.0.0.1
        with path.start():
            remote = path.dsn_for(dsn)
            assert "sslmode" not in conninfo_to_dict(remote)
            result, marker = run_guarded(remote, key, tmp_path)
            assert result.returncode == 69, result.stderr
            failed = event(result.stderr, "lockstore_unavailable")
            assert failed["reason"] == "tls"
            assert "add sslmode=prefer" in failed["error"]
            assert not marker.exists()

            result, marker = run_guarded(f"{remote} sslmode=prefer", key, tmp_path)
            assert result.returncode == 0, result.stderr
            assert marker.exists()


class TestLocalAndChosen:
    """Local connections stay in plain text; a user's own sslmode is taken as written."""

    @pytest.mark.parametrize("host", ["127.0.0.1", "localhost"])
    def test_a_loopback_dsn_without_sslmode_connects_without_tls(self, dsn, key, tmp_path, host):
        """The local server (no TLS) is reached as before: the run succeeds, unencrypted."""
        params = {k: v for k, v in conninfo_to_dict(dsn).items() if k != "sslmode"}
        if params.get("host") not in ("127.0.0.1", "localhost"):
            pytest.skip("the test server is not reached over the loopback")
        params.pop("hostaddr", None)
        local = make_conninfo("", **{**params, "host": host})
        result, marker = run_guarded(local, key, tmp_path)
        assert result.returncode == 0, result.stderr
        assert marker.exists()
        doctor = jobrun_cli.run("doctor", dsn=local)
        assert "not encrypted: a local connection" in doctor.stdout, doctor.stdout

    @pytest.mark.parametrize(
        ("setting", "env"),
        [
            ({"sslmode": "prefer"}, {}),
            ({"sslmode": "disable"}, {}),
            ({}, {"PGSSLMODE": "prefer"}),
        ],
    )
    def test_an_explicit_sslmode_is_the_users_choice(self, declining, key, tmp_path, setting, env):
        """sslmode=prefer or disable (or PGSSLMODE) opts out: libpq's plain-text path, as asked.

        The password then reaches a server that declines TLS: what that line allows.
        """
        result, marker = run_guarded(declining.dsn(**setting), key, tmp_path, env)
        assert declining.saw_password
        assert result.returncode == 69, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["reason"] == "refused"
        assert not marker.exists()
        assert PASSWORD not in result.stderr


class TestUsersOwnGuards:
    """require_auth and channel_binding are the user's choice, and when they trip it is `tls`."""

    @pytest.mark.parametrize(
        ("setting", "env"),
        [
            ({"require_auth": "scram-sha-256"}, {}),
            ({}, {"PGREQUIREAUTH": "!password"}),
            ({"channel_binding": "require"}, {}),
        ],
    )
    def test_a_tripped_guard_is_tls_and_never_runs_the_child(
        self, declining, key, tmp_path, setting, env
    ):
        """The server asks for what the guard forbids: 69, tls, no child, no password sent.

        jobrun adds no sslmode of its own beside them (libpq's plain-text path is taken and
        the guard is what stops it), and ``--on-db-error run`` does not run the job.
        """
        result, marker = run_guarded(
            declining.dsn(**setting), key, tmp_path, env, "--on-db-error", "run"
        )
        assert not declining.saw_password
        assert result.returncode == 69, result.stderr
        failed = event(result.stderr, "lockstore_unavailable")
        assert (failed["reason"], failed["running_unguarded"]) == ("tls", False)
        assert "does not support SSL" not in failed["error"]  # the guard tripped, not ours
        assert not marker.exists()
