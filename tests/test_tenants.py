"""Teams sharing one database: after jobrun init and jobrun grant, PostgreSQL keeps them apart."""

from __future__ import annotations

import json
import uuid
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql

from harness import jobrun_cli
from harness.jobrun_cli import event, wait_until
from jobrun.keys import lock_id_for
from support.tenants import Teams, alone, end, ok, running_run_id, victim

if TYPE_CHECKING:
    import datetime as dt

MODES = ("session", "lease")


def _beats_after(owner: str, key: str, moment: dt.datetime, beats: int = 2) -> None:
    """Wait until ``key``'s run has sent ``beats`` heartbeats that began after ``moment``."""
    seen: set[dt.datetime] = set()

    def beat() -> bool:
        with psycopg.connect(owner) as conn:
            row = conn.execute(
                "SELECT query_start FROM pg_stat_activity WHERE application_name = %s "
                "AND state = 'idle' AND query LIKE '%%stop_requests%%'",
                (f"jobrun:{key}",),
            ).fetchone()
        if row and row[0] > moment:
            seen.add(row[0])
        return len(seen) >= beats

    wait_until(beat, what=f"{beats} heartbeats of {key}")


def _now(dsn: str) -> dt.datetime:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT clock_timestamp()").fetchone()
    assert row is not None
    return row[0]


def _sql(dsn: str, statement: str, params=None) -> str | None:
    """Run ``statement`` as the DSN's role; the error's SQLSTATE, or None when it went through."""
    try:
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(statement, params)
    except psycopg.Error as exc:
        return exc.sqlstate
    return None


