"""The chaos soak: a 30-second run has no failure, and the bugs it found, reproduced alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import psycopg
import pytest
import structlog

from jobrun import db, keys, sql
from jobrun.db.server_session import ServerSession
from jobrun.exitcodes import LockStoreUnavailable
from jobrun.locks import Identity, Taken, new_run_id
from jobrun.locks.lease import LeaseLock

ROOT = Path(__file__).resolve().parent.parent
SOAK = ROOT / "benchmarks" / "soak.py"


@pytest.mark.fault
@pytest.mark.timeout(600)
@pytest.mark.pg  # starts servers of its own
def test_a_short_soak_has_no_overlap_orphan_or_internal_error(tmp_path):
    """Overlaps outside the documented window, orphans, exit 70 and hangs: all 0."""
    figures_path = tmp_path / "soak.json"
    soak = subprocess.run(
        [sys.executable, str(SOAK), "--duration", "30s", "--failover", "--workers", "4",
         "--fault-interval", "0.5", "--seed", "1", "--json", str(figures_path),
         "--work-dir", str(tmp_path / "work")],
        capture_output=True,
        text=True,
        timeout=540,
        check=False,
    )  # fmt: skip
    assert figures_path.exists(), soak.stderr
    figures = json.loads(figures_path.read_text())
    assert figures["failures"] == {
        "overlaps_outside_window": 0,
        "orphaned_children": 0,
        "internal_errors_exit_70": 0,
        "hung_jobruns": 0,
    }, json.dumps(figures, indent=2)
    assert soak.returncode == 0, soak.stderr
    assert figures["guarded_runs"] > 0
    assert figures["faults"] > 0
    assert figures["fault_injection_errors"] == {}


class DiesAfterAcquire(psycopg.Connection):  # type: ignore[type-arg]
    """A real connection whose backend is terminated right after the lease statement."""

    admin_dsn = ""

    def execute(self, query, params=None, **kwargs):  # type: ignore[no-untyped-def]
        cursor = super().execute(query, params, **kwargs)
        if query is sql.LEASE_ACQUIRE:
            with psycopg.connect(self.admin_dsn, autocommit=True) as admin:
                # Waits until the backend is gone: the ROLLBACK that follows must fail.
                admin.execute("SELECT pg_terminate_backend(%s, 30000)", (self.info.backend_pid,))
        return cursor


class TestFoundByTheSoak:
    """Bugs the soak found, each reproduced on its own."""

    def test_a_connection_lost_while_finding_the_key_taken_is_a_database_error(self, dsn, key):
        """The connection dies between the lease statement and its rollback: 69, never 70.

        psycopg lets its ``Rollback`` through when the ROLLBACK itself fails (it is not a
        ``psycopg.Error``): the database boundary must turn it into a lock-store error.
        Two keys: one key's lease is one statement, with no transaction to roll back.
        """
        target = db.Target(dsn=dsn)
        holder, latecomer = (
            LeaseLock(
                (keys.from_name(key), keys.from_name(f"{key}-b")),
                ServerSession(target, app_name="jobrun:test", held=False, lends=False),
                Identity(run_id=new_run_id(), pid=pid),
                structlog.get_logger(),
                ttl=60,
                lifetime=40,
                heartbeat=1.0,
            )
            for pid in (1, 2)
        )
        assert isinstance(holder.acquire(0), Taken)
        try:
            DiesAfterAcquire.admin_dsn = dsn
            with DiesAfterAcquire.connect(dsn, autocommit=True) as conn:  # noqa: SIM117
                with (
                    pytest.raises(LockStoreUnavailable),
                    db.translate_errors(target, "taking the lease"),
                ):
                    latecomer._insert(conn, ())  # noqa: SLF001 - the step that must fail cleanly
        finally:
            holder.release()
