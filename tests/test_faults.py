"""The lock never lies: terminated backends, restarts, cut networks, poolers, crashed holders."""

from __future__ import annotations

import datetime as dt
import select
import signal
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
import structlog

from harness import jobrun_cli
from harness.jobrun_cli import event, wait_for_file, wait_until
from jobrun import db, keys
from jobrun.db.server_session import ServerSession
from jobrun.locks import Identity, Taken, new_run_id
from jobrun.locks.session import CONFIRMATION_LIFETIME, SessionLock
from support.history import rows_of

if TYPE_CHECKING:
    import subprocess

#: A child that proves mutual exclusion on its own: it takes an exclusive flock on a file
#: shared by every child of the test; a second child alive at the same time cannot, and
#: records the overlap. The kernel drops the flock the instant a child dies.
GUARDED_CHILD = """
import fcntl, os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
except BlockingIOError:
    with open(sys.argv[1] + ".overlap", "a") as f:
        f.write(os.environ["JOBRUN_RUN_ID"] + "\\n")
    sys.exit(99)
with open(sys.argv[2], "w") as f:
    f.write(str(os.getpid()) + "\\n")
time.sleep(float(sys.argv[3]))
"""


class Children:
    """Guarded children of one test that share a flock file."""

    def __init__(self, tmp_path: Path) -> None:
        self.lockfile = tmp_path / "exclusive"
        self.tmp_path = tmp_path
        self.count = 0

    def argv(self, seconds: float = 300) -> tuple[list[str], Path]:
        """argv for the next child, and the marker it writes once it runs."""
        self.count += 1
        marker = self.tmp_path / f"child-{self.count}"
        cmd = [sys.executable, "-c", GUARDED_CHILD, str(self.lockfile), str(marker), str(seconds)]
        return cmd, marker

    def overlaps(self) -> list[str]:
        """Run ids of children that found another child running."""
        path = Path(str(self.lockfile) + ".overlap")
        return path.read_text().splitlines() if path.exists() else []


@pytest.fixture
def children(tmp_path: Path) -> Children:
    return Children(tmp_path)


def backend_of(dsn: str, name: str) -> int:
    """The backend pid holding key ``name``."""
    classid, objid = keys.from_name(name).pg_locks_pair
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = %s::int8::oid AND objid = %s::int8::oid AND objsubid = 1",
            (classid, objid),
        ).fetchone()
    assert row is not None, "nobody holds the key"
    return int(row[0])


def lease_expiry(dsn: str, name: str) -> dt.datetime:
    """expires_at of the lease on key ``name``, on the database's clock."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT expires_at FROM jobrun.leases WHERE lock_id = %s", (keys.lock_id_for(name),)
        ).fetchone()
    assert row is not None
    return row[0]


def event_time(line: dict[str, object]) -> dt.datetime:
    """An event line's timestamp as an aware datetime."""
    return dt.datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00"))


def start_holder(children: Children, *args: str, dsn: str) -> tuple[object, int]:
    """A guarded long-running child under jobrun; wait until it runs; (process, child pid)."""
    argv, marker = children.argv()
    proc = jobrun_cli.start(*args, "--", *argv, dsn=dsn)
    return proc, int(wait_for_file(marker))


def start_waiting(tmp_path: Path, *args: str, dsn: str) -> tuple[subprocess.Popen[str], Path, Path]:
    """A run whose child waits for a file: (process, the file to create, the run's log file).

    The log file lets a test read the run's events while it still runs.
    """
    marker, go, log = tmp_path / "running", tmp_path / "go", tmp_path / "jobrun.log"
    proc = jobrun_cli.start(
        *args, "--log-file", str(log), "--log-level", "debug", "--",
        "sh", "-c", f'echo $$ > "{marker}"; while [ ! -e "{go}" ]; do sleep 0.05; done',
        dsn=dsn,
    )  # fmt: skip
    wait_for_file(marker, proc=proc)
    return proc, go, log


def end_cleanly(proc: subprocess.Popen[str], go: Path, log: Path) -> None:
    """Let a start_waiting() child end: the run must end 0, its lock never lost."""
    go.touch()
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 0, stderr
    assert "lock_lost" not in log.read_text()


