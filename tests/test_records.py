"""What is recorded of a key: a mistyped KEY is caught, a retired key can be forgotten."""

from __future__ import annotations

import os
import pty
import subprocess

import psycopg
import pytest

from harness import jobrun_cli
from harness.jobrun_cli import wait_for_file
from jobrun.keys import lock_id_for
from support.history import rows_of

MODES = ("session", "lease")


def _ran(key: str, dsn: str, *args: str, command: tuple[str, ...] = ("true",)) -> None:
    """One finished run of ``key``."""
    result = jobrun_cli.run("--key", key, *args, "--", *command, dsn=dsn)
    assert result.returncode in {0, 1}, result.stderr


def _count(dsn: str, table: str, key: str) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(f"SELECT count(*) FROM jobrun.{table} WHERE key = %s", (key,)).fetchone()  # noqa: S608 - the tests' own table names
    assert row is not None
    return int(row[0])


class TestTyposAreCaught:
    """A KEY that no run ever recorded is refused with one line, exit 1."""

    @pytest.mark.parametrize(
        "argv",
        [("status", "--check"), ("pause",), ("stop",), ("resume",)],
        ids=["status--check", "pause", "stop", "resume"],
    )
    def test_a_key_never_recorded_is_exit_1(self, dsn, key, argv):
        """`jobrun pause typo-key` and friends: "no run of KEY was ever recorded", exit 1."""
        _ran(key, dsn)  # the history exists; the typo is not in it
        typo = f"{key}-typo"
        result = jobrun_cli.run(*argv, typo, dsn=dsn)
        assert result.returncode == 1, result.stderr
        assert f"no run of {typo} was ever recorded" in result.stderr
        assert _count(dsn, "pauses", typo) == 0

    def test_pause_new_pauses_a_job_that_has_not_run_yet(self, dsn, key):
        """--new: the pause is written, and resume then knows the key."""
        paused = jobrun_cli.run("pause", "--new", key, dsn=dsn)
        assert paused.returncode == 0, paused.stderr
        resumed = jobrun_cli.run("resume", key, dsn=dsn)
        assert (resumed.returncode, resumed.stdout) == (0, f"resumed {key}\n"), resumed.stderr

    @pytest.mark.parametrize("mode", MODES)
    def test_a_held_key_without_history_counts_as_recorded(self, dsn, key, tmp_path, mode):
        """A --no-history run leaves no row: its lock or lease makes the key known."""
        marker = tmp_path / "child"
        proc = jobrun_cli.start(
            "--key", key, "--mode", mode, "--no-history", "--",
            *jobrun_cli.holder_marker(marker), dsn=dsn,
        )  # fmt: skip
        try:
            wait_for_file(marker, proc=proc)
            result = jobrun_cli.run("pause", key, dsn=dsn)
        finally:
            proc.kill()
            proc.communicate()
        assert result.returncode == 0, result.stderr

    def test_status_check_of_a_recorded_key_is_quiet(self, dsn, key):
        """A key that ran and succeeded: --check exits 0, nothing on stderr."""
        _ran(key, dsn)
        result = jobrun_cli.run("status", "--check", key, dsn=dsn)
        assert (result.returncode, result.stderr) == (0, ""), result.stderr


