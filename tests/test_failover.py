"""Primary failover: a streaming standby promoted while a run holds the key."""

from __future__ import annotations

import datetime as dt
import signal
import time
from typing import TYPE_CHECKING

import psycopg
import pytest

from harness import jobrun_cli
from harness.failover import FailoverPair, window_child
from harness.jobrun_cli import event, wait_for_file, wait_until
from jobrun import keys
from jobrun.locks.lease import timing
from jobrun.locks.session import CONFIRMATION_LIFETIME

if TYPE_CHECKING:
    import subprocess
    from collections.abc import Iterator
    from pathlib import Path

pytestmark = pytest.mark.fault

KILL_AFTER = 2.0
TTL = 8.0
#: The old child traps SIGTERM and takes this long to exit (less than --kill-after).
SLOW_EXIT = 1.0


@pytest.fixture
def pair() -> Iterator[FailoverPair]:
    """A primary and its standby; jobrun's tables exist on both before the test starts."""
    with FailoverPair() as servers:
        for mode in ("session", "lease"):
            warm = jobrun_cli.run(
                "--key", "warm-up", "--mode", mode, "--", "true", dsn=servers.dsn()
            )
            assert warm.returncode == 0, warm.stderr
        servers.wait_replayed()
        yield servers


class Holders:
    """Runs of one key whose children measure how long they had to wait for each other."""

    def __init__(self, tmp_path: Path, dsn: str, key: str, *args: str) -> None:
        self.tmp_path = tmp_path
        self.dsn = dsn
        self.args = ("--key", key, "--kill-after", f"{KILL_AFTER}s", *args)
        self.count = 0

    def start(self, *extra: str, exit_delay: float = 0) -> tuple[subprocess.Popen[str], Path]:
        """A run in the background, and the marker its child writes once it has the flock."""
        self.count += 1
        marker = self.tmp_path / f"child-{self.count}"
        argv = window_child(str(self.tmp_path / "exclusive"), str(marker), exit_delay=exit_delay)
        return jobrun_cli.start(*self.args, *extra, "--", *argv, dsn=self.dsn), marker


def child_of(marker: Path) -> tuple[int, float]:
    """(pid, seconds it waited for the previous child) from a running child's marker."""
    pid, waited, _ = wait_for_file(marker, timeout=60).split()
    return int(pid), float(waited)


def one_new_holder(holders: Holders) -> subprocess.Popen[str]:
    """Two runs start at once after the failover: exactly one runs, the other skips (75)."""
    (first, first_marker), (second, second_marker) = holders.start(), holders.start()
    wait_until(
        lambda: first.poll() is not None or second.poll() is not None,
        timeout=60,
        what="one of two new runs to skip",
    )
    skipped, running = (first, second) if first.poll() is not None else (second, first)
    _, stderr = skipped.communicate()
    assert skipped.returncode == 75, stderr
    marker = second_marker if running is second else first_marker
    child_of(marker)
    assert running.poll() is None
    return running


def lease_expiry(dsn: str, name: str) -> dt.datetime:
    """expires_at of the lease on key ``name``."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(
            "SELECT expires_at FROM jobrun.leases WHERE lock_id = %s", (keys.lock_id_for(name),)
        ).fetchone()
    assert row is not None
    return row[0]


def stop(proc: subprocess.Popen[str]) -> None:
    stderr = jobrun_cli.signal_and_wait(proc, signal.SIGTERM)
    assert proc.returncode == 143, stderr


def finished_at(stderr: str) -> float:
    """The 'finished' event's timestamp as seconds since the epoch."""
    stamp = str(event(stderr, "finished")["timestamp"]).replace("Z", "+00:00")
    return dt.datetime.fromisoformat(stamp).timestamp()


