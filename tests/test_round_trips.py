"""Sessions and statements per run and per skip, pinned: each one is a round trip far away."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING

import psycopg
import pytest

from harness import jobrun_cli
from harness.bench import run_by_hand
from harness.delay_proxy import DelayProxy
from harness.pgserver import PgServer
from harness.statement_log import LOG_SETTINGS, Calls, StatementLog

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

# Today's counts, from a private server's log: the sessions a command opens and the
# statements (messages) they send, history on, on a database where both modes have run
# (a session run looks for a lease on its key once jobrun.leases exists: one statement more
# than on a database that never saw lease mode). A host in another region pays a round trip
# for each statement and two or three for each session (TCP, then the SSL request or TLS,
# then start-up), so a change that adds one fails here.
# Lower a pin when an optimisation lands; never raise one without saying why in the commit.
# benchmarks/bench_latency.py turns these counts into wall time at a given round trip.
# A session run: the acquisition (settings, lock, lease lookup: one message), the history's
# start, its end with the unlock. A skip: the acquisition (with the holder), the skip row.
SESSION_RUN = Calls(sessions=1, statements=3)
SESSION_SKIP = Calls(sessions=1, statements=2)
# A lease run: the lease (one statement), the start; the end row with the lease's delete.
# Lease mode keeps one connection for the run (--lease-connection kept): the attempt, the
# history, the beats and the release all go over it (it was 2: one closed before the child
# started, one opened for the end row and the release).
LEASE_RUN = Calls(sessions=1, statements=3)
#: --lease-connection per-renewal: the attempt's connection is closed before the child starts
#: and the release opens its own (each renewal would open one more).
LEASE_RUN_PER_RENEWAL = Calls(sessions=2, statements=3)
LEASE_SKIP = Calls(sessions=1, statements=2)
# The run's options at a run's count: the token in the acquisition's message, the tails in
# the end row's, slot 0 taken as the key is; --once-per's second run skips with its row
# and the unlock in one message.
FENCE_RUN = Calls(sessions=1, statements=3)
KEEP_OUTPUT_FAILED = Calls(sessions=1, statements=3)
ONCE_PER_SECOND = Calls(sessions=1, statements=3)
SLOTS_RUN = Calls(sessions=1, statements=3)

# The subcommands, each over its one session (a key run once first, so that it is known).
STATUS = Calls(sessions=1, statements=1)
STATUS_KEY = Calls(sessions=1, statements=1)
#: Where lease mode never ran (no jobrun.leases): the same one message, which looks for the
#: table before reading it (it was 2: the message failed on the missing table, an ERROR in
#: the server's log, and was sent again without it).
STATUS_NO_LEASES = Calls(sessions=1, statements=1)
HISTORY_KEY = Calls(sessions=1, statements=1)
SHOW_KEY = Calls(sessions=1, statements=2)
STOP_NO_WAIT = Calls(sessions=1, statements=2)
PAUSE_KEY = Calls(sessions=1, statements=2)
RESUME_KEY = Calls(sessions=1, statements=1)

DBNAME = "round_trips"

# A heartbeat (session mode: a check; lease mode: a renewal over a session of its own) is a
# cost per second of a run, not per run: these keep it out of the count, even on a machine
# so loaded that running `true` takes longer than the default heartbeat. (StatementLog
# counts checks apart, and they are not pinned.)
SESSION_BEATS = ("--heartbeat", "1h")
LEASE_BEATS = ("--mode", "lease", "--ttl", "1h", "--heartbeat", "10m")


@pytest.fixture(scope="module")
def logged_server() -> Iterator[PgServer]:
    """A private server that logs every session and statement, with jobrun's schema made."""
    with PgServer.start(LOG_SETTINGS) as server:
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {DBNAME}")
        # The first run creates the schema; a warm lease run, the lease table.
        for mode in ("session", "lease"):
            warm = jobrun_cli.run("--mode", mode, "--key", "warm-up", "--", "true", dsn=dsn(server))
            assert warm.returncode == 0, warm.stderr
        yield server


@pytest.fixture
def log(logged_server: PgServer) -> Iterator[StatementLog]:
    with StatementLog(logged_server, DBNAME) as opened:
        yield opened


def dsn(server: PgServer) -> str:
    return server.dsn(DBNAME)


def counted(log: StatementLog, server: PgServer, *args: str, status: int) -> Calls:
    """Sessions and statements of ``jobrun ARGS`` (run to the end, with this exit status)."""
    log.mark()
    done = jobrun_cli.run(*args, dsn=dsn(server))
    assert done.returncode == status, done.stderr
    return log.calls()


def held(server: PgServer, tmp_path: Path, *args: str) -> subprocess.Popen[str]:
    """A jobrun holding the key (``args``) until it is sent SIGTERM; started when this returns."""
    marker = tmp_path / "holder.pid"
    holder = jobrun_cli.start(*args, "--", *jobrun_cli.holder_marker(marker), dsn=dsn(server))
    jobrun_cli.wait_for_file(marker, proc=holder)
    return holder


