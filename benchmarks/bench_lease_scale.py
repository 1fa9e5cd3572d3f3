"""Lease mode at scale: many concurrent leases on one PostgreSQL, renewed on schedule.

N lease holders (threads in --processes processes, as N jobrun processes would) for
--seconds, in one of lease mode's two connection modes:

- ``--connection kept`` (a run's default): each holder keeps one connection, beats every
  second over it (the stop-request lookup, with the lease check or, every --heartbeat, the
  renewal), through a PgBouncer in transaction mode started here (``--pool-size`` server
  connections); ``--direct`` skips the pooler (one server connection per holder: past
  the server's max_connections the holders cannot all connect, which is the point).
- ``--connection per-renewal``: each holder connects for each renewal, every --heartbeat,
  straight to the server, and holds no connection in between.

Prints beat latency (median, p99, max), beats per second, how many server connections
were open at the peak (and client connections to the pooler), and whether any lease was
ever lost. Figures, not a test::

    .venv/bin/python benchmarks/bench_lease_scale.py [--leases 1000] [--heartbeat 7.5]
        [--connection kept|per-renewal] [--direct] [--pool-size 5]
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import statistics
import threading
import time
import uuid
from typing import TYPE_CHECKING, Any

import _path  # noqa: F401  (first: the root on sys.path, for harness/)
import psycopg
import structlog
from psycopg.conninfo import conninfo_to_dict

from harness.pgbouncer import PgBouncer
from jobrun import db, keys
from jobrun.db.server_session import ServerSession
from jobrun.exitcodes import LockLost, LockStoreUnavailable
from jobrun.locks import Holder, Identity, new_run_id
from jobrun.locks.lease import LeaseLock, beat

if TYPE_CHECKING:
    from multiprocessing.queues import Queue
    from multiprocessing.synchronize import Barrier

#: The lease's timing in the bench: what a run with --ttl 30s --kill-after 10s would have.
TTL, LIFETIME = 30.0, 17.0


def holder(
    lock: LeaseLock, interval: float, until: float, latencies: list[float], lost: list[str]
) -> None:
    """Beat every ``interval`` seconds (first beat at a random phase) until ``until``."""
    time.sleep(interval * (uuid.uuid4().int % 1000) / 1000)
    while time.monotonic() < until:
        began = time.monotonic()
        try:
            lock.check()
        except (LockLost, LockStoreUnavailable) as exc:
            lost.append(str(exc))
        latencies.append(time.monotonic() - began)
        time.sleep(max(0.0, began + interval - time.monotonic()))


def peak_connections(server_dsn: str, bouncer: PgBouncer | None, until: float) -> tuple[int, int]:
    """(server connections, client connections to the pooler) at their peak, until ``until``.

    Through the pooler the server connections are PgBouncer's (SHOW SERVERS); straight to
    the server, the sessions whose application_name is a run's.
    """
    peak_server = peak_clients = 0
    with contextlib.ExitStack() as stack:
        monitor = stack.enter_context(psycopg.connect(server_dsn, autocommit=True))
        admin = (
            stack.enter_context(psycopg.connect(bouncer.admin_dsn(), autocommit=True))
            if bouncer is not None
            else None
        )
        while time.monotonic() < until:
            if admin is not None:
                # The admin console speaks the simple query protocol only.
                servers = psycopg.ClientCursor(admin).execute("SHOW SERVERS").fetchall()
                clients = psycopg.ClientCursor(admin).execute("SHOW CLIENTS").fetchall()
                peak_server = max(peak_server, len(servers))
                peak_clients = max(peak_clients, len(clients) - 1)  # our console's own
            else:
                row = monitor.execute(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name LIKE 'jobrun:%'"
                ).fetchone()
                peak_server = max(peak_server, int(row[0]) if row else 0)
            time.sleep(0.2)
    return peak_server, peak_clients


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--leases", type=int, default=1000)
    parser.add_argument("--heartbeat", type=float, default=7.5, help="renewal interval")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--connection", choices=["kept", "per-renewal"], default="kept")
    parser.add_argument("--direct", action="store_true", help="kept, without the pooler")
    parser.add_argument("--pool-size", type=int, default=5)
    parser.add_argument(
        "--processes",
        type=int,
        default=os.cpu_count() or 1,
        help="holder processes (one process's interpreter lock would be the bottleneck)",
    )
    parser.add_argument(
        "--dsn", default=os.environ.get("JOBRUN_DSN", "host=127.0.0.1 user=postgres dbname=test")
    )
    args = parser.parse_args()
    kept = args.connection == "kept"
    bouncer = None
    dsn = args.dsn
    if kept and not args.direct:
        server = conninfo_to_dict(args.dsn)
        bouncer = PgBouncer(
            str(server.get("host", "127.0.0.1")),
            int(str(server.get("port", 5432))),
            default_pool_size=args.pool_size,
            users=[str(server.get("user", "postgres"))],
            settings={"max_client_conn": str(args.leases + 20)},
        ).start()
        dsn = bouncer.dsn_for(args.dsn)
    try:
        run(args, dsn, bouncer, kept=kept)
    finally:
        if bouncer is not None:
            bouncer.stop()


def holders(
    args: argparse.Namespace, dsn: str, count: int, *, kept: bool, go: Barrier, out: Queue[Any]
) -> None:
    """One process's ``count`` holders: acquire, beat from ``go`` for --seconds, release.

    Puts (seconds to acquire, beat latencies, failures) on ``out``.
    """
    target = db.Target(dsn=dsn)
    log = structlog.get_logger()
    interval = beat(args.heartbeat, kept=kept)
    locks, sessions = [], []
    began = time.monotonic()
    for i in range(count):
        key = keys.from_name(f"bench-scale-{i}-{uuid.uuid4().hex}")
        session = ServerSession(target, app_name="jobrun:bench", held=False, lends=kept, keeps=kept)
        lock = LeaseLock(
            (key,), session, Identity(run_id=new_run_id(), pid=os.getpid()), log,
            ttl=TTL, lifetime=LIFETIME, heartbeat=interval, renew_every=args.heartbeat,
        )  # fmt: skip
        if isinstance(lock.acquire(0), Holder):
            raise SystemExit(f"lease {i} was held by someone else")
        locks.append(lock)
        sessions.append(session)
    acquired = time.monotonic() - began
    latencies: list[float] = []
    lost: list[str] = []
    go.wait()  # every process has acquired its leases (well within their TTL)
    until = time.monotonic() + args.seconds
    threads = [
        threading.Thread(target=holder, args=(lock, interval, until, latencies, lost))
        for lock in locks
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for lock, session in zip(locks, sessions, strict=True):
        lock.release()
        session.close()
    out.put((acquired, latencies, lost))


def run(args: argparse.Namespace, dsn: str, bouncer: PgBouncer | None, *, kept: bool) -> None:
    """The holder processes, the monitor, the figures."""
    context = multiprocessing.get_context("fork")
    out: Queue[Any] = context.Queue()
    # Every process starts beating once all have acquired their leases.
    go = context.Barrier(args.processes + 1)
    shares = [args.leases // args.processes + (n < args.leases % args.processes)
              for n in range(args.processes)]  # fmt: skip
    procs = [
        context.Process(
            target=holders,
            args=(args, dsn, share),
            kwargs={"kept": kept, "go": go, "out": out},
        )
        for share in shares
    ]
    for proc in procs:
        proc.start()
    go.wait()
    peak, clients = peak_connections(args.dsn, bouncer, time.monotonic() + args.seconds)
    results = [out.get() for _ in procs]
    for proc in procs:
        proc.join()
    acquired = max(result[0] for result in results)
    latencies = [latency for result in results for latency in result[1]]
    lost = [failure for result in results for failure in result[2]]
    interval = beat(args.heartbeat, kept=kept)
    ordered = sorted(latencies)
    how = (
        f"kept, through PgBouncer (transaction mode, pool {args.pool_size})"
        if bouncer is not None
        else "kept, direct"
        if kept
        else "per renewal, direct"
    )
    print(
        f"{args.leases} leases in {args.processes} processes, {how}, "
        f"renewal every {args.heartbeat}s, {args.seconds:g}s (load {os.getloadavg()[0]:.1f})"
    )
    print(f"  acquired all in {acquired:.1f}s")
    print(
        f"  beats: {len(latencies)} ({len(latencies) / args.seconds:.0f}/s), "
        f"each lease's every {interval:g}s"
    )
    print(
        f"  beat latency: median {statistics.median(ordered) * 1000:.1f} ms, "
        f"p99 {ordered[int(len(ordered) * 0.99)] * 1000:.1f} ms, max {ordered[-1] * 1000:.1f} ms"
    )
    print(f"  peak server connections held by leases: {peak} (of {args.leases} leases)")
    if bouncer is not None:
        print(f"  peak client connections to the pooler: {clients}")
    print(f"  leases lost or beats failed: {len(lost)}")
    for failure in sorted(set(lost))[:3]:
        print(f"    e.g. {failure}")


if __name__ == "__main__":
    main()
