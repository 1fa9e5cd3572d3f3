"""A primary with a streaming standby behind a proxy, and a failover from one to the other."""

from __future__ import annotations

import sys
import time

from psycopg.conninfo import make_conninfo

from .managed import Managed
from .pgserver import PgServer
from .proxy import TcpProxy


class FailoverPair(Managed):
    """Two private servers: a primary, and a hot standby streaming from it asynchronously.

    The standby streams through a TcpProxy, so hold_back_replication() can keep the latest
    commits from it, as a lagging standby would. dsn() names both hosts with
    ``target_session_attrs=read-write``, so clients follow the primary through a failover.
    """

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        self.settings = dict(settings or {})
        self.primary = PgServer.start(self.settings)
        self.replication: TcpProxy | None = None
        self.standby: PgServer | None = None
        self._started(self._start_standby)
        assert self.standby is not None
        self._ports: tuple[int, int] = (self.primary.port, self.standby.port)

    def _start_standby(self) -> None:
        self.replication = TcpProxy(self.primary.host, self.primary.port).start()
        self.standby = PgServer.start_standby(
            self.primary, self.settings, upstream=self.replication.dsn_for(self.primary.dsn())
        )

    def dsn(self, dbname: str = "postgres") -> str:
        """Both hosts, the writable one wins: what a client configures for failover."""
        return make_conninfo(
            "",
            host=f"{PgServer.host},{PgServer.host}",
            port=",".join(str(port) for port in self._ports),
            user=PgServer.user,
            dbname=dbname,
            target_session_attrs="read-write",
            connect_timeout="5",
        )

    def wait_replayed(self) -> None:
        """Wait until the standby has replayed everything the primary has written so far."""
        assert self.standby is not None
        self.standby.wait_replayed(self.primary)

    def hold_back_replication(self) -> None:
        """From now on the primary's commits stay on the primary (the standby lags)."""
        assert self.replication is not None
        self.replication.blackhole()

    def fail_over(self) -> float:
        """Crash the primary, promote the standby; return time.monotonic() of the crash."""
        assert self.standby is not None
        crashed_at = time.monotonic()
        self.primary.kill()
        self.standby.promote()
        return crashed_at

    def _release(self) -> None:
        if self.replication is not None:
            self.replication.stop()
        if self.standby is not None:
            self.standby.cleanup()
        self.primary.cleanup()


#: A guarded child that measures an overlap instead of failing on one: it takes an exclusive
#: flock on argv[1], waiting for it if another child still holds it, then writes
#: "<pid> <seconds it waited> <time.monotonic() it began>" to argv[2] and runs for argv[3]
#: seconds. On SIGTERM it takes argv[4] seconds to exit (a slow shutdown). The kernel drops
#: the flock when a child dies, so the wait is how long the previous child ran on after this
#: one was started.
WINDOW_CHILD = """
import fcntl, os, signal, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
began = time.monotonic()
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    waited = 0.0
except BlockingIOError:
    fcntl.flock(fd, fcntl.LOCK_EX)
    waited = time.monotonic() - began
with open(sys.argv[2] + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {waited:.3f} {began:.3f}\\n")
os.rename(sys.argv[2] + ".tmp", sys.argv[2])
def stop(signum, frame):
    time.sleep(float(sys.argv[4]))
    os._exit(128 + signum)
signal.signal(signal.SIGTERM, stop)
time.sleep(float(sys.argv[3]))
"""


def window_child(
    lockfile: str, marker: str, seconds: float = 300, exit_delay: float = 0
) -> list[str]:
    """Argv of a WINDOW_CHILD."""
    return [sys.executable, "-c", WINDOW_CHILD, lockfile, marker, str(seconds), str(exit_delay)]