class TestSessionMode:
    """A session-mode run and skip send today's count of statements over one session."""

    def test_run(self, logged_server, log, key):
        """A run of true: one session, SESSION_RUN's statements."""
        calls = counted(log, logged_server, *SESSION_BEATS, "--key", key, "--", "true", status=0)
        assert calls == SESSION_RUN, calls.explain()

    def test_skip(self, logged_server, log, key, tmp_path):
        """A skip behind a running holder: one session, SESSION_SKIP's statements."""
        holder = held(logged_server, tmp_path, *SESSION_BEATS, "--key", key)
        try:
            calls = counted(log, logged_server, "--key", key, "--", "true", status=75)
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert calls == SESSION_SKIP, calls.explain()

    def test_skip_costs_no_more_than_the_floor(self, logged_server, key, tmp_path):
        """A skip, as a distant network sees it: no more round trips than the floor script.

        The floor (benchmarks/bench_latency.py's) connects, tries an advisory lock and
        unlocks it by hand. A skip connects, tries the lock (the holder named in the same
        message) and writes its row: a statement more on the skip's path, a Terminate that
        waits, or a second connection fails here. Both over the same proxy, with the same
        DSN: the handshake (TCP, the SSL request, start-up) costs both the same.
        """
        holder = held(logged_server, tmp_path, *SESSION_BEATS, "--key", key)
        try:
            with DelayProxy(logged_server.host, logged_server.port, 0.0).start() as proxy:
                proxied = proxy.dsn_for(dsn(logged_server))
                floor = subprocess.run(
                    [sys.executable, "-c", run_by_hand()],
                    env=jobrun_cli.environment(proxied),
                    capture_output=True, text=True, timeout=60, check=False,
                )  # fmt: skip
                assert floor.returncode == 0, floor.stderr
                floor_trips, floor_conns = proxy.round_trips, proxy.accepted
                skip = jobrun_cli.run("--key", key, "--", "true", dsn=proxied)
                assert skip.returncode == 75, skip.stderr
                assert '"skipped"' in skip.stderr  # its log line
                trips, conns = proxy.round_trips - floor_trips, proxy.accepted - floor_conns
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert (floor_conns, conns) == (1, 1)
        assert trips <= floor_trips, (trips, floor_trips)


class TestRunOptions:
    """--fence, --keep-output, --once-per and --slots stay at a run's count."""

    def test_fence(self, logged_server, log, key):
        """The token rides in the acquisition's message (the sequence made by a first run)."""
        ran(logged_server, f"{key}-first", "--fence")
        calls = counted(
            log, logged_server, *SESSION_BEATS, "--fence", "--key", key, "--", "true", status=0
        )
        assert calls == FENCE_RUN, calls.explain()

    def test_keep_output_of_a_failed_run(self, logged_server, log, key):
        """The tails ride in the end row's message: no session of their own."""
        calls = counted(
            log, logged_server, *SESSION_BEATS, "--keep-output", "1KiB", "--key", key,
            "--", "sh", "-c", "echo kept; exit 1", status=1,
        )  # fmt: skip
        assert calls == KEEP_OUTPUT_FAILED, calls.explain()
        shown = jobrun_cli.run("show", key, dsn=dsn(logged_server))
        assert "kept" in shown.stdout, shown.stderr

    def test_once_per_second_run(self, logged_server, log, key):
        """The second run of a window: acquisition, the start that finds the first, the skip."""
        ran(logged_server, key, "--once-per", "1d")
        calls = counted(
            log, logged_server, *SESSION_BEATS, "--once-per", "1d", "--key", key, "--", "true",
            status=75,
        )  # fmt: skip
        assert calls == ONCE_PER_SECOND, calls.explain()

    def test_slots(self, logged_server, log, key):
        """A free first slot costs what a key does."""
        calls = counted(
            log, logged_server, *SESSION_BEATS, "--slots", "3", "--key", key, "--", "true",
            status=0,
        )  # fmt: skip
        assert calls == SLOTS_RUN, calls.explain()


class TestLeaseMode:
    """A lease-mode run and skip send today's count of statements and sessions."""

    def test_run(self, logged_server, log, key):
        """A run of true: LEASE_RUN's sessions and statements (a beat is counted apart)."""
        calls = counted(log, logged_server, *LEASE_BEATS, "--key", key, "--", "true", status=0)
        assert calls == LEASE_RUN, calls.explain()

    def test_run_per_renewal(self, logged_server, log, key):
        """The same run with a connection per renewal: LEASE_RUN_PER_RENEWAL."""
        calls = counted(
            log, logged_server, *LEASE_BEATS, "--lease-connection", "per-renewal",
            "--key", key, "--", "true", status=0,
        )  # fmt: skip
        assert calls == LEASE_RUN_PER_RENEWAL, calls.explain()

    def test_skip(self, logged_server, log, key, tmp_path):
        """A skip behind a running lease holder: LEASE_SKIP's sessions and statements."""
        holder = held(logged_server, tmp_path, *LEASE_BEATS, "--key", key)
        try:
            calls = counted(log, logged_server, *LEASE_BEATS, "--key", key, "--", "true", status=75)
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert calls == LEASE_SKIP, calls.explain()