class TestSessionLockLost:
    """Session mode: whatever ends the session stops the child (exit 76)."""

    def test_terminated_backend_stops_the_child(self, dsn, key, children):
        """pg_terminate_backend of the lock session: lock_lost, child stopped, exit 76."""
        proc, child = start_holder(children, "--key", key, "--kill-after", "2s", dsn=dsn)
        with psycopg.connect(dsn) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (backend_of(dsn, key),))
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 76, stderr
        assert "lock session broke" in event(stderr, "lock_lost")["reason"]
        assert event(stderr, "finished")["outcome"] == "lock_lost"
        assert jobrun_cli.process_gone(child)
        argv, _ = children.argv(0)
        assert jobrun_cli.run("--key", key, "--", *argv, dsn=dsn).returncode == 0
        assert children.overlaps() == []

    def test_ignore_lets_the_child_finish(self, dsn, key, tmp_path):
        """--on-lock-lost ignore: an error line, and the child's own status."""
        marker = tmp_path / "ignored"
        log = tmp_path / "jobrun.log"
        proc = jobrun_cli.start(
            "--key", key, "--on-lock-lost", "ignore", "--log-file", str(log), "--",
            "sh", "-c", f'echo $$ > "{marker}"; while [ ! -e "{marker}.go" ]; do sleep 0.05; done',
            dsn=dsn,
        )  # fmt: skip
        wait_for_file(marker)
        with psycopg.connect(dsn) as conn:
            conn.execute("SELECT pg_terminate_backend(%s)", (backend_of(dsn, key),))
        # The child is told nothing: we let it finish once the loss has been logged.
        wait_until(lambda: '"lock_lost"' in log.read_text(), what="lock_lost")
        Path(f"{marker}.go").touch()
        proc.communicate(timeout=30)
        assert proc.returncode == 0
        assert event(log.read_text(), "lock_lost")["action"] == "ignore"

    @pytest.mark.fault
    def test_server_restart_stops_the_child(self, private_server, key, children):
        """A restart ends every session: the child is stopped; the next run gets the lock."""
        dsn = private_server.dsn()
        proc, child = start_holder(children, "--key", key, "--kill-after", "2s", dsn=dsn)
        private_server.restart()
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 76, stderr
        assert jobrun_cli.process_gone(child)
        argv, _ = children.argv(0.2)
        after = jobrun_cli.run("--key", key, "--wait", "30s", "--", *argv, dsn=dsn)
        assert after.returncode == 0, after.stderr
        assert children.overlaps() == []

    @pytest.mark.fault
    def test_dropped_connection_stops_the_child(self, private_server, proxy, key, children):
        """The proxy resets the lock session: lock lost, exit 76."""
        cut = proxy(private_server.host, private_server.port)
        dsn = cut.dsn_for(private_server.dsn())
        proc, child = start_holder(children, "--key", key, "--kill-after", "2s", dsn=dsn)
        assert cut.drop_all() >= 1
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 76, stderr
        assert jobrun_cli.process_gone(child)

    @pytest.mark.fault
    def test_blackholed_network_stops_the_child(self, private_server, proxy, key, children):
        """No answer at all (a cut cable): the lock counts as lost and the child is stopped.

        Meanwhile the server still holds the session, so nobody else may start: the lock
        is never held twice. (Detection time: benchmarks/bench_detection.py.)
        """
        cut = proxy(private_server.host, private_server.port)
        proc, child = start_holder(
            children, "--key", key, "--kill-after", "1s", dsn=cut.dsn_for(private_server.dsn())
        )
        cut.blackhole()
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 76, stderr
        assert jobrun_cli.process_gone(child)
        direct = jobrun_cli.run("--key", key, "--", "true", dsn=private_server.dsn())
        assert direct.returncode == 75  # the server-side session still holds it
        cut.drop_all()
        argv, _ = children.argv(0)
        after = jobrun_cli.run("--key", key, "--wait", "30s", "--", *argv, dsn=private_server.dsn())
        assert after.returncode == 0, after.stderr
        assert children.overlaps() == []

    @pytest.mark.fault
    def test_idle_session_timeout_does_not_kill_the_lock(self, private_server_factory, key):
        """With idle_session_timeout = 1s on the server, a quiet lock session survives."""
        server = private_server_factory({"idle_session_timeout": "1s"})
        dsn = server.dsn()
        with psycopg.connect(dsn, autocommit=True) as idle:
            # The setting is live: a plain idle session is closed by the server.
            readable, _, _ = select.select([idle.fileno()], [], [], 30)
            assert readable
        result = jobrun_cli.run(
            "--key", key, "--heartbeat", "5s", "--", "sleep", "3", dsn=dsn, timeout=60
        )
        assert result.returncode == 0, result.stderr
        assert "lock_lost" not in result.stderr


