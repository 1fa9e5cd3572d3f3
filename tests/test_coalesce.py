"""--coalesce: one run queues behind a held key, later arrivals skip; never two at once."""

from __future__ import annotations

import signal
import time
from typing import TYPE_CHECKING

import psycopg
import pytest

from harness import jobrun_cli
from harness.jobrun_cli import HANG_GUARD, wait_until
from jobrun import keys
from jobrun.locks import queue, slots
from support.modes import LEASE_TTL, MODES
from support.modes import events_until as _events_until
from support.modes import run as _run
from support.modes import start as _start
from support.spans import assert_no_overlap, span_child, started

if TYPE_CHECKING:
    import subprocess
    from pathlib import Path

    from support.tenants import Teams


def _holder(key: str, mode: str, log: Path, go: Path, dsn: str) -> subprocess.Popen[str]:
    """A plain run of ``key`` whose child runs until ``go`` exists."""
    holder = _start(key, mode, "--", *span_child(log, until=go), dsn=dsn)
    wait_until(lambda: started(log) == 1 or holder.poll() is not None, what="the holder")
    assert holder.poll() is None, holder.communicate()[1]
    return holder


def _finish(proc: subprocess.Popen[str]) -> int:
    """Let ``proc`` end (its stderr read and closed); its status."""
    proc.communicate(timeout=30)
    return proc.returncode


def _end_all(*procs: subprocess.Popen[str]) -> None:
    """Kill what still runs and close every pipe (a test that failed midway)."""
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
        if proc.stderr is not None and not proc.stderr.closed:
            proc.communicate()


def _skip_reason(result: subprocess.CompletedProcess[str]) -> str:
    assert result.returncode == 75, result.stderr
    return str(jobrun_cli.event(result.stderr, "skipped")["reason"])


class TestQueueSlotIds:
    """The queue slot's lock id: derived from the key, never a key's, a slot's or another's."""

    def test_the_queue_id_is_the_hash_of_the_name_a_line_feed_and_queue(self):
        assert queue.queue_lock_id("nightly") == keys.lock_id_for("nightly\nqueue")
        assert queue.queue_key(keys.from_name("nightly")) == keys.Key(
            keys.lock_id_for("nightly\nqueue"), "nightly"
        )

    def test_no_key_name_and_no_slot_shares_it(self):
        """A key name cannot hold a line feed; a slot's text is ``name\\nslot N``."""
        with pytest.raises(Exception, match="a control character"):
            keys.validate_name("nightly\nqueue")
        ids = {slots.slot_lock_id("nightly", n) for n in range(slots.MAX_SLOTS)}
        ids.add(keys.lock_id_for("nightly"))
        assert queue.queue_lock_id("nightly") not in ids
        assert queue.queue_lock_id("nightly") != queue.queue_lock_id("nightly2")


