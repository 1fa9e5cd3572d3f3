"""Operators act on every key in every mode; a key a role was not granted is refused as such."""

from __future__ import annotations

import subprocess
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from harness import jobrun_cli
from support.tenants import Teams, alone, end, ok, running_run_id, victim

if TYPE_CHECKING:
    from collections.abc import Callable

#: ``stop --wait`` where the run is frozen and cannot hear: the wait is only to run out.
FROZEN_WAIT = "1s"


@pytest.fixture
def oncall(teams: Teams, role: Callable[..., str]) -> str:
    """A LOGIN role granted --operator (and nothing else: no pg_read_all_stats, no signals)."""
    dsn = role(database_dsn=teams.owner)
    ok(jobrun_cli.run("grant", Teams.role_of(dsn), "--operator", dsn=teams.owner))
    return dsn


@pytest.fixture
def nightly(teams: Teams) -> str:
    """team_a's key a-nightly, run once and recorded (a failed run that kept its output)."""
    failed = jobrun_cli.run(
        "--key", "a-nightly", "--keep-output", "4k", "--", "sh", "-c", "echo out; exit 3",
        dsn=teams.a,
    )  # fmt: skip
    assert failed.returncode == 3, failed.stderr
    return "a-nightly"


def _lock_backend(owner: str, key: str) -> int:
    """The backend pid of ``key``'s lock session (the owner sees every session)."""
    with psycopg.connect(owner) as conn:
        row = conn.execute(
            "SELECT pid FROM pg_stat_activity WHERE application_name = %s", (f"jobrun:{key}",)
        ).fetchone()
    assert row is not None, f"no lock session of {key}"
    return int(row[0])


def _one_line(result) -> str:
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    return lines[0]


class TestOperatorStopsAnyRun:
    """An --operator role stops a session-mode run of another role from jobrun's own records."""

    def test_stop_ends_another_role_session_run_with_77(self, teams, oncall, tmp_path):
        """team_a's session-mode run, stopped by oncall: exit 77, the request in oncall's name."""
        proc = victim(teams, "session", tmp_path / "child")
        try:
            run_id = running_run_id(teams.owner, "a-victim")
            stopped = jobrun_cli.run("stop", "a-victim", dsn=oncall)
            assert stopped.returncode == 0, stopped.stderr
            _, stderr = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                end(proc)
        assert proc.returncode == 77, stderr
        assert f"as role {Teams.role_of(oncall)}" in stopped.stderr
        with psycopg.connect(teams.owner) as conn:
            row = conn.execute(
                "SELECT r.outcome, r.exit_code, s.username FROM jobrun.runs AS r "
                "JOIN jobrun.stop_requests AS s USING (run_id) WHERE r.run_id = %s",
                (run_id,),
            ).fetchone()
        assert row == ("stopped", 77, Teams.role_of(oncall))

    def test_force_takes_the_lock_of_a_frozen_run_of_another_role(self, teams, oncall, tmp_path):
        """A SIGSTOPped run of team_a: oncall's stop --force terminates its lock session."""
        proc = victim(teams, "session", tmp_path / "child")
        running_run_id(teams.owner, "a-victim")
        proc.send_signal(jobrun_cli.signal.SIGSTOP)
        try:
            forced = jobrun_cli.run(
                "stop", "a-victim", "--wait", FROZEN_WAIT, "--force", dsn=oncall
            )
            assert forced.returncode == 3, forced.stderr
            assert "took its lock away" in forced.stderr
            again = jobrun_cli.run("--key", "a-victim", "--", "true", dsn=teams.a)
            assert again.returncode == 0, again.stderr
        finally:
            proc.send_signal(jobrun_cli.signal.SIGCONT)
            try:
                _, stderr = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                end(proc)  # it never lost its lock: the assertions above say why
                raise
        assert proc.returncode == 76, stderr

    def test_force_names_the_grant_where_the_owner_may_not_terminate(
        self, fresh_dsn, role, tmp_path
    ):
        """Owner neither superuser nor in pg_signal_backend: --force is 69, naming the grant."""
        database = conninfo_to_dict(fresh_dsn)["dbname"]
        owner = role(f'GRANT CREATE ON DATABASE "{database}" TO {{role}}', database_dsn=fresh_dsn)
        ok(jobrun_cli.run("init", dsn=owner))
        team_a, operator = role(database_dsn=fresh_dsn), role(database_dsn=fresh_dsn)
        ok(jobrun_cli.run("grant", Teams.role_of(team_a), "--keys", "a-*", dsn=owner))
        ok(jobrun_cli.run("grant", Teams.role_of(operator), "--operator", dsn=owner))
        teams = Teams(owner=owner, a=team_a, b=operator)
        proc = victim(teams, "session", tmp_path / "child")
        running_run_id(owner, "a-victim")
        proc.send_signal(jobrun_cli.signal.SIGSTOP)
        try:
            forced = jobrun_cli.run(
                "stop", "a-victim", "--wait", FROZEN_WAIT, "--force", dsn=operator
            )
            assert forced.returncode == 69, forced.stderr
            assert "grant pg_signal_backend to the owner" in forced.stderr.splitlines()[-1]
            alone(teams, "session")
        finally:
            proc.send_signal(jobrun_cli.signal.SIGCONT)
            end(proc)

    def test_take_lock_away_called_without_a_stop_request_terminates_nothing(self, teams, tmp_path):
        """team_b calls jobrun.take_lock_away on team_a's run by hand: refused, the run goes on."""
        proc = victim(teams, "session", tmp_path / "child")
        try:
            run_id = running_run_id(teams.owner, "a-victim")
            backend = _lock_backend(teams.owner, "a-victim")
            with (
                psycopg.connect(teams.b, autocommit=True) as conn,
                pytest.raises(psycopg.errors.InsufficientPrivilege),
            ):
                conn.execute("SELECT jobrun.take_lock_away(%s, %s)", (run_id, backend))
            alone(teams, "session")
            assert proc.poll() is None
        finally:
            end(proc)


