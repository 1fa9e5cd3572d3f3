"""A history that cannot be used: --once-per fails closed, plain history warns once and runs."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql as pgsql

from harness import jobrun_cli
from harness.jobrun_cli import event, events, wait_for_file, wait_until
from support.history import ensure_runs_table, history_config, holder, rows_of

if TYPE_CHECKING:
    from collections.abc import Callable


def _no_create(admin: str, make_role: Callable[..., str]) -> str:
    """A fresh database and a role that may connect but create nothing in it."""
    del admin
    return make_role()


def _schema_of_someone_else(admin: str, make_role: Callable[..., str]) -> str:
    """The jobrun schema exists (another role's), without the table; we may only use it."""
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute("CREATE SCHEMA jobrun")
    return make_role("GRANT USAGE ON SCHEMA jobrun TO {role}")


def _read_only(admin: str, make_role: Callable[..., str]) -> str:
    """A role whose transactions are read-only by default (the table exists)."""
    ensure_runs_table(admin)
    return make_role(
        "GRANT USAGE ON SCHEMA jobrun TO {role}",
        "GRANT SELECT, INSERT, UPDATE, DELETE ON jobrun.runs TO {role}",
        "ALTER ROLE {role} SET default_transaction_read_only = on",
    )


def _read_only_fresh(admin: str, make_role: Callable[..., str]) -> str:
    """A role whose transactions are read-only by default, on a fresh database it owns."""
    dsn = make_role()
    with psycopg.connect(admin, autocommit=True) as conn:
        name = psycopg.conninfo.conninfo_to_dict(dsn)["user"]
        conn.execute(
            pgsql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(
                pgsql.Identifier(str(conn.info.dbname)), pgsql.Identifier(str(name))
            )
        )
        conn.execute(
            pgsql.SQL("ALTER ROLE {} SET default_transaction_read_only = on").format(
                pgsql.Identifier(str(name))
            )
        )
    return dsn


UNAVAILABLE = {
    "no_create_privilege": _no_create,
    "schema_owned_by_someone_else": _schema_of_someone_else,
    "read_only_default": _read_only,
    "read_only_default_fresh": _read_only_fresh,
}


@pytest.fixture
def limited(fresh_dsn, role) -> Callable[[str], str]:
    """``make(case) -> dsn``: a role on a fresh database for which the history is unavailable."""

    def make(case: str) -> str:
        return UNAVAILABLE[case](fresh_dsn, lambda *grants: role(*grants, database_dsn=fresh_dsn))

    return make


class TestOncePerFailsClosed:
    """--once-per depends on the history: whatever keeps it from being used, exit 69."""

    @pytest.mark.parametrize("case", sorted(UNAVAILABLE))
    def test_no_child_and_exit_69(self, case, limited, key, tmp_path):
        """history_unavailable, exit 69, the child never started."""
        ran = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key", key, "--once-per", "1h", "--", "touch", str(ran), dsn=limited(case)
        )
        assert result.returncode == 69, result.stderr
        line = event(result.stderr, "lockstore_unavailable")
        assert line["reason"] == "history_unavailable"
        assert not ran.exists()
        assert "started" not in [e["event"] for e in events(result.stderr)]

    def test_a_locked_table_fails_closed_after_the_history_timeout(self, dsn, key, tmp_path):
        """jobrun.runs locked by another session beyond the timeout: exit 69, no child."""
        ensure_runs_table(dsn)
        ran = tmp_path / "ran"
        with psycopg.connect(dsn) as blocker:
            blocker.execute("LOCK TABLE jobrun.runs IN ACCESS EXCLUSIVE MODE")
            result = jobrun_cli.run(
                "--key", key, "--once-per", "1h", "--", "touch", str(ran), dsn=dsn
            )
        assert result.returncode == 69, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["reason"] == "history_unavailable"
        assert "timeout" in event(result.stderr, "history_failed")["error"]
        assert not ran.exists()

    def test_lease_mode_fails_closed_on_a_locked_table(self, dsn, key, tmp_path):
        """Lease mode, the window checked over the attempt's connection: exit 69, no child,
        and the lease released (the next run takes it at once)."""
        ensure_runs_table(dsn)
        ran = tmp_path / "ran"
        args = ("--mode", "lease", "--key", key)
        with psycopg.connect(dsn) as blocker:
            blocker.execute("LOCK TABLE jobrun.runs IN ACCESS EXCLUSIVE MODE")
            result = jobrun_cli.run(*args, "--once-per", "1h", "--", "touch", str(ran), dsn=dsn)
        assert result.returncode == 69, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["reason"] == "history_unavailable"
        assert "timeout" in event(result.stderr, "history_failed")["error"]
        assert "started" not in [e["event"] for e in events(result.stderr)]
        assert not ran.exists()
        assert "release_failed" not in result.stderr
        assert jobrun_cli.run(*args, "--", "true", dsn=dsn).returncode == 0

    def test_lease_mode_fails_closed_when_the_lent_connection_dies(self, dsn, key, tmp_path):
        """The attempt's connection terminated while the window check waits on it: exit 69,
        no child, and the release goes over a fresh connection."""
        ensure_runs_table(dsn)
        ran = tmp_path / "ran"
        args = ("--mode", "lease", "--key", key)
        with psycopg.connect(dsn) as blocker:
            blocker.execute("LOCK TABLE jobrun.runs IN ACCESS EXCLUSIVE MODE")
            proc = jobrun_cli.start(*args, "--once-per", "1h", "--", "touch", str(ran), dsn=dsn)
            with psycopg.connect(dsn, autocommit=True) as admin:

                def waiting() -> list[int]:
                    return [
                        int(row[0])
                        for row in admin.execute(
                            "SELECT pid FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
                            " AND query LIKE '%%jobrun.runs%%' AND pid <> %s",
                            (blocker.info.backend_pid,),
                        )
                    ]

                wait_until(lambda: bool(waiting()), what="the window check to wait")
                for pid in waiting():
                    admin.execute("SELECT pg_terminate_backend(%s)", (pid,))
                _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 69, stderr
        assert event(stderr, "lockstore_unavailable")["reason"] == "history_unavailable"
        assert "started" not in [e["event"] for e in events(stderr)]
        assert not ran.exists()
        assert "release_failed" not in stderr
        assert jobrun_cli.run(*args, "--", "true", dsn=dsn).returncode == 0

    def test_on_db_error_run_runs_unchecked(self, limited, key, tmp_path):
        """--on-db-error run opts into running when --once-per cannot be checked."""
        ran = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key", key, "--once-per", "1h", "--on-db-error", "run", "--", "touch", str(ran),
            dsn=limited("no_create_privilege"),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert event(result.stderr, "lockstore_unavailable")["running_unchecked"] is True
        assert ran.exists()