class TestSessionFailover:
    """Session locks live in the primary's memory: they vanish with it."""

    def test_the_old_holders_child_is_stopped(self, pair, key, tmp_path):
        """The session died with the primary: lock_lost, exit 76, the child is gone."""
        holders = Holders(tmp_path, pair.dsn(), key)
        proc, marker = holders.start()
        child, _ = child_of(marker)
        crashed = time.time()
        pair.fail_over()
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 76, stderr
        assert event(stderr, "finished")["outcome"] == "lock_lost"
        assert jobrun_cli.process_gone(child)
        # Without a confirmed check for CONFIRMATION_LIFETIME the child is stopped anyway.
        assert finished_at(stderr) - crashed <= CONFIRMATION_LIFETIME + KILL_AFTER + 1

    def test_exactly_one_new_holder_after_the_failover(self, pair, key, tmp_path):
        """On the promoted standby the key is free once, for one of two runs."""
        holders = Holders(tmp_path, pair.dsn(), key)
        proc, marker = holders.start()
        child_of(marker)
        pair.fail_over()
        proc.communicate(timeout=60)
        stop(one_new_holder(holders))

    def test_a_new_holder_overlaps_only_while_the_old_child_shuts_down(self, pair, key, tmp_path):
        """A new run may start at once; the old child is gone within heartbeat + kill-after."""
        holders = Holders(tmp_path, pair.dsn(), key, "--heartbeat", "1s")
        old, old_marker = holders.start(exit_delay=SLOW_EXIT)
        child_of(old_marker)
        pair.fail_over()
        new, new_marker = holders.start("--wait", "60s")
        _, waited = child_of(new_marker)
        _, stderr = old.communicate(timeout=60)
        assert old.returncode == 76, stderr
        # The documented window: noticing (a heartbeat, or at worst the confirmation
        # lifetime) plus the child's shutdown (at most --kill-after).
        assert waited <= CONFIRMATION_LIFETIME + KILL_AFTER
        stop(new)


class TestLeaseFailover:
    """Leases are rows: they survive a failover when replicated, and vanish when not."""

    ARGS = ("--mode", "lease", "--ttl", f"{TTL}s")
    #: The holder keeps its lease only if the crash, the promotion and its reconnection fit
    #: in the lease's lifetime (less than the TTL); on a loaded machine that took more than
    #: an 8 s TTL allows, and the holder rightly stopped its child (exit 76). A longer TTL
    #: costs nothing when the renewal comes at once.
    KEEPING_TTL = 30.0

    def test_a_replicated_lease_keeps_its_holder(self, pair, key, tmp_path):
        """The lease reached the standby: the holder renews it there; others skip."""
        holders = Holders(
            tmp_path, pair.dsn(), key, "--mode", "lease", "--ttl", f"{self.KEEPING_TTL}s"
        )
        proc, marker = holders.start()
        child, _ = child_of(marker)
        pair.wait_replayed()
        pair.fail_over()
        replicated = lease_expiry(pair.dsn(), key)
        # The holder renews within its lease's lifetime (less than TTL) of its last renewal,
        # or stops its child: past that the outcome is decided either way. Twice the TTL is
        # headroom for a loaded machine (the beat's reconnection to the promoted server
        # included); a holder that gave up fails the poll() below.
        wait_until(
            lambda: lease_expiry(pair.dsn(), key) > replicated or proc.poll() is not None,
            timeout=2 * self.KEEPING_TTL,
            what="a renewal on the promoted standby",
        )
        assert proc.poll() is None, proc.communicate()[1]
        skipped = jobrun_cli.run(*holders.args, "--", "true", dsn=pair.dsn())
        assert skipped.returncode == 75, skipped.stderr
        assert not jobrun_cli.process_gone(child)
        stop(proc)

    def test_an_unreplicated_lease_is_lost_and_the_child_stopped(self, pair, key, tmp_path):
        """The lease never reached the standby: the next renewal finds none, exit 76."""
        pair.hold_back_replication()
        holders = Holders(tmp_path, pair.dsn(), key, *self.ARGS)
        proc, marker = holders.start()
        child, _ = child_of(marker)
        pair.fail_over()
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 76, stderr
        assert jobrun_cli.process_gone(child)
        stop(one_new_holder(holders))

    def test_a_new_holder_overlaps_only_while_the_old_child_shuts_down(self, pair, key, tmp_path):
        """Lost with the primary: a new run starts at once; the old child is gone in time."""
        pair.hold_back_replication()
        holders = Holders(tmp_path, pair.dsn(), key, *self.ARGS)
        old, old_marker = holders.start(exit_delay=SLOW_EXIT)
        child_of(old_marker)
        pair.fail_over()
        new, new_marker = holders.start("--wait", "60s")
        _, waited = child_of(new_marker)
        _, stderr = old.communicate(timeout=60)
        assert old.returncode == 76, stderr
        # The watchdog stops the child lifetime + kill-after after the last renewal at the
        # latest, which came before the crash: that bounds the overlap too.
        _, lifetime = timing(TTL, KILL_AFTER, None)
        assert waited <= lifetime + KILL_AFTER
        stop(new)