class TestAttacksOfAnotherTeam:
    """team_b replays every known attack on team_a's key: each fails or is harmless."""

    def test_deleting_every_lease_leaves_team_a_alone(self, teams, tmp_path):
        """DELETE FROM jobrun.leases deletes none of team_a's: its next run still skips."""
        proc = victim(teams, "lease", tmp_path / "child")
        try:
            with psycopg.connect(teams.b, autocommit=True) as conn:
                deleted = conn.execute("DELETE FROM jobrun.leases").rowcount
            assert deleted == 0
            alone(teams, "lease")
            assert proc.poll() is None
        finally:
            end(proc)

    def test_a_lease_row_for_team_a_lock_id_is_refused(self, teams):
        """A lease under team_b's own key but on team_a's lock id would block team_a."""
        forged = _sql(
            teams.b,
            "INSERT INTO jobrun.leases VALUES (%s, 'b-mine', gen_random_uuid(), 'h', 1, "
            "now(), now(), now() + interval '1 hour')",
            (lock_id_for("a-victim"),),
        )
        assert forged == "42501"
        ok(jobrun_cli.run("--key", "a-victim", "--mode", "lease", "--", "true", dsn=teams.a))

    @pytest.mark.parametrize("mode", MODES)
    def test_jobrun_stop_of_team_a_run_stops_nothing(self, teams, tmp_path, mode):
        """team_b's stop --force of team_a's run: refused, team_b is not granted the key (69).

        The database says so (jobrun.allowed) before anything is looked up or written, in
        both modes; the run goes on.
        """
        proc = victim(teams, mode, tmp_path / "child")
        try:
            stopped = jobrun_cli.run("stop", "a-victim", "--wait", "1s", "--force", dsn=teams.b)
            assert stopped.returncode == 69, stopped.stderr
            assert "is not granted a-victim" in stopped.stderr
            alone(teams, mode)
            assert proc.poll() is None
        finally:
            end(proc)

    def test_resume_of_team_a_pause_leaves_it_paused(self, teams):
        """team_b's resume of team_a's paused key deletes nothing: team_a's runs still skip."""
        ok(jobrun_cli.run("pause", "--new", "a-victim", dsn=teams.a))
        resumed = jobrun_cli.run("resume", "a-victim", dsn=teams.b)
        # team_b sees no row of the key, but the database says why: not granted, not a typo.
        assert resumed.returncode == 69, resumed.stderr
        assert "is not granted a-victim" in resumed.stderr
        skipped = jobrun_cli.run("--key", "a-victim", "--", "true", dsn=teams.a)
        assert skipped.returncode == 75, skipped.stderr
        assert event(skipped.stderr, "skipped")["reason"] == "paused"

    def test_stop_request_for_team_a_key_is_refused(self, teams, tmp_path):
        """An INSERT into stop_requests naming team_a's key fails (row-level security)."""
        proc = victim(teams, "session", tmp_path / "child")
        try:
            run_id = running_run_id(teams.owner, "a-victim")
            refused = _sql(
                teams.b,
                "INSERT INTO jobrun.stop_requests (run_id, key, host, username, pid) "
                "VALUES (%s, 'a-victim', 'h', 'root', 1)",
                (run_id,),
            )
            assert refused == "42501"
            alone(teams, "session")
        finally:
            end(proc)

    def test_stop_request_under_team_b_key_does_not_reach_team_a_run(self, teams, tmp_path):
        """A request for team_a's run id written under a b- key is never read by that run."""
        proc = victim(teams, "session", tmp_path / "child")
        try:
            run_id = running_run_id(teams.owner, "a-victim")
            written = _now(teams.owner)
            forged = _sql(
                teams.b,
                "INSERT INTO jobrun.stop_requests (run_id, key, host, username, pid) "
                "VALUES (%s, 'b-mine', 'h', 'root', 1)",
                (run_id,),
            )
            assert forged is None
            _beats_after(teams.owner, "a-victim", written)
            assert proc.poll() is None
            alone(teams, "session")
        finally:
            end(proc)

    def test_a_squatted_stop_request_is_reported_not_waited_on(self, teams, tmp_path):
        """team_b took team_a's run id under a b- key first: team_a's stop says so, exit 3."""
        proc = victim(teams, "session", tmp_path / "child")
        try:
            run_id = running_run_id(teams.owner, "a-victim")
            assert (
                _sql(
                    teams.b,
                    "INSERT INTO jobrun.stop_requests (run_id, key, host, username, pid) "
                    "VALUES (%s, 'b-mine', 'h', 'root', 1)",
                    (run_id,),
                )
                is None
            )
            stopped = jobrun_cli.run("stop", "a-victim", "--wait", "1s", dsn=teams.a)
            assert stopped.returncode == 3, stopped.stderr
            assert "in the way" in stopped.stderr
            assert len(stopped.stderr.strip().splitlines()) == 1, stopped.stderr
        finally:
            end(proc)

    def test_pause_of_team_a_key_is_refused(self, teams):
        """jobrun pause a-victim as team_b fails, and team_a's next run goes ahead."""
        paused = jobrun_cli.run("pause", "--new", "a-victim", dsn=teams.b)
        assert paused.returncode == 69, paused.stderr
        assert "is not granted a-victim" in paused.stderr
        ok(jobrun_cli.run("--key", "a-victim", "--", "true", dsn=teams.a))

    def test_forged_success_does_not_make_once_per_skip(self, teams):
        """A fake succeeded row for team_a's key is refused; --once-per 1d still runs."""
        forged = _sql(
            teams.b,
            "INSERT INTO jobrun.runs (run_id, key, lock_ids, mode, host, pid, started_at, "
            "outcome) VALUES (gen_random_uuid(), 'a-victim', %s, 'session', 'h', 1, now(), "
            "'succeeded')",
            ([lock_id_for("a-victim")],),
        )
        assert forged == "42501"
        ran = jobrun_cli.run("--key", "a-victim", "--once-per", "1d", "--", "true", dsn=teams.a)
        assert ran.returncode == 0, ran.stderr

    def test_team_b_reads_none_of_team_a_rows(self, teams, tmp_path):
        """Every jobrun table shows team_b none of team_a's rows."""
        ok(jobrun_cli.run("--key", "a-victim", "--expect-every", "1d", "--", "true",
                           dsn=teams.a))  # fmt: skip
        ok(jobrun_cli.run("pause", "a-victim", dsn=teams.a))
        proc = victim(teams, "lease", tmp_path / "child", key="a-other")
        try:
            with psycopg.connect(teams.b) as conn:
                for table in ("runs", "leases", "pauses", "expectations", "stop_requests"):
                    statement = sql.SQL("SELECT count(*) FROM jobrun.{}").format(
                        sql.Identifier(table)
                    )
                    count = conn.execute(statement).fetchone()
                    assert count == (0,), table
        finally:
            end(proc)

    @pytest.mark.parametrize("as_owner", [False, True], ids=["team_b", "owner"])
    def test_stop_of_a_decoy_key_never_stops_another_key_run(self, teams, role, tmp_path, as_owner):
        """A CONNECT-only session holds b-decoy naming a-victim's run: stop b-decoy refuses."""
        proc = victim(teams, "session", tmp_path / "child")
        decoy_dsn = role(database_dsn=teams.owner)
        try:
            run_id = running_run_id(teams.owner, "a-victim")
            comment = json.dumps({"run_id": run_id, "host": "decoy", "pid": 1})
            with psycopg.connect(decoy_dsn, autocommit=True) as decoy:
                decoy.execute(
                    f"/* jobrun-holder {comment} */ SELECT pg_advisory_lock(%s)",
                    (lock_id_for("b-decoy"),),
                )
                stopped = jobrun_cli.run(
                    "stop", "b-decoy", "--wait", "1s", dsn=teams.owner if as_owner else teams.b
                )
            assert stopped.returncode in {1, 3}, stopped.stderr
            assert proc.poll() is None
            with psycopg.connect(teams.owner) as conn:
                requests = conn.execute(
                    "SELECT count(*) FROM jobrun.stop_requests WHERE run_id = %s", (run_id,)
                ).fetchone()
            assert requests == (0,)
            alone(teams, "session")
        finally:
            end(proc)