class TestLostBeforeTheChildStarts:
    """The lock is watched from the moment it is taken, not only once the child runs."""

    def test_lock_lost_while_the_history_is_slow_never_starts_the_child(self, dsn, key, children):
        """Lost during a slow history call: exit 76, lock_lost, and no child at all."""
        assert jobrun_cli.run("--key", key, "--", "true", dsn=dsn).returncode == 0
        with psycopg.connect(dsn, autocommit=True) as admin, psycopg.connect(dsn) as blocker:
            # A "running" row whose row lock we hold: the next run's check for abandoned
            # runs waits on it (up to its 5 s statement timeout).
            admin.execute("UPDATE jobrun.runs SET outcome = 'running' WHERE key = %s", (key,))
            blocker.execute("SELECT 1 FROM jobrun.runs WHERE key = %s FOR UPDATE", (key,))
            argv, marker = children.argv()
            proc = jobrun_cli.start("--key", key, "--", *argv, dsn=dsn)
            try:
                wait_until(lambda: _row_lock_waiters(admin) > 0, what="the history to wait")
                admin.execute("SELECT pg_terminate_backend(%s)", (backend_of(dsn, key),))
                _, stderr = proc.communicate(timeout=30)
            finally:
                blocker.rollback()
                if proc.poll() is None:
                    proc.kill()
                    proc.communicate()
        assert proc.returncode == 76, stderr
        assert event(stderr, "lock_lost")["action"] == "not_started"
        assert '"started"' not in stderr
        assert not marker.exists()

    def test_kill_9_while_waiting_for_the_next_key_frees_the_first(self, dsn, key):
        """--wait on the second key: the server notices the dead client within seconds."""
        with psycopg.connect(dsn, autocommit=True) as holder:
            if holder.info.server_version < 140000:  # PostgreSQL 14
                pytest.skip("client_connection_check_interval needs PostgreSQL 14")
            first, second = sorted((f"{key}-a", f"{key}-b"), key=keys.lock_id_for)
            holder.execute("SELECT pg_advisory_lock(%s)", (keys.lock_id_for(second),))
            proc = jobrun_cli.start(
                "--key", first, "--key", second, "--wait", "120s", "--", "true", dsn=dsn
            )  # fmt: skip
            try:
                wait_until(lambda: _advisory_waiters(holder) > 0, what="jobrun to wait")
            finally:
                proc.kill()
                proc.communicate(timeout=10)
            after = jobrun_cli.run("--key", first, "--wait", "15s", "--", "true", dsn=dsn)
        assert after.returncode == 0, after.stderr


