"""The database boundary: connect deadlines, why a connection failed, busy servers, rollbacks."""

from __future__ import annotations

import contextlib
import json
import os
import socket
import threading
import time
from typing import TYPE_CHECKING, ClassVar

import psycopg
import pytest
import structlog
from psycopg import sql as pgsql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harness import jobrun_cli
from harness.jobrun_cli import event
from harness.pgtools import server_major
from jobrun import db, keys
from jobrun.db import connecting
from jobrun.db.server_session import ServerSession
from jobrun.exitcodes import LockStoreUnavailable
from jobrun.locks import Identity, Taken, new_run_id
from jobrun.locks.session import SessionLock

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path
    from subprocess import CompletedProcess

    from harness.pgserver import PgServer

#: libpq's connect_timeout is whole seconds and at least 2: what jobrun must do better than.
LIBPQ_MINIMUM_TIMEOUT = 2.0


@pytest.fixture
def silent_listener() -> Iterator[int]:
    """A port that accepts TCP connections and never says a word."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(64)
        yield server.getsockname()[1]


@pytest.fixture
def blackholed_port() -> Iterator[int]:
    """A port whose accept queue is full: the kernel drops new SYNs, as a firewall would."""
    with contextlib.ExitStack() as stack:
        server = stack.enter_context(socket.socket())
        server.bind(("127.0.0.1", 0))
        server.listen(0)
        address = server.getsockname()
        for _ in range(4):  # fill the (tiny) queue; later connects get no answer at all
            filler = stack.enter_context(socket.socket())
            filler.setblocking(False)  # noqa: FBT003 - positional only
            filler.connect_ex(address)
        yield address[1]


def connect_seconds(dsn: str, timeout: float) -> tuple[float, LockStoreUnavailable]:
    """How long db.connect took to give up on ``dsn``, and what it raised."""
    started = time.monotonic()
    with pytest.raises(LockStoreUnavailable) as raised:
        db.connect(db.Target(dsn=dsn, connect_timeout=timeout), app_name="jobrun:test")
    return time.monotonic() - started, raised.value


class TestConnectDeadline:
    """--connect-timeout is kept to the fraction of a second, not rounded up to libpq's 2 s."""

    @pytest.mark.parametrize("timeout", [0.25, 1.0])
    def test_silent_listener(self, silent_listener, timeout):
        """A server that accepts and never answers: given up after the timeout."""
        dsn = f"host=127.0.0.1 port={silent_listener} user=u dbname=d"
        elapsed, error = connect_seconds(dsn, timeout)
        assert timeout <= elapsed < LIBPQ_MINIMUM_TIMEOUT
        assert error.reason == "unreachable"
        assert f"no answer within {timeout:g}s" in str(error)

    def test_blackholed_port(self, blackholed_port):
        """A SYN nobody answers: given up after the timeout."""
        dsn = f"host=127.0.0.1 port={blackholed_port} user=u dbname=d"
        elapsed, error = connect_seconds(dsn, 0.25)
        assert 0.25 <= elapsed < LIBPQ_MINIMUM_TIMEOUT
        assert error.reason == "unreachable"

    def test_run_exits_69_without_starting_the_child(
        self, jobrun_here, silent_listener, key, tmp_path
    ):
        """The command line: exit 69, reason unreachable, the child never ran."""
        marker = tmp_path / "ran"
        result = jobrun_here.run(
            "--connect-timeout",
            "250ms",
            "--key",
            key,
            "--",
            "touch",
            str(marker),
            dsn=f"host=127.0.0.1 port={silent_listener} user=u dbname=d",
        )
        assert result.returncode == 69, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["reason"] == "unreachable"
        assert not marker.exists()


def run_marked(dsn: str, key: str, tmp_path: Path) -> tuple[CompletedProcess[str], Path]:
    """A run whose child leaves a marker file, and that file's path."""
    marker = tmp_path / "ran"
    result = jobrun_cli.run("--key", key, "--", "touch", str(marker), dsn=dsn)
    return result, marker