class TestWhoAsked:
    """Stop and pause record the database role, whatever $USER or the row says."""

    def test_stop_records_the_role_not_user(self, teams, tmp_path):
        """USER=root jobrun stop: requested by team_a's role, root only as a claim."""
        proc = victim(teams, "session", tmp_path / "child")
        try:
            stopped = jobrun_cli.run("stop", "a-victim", dsn=teams.a, env={"USER": "root"})
            assert stopped.returncode == 0, stopped.stderr
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                end(proc)
        role_a = Teams.role_of(teams.a)
        assert f"as role {role_a}" in stopped.stderr
        with psycopg.connect(teams.owner) as conn:
            row = conn.execute("SELECT username, claimed_user FROM jobrun.stop_requests").fetchone()
        assert row == (role_a, "root")
        assert proc.returncode == 77, stderr

    def test_a_forged_requester_is_replaced_by_the_role(self, teams):
        """A pause row written by hand with username 'root' records team_b's role."""
        forged = _sql(
            teams.b,
            "INSERT INTO jobrun.pauses (key, host, username, pid) VALUES ('b-x', 'h', 'root', 1)",
        )
        assert forged is None
        with psycopg.connect(teams.owner) as conn:
            row = conn.execute("SELECT username FROM jobrun.pauses WHERE key = 'b-x'").fetchone()
        assert row == (Teams.role_of(teams.b),)

    def test_pause_shows_the_role(self, teams):
        """jobrun pause says which role paused the key."""
        paused = jobrun_cli.run("pause", "--new", "b-x", dsn=teams.b, env={"USER": "root"})
        ok(paused)
        assert f"(by role {Teams.role_of(teams.b)})" in paused.stdout