class TestPlainHistoryWarnsOnce:
    """Without --once-per the job does not depend on the history: one warning, and it runs."""

    @pytest.mark.parametrize("case", sorted(UNAVAILABLE))
    def test_one_warning_and_the_run_happens(self, case, limited, key, tmp_path):
        """Exit 0, the child ran, exactly one history_failed (a warning)."""
        ran = tmp_path / "ran"
        result = jobrun_cli.run("--key", key, "--", "touch", str(ran), dsn=limited(case))
        assert result.returncode == 0, result.stderr
        assert ran.exists()
        (line,) = [e for e in events(result.stderr) if e["event"] == "history_failed"]
        assert line["level"] == "warning"
        assert event(result.stderr, "finished")["outcome"] == "succeeded"

    def test_a_table_without_privileges_is_one_warning(self, dsn, key, role):
        """A role that may not read or write jobrun.runs: exit 0 and one history_failed."""
        ensure_runs_table(dsn)
        result = jobrun_cli.run(
            "--key", key, "--", "true", dsn=role("GRANT USAGE ON SCHEMA jobrun TO {role}")
        )
        assert result.returncode == 0, result.stderr
        assert event(result.stderr, "history_failed")["level"] == "warning"

    def test_a_skip_that_cannot_be_recorded_still_skips(self, dsn, key, role, tmp_path):
        """The lock is held; the skip row cannot be written: exit 75 and one warning."""
        ensure_runs_table(dsn)
        marker = tmp_path / "child"
        holder_proc = jobrun_cli.start(
            "--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn
        )
        try:
            wait_for_file(marker)
            result = jobrun_cli.run(
                "--key", key, "--", "true", dsn=role("GRANT USAGE ON SCHEMA jobrun TO {role}")
            )
        finally:
            jobrun_cli.signal_and_wait(holder_proc, jobrun_cli.SIGTERM)
        assert result.returncode == 75, result.stderr
        assert event(result.stderr, "history_failed")["during"] == "recording the skip"