@pytest.mark.parametrize("mode", MODES)
class TestCoalesce:
    def test_one_run_queues_the_rest_skip_and_none_overlap(self, dsn, key, tmp_path, mode):
        """Holder, one queued run, three later arrivals skip (queued); the queued one runs."""
        log, go = tmp_path / "spans", tmp_path / "go"
        holder = _holder(key, mode, log, go, dsn)
        queued = _start(key, mode, "--coalesce", "--", *span_child(log), dsn=dsn)
        try:
            line = _events_until(queued, "queued")[-1]
            assert line["holder_pid"] == holder.pid
            later = [
                _run(key, mode, "--coalesce", "--", *span_child(log), dsn=dsn) for _ in range(3)
            ]
            assert [_skip_reason(each) for each in later] == ["queued"] * 3
            assert started(log) == 1  # the queued run has not started its child
            go.touch()
            assert _finish(holder) == 0
            _, rest = queued.communicate(timeout=30)
            assert queued.returncode == 0, rest
        finally:
            go.touch()
            _end_all(holder, queued)
        assert len(assert_no_overlap(log)) == 2
        dequeued = jobrun_cli.event(rest, "dequeued")
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(
                "SELECT outcome, reason, queued_seconds FROM jobrun.runs WHERE key = %s "
                "ORDER BY started_at",
                (key,),
            ).fetchall()
        assert sorted(r[:2] for r in rows) == sorted(
            [("succeeded", None)] * 2 + [("skipped", "queued")] * 3
        )
        assert [r[2] for r in rows if r[2] is not None] == [dequeued["queued_seconds"]]

    def test_a_herd_arriving_at_once_queues_exactly_one(self, dsn, key, tmp_path, mode):
        """Six runs started together behind a holder: one queues, five skip (queued)."""
        log, go = tmp_path / "spans", tmp_path / "go"
        holder = _holder(key, mode, log, go, dsn)
        herd = [_start(key, mode, "--coalesce", "--", *span_child(log), dsn=dsn) for _ in range(6)]
        try:
            wait_until(
                lambda: sum(proc.poll() is not None for proc in herd) == 5,
                timeout=60,
                what="five of the herd to skip",
            )
            waiting = [proc for proc in herd if proc.poll() is None]
            assert len(waiting) == 1
            for proc in herd:
                if proc is not waiting[0]:
                    _, stderr = proc.communicate()
                    assert proc.returncode == 75, stderr
                    assert jobrun_cli.event(stderr, "skipped")["reason"] == "queued"
            assert started(log) == 1
            go.touch()
            assert _finish(holder) == 0
            _, rest = waiting[0].communicate(timeout=30)
            assert waiting[0].returncode == 0, rest
        finally:
            go.touch()
            _end_all(holder, *herd)
        assert len(assert_no_overlap(log)) == 2

    def test_wait_bounds_the_queue_and_frees_the_slot(self, dsn, key, tmp_path, mode):
        """--wait: the queued run gives up (skip: locked) and the next arrival may queue."""
        log, go = tmp_path / "spans", tmp_path / "go"
        holder = _holder(key, mode, log, go, dsn)
        try:
            gave_up = _run(key, mode, "--coalesce", "--wait", "1s", "--", "true", dsn=dsn)
            assert _skip_reason(gave_up) == "locked"
            assert [e["event"] for e in jobrun_cli.events(gave_up.stderr)][:1] == ["queued"]
            again = _run(key, mode, "--coalesce", "--wait", "200ms", "--", "true", dsn=dsn)
            assert _skip_reason(again) == "locked"  # it queued: the slot was free
        finally:
            go.touch()
            _finish(holder)
        assert started(log) == 1

    @pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
    def test_a_signalled_queued_run_leaves_no_slot_behind(self, dsn, key, tmp_path, mode, how):
        """A queued run ended by a signal (or kill -9) never runs; its slot frees."""
        log, go = tmp_path / "spans", tmp_path / "go"
        holder = _holder(key, mode, log, go, dsn)
        try:
            queued = _start(key, mode, "--coalesce", "--", *span_child(log), dsn=dsn)
            _events_until(queued, "queued")
            if how == "SIGTERM":
                stderr = jobrun_cli.signal_and_wait(queued, signal.SIGTERM)
                assert queued.returncode == 128 + signal.SIGTERM
                line = jobrun_cli.event(stderr, "interrupted")
                assert line["child_started"] is False
            else:
                queued.kill()
                _finish(queued)
            # Session mode: the server ends the dead run's session (its slot at once);
            # lease mode: the slot's lease expires after its TTL. Each try is a whole jobrun
            # process: the hang guard covers those starts.
            bound = HANG_GUARD + (LEASE_TTL if mode == "lease" else 0.0)

            def may_queue() -> bool:
                tried = _run(key, mode, "--coalesce", "--wait", "100ms", "--", "true", dsn=dsn)
                return _skip_reason(tried) == "locked"

            wait_until(may_queue, timeout=bound, what="the queue slot to free")
        finally:
            go.touch()
            assert _finish(holder) == 0
        assert started(log) == 1  # the queued child never ran
        after = _run(key, mode, "--", "true", dsn=dsn)  # and the key itself is free
        assert after.returncode == 0, after.stderr

    def test_stop_reaches_the_queued_run_too(self, dsn, key, tmp_path, mode):
        """jobrun stop KEY: the holder stops, and the run queued behind it leaves unrun."""
        log, go = tmp_path / "spans", tmp_path / "go"
        holder = _holder(key, mode, log, go, dsn)
        queued = _start(key, mode, "--coalesce", "--", *span_child(log), dsn=dsn)
        try:
            _events_until(queued, "queued")
            stop = jobrun_cli.run("stop", key, "--reason", "test", "--wait", "20s", dsn=dsn)
            assert stop.returncode == 0, stop.stdout + stop.stderr
            assert _finish(holder) == 77
            _, rest = queued.communicate(timeout=30)
            assert queued.returncode == 75, rest
        finally:
            go.touch()
            _end_all(holder, queued)
        assert jobrun_cli.event(rest, "skipped")["reason"] == "stop_requested"
        assert jobrun_cli.event(rest, "stop_requested")["requested_by_reason"] == "test"
        assert started(log) == 1
        after = _run(key, mode, "--coalesce", "--", "true", dsn=dsn)
        assert after.returncode == 0, after.stderr

    def test_a_granted_role_queues_under_row_level_security(self, teams: Teams, tmp_path, mode):
        """After jobrun init: the queue slot (lease row, advisory lock) is the key's own."""
        log, go = tmp_path / "spans", tmp_path / "go"
        holder = _holder("a-queue", mode, log, go, teams.a)
        queued = _start("a-queue", mode, "--coalesce", "--", *span_child(log), dsn=teams.a)
        try:
            _events_until(queued, "queued")
            later = _run("a-queue", mode, "--coalesce", "--", "true", dsn=teams.a)
            assert _skip_reason(later) == "queued"
            go.touch()
            assert _finish(holder) == 0
            _, rest = queued.communicate(timeout=30)
            assert queued.returncode == 0, rest
        finally:
            go.touch()
            _end_all(holder, queued)
        assert len(assert_no_overlap(log)) == 2
        # Another team may not take a-queue's queue slot (nor the key).
        other = _run("a-queue", mode, "--coalesce", "--", "true", dsn=teams.b)
        assert other.returncode == 69, other.stderr


