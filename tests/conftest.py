"""Shared fixtures: a test database, private servers, fault-injecting proxies and PgBouncer."""

from __future__ import annotations

import os
import subprocess
import uuid
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harness import jobrun_cli, jobrun_inprocess
from harness.pgbouncer import PgBouncer, require_pgbouncer
from harness.pgserver import PgServer
from harness.pgtools import create_database, drop_database, server_address, server_version
from harness.proxy import TcpProxy
from jobrun.ops.throwaway import NoPostgresError, find_pg_bin
from support import EXAMPLES_PROPERTY

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable, Iterator
    from types import ModuleType

#: Fixtures shared by several test files (databases and roles of a test's own; history; leaks).
pytest_plugins = ["support.fixtures", "support.history", "support.leaks"]

#: Point the tests at an existing server (libpq key=value or URI); unset: a private one.
DSN_ENV = "JOBRUN_TEST_DSN"


def safe_dsn(dsn: str) -> str:
    """``dsn`` without its password, for display."""
    try:
        params = conninfo_to_dict(dsn)
    except psycopg.ProgrammingError:
        return "(a DSN that does not parse)"  # its error message could quote the password
    hidden = " password=***" if params.pop("password", None) else ""
    return make_conninfo("", **params) + hidden


def pytest_report_header() -> list[str]:
    # Runs before any fixture: connect on our own, and never start a server just for this.
    dsn = os.environ.get(DSN_ENV)
    if dsn:
        try:
            with psycopg.connect(dsn, connect_timeout=3) as conn:
                version = conn.execute("SHOW server_version").fetchone()
        except psycopg.Error as exc:
            reason = " ".join(str(exc).split())
            return [f"jobrun test server: {safe_dsn(dsn)} from ${DSN_ENV} (unreachable: {reason})"]
        shown = version[0] if version else "?"
        return [f"jobrun test server: {safe_dsn(dsn)} from ${DSN_ENV} (PostgreSQL {shown})"]
    try:
        bin_dir = find_pg_bin()
        detail = f"{server_version(bin_dir)}, {bin_dir}"
    except (NoPostgresError, OSError, subprocess.SubprocessError) as exc:
        detail = f"unavailable: {exc}"
    return [f"jobrun test server: private throwaway server, started once per session ({detail})"]


#: A test is marked by what it uses, so ``-m "not pg"`` is always the tier without a server.
MARKS_FROM_FIXTURES = {
    "pg": (
        "pg_admin_dsn",
        "private_server_factory",
        "pgbouncer",
        "pair",
        "staging",
        # Module fixtures that start a private server of their own (logs, TLS, the demo's).
        "logging_server",
        "logged_server",
        "tls_server",
        "demo_dsn",
        "night",
        "nls_server",
    ),
    "fault": ("private_server_factory", "pair"),
}


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Mark each test ``pg`` / ``fault`` from the fixtures it uses (directly or not).

    A ``process`` test is marked ``pg`` too: ``-m "not pg"``, the fast tier, is the tests
    that need neither a server nor a jobrun process of their own.
    """
    for item in items:
        used = set(getattr(item, "fixturenames", ()))
        for mark, fixtures in MARKS_FROM_FIXTURES.items():
            if used.intersection(fixtures):
                item.add_marker(mark)
        if item.get_closest_marker("fault") and not item.get_closest_marker("pg"):
            item.add_marker("pg")  # a fault test always has a server of its own
        if item.get_closest_marker("process") and not item.get_closest_marker("pg"):
            item.add_marker("pg")  # the full suite's, as a test with a server is


@pytest.fixture(autouse=True)
def _fast_tier_starts_no_jobrun(request: pytest.FixtureRequest) -> Iterator[None]:
    """In the fast tier, starting jobrun through harness/jobrun_cli fails the test at once.

    An interpreter start costs about a quarter of a CPU second (the tier once spent most of
    its time on them): such a test calls jobrun in this process (the ``jobrun_here``
    fixture), or, when what it checks is the process itself, is marked ``process``.
    """
    if request.node.get_closest_marker("pg"):
        yield
        return
    jobrun_cli.refused = (
        f"{request.node.nodeid} is in the fast tier (-m 'not pg') but starts jobrun as a "
        "process: call it in this process (the jobrun_here fixture), or mark the test "
        "@pytest.mark.process if what it checks is the process itself"
    )
    try:
        yield
    finally:
        jobrun_cli.refused = None


@pytest.fixture
def jobrun_here() -> ModuleType:
    """jobrun's command line called in this process (harness/jobrun_inprocess.py).

    ``jobrun_here.run(*args, dsn=..., env=..., stdin=...)`` answers as ``jobrun_cli.run``
    does (exit status, stdout, stderr), without starting an interpreter; ``forked=True``
    makes the call in a fork, for a run that leaves a thread to its process's exit.
    """
    return jobrun_inprocess


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    """How many examples each property test tried (test_properties reports them)."""
    tried = {
        value[0]: value[1]
        for reports in terminalreporter.stats.values()
        for report in reports
        for name, value in getattr(report, "user_properties", ())
        if name == EXAMPLES_PROPERTY and getattr(report, "when", None) == "teardown"
    }
    if tried:
        terminalreporter.section("hypothesis examples (jobrun properties)")
        for name, count in sorted(tried.items()):
            terminalreporter.write_line(f"{name}: {count} examples")


@pytest.fixture(scope="session")
def pg_admin_dsn() -> Iterator[str]:
    """A superuser DSN: $JOBRUN_TEST_DSN, else a private server for this session."""
    dsn = os.environ.get(DSN_ENV)
    if dsn:
        yield dsn
        return
    with PgServer.start() as server:
        yield server.dsn()


@pytest.fixture(scope="session")
def dsn(pg_admin_dsn: str) -> Iterator[str]:
    """A DSN for a fresh database of this session's own.

    Advisory locks are per database, so concurrent test sessions on one server do not meet.
    """
    name = f"jobrun_test_{uuid.uuid4().hex[:12]}"
    create_database(pg_admin_dsn, name)
    try:
        yield make_conninfo(pg_admin_dsn, dbname=name)
    finally:
        drop_database(pg_admin_dsn, name)


@pytest.fixture
def private_server_factory() -> Iterator[Callable[..., PgServer]]:
    """``make(settings=None) -> PgServer``: private servers, removed after the test."""
    servers: list[PgServer] = []

    def make(settings: dict[str, str] | None = None) -> PgServer:
        server = PgServer.start(settings)
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.cleanup()


@pytest.fixture
def private_server(private_server_factory: Callable[..., PgServer]) -> PgServer:
    """A private server of this test's own, to restart, kill or cut off at will."""
    return private_server_factory()