class TestRecorderFailures:
    """The recorder itself: failures are warnings, never exceptions, and cost bounded time."""

    def test_missing_privileges_are_one_warning_and_no_exception(
        self, dsn, make_recorder, captured, role
    ):
        """A role that may not write jobrun.runs: the whole run logs one history_failed."""
        ensure_runs_table(dsn)
        limited = role(
            "GRANT USAGE ON SCHEMA jobrun TO {role}", "GRANT SELECT ON jobrun.runs TO {role}"
        )
        recorder = make_recorder(target_dsn=limited, config=history_config(alert_after=1))
        assert recorder.acquired(None) is None
        recorder.started(1)
        recorder.finished("failed", 1, None, 1.0)
        recorder.skipped("locked", holder(str(uuid.uuid4())), 75)
        (line,) = captured.events("history_failed")
        assert line["level"] == "warning"
        assert "permission denied" in line["error"]
        assert captured.events("failure_streak") == []

    def test_an_unreachable_database_costs_one_attempt(self, make_recorder, captured):
        """Connection refused: one warning, then no more attempts for the rest of the run."""
        recorder = make_recorder(target_dsn="host=127.0.0.1 port=1 dbname=x connect_timeout=2")
        recorder.acquired(None)
        recorder.started(1)
        recorder.finished("succeeded", 0, None, 1.0)
        assert recorder.calls.sessions == 1
        (line,) = captured.events("history_failed")
        assert line["during"] == "checking earlier runs"

    def test_a_locked_table_gives_up_after_the_timeout(self, fresh_dsn, make_recorder, captured):
        """A history call stuck behind a table lock is cancelled by the server in time."""
        ensure_runs_table(fresh_dsn)
        with psycopg.connect(fresh_dsn) as blocker:
            blocker.execute("LOCK TABLE jobrun.runs IN ACCESS EXCLUSIVE MODE")
            recorder = make_recorder(target_dsn=fresh_dsn, config=history_config(timeout=0.5))
            recorder.acquired(None)
        (line,) = captured.events("history_failed")
        assert line["during"] == "checking earlier runs"
        assert "timeout" in line["error"]

    def test_a_shared_session_is_never_left_in_a_transaction(
        self, fresh_dsn, make_recorder, captured
    ):
        """After a failed call on the lock session, it is idle (not idle in transaction)."""
        ensure_runs_table(fresh_dsn)
        with psycopg.connect(fresh_dsn, autocommit=True) as session:
            with psycopg.connect(fresh_dsn) as blocker:
                blocker.execute("LOCK TABLE jobrun.runs IN ACCESS EXCLUSIVE MODE")
                recorder = make_recorder(
                    target_dsn=fresh_dsn, config=history_config(timeout=0.5), shared=session
                )
                recorder.acquired(None)
            assert session.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
            assert session.execute("SHOW statement_timeout").fetchone() == ("0",)
            recorder.finished("succeeded", 0, None, 1.0)
        assert recorder.calls.sessions == 0
        assert len(captured.events("history_failed")) == 1
        assert rows_of(fresh_dsn, recorder.label)[0]["outcome"] == "succeeded"

    def test_a_silent_network_under_a_shared_session_is_cut(
        self, dsn, make_recorder, captured, proxy, pg_address
    ):
        """No answer at all on the lock session: the call gives up, the session is cut."""
        ensure_runs_table(dsn)
        cut = proxy(*pg_address)
        with psycopg.connect(cut.dsn_for(dsn), autocommit=True) as session:
            config = history_config(timeout=0.5)
            recorder = make_recorder(config=config, shared=session)
            cut.blackhole()
            recorder.acquired(None)  # returns: the test would hang otherwise
            assert session.broken
        (line,) = captured.events("history_failed")
        assert line["during"] == "checking earlier runs"

    def test_a_password_never_reaches_the_warning(self, make_recorder, captured):
        """The DSN's password is masked in history_failed."""
        recorder = make_recorder(target_dsn="host=127.0.0.1 port=1 password=hunter2secret")
        recorder.acquired(None)
        assert captured.events("history_failed")
        assert "hunter2secret" not in captured.path.read_text()