class TestWhyItFailed:
    """``reason`` tells an unreachable server from one that refused us; bad DSNs exit 64."""

    @pytest.mark.parametrize(
        ("change", "reason"),
        [
            ({"user": "no_such_role"}, "refused"),
            ({"dbname": "no_such_database"}, "refused"),
            ({"host": "127.0.0.1", "port": "1"}, "unreachable"),
        ],
    )
    def test_reason(self, dsn, key, tmp_path, change, reason):
        """Role or database missing: refused (the server answered); no listener: unreachable."""
        params = {**psycopg.conninfo.conninfo_to_dict(dsn), **change}
        params.pop("hostaddr", None)
        result, marker = run_marked(psycopg.conninfo.make_conninfo("", **params), key, tmp_path)
        assert result.returncode == 69, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["reason"] == reason
        assert not marker.exists()

    @pytest.mark.parametrize(
        ("setting", "named"),
        [
            ("port=abc", '"abc"'),
            ("sslmode=bogus", '"bogus"'),
            ("target_session_attrs=x", '"x"'),
            # direct TLS with sslmode=prefer (the default), which may fall back to plain text
            ("sslnegotiation=direct", "sslnegotiation"),
        ],
    )
    def test_bad_value_is_a_usage_error(self, dsn, key, tmp_path, setting, named):
        """A value libpq rejects is a usage error (64) naming it, and the child never runs."""
        result, marker = run_marked(f"{dsn} {setting}", key, tmp_path)
        assert result.returncode == 64, result.stderr
        assert named in result.stderr
        assert "Traceback" not in result.stderr
        assert not marker.exists()

    @pytest.mark.skipif(psycopg.pq.version() < 170000, reason="sslnegotiation is libpq 17+")
    def test_direct_tls_to_a_server_that_cannot_is_tls(self, private_server, key, tmp_path):
        """sslnegotiation=direct to a server without TLS (or before 17): tls, even with run.

        The server hangs up on the ClientHello every time: a setting that does not fit it,
        not an outage, so ``--on-db-error run`` must not run every job unguarded.
        """
        marker = tmp_path / "ran"
        dsn = make_conninfo(private_server.dsn(), sslmode="require", sslnegotiation="direct")
        result = jobrun_cli.run(
            "--key", key, "--on-db-error", "run", "--", "touch", str(marker), dsn=dsn
        )
        assert result.returncode == 69, result.stderr
        failed = event(result.stderr, "lockstore_unavailable")
        assert (failed["reason"], failed["running_unguarded"]) == ("tls", False)
        assert "needs a PostgreSQL 17 or later server" in failed["error"]
        assert not marker.exists()


def fill_server(server_dsn: str, count: int) -> list[psycopg.Connection[tuple[object, ...]]]:
    """Take ``count`` connection slots."""
    return [psycopg.connect(server_dsn, autocommit=True) for _ in range(count)]


def refusals(log: Path, words: str) -> int:
    """How many times the server log says it turned a client away with ``words``."""
    return log.read_text(errors="replace").count(words)


