"""--jitter: a delay before the lock, the same for a host and key, with nothing held."""

from __future__ import annotations

import hashlib
import json
import signal
from typing import TYPE_CHECKING, Any

import psycopg
import pytest

from harness import jobrun_cli
from jobrun import db
from jobrun.run import pacing

if TYPE_CHECKING:
    import subprocess

MODES = ("session", "lease")


def _first(proc: subprocess.Popen[str], name: str) -> dict[str, Any]:
    assert proc.stderr is not None
    for line in proc.stderr:
        found = json.loads(line)
        if found["event"] == name:
            return dict(found)
    msg = f"jobrun ended (status {proc.wait()}) before {name!r}"
    raise AssertionError(msg)


class TestDelay:
    def test_fixed_the_same_for_a_host_and_key_and_within_the_window(self):
        one = pacing.jitter_delay(60.0, "nightly", fresh=False, seed="m1\nhost-a")
        assert one == pacing.jitter_delay(60.0, "nightly", fresh=False, seed="m1\nhost-a")
        assert 0 <= one < 60
        others = {
            pacing.jitter_delay(60.0, "nightly", fresh=False, seed=f"m1\nhost-{n}")
            for n in range(50)
        } | {pacing.jitter_delay(60.0, f"k{n}", fresh=False, seed="m1\nhost-a") for n in range(50)}
        assert len(others) == 100  # hosts and keys spread over the window
        assert all(0 <= each < 60 for each in others)

    def test_the_fixed_delay_is_sha256_of_seed_and_key_as_a_fraction(self):
        raw = hashlib.sha256(b"m1\nhost-a\nnightly").digest()[:8]
        expected = 60.0 * int.from_bytes(raw, "big") / 2**64
        assert pacing.jitter_delay(60.0, "nightly", fresh=False, seed="m1\nhost-a") == expected

    def test_fresh_draws_differ(self):
        draws = {pacing.jitter_delay(60.0, "nightly", fresh=True) for _ in range(20)}
        assert len(draws) == 20


@pytest.mark.parametrize("mode", MODES)
class TestJitter:
    def test_two_runs_wait_the_same_delay_and_record_it(self, dsn, key, mode):
        delays = []
        for _ in range(2):
            result = jobrun_cli.run(
                "--key", key, "--mode", mode, "--jitter", "1s", "--", "true", dsn=dsn
            )
            assert result.returncode == 0, result.stderr
            line = jobrun_cli.event(result.stderr, "jitter")
            assert line["fixed"] is True
            delays.append(line["delay"])
        assert delays[0] == delays[1]
        assert 0 <= delays[0] < 1
        with psycopg.connect(dsn) as conn:
            recorded = conn.execute(
                "SELECT jitter_seconds FROM jobrun.runs WHERE key = %s", (key,)
            ).fetchall()
        assert [r[0] for r in recorded] == delays

    def test_a_signal_ends_the_delay_with_no_connection_opened(self, dsn, key, tmp_path, mode):
        """A long delay: no server session meanwhile; SIGTERM ends it, the child never runs."""
        marker = tmp_path / "ran"
        proc = jobrun_cli.start(
            "--key", key, "--mode", mode, "--jitter", "100d", "--jitter-random", "--",
            "touch", str(marker), dsn=dsn,
        )  # fmt: skip
        line = _first(proc, "jitter")
        assert line["fixed"] is False
        with psycopg.connect(dsn) as conn:
            sessions = conn.execute(
                "SELECT count(*) FROM pg_stat_activity WHERE application_name = %s",
                (db.application_name(key),),
            ).fetchone()
        assert sessions == (0,)
        rest = jobrun_cli.signal_and_wait(proc, signal.SIGTERM)
        assert proc.returncode == 128 + signal.SIGTERM
        assert jobrun_cli.event(rest, "interrupted")["child_started"] is False
        assert not marker.exists()