class TestLeaseQueue:
    def test_the_queue_slot_lease_is_renewed_while_the_run_waits(self, dsn, key, tmp_path):
        """Queued for twice the slot's TTL: a later arrival still finds the queue taken."""
        log, go = tmp_path / "spans", tmp_path / "go"
        holder = _holder(key, "lease", log, go, dsn)
        queued = _start(key, "lease", "--coalesce", "--", *span_child(log), dsn=dsn)
        try:
            _events_until(queued, "queued")
            time.sleep(2 * LEASE_TTL)  # what is under test: the slot outlives its TTL
            later = _run(key, "lease", "--coalesce", "--", "true", dsn=dsn)
            assert _skip_reason(later) == "queued"
            with psycopg.connect(dsn) as conn:
                row = conn.execute(
                    "SELECT expires_at > clock_timestamp() FROM jobrun.leases WHERE lock_id = %s",
                    (queue.queue_lock_id(key),),
                ).fetchone()
            assert row == (True,)
            go.touch()
            assert _finish(holder) == 0
            _, rest = queued.communicate(timeout=30)
            assert queued.returncode == 0, rest
        finally:
            go.touch()
            _end_all(holder, queued)
        assert len(assert_no_overlap(log)) == 2


class TestRefused:
    @pytest.mark.parametrize(
        ("args", "message"),
        [
            (("--key", "a", "--key", "b", "--coalesce"), "--coalesce takes one key name"),
            (("--lock-id", "5", "--coalesce"), "--coalesce takes one key name"),
            (("--key", "a", "--slots", "2", "--coalesce"), "--coalesce with --slots"),
        ],
    )
    def test_usage_errors(self, jobrun_here, args, message):
        result = jobrun_here.run(*args, "--", "true", dsn="host=/nonexistent")
        assert result.returncode == 64, result.stderr
        assert message in result.stderr