class TestBusyServer:
    """A server that is full or starting up is waited for until --connect-timeout runs out."""

    SETTINGS: ClassVar[dict[str, str]] = {
        "max_connections": "3",
        "superuser_reserved_connections": "0",
        # PostgreSQL 16 added a second reserve (pg_use_reserved_connections); older servers
        # refuse to start with a setting they do not know.
        **({"reserved_connections": "0"} if server_major() >= 16 else {}),
    }

    def test_too_many_clients_is_waited_out(self, private_server_factory, key, tmp_path):
        """Every slot taken: jobrun retries, and runs as soon as one is freed."""
        server = private_server_factory(self.SETTINGS)
        held = fill_server(server.dsn(), 3)
        before = refusals(server.log_path, "too many clients")
        marker = tmp_path / "ran"
        proc = jobrun_cli.start(
            "--connect-timeout",
            "60s",
            "--no-history",
            "--key",
            key,
            "--",
            "touch",
            str(marker),
            dsn=server.dsn(),
        )
        try:
            jobrun_cli.wait_until(
                lambda: refusals(server.log_path, "too many clients") > before + 1,
                what="jobrun to be turned away twice",
            )
            held.pop().close()
            _, stderr = proc.communicate(timeout=60)
        finally:
            for conn in held:
                conn.close()
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stderr
        assert marker.exists()

    def test_full_until_the_timeout_is_refused(self, private_server_factory, key):
        """Still full at --connect-timeout: exit 69, reason refused, in the server's words."""
        server = private_server_factory(self.SETTINGS)
        held = fill_server(server.dsn(), 3)
        try:
            result = jobrun_cli.run(
                "--connect-timeout",
                "1s",
                "--no-history",
                "--key",
                key,
                "--",
                "true",
                dsn=server.dsn(),
            )
        finally:
            for conn in held:
                conn.close()
        assert result.returncode == 69, result.stderr
        unavailable = event(result.stderr, "lockstore_unavailable")
        assert unavailable["reason"] == "refused"
        assert "too many clients" in unavailable["error"]
        assert "attempts" in unavailable["error"]

    def test_starting_up_is_waited_out(self, private_server_factory, key, tmp_path):
        """A server that does not accept connections yet (57P03): jobrun runs once it does."""
        server = private_server_factory({"hot_standby": "off"})
        server.become_standby(wait=False)
        before = refusals(server.log_path, "not accepting connections")
        marker = tmp_path / "ran"
        proc = jobrun_cli.start(
            "--connect-timeout",
            "60s",
            "--no-history",
            "--key",
            key,
            "--",
            "touch",
            str(marker),
            dsn=server.dsn(),
        )
        try:
            jobrun_cli.wait_until(
                lambda: refusals(server.log_path, "not accepting connections") > before,
                what="jobrun to be told the server is not accepting connections",
            )
            server.signal_promotion()
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
        assert proc.returncode == 0, stderr
        assert marker.exists()


class CutOnRollback:
    """A TCP proxy that drops both sides the moment the client sends ROLLBACK."""

    def __init__(self, host: str, port: int) -> None:
        self._upstream = (host, port)
        self._listener = socket.socket()
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(16)
        self.port = self._listener.getsockname()[1]
        self.cuts = 0
        self._lock = threading.Lock()
        self._finished = 0
        self._pumps: list[threading.Thread] = []
        self._acceptor = threading.Thread(target=self._accept, daemon=True)
        self._acceptor.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection(self._upstream)
            for args in ((client, server, True), (server, client, False)):
                pump = threading.Thread(target=self._pump, args=args, daemon=True)
                self._pumps.append(pump)
                pump.start()

    def _pump(self, src: socket.socket, dst: socket.socket, from_client: bool) -> None:
        with contextlib.suppress(OSError):
            while data := src.recv(65536):
                if from_client and b"ROLLBACK" in data:
                    self.cuts += 1
                    break
                dst.sendall(data)
        for sock in (src, dst):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
        with self._lock:  # the second pump to finish closes both
            self._finished += 1
            if self._finished % 2 == 0:
                src.close()
                dst.close()

    def close(self) -> None:
        """Stop accepting and wait for every connection to be closed."""
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._acceptor.join(timeout=10)
        for pump in self._pumps:
            pump.join(timeout=10)


class TestRollbackOnADeadSession:
    """A transaction whose ROLLBACK cannot be sent is a lock-store error, never exit 70."""

    def test_lease_acquire(self, dsn, pg_address, key, tmp_path):
        """The lease is held elsewhere (the attempt rolls back), and the session dies then.

        Two keys: one key is taken in one statement (no transaction to roll back).
        """
        marker = tmp_path / "holder"
        holder = jobrun_cli.start(
            "--mode", "lease", "--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn
        )
        proxy = CutOnRollback(*pg_address)
        try:
            jobrun_cli.wait_for_file(marker)
            params = psycopg.conninfo.conninfo_to_dict(dsn)
            params.pop("hostaddr", None)
            cut = psycopg.conninfo.make_conninfo(
                "", **{**params, "host": "127.0.0.1", "port": str(proxy.port)}
            )
            result = jobrun_cli.run(
                "--mode", "lease", "--key", key, "--key", f"{key}-b", "--", "true", dsn=cut
            )  # fmt: skip
        finally:
            proxy.close()
            jobrun_cli.signal_and_wait(holder, jobrun_cli.SIGTERM)
        assert proxy.cuts >= 1
        assert result.returncode == 69, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["reason"] == "error"


