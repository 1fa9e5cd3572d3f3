"""`jobrun demo` uses only a database it was given, and leaves nothing of its own there."""

from __future__ import annotations

import contextlib
import random
import re
import socket
import subprocess
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from harness import jobrun_cli

if TYPE_CHECKING:
    from collections.abc import Iterator

#: libpq variables that name a server or database (the demo's rule).
NAMING = ("PGHOST", "PGHOSTADDR", "PGDATABASE", "PGSERVICE")
DEMO_TIMEOUT = 180


def demo(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``jobrun demo`` with exactly ``env`` (JOBRUN_DSN included or not)."""
    return subprocess.run(
        [*jobrun_cli.JOBRUN, "demo"], env=env, capture_output=True, text=True,
        timeout=DEMO_TIMEOUT, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def unnamed_environment(**extra: str) -> dict[str, str]:
    """Our environment with no JOBRUN_DSN and none of the variables that name a database."""
    env = jobrun_cli.environment(None)
    for name in NAMING:
        env.pop(name, None)
    return {**env, **extra}


def default_socket_dir() -> Path:
    """The directory where this libpq looks for a server when no host is given."""
    try:
        psycopg.connect("port=1", connect_timeout=2).close()
    except psycopg.OperationalError as exc:
        found = re.search(r'socket "(.+)/\.s\.PGSQL\.1"', str(exc))
        if found:
            return Path(found[1])
    pytest.skip("this libpq does not connect through a Unix socket by default")


@contextlib.contextmanager
def default_server() -> Iterator[tuple[str, list[int]]]:
    """A listener where libpq's defaults lead (its socket dir, PGPORT): (port, connections)."""
    directory = default_socket_dir()
    if not directory.is_dir():
        pytest.skip(f"no {directory}: libpq's defaults lead nowhere here")
    for _ in range(100):
        port = str(random.randrange(20000, 60000))
        path = directory / f".s.PGSQL.{port}"
        if not path.exists():
            break
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(str(path))
    except PermissionError:
        pytest.skip(f"{directory} is not writable here")
    listener.listen(16)
    accepted: list[int] = []

    def accept() -> None:
        with contextlib.suppress(OSError):  # closed at the end
            while True:
                conn, _ = listener.accept()
                accepted.append(1)
                conn.close()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield port, accepted
    finally:
        listener.shutdown(socket.SHUT_RDWR)
        listener.close()
        path.unlink(missing_ok=True)
        thread.join(timeout=5)


def demo_rows(dsn: str) -> list[tuple[str, str]]:
    """(table, key) of every row whose key starts with ``demo-`` in the jobrun schema."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = conn.execute(
            "SELECT table_name FROM information_schema.columns "
            "WHERE table_schema = 'jobrun' AND column_name = 'key'"
        ).fetchall()
        rows = []
        for (table,) in tables:
            found = conn.execute(
                f"SELECT key FROM jobrun.{table} WHERE key LIKE 'demo-%'"  # noqa: S608 - catalog names
            ).fetchall()
            rows += [(table, key) for (key,) in found]
    return rows


def has_schema(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT to_regnamespace('jobrun') IS NOT NULL").fetchone()
    return bool(row and row[0])


class TestDatabaseChoice:
    """A database is used only when named; libpq's defaults alone never choose one."""

    @pytest.mark.pg  # nothing named: the demo starts a throwaway server of its own
    def test_nothing_named_never_reaches_the_default_server(self):
        """PG* unset: the server libpq would reach by default gets no connection at all."""
        with default_server() as (port, accepted):
            env = unnamed_environment(PGPORT=port)
            # What "nothing named" means elsewhere: `jobrun status` goes where libpq's defaults
            # lead, so this proves the listener stands where the demo would have gone before.
            subprocess.run(
                [*jobrun_cli.JOBRUN, "status"], env=env, capture_output=True, timeout=60,
                check=False,
            )  # fmt: skip
            assert accepted, "the test's listener is not where libpq's defaults lead"
            accepted.clear()
            result = demo(env)
        assert accepted == []
        assert result.returncode == 0, result.stdout + result.stderr
        assert "no database named" in result.stdout

    def test_pghost_names_the_database(self, dsn):
        """PGHOST, PGPORT, PGUSER and PGDATABASE set (no DSN): the demo runs there."""
        params = conninfo_to_dict(dsn)
        env = unnamed_environment(
            PGHOST=str(params["host"]), PGPORT=str(params.get("port", 5432)),
            PGUSER=str(params["user"]), PGDATABASE=str(params["dbname"]),
        )  # fmt: skip
        result = demo(env)
        assert result.returncode == 0, result.stdout + result.stderr
        assert f"using the database at {params['host']}:" in result.stdout


class TestNamedDatabaseLeftClean:
    """In a database it was given, the demo removes what it wrote."""

    def test_fresh_database_is_left_without_schema(self, fresh_dsn):
        """A database without the jobrun schema has none after the demo."""
        result = demo(jobrun_cli.environment(fresh_dsn))
        assert result.returncode == 0, result.stdout + result.stderr
        assert not has_schema(fresh_dsn)

    def test_existing_schema_keeps_other_rows_and_loses_the_demos(self, fresh_dsn, key):
        """A schema in use keeps its rows and tables; only the demo's rows go."""
        assert jobrun_cli.run("--key", key, "--", "true", dsn=fresh_dsn).returncode == 0
        result = demo(jobrun_cli.environment(fresh_dsn))
        assert result.returncode == 0, result.stdout + result.stderr
        assert demo_rows(fresh_dsn) == []
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            kept = conn.execute("SELECT count(*) FROM jobrun.runs WHERE key = %s", (key,))
            assert kept.fetchone() == (1,)

    def test_rows_it_may_not_delete_are_named(self, fresh_dsn, role, key):
        """A role that may write runs but not delete them: one line says what was left."""
        assert jobrun_cli.run("--key", key, "--", "true", dsn=fresh_dsn).returncode == 0
        limited = role(
            "GRANT USAGE ON SCHEMA jobrun TO {role}",
            "GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA jobrun TO {role}",
            database_dsn=fresh_dsn,
        )
        result = demo(jobrun_cli.environment(limited))
        assert result.returncode == 0, result.stdout + result.stderr
        assert "could not remove the demo's rows" in result.stdout
        assert "Traceback" not in result.stderr
