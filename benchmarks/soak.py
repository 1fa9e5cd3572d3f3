"""Chaos soak: guarded runs of one key under injected faults, counting overlaps, orphans, exit 70.

Several workers start ``python -m jobrun`` of this checkout for one key, again and again,
with random options (session or lease mode, a --wait or none, --coalesce, --jitter and
--retries now and then, straight to the server or
through a TCP proxy that can reset and black-hole connections). Each run's child is an
overlap detector: it takes an exclusive, non-blocking ``flock`` on one file; a child that
cannot get it has found another run's child still running, and records an overlap. A share
of the children take a while to exit on SIGTERM (they trap it and sleep, less than
--kill-after), a few ignore it and are SIGKILLed.

Meanwhile a fault injector SIGKILLs, SIGTERMs and signals jobrun, freezes it (SIGSTOP, then
SIGCONT: jobrun only, never its child), terminates its backends (pg_terminate_backend),
restarts and crashes the server, resets and black-holes the proxied connections and, with
--failover, promotes a streaming standby (the DSN names both hosts) and rebuilds a new
standby from it.

Figures: runs, skips, exits by status, faults by kind, and the failures, which must all be
0 - overlaps outside the documented window, orphaned children (a child alive after its
jobrun died, beyond --kill-after + a margin), internal errors (exit 70), hung jobruns.

The documented window: a fault that frees the lock at the server at once (backend
terminated, a connection reset that reaches the server, server restart or crash, failover)
lets a new run start while the old child is
still shutting down, until jobrun has noticed (one heartbeat) and the child has exited
(at most --kill-after after its SIGTERM). An overlap counts as inside that window when such
a fault came before it, and the old child was gone within heartbeat + kill-after + slack of
the fault. Usage::

    .venv/bin/python benchmarks/soak.py --duration 20m [--failover] [--workers 6]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import datetime as dt
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import _path  # noqa: F401  (first: the root on sys.path, for harness/)
import psycopg
from psycopg.conninfo import make_conninfo

from harness import jobrun_cli
from harness.failover import FailoverPair, window_child
from harness.pgserver import PgServer
from harness.pgtools import server_version
from harness.proxy import TcpProxy

ROOT = Path(__file__).resolve().parent.parent

KEY = "soak"
#: Faults that free the lock at the server at once, while the old child may still run.
FREES_AT_SERVER = frozenset(
    {"terminate_backend", "proxy_reset", "server_restart", "server_crash", "failover"}
)
#: Exit status of a child that found another child holding the flock.
OVERLAP_EXIT = 3

CHILD = r"""
import fcntl, json, os, signal, sys, time

work, token, run_for, on_term = sys.argv[1], sys.argv[2], float(sys.argv[3]), sys.argv[4]
# "fail_first" (a run with --retries): the token's first attempt exits 1, the retry 0.
fail_first = sys.argv[5:] == ["fail_first"]

def record(kind, **fields):
    line = json.dumps({"kind": kind, "token": token, "t": time.time(), **fields}) + "\n"
    fd = os.open(os.path.join(work, "records.jsonl"), os.O_WRONLY | os.O_APPEND | os.O_CREAT)
    os.write(fd, line.encode())  # one small O_APPEND write: never interleaved
    os.close(fd)

with open(os.path.join(work, "pids", token), "w") as f:
    f.write(str(os.getpid()))
lock = os.open(os.path.join(work, "guarded.lock"), os.O_RDWR | os.O_CREAT)
try:
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    try:
        holder = json.loads(open(os.path.join(work, "holder")).read())
    except (OSError, ValueError):
        holder = {}
    record("overlap", holder=holder.get("token"), holder_pid=holder.get("pid"),
           run_id=os.environ.get("JOBRUN_RUN_ID"))
    sys.exit(3)
