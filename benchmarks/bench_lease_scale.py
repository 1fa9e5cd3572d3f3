"""Lease mode at scale: many concurrent leases on one PostgreSQL, renewed on schedule.

N lease holders (threads in one process, each renewing on its own short connection every
--heartbeat seconds, as N jobrun processes would) for --seconds. Prints renewal latency
(median, p99, max), renewals per second, how many server connections were open at the
peak, and whether any lease was ever lost. Figures, not a test::

    .venv/bin/python benchmarks/bench_lease_scale.py [--leases 1000] [--heartbeat 7.5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid

import psycopg
import structlog

from jobrun import db, keys
from jobrun.exitcodes import LockLost, LockStoreUnavailable
from jobrun.locks import Identity, new_run_id
from jobrun.locks.lease import LeaseLock
from jobrun.session import ServerSession


def holder(
    lock: LeaseLock, heartbeat: float, until: float, latencies: list[float], lost: list[str]
) -> None:
    """Renew every ``heartbeat`` seconds (first renewal at a random phase) until ``until``."""
    time.sleep(heartbeat * (uuid.uuid4().int % 1000) / 1000)
    while time.monotonic() < until:
        began = time.monotonic()
        try:
            lock.check()
        except (LockLost, LockStoreUnavailable) as exc:
            lost.append(str(exc))
        latencies.append(time.monotonic() - began)
        time.sleep(max(0.0, began + heartbeat - time.monotonic()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=1000)
    parser.add_argument("--heartbeat", type=float, default=7.5)
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument(
        "--dsn", default=os.environ.get("JOBRUN_DSN", "host=127.0.0.1 user=postgres dbname=test")
    )
    args = parser.parse_args()
    target = db.Target(dsn=args.dsn)
    log = structlog.get_logger()
    locks = []
    began = time.monotonic()
    for i in range(args.leases):
        key = keys.from_name(f"bench-scale-{i}-{uuid.uuid4().hex[:6]}")
        lock = LeaseLock(
            (key,), ServerSession(target, app_name="jobrun:bench", held=False, lends=False),
            Identity(run_id=new_run_id(), pid=os.getpid()), log,
            ttl=30, lifetime=17, heartbeat=1.0,
        )  # fmt: skip
        if lock.acquire(0) is not None:
            raise SystemExit(f"lease {i} was held by someone else")
        locks.append(lock)
    acquired = time.monotonic() - began
    latencies: list[float] = []
    lost: list[str] = []
    until = time.monotonic() + args.seconds
    threads = [
        threading.Thread(target=holder, args=(lock, args.heartbeat, until, latencies, lost))
        for lock in locks
    ]
    for thread in threads:
        thread.start()
    peak = 0
    with psycopg.connect(args.dsn, autocommit=True) as monitor:
        while time.monotonic() < until:
            row = monitor.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'jobrun:%'"
            ).fetchone()
            peak = max(peak, int(row[0]) if row else 0)
            time.sleep(0.2)
    for thread in threads:
        thread.join()
    for lock in locks:
        lock.release()
    ordered = sorted(latencies)
    print(f"{args.leases} leases, heartbeat {args.heartbeat}s, {args.seconds:g}s")
    print(f"  acquired all in {acquired:.1f}s ({acquired / args.leases * 1000:.1f} ms each)")
    print(f"  renewals: {len(latencies)} ({len(latencies) / args.seconds:.0f}/s)")
    print(
        f"  renewal latency: median {statistics.median(ordered) * 1000:.1f} ms, "
        f"p99 {ordered[int(len(ordered) * 0.99)] * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms"
    )
    print(f"  peak server connections held by leases: {peak} (of {args.leases} leases)")
    print(f"  leases lost or renewals failed: {len(lost)}")


if __name__ == "__main__":
    main()