class TestReaders:
    """A reader sees status and history of every key, never the output runs kept."""

    def test_reader_sees_history_but_not_kept_output(self, teams, role):
        """status and history work; show of a run's kept output is refused in one line."""
        failed = jobrun_cli.run(
            "--key", "a-out", "--keep-output", "4k", "--", "sh", "-c", "echo secret; exit 3",
            dsn=teams.a,
        )  # fmt: skip
        assert failed.returncode == 3, failed.stderr
        run_id = event(failed.stderr, "finished")["run_id"]
        reader = role(database_dsn=teams.owner)
        ok(jobrun_cli.run("grant", Teams.role_of(reader), "--reader", dsn=teams.owner))
        status = jobrun_cli.run("status", dsn=reader)
        ok(status)
        assert "a-out" in status.stdout
        history = jobrun_cli.run("history", "a-out", dsn=reader)
        ok(history)
        assert "failed" in history.stdout
        shown = jobrun_cli.run("show", run_id, dsn=reader)
        assert shown.returncode == 69
        assert "secret" not in shown.stdout + shown.stderr
        assert len(shown.stderr.strip().splitlines()) == 1, shown.stderr
        assert "may not read" in shown.stderr or "may read the history but not" in shown.stderr
        owner_view = jobrun_cli.run("show", run_id, dsn=teams.a)
        assert "secret" in owner_view.stdout