class TestSharedSessionUnderLoss:
    """History and heartbeat share the lock session: neither may hide a lost lock."""

    def test_a_history_call_stuck_on_a_lock_when_the_session_dies(self, dsn, key, tmp_path):
        """jobrun.runs locked, the lock session terminated meanwhile: exit 76, no child."""
        ensure_runs_table(dsn)
        ran = tmp_path / "ran"
        with psycopg.connect(dsn) as blocker:
            blocker.execute("LOCK TABLE jobrun.runs IN ACCESS EXCLUSIVE MODE")
            proc = jobrun_cli.start(
                "--key", key, "--heartbeat", "200ms", "--", "touch", str(ran), dsn=dsn
            )
            with psycopg.connect(dsn, autocommit=True) as watcher:
                app = f"jobrun:{key}"[:63]

                def history_waiting() -> list[int]:
                    rows = watcher.execute(
                        "SELECT pid FROM pg_stat_activity WHERE application_name = %s"
                        " AND wait_event_type = 'Lock' AND datname = current_database()",
                        (app,),
                    ).fetchall()
                    return [row[0] for row in rows]

                wait_until(lambda: bool(history_waiting()), what="the history call waiting")
                (backend,) = history_waiting()
                watcher.execute("SELECT pg_terminate_backend(%s)", (backend,))
            # Bounded by the heartbeat and the history timeout (5 s), never by the table lock.
            _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 76, stderr
        assert event(stderr, "lock_lost")["action"] == "not_started"
        assert not ran.exists()

    def test_a_run_whose_lock_session_died_is_recorded_as_lock_lost(self, dsn, key, tmp_path):
        """The lock session terminated mid-run: the row says lock_lost and 76, not running.

        The end can no longer go over the lock session, so it takes a connection of its own;
        left "running", the next run would call it abandoned and the loss would be lost.
        """
        marker = tmp_path / "child"
        proc = jobrun_cli.start(
            "--key", key, "--kill-after", "1s", "--", "sh", "-c",
            f'echo $$ > "{marker}"; exec sleep 300', dsn=dsn,
        )  # fmt: skip
        wait_for_file(marker, proc=proc)
        with psycopg.connect(dsn, autocommit=True) as admin:
            admin.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                " WHERE application_name = %s AND datname = current_database()",
                (f"jobrun:{key}"[:63],),
            )
        _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 76, stderr
        assert "history_failed" not in stderr
        (row,) = rows_of(dsn, key)
        assert (row["outcome"], row["exit_code"]) == ("lock_lost", 76)
        assert str(row["run_id"]) == event(stderr, "finished")["run_id"]

    def test_a_history_call_waiting_its_timeout_never_costs_the_lock(self, dsn, key, tmp_path):
        """A history call held up for its whole timeout: the heartbeat waits, the job runs."""
        ensure_runs_table(dsn)
        marker = tmp_path / "child"
        with psycopg.connect(dsn) as blocker:
            blocker.execute("LOCK TABLE jobrun.runs IN ACCESS EXCLUSIVE MODE")
            proc = jobrun_cli.start(
                "--key", key, "--heartbeat", "1s", "--", "sh", "-c",
                f'echo ran > "{marker}"; sleep 2', dsn=dsn,
            )  # fmt: skip
            wait_for_file(marker, timeout=30)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 0, stderr
        names = [e["event"] for e in events(stderr)]
        assert names.count("history_failed") == 1
        assert "lock_lost" not in names