holder = os.open(os.path.join(work, "holder"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
os.write(holder, json.dumps({"token": token, "pid": os.getpid()}).encode())
os.close(holder)
record("start", pid=os.getpid())

def finish(signum=None, frame=None):
    if signum is not None:
        record("term")
        if on_term == "ignore":
            return  # SIGKILL will come after --kill-after
        time.sleep(float(on_term))  # a slow shutdown, shorter than --kill-after
    record("exit")
    failed = 0
    if fail_first and signum is None:
        os.makedirs(os.path.join(work, "failed"), exist_ok=True)
        try:
            os.close(os.open(os.path.join(work, "failed", token), os.O_CREAT | os.O_EXCL))
            failed = 1
        except FileExistsError:
            pass
    os._exit(failed if signum is None else 128 + signum)

for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):  # jobrun forwards all three
    signal.signal(signum, finish)
time.sleep(run_for)
finish()
"""


def duration(text: str) -> float:
    """``90``, ``30s``, ``20m`` or ``1h`` as seconds."""
    units = {"s": 1, "m": 60, "h": 3600}
    if text and text[-1] in units:
        return float(text[:-1]) * units[text[-1]]
    return float(text)


@dataclass
class Run:
    """One jobrun invocation."""

    token: str
    mode: str
    path: str
    wait: float
    started: float
    ended: float = 0.0
    status: int | None = None
    proc: subprocess.Popen[bytes] | None = None
    #: The drawn options beyond mode and --wait: --coalesce, --jitter, --retries.
    extras: tuple[str, ...] = ()


@dataclass
class Tally:
    """Everything the soak counts (guarded by ``lock``)."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    runs: list[Run] = field(default_factory=list)
    faults: collections.Counter[str] = field(default_factory=collections.Counter)
    fault_times: list[tuple[float, str]] = field(default_factory=list)
    orphans: list[dict[str, Any]] = field(default_factory=list)
    hung: list[str] = field(default_factory=list)
    fault_errors: collections.Counter[str] = field(default_factory=collections.Counter)

    def fault(self, kind: str, at: float | None = None) -> None:
        with self.lock:
            self.faults[kind] += 1
            self.fault_times.append((time.time() if at is None else at, kind))


class Cluster:
    """The primary (and with --failover a standby), with a proxy in front of each."""

    def __init__(self, *, failover: bool, settings: dict[str, str]) -> None:
        self.settings = settings
        self.primary = PgServer.start(settings)
        self.standby = PgServer.start_standby(self.primary, settings) if failover else None
        self.proxies = [TcpProxy(PgServer.host, self.primary.port).start()]
        if self.standby is not None:
            self.proxies.append(TcpProxy(PgServer.host, self.standby.port).start())
        # Failover swaps primary and standby; their ports (and so both DSNs) stay the same.

    def _dsn(self, ports: list[int]) -> str:
        if len(ports) == 1:
            return make_conninfo(
                "", host=PgServer.host, port=str(ports[0]), user="postgres", dbname="postgres"
            )
        return make_conninfo(
            "",
            host=",".join([PgServer.host] * len(ports)),
            port=",".join(str(p) for p in ports),
            user="postgres",
            dbname="postgres",
            target_session_attrs="read-write",
        )

    @property
    def direct_dsn(self) -> str:
        ports = [self.primary.port] + ([self.standby.port] if self.standby else [])
        return self._dsn(sorted(ports))

    @property
    def proxied_dsn(self) -> str:
        return self._dsn([p.port for p in self.proxies])

    def terminate_backends(self) -> int:
        with psycopg.connect(self.primary.dsn(), autocommit=True, connect_timeout=5) as conn:
            rows = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
                "WHERE application_name LIKE 'jobrun:%%' AND pid <> pg_backend_pid()"
            ).fetchall()
        return len(rows)

    def restart(self) -> None:
        self.primary.restart()

    def crash(self) -> None:
        self.primary.kill()
        self.primary.start_again()

    def promote(self) -> float:
        """Crash the primary, promote the standby, rebuild a standby; return the crash time."""
        old, new = self.primary, self.standby
        if new is None:
            raise RuntimeError("no standby to promote")
        at = time.time()
        old.kill()
        new.promote()
        self.primary, self.standby = new, None
        port = old.port
        old.cleanup()
        self.standby = PgServer.start_standby(new, self.settings, port=port)
        return at

    def close(self) -> None:
        for proxy in self.proxies:
            proxy.stop()
        for server in (self.primary, self.standby):
            if server is not None:
                server.cleanup()


