"""What history costs a run on the server: sessions, round trips; what it records: deadlocks."""

from __future__ import annotations

import sys

import pytest

from harness import jobrun_cli
from harness.jobrun_cli import event, events, wait_for_file
from support.history import ensure_runs_table, rows_of
from support.sessions import SessionCounter


def debug_event(stderr: str, name: str) -> dict[str, object]:
    return event(stderr, name)


class TestOneSessionPerRun:
    """Session mode: a run and a skip each use the lock session and nothing else."""

    def test_a_run_with_history_opens_one_session(self, fresh_dsn, key):
        """A guarded run with history (the table exists): one server session, 2 history calls."""
        ensure_runs_table(fresh_dsn)
        with SessionCounter(fresh_dsn) as counter:
            result = jobrun_cli.run(
                "--key", key, "--log-level", "debug", "--", "true", dsn=fresh_dsn
            )
            assert result.returncode == 0, result.stderr
            assert counter.ended_since_start(1) == 1
        calls = event(result.stderr, "history_calls")
        print(f"run: history round trips {calls['round_trips']}, sessions {calls['sessions']}")
        assert (calls["round_trips"], calls["sessions"]) == (2, 0)
        assert [row["outcome"] for row in rows_of(fresh_dsn, key)] == ["succeeded"]

    def test_a_first_run_on_a_fresh_database_opens_one_session(self, fresh_dsn, key):
        """Creating the table on the way costs round trips, never a session."""
        with SessionCounter(fresh_dsn) as counter:
            result = jobrun_cli.run("--key", key, "--", "true", dsn=fresh_dsn)
            assert result.returncode == 0, result.stderr
            assert counter.ended_since_start(1) == 1
        assert [row["outcome"] for row in rows_of(fresh_dsn, key)] == ["succeeded"]

    def test_a_skip_opens_one_session(self, fresh_dsn, key, tmp_path):
        """A skip names the holder and records the skip over its one session."""
        ensure_runs_table(fresh_dsn)
        marker = tmp_path / "child"
        holder = jobrun_cli.start(
            "--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=fresh_dsn
        )
        try:
            wait_for_file(marker)
            with SessionCounter(fresh_dsn) as counter:
                result = jobrun_cli.run(
                    "--key", key, "--log-level", "debug", "--", "true", dsn=fresh_dsn
                )
                assert result.returncode == 75, result.stderr
                jobrun_cli.signal_and_wait(holder, jobrun_cli.SIGTERM)
                # The holder's session was established before the count began.
                assert counter.ended_since_start(1) == 1
        finally:
            if holder.poll() is None:
                jobrun_cli.signal_and_wait(holder, jobrun_cli.SIGTERM)
        assert event(result.stderr, "skipped")["holder_pid"] == holder.pid
        calls = event(result.stderr, "history_calls")
        print(f"skip: history round trips {calls['round_trips']}, sessions {calls['sessions']}")
        assert (calls["round_trips"], calls["sessions"]) == (1, 0)
        skips = [row for row in rows_of(fresh_dsn, key) if row["outcome"] == "skipped"]
        assert len(skips) == 1

    def test_a_once_per_skip_opens_one_session(self, fresh_dsn, key):
        """--once-per: the check, the skip and its row, all on the lock session."""
        ensure_runs_table(fresh_dsn)
        first = jobrun_cli.run("--key", key, "--once-per", "1d", "--", "true", dsn=fresh_dsn)
        assert first.returncode == 0, first.stderr
        with SessionCounter(fresh_dsn) as counter:
            result = jobrun_cli.run("--key", key, "--once-per", "1d", "--", "true", dsn=fresh_dsn)
            assert result.returncode == 75, result.stderr
            assert counter.ended_since_start(1) == 1


#: A child that writes how many other sessions of its database are open (its own excepted).
OTHER_SESSIONS = """
import sys, psycopg
with psycopg.connect(sys.argv[1], autocommit=True) as conn:
    row = conn.execute(
        "SELECT count(*) FROM pg_stat_activity"
        " WHERE datname = current_database() AND pid <> pg_backend_pid()"
    ).fetchone()
open(sys.argv[2], "w").write(str(row[0]))
"""


