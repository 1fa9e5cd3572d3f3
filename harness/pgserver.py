"""Private throwaway PostgreSQL servers for tests: create, stop, crash and start them again."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time
from typing import TYPE_CHECKING

import psycopg
from psycopg.conninfo import make_conninfo

from jobrun.ops.throwaway import find_pg_bin

from .managed import Managed
from .pgtools import (
    PgServerError,
    RunAs,
    check_reachable,
    children_of,
    free_port,
    log_tail,
    make_private_dir,
    open_pidfd,
    pg_env,
    wait_gone,
    wait_ready,
)

if TYPE_CHECKING:
    from pathlib import Path

_READY_TIMEOUT = 30.0
_STOP_TIMEOUT = 30.0
_PORT_ATTEMPTS = 5
_STOP_SIGNALS = {
    "smart": signal.SIGTERM,
    "fast": signal.SIGINT,
    "immediate": signal.SIGQUIT,
}

_BASE_SETTINGS = {
    "listen_addresses": "127.0.0.1",
    # Throwaway data: surviving an OS crash only costs time. synchronous_commit stays on:
    # kill() simulates a server crash, and that must not lose committed transactions.
    "fsync": "off",
    "full_page_writes": "off",
    "log_line_prefix": "%m [%p] %q%u@%d ",
}


def _quote(value: str) -> str:
    """A postgresql.conf value: every GUC accepts a single-quoted string."""
    return "'" + value.replace("\\", "\\\\").replace("'", "''") + "'"


class PgServer(Managed):
    """A private PostgreSQL server in a temp dir, for tests that restart, crash or cut it.

    Use PgServer.start(); the server listens on 127.0.0.1:<port> with trust auth for
    user "postgres", and on a unix socket in its own directory.
    """

    host = "127.0.0.1"
    user = "postgres"

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.settings = dict(settings or {})
        self.bin_dir = find_pg_bin()
        self.base_dir: Path | None = None
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None

    @classmethod
    def start(cls, settings: dict[str, str] | None = None) -> PgServer:
        """Initdb a new cluster, start it on a free port and wait until it accepts connections.

        ``settings`` go into postgresql.conf, e.g. ``{"idle_session_timeout": "1s"}``.
        """
        server = cls(settings)

        def setup() -> None:
            server._init()
            server._start_on_free_port()

        return server._started(setup)

    @classmethod
    def start_standby(
        cls,
        primary: PgServer,
        settings: dict[str, str] | None = None,
        *,
        port: int | None = None,
        upstream: str | None = None,
    ) -> PgServer:
        """A streaming standby of ``primary``: pg_basebackup -R, then start it and wait.

        Replication is asynchronous (the primary does not wait for the standby), as in most
        deployments: a commit acknowledged by the primary may not have reached the standby
        when it is promoted. ``port`` reuses a port (say, a stopped old primary's), so that a
        multi-host DSN naming both ports stays valid; default: a free one. ``upstream`` is
        the conninfo the standby streams from (default: the primary's own), e.g. a TcpProxy
        in front of the primary, so that a test can hold replication back.
        """
        server = cls(settings)

        def setup() -> None:
            server._clone(primary, upstream)
            if port is None:
                server._start_on_free_port()
            else:
                server.port = port
                server._launch()

        return server._started(setup)

    # --- paths and connection strings -------------------------------------------------------

    @property
    def data_dir(self) -> Path:
        """PGDATA."""
        return self._base / "data"

    @property
    def socket_dir(self) -> Path:
        """Where the server's unix socket lives."""
        return self._base

    @property
    def log_path(self) -> Path:
        """The server's stderr (initdb's output first)."""
        return self._base / "postgres.log"

    @property
    def _base(self) -> Path:
        if self.base_dir is None:
            raise PgServerError("the server has no directory yet")
        return self.base_dir

    def dsn(self, dbname: str = "postgres") -> str:
        """A libpq key=value connection string for this server over TCP."""
        return make_conninfo("", host=self.host, port=str(self.port), user=self.user, dbname=dbname)

    @property
    def pid(self) -> int | None:
        """The postmaster's pid while it runs."""
        return self._proc.pid if self.running and self._proc else None

    @property
    def running(self) -> bool:
        """Whether the postmaster is alive."""
        return self._proc is not None and self._proc.poll() is None

    # --- lifecycle ---------------------------------------------------------------------------

    def _init(self) -> None:
        check_reachable(self.bin_dir)
        self.base_dir = make_private_dir("jobrun-pg-")
        self._run_tool(
            "initdb",
            "-D",
            str(self.data_dir),
            "--auth=trust",
            "--username=postgres",
            "--encoding=UTF8",
            "--no-locale",
            "--no-sync",
        )
        self._append_settings(
            "# added by harness/pgserver.py",
            {**_BASE_SETTINGS, "unix_socket_directories": str(self.socket_dir), **self.settings},
        )

    def _clone(self, primary: PgServer, upstream: str | None) -> None:
        """Copy ``primary`` with pg_basebackup -R (standby.signal and primary_conninfo)."""
        check_reachable(self.bin_dir)
        self.base_dir = make_private_dir("jobrun-pg-standby-")
        self._run_tool(
            "pg_basebackup",
            "-D",
            str(self.data_dir),
            "-R",
            "--wal-method=stream",
            "--checkpoint=fast",
            "--no-sync",
            "-d",
            primary.dsn(),
        )
        # The copy carries the primary's postgresql.conf: later lines win, so the socket
        # directory (the primary's own) and this server's settings go at the end.
        self._append_settings(
            "# added by harness/pgserver.py for the standby",
            {"unix_socket_directories": str(self.socket_dir), **self.settings},
        )
        if upstream is not None:
            # -R wrote primary_conninfo into postgresql.auto.conf; a later line there wins.
            with (self.data_dir / "postgresql.auto.conf").open("a") as auto:
                auto.write(f"primary_conninfo = {_quote(upstream)}\n")

    def _run_tool(self, tool: str, *args: str) -> None:
        """Run a server program of ``bin_dir`` as the servers' user; its output to the log."""
        run_as = RunAs.for_servers()
        with self.log_path.open("ab") as log:
            result = subprocess.run(
                [str(self.bin_dir / tool), *args],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=self._base,
                env=pg_env(self.bin_dir),
                timeout=120,
                check=False,
                user=run_as.user,
                group=run_as.group,
                extra_groups=run_as.extra_groups,
            )
        if result.returncode != 0:
            raise PgServerError(f"{tool} failed:\n{log_tail(self.log_path)}")

    def _append_settings(self, header: str, settings: dict[str, str]) -> None:
        lines = ["", header, *(f"{name} = {_quote(value)}" for name, value in settings.items())]
        with (self.data_dir / "postgresql.conf").open("a") as conf:
            conf.write("\n".join(lines) + "\n")

    def _start_on_free_port(self) -> None:
        for _ in range(_PORT_ATTEMPTS):
            self.port = free_port()
            try:
                self._launch()
            except _PortTakenError:
                continue  # someone grabbed the port between free_port() and our bind
            return
        raise PgServerError(f"no free port after {_PORT_ATTEMPTS} attempts")

    def start_again(self, *, wait: bool = True) -> None:
        """Start the stopped (or killed) server on its old port and wait until it is ready.

        ``wait=False``: return once the postmaster runs (a standby with hot_standby off
        never becomes ready: it answers "not accepting connections" until promoted).
        """
        if self.running:
            raise PgServerError("the server is already running")
        self._launch(wait=wait)

    def _launch(self, *, wait: bool = True) -> None:
        offset = self.log_path.stat().st_size if self.log_path.exists() else 0
        run_as = RunAs.for_servers()
        with self.log_path.open("ab") as log:
            # The port goes on the command line so that a collision retry needs no conf edit.
            self._proc = subprocess.Popen(
                [str(self.bin_dir / "postgres"), "-D", str(self.data_dir), "-p", str(self.port)],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                cwd=self._base,
                env=pg_env(self.bin_dir),
                # Its own session: a Ctrl-C meant for pytest must not shut the server down.
                start_new_session=True,
                user=run_as.user,
                group=run_as.group,
                extra_groups=run_as.extra_groups,
            )
        if wait:
            self._wait_ready(offset)

    def _wait_ready(self, log_offset: int) -> None:
        assert self._proc is not None
        ready = wait_ready(
            self._proc,
            self.dsn(),
            self.log_path,
            log_offset,
            name="postgres",
            timeout=_READY_TIMEOUT,
            give_up=self.kill,
            port_taken=("could not bind", "Address already in use"),
        )
        if not ready:
            raise _PortTakenError

    def stop(self, mode: str = "fast") -> None:
        """Shut down ("smart", "fast" or "immediate", as pg_ctl -m) and wait for the exit."""
        if mode not in _STOP_SIGNALS:
            raise ValueError(f"unknown stop mode {mode!r}")
        if not self.running:
            return
        assert self._proc is not None
        self._proc.send_signal(_STOP_SIGNALS[mode])
        try:
            self._proc.wait(timeout=_STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            self.kill()
            raise PgServerError(f"postgres ignored {mode} shutdown; killed it") from None

    def restart(self) -> None:
        """Fast shutdown, then start again on the same port."""
        self.stop("fast")
        self.start_again()

    def become_standby(self, *, wait: bool = True) -> None:
        """Restart as a hot standby (read-only, in recovery) of a primary that never answers.

        After a clean shutdown the standby is consistent at once and accepts connections
        (with hot_standby off it never does: then pass ``wait=False``).
        """
        self.stop("fast")
        signal_file = self.data_dir / "standby.signal"
        signal_file.touch()
        run_as = RunAs.for_servers()
        if run_as.user is not None and run_as.group is not None:
            os.chown(signal_file, run_as.user, run_as.group)
        self.start_again(wait=wait)

    def signal_promotion(self) -> None:
        """Ask a standby to promote itself, without waiting (``pg_ctl promote``).

        A file and SIGUSR1: works where no connection is possible (``hot_standby = off``).
        """
        assert self._proc is not None
        trigger = self.data_dir / "promote"
        trigger.touch()
        run_as = RunAs.for_servers()
        if run_as.user is not None and run_as.group is not None:
            os.chown(trigger, run_as.user, run_as.group)
        self._proc.send_signal(signal.SIGUSR1)

    def promote(self) -> None:
        """Promote this standby to a primary (``pg_promote()``) and wait until it writes."""
        with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_promote(true, %s)", (int(_READY_TIMEOUT),)).fetchone()
        if not (row and row[0]):
            raise PgServerError(f"promotion did not finish:\n{log_tail(self.log_path)}")

    def in_recovery(self) -> bool:
        """Whether the server is a standby (``pg_is_in_recovery()``)."""
        with psycopg.connect(self.dsn(), connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_is_in_recovery()").fetchone()
        return bool(row and row[0])

    def wait_replayed(self, primary: PgServer, timeout: float = _READY_TIMEOUT) -> None:
        """Wait until this standby has replayed everything ``primary`` had written so far."""
        with psycopg.connect(primary.dsn(), connect_timeout=5) as conn:
            row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
        assert row is not None
        target = row[0]
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.dsn(), autocommit=True, connect_timeout=5) as conn:
            while True:
                done = conn.execute(
                    "SELECT pg_last_wal_replay_lsn() >= %s::pg_lsn", (target,)
                ).fetchone()
                if done and done[0]:
                    return
                if time.monotonic() > deadline:
                    raise PgServerError(f"standby did not replay up to {target} in {timeout}s")
                time.sleep(0.02)  # no server-side wait for replay exists before PostgreSQL 17

    def kill(self) -> None:
        """Crash: SIGKILL the postmaster and its children, as an OOM kill or power cut would.

        Clients see their connections closed without a goodbye ("server closed the connection
        unexpectedly"). start_again() then runs crash recovery; committed data survives.
        """
        if not self.running:
            return
        assert self._proc is not None
        pid = self._proc.pid
        # Freeze the postmaster first so that it cannot fork while we collect its children;
        # the children are killed too, because each is its own session leader (killpg
        # would miss them) and orphans holding shared memory would block a restart.
        os.kill(pid, signal.SIGSTOP)
        try:
            children = [(child, open_pidfd(child)) for child in children_of(pid)]
        finally:
            os.kill(pid, signal.SIGKILL)  # never leave it frozen
        for child, _ in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        self._proc.wait(timeout=_STOP_TIMEOUT)
        # Every pidfd gets waited on (and closed) before any complaint.
        survivors = [child for child, pidfd in children if not wait_gone(child, pidfd, 10)]
        if survivors:
            raise PgServerError(f"postgres children {survivors} survived SIGKILL")
        # Stale lock files would point at a pid that may be reused by now.
        for stale in (
            self.data_dir / "postmaster.pid",
            self.socket_dir / f".s.PGSQL.{self.port}.lock",
            self.socket_dir / f".s.PGSQL.{self.port}",
        ):
            stale.unlink(missing_ok=True)

    def _release(self) -> None:
        """Stop the server (or kill it) and remove its directory."""
        try:
            self.stop("immediate")
        except PgServerError:
            self.kill()
        finally:
            if self.base_dir is not None:
                shutil.rmtree(self.base_dir, ignore_errors=True)

    def __repr__(self) -> str:
        state = "running" if self.running else "stopped"
        return f"<PgServer {self.host}:{self.port} {state} in {self.base_dir}>"


class _PortTakenError(Exception):
    """The server could not bind its port: pick another one."""