class Soak:
    """Workers, a fault injector and an orphan checker around one cluster."""

    def __init__(self, args: argparse.Namespace, cluster: Cluster, work: Path) -> None:
        self.args = args
        self.cluster = cluster
        self.work = work
        self.rng = random.Random(args.seed)
        self.tally = Tally()
        self.stop = threading.Event()
        self.running: dict[str, Run] = {}
        self.frozen: set[int] = set()
        self.child = work / "child.py"
        self.child.write_text(CHILD)
        (work / "pids").mkdir()
        (work / "stderr").mkdir()
        self.to_check: list[tuple[float, Run]] = []
        self.check_lock = threading.Lock()
        self.blackholed_until = 0.0

    # --- the runs -------------------------------------------------------------------------

    def command(self, run: Run, rng: random.Random) -> list[str]:
        a = self.args
        run_for = f"{rng.uniform(0.2, a.max_run):.2f}"
        draw = rng.random()
        if draw < a.ignore_term:
            on_term = "ignore"
        elif draw < a.ignore_term + a.slow_term:
            on_term = f"{rng.uniform(0.1, 0.8 * a.kill_after):.2f}"
        else:
            on_term = "0"
        options = [
            "--key",
            KEY,
            "--mode",
            run.mode,
            "--wait",
            f"{run.wait:.2f}s",
            "--kill-after",
            f"{a.kill_after}s",
            "--connect-timeout",
            "5s",
        ]
        if run.mode == "lease":
            options += ["--ttl", f"{a.ttl}s"]
        options += self.watching(rng)
        child = [sys.executable, str(self.child), str(self.work), run.token, run_for, on_term]
        options += _extra_options(run.extras)
        if "retries" in run.extras:
            child.append("fail_first")
        return [sys.executable, "-m", "jobrun", *options, "--", *child]

    def watching(self, rng: random.Random) -> list[str]:
        """--warn-after (a bound, or auto) and --requires (the key itself) for a share of runs.

        Neither may change what the soak counts: a slow run is not stopped, and a run whose
        requirement is not met (the key's last run failed under a fault) skips with 75.
        """
        share = self.args.watch_share
        options: list[str] = []
        if rng.random() < share:
            bound = rng.choice(["auto", f"{rng.uniform(1.0, max(1.0, self.args.max_run)):.2f}s"])
            options += ["--warn-after", bound]
        if rng.random() < share / 2:
            options += ["--requires", KEY, "--requires-within", "1h"]
        return options

    def worker(self, seed: int) -> None:
        rng = random.Random(seed)
        while not self.stop.is_set():
            run = Run(
                token=uuid.uuid4().hex[:12],
                mode=rng.choice(["session", "lease"]),
                path=rng.choice(["direct", "proxy"]),
                # Two in three wait for the key: more of them get to run a child.
                wait=rng.choice([0.0, rng.uniform(0.5, 5.0), rng.uniform(0.5, 5.0)]),
                started=time.time(),
                # One in five of each: queued behind the holder, a delay before the lock, a
                # first attempt that fails and is retried under the same lock.
                extras=tuple(
                    name
                    for name in ("coalesce", "jitter", "jitter_random", "retries")
                    if rng.random() < 0.2
                ),
            )
            dsn = self.cluster.direct_dsn if run.path == "direct" else self.cluster.proxied_dsn
            env = {k: v for k, v in os.environ.items() if not k.startswith(("JOBRUN_", "PG"))}
            env |= {"JOBRUN_DSN": dsn, "JOBRUN_LOG_FORMAT": "json", "PYTHONPATH": str(ROOT)}
            stderr_path = self.work / "stderr" / run.token
            with stderr_path.open("wb") as stderr:
                proc = subprocess.Popen(
                    self.command(run, rng),
                    env=env,
                    cwd=ROOT,
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.DEVNULL,
                    stderr=stderr,
                )
            run.proc = proc
            with self.tally.lock:
                self.running[run.token] = run
            try:
                run.status = proc.wait(timeout=self.args.hang_after)
            except subprocess.TimeoutExpired:
                with self.tally.lock:
                    self.tally.hung.append(run.token)
                proc.kill()
                run.status = proc.wait()
            run.ended = time.time()
            with self.tally.lock:
                del self.running[run.token]
                self.tally.runs.append(run)
            if run.status in (0, 75, OVERLAP_EXIT):
                stderr_path.unlink()  # ordinary: keep only the telling ones
            with self.check_lock:
                self.to_check.append((time.monotonic() + self.args.kill_after + 2.0, run))

    # --- orphans --------------------------------------------------------------------------

    def orphan_checker(self) -> None:
        while not (self.stop.is_set() and not self.to_check and not self.running):
            time.sleep(0.5)
            now = time.monotonic()
            with self.check_lock:
                due = [r for deadline, r in self.to_check if deadline <= now]
                self.to_check = [(d, r) for d, r in self.to_check if d > now]
            if due:
                self.check(due)

    def check(self, runs: list[Run]) -> None:
        """A child (found by its token in /proc) still alive after its jobrun exited."""
        tokens = {r.token: r for r in runs}
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                cmdline = (entry / "cmdline").read_bytes().split(b"\0")
                state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if state in ("Z", "X") or str(self.child).encode() not in cmdline:
                continue
            for token, run in tokens.items():
                if token.encode() in cmdline:
                    with self.tally.lock:
                        self.tally.orphans.append(
                            {"token": token, "pid": int(entry.name), "status": run.status}
                        )
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(entry.name), signal.SIGKILL)

    # --- faults ---------------------------------------------------------------------------

    def victim(self) -> Run | None:
        with self.tally.lock:
            runs = [r for r in self.running.values() if r.proc and r.proc.poll() is None]
        return self.rng.choice(runs) if runs else None

    def signal_jobrun(self, kind: str, signum: int) -> bool:
        run = self.victim()
        if run is None or run.proc is None:
            return False
        with contextlib.suppress(ProcessLookupError):
            run.proc.send_signal(signum)
            self.tally.fault(kind)
            return True
        return False

    def freeze(self) -> bool:
        run = self.victim()
        if run is None or run.proc is None:
            return False
        pid = run.proc.pid
        try:
            os.kill(pid, signal.SIGSTOP)
        except ProcessLookupError:
            return False
        self.frozen.add(pid)
        self.tally.fault("freeze_jobrun")

        def thaw() -> None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
            self.frozen.discard(pid)

        timer = threading.Timer(self.rng.uniform(0.2, self.args.max_freeze), thaw)
        timer.daemon = True
        timer.start()
        return True

    def blackhole(self) -> bool:
        if time.monotonic() < self.blackholed_until:
            return False
        seconds = self.rng.uniform(1.0, self.args.max_blackhole)
        self.blackholed_until = time.monotonic() + seconds
        proxies = self.cluster.proxies
        for proxy in proxies:
            proxy.blackhole()
        self.tally.fault("proxy_blackhole")

        def restore() -> None:
            for proxy in proxies:
                with contextlib.suppress(RuntimeError):
                    proxy.restore()

        timer = threading.Timer(seconds, restore)
        timer.daemon = True
        timer.start()
        return True

    def proxy_reset(self) -> bool:
        if time.monotonic() < self.blackholed_until:
            return False  # a reset would end the black hole early
        at = time.time()
        if sum(proxy.drop_all() for proxy in self.cluster.proxies):
            self.tally.fault("proxy_reset", at)
            return True
        return False

    def terminate_backends(self) -> bool:
        at = time.time()
        if self.cluster.terminate_backends():
            self.tally.fault("terminate_backend", at)
            return True
        return False

    def server(self, kind: str) -> bool:
        at = time.time()
        {"server_restart": self.cluster.restart, "server_crash": self.cluster.crash}[kind]()
        self.tally.fault(kind, at)
        return True

    def fail_over(self) -> bool:
        self.tally.fault("failover", self.cluster.promote())
        return True

    def inject(self, kind: str) -> bool:
        """Inject one fault of ``kind``; False when it found nothing to hit."""
        signals = {
            "sigkill_jobrun": signal.SIGKILL,
            "sigterm_jobrun": signal.SIGTERM,
            "sigint_jobrun": signal.SIGINT,
            "sighup_jobrun": signal.SIGHUP,
        }
        if kind in signals:
            return self.signal_jobrun(kind, signals[kind])
        if kind in ("server_restart", "server_crash"):
            return self.server(kind)
        actions = {
            "freeze_jobrun": self.freeze,
            "proxy_reset": self.proxy_reset,
            "proxy_blackhole": self.blackhole,
            "terminate_backend": self.terminate_backends,
            "failover": self.fail_over,
        }
        return actions[kind]()

    def injector(self) -> None:
        weights = {
            "sigkill_jobrun": 10,
            "sigterm_jobrun": 6,
            "sigint_jobrun": 3,
            "sighup_jobrun": 3,
            "freeze_jobrun": 8,
            "terminate_backend": 10,
            "proxy_reset": 8,
            "proxy_blackhole": 3,
            "server_restart": 2,
            "server_crash": 2,
        }
        if self.args.failover:
            weights["failover"] = 2
        kinds, w = list(weights), list(weights.values())
        while not self.stop.wait(self.rng.expovariate(1.0 / self.args.fault_interval)):
            kind = self.rng.choices(kinds, w)[0]
            try:
                self.inject(kind)
            except Exception as exc:  # noqa: BLE001 - a failed injection is counted, not fatal
                with self.tally.lock:
                    self.tally.fault_errors[f"{kind}: {type(exc).__name__}: {exc}"[:200]] += 1

    # --- the whole soak -------------------------------------------------------------------

    def run(self) -> None:
        threads = [
            threading.Thread(target=self.worker, args=(self.args.seed * 1000 + i,), daemon=True)
            for i in range(self.args.workers)
        ]
        threads.append(threading.Thread(target=self.injector, daemon=True))
        checker = threading.Thread(target=self.orphan_checker, daemon=True)
        for thread in [*threads, checker]:
            thread.start()
        deadline = time.monotonic() + self.args.duration
        try:
            while time.monotonic() < deadline:
                time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
                if self.args.progress:
                    self.progress()
        finally:
            self.stop.set()
            for thread in threads:
                thread.join()
            for pid in list(self.frozen):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            for proxy in self.cluster.proxies:
                with contextlib.suppress(RuntimeError):
                    proxy.restore()
            checker.join()

    def progress(self) -> None:
        with self.tally.lock:
            runs, faults = len(self.tally.runs), sum(self.tally.faults.values())
        print(f"  runs {runs}, faults {faults}", file=sys.stderr, flush=True)