#: A child that returns once the lease of its key has been renewed (one session of its own).
UNTIL_RENEWED = """
import sys, time, psycopg
with psycopg.connect(sys.argv[1], autocommit=True) as conn:
    while not conn.execute(
        "SELECT renewed_at > acquired_at FROM jobrun.leases WHERE key = %s", (sys.argv[2],)
    ).fetchone()[0]:
        time.sleep(0.02)
"""


class TestLeaseModeSessions:
    """Lease mode keeps one connection for the run (``--lease-connection kept``), lent to the
    history; per renewal, it holds none between statements."""

    def test_a_lease_run_opens_one_session(self, fresh_dsn, key):
        """A run: the attempt, the history's start and end and the release, over one
        connection. Both rows' calls went over it."""
        first = jobrun_cli.run("--mode", "lease", "--key", key, "--", "true", dsn=fresh_dsn)
        assert first.returncode == 0, first.stderr  # the schema exists from here on
        with SessionCounter(fresh_dsn) as counter:
            result = jobrun_cli.run(
                "--mode", "lease", "--key", key, "--log-level", "debug", "--", "true",
                dsn=fresh_dsn,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            run_sessions = counter.ended_since_start(1)
        print(f"lease mode: run {run_sessions} sessions")
        assert run_sessions == 1
        assert "history_failed" not in result.stderr
        calls = event(result.stderr, "history_calls")
        assert (calls["round_trips"], calls["sessions"]) == (2, 0)
        assert [row["outcome"] for row in rows_of(fresh_dsn, key)] == ["succeeded"] * 2

    def test_renewals_go_over_the_kept_connection(self, fresh_dsn, key):
        """However many beats and renewals: the run's one connection, and the child's own
        (which waits until it has seen its lease renewed)."""
        ensure_runs_table(fresh_dsn)
        first = jobrun_cli.run("--mode", "lease", "--key", key, "--", "true", dsn=fresh_dsn)
        assert first.returncode == 0, first.stderr  # the lease table exists from here on
        with SessionCounter(fresh_dsn) as counter:
            result = jobrun_cli.run(
                "--mode", "lease", "--heartbeat", "200ms", "--key", key, "--log-level", "debug",
                "--", sys.executable, "-c", UNTIL_RENEWED, fresh_dsn, key, dsn=fresh_dsn,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            beats = [e for e in events(result.stderr) if e["event"] == "lock_confirmed"]
            assert beats, result.stderr
            sessions = counter.ended_since_start(2)
        print(f"lease mode, kept: {len(beats)} beats, {sessions} sessions")
        assert sessions == 2
        assert "history_failed" not in result.stderr

    def test_each_renewal_opens_one_session_per_renewal(self, fresh_dsn, key):
        """--lease-connection per-renewal: attempt and release, plus one per renewal (and the
        child's own): never more than one connection per renewal."""
        ensure_runs_table(fresh_dsn)
        first = jobrun_cli.run("--mode", "lease", "--key", key, "--", "true", dsn=fresh_dsn)
        assert first.returncode == 0, first.stderr  # the lease table exists from here on
        with SessionCounter(fresh_dsn) as counter:
            result = jobrun_cli.run(
                "--mode", "lease", "--lease-connection", "per-renewal", "--heartbeat", "200ms",
                "--key", key, "--log-level", "debug",
                "--", sys.executable, "-c", UNTIL_RENEWED, fresh_dsn, key, dsn=fresh_dsn,
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            renewals = [e for e in events(result.stderr) if e["event"] == "lock_confirmed"]
            assert renewals, result.stderr
            sessions = counter.ended_since_start(2 + len(renewals) + 1)
        print(f"lease mode, per renewal: {len(renewals)} renewals, {sessions} sessions")
        assert sessions == 2 + len(renewals) + 1
        assert "history_failed" not in result.stderr

    @pytest.mark.parametrize(("connection", "open_meanwhile"), [("per-renewal", 0), ("kept", 1)])
    def test_connections_open_while_the_lease_child_runs(
        self, fresh_dsn, key, tmp_path, connection, open_meanwhile
    ):
        """Per renewal, the attempt's connection, lent to the history's start, is closed
        before the child starts (and the release's is opened only after it ended); kept,
        the run's one connection is the only one open."""
        ensure_runs_table(fresh_dsn)
        seen = tmp_path / "seen"
        # No renewal while the child looks: the first one is an hour away.
        result = jobrun_cli.run(
            "--mode", "lease", "--ttl", "3h", "--heartbeat", "1h", "--lease-connection",
            connection, "--key", key, "--",
            sys.executable, "-c", OTHER_SESSIONS, fresh_dsn, str(seen), dsn=fresh_dsn,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert seen.read_text() == str(open_meanwhile)

    def test_a_lease_skip_opens_one_session(self, fresh_dsn, key, tmp_path):
        """A skip: the attempt names the holder, and its connection carries the skip row."""
        ensure_runs_table(fresh_dsn)
        marker = tmp_path / "child"
        # No renewal while the skip is counted: its first heartbeat is an hour away, and
        # no connection of the holder's is open meanwhile (per renewal).
        holder = jobrun_cli.start(
            "--mode", "lease", "--ttl", "3h", "--heartbeat", "1h",
            "--lease-connection", "per-renewal", "--key", key, "--",
            *jobrun_cli.holder_marker(marker), dsn=fresh_dsn,
        )  # fmt: skip
        try:
            wait_for_file(marker)
            with SessionCounter(fresh_dsn) as counter:
                skip = jobrun_cli.run(
                    "--mode", "lease", "--key", key, "--log-level", "debug", "--", "true",
                    dsn=fresh_dsn,
                )  # fmt: skip
                assert skip.returncode == 75, skip.stderr
                skip_sessions = counter.ended_since_start(1)
        finally:
            jobrun_cli.signal_and_wait(holder, jobrun_cli.SIGTERM)
        print(f"lease mode: skip {skip_sessions} sessions")
        assert skip_sessions == 1
        assert event(skip.stderr, "skipped")["holder_pid"] == holder.pid
        calls = event(skip.stderr, "history_calls")
        assert (calls["round_trips"], calls["sessions"]) == (1, 0)
        skips = [row for row in rows_of(fresh_dsn, key) if row["outcome"] == "skipped"]
        assert len(skips) == 1

    def test_a_lease_once_per_skip_opens_one_session(self, fresh_dsn, key):
        """--once-per: the check, the already_ran skip row and the release, on the attempt's."""
        args = ("--mode", "lease", "--key", key, "--once-per", "1d", "--", "true")
        first = jobrun_cli.run(*args, dsn=fresh_dsn)
        assert first.returncode == 0, first.stderr
        with SessionCounter(fresh_dsn) as counter:
            result = jobrun_cli.run(*args, dsn=fresh_dsn)
            assert result.returncode == 75, result.stderr
            assert counter.ended_since_start(1) == 1
        assert event(result.stderr, "skipped")["reason"] == "already_ran"
        again = jobrun_cli.run("--mode", "lease", "--key", key, "--", "true", dsn=fresh_dsn)
        assert again.returncode == 0, again.stderr  # the lease was released

    @pytest.mark.parametrize(("connection", "sessions"), [("per-renewal", 3), ("kept", 1)])
    def test_a_lease_run_with_min_hold(self, fresh_dsn, key, connection, sessions):
        """--min-hold, per renewal: the end row is written before the hold on a connection
        of its own, the release after it on another: nothing is held open while the run
        waits. Kept: the run's one connection carries both (its beats go on in the hold)."""
        ensure_runs_table(fresh_dsn)
        args = ("--mode", "lease", "--lease-connection", connection, "--key", key,
                "--min-hold", "1s", "--", "true")  # fmt: skip
        first = jobrun_cli.run(*args, dsn=fresh_dsn)
        assert first.returncode == 0, first.stderr
        with SessionCounter(fresh_dsn) as counter:
            result = jobrun_cli.run(*args, dsn=fresh_dsn)
            assert result.returncode == 0, result.stderr
            assert counter.ended_since_start(sessions) == sessions
        assert event(result.stderr, "holding")["reason"] == "min_hold"
        assert [row["outcome"] for row in rows_of(fresh_dsn, key)] == ["succeeded"] * 2

    def test_a_lease_skip_with_slots_keeps_no_slot_connection(self, fresh_dsn, key, tmp_path):
        """--slots 2, both held: each slot's attempt closes its connection; the skip row
        takes one of its own (3 sessions), and is written."""
        ensure_runs_table(fresh_dsn)
        args = ("--mode", "lease", "--ttl", "3h", "--heartbeat", "1h", "--slots", "2")
        # The holders keep no connection open while the skip is counted (per renewal).
        holding = (*args, "--lease-connection", "per-renewal")
        holders = []
        try:
            for n in range(2):
                marker = tmp_path / f"child{n}"
                child = jobrun_cli.holder_marker(marker)
                holders.append(
                    jobrun_cli.start(*holding, "--key", key, "--", *child, dsn=fresh_dsn)
                )
                wait_for_file(marker)
            with SessionCounter(fresh_dsn) as counter:
                skip = jobrun_cli.run(*args, "--key", key, "--", "true", dsn=fresh_dsn)
                assert skip.returncode == 75, skip.stderr
                assert counter.ended_since_start(3) == 3
        finally:
            for holder in holders:
                jobrun_cli.signal_and_wait(holder, jobrun_cli.SIGTERM)
        assert "history_failed" not in skip.stderr
        skips = [row for row in rows_of(fresh_dsn, key) if row["outcome"] == "skipped"]
        assert len(skips) == 1


DEADLOCK_CHILD = """
import sys, threading, psycopg
dsn = sys.argv[1]
def count(conn):
    conn.execute("SELECT pg_stat_clear_snapshot()")
    return conn.execute(
        "SELECT deadlocks FROM pg_stat_database WHERE datname = current_database()"
    ).fetchone()[0]
watch = psycopg.connect(dsn, autocommit=True)
before = count(watch)
setup = psycopg.connect(dsn, autocommit=True)
setup.execute("CREATE TABLE IF NOT EXISTS dl (id int PRIMARY KEY)")
setup.execute("INSERT INTO dl VALUES (1), (2) ON CONFLICT DO NOTHING")
a, b = psycopg.connect(dsn), psycopg.connect(dsn)
a.execute("UPDATE dl SET id = id WHERE id = 1")
b.execute("UPDATE dl SET id = id WHERE id = 2")
errors = []
def cross(conn, row):
    try:
        conn.execute("UPDATE dl SET id = id WHERE id = %s", (row,))
    except psycopg.errors.DeadlockDetected as exc:
        errors.append(exc)
        conn.rollback()
        if conn.info.server_version >= 150000:
            # Report the count now, not at the next stats interval.
            conn.execute("SELECT pg_stat_force_next_flush()")
        conn.rollback()
t = threading.Thread(target=cross, args=(a, 2))
t.start()
while not setup.execute(
    "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'"
    " AND datname = current_database()"
).fetchone()[0]:
    pass
cross(b, 1)
t.join()
a.rollback(); b.rollback(); a.close(); b.close()
assert len(errors) == 1, errors
# The event, not a sleep: the counter shows it once the victim's backend reported it.
while count(watch) <= before:
    pass
print("deadlocked")
"""


class TestDeadlocksPerRun:
    """Each run records the deadlocks in its database while it ran."""

    def test_a_deadlock_during_the_run_is_counted_and_shown(self, fresh_dsn, key):
        """A real deadlock between two of the child's sessions: deadlocks 1 in the row,
        in history --json and the table, in status --json; a quiet run after it: 0."""
        result = jobrun_cli.run(
            "--key", key, "--", sys.executable, "-c", DEADLOCK_CHILD, fresh_dsn, dsn=fresh_dsn
        )
        assert result.returncode == 0, result.stderr
        assert event(result.stderr, "deadlocks_during_run")["count"] == 1
        assert rows_of(fresh_dsn, key)[0]["deadlocks"] == 1
        quiet = jobrun_cli.run("--key", key, "--", "true", dsn=fresh_dsn)
        assert quiet.returncode == 0, quiet.stderr
        history = jobrun_cli.run("history", key, "--json", dsn=fresh_dsn)
        assert [run["deadlocks"] for run in _json(history.stdout)] == [0, 1]
        table = jobrun_cli.run("history", key, dsn=fresh_dsn).stdout.splitlines()
        assert "DEADLOCKS" in table[0]
        status = jobrun_cli.run("status", key, "--json", dsn=fresh_dsn)
        assert _json(status.stdout)[0]["last_deadlocks"] == 0


def _json(text: str) -> list[dict[str, object]]:
    import json  # noqa: PLC0415

    return json.loads(text)


class TestOverlapping:
    """history KEY --overlapping OTHER: the runs of two keys that overlapped, from real runs."""

    def test_only_the_runs_that_overlapped(self, fresh_dsn, key, tmp_path):
        """A's run overlaps B's first run, not its second: one pair, both sides named."""
        other = f"{key}-other"
        marker, go = tmp_path / "a-running", tmp_path / "go"
        script = f'echo ran > "{marker}"; while [ ! -e "{go}" ]; do sleep 0.05; done'
        a = jobrun_cli.start("--key", key, "--", "sh", "-c", script, dsn=fresh_dsn)
        wait_for_file(marker)
        during = jobrun_cli.run("--key", other, "--", "true", dsn=fresh_dsn)
        assert during.returncode == 0, during.stderr
        go.write_text("go")
        _, a_stderr = a.communicate(timeout=60)
        assert a.returncode == 0, a_stderr
        after = jobrun_cli.run("--key", other, "--", "true", dsn=fresh_dsn)
        assert after.returncode == 0, after.stderr
        result = jobrun_cli.run(
            "history", key, "--overlapping", other, "--since", "1h", "--json", dsn=fresh_dsn
        )
        assert result.returncode == 0, result.stderr
        (pair,) = _json(result.stdout)
        assert pair["run_id"] == event(a_stderr, "started")["run_id"]
        assert pair["other_run_id"] == event(during.stderr, "started")["run_id"]
        assert (pair["outcome"], pair["other_outcome"]) == ("succeeded", "succeeded")
        assert pair["overlap"] >= 0
        assert pair["deadlocks"] == 0
        table = jobrun_cli.run("history", key, "--overlapping", other, dsn=fresh_dsn)
        assert len(table.stdout.splitlines()) == 2
        reverse = jobrun_cli.run("history", other, "--overlapping", key, "--json", dsn=fresh_dsn)
        assert [p["run_id"] for p in _json(reverse.stdout)] == [pair["other_run_id"]]

    def test_no_overlap_says_so(self, fresh_dsn, key):
        """Two keys that never ran at once: an empty list, exit 0."""
        for label in (key, f"{key}-other"):
            assert jobrun_cli.run("--key", label, "--", "true", dsn=fresh_dsn).returncode == 0
        result = jobrun_cli.run(
            "history", key, "--overlapping", f"{key}-other", "--json", dsn=fresh_dsn
        )
        assert (result.returncode, _json(result.stdout)) == (0, [])

    def test_since_without_overlapping_is_a_usage_error(self, fresh_dsn, key):
        """--since alone: exit 64, one line."""
        result = jobrun_cli.run("history", key, "--since", "1d", dsn=fresh_dsn)
        assert result.returncode == 64
        assert len(result.stderr.strip().splitlines()) == 1
