"""The test helpers themselves: servers, proxy faults and PgBouncer behave as advertised."""

from __future__ import annotations

import concurrent.futures
import os
import random
import re
import select
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest

from harness import pgbouncer as pgbouncer_module
from harness.failover import FailoverPair
from harness.managed import Managed
from harness.pgbouncer import PgBouncer
from harness.pgserver import PgServer
from harness.pgtools import TEMP_ROOT_ENV, PgServerError
from harness.proxy import TcpProxy
from jobrun.ops.throwaway import PGBIN_ENV, NoPostgresError, find_pg_bin

if TYPE_CHECKING:
    from collections.abc import Callable

ADVISORY_HELD_HERE = """
SELECT count(*) FROM pg_locks
WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid() AND objid = %s::oid
"""


def one(conn: psycopg.Connection[tuple[object, ...]], query: str, params: object = None) -> object:
    row = conn.execute(query, params).fetchone()  # type: ignore[arg-type]
    assert row is not None
    return row[0]


def lock_id() -> int:
    # Positive and below 2**31, so that objid alone identifies it.
    return random.randrange(1, 2**31)


# --- servers ---------------------------------------------------------------------------------


def test_find_pg_bin_has_server_binaries() -> None:
    bin_dir = find_pg_bin()
    assert (bin_dir / "initdb").is_file()
    assert (bin_dir / "postgres").is_file()