class TestBytesThatAreNotUtf8:
    """A command (or DSN) whose bytes are not UTF-8, in any locale."""

    @pytest.mark.parametrize("lang", ["C", "C.UTF-8", "POSIX"])
    def test_command_runs_and_is_recorded(self, dsn, key, tmp_path, lang):
        """A program in a directory named with byte 0xff runs (0), a missing one is 127."""
        directory = tmp_path / "bin\udcff"
        directory.mkdir()
        program = directory / "job\udcfe"
        program.write_text("#!/bin/sh\nexit 0\n")
        program.chmod(0o755)
        env = {"LANG": lang, "LC_ALL": lang}
        ran = jobrun_cli.run("--key", key, "--", str(program), "arg\udcfd", dsn=dsn, env=env)
        assert ran.returncode == 0, ran.stderr
        assert event(ran.stderr, "finished")["outcome"] == "succeeded"
        assert "history_failed" not in ran.stderr
        missing = jobrun_cli.run(
            "--key", key, "--", str(directory / "gone\udcff"), dsn=dsn, env=env
        )
        assert missing.returncode == 127, missing.stderr
        history = jobrun_cli.run("history", key, "--json", dsn=dsn, env=env)
        assert history.returncode == 0, history.stderr
        assert "job\\\\xfe" in history.stdout

    def test_dsn_bytes_are_a_usage_error(self, jobrun_here, key, tmp_path):
        """A DSN that is not UTF-8 (application_name=\\xff): exit 64, the child never runs."""
        marker = tmp_path / "ran"
        result = jobrun_here.run(
            "--key", key, "--", "touch", str(marker), dsn="host=127.0.0.1 application_name=\udcff"
        )
        assert result.returncode == 64, result.stderr
        assert not marker.exists()

    def test_pgappname_bytes_reach_the_child(self, dsn, key):
        """PGAPPNAME with byte 0xff is passed on to the child as it was."""
        result = jobrun_cli.run(
            "--key",
            key,
            "--",
            "sh",
            "-c",
            'test "$PGAPPNAME" = "$(printf "app\\377")"',
            dsn=dsn,
            env={"PGAPPNAME": "app\udcff"},
        )
        assert result.returncode == 0, result.stderr


class TestOneLine:
    """A server's error as one line: its words, not the position in jobrun's SQL."""

    def test_the_position_under_a_statement_is_left_out(self, dsn):
        """ "LINE 2: FROM nowhere_at_all" and its caret line say nothing to a user."""
        with psycopg.connect(dsn) as conn, pytest.raises(psycopg.Error) as caught:
            conn.execute("SELECT 1\nFROM nowhere_at_all")
        assert "LINE 2:" in str(caught.value)  # the server did add it
        assert db.one_line(caught.value) == 'relation "nowhere_at_all" does not exist'


def over_tcp(dsn: str, address: tuple[str, int]) -> str:
    """``dsn`` to the same server and database over TCP: a unix socket has no TCP options."""
    host, port = address
    params = conninfo_to_dict(dsn)
    params.pop("hostaddr", None)
    # A server reached through its socket directory listens on the same port over TCP.
    params["host"] = "127.0.0.1" if host.startswith("/") else host
    params["port"] = str(port)
    return make_conninfo("", **params)


#: The --kill-after the lock session below is made with (the run's default).
KILL_AFTER = 10.0


@pytest.fixture
def lock_socket(dsn, pg_address, key) -> Iterator[tuple[SessionLock, db.Target, socket.socket]]:
    """A run's lock session over TCP holding ``key``: the lock, its Target, its socket."""
    target = db.Target(dsn=over_tcp(dsn, pg_address))
    session = ServerSession(target, app_name="jobrun:test", held=True)
    lock = SessionLock(
        (keys.from_name(key),),
        session,
        Identity(run_id=new_run_id(), pid=os.getpid()),
        structlog.get_logger(),
        heartbeat=1.0,
        kill_after=KILL_AFTER,
    )
    assert isinstance(lock.acquire(0), Taken)
    try:
        conn = session.connection()
        assert conn is not None
        # getsockopt on a duplicate descriptor reads the options of the very same socket.
        with socket.socket(fileno=os.dup(conn.fileno())) as sock:
            assert sock.family in (socket.AF_INET, socket.AF_INET6), sock
            yield lock, target, sock
    finally:
        lock.release()
        session.close()