def ran(server: PgServer, key: str, *args: str) -> None:
    """One run of ``key`` (``args`` before ``--``, the job ``true``), so that it is recorded."""
    done = jobrun_cli.run(*SESSION_BEATS, *args, "--key", key, "--", "true", dsn=dsn(server))
    assert done.returncode == 0, done.stderr


class TestSubcommands:
    """Each subcommand an operator runs sends its pinned count of statements, in one session."""

    def test_status(self, logged_server, log, key):
        """``status``: every read in one message."""
        ran(logged_server, key)
        calls = counted(log, logged_server, "status", status=0)
        assert calls == STATUS, calls.explain()

    def test_status_where_lease_mode_never_ran(self, logged_server, log, key):
        """``status`` without jobrun.leases: the same one message, no retry without it."""
        name = f"session_only_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(logged_server.dsn(), autocommit=True) as conn:
            conn.execute(f"CREATE DATABASE {name}")
        only = logged_server.dsn(name)
        done = jobrun_cli.run(*SESSION_BEATS, "--key", key, "--", "true", dsn=only)
        assert done.returncode == 0, done.stderr
        log.mark()
        shown = jobrun_cli.run("status", "--wide", dsn=only)  # the key whole, however long
        assert shown.returncode == 0, shown.stderr
        assert key in shown.stdout
        calls = log.calls()
        assert calls == STATUS_NO_LEASES, calls.explain()

    def test_status_of_a_key(self, logged_server, log, key):
        """``status KEY``: every read in one message."""
        ran(logged_server, key)
        calls = counted(log, logged_server, "status", key, status=0)
        assert calls == STATUS_KEY, calls.explain()

    def test_history_of_a_key(self, logged_server, log, key):
        """``history KEY``: the read and its timeouts in one message."""
        ran(logged_server, key)
        calls = counted(log, logged_server, "history", key, status=0)
        assert calls == HISTORY_KEY, calls.explain()

    def test_show_of_a_key(self, logged_server, log, key):
        """``show KEY``: which run, then its kept output."""
        failed = jobrun_cli.run(
            *SESSION_BEATS, "--keep-output", "1KiB", "--key", key, "--", "false",
            dsn=dsn(logged_server),
        )  # fmt: skip
        assert failed.returncode == 1, failed.stderr
        calls = counted(log, logged_server, "show", key, status=0)
        assert calls == SHOW_KEY, calls.explain()

    def test_stop_without_waiting(self, logged_server, log, key, tmp_path):
        """``stop KEY --wait 0s``: the check and holder, then the label-checked request."""
        holder = held(logged_server, tmp_path, *SESSION_BEATS, "--key", key)
        try:
            calls = counted(log, logged_server, "stop", key, "--wait", "0s", status=3)
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert calls == STOP_NO_WAIT, calls.explain()

    def test_pause(self, logged_server, log, key):
        """``pause KEY``: the typo check, then the pause."""
        ran(logged_server, key)
        calls = counted(log, logged_server, "pause", key, status=0)
        assert calls == PAUSE_KEY, calls.explain()

    def test_resume(self, logged_server, log, key):
        """``resume KEY``: the typo check and the resume in one message."""
        ran(logged_server, key)
        done = jobrun_cli.run("pause", key, dsn=dsn(logged_server))
        assert done.returncode == 0, done.stderr
        calls = counted(log, logged_server, "resume", key, status=0)
        assert calls == RESUME_KEY, calls.explain()


#: The proxy's round trip in these tests: long enough to tell from no delay at all.
PROXY_RTT = 0.1


@pytest.fixture
def delayed(pg_address) -> Iterator[DelayProxy]:
    with DelayProxy(*pg_address, rtt=PROXY_RTT).start() as proxy:
        yield proxy


class TestDelayProxy:
    """The proxy bench_latency measures with delays and counts as a distant network would."""

    def test_counts_handshake_startup_and_each_query(self, delayed, dsn):
        """Connect (no SSL request), two queries, close: four round trips, one connection."""
        proxied = delayed.dsn_for(dsn) + " sslmode=disable gssencmode=disable"
        with psycopg.connect(proxied, autocommit=True) as conn:
            conn.execute("SELECT 1")
            conn.execute("SELECT 2")
        assert (delayed.accepted, delayed.round_trips) == (1, 4)

    def test_each_round_trip_takes_the_configured_time(self, delayed, dsn):
        """Connecting takes two round trips (TCP, then start-up), a query one more."""
        proxied = delayed.dsn_for(dsn) + " sslmode=disable gssencmode=disable"
        began = time.monotonic()
        with psycopg.connect(proxied, autocommit=True) as conn:
            connected = time.monotonic()
            conn.execute("SELECT 1")
            queried = time.monotonic()
        assert connected - began >= 2 * PROXY_RTT
        assert queried - connected >= PROXY_RTT