class TestFindPgBin:
    """The demo's and the test servers' one search for binaries: $JOBRUN_TEST_PGBIN first."""

    def test_the_named_directory_wins(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        for name in ("initdb", "postgres"):
            (tmp_path / name).touch()
        monkeypatch.setenv(PGBIN_ENV, str(tmp_path))
        assert find_pg_bin() == tmp_path

    def test_a_named_directory_without_binaries_is_refused(
        self, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
    ) -> None:
        monkeypatch.setenv(PGBIN_ENV, str(tmp_path))
        with pytest.raises(NoPostgresError, match=f"\\${PGBIN_ENV}=.* holds no initdb"):
            find_pg_bin()


def test_dsn_is_a_database_of_this_session(dsn: str) -> None:
    with psycopg.connect(dsn) as conn:
        name = one(conn, "SELECT current_database()")
    assert str(name).startswith("jobrun_test_")


def test_key_is_unique_per_test(key: str) -> None:
    assert key.startswith("test-test_key_is_unique_per_test-")
    assert len(key) == len("test-test_key_is_unique_per_test-") + 8


@pytest.mark.fault
def test_private_server_restarts_on_the_same_port(private_server: PgServer) -> None:
    port = private_server.port
    with psycopg.connect(private_server.dsn(), autocommit=True) as old:
        private_server.restart()
        assert private_server.port == port
        # A fast shutdown ends every session.
        with pytest.raises(psycopg.OperationalError):
            old.execute("SELECT 1")
    with psycopg.connect(private_server.dsn()) as conn:
        assert one(conn, "SELECT 1") == 1


@pytest.mark.fault
def test_killed_private_server_starts_again_with_committed_data(private_server: PgServer) -> None:
    with psycopg.connect(private_server.dsn(), autocommit=True) as old:
        old.execute("CREATE TABLE survivor (x int)")
        old.execute("INSERT INTO survivor VALUES (1)")
        private_server.kill()
        assert not private_server.running
        with pytest.raises(psycopg.OperationalError):
            old.execute("SELECT 1")
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(private_server.dsn(), connect_timeout=2)
    private_server.start_again()
    with psycopg.connect(private_server.dsn()) as conn:
        assert one(conn, "SELECT count(*) FROM survivor") == 1


@pytest.mark.fault
def test_private_server_applies_settings(
    private_server_factory: Callable[..., PgServer],
) -> None:
    server = private_server_factory({"idle_session_timeout": "1s"})
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        assert one(conn, "SHOW idle_session_timeout") == "1s"
        # The server ends the idle session by itself: its FATAL makes the socket readable.
        readable, _, _ = select.select([conn.fileno()], [], [], 10)
        assert readable, "idle_session_timeout did not end the session"
        with pytest.raises(psycopg.OperationalError, match="idle-session timeout"):
            conn.execute("SELECT 1")


@pytest.mark.fault
@pytest.mark.pg  # starts a server of its own
def test_private_server_context_manager_cleans_up() -> None:
    with PgServer.start() as server:
        base_dir = server.base_dir
        assert base_dir is not None
        assert base_dir.is_dir()
        with psycopg.connect(server.dsn()) as conn:
            assert one(conn, "SELECT 1") == 1
    assert not server.running
    assert not base_dir.exists()
    server.cleanup()  # idempotent


@pytest.mark.fault
@pytest.mark.pg  # starts a server of its own
def test_a_server_that_fails_to_start_leaves_nothing_behind(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    root = Path(tempfile.mkdtemp(prefix="jobrun-test-root-"))
    root.chmod(0o755)  # the demoted server user must reach it when the tests run as root
    monkeypatch.setenv(TEMP_ROOT_ENV, str(root))
    try:
        with pytest.raises(PgServerError, match="exited during startup"):
            PgServer.start({"max_connections": "not a number"})
        assert list(root.iterdir()) == []
    finally:
        root.rmdir()


def test_servers_poolers_and_proxies_share_one_lifecycle() -> None:
    for managed in (PgServer, PgBouncer, TcpProxy):
        assert issubclass(managed, Managed)
        assert managed.cleanup is Managed.cleanup
        assert managed.__exit__ is Managed.__exit__


@pytest.mark.fault
def test_standby_streams_and_takes_over_when_promoted(private_server: PgServer) -> None:
    with PgServer.start_standby(private_server) as standby:
        assert standby.in_recovery()
        with psycopg.connect(private_server.dsn(), autocommit=True) as conn:
            conn.execute("CREATE TABLE streamed AS SELECT 42 AS answer")
        standby.wait_replayed(private_server)
        with psycopg.connect(standby.dsn()) as conn:
            assert one(conn, "SELECT answer FROM streamed") == 42
            with pytest.raises(psycopg.errors.ReadOnlySqlTransaction):
                conn.execute("INSERT INTO streamed VALUES (1)")
        private_server.kill()
        standby.promote()
        assert not standby.in_recovery()
        with psycopg.connect(standby.dsn(), autocommit=True) as conn:
            conn.execute("INSERT INTO streamed VALUES (1)")


@pytest.mark.fault
@pytest.mark.pg  # starts a server of its own
def test_failover_loses_what_replication_held_back() -> None:
    with FailoverPair() as pair:
        with psycopg.connect(pair.dsn(), autocommit=True) as conn:
            conn.execute("CREATE TABLE facts (fact text)")
            conn.execute("INSERT INTO facts VALUES ('replicated')")
        pair.wait_replayed()
        pair.hold_back_replication()
        with psycopg.connect(pair.dsn(), autocommit=True) as conn:
            conn.execute("INSERT INTO facts VALUES ('held back')")
        pair.fail_over()
        # The two-host DSN finds the promoted standby, which never saw the second commit.
        with psycopg.connect(pair.dsn(), autocommit=True) as conn:
            assert one(conn, "SELECT pg_is_in_recovery()") is False
            facts = conn.execute("SELECT fact FROM facts").fetchall()
        assert facts == [("replicated",)]


# --- proxy -----------------------------------------------------------------------------------


def test_proxy_passes_queries(
    proxy: Callable[[str, int], TcpProxy], pg_address: tuple[str, int], dsn: str
) -> None:
    through = proxy(*pg_address)
    with psycopg.connect(through.dsn_for(dsn)) as conn:
        assert conn.info.port == through.port
        assert one(conn, "SELECT 1") == 1
        # More than the proxy buffers at once, in both directions.
        big = "x" * 3_000_000
        assert one(conn, "SELECT length(%s::text || repeat('y', 3000000))", (big,)) == 6_000_000
        assert through.connections == 1
    assert through.accepted == 1


def test_proxy_drop_all_breaks_live_connections(
    proxy: Callable[[str, int], TcpProxy], pg_address: tuple[str, int], dsn: str
) -> None:
    through = proxy(*pg_address)
    with psycopg.connect(through.dsn_for(dsn), autocommit=True) as conn:
        assert one(conn, "SELECT 1") == 1
        assert through.drop_all() == 1
        with pytest.raises(psycopg.OperationalError):
            conn.execute("SELECT 1")
    # The proxy itself keeps working.
    with psycopg.connect(through.dsn_for(dsn)) as conn:
        assert one(conn, "SELECT 2") == 2


def test_proxy_blackhole_hangs_until_restored(
    proxy: Callable[[str, int], TcpProxy], pg_address: tuple[str, int], dsn: str
) -> None:
    through = proxy(*pg_address)
    with (
        psycopg.connect(through.dsn_for(dsn), autocommit=True) as conn,
        concurrent.futures.ThreadPoolExecutor(1) as pool,
    ):
        assert one(conn, "SELECT 1") == 1
        through.blackhole()
        try:
            pending = pool.submit(one, conn, "SELECT 42")
            # New connections hang too, until psycopg's connect_timeout (2 s is the minimum)
            # gives up; meanwhile the query above has had ample time to come back.
            with pytest.raises(psycopg.OperationalError, match="timeout"):
                psycopg.connect(through.dsn_for(dsn), connect_timeout=2)
            assert not pending.done(), "a query got through the black hole"
        finally:
            through.restore()
        assert pending.result(timeout=10) == 42
    with psycopg.connect(through.dsn_for(dsn)) as conn:
        assert one(conn, "SELECT 3") == 3


def test_proxy_refuse_rejects_new_connections_only(
    proxy: Callable[[str, int], TcpProxy], pg_address: tuple[str, int], dsn: str
) -> None:
    through = proxy(*pg_address)
    with psycopg.connect(through.dsn_for(dsn), autocommit=True) as conn:
        through.refuse()
        with pytest.raises(psycopg.OperationalError, match="refused"):
            psycopg.connect(through.dsn_for(dsn), connect_timeout=2)
        assert one(conn, "SELECT 1") == 1
        through.restore()
        with psycopg.connect(through.dsn_for(dsn)) as again:
            assert one(again, "SELECT 2") == 2


def test_proxy_stop_is_idempotent(pg_address: tuple[str, int]) -> None:
    from harness.proxy import TcpProxy  # noqa: PLC0415 - the fixture's class, used bare here

    through = TcpProxy(*pg_address).start()
    through.stop()
    through.stop()
    with pytest.raises(RuntimeError, match="not running"):
        through.drop_all()


# --- PgBouncer -------------------------------------------------------------------------------


def test_pgbouncer_transaction_mode_shares_a_backend(
    pgbouncer: Callable[..., PgBouncer], pg_address: tuple[str, int], dsn: str
) -> None:
    bouncer = pgbouncer(*pg_address, default_pool_size=1)
    # prepare_threshold=None: prepared statements do not survive a change of backend.
    with (
        psycopg.connect(bouncer.dsn_for(dsn), autocommit=True, prepare_threshold=None) as a,
        psycopg.connect(bouncer.dsn_for(dsn), autocommit=True, prepare_threshold=None) as b,
    ):
        backend = one(a, "SELECT pg_backend_pid()")
        assert one(a, "SELECT pg_backend_pid()") == backend
        assert one(b, "SELECT pg_backend_pid()") == backend
        # PgBouncer makes up the pid of its protocol handshake.
        assert a.info.backend_pid != backend
        # The pooling hazard itself: a's session lock now sits on b's backend too.
        lock = lock_id()
        a.execute("SELECT pg_advisory_lock(%s)", (lock,))
        try:
            assert one(b, ADVISORY_HELD_HERE, (lock,)) == 1
        finally:
            a.execute("SELECT pg_advisory_unlock(%s)", (lock,))


def test_pgbouncer_session_mode_gives_each_client_a_backend(
    pgbouncer: Callable[..., PgBouncer], pg_address: tuple[str, int], dsn: str
) -> None:
    bouncer = pgbouncer(*pg_address, pool_mode="session")
    with (
        psycopg.connect(bouncer.dsn_for(dsn), autocommit=True) as a,
        psycopg.connect(bouncer.dsn_for(dsn), autocommit=True) as b,
    ):
        assert one(a, "SELECT pg_backend_pid()") != one(b, "SELECT pg_backend_pid()")


def test_missing_pgbouncer_skips_locally_but_fails_on_ci(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pgbouncer_module, "find_pgbouncer", lambda: None)
    monkeypatch.delenv("CI", raising=False)
    with pytest.raises(pytest.skip.Exception):
        pgbouncer_module.require_pgbouncer()
    monkeypatch.setenv("CI", "true")
    with pytest.raises(pytest.fail.Exception):
        pgbouncer_module.require_pgbouncer()


LEAKY_TESTS = """
import subprocess, sys

def test_a_failing_test_that_leaks_a_process():
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(5)"])
    assert child.pid < 0, "fails, with the running Popen in its frame"

def test_a_clean_neighbour():
    assert sum(range(3)) == 3
"""


def test_a_leak_fails_the_test_that_leaked_it(tmp_path: Path) -> None:
    """A failed test's leaked process is reported on that test, never on the next one."""
    (tmp_path / "test_leaky.py").write_text(LEAKY_TESTS)
    tests_dir = Path(__file__).parent
    inner = subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "support.leaks", "-p", "no:randomly",
         "-p", "no:cacheprovider", "-W", "error", "-rA", "-q", "test_leaky.py"],
        check=False,
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(tests_dir)},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    reported = re.compile(r"^(PASSED|FAILED|ERROR) test_leaky\.py::(\w+)", re.MULTILINE)
    outcomes = set(reported.findall(inner.stdout))
    assert outcomes == {
        ("FAILED", "test_a_failing_test_that_leaks_a_process"),
        ("ERROR", "test_a_failing_test_that_leaks_a_process"),
        ("PASSED", "test_a_clean_neighbour"),
    }, inner.stdout