def _row_lock_waiters(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute(
        # This database's only: other test sessions may share the server.
        "SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted "
        "AND pid IN (SELECT pid FROM pg_stat_activity WHERE datname = current_database())"
    ).fetchone()
    return int(row[0]) if row else 0


def _advisory_waiters(conn: psycopg.Connection[tuple[object, ...]]) -> int:
    row = conn.execute(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
        "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    ).fetchone()
    return int(row[0]) if row else 0


class TestAmbiguousHeartbeatErrors:
    """A heartbeat that fails without proof of loss is retried, not taken for a lost lock.

    A lost lock stops the job; a check that merely went unanswered or failed on a live
    session proves nothing, and stopping every job at the first hiccup would make jobrun
    the outage. The limit is the confirmation lifetime (session mode) or the lease's
    lifetime (lease mode): within it, a recovered heartbeat changes nothing for the child.
    """

    def test_a_cancelled_check_on_a_live_session_is_retried(self, dsn, key, tmp_path):
        """Session mode: a check cancelled by the server fails once; the run goes on."""
        proc, go, log = start_waiting(tmp_path, "--key", key, "--heartbeat", "200ms", dsn=dsn)
        backend = backend_of(dsn, key)
        with psycopg.connect(dsn) as blocker, psycopg.connect(dsn, autocommit=True) as admin:
            # The check reads jobrun.stop_requests: locking that table makes it wait, so a
            # cancel lands inside the check, on a session that stays alive and keeps its lock.
            blocker.execute("LOCK TABLE jobrun.stop_requests IN ACCESS EXCLUSIVE MODE")
            wait_until(
                lambda: (
                    admin.execute(
                        "SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = %s",
                        (backend,),
                    ).fetchone()
                    == (True,)
                ),
                what="the check to wait for the table",
            )
            admin.execute("SELECT pg_cancel_backend(%s)", (backend,))
            wait_until(lambda: '"heartbeat_failed"' in log.read_text(), what="heartbeat_failed")
        wait_until(lambda: '"heartbeat_recovered"' in log.read_text(), what="the next check")
        assert backend_of(dsn, key) == backend  # the same session still holds the lock
        end_cleanly(proc, go, log)

    @pytest.mark.fault
    def test_a_silence_shorter_than_the_confirmation_lifetime_costs_nothing(
        self, private_server, proxy, key, tmp_path
    ):
        """Session mode: no answer for a while, then answers again: the child never notices."""
        cut = proxy(private_server.host, private_server.port)
        heartbeat = 0.5
        silence = CONFIRMATION_LIFETIME / 4  # well inside what one check vouches for
        proc, go, log = start_waiting(
            tmp_path, "--key", key, "--heartbeat", f"{heartbeat}s",
            dsn=cut.dsn_for(private_server.dsn()),
        )  # fmt: skip
        cut.blackhole()
        time.sleep(silence)  # the fault's duration: the thing under test, not a wait for an event
        confirmed = log.read_text().count('"lock_confirmed"')
        cut.restore()
        wait_until(
            lambda: log.read_text().count('"lock_confirmed"') > confirmed,
            what="a check answered after the silence",
        )
        end_cleanly(proc, go, log)

    @pytest.mark.fault
    @pytest.mark.parametrize("connection", ["per-renewal", "kept"])
    def test_lease_renewals_refused_for_a_while_are_retried(
        self, private_server, proxy, key, tmp_path, connection
    ):
        """Lease mode: renewals that cannot connect are retried; once through, the run goes on.

        Kept: the run's connection is dropped too, so the next beat must reconnect (a
        connection that failed is reopened, never fatal by itself)."""
        cut = proxy(private_server.host, private_server.port)
        proc, go, log = start_waiting(
            tmp_path, "--key", key, "--mode", "lease", "--ttl", "20s", "--kill-after", "2s",
            "--heartbeat", "1s", "--connect-timeout", "1s", "--lease-connection", connection,
            dsn=cut.dsn_for(private_server.dsn()),
        )  # fmt: skip
        cut.refuse()  # each new connection is refused now
        if connection == "kept":
            cut.drop_all()  # and the kept one is gone: the next beat reconnects
        wait_until(lambda: '"heartbeat_failed"' in log.read_text(), what="a refused renewal")
        cut.restore()
        wait_until(lambda: '"heartbeat_recovered"' in log.read_text(), what="a renewal again")
        end_cleanly(proc, go, log)


class TestStandby:
    """A standby's advisory locks are its own: jobrun refuses to lock there."""

    def test_session_mode_refuses_a_standby(self, private_server, key, tmp_path):
        """Exit 69 with reason standby; the child never starts."""
        private_server.become_standby()
        marker = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key", key, "--", "touch", str(marker), dsn=private_server.dsn()
        )  # fmt: skip
        assert result.returncode == 69, result.stderr
        unavailable = event(result.stderr, "lockstore_unavailable")
        assert unavailable["reason"] == "standby"
        assert "target_session_attrs=read-write" in unavailable["error"]
        assert not marker.exists()

    def test_lease_mode_fails_closed_on_a_standby(self, private_server, key, tmp_path):
        """The lease cannot be written: exit 69, the child never starts."""
        private_server.become_standby()
        marker = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key", key, "--mode", "lease", "--", "touch", str(marker), dsn=private_server.dsn()
        )  # fmt: skip
        assert result.returncode == 69, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["level"] == "error"
        assert not marker.exists()