class TestClientKeepalives:
    """The lock session's own socket gives up on a silent server within seconds.

    A half-open connection (the server's host vanished, no RST ever came) would otherwise
    keep the socket, and a heartbeat waiting on it, for the OS default of about 2 hours.
    """

    def test_keepalives_probe_as_jobrun_asks(self, lock_socket):
        """SO_KEEPALIVE is on, with the idle time, interval and count jobrun asks libpq for."""
        _, target, sock = lock_socket
        # jobrun names these values nowhere else: the libpq parameters it connects with are
        # the one source, and what matters here is that they reach the lock session's socket.
        asked = connecting._connection_kwargs(target, {}, "jobrun:test", target.connect_timeout)  # noqa: SLF001
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == asked["keepalives"]
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == asked["keepalives_idle"]
        assert (
            sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
            == asked["keepalives_interval"]
        )
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT) == asked["keepalives_count"]
        assert asked["keepalives"] == 1

    def test_tcp_user_timeout_is_the_targets(self, lock_socket):
        """Unacknowledged sends are given up after the Target's tcp_user_timeout (kernel: ms)."""
        _, target, sock = lock_socket
        timeout_ms = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)
        assert timeout_ms == int(target.tcp_user_timeout * 1000)
        assert timeout_ms > 0  # 0 is the kernel's "no limit"

    def test_a_silent_server_is_given_up_before_the_child_would_be_killed(self, lock_socket):
        """Idle or sending, the kernel ends the socket within confirmation lifetime + kill-after.

        By then jobrun has stopped vouching for the lock and SIGKILLed the child; a socket
        that outlived that would only hold a heartbeat up on a connection that is gone.
        """
        lock, _, sock = lock_socket
        deadline = lock.confirmation_lifetime + KILL_AFTER
        idle = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE)
        interval = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL)
        count = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT)
        assert idle + interval * count <= deadline
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT) / 1000 <= deadline


#: The service the service file below defines.
SERVICE = "jobrun_test"


@pytest.fixture
def service_env(dsn, pg_address, tmp_path) -> dict[str, str]:
    """PGSERVICEFILE naming a file whose [jobrun_test] is the test server's database."""
    params = {
        name: str(value) for name, value in conninfo_to_dict(over_tcp(dsn, pg_address)).items()
    }
    path = tmp_path / "pg_service.conf"
    path.write_text("\n".join([f"[{SERVICE}]", *(f"{k}={v}" for k, v in params.items())]) + "\n")
    return {"PGSERVICEFILE": str(path)}


def touch_run(
    *options: str, key: str, tmp_path: Path, dsn: str | None, env: dict[str, str]
) -> tuple[CompletedProcess[str], Path]:
    """`jobrun OPTIONS --key K -- touch F`: (the result, F, which exists if the child ran)."""
    marker = tmp_path / "ran"
    result = jobrun_cli.run(*options, "--key", key, "--", "touch", str(marker), dsn=dsn, env=env)
    return result, marker


