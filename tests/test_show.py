"""`jobrun show` takes a run id as `history` prints it, or a KEY."""

from __future__ import annotations

import json

import psycopg
import pytest

from harness import jobrun_cli
from support.history import ensure_runs_table


def _failed_run(key: str, dsn: str, text: str = "boom") -> str:
    """A failed run of ``key`` that kept its output; its run id."""
    result = jobrun_cli.run(
        "--key", key, "--keep-output", "1KiB", "--", "sh", "-c", f"echo {text}; exit 3", dsn=dsn
    )
    assert result.returncode == 3, result.stderr
    return str(jobrun_cli.event(result.stderr, "finished")["run_id"])


def _history_ids(key: str, dsn: str) -> list[str]:
    result = jobrun_cli.run("history", "--json", key, dsn=dsn)
    assert result.returncode == 0, result.stderr
    return [str(run["run_id"]) for run in json.loads(result.stdout)]


def _row(dsn: str, run_id: str, key: str) -> None:
    """A history row with a chosen run id (to make two ids share their first digits)."""
    ensure_runs_table(dsn)
    with psycopg.connect(dsn) as conn:
        conn.execute(
            "INSERT INTO jobrun.runs (run_id, key, lock_ids, mode, host, pid, started_at, outcome)"
            " VALUES (%s, %s, '{1}', 'session', 'h', 1, now(), 'failed')",
            (run_id, key),
        )


class TestRunIdsAsShown:
    """The 8 characters `history` prints, or any unique prefix of 4 or more, name a run."""

    @pytest.mark.parametrize("length", [8, 4, 13])
    def test_a_unique_prefix_shows_the_run(self, dsn, key, length):
        """`jobrun show aad808e5`: the run whose id starts so (hyphens may be left in)."""
        run_id = _failed_run(key, dsn)
        assert run_id in _history_ids(key, dsn)
        shown = jobrun_cli.run("show", run_id[:length], dsn=dsn)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"run {run_id} ")
        assert "boom" in shown.stdout

    def test_an_ambiguous_prefix_is_exit_64_listing_the_runs(self, dsn, key):
        """Two runs start with the same digits: exit 64, both named, nothing shown."""
        first, second = (
            "abcd1234-0000-4000-8000-000000000001",
            "abcd1234-0000-4000-8000-000000000002",
        )
        _row(dsn, first, key)
        _row(dsn, second, key)
        shown = jobrun_cli.run("show", "abcd1234", dsn=dsn)
        assert shown.returncode == 64
        assert first in shown.stderr
        assert second in shown.stderr
        assert "more digits" in shown.stderr
        assert shown.stdout == ""

    def test_an_unknown_prefix_is_exit_1(self, dsn, key):
        """No run starts with the digits (and no key is so named): one line, exit 1."""
        _failed_run(key, dsn)
        shown = jobrun_cli.run("show", "0000fffe", dsn=dsn)
        assert shown.returncode == 1
        assert "no run id starting with '0000fffe'" in shown.stderr
        assert len(shown.stderr.splitlines()) == 1

    def test_a_prefix_shorter_than_4_is_not_a_run_id(self, dsn, key):
        """Three digits name too many runs to be meant as one: read as a key, not found."""
        run_id = _failed_run(key, dsn)
        shown = jobrun_cli.run("show", run_id[:3], dsn=dsn)
        assert shown.returncode == 1
        assert "kept output" in shown.stderr

    def test_the_ambiguous_runs_are_listed_escaped(self, dsn, key):
        """A key another role wrote with an escape sequence is listed as \\x1b, not raw."""
        hostile = f"{key}\x1b[2J"
        _row(dsn, "abcd5678-0000-4000-8000-000000000001", hostile)
        _row(dsn, "abcd5678-0000-4000-8000-000000000002", hostile)
        shown = jobrun_cli.run("show", "abcd5678", dsn=dsn)
        assert shown.returncode == 64
        assert "\x1b" not in shown.stderr
        assert f"{key}\\x1b[2J" in shown.stderr


class TestShowKey:
    """`jobrun show KEY` shows the newest run of KEY that kept output."""

    def test_a_key_shows_its_newest_kept_output(self, dsn, key):
        """Two failed runs, then a success (which keeps nothing): the second failure."""
        _failed_run(key, dsn, "first")
        newest = _failed_run(key, dsn, "second")
        ok = jobrun_cli.run("--key", key, "--keep-output", "1KiB", "--", "true", dsn=dsn)
        assert ok.returncode == 0, ok.stderr
        shown = jobrun_cli.run("show", key, dsn=dsn)
        assert shown.returncode == 0, shown.stderr
        assert shown.stdout.startswith(f"run {newest} ")
        assert "second" in shown.stdout

    def test_a_key_without_kept_output_is_exit_1(self, dsn, key):
        """A key whose runs kept nothing: exit 1, saying so."""
        ok = jobrun_cli.run("--key", key, "--", "true", dsn=dsn)
        assert ok.returncode == 0, ok.stderr
        shown = jobrun_cli.run("show", key, dsn=dsn)
        assert shown.returncode == 1
        assert f"no run of {key} kept output" in shown.stderr
