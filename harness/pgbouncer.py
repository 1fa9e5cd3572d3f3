"""A private PgBouncer in front of a PostgreSQL server, for tests of pooled connections."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
from pathlib import Path
from typing import TYPE_CHECKING

from psycopg.conninfo import make_conninfo

from .managed import Managed
from .pgtools import RunAs, dsn_through, free_port, log_tail, make_private_dir, wait_ready

if TYPE_CHECKING:
    from collections.abc import Iterable

_READY_TIMEOUT = 30.0
_STOP_TIMEOUT = 30.0
_PORT_ATTEMPTS = 5
_SEARCH = ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer", "/usr/local/bin/pgbouncer")

INSTALL_HINT = "pgbouncer is not installed (apt-get install pgbouncer)"


def find_pgbouncer() -> Path | None:
    """The pgbouncer executable: on PATH, or where packages put it (sbin is often off PATH)."""
    found = shutil.which("pgbouncer")
    if found:
        return Path(found)
    return next((Path(p) for p in _SEARCH if os.access(p, os.X_OK)), None)


def require_pgbouncer() -> Path:  # noqa: RET503 - pytest.skip and pytest.fail raise
    """find_pgbouncer(), or skip the test; on CI (CI=true) fail instead of skipping."""
    import pytest  # noqa: PLC0415 - only a test calls this; the harness itself needs no pytest

    binary = find_pgbouncer()
    if binary is not None:
        return binary
    if os.environ.get("CI") == "true":
        pytest.fail(f"{INSTALL_HINT}; CI must run the PgBouncer tests, not skip them")
    pytest.skip(INSTALL_HINT)


def _ini_value(value: str) -> str:
    if any(c in value for c in "\n;#"):
        raise ValueError(f"not safe in pgbouncer.ini: {value!r}")
    return value


class PgBouncer(Managed):
    """PgBouncer on 127.0.0.1:<port>, forwarding every database name to one server.

    Clients authenticate with ``auth_type = trust`` (PgBouncer still wants the user names in
    its auth_file: pass them in ``users``); PgBouncer logs in to the server as the same user,
    with ``server_password`` when the server wants one.
    """

    host = "127.0.0.1"

    def __init__(
        self,
        server_host: str,
        server_port: int,
        *,
        pool_mode: str = "transaction",
        default_pool_size: int = 2,
        users: Iterable[str] = ("postgres",),
        server_password: str | None = None,
        ignore_startup_parameters: Iterable[str] = ("extra_float_digits",),
        settings: dict[str, str] | None = None,
        binary: Path | None = None,
    ) -> None:
        self.server_host = server_host
        self.server_port = server_port
        self.pool_mode = pool_mode
        self.default_pool_size = default_pool_size
        self.users = list(dict.fromkeys(users))  # de-duplicated, in order
        if not self.users:
            raise ValueError("PgBouncer needs at least one user for its auth_file")
        self.server_password = server_password
        self.ignore_startup_parameters = list(ignore_startup_parameters)
        self.settings = dict(settings or {})
        self.binary = binary or find_pgbouncer()
        self.base_dir: Path | None = None
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def log_path(self) -> Path:
        """PgBouncer's stderr."""
        if self.base_dir is None:
            raise RuntimeError("PgBouncer has no directory yet")
        return self.base_dir / "pgbouncer.log"

    @property
    def running(self) -> bool:
        """Whether the pgbouncer process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def dsn(self, dbname: str = "postgres", user: str | None = None) -> str:
        """A libpq key=value string for connecting through PgBouncer."""
        return make_conninfo(
            "", host=self.host, port=str(self.port), user=user or self.users[0], dbname=dbname
        )

    def dsn_for(self, server_dsn: str) -> str:
        """``server_dsn`` (same user, dbname...) with host and port pointing at PgBouncer."""
        return dsn_through(server_dsn, self.host, self.port)

    def admin_dsn(self) -> str:
        """The admin console (SHOW POOLS, SHOW SERVERS...): simple query protocol only."""
        return self.dsn("pgbouncer")

    def start(self) -> PgBouncer:
        """Write the config, start pgbouncer on a free port and wait until it answers."""
        if self.binary is None:
            raise RuntimeError(INSTALL_HINT)

        def setup() -> None:
            self.base_dir = make_private_dir("jobrun-pgbouncer-")
            (self.base_dir / "userlist.txt").write_text(
                "".join(f'"{_ini_value(user)}" ""\n' for user in self.users)
            )
            self._start_on_free_port()

        return self._started(setup)

    def _start_on_free_port(self) -> None:
        for _ in range(_PORT_ATTEMPTS):
            self.port = free_port()
            self._write_config()
            if self._launch():
                return
        raise RuntimeError(f"pgbouncer found no free port:\n{log_tail(self.log_path)}")

    def _write_config(self) -> None:
        assert self.base_dir is not None
        target = f"host={self.server_host} port={self.server_port}"
        if self.server_password:
            target += f" password={self.server_password}"
        settings = {
            "listen_addr": self.host,
            "listen_port": str(self.port),
            # Default is /tmp: keep our socket to ourselves.
            "unix_socket_dir": str(self.base_dir),
            "auth_type": "trust",
            "auth_file": str(self.base_dir / "userlist.txt"),
            "admin_users": ",".join(self.users),
            "pool_mode": self.pool_mode,
            "default_pool_size": str(self.default_pool_size),
            "min_pool_size": "0",
            "reserve_pool_size": "0",
            "max_client_conn": "200",
            # LIFO: the most recently used server connection is reused first, so successive
            # transactions predictably share a backend.
            "server_round_robin": "0",
            "ignore_startup_parameters": ",".join(self.ignore_startup_parameters),
            # Logs go to stderr (our log file); no pidfile, no daemon.
            "logfile": "",
            "pidfile": "",
            **self.settings,
        }
        lines = ["[databases]", f"* = {_ini_value(target)}", "", "[pgbouncer]"]
        lines += [f"{name} = {_ini_value(value)}" for name, value in settings.items()]
        (self.base_dir / "pgbouncer.ini").write_text("\n".join(lines) + "\n")

    def _launch(self) -> bool:
        """Start pgbouncer; False when its port was taken meanwhile."""
        assert self.base_dir is not None
        assert self.binary is not None
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        run_as = RunAs.for_servers()
        with self.log_path.open("ab") as log:
            self._proc = subprocess.Popen(
                [str(self.binary), str(self.base_dir / "pgbouncer.ini")],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self.base_dir,
                start_new_session=True,  # a Ctrl-C meant for pytest is not for pgbouncer
                user=run_as.user,
                group=run_as.group,
                extra_groups=run_as.extra_groups,
            )
        # The admin console answers without touching the server behind.
        return wait_ready(
            self._proc,
            self.admin_dsn(),
            self.log_path,
            offset,
            name="pgbouncer",
            timeout=_READY_TIMEOUT,
            give_up=self.stop,
        )

    def version(self) -> tuple[int, ...]:
        """PgBouncer's version, e.g. (1, 18, 0)."""
        assert self.binary is not None
        out = subprocess.run(
            [str(self.binary), "--version"], capture_output=True, text=True, check=True, timeout=30
        ).stdout
        found = re.search(r"PgBouncer (\d+(?:\.\d+)*)", out)
        if not found:
            raise RuntimeError(f"cannot tell the PgBouncer version from {out!r}")
        return tuple(int(part) for part in found.group(1).split("."))

    def stop(self) -> None:
        """Immediate shutdown: client and server connections are closed."""
        if not self.running:
            return
        assert self._proc is not None
        # 1.23 made SIGTERM wait for every client to leave; SIGQUIT took over "immediate".
        immediate = signal.SIGQUIT if self.version() >= (1, 23) else signal.SIGTERM
        self._proc.send_signal(immediate)
        try:
            self._proc.wait(timeout=_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _release(self) -> None:
        """stop() and remove the directory."""
        try:
            self.stop()
        finally:
            if self.base_dir is not None:
                shutil.rmtree(self.base_dir, ignore_errors=True)

    def __repr__(self) -> str:
        target = f"{self.server_host}:{self.server_port}"
        return f"<PgBouncer {self.host}:{self.port} -> {target} ({self.pool_mode})>"