class TestRefusedAsNotGranted:
    """A key of another team is refused as not granted (69, one line), never as a typo."""

    @pytest.mark.parametrize(
        "command",
        [("pause",), ("resume",), ("stop",), ("forget", "--yes"), ("show",)],
        ids=["pause", "resume", "stop", "forget", "show"],
    )
    def test_a_recorded_key_of_another_team_is_not_granted(self, teams, nightly, command):
        """team_b's pause, resume, stop, forget and show of a-nightly: 69, naming the grant."""
        refused = jobrun_cli.run(*command, nightly, dsn=teams.b)
        assert refused.returncode == 69, refused.stderr
        line = _one_line(refused)
        role_b = Teams.role_of(teams.b)
        assert f"role {role_b} is not granted {nightly}" in line
        assert f"jobrun grant {role_b} --keys {nightly}" in line
        assert "spelled" not in line

    def test_pause_new_of_another_team_key_is_not_granted(self, teams):
        """team_b's pause --new of a key it was not granted: 69, the grant named, nothing paused."""
        refused = jobrun_cli.run("pause", "--new", "a-later", dsn=teams.b)
        assert refused.returncode == 69, refused.stderr
        assert f"role {Teams.role_of(teams.b)} is not granted a-later" in _one_line(refused)
        with psycopg.connect(teams.owner) as conn:
            assert conn.execute("SELECT count(*) FROM jobrun.pauses").fetchone() == (0,)

    @pytest.mark.parametrize("mode", ["session", "lease"])
    def test_stop_force_of_a_running_key_of_another_team_is_not_granted(
        self, teams, tmp_path, mode
    ):
        """team_b's stop --force of team_a's live run: 69 not granted; the run goes on."""
        proc = victim(teams, mode, tmp_path / "child")
        try:
            refused = jobrun_cli.run("stop", "a-victim", "--wait", "1s", "--force", dsn=teams.b)
            assert refused.returncode == 69, refused.stderr
            assert f"role {Teams.role_of(teams.b)} is not granted a-victim" in _one_line(refused)
            alone(teams, mode)
            assert proc.poll() is None
        finally:
            end(proc)

    @pytest.mark.parametrize(
        ("command", "dsn_of"),
        [(("pause",), "a"), (("stop",), "oncall")],
        ids=["team_a pause", "operator stop"],
    )
    def test_a_granted_role_typo_keeps_its_answer(self, teams, oncall, command, dsn_of):
        """A key nobody ran, asked by a role granted it: exit 1, is the key spelled right?"""
        dsn = oncall if dsn_of == "oncall" else teams.a
        typo = jobrun_cli.run(*command, "a-nightlyy", dsn=dsn)
        assert typo.returncode == 1, typo.stderr
        assert "is the key spelled right?" in _one_line(typo)
