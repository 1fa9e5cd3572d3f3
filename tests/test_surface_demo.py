"""``jobrun demo``'s throwaway server admits its owner only: no TCP, a private socket directory."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from jobrun.ops import throwaway

if TYPE_CHECKING:
    from collections.abc import Iterator

#: Someone else on the host: neither us nor the user the server runs as.
OTHER_USER = "daemon"


@pytest.fixture(scope="module")
def demo_dsn() -> Iterator[str]:
    """The DSN of a throwaway server as ``jobrun demo`` starts it."""
    try:
        throwaway.find_pg_bin()
    except throwaway.NoPostgresError as exc:
        pytest.skip(str(exc))
    with throwaway.server() as dsn:
        yield dsn


class TestThrowawayServer:
    """Its trust authentication is safe only because nobody else can reach it."""

    def test_listens_on_no_tcp_port(self, demo_dsn):
        """listen_addresses is empty: no local user can connect through 127.0.0.1."""
        with psycopg.connect(demo_dsn) as conn:
            assert conn.execute("SHOW listen_addresses").fetchone() == ("",)

    def test_its_socket_directory_is_private(self, demo_dsn):
        """The socket's directory is 0700 and the server's user's."""
        directory = Path(conninfo_to_dict(demo_dsn)["host"])
        found = directory.stat()
        assert stat.S_IMODE(found.st_mode) == 0o700
        expected = throwaway.run_as().get("user", os.geteuid())
        assert found.st_uid == expected

    @pytest.mark.skipif(os.geteuid() != 0, reason="only root can act as another user")
    def test_another_user_cannot_connect(self, demo_dsn):
        """psql as another OS user, with the DSN the demo uses: refused."""
        psql = shutil.which("psql") or str(throwaway.find_pg_bin() / "psql")
        if not os.access(psql, os.X_OK):
            pytest.skip("no psql to connect with")
        result = subprocess.run(
            [psql, demo_dsn, "-Atc", "SELECT current_user"],
            user=OTHER_USER,
            env={"PATH": "/usr/bin:/bin", "HOME": "/"},
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        assert result.returncode != 0, result.stdout
        assert "Permission denied" in result.stderr
