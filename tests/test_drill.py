"""`jobrun drill` passes against a real database in both modes, and fails when it should."""

from __future__ import annotations

import pytest

from support import jobrun_cli


class TestDrill:
    """The crash-path rehearsal, end to end."""

    @pytest.mark.parametrize(
        "mode_args",
        [("--mode", "session"), ("--mode", "lease", "--ttl", "4s", "--kill-after", "1s")],
        ids=["session", "lease"],
    )
    def test_drill_passes_on_the_test_database(self, dsn, key, mode_args):
        """Every step passes and the exit status is 0."""
        result = jobrun_cli.run("drill", "--key", key, *mode_args, dsn=dsn, timeout=180)
        assert result.returncode == 0, result.stdout + result.stderr
        steps = [line for line in result.stdout.splitlines() if line.strip().startswith("[")]
        assert len(steps) >= 5
        assert all(line.strip().startswith("[PASS]") for line in steps), result.stdout
        assert "backend terminated" in result.stdout or "lease handed" in result.stdout

    def test_drill_fails_when_the_key_is_busy(self, dsn, key, tmp_path):
        """With the key held by someone else, the first step fails and so does the drill."""
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            jobrun_cli.wait_for_file(marker)
            result = jobrun_cli.run("drill", "--key", key, dsn=dsn, timeout=120)
        finally:
            jobrun_cli.signal_and_wait(holder, jobrun_cli.SIGTERM)
        assert result.returncode == 1
        assert "[FAIL] guarded run started" in result.stdout
        assert "drill FAILED" in result.stdout

    def test_drill_without_database_fails_cleanly(self, key):
        """An unreachable database: the drill fails with a checklist, no traceback."""
        result = jobrun_cli.run(
            "drill", "--key", key, "--connect-timeout", "1s", dsn="host=127.0.0.1 port=1"
        )
        assert result.returncode == 1
        assert "Traceback" not in result.stdout + result.stderr
        assert "[FAIL]" in result.stdout