@pytest.fixture
def proxy() -> Iterator[Callable[[str, int], TcpProxy]]:
    """``make_proxy(host, port) -> TcpProxy`` (started), stopped after the test."""
    proxies: list[TcpProxy] = []

    def make_proxy(host: str, port: int) -> TcpProxy:
        started = TcpProxy(host, port).start()
        proxies.append(started)
        return started

    yield make_proxy
    for started in proxies:
        started.stop()


@pytest.fixture
def pgbouncer() -> Iterator[Callable[..., PgBouncer]]:
    """``make_pgbouncer(host, port, pool_mode="transaction", ...) -> PgBouncer`` (started).

    Skips when pgbouncer is not installed, except on CI (CI=true), where that fails.
    """
    binary = require_pgbouncer()
    bouncers: list[PgBouncer] = []
    # PgBouncer's auth_file must list the users: add the one $JOBRUN_TEST_DSN logs in as,
    # and log in to the server with its password, if any.
    env = conninfo_to_dict(os.environ.get(DSN_ENV, ""))
    env_users = [str(env["user"])] if env.get("user") else []
    env_password = str(env["password"]) if env.get("password") else None

    def make_pgbouncer(
        host: str,
        port: int,
        pool_mode: str = "transaction",
        *,
        default_pool_size: int = 2,
        users: Iterable[str] = ("postgres", *env_users),
        server_password: str | None = env_password,
        ignore_startup_parameters: Iterable[str] = ("extra_float_digits",),
        settings: dict[str, str] | None = None,
    ) -> PgBouncer:
        bouncer = PgBouncer(
            host,
            port,
            pool_mode=pool_mode,
            default_pool_size=default_pool_size,
            users=users,
            server_password=server_password,
            ignore_startup_parameters=ignore_startup_parameters,
            settings=settings,
            binary=binary,
        )
        bouncers.append(bouncer)
        return bouncer.start()

    yield make_pgbouncer
    for bouncer in bouncers:
        bouncer.cleanup()


@pytest.fixture
def key(request: pytest.FixtureRequest) -> str:
    """A lock key no other test (or test session) uses."""
    return f"test-{request.node.name[:40]}-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="session")
def pg_address(pg_admin_dsn: str) -> tuple[str, int]:
    """(host, port) of the session's server, for make_proxy() and make_pgbouncer()."""
    return server_address(pg_admin_dsn)