class TestPooler:
    """PgBouncer in transaction mode: session mode refused, lease mode works."""

    def test_session_mode_is_refused_behind_transaction_pooling(
        self, pgbouncer, pg_address, dsn, key, tmp_path
    ):
        """Exit 69 with reason transaction_pooler; the child never starts."""
        bouncer = pgbouncer(*pg_address, pool_mode="transaction")
        marker = tmp_path / "ran"
        result = jobrun_cli.run("--key", key, "--", "touch", str(marker), dsn=bouncer.dsn_for(dsn))
        assert result.returncode == 69, result.stderr
        unavailable = event(result.stderr, "lockstore_unavailable")
        assert unavailable["reason"] == "transaction_pooler"
        assert "--mode lease" in unavailable["error"]
        assert not marker.exists()

    def test_session_mode_works_behind_session_pooling(self, pgbouncer, pg_address, dsn, key):
        """A pooler in session mode keeps our session: no false alarm."""
        bouncer = pgbouncer(*pg_address, pool_mode="session")
        result = jobrun_cli.run("--key", key, "--", "true", dsn=bouncer.dsn_for(dsn))
        assert result.returncode == 0, result.stderr

    def test_lease_mode_works_through_transaction_pooling(
        self, pgbouncer, pg_address, dsn, key, children
    ):
        """Lease mode through PgBouncer: one run holds, a concurrent one skips."""
        bouncer = pgbouncer(*pg_address, pool_mode="transaction")
        pooled = bouncer.dsn_for(dsn)
        args = ("--key", key, "--mode", "lease", "--ttl", "6s", "--kill-after", "1s")
        proc, _ = start_holder(children, *args, dsn=pooled)
        second = jobrun_cli.run(*args, "--", "true", dsn=pooled)
        assert second.returncode == 75, second.stderr
        stderr = jobrun_cli.signal_and_wait(proc, signal.SIGTERM)
        assert proc.returncode == 143, stderr
        assert "heartbeat_failed" not in stderr

    def test_kept_lease_connections_share_one_server_connection(
        self, pgbouncer, pg_address, dsn, key, tmp_path
    ):
        """Two lease runs keep their connections through PgBouncer with ONE server
        connection: between their statements (each its own transaction) neither holds it.
        Both beat and renew through it, and ``jobrun stop`` reaches one of them."""
        bouncer = pgbouncer(*pg_address, pool_mode="transaction", default_pool_size=1)
        pooled = bouncer.dsn_for(dsn)
        # Renewals every ttl/3 or so (3.3 s), a beat every second between them.
        args = ("--mode", "lease", "--ttl", "12s", "--kill-after", "1s")
        runs = {}
        for name in ("a", "b"):
            (tmp_path / name).mkdir()
            runs[name] = start_waiting(tmp_path / name, *args, "--key", f"{key}-{name}", dsn=pooled)
        with psycopg.connect(dsn, autocommit=True) as conn:
            wait_until(
                lambda: (
                    conn.execute(
                        "SELECT count(*) FROM jobrun.leases WHERE key = ANY(%s)"
                        " AND renewed_at > acquired_at",
                        ([f"{key}-a", f"{key}-b"],),
                    ).fetchone()
                    == (2,)
                ),
                what="both leases renewed through the pooler",
            )
        stop = jobrun_cli.run("stop", f"{key}-a", "--wait", "0s", dsn=pooled)
        assert "asked run" in stop.stderr, stop.stderr  # exit 3: not ended within 0s
        proc, _, log = runs["a"]
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 77, stderr
        end_cleanly(*runs["b"])
        for _, _, log in runs.values():
            assert "heartbeat_failed" not in log.read_text()

    def test_lease_history_through_transaction_pooling(
        self, pgbouncer, pg_address, dsn, key, children
    ):
        """The history rides the lease's connections through PgBouncer: a run's row and a
        skip's row are written, and no call fails."""
        bouncer = pgbouncer(*pg_address, pool_mode="transaction")
        pooled = bouncer.dsn_for(dsn)
        args = ("--key", key, "--mode", "lease", "--ttl", "6s", "--kill-after", "1s")
        proc, _ = start_holder(children, *args, dsn=pooled)
        skip = jobrun_cli.run(*args, "--", "true", dsn=pooled)
        assert skip.returncode == 75, skip.stderr
        stderr = jobrun_cli.signal_and_wait(proc, signal.SIGTERM)
        assert proc.returncode == 143, stderr
        after = jobrun_cli.run(*args, "--", "true", dsn=pooled)
        assert after.returncode == 0, after.stderr
        for output in (stderr, skip.stderr, after.stderr):
            assert "history_failed" not in output
            assert "release_failed" not in output
        outcomes = [row["outcome"] for row in rows_of(dsn, key)]
        assert outcomes == ["succeeded", "skipped", "failed"]