class TestServiceFile:
    """``--dsn service=NAME`` takes the connection from PGSERVICEFILE, as libpq programs do."""

    def test_a_run_connects_through_the_service(self, service_env, key, tmp_path):
        """`jobrun --dsn service=jobrun_test --key K -- touch F`: exit 0, and the child ran."""
        result, marker = touch_run(
            "--dsn", f"service={SERVICE}", key=key, tmp_path=tmp_path, dsn=None, env=service_env
        )
        assert result.returncode == 0, result.stderr
        assert marker.exists()

    def test_status_reads_the_services_database(self, dsn, service_env, key):
        """`jobrun status K --dsn service=jobrun_test` sees a lock held in that database."""
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (keys.lock_id_for(key),))
            result = jobrun_cli.run(
                "status", key, "--json", "--dsn", f"service={SERVICE}", dsn=None, env=service_env
            )
        assert result.returncode == 0, result.stderr
        (row,) = json.loads(result.stdout)
        assert row["held"] is True

    def test_an_unreachable_service_is_named_in_the_error(self, jobrun_here, key, tmp_path):
        """Its server down: exit 69, and the line names the service, not a guessed address."""
        path = tmp_path / "pg_service.conf"
        path.write_text("[jobrun_down]\nhost=127.0.0.1\nport=1\n")
        result = jobrun_here.run(
            "--dsn", "service=jobrun_down", "--key", key, "--", "true",
            dsn=None, env={"PGSERVICEFILE": str(path)},
        )  # fmt: skip
        assert result.returncode == 69, result.stderr
        error = event(result.stderr, "lockstore_unavailable")["error"]
        assert error.startswith("cannot connect to service jobrun_down:"), error

    def test_an_unknown_service_is_a_usage_error(self, service_env, key, tmp_path):
        """A service the file does not define: exit 64 naming it, and the child never ran."""
        result, marker = touch_run(
            "--dsn", "service=jobrun_no_such_service",
            key=key, tmp_path=tmp_path, dsn=None, env=service_env,
        )  # fmt: skip
        assert result.returncode == 64, result.stderr
        assert "jobrun_no_such_service" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1
        assert not marker.exists()


#: The password the role below logs in with; never in jobrun's output.
PASSWORD = "pgpass-Secret-4711"  # noqa: S105 - a throwaway role's, on a throwaway server
SCRAM_ROLE = "jobrun_pw"


@pytest.fixture
def password_server(private_server_factory: Callable[..., PgServer]) -> PgServer:
    """A private server that asks SCRAM_ROLE for its password (scram) over TCP."""
    server = private_server_factory()
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(
            pgsql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                pgsql.Identifier(SCRAM_ROLE), pgsql.Literal(PASSWORD)
            )
        )
        hba = server.data_dir / "pg_hba.conf"
        # The first matching line wins: this one goes before initdb's "trust" lines.
        hba.write_text(f"host all {SCRAM_ROLE} 127.0.0.1/32 scram-sha-256\n{hba.read_text()}")
        conn.execute("SELECT pg_reload_conf()")

    def asks_for_a_password() -> bool:
        # The postmaster rereads pg_hba.conf on its own time after pg_reload_conf().
        try:
            psycopg.connect(role_dsn(server), passfile=os.devnull, connect_timeout=5).close()
        except psycopg.OperationalError as exc:
            return "password" in str(exc)
        return False

    jobrun_cli.wait_until(asks_for_a_password, what="the server to ask for the role's password")
    return server


def role_dsn(server: PgServer) -> str:
    """The password role's DSN on ``server``: no password in it."""
    return make_conninfo(server.dsn(), user=SCRAM_ROLE)


def passfile_env(server: PgServer, password: str, tmp_path: Path) -> dict[str, str]:
    """PGPASSFILE naming a 0600 file with ``password`` for the role on ``server``."""
    path = tmp_path / "pgpass"
    path.write_text(f"{server.host}:{server.port}:postgres:{SCRAM_ROLE}:{password}\n")
    # libpq ignores a password file that others may read.
    path.chmod(0o600)
    return {"PGPASSFILE": str(path), "PGPASSWORD": ""}


class TestPasswordFile:
    """PGPASSFILE supplies the password of a role the server asks one of."""

    def test_the_passfiles_password_logs_in(self, password_server, key, tmp_path):
        """The password is in PGPASSFILE alone: exit 0, and the child ran."""
        result, marker = touch_run(
            "--no-history", key=key, tmp_path=tmp_path, dsn=role_dsn(password_server),
            env=passfile_env(password_server, PASSWORD, tmp_path),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert marker.exists()

    def test_a_wrong_password_is_refused_and_not_shown(self, password_server, key, tmp_path):
        """A wrong password in PGPASSFILE: exit 69, reason refused, the password never shown."""
        wrong = "pgpass-Wrong-0815"
        result, marker = touch_run(
            "--no-history", key=key, tmp_path=tmp_path, dsn=role_dsn(password_server),
            env=passfile_env(password_server, wrong, tmp_path),
        )  # fmt: skip
        assert result.returncode == 69, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["reason"] == "refused"
        assert wrong not in result.stdout + result.stderr
        assert not marker.exists()
