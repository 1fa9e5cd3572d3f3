"""How fast a lost lock stops the child, and what a lease costs: figures, not a test.

  (a) session mode: pg_terminate_backend of the lock session -> SIGTERM reaches the child
      (target <= 2 s)
  (b) session mode: the network path black-holed (a TCP proxy that stops forwarding but
      keeps the sockets open, like a cut cable) -> SIGTERM reaches the child (target <= 15 s)
  (c) lease mode: acquire and renew latency (one short connection each), median and p90

Times are taken on CLOCK_MONOTONIC, which every process on the host shares: the child
writes the instant its SIGTERM handler runs. Usage::

    .venv/bin/python benchmarks/bench_detection.py [--runs 5] [--dsn DSN]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import _path  # noqa: F401  (first: the root on sys.path, for harness/)
import psycopg
import structlog

from harness.proxy import TcpProxy
from jobrun import db, keys
from jobrun.db.server_session import ServerSession
from jobrun.locks import Holder, Identity
from jobrun.locks.lease import LeaseLock

ROOT = Path(__file__).resolve().parent.parent

CHILD = """
import signal, sys, time
def stop(signum, frame):
    open(sys.argv[1], "w").write(repr(time.monotonic()))
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
open(sys.argv[2], "w").write("ready")
while True:
    time.sleep(1)
"""


def _wait_for(path: Path, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() or not path.read_text():
        if time.monotonic() > deadline:
            msg = f"{path} never appeared"
            raise RuntimeError(msg)
        time.sleep(0.01)


def _start(dsn: str, key: str, tmp: Path) -> tuple[subprocess.Popen[bytes], Path]:
    stopped, ready = tmp / f"{key}.stopped", tmp / f"{key}.ready"
    env = {**os.environ, "JOBRUN_DSN": dsn, "JOBRUN_LOG_FORMAT": "json"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jobrun", "--key", key, "--kill-after", "5s", "--",
         sys.executable, "-c", CHILD, str(stopped), str(ready)],
        env=env, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _wait_for(ready)
    return proc, stopped


def terminate_backend(dsn: str, tmp: Path) -> float:
    """Seconds from pg_terminate_backend to the child's SIGTERM."""
    key = f"bench-term-{uuid.uuid4().hex[:8]}"
    proc, stopped = _start(dsn, key, tmp)
    classid, objid = keys.from_name(key).pg_locks_pair
    with psycopg.connect(dsn, autocommit=True) as conn:
        (pid,) = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = %s::int8::oid AND objid = %s::int8::oid",
            (classid, objid),
        ).fetchone() or (None,)
        began = time.monotonic()
        conn.execute("SELECT pg_terminate_backend(%s)", (pid,))
    _wait_for(stopped)
    proc.wait(timeout=60)
    return float(stopped.read_text()) - began


def blackhole(dsn: str, tmp: Path) -> float:
    """Seconds from black-holing the network path to the child's SIGTERM."""
    host, port = _address(dsn)
    with TcpProxy(host, port).start() as proxy:
        key = f"bench-cut-{uuid.uuid4().hex[:8]}"
        proc, stopped = _start(proxy.dsn_for(dsn), key, tmp)
        began = time.monotonic()
        proxy.blackhole()
        _wait_for(stopped, timeout=120)
        proc.wait(timeout=60)
        proxy.drop_all()
    return float(stopped.read_text()) - began


def lease_latency(dsn: str, runs: int) -> tuple[list[float], list[float]]:
    """Seconds per lease acquire and per renewal."""
    log = structlog.get_logger()
    target = db.Target(dsn=dsn)
    acquire, renew = [], []
    for _ in range(runs):
        key = keys.from_name(f"bench-lease-{uuid.uuid4().hex[:8]}")
        lock = LeaseLock(
            (key,), ServerSession(target, app_name="jobrun:bench", held=False, lends=False),
            Identity(run_id=str(uuid.uuid4()), pid=os.getpid()), log,
            ttl=30, lifetime=17, heartbeat=1.0,
        )  # fmt: skip
        t = time.perf_counter()
        held = isinstance(lock.acquire(0), Holder)
        if held:
            msg = "a fresh lease key was held"
            raise RuntimeError(msg)
        acquire.append(time.perf_counter() - t)
        t = time.perf_counter()
        lock.check()
        renew.append(time.perf_counter() - t)
        lock.release()
    return acquire, renew


def _address(dsn: str) -> tuple[str, int]:
    with psycopg.connect(dsn) as conn:
        return conn.info.host, int(conn.info.port)


def _row(name: str, values: list[float], target: float | None) -> str:
    median = statistics.median(values)
    worst = max(values)
    verdict = "" if target is None else ("PASS" if worst <= target else "MISS")
    goal = "" if target is None else f"<= {target:g} s"
    return f"{name:<46} {median * 1000:9.1f} {worst * 1000:9.1f}  {goal:<9} {verdict}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument(
        "--dsn", default=os.environ.get("JOBRUN_DSN", "host=127.0.0.1 user=postgres dbname=test")
    )
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        term = [terminate_backend(args.dsn, tmp) for _ in range(args.runs)]
        cut = [blackhole(args.dsn, tmp) for _ in range(max(1, args.runs // 2))]
    acquire, renew = lease_latency(args.dsn, args.runs * 10)
    print(f"{'measure':<46} {'median ms':>9} {'max ms':>9}  {'target':<9}")
    print(_row("(a) terminate backend -> child SIGTERM", term, 2.0))
    print(_row("(b) black-holed network -> child SIGTERM", cut, 15.0))
    print(_row("(c) lease acquire (connect + insert)", acquire, None))
    print(_row("(c) lease renew (connect + update)", renew, None))


if __name__ == "__main__":
    main()