def records(work: Path) -> list[dict[str, Any]]:
    path = work / "records.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _extra_options(extras: tuple[str, ...]) -> list[str]:
    """The command-line options of a run's drawn extras."""
    options = []
    if "coalesce" in extras:
        options += ["--coalesce"]
    if "jitter" in extras or "jitter_random" in extras:
        options += ["--jitter", "1s"] + (["--jitter-random"] if "jitter_random" in extras else [])
    if "retries" in extras:
        options += ["--retries", "2", "--retry-delay", "100ms"]
    return options


def report(soak: Soak, wall: float) -> dict[str, Any]:
    """The figures; ``failures`` must all be 0."""
    a, tally = soak.args, soak.tally
    recs = records(soak.work)
    runs = {r.token: r for r in tally.runs}
    started = {r["token"] for r in recs if r["kind"] == "start"}
    exited = {r["token"]: r["t"] for r in recs if r["kind"] == "exit"}

    def child_end(token: str) -> float | None:
        # The child's own last word, else its jobrun's exit: jobrun exits only after the
        # child's process group is gone, and a SIGKILLed jobrun takes its child with it
        # (parent-death signal). Either way an upper bound.
        if token in exited:
            return exited[token]
        run = runs.get(token)
        return run.ended if run and run.ended else None

    (soak.work / "faults.json").write_text(json.dumps(sorted(tally.fault_times)))
    slack = 3.0  # scheduling on a loaded host, the time to read /proc, clock reads
    window = a.heartbeat + a.kill_after + slack
    inside, outside = [], []
    for rec in (r for r in recs if r["kind"] == "overlap"):
        holder = rec.get("holder")
        end = child_end(holder) if holder else None
        holder_run = runs.get(holder) if holder else None
        frees = [
            (t, kind) for t, kind in tally.fault_times if kind in FREES_AT_SERVER and t <= rec["t"]
        ]
        fault = max(frees, default=None)
        entry = {
            "at": rec["t"],
            "holder": holder,
            "holder_mode": holder_run.mode if holder_run else None,
            "newcomer": rec["token"],
            "newcomer_mode": runs[rec["token"]].mode if rec["token"] in runs else None,
            "fault": fault[1] if fault else None,
            "after_fault": round(rec["t"] - fault[0], 3) if fault else None,
            "old_child_ran_on": round(end - rec["t"], 3) if end is not None else None,
            "old_child_gone_after_fault": round(end - fault[0], 3) if fault and end else None,
        }
        if fault and end is not None and end <= fault[0] + window:
            inside.append(entry)
        else:
            outside.append(entry)

    statuses = collections.Counter(
        "hung" if r.token in tally.hung else str(r.status) for r in tally.runs
    )
    guarded = len(started)
    return {
        "command": " ".join(sys.argv),
        "machine": machine(),
        "wall_seconds": round(wall, 1),
        "runs": len(tally.runs),
        "guarded_runs": guarded,
        "skips": statuses.get("75", 0),
        "exits_by_status": dict(sorted(statuses.items())),
        "runs_by_mode_and_path": dict(
            collections.Counter(f"{r.mode}/{r.path}" for r in tally.runs)
        ),
        "runs_by_option": dict(
            sorted(collections.Counter(name for r in tally.runs for name in r.extras).items())
        ),
        # Children started again by --retries (their token's second start or later).
        "retried_attempts": sum(
            collections.Counter(r["token"] for r in recs if r["kind"] == "start").values()
        )
        - guarded,
        "faults": sum(tally.faults.values()),
        "faults_by_kind": dict(sorted(tally.faults.items())),
        "fault_injection_errors": dict(tally.fault_errors),
        "window_seconds": window,
        "overlaps_inside_window": len(inside),
        "overlaps_inside_window_by_fault": dict(collections.Counter(e["fault"] for e in inside)),
        "old_child_ran_on_max_by_fault_and_mode": _max_by(inside),
        "overlaps_inside_window_detail": inside[:50],
        "failures": {
            "overlaps_outside_window": len(outside),
            "orphaned_children": len(tally.orphans),
            "internal_errors_exit_70": statuses.get("70", 0),
            "hung_jobruns": len(tally.hung),
        },
        "overlaps_outside_window_detail": outside[:50],
        "orphans_detail": tally.orphans[:50],
        "work_dir (records.jsonl, faults.json, stderr/)": str(soak.work),
    }