class TestForget:
    """jobrun forget KEY: a retired key's history, pauses, expectations and output go."""

    def test_forget_removes_every_row_and_counts_them(self, dsn, key):
        """Runs (with kept output), a skip-free history, a pause, an expectation: all gone."""
        _ran(key, dsn, "--expect-every", "1h")
        _ran(key, dsn, "--keep-output", "1KiB", command=("sh", "-c", "echo boom; exit 1"))
        assert jobrun_cli.run("pause", key, dsn=dsn).returncode == 0
        other = f"{key}-other"
        _ran(other, dsn)
        result = jobrun_cli.run("forget", key, "--yes", dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert result.stdout == (
            f"forgot {key}: 2 runs (1 with kept output), 0 skips, 1 pause, 1 expectation, "
            "0 stop requests, 0 expired leases\n"
        )
        assert rows_of(dsn, key) == []
        assert _count(dsn, "pauses", key) == _count(dsn, "expectations", key) == 0
        assert len(rows_of(dsn, other)) == 1

    def test_a_forgotten_key_is_unknown_again(self, dsn, key):
        """After forget, status --check says the key was never recorded."""
        _ran(key, dsn)
        assert jobrun_cli.run("forget", key, "--yes", dsn=dsn).returncode == 0
        result = jobrun_cli.run("status", "--check", key, dsn=dsn)
        assert result.returncode == 1
        assert f"no run of {key} was ever recorded" in result.stderr

    @pytest.mark.parametrize("mode", MODES)
    def test_a_held_key_is_not_forgotten(self, dsn, key, tmp_path, mode):
        """While a run holds the key (lock or live lease): refused, exit 1, nothing removed."""
        _ran(key, dsn)
        marker = tmp_path / "child"
        proc = jobrun_cli.start(
            "--key", key, "--mode", mode, "--", *jobrun_cli.holder_marker(marker), dsn=dsn
        )
        try:
            wait_for_file(marker, proc=proc)
            result = jobrun_cli.run("forget", key, "--yes", dsn=dsn)
        finally:
            proc.kill()
            proc.communicate()
        assert result.returncode == 1
        assert f"{key} is held by" in result.stderr
        assert "jobrun stop" in result.stderr
        assert len(result.stderr.splitlines()) == 1
        assert len(rows_of(dsn, key)) == 2  # the finished run and the one that held it

    def test_without_yes_off_a_terminal_it_refuses(self, dsn, key):
        """No terminal to ask on, no --yes: exit 64, saying to add --yes; nothing removed."""
        _ran(key, dsn)
        result = jobrun_cli.run("forget", key, dsn=dsn)
        assert result.returncode == 64
        assert "--yes" in result.stderr
        assert len(rows_of(dsn, key)) == 1

    @pytest.mark.parametrize(("answer", "removed"), [("y", True), ("n", False)])
    def test_on_a_terminal_it_asks(self, dsn, key, answer, removed):
        """Without --yes on a terminal: asks, and removes only on yes."""
        _ran(key, dsn)
        leader, follower = pty.openpty()
        proc = subprocess.Popen(
            [*jobrun_cli.JOBRUN, "forget", key],
            env=jobrun_cli.environment(dsn),
            stdin=follower,
            stdout=follower,
            stderr=follower,
        )
        os.close(follower)
        seen = b""
        try:
            while b"[y/N]" not in seen:
                seen += os.read(leader, 1024)  # OSError once jobrun ends without asking
            os.write(leader, answer.encode() + b"\n")
            assert proc.wait(timeout=60) == (0 if removed else 1)
        finally:
            proc.kill()
            proc.wait()
            os.close(leader)
        assert (rows_of(dsn, key) == []) is removed

    def test_a_role_that_may_only_read_cannot_forget(self, dsn, key, role):
        """Without DELETE on jobrun.runs: exit 69, one line, every row still there."""
        _ran(key, dsn)
        reader = role(
            "GRANT USAGE ON SCHEMA jobrun TO {role}",
            "GRANT SELECT ON ALL TABLES IN SCHEMA jobrun TO {role}",
        )
        result = jobrun_cli.run("forget", key, "--yes", dsn=reader)
        assert result.returncode == 69, result.stderr
        assert len(result.stderr.splitlines()) == 1
        assert len(rows_of(dsn, key)) == 1

    def test_the_lease_holder_is_named_escaped(self, dsn, key):
        """A live lease whose host holds an escape sequence: named as \\x1b, never raw."""
        _ran(key, dsn, "--mode", "lease")  # creates jobrun.leases
        with psycopg.connect(dsn) as conn:
            conn.execute(
                "INSERT INTO jobrun.leases VALUES (%s, %s, gen_random_uuid(), %s, 1, now(), now(),"
                " now() + interval '1 hour')",
                (lock_id_for(key), key, "host\x1b[2J"),
            )
        result = jobrun_cli.run("forget", key, "--yes", dsn=dsn)
        assert result.returncode == 1
        assert "\x1b" not in result.stderr
        assert "host\\x1b[2J" in result.stderr