class TestSetUp:
    """init and grant themselves: idempotent, printable, reversible, checked."""

    def test_history_written_before_init_stays_readable(self, fresh_dsn, role):
        """Runs recorded by the single owner before init are read by the team granted them."""
        ok(jobrun_cli.run("--key", "a-old", "--", "true", dsn=fresh_dsn))
        ok(jobrun_cli.run("init", dsn=fresh_dsn))
        ok(jobrun_cli.run("init", dsn=fresh_dsn))
        team_a = role(database_dsn=fresh_dsn)
        ok(jobrun_cli.run("grant", Teams.role_of(team_a), "--keys", "a-*", dsn=fresh_dsn))
        history = jobrun_cli.run("history", "a-old", "--json", dsn=team_a)
        ok(history)
        assert [run["outcome"] for run in json.loads(history.stdout)] == ["succeeded"]

    def test_print_sql_prints_and_changes_nothing(self, fresh_dsn, role):
        """init --print-sql and grant --print-sql print SQL; the database stays as it was."""
        team = Teams.role_of(role(database_dsn=fresh_dsn))
        init = jobrun_cli.run("init", "--print-sql", dsn=fresh_dsn)
        ok(init)
        assert "ENABLE ROW LEVEL SECURITY" in init.stdout
        with psycopg.connect(fresh_dsn) as conn:
            schema = conn.execute("SELECT to_regnamespace('jobrun')").fetchone()
        assert schema == (None,)
        ok(jobrun_cli.run("init", dsn=fresh_dsn))
        grant = jobrun_cli.run("grant", team, "--keys", "a-*", "--print-sql", dsn=fresh_dsn)
        ok(grant)
        assert "INSERT INTO jobrun.grants" in grant.stdout
        assert "'a-%'" in grant.stdout
        with psycopg.connect(fresh_dsn) as conn:
            rows = conn.execute("SELECT count(*) FROM jobrun.grants WHERE role = %s", (team,))
            assert rows.fetchone() == (0,)

    def test_grant_and_revoke_round_trip(self, teams):
        """After --revoke team_b's runs are refused (69); granted again, they run and record."""
        team_b = Teams.role_of(teams.b)
        ok(jobrun_cli.run("grant", team_b, "--revoke", dsn=teams.owner))
        revoked = jobrun_cli.run("--key", "b-x", "--", "true", dsn=teams.b)
        assert revoked.returncode == 69, revoked.stderr
        assert event(revoked.stderr, "lockstore_unavailable")["reason"] == "not_granted"
        ok(jobrun_cli.run("grant", team_b, "--keys", "b-*", dsn=teams.owner))
        granted = jobrun_cli.run("--key", "b-x", "--", "true", dsn=teams.b)
        assert granted.returncode == 0, granted.stderr
        assert "history_failed" not in granted.stderr

    def test_grants_lists_who_may_do_what(self, teams):
        """jobrun grants lists each team's pattern and jobrun's own roles."""
        listed = jobrun_cli.run("grants", "--json", dsn=teams.owner)
        ok(listed)
        rows = {(row["role"], row["kind"], row["pattern"]) for row in json.loads(listed.stdout)}
        assert (Teams.role_of(teams.a), "job", "a-*") in rows
        assert (Teams.role_of(teams.b), "job", "b-*") in rows
        table = jobrun_cli.run("grants", dsn=teams.owner)
        assert Teams.role_of(teams.a) in table.stdout

    @pytest.mark.parametrize(
        "args",
        [
            ("no_such_role_" + uuid.uuid4().hex[:8], "--keys", "a-*"),
            ("{team}", "--keys", "a,b"),
            ("{team}", "--keys", ""),
            ("{team}", "--keys", "a-\x07"),
            ("public", "--keys", "a-*"),
            ("{team}",),
        ],
        ids=["unknown role", "comma", "empty pattern", "control character", "public", "nothing"],
    )
    def test_bad_role_or_pattern_exits_64_in_one_line(self, teams, args):
        """A role that does not exist, or a pattern no key can match: exit 64, one line."""
        team = Teams.role_of(teams.a)
        result = jobrun_cli.run("grant", *(arg.format(team=team) for arg in args), dsn=teams.owner)
        assert result.returncode == 64, result.stderr
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr

    def test_doctor_names_the_missing_fence_grant(self, teams):
        """A job role without USAGE on jobrun.fence: doctor FAILs and names jobrun grant."""
        with psycopg.connect(teams.owner, autocommit=True) as conn:
            conn.execute(f'REVOKE USAGE ON SEQUENCE jobrun.fence FROM "{Teams.role_of(teams.a)}"')
        doctor = jobrun_cli.run("doctor", dsn=teams.a)
        assert doctor.returncode == 1, doctor.stdout
        line = next(line for line in doctor.stdout.splitlines() if "jobrun.fence" in line)
        assert line.startswith("FAIL")
        assert f"jobrun grant {Teams.role_of(teams.a)} --keys" in line

    def test_doctor_warns_of_tables_shared_without_row_level_security(self, fresh_dsn, role):
        """Tables granted as older docs said, without jobrun init: doctor WARNs, names init."""
        ok(jobrun_cli.run("--key", "a-x", "--", "true", dsn=fresh_dsn))
        team = role(
            "GRANT USAGE ON SCHEMA jobrun TO {role}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA jobrun TO {role}",
            database_dsn=fresh_dsn,
        )
        doctor = jobrun_cli.run("doctor", dsn=team)
        line = next(line for line in doctor.stdout.splitlines() if " tenancy " in line)
        assert line.startswith("WARN")
        assert "jobrun init" in line


class TestStatus:
    """status names who holds a key in session mode: the holder's database role."""

    def test_status_names_the_session_holder_role(self, teams, role):
        """A squatter of team_a's lock id is shown with its own role, by any team."""
        squatter_dsn = role(database_dsn=teams.owner)
        with psycopg.connect(squatter_dsn, autocommit=True) as squatter:
            squatter.execute("SELECT pg_advisory_lock(%s)", (lock_id_for("a-victim"),))
            status = jobrun_cli.run("status", "a-victim", "--json", dsn=teams.a)
            table = jobrun_cli.run("status", "a-victim", dsn=teams.b)
        ok(status)
        (row,) = json.loads(status.stdout)
        assert row["holder"]["role"] == Teams.role_of(squatter_dsn)
        assert f"(role {Teams.role_of(squatter_dsn)})" in table.stdout