def _max_by(entries: list[dict[str, Any]]) -> dict[str, float]:
    out: dict[str, float] = {}
    for e in entries:
        name = f"{e['fault']}/{e['holder_mode']}"
        if e["old_child_ran_on"] is not None:
            out[name] = max(out.get(name, 0.0), e["old_child_ran_on"])
    return out


def machine() -> str:
    cpu = "?"
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    load = os.getloadavg()
    return (
        f"{os.cpu_count()} CPUs ({cpu}), load average at the end {load[0]:.1f}/{load[1]:.1f}/"
        f"{load[2]:.1f}, Python {sys.version.split()[0]}, {server_version()}"
    )


def failover_window(args: argparse.Namespace) -> dict[str, Any]:
    """How long the old holder's child runs on after a new holder started, per mode.

    Each round: a primary and its asynchronous standby; a run holds the key, its child
    slow to exit on SIGTERM (--slow-exit); for lease mode, replication is held back first, so
    the lease is written on the primary only (a lagging standby). Then the primary crashes,
    the standby is promoted and a new run (--wait) starts at once: its child waits for the
    old child's flock, and that wait is the overlap.
    """
    rng = random.Random(args.seed)
    env = {"PYTHONPATH": str(ROOT)}
    figures: dict[str, Any] = {}
    for mode in ("session", "lease"):
        rounds = []
        for round_ in range(args.failover_window):
            rounds.append(failover_round(args, mode, rng, env))
            print(f"  {mode} round {round_ + 1}: {rounds[-1]}", file=sys.stderr, flush=True)
        gone = sorted(r["old_child_gone_after_crash"] for r in rounds)
        figures[mode] = {
            "old_jobrun_exits": dict(collections.Counter(str(r["old_exit"]) for r in rounds)),
            "old_child_gone_after_crash_s": {"max": gone[-1], "median": gone[len(gone) // 2]},
            "new_child_started_after_crash_s_min": min(r["new_child_started"] for r in rounds),
            "overlap_s_max": max(r["overlap"] for r in rounds),
            "rounds": rounds,
        }
    return {
        "command": " ".join(sys.argv),
        "machine": machine(),
        "kill_after": args.kill_after,
        "slow_exit": args.slow_exit,
        "ttl": args.ttl,
        **figures,
    }


def failover_round(
    args: argparse.Namespace, mode: str, rng: random.Random, env: dict[str, str]
) -> dict[str, Any]:
    """One failover under a holder of ``mode``; times in seconds after the crash."""
    work = Path(tempfile.mkdtemp(prefix="jobrun-failover-"))
    with FailoverPair() as pair:
        for warm_mode in ("session", "lease"):
            warm = jobrun_cli.run(
                "--key", "warm-up", "--mode", warm_mode, "--", "true", dsn=pair.dsn(), env=env
            )
            if warm.returncode != 0:
                raise RuntimeError(warm.stderr)
        pair.wait_replayed()
        if mode == "lease":
            pair.hold_back_replication()
        common = ("--key", KEY, "--mode", mode, "--kill-after", f"{args.kill_after}s")
        if mode == "lease":
            common += ("--ttl", f"{args.ttl}s")
        lock = str(work / "exclusive")
        old_argv = window_child(lock, str(work / "old"), exit_delay=args.slow_exit)
        old = jobrun_cli.start(*common, "--", *old_argv, dsn=pair.dsn(), env=env)
        jobrun_cli.wait_for_file(work / "old", timeout=120)
        time.sleep(rng.uniform(0, args.heartbeat))  # crash at a random phase of the heartbeat
        crashed_wall = time.time()
        crashed = pair.fail_over()
        promoted = time.monotonic() - crashed
        new_argv = window_child(lock, str(work / "new"))
        new = jobrun_cli.start(*common, "--wait", "120s", "--", *new_argv, dsn=pair.dsn(), env=env)
        _, waited, began = jobrun_cli.wait_for_file(work / "new", timeout=180).split()
        _, old_stderr = old.communicate(timeout=120)
        new.send_signal(signal.SIGTERM)
        new.communicate(timeout=120)
    finished = jobrun_cli.event(old_stderr, "finished")["timestamp"]
    old_end = dt.datetime.fromisoformat(str(finished).replace("Z", "+00:00")).timestamp()
    return {
        "old_exit": old.returncode,
        "promoted": round(promoted, 3),
        "old_child_gone_after_crash": round(old_end - crashed_wall, 3),
        "new_child_started": round(float(began) - crashed, 3),
        "overlap": float(waited),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--duration", type=duration, default=60.0, help="e.g. 30s, 20m, 1h")
    parser.add_argument("--workers", type=int, default=6)
    parser.add_argument("--fault-interval", type=duration, default=0.8, help="mean seconds")
    parser.add_argument("--failover", action="store_true", help="a standby promoted now and then")
    parser.add_argument("--kill-after", type=float, default=2.0, help="seconds")
    parser.add_argument("--ttl", type=float, default=8.0, help="lease mode, seconds")
    parser.add_argument("--heartbeat", type=float, default=1.0, help="jobrun's session default")
    parser.add_argument("--max-run", type=float, default=1.5, help="longest child run, seconds")
    parser.add_argument("--slow-term", type=float, default=0.3, help="share of slow SIGTERM exits")
    parser.add_argument("--ignore-term", type=float, default=0.05, help="share ignoring SIGTERM")
    parser.add_argument("--max-freeze", type=float, default=2.0, help="seconds")
    parser.add_argument("--max-blackhole", type=float, default=6.0, help="seconds")
    parser.add_argument("--hang-after", type=float, default=180.0, help="a jobrun this slow hangs")
    parser.add_argument(
        "--watch-share",
        type=float,
        default=0.25,
        help="share of runs with --warn-after (half as many with --requires KEY)",
    )
    parser.add_argument("--seed", type=int, default=int(time.time()))
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--progress", action="store_true", help="a line every 5 s on stderr")
    parser.add_argument(
        "--work-dir",
        type=Path,
        help="a new or empty directory for the records, faults and stderr (default: a new "
        "temp dir, kept and named in the report)",
    )
    parser.add_argument(
        "--failover-window",
        type=int,
        metavar="ROUNDS",
        help="instead of the soak: measure the failover overlap, ROUNDS per mode",
    )
    parser.add_argument("--slow-exit", type=float, default=1.0, help="failover-window, seconds")
    args = parser.parse_args()
    if args.work_dir is not None and args.work_dir.exists() and any(args.work_dir.iterdir()):
        parser.error(f"--work-dir {args.work_dir} is not empty (an earlier soak's?)")
    if args.failover_window:
        figures = failover_window(args)
        print(json.dumps(figures, indent=2))
        if args.json:
            args.json.write_text(json.dumps(figures, indent=2) + "\n")
        return 0

    # An ignored signal stays ignored across exec: under nohup (SIGHUP) or as a shell's
    # background job (SIGINT, SIGQUIT) every jobrun would start with the injector's signal
    # ignored, and the soak would test something no cron or terminal does. Say so.
    ignored = [
        signal.Signals(signum).name
        for signum in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)
        if signal.getsignal(signum) == signal.SIG_IGN
    ]
    if ignored:
        print(
            f"warning: {', '.join(ignored)} ignored in this process (nohup? a background job?):"
            " the jobruns inherit that; run the soak in the foreground (tmux or screen if long)",
            file=sys.stderr,
        )
    work = args.work_dir or Path(tempfile.mkdtemp(prefix="jobrun-soak-"))
    work.mkdir(parents=True, exist_ok=True)
    began = time.monotonic()
    cluster = Cluster(failover=args.failover, settings={"max_connections": "200"})
    try:
        soak = Soak(args, cluster, work)
        soak.run()
    finally:
        cluster.close()
    figures = report(soak, time.monotonic() - began)
    text = json.dumps(figures, indent=2)
    print(text)
    if args.json:
        args.json.write_text(text + "\n")
    print(verdict(figures))
    return 1 if any(figures["failures"].values()) else 0


#: What one soak must show to count as evidence (the promises, and enough of everything).
MIN_FAULTS = 1000
MIN_GUARDED_RUNS = 2000


def verdict(figures: dict[str, Any]) -> str:
    """One line: each target with its figure, and whether all were met."""
    failures = figures["failures"]
    checks = [
        (f"{figures['faults']} faults (>= {MIN_FAULTS})", figures["faults"] >= MIN_FAULTS),
        (
            f"{figures['guarded_runs']} guarded runs (>= {MIN_GUARDED_RUNS})",
            figures["guarded_runs"] >= MIN_GUARDED_RUNS,
        ),
        *(
            (f"{count} {name.replace('_', ' ')} (0)", count == 0)
            for name, count in failures.items()
        ),
    ]
    met = all(ok for _, ok in checks)
    shown = "; ".join(f"{text}: {'met' if ok else 'MISSED'}" for text, ok in checks)
    return f"targets {'MET' if met else 'MISSED'}: {shown}"


if __name__ == "__main__":
    sys.exit(main())