class TestLeaseFaults:
    """Lease mode: a crashed holder keeps the lease until it expires; a cut one stops early."""

    def test_killed_holder_blocks_others_until_expiry(self, dsn, key, children):
        """kill -9 of the holder: others skip until the TTL ends, then acquire at once."""
        args = ("--key", key, "--mode", "lease", "--ttl", "4s", "--kill-after", "1s")
        proc, child = start_holder(children, *args, dsn=dsn)
        proc.kill()
        proc.communicate(timeout=10)
        expires = lease_expiry(dsn, key)
        wait_until(lambda: jobrun_cli.process_gone(child), what="the child to die")
        early = jobrun_cli.run(*args, "--", "true", dsn=dsn)
        if early.returncode == 0:  # a loaded machine: the TTL ran out before this run began
            assert event_time(event(early.stderr, "started")) >= expires
        elif event_time(event(early.stderr, "skipped")) < expires:
            assert early.returncode == 75
        argv, _ = children.argv(0)
        after = jobrun_cli.run(*args, "--wait", "30s", "--", *argv, dsn=dsn)
        assert after.returncode == 0, after.stderr
        assert event_time(event(after.stderr, "started")) >= expires
        assert children.overlaps() == []

    def test_an_expired_lease_is_not_renewed(self, dsn, key, children):
        """Expired (here: by hand) means gone: the next renewal fails, exit 76."""
        args = ("--key", key, "--mode", "lease", "--ttl", "60s", "--kill-after", "1s",
                "--heartbeat", "500ms")  # fmt: skip
        proc, child = start_holder(children, *args, dsn=dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(
                "UPDATE jobrun.leases SET expires_at = clock_timestamp() - interval '1 second'"
                " WHERE lock_id = %s",
                (keys.lock_id_for(key),),
            )
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 76, stderr
        assert jobrun_cli.process_gone(child)

    def test_partial_loss_releases_the_leases_still_held(self, dsn, key, children):
        """One of two leases taken away: exit 76, and the other one is free at once."""
        keep, lose = f"{key}-keep", f"{key}-lose"
        args = ("--mode", "lease", "--ttl", "60s", "--kill-after", "1s", "--heartbeat", "500ms")
        proc, _ = start_holder(children, "--key", keep, "--key", lose, *args, dsn=dsn)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("DELETE FROM jobrun.leases WHERE lock_id = %s", (keys.lock_id_for(lose),))
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 76, stderr
        after = jobrun_cli.run("--key", keep, *args, "--", "true", dsn=dsn)
        assert after.returncode == 0, after.stderr

    @pytest.mark.fault
    def test_cut_off_holder_stops_its_child_before_the_lease_expires(
        self, private_server, proxy, key, children
    ):
        """Renewals cannot get through: the child is dead before expires_at; then others run."""
        cut = proxy(private_server.host, private_server.port)
        args = ("--key", key, "--mode", "lease", "--ttl", "6s", "--kill-after", "1s",
                "--connect-timeout", "2s")  # fmt: skip
        proc, child = start_holder(children, *args, dsn=cut.dsn_for(private_server.dsn()))
        cut.blackhole()
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 76, stderr
        finished = event(stderr, "finished")
        assert jobrun_cli.process_gone(child)
        assert event_time(finished) < lease_expiry(private_server.dsn(), key)
        argv, _ = children.argv(0)
        after = jobrun_cli.run(*args, "--wait", "30s", "--", *argv, dsn=private_server.dsn())
        assert after.returncode == 0, after.stderr
        assert children.overlaps() == []

    def test_stolen_lease_stops_the_child(self, dsn, key, children):
        """A renewal that finds another owner: lock lost at once, exit 76."""
        args = ("--key", key, "--mode", "lease", "--ttl", "6s", "--kill-after", "1s")
        proc, child = start_holder(children, *args, dsn=dsn)
        with psycopg.connect(dsn) as conn:
            conn.execute(
                "UPDATE jobrun.leases SET owner = gen_random_uuid() WHERE lock_id = %s",
                (keys.lock_id_for(key),),
            )
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 76, stderr
        assert "taken over" in event(stderr, "lock_lost")["reason"]
        assert jobrun_cli.process_gone(child)

    def test_a_stale_owners_release_leaves_the_new_owners_lease(self, dsn, key, tmp_path):
        """A holder frozen while its key changed hands releases nothing of the new owner's.

        The thawed holder's child has ended, so it releases its lease before any renewal
        can tell it the lease is gone: only the owner check in that release keeps the new
        owner's row.
        """
        args = ("--key", key, "--mode", "lease", "--ttl", "60s", "--kill-after", "1s",
                "--heartbeat", "20s")  # fmt: skip  # no renewal falls due during the test
        proc, go, log = start_waiting(tmp_path, *args, dsn=dsn)
        child = int((tmp_path / "running").read_text())
        proc.send_signal(signal.SIGSTOP)
        try:
            with psycopg.connect(dsn) as conn:  # what an expiry and a takeover leave behind
                stolen = conn.execute(
                    "UPDATE jobrun.leases SET owner = gen_random_uuid() WHERE lock_id = %s"
                    " RETURNING owner",
                    (keys.lock_id_for(key),),
                ).fetchone()
            go.touch()
            wait_until(lambda: jobrun_cli.process_gone(child), what="the child to end")
        finally:
            proc.send_signal(signal.SIGCONT)
        _, stderr = proc.communicate(timeout=30)
        assert event(log.read_text(), "finished")["child_exit_code"] == 0, stderr
        with psycopg.connect(dsn) as conn:
            owners = conn.execute(
                "SELECT owner FROM jobrun.leases WHERE lock_id = %s", (keys.lock_id_for(key),)
            ).fetchall()
        assert stolen is not None
        assert owners == [stolen]


class TestLeaseBasics:
    """Lease mode's table, concurrency and invariants."""

    def test_fifty_first_runs_at_once(self, private_server, key, tmp_path):
        """50 runs on a fresh database create the schema once; exactly one child runs."""
        dsn = private_server.dsn()
        ran = tmp_path / "ran"
        go = tmp_path / "go"
        body = (
            "import os, time\n"
            f"open({str(ran)!r}, 'a').write('x\\n')\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        )
        runs = [
            jobrun_cli.start("--key", key, "--mode", "lease", "--", *jobrun_cli.child_script(body),
                             dsn=dsn)
            for _ in range(50)
        ]  # fmt: skip
        try:
            wait_until(lambda: sum(r.poll() is not None for r in runs) == 49, timeout=120,
                       what="49 runs to finish")  # fmt: skip
        finally:
            go.touch()
        outputs = [r.communicate(timeout=60)[1] for r in runs]
        codes = sorted(r.returncode for r in runs)
        assert codes == [0] + [75] * 49, [o for o in outputs if "Traceback" in o or "error" in o][
            :2
        ]
        assert ran.read_text() == "x\n"

    def test_a_finished_run_leaves_no_lease_row(self, dsn, key):
        """After a run the lease row is gone (a stale owner's release: TestLeaseFaults)."""
        result = jobrun_cli.run("--key", key, "--mode", "lease", "--", "true", dsn=dsn)
        assert result.returncode == 0
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT count(*) FROM jobrun.leases WHERE lock_id = %s", (keys.lock_id_for(key),)
            ).fetchone()
        assert rows == (0,)

    def test_a_run_longer_than_its_ttl_keeps_the_lease(self, dsn, key, tmp_path):
        """Renewals carry a run past its TTL: long after the first expiry, others still skip."""
        args = ("--key", key, "--mode", "lease", "--ttl", "3s", "--kill-after", "1s")
        proc, go, log = start_waiting(tmp_path, *args, dsn=dsn)
        first_expiry = lease_expiry(dsn, key)
        # Past the first expiry by a whole TTL: without a renewal the lease would be long gone.
        with psycopg.connect(dsn, autocommit=True) as conn:
            wait_until(
                lambda: (
                    conn.execute(
                        "SELECT clock_timestamp() > %s + interval '3 seconds'", (first_expiry,)
                    ).fetchone()
                    == (True,)
                ),
                what="one TTL past the first expiry",
            )
        assert lease_expiry(dsn, key) > first_expiry
        late = jobrun_cli.run(*args, "--", "true", dsn=dsn)
        assert late.returncode == 75, late.stderr
        holder_run = event(log.read_text(), "started")["run_id"]
        assert event(late.stderr, "skipped")["holder_run_id"] == holder_run
        end_cleanly(proc, go, log)

    @pytest.mark.parametrize(
        "args",
        [
            ("--ttl", "10s"),  # kill-after 10s leaves no room
            ("--ttl", "30s", "--heartbeat", "20s"),  # two heartbeats do not fit
            ("--ttl", "0"),
        ],
    )
    def test_bad_timing_is_a_usage_error(self, jobrun_here, key, args):
        """ttl vs heartbeat vs kill-after is checked before anything runs, with a fix."""
        result = jobrun_here.run("--key", key, "--mode", "lease", *args, "--", "true", dsn=None)
        assert result.returncode == 64
        assert "--ttl" in result.stderr
        assert len(result.stderr.strip().splitlines()) == 1


def test_threads_are_not_left_behind() -> None:
    """Guard for this module: no test left a helper thread running."""
    assert [t.name for t in threading.enumerate() if t.name.startswith("jobrun")] == []


class TestSessionSettings:
    """What the lock session sets on the server for itself."""

    def test_server_side_keepalives_outlast_our_own_kill_deadline(self, dsn, key):
        """The server drops a vanished host's session, but only after we would have killed
        the child: keepalive idle > confirmation lifetime + kill-after."""
        session = ServerSession(db.Target(dsn=dsn), app_name="jobrun:test", held=True)
        lock = SessionLock(
            (keys.from_name(key),),
            session,
            Identity(run_id=new_run_id(), pid=1),
            structlog.get_logger(),
            heartbeat=1.0,
            kill_after=7.0,
        )
        assert isinstance(lock.acquire(0), Taken)
        try:
            conn = session.connection()
            assert conn is not None
            shown = {
                name: conn.execute(f"SHOW {name}").fetchone()[0]
                for name in (
                    "tcp_keepalives_idle",
                    "tcp_keepalives_interval",
                    "tcp_keepalives_count",
                    "idle_session_timeout",
                    "idle_in_transaction_session_timeout",
                )
            }
        finally:
            lock.release()
            session.close()
        if shown["tcp_keepalives_idle"] != "0":  # 0 on a unix socket: nothing to set there
            assert int(shown["tcp_keepalives_idle"].rstrip("s")) > lock.confirmation_lifetime + 7
        assert shown["idle_session_timeout"] == "0"
        assert shown["idle_in_transaction_session_timeout"] == "0"
