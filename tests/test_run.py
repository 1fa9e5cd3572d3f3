"""The main job against a real PostgreSQL: run, skip, signals, timeouts, exec errors, keys."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import ClassVar

import psycopg
import pytest

from harness import jobrun_cli
from harness.jobrun_cli import event, events, wait_for_file, wait_until
from jobrun import keys

COMMON_FIELDS = {
    "timestamp",
    "level",
    "event",
    "key",
    "lock_id",
    "run_id",
    "host",
    "pid",
    "version",
}


def advisory_holders(dsn: str, name: str) -> list[int]:
    """Backend pids holding the advisory lock of key ``name`` right now."""
    classid, objid = keys.from_name(name).pg_locks_pair
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND granted "
            "AND classid = %s::int8::oid AND objid = %s::int8::oid AND objsubid = 1",
            (classid, objid),
        ).fetchall()
    return [row[0] for row in rows]


class TestLockFree:
    """With nobody holding the key, the child runs and its status is ours."""

    def test_runs_child_and_passes_its_exit_status(self, dsn, key):
        """Exit 3 from the child is jobrun's exit 3."""
        result = jobrun_cli.run("--key", key, "--", "sh", "-c", "exit 3", dsn=dsn)
        assert result.returncode == 3
        finished = event(result.stderr, "finished")
        assert finished["exit_code"] == 3
        assert finished["outcome"] == "failed"

    def test_child_owns_stdout_and_stdin(self, dsn, key):
        """The child's stdout is untouched; jobrun logs only to stderr."""
        result = subprocess.run(
            [*jobrun_cli.JOBRUN, "--key", key, "--", "cat"],
            env=jobrun_cli.environment(dsn),
            input="payload through stdin\n",
            capture_output=True,
            text=True,
            check=False,
            timeout=60,
        )
        assert result.returncode == 0
        assert result.stdout == "payload through stdin\n"

    def test_lock_is_released_after_the_run(self, dsn, key):
        """Nobody holds the key once jobrun has exited."""
        result = jobrun_cli.run("--key", key, "--", "true", dsn=dsn)
        assert result.returncode == 0
        assert advisory_holders(dsn, key) == []

    def test_child_holds_lock_while_running(self, dsn, key, tmp_path):
        """While the child runs, exactly one backend holds the key."""
        marker = tmp_path / "child"
        proc = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            wait_for_file(marker)
            assert len(advisory_holders(dsn, key)) == 1
        finally:
            jobrun_cli.signal_and_wait(proc, signal.SIGTERM)

    def test_child_environment_names_the_job(self, dsn, key, tmp_path):
        """JOBRUN_KEY, JOBRUN_LOCK_ID, JOBRUN_RUN_ID and PGAPPNAME reach the child."""
        out = tmp_path / "env"
        script = (
            "import os, json\n"
            f"open({str(out)!r}, 'w').write(json.dumps({{k: os.environ.get(k) for k in "
            "('JOBRUN_KEY', 'JOBRUN_LOCK_ID', 'JOBRUN_RUN_ID', 'PGAPPNAME')}))\n"
        )
        result = jobrun_cli.run("--key", key, "--", sys.executable, "-c", script, dsn=dsn)
        seen = json.loads(out.read_text())
        started = event(result.stderr, "started")
        assert seen == {
            "JOBRUN_KEY": key,
            "JOBRUN_LOCK_ID": str(keys.lock_id_for(key)),
            "JOBRUN_RUN_ID": started["run_id"],
            "PGAPPNAME": f"jobrun:{key}"[:63],
        }

    def test_existing_pgappname_is_kept(self, dsn, key, tmp_path):
        """A PGAPPNAME the user set is not overwritten."""
        out = tmp_path / "app"
        result = jobrun_cli.run(
            "--key",
            key,
            "--",
            "sh",
            "-c",
            f'echo "$PGAPPNAME" > "{out}"',
            dsn=dsn,
            env={"PGAPPNAME": "mine"},
        )
        assert result.returncode == 0
        assert out.read_text().strip() == "mine"

    def test_child_killed_by_signal_gives_128_plus_n(self, dsn, key):
        """A child that dies of SIGKILL makes jobrun exit 137, with the signal named."""
        result = jobrun_cli.run("--key", key, "--", "sh", "-c", "kill -KILL $$", dsn=dsn)
        assert result.returncode == 137
        assert event(result.stderr, "finished")["signal"] == "SIGKILL"


class TestHeld:
    """With the key held elsewhere, jobrun skips without starting the child."""

    def test_second_run_skips_with_75_and_names_the_holder(self, dsn, key, tmp_path):
        """The skip line carries the holder's host, pid, run id and since."""
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            wait_for_file(marker)
            second = tmp_path / "second"
            result = jobrun_cli.run("--key", key, "--", "touch", str(second), dsn=dsn)
            assert result.returncode == 75
            assert not second.exists()
            skipped = event(result.stderr, "skipped")
            assert skipped["holder_pid"] == holder.pid
            assert skipped["holder_host"] == os.uname().nodename
            assert skipped["holder_since"]
            assert skipped["level"] == "info"
        finally:
            stderr = jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert skipped["holder_run_id"] == event(stderr, "started")["run_id"]

    def test_skip_exit_code_can_be_zero(self, dsn, key, tmp_path):
        """--skip-exit-code 0 makes a skip a success for cron and CI."""
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            wait_for_file(marker)
            result = jobrun_cli.run("--key", key, "--skip-exit-code", "0", "--", "true", dsn=dsn)
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert result.returncode == 0
        assert event(result.stderr, "skipped")["exit_code"] == 0

    def test_twenty_simultaneous_starters_run_one_child(self, dsn, key, tmp_path):
        """Of 20 runs started at once, exactly one child runs; 19 skip."""
        ran = tmp_path / "ran"
        go = tmp_path / "go"
        body = (
            "import os, time\n"
            f"open({str(ran)!r}, 'a').write(os.environ['JOBRUN_RUN_ID'] + '\\n')\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
        )
        runs = [
            jobrun_cli.start("--key", key, "--", *jobrun_cli.child_script(body), dsn=dsn)
            for _ in range(20)
        ]
        try:
            # The child holds the lock until we say go: everyone else must have skipped.
            wait_until(
                lambda: sum(r.poll() is not None for r in runs) == 19,
                timeout=60,
                what="19 runs to finish",
            )
        finally:
            go.touch()
        for r in runs:
            r.communicate(timeout=60)
        codes = sorted(r.returncode for r in runs)
        assert codes == [0] + [75] * 19
        assert len(ran.read_text().splitlines()) == 1

    def test_wait_acquires_when_the_holder_finishes(self, dsn, key, tmp_path):
        """--wait takes the lock as soon as the holder releases it."""
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        wait_for_file(marker)
        waiter = jobrun_cli.start("--key", key, "--wait", "60s", "--", "true", dsn=dsn)
        wait_until(lambda: len(advisory_waiters(dsn)) > 0, what="the waiter to wait")
        jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        _, stderr = waiter.communicate(timeout=60)
        assert waiter.returncode == 0, stderr
        assert event(stderr, "finished")["outcome"] == "succeeded"

    def test_wait_gives_up_after_its_duration(self, dsn, key, tmp_path):
        """--wait 1s against a holder that stays: skipped after about a second."""
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            wait_for_file(marker)
            result = jobrun_cli.run("--key", key, "--wait", "1s", "--", "true", dsn=dsn)
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert result.returncode == 75
        assert event(result.stderr, "skipped")["holder_pid"] == holder.pid

    def test_a_server_statement_timeout_shorter_than_the_wait_still_skips(self, dsn, key, tmp_path):
        """A role's statement_timeout (here 300ms, via PGOPTIONS) cannot cut --wait short."""
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            wait_for_file(marker)
            result = jobrun_cli.run(
                "--key", key, "--wait", "1s", "--", "true",
                dsn=dsn, env={"PGOPTIONS": "-c statement_timeout=300"},
            )  # fmt: skip
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert result.returncode == 75, result.stderr
        assert event(result.stderr, "skipped")["holder_pid"] == holder.pid


def advisory_waiters(dsn: str, name: str | None = None) -> list[int]:
    """Backends waiting for the advisory lock of key ``name`` (None: for any advisory lock).

    Naming the key matters where a run may wait a moment for another advisory lock first
    (the schema's, while another run creates the history table).
    """
    with psycopg.connect(dsn) as conn:
        if name is None:
            rows = conn.execute(  # this database's only: other test sessions share the server
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
            ).fetchall()
        else:
            rows = conn.execute(
                "SELECT pid FROM pg_locks WHERE locktype = 'advisory' AND NOT granted "
                "AND classid = %s::int8::oid AND objid = %s::int8::oid AND objsubid = 1",
                keys.from_name(name).pg_locks_pair,
            ).fetchall()
    return [row[0] for row in rows]


class TestNested:
    """A jobrun inside a guarded child, and key variables."""

    def test_a_nested_jobrun_takes_only_its_own_key(self, dsn, key, tmp_path):
        """The child's JOBRUN_KEY / JOBRUN_LOCK_ID do not add the outer key to the inner run."""
        marker = tmp_path / "inner"
        inner = [*jobrun_cli.JOBRUN, "--key", f"{key}-inner", "--", "touch", str(marker)]
        result = jobrun_cli.run(
            "--key", f"{key}-outer", "--pass-env", "JOBRUN_DSN", "--", *inner, dsn=dsn
        )
        assert result.returncode == 0, result.stderr
        assert marker.exists()

    @pytest.mark.parametrize(
        "keys_args",
        [("--key", "{key}-a", "--key", "{key}-b"), ("--lock-id", "77"), ("--key", "{key}")],
        ids=["two keys", "raw lock id", "one key"],
    )
    def test_a_nested_jobrun_without_keys_tries_exactly_the_outer_ones(
        self, dsn, key, keys_args, tmp_path
    ):
        """The child's JOBRUN_KEY / JOBRUN_LOCK_ID read back as the outer keys: it skips.

        The outer run passes its DSN on (``--pass-env``): without it the child has none.
        """
        marker = tmp_path / "inner"
        args = [arg.format(key=key) for arg in keys_args]
        if "77" in args:  # a raw id of this test's own
            args = ["--lock-id", str(keys.lock_id_for(key))]
        inner = [*jobrun_cli.JOBRUN, "--", "touch", str(marker)]
        result = jobrun_cli.run(*args, "--pass-env", "JOBRUN_DSN", "--", *inner, dsn=dsn)
        assert result.returncode == 75, result.stderr
        assert not marker.exists()

    def test_blank_lines_in_jobrun_key_are_skipped(self, dsn, key, tmp_path):
        """JOBRUN_KEY with a trailing newline (as a file read into it has) names one key."""
        marker = tmp_path / "ran"
        result = jobrun_cli.run(
            "--", "touch", str(marker), dsn=dsn, env={"JOBRUN_KEY": f"{key}\n\n"}
        )
        assert result.returncode == 0, result.stderr
        assert event(result.stderr, "started")["key"] == key
        assert marker.exists()


class TestMixedModes:
    """A key held in one mode is held for the other mode too (a fleet switching modes)."""

    def test_a_lease_run_skips_while_a_session_run_holds_the_key(self, dsn, key, tmp_path):
        """Session first: the lease run skips and names the session's backend."""
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        ran = tmp_path / "ran"
        try:
            wait_for_file(marker)
            result = jobrun_cli.run(
                "--key", key, "--mode", "lease", "--", "touch", str(ran), dsn=dsn
            )  # fmt: skip
            session_backends = advisory_holders(dsn, key)
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert result.returncode == 75, result.stderr
        skipped = event(result.stderr, "skipped")
        assert skipped["holder_backend_pid"] in session_backends
        assert skipped["holder_pid"] == holder.pid  # from the session's holder comment
        assert not ran.exists()

    def test_a_session_run_skips_while_a_lease_run_holds_the_key(self, dsn, key, tmp_path):
        """Lease first: the session run skips, names the lease's run, and keeps no lock."""
        marker = tmp_path / "holder"
        holder = jobrun_cli.start(
            "--key", key, "--mode", "lease", "--", *jobrun_cli.holder_marker(marker), dsn=dsn
        )  # fmt: skip
        ran = tmp_path / "ran"
        try:
            wait_for_file(marker)
            result = jobrun_cli.run("--key", key, "--", "touch", str(ran), dsn=dsn)
            left_behind = advisory_holders(dsn, key)
        finally:
            stderr = jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert result.returncode == 75, result.stderr
        skipped = event(result.stderr, "skipped")
        assert skipped["holder_run_id"] == event(stderr, "started")["run_id"]
        assert "holder_expires_at" in skipped
        assert left_behind == []
        assert not ran.exists()

    @pytest.mark.parametrize("wait", [None, "1s"], ids=["at-once", "waiting"])
    def test_a_lease_run_skips_while_a_lease_run_holds_the_key(self, dsn, key, tmp_path, wait):
        """Lease behind lease (one statement, or --wait's path): the skip names the holder."""
        marker = tmp_path / "holder"
        lease = ("--mode", "lease")
        holder = jobrun_cli.start(
            "--key", key, *lease, "--", *jobrun_cli.holder_marker(marker), dsn=dsn
        )  # fmt: skip
        ran = tmp_path / "ran"
        waits = ("--wait", wait) if wait else ()
        try:
            wait_for_file(marker)
            result = jobrun_cli.run(
                "--key", key, *lease, *waits, "--", "touch", str(ran), dsn=dsn
            )  # fmt: skip
        finally:
            stderr = jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert result.returncode == 75, result.stderr
        skipped = event(result.stderr, "skipped")
        assert skipped["holder_run_id"] == event(stderr, "started")["run_id"]
        assert skipped["holder_pid"] == holder.pid
        assert skipped["holder_host"] == os.uname().nodename
        assert skipped["holder_since"]
        assert skipped["holder_expires_at"]
        assert not ran.exists()


class TestForeignHolders:
    """Whatever another session put in its query is taken on trust by nothing."""

    @pytest.mark.parametrize("comment", ['{"pid": 1.5}', '{"pid": "12ab"}', "{not json}"])
    def test_a_malformed_holder_comment_still_skips(self, dsn, key, comment, tmp_path):
        """The skip names the holder's backend; no internal error."""
        marker = tmp_path / "ran"
        with psycopg.connect(dsn, autocommit=True) as holder:
            holder.execute(
                f"/* jobrun-holder {comment} */ SELECT pg_advisory_lock(%s)",
                (keys.lock_id_for(key),),
            )
            result = jobrun_cli.run("--key", key, "--", "touch", str(marker), dsn=dsn)
            backend = holder.info.backend_pid
        assert result.returncode == 75, result.stderr
        skipped = event(result.stderr, "skipped")
        assert skipped["holder_backend_pid"] == backend
        assert "holder_pid" not in skipped
        assert not marker.exists()

    def test_a_wait_longer_than_lock_timeouts_limit_still_waits(self, dsn, key, tmp_path):
        """--wait 30d (over PostgreSQL's 24.8-day lock_timeout): waits, then acquires."""
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        wait_for_file(marker)
        waiter = jobrun_cli.start("--key", key, "--wait", "30d", "--", "true", dsn=dsn)
        try:
            wait_until(lambda: len(advisory_waiters(dsn)) > 0, what="the waiter to wait")
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        _, stderr = waiter.communicate(timeout=60)
        assert waiter.returncode == 0, stderr


class TestSeveralKeys:
    """Several --key flags: all or nothing, in ascending lock-id order."""

    @staticmethod
    def two_keys() -> tuple[str, str]:
        """Two fresh names, ordered by lock id (low, high)."""
        a, b = f"multi-{uuid.uuid4().hex}", f"multi-{uuid.uuid4().hex}"
        return (a, b) if keys.lock_id_for(a) < keys.lock_id_for(b) else (b, a)

    def test_all_or_nothing(self, dsn, tmp_path):
        """If one key is held, the other is released again and the run skips."""
        low, high = self.two_keys()
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", high, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            wait_for_file(marker)
            both = jobrun_cli.run("--key", low, "--key", high, "--", "true", dsn=dsn)
            assert both.returncode == 75
            assert event(both.stderr, "skipped")["holder_key"] == high
            assert advisory_holders(dsn, low) == []
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)

    def test_taken_in_ascending_lock_id_order(self, dsn, tmp_path):
        """Waiting for the higher key, a run already holds the lower one."""
        low, high = self.two_keys()
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", high, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        wait_for_file(marker)  # the holder first, or the waiter could take both keys at once
        waiter = jobrun_cli.start(
            "--key", high, "--key", low, "--wait", "60s", "--", "true", dsn=dsn
        )
        try:
            wait_until(lambda: len(advisory_waiters(dsn, high)) > 0, what="the waiter to wait")
            assert len(advisory_holders(dsn, low)) == 1
            lower_only = jobrun_cli.run("--key", low, "--", "true", dsn=dsn)
            assert lower_only.returncode == 75
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        _, stderr = waiter.communicate(timeout=60)
        assert waiter.returncode == 0, stderr
        started = event(stderr, "started")
        assert started["key"] == f"{low},{high}"
        assert started["lock_id"] == [keys.lock_id_for(low), keys.lock_id_for(high)]


class TestSignalsAndDeath:
    """The child never outlives jobrun, and signals reach it."""

    def test_sigterm_is_forwarded_and_exit_is_143(self, dsn, key, tmp_path):
        """SIGTERM to jobrun reaches the child, which dies of it: exit 143."""
        marker = tmp_path / "child"
        proc = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        wait_for_file(marker)
        stderr = jobrun_cli.signal_and_wait(proc, signal.SIGTERM)
        assert proc.returncode == 143
        assert event(stderr, "signal_forwarded")["signal"] == "SIGTERM"
        assert event(stderr, "finished")["signal"] == "SIGTERM"

    @pytest.mark.parametrize("signum", [signal.SIGHUP, signal.SIGUSR1, signal.SIGINT])
    def test_other_signals_are_forwarded(self, dsn, key, tmp_path, signum):
        """HUP, USR1, INT reach the child (which reports and exits 0)."""
        ready, got = tmp_path / "ready", tmp_path / "got"
        body = (
            "import signal, sys, time\n"
            f"def h(n, f):\n    open({str(got)!r}, 'w').write(str(n)); sys.exit(0)\n"
            f"signal.signal({int(signum)}, h)\n"
            f"open({str(ready)!r}, 'w').write('ready\\n')\n"
            "while True: time.sleep(1)\n"
        )
        proc = jobrun_cli.start("--key", key, "--", *jobrun_cli.child_script(body), dsn=dsn)
        wait_for_file(ready)
        jobrun_cli.signal_and_wait(proc, signum)
        assert proc.returncode == 0
        assert got.read_text() == str(int(signum))

    def test_kill_9_of_jobrun_kills_child_and_frees_the_lock(self, dsn, key, tmp_path):
        """After SIGKILL to jobrun the child dies and the next run acquires."""
        marker = tmp_path / "child"
        proc = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        child_pid = int(wait_for_file(marker))
        proc.kill()
        proc.communicate(timeout=10)
        wait_until(lambda: jobrun_cli.process_gone(child_pid), what="the child to die")
        result = jobrun_cli.run("--key", key, "--wait", "10s", "--", "true", dsn=dsn)
        assert result.returncode == 0, result.stderr


#: A child that ignores SIGTERM and leaves a zombie in its process group: its own child X
#: forks Y, moves itself to another group and never reaps Y, so Y (dead, in the job's
#: group) survives every SIGKILL until X goes.
ZOMBIE_KEEPER = """
import os, signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
if os.fork() == 0:
    if os.fork() == 0:
        os._exit(0)
    os.setpgid(0, 0)
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # let go of jobrun's pipes: the test waits for their end
        os.dup2(null, fd)
    with open(sys.argv[1] + ".tmp", "w") as f:
        f.write(str(os.getpid()))
    os.rename(sys.argv[1] + ".tmp", sys.argv[1])
    time.sleep(300)
    os._exit(0)
time.sleep(300)
"""


class TestTimeout:
    """--timeout stops the whole process group."""

    def test_timeout_exits_124_and_the_group_is_gone(self, dsn, key, tmp_path):
        """A child ignoring SIGTERM, with a grandchild, is killed after --kill-after."""
        marker = tmp_path / "grandchild"
        script = f'trap "" TERM; sleep 300 & echo $! > "{marker}"; wait; wait'
        result = jobrun_cli.run(
            "--key",
            key,
            "--timeout",
            "1s",
            "--kill-after",
            "500ms",
            "--",
            "sh",
            "-c",
            script,
            dsn=dsn,
        )
        assert result.returncode == 124, result.stderr
        started = event(result.stderr, "started")
        assert jobrun_cli.group_gone(started["child_pid"])
        assert jobrun_cli.process_gone(int(marker.read_text()))
        finished = event(result.stderr, "finished")
        assert finished["outcome"] == "timed_out"
        assert event(result.stderr, "timed_out")["level"] == "error"

    def test_an_unkillable_group_member_does_not_hang_jobrun(self, dsn, key, tmp_path):
        """A zombie in the group that is not ours to reap: jobrun still finishes."""
        pidfile = tmp_path / "leaver"
        result = None
        try:
            result = jobrun_cli.run(
                "--key", key, "--timeout", "1s", "--kill-after", "1s", "--",
                sys.executable, "-c", ZOMBIE_KEEPER, str(pidfile), dsn=dsn, timeout=60,
            )  # fmt: skip
        finally:
            if pidfile.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.kill(int(pidfile.read_text()), signal.SIGKILL)
        assert result.returncode == 124, result.stderr
        assert event(result.stderr, "finished")["outcome"] == "timed_out"

    def test_leftover_background_processes_are_stopped(self, dsn, key, tmp_path):
        """A child that exits leaving a background process: it is stopped before release."""
        marker = tmp_path / "bg"
        script = f'sleep 300 & echo $! > "{marker}"; exit 0'
        result = jobrun_cli.run("--key", key, "--", "sh", "-c", script, dsn=dsn)
        assert result.returncode == 0
        assert jobrun_cli.process_gone(int(marker.read_text()))
        assert event(result.stderr, "leftover_processes")["action"] == "SIGTERM"


class TestDaemonizedDescendants:
    """jobrun is the subreaper of what the job daemonizes: it reaps them as they exit."""

    def test_exited_orphans_are_reaped_while_the_child_runs(self, dsn, key, tmp_path):
        """No zombies pile up under a long-running job that keeps starting helpers."""
        pids, ready, go = tmp_path / "pids", tmp_path / "ready", tmp_path / "go"
        script = (
            f'for i in 1 2 3 4 5; do (sleep 0.1 & echo $! >> "{pids}"); done; echo x > "{ready}"; '
            f'while [ ! -e "{go}" ]; do sleep 0.05; done'
        )
        proc = jobrun_cli.start("--key", key, "--", "sh", "-c", script, dsn=dsn)
        try:
            wait_for_file(ready)
            orphans = [int(pid) for pid in pids.read_text().split()]
            assert len(orphans) == 5
            wait_until(
                lambda: not any(Path(f"/proc/{pid}").exists() for pid in orphans),
                timeout=10,
                what="the exited orphans to be reaped",
            )
        finally:
            go.touch()
            _, stderr = proc.communicate(timeout=30)
        assert proc.returncode == 0, stderr


class TestExecFailures:
    """A command that cannot start: 126/127, logged, lock released."""

    def test_not_found_is_127(self, dsn, key):
        """A missing command: exit 127 and an exec_failed line."""
        result = jobrun_cli.run("--key", key, "--", "no-such-command-xyz", dsn=dsn)
        assert result.returncode == 127
        assert event(result.stderr, "exec_failed")["exit_code"] == 127
        assert advisory_holders(dsn, key) == []

    def test_not_executable_is_126(self, dsn, key, tmp_path):
        """A file without the execute bit: exit 126."""
        script = tmp_path / "script.sh"
        script.write_text("#!/bin/sh\necho hi\n")
        script.chmod(0o644)
        result = jobrun_cli.run("--key", key, "--", str(script), dsn=dsn)
        assert result.returncode == 126
        assert event(result.stderr, "exec_failed")["exit_code"] == 126
        assert advisory_holders(dsn, key) == []


class TestNoShell:
    """The command after -- is an argv, never a shell line: nothing in it is expanded."""

    def test_arguments_reach_the_child_as_given(self, dsn, key, tmp_path):
        """`$HOME`, `*`, `;` and quotes arrive verbatim, one argument each."""
        out = tmp_path / "argv.json"
        given = ["$HOME", "*", "a b", "; touch pwned", "'q'", "`id`"]
        script = f"import json, sys; open({str(out)!r}, 'w').write(json.dumps(sys.argv[1:]))"
        result = jobrun_cli.run("--key", key, "--", sys.executable, "-c", script, *given, dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert json.loads(out.read_text()) == given

    def test_a_shell_line_is_one_program_name(self, dsn, key, tmp_path):
        """`jobrun -- 'true; touch F'` looks for a program of that name: 127, nothing run."""
        marker = tmp_path / "pwned"
        result = jobrun_cli.run("--key", key, "--", f"true; touch {marker}", dsn=dsn)
        assert result.returncode == 127
        assert not marker.exists()


class TestDatabaseDown:
    """No database: exit 69 and no child, unless --on-db-error run."""

    def test_unreachable_database_exits_69_without_running(self, jobrun_here, key, tmp_path):
        """Connection refused: one error line, exit 69, child never started."""
        marker = tmp_path / "ran"
        result = jobrun_here.run(
            "--key",
            key,
            "--connect-timeout",
            "2s",
            "--",
            "touch",
            str(marker),
            dsn="host=127.0.0.1 port=1 dbname=nope",
        )
        assert result.returncode == 69
        assert not marker.exists()
        unavailable = event(result.stderr, "lockstore_unavailable")
        assert unavailable["level"] == "error"
        assert unavailable["running_unguarded"] is False
        assert "Traceback" not in result.stderr

    def test_on_db_error_run_runs_unguarded(self, jobrun_here, key, tmp_path):
        """--on-db-error run: the child runs and its status is ours; the line says so."""
        marker = tmp_path / "ran"
        result = jobrun_here.run(
            "--key",
            key,
            "--on-db-error",
            "run",
            "--",
            "sh",
            "-c",
            f'touch "{marker}"; exit 5',
            dsn="host=127.0.0.1 port=1",
        )
        assert result.returncode == 5
        assert marker.exists()
        assert event(result.stderr, "lockstore_unavailable")["running_unguarded"] is True
        assert event(result.stderr, "started")["guarded"] is False


class TestEventLines:
    """Structured lines: JSON that parses and carries the promised fields."""

    def test_every_line_carries_the_common_fields(self, dsn, key):
        """started and finished carry key, lock id, run id, host, pid, version, UTC time."""
        result = jobrun_cli.run("--key", key, "--", "true", dsn=dsn)
        lines = events(result.stderr)
        assert [e["event"] for e in lines] == ["started", "finished"]
        for line in lines:
            assert line.keys() >= COMMON_FIELDS
            assert line["lock_id"] == keys.lock_id_for(key)
            assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d+Z", line["timestamp"])
        assert lines[0]["run_id"] == lines[1]["run_id"]
        finished = lines[1]
        assert {"exit_code", "signal", "duration"} <= finished.keys()

    #: The events that end a run's lines (alerts and history warnings may follow them).
    #: Then each way a run can end: options ("holder": another session holds the key),
    #: command, the run's last event, its exit status.
    LAST_EVENTS = frozenset({"finished", "skipped", "exec_failed", "lockstore_unavailable"})
    ENDINGS: ClassVar[dict[str, tuple[tuple[str, ...], tuple[str, ...], str, int]]] = {
        "failed": ((), ("sh", "-c", "exit 3"), "finished", 3),
        "timed_out": (("--timeout", "200ms"), ("sleep", "30"), "finished", 124),
        "exec_failed": ((), ("/nonexistent/command",), "exec_failed", 127),
        "skipped": (("holder",), ("true",), "skipped", 75),
        "unavailable": (("--dsn", "host=127.0.0.1 port=1"), ("true",), "lockstore_unavailable", 69),
        "lock_lost": (
            ("--kill-after", "1s"),
            (sys.executable, "-c", (
                "import os, time, psycopg\n"
                "with psycopg.connect(os.environ['JOBRUN_TEST_CHILD_DSN'], autocommit=True) as c:\n"
                '    c.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity"\n'
                '              " WHERE application_name = %s AND pid <> pg_backend_pid()",\n'
                "              (os.environ['PGAPPNAME'],))\n"
                "time.sleep(60)\n"
            )),
            "finished",
            76,
        ),
    }  # fmt: skip

    @pytest.mark.parametrize("ending", list(ENDINGS))
    def test_every_ending_leaves_a_last_line_with_its_exit_status(self, dsn, key, ending):
        """Each way a run ends: one last line with the common fields and the exit status."""
        options, command, last_event, status = self.ENDINGS[ending]
        with contextlib.ExitStack() as stack:
            if options == ("holder",):
                options = ()
                holder = stack.enter_context(psycopg.connect(dsn, autocommit=True))
                holder.execute("SELECT pg_advisory_lock(%s)", (keys.lock_id_for(key),))
            result = jobrun_cli.run(
                "--key", key, *options, "--", *command,
                dsn=dsn, env={"JOBRUN_TEST_CHILD_DSN": dsn},
            )  # fmt: skip
        assert result.returncode == status, result.stderr
        lines = events(result.stderr)
        (last,) = [line for line in lines if line["event"] in self.LAST_EVENTS]
        assert last["event"] == last_event
        assert last.keys() >= COMMON_FIELDS
        assert last["lock_id"] == keys.lock_id_for(key)
        assert last["exit_code"] == status
        assert len({line["run_id"] for line in lines}) == 1
        if last_event == "finished":
            assert {"signal", "duration", "outcome"} <= last.keys()

    def test_run_ids_are_unique(self, dsn, key):
        """Two runs never share a run id."""
        ids = {
            event(jobrun_cli.run("--key", key, "--", "true", dsn=dsn).stderr, "started")["run_id"]
            for _ in range(3)
        }
        assert len(ids) == 3

    def test_log_file_collects_lines_from_concurrent_runs(self, dsn, key, tmp_path):
        """Ten runs appending to one --log-file: every line is whole JSON."""
        log = tmp_path / "jobrun.log"
        runs = [
            jobrun_cli.start("--key", f"{key}-{i}", "--log-file", str(log), "--", "true", dsn=dsn)
            for i in range(10)
        ]
        for proc in runs:
            _, stderr = proc.communicate(timeout=60)
            assert proc.returncode == 0
            assert stderr == ""
        lines = events(log.read_text())
        assert sorted(e["event"] for e in lines) == ["finished"] * 10 + ["started"] * 10

    @pytest.mark.parametrize("fmt", ["logfmt", "console"])
    def test_other_formats(self, dsn, key, fmt):
        """logfmt and console render one line per event with the event name."""
        result = jobrun_cli.run("--key", key, "--log-format", fmt, "--", "true", dsn=dsn)
        lines = result.stderr.splitlines()
        assert len(lines) == 2
        assert "started" in lines[0]
        assert "finished" in lines[1]


class TestSecrets:
    """A password in the DSN never reaches any output."""

    SECRET = "hunter2-do-not-print"  # noqa: S105 - the point of the test

    def test_password_in_failing_dsn_is_hidden(self, jobrun_here, key):
        """Connection errors do not echo the password."""
        for dsn in (
            f"host=127.0.0.1 port=1 user=u password={self.SECRET}",
            f"postgresql://u:{self.SECRET}@127.0.0.1:1/db",
        ):
            result = jobrun_here.run("--key", key, "--dsn", dsn, "--", "true", dsn=None)
            assert result.returncode == 69
            assert self.SECRET not in result.stderr + result.stdout

    def test_password_on_command_line_warns_and_stays_hidden(self, dsn, key):
        """A working DSN with a password: the run works, warns about ps, never prints it."""
        with_password = f"{dsn} password={self.SECRET}"
        result = jobrun_cli.run("--key", key, "--dsn", with_password, "--", "true", dsn=None)
        assert result.returncode == 0, result.stderr
        assert self.SECRET not in result.stderr + result.stdout
        assert event(result.stderr, "password_on_command_line")["level"] == "warning"

    def test_password_in_environment_does_not_warn(self, dsn, key):
        """JOBRUN_DSN is not visible in ps: no warning."""
        result = jobrun_cli.run("--key", key, "--", "true", dsn=f"{dsn} password={self.SECRET}")
        assert result.returncode == 0
        assert "password_on_command_line" not in result.stderr
        assert self.SECRET not in result.stderr


class TestInterruptedWhileWaiting:
    """A signal that arrives before the child starts ends the run cleanly."""

    def test_sigterm_while_waiting_for_the_lock(self, dsn, key, tmp_path):
        """SIGTERM during --wait: exit 143, an `interrupted` line, no child, no lock left."""
        marker = tmp_path / "holder"
        holder = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            wait_for_file(marker)
            ran = tmp_path / "ran"
            waiter = jobrun_cli.start(
                "--key", key, "--wait", "120s", "--", "touch", str(ran), dsn=dsn
            )
            wait_until(lambda: len(advisory_waiters(dsn)) > 0, what="the waiter to wait")
            stderr = jobrun_cli.signal_and_wait(waiter, signal.SIGTERM)
        finally:
            jobrun_cli.signal_and_wait(holder, signal.SIGTERM)
        assert waiter.returncode == 143, stderr
        assert event(stderr, "interrupted")["child_started"] is False
        assert not ran.exists()
        assert "Traceback" not in stderr
        wait_until(lambda: advisory_waiters(dsn) == [], what="the waiter's session to end")


class TestMinHold:
    """--min-hold keeps the lock after a short child, for hosts whose clocks run late."""

    def test_lock_stays_held_after_the_child_ends(self, dsn, key, tmp_path):
        """A second run after the child finished still skips while the hold lasts."""
        done = tmp_path / "done"
        first = jobrun_cli.start(
            "--key", key, "--min-hold", "60s", "--", "sh", "-c", f'echo $$ > "{done}"', dsn=dsn
        )
        try:
            child = int(wait_for_file(done))
            wait_until(lambda: jobrun_cli.process_gone(child), what="the child to end")
            second = jobrun_cli.run("--key", key, "--", "true", dsn=dsn)
            assert second.returncode == 75
            assert event(second.stderr, "skipped")["holder_pid"] == first.pid
        finally:
            stderr = jobrun_cli.signal_and_wait(first, signal.SIGTERM)
        assert first.returncode == 0, stderr  # the child's status, not the signal's
        assert event(stderr, "holding")["reason"] == "min_hold"
        assert event(stderr, "hold_interrupted")["signal"] == "SIGTERM"

    def test_hold_ends_at_min_hold_after_the_start(self, dsn, key):
        """Without interruption the run ends once min-hold has passed since the start."""
        min_hold = 3.0  # far beyond what `true` takes, even on a loaded machine
        result = jobrun_cli.run("--key", key, "--min-hold", f"{min_hold}s", "--", "true", dsn=dsn)
        assert result.returncode == 0
        started, finished = event(result.stderr, "started"), event(result.stderr, "finished")
        assert event(result.stderr, "holding")["seconds"] <= min_hold
        assert finished["duration"] < min_hold  # the child's own duration, not the hold
        assert started["run_id"] == finished["run_id"]


#: jobrun with a bug injected into the supervisor: it raises once the child has written its
#: pid (the child's group includes a grandchild that PDEATHSIG alone would not stop).
BROKEN_SUPERVISOR = """
import sys, time
from jobrun import cli
from jobrun.run import supervise

def written(path):
    try:
        with open(path) as f:
            return f.read().endswith("\\n")
    except FileNotFoundError:
        return False

def broken(child, **_options):
    # The whole line, not just the file: the shell creates the file before it writes the pid,
    # and a bug raised in between would leave the test waiting for a pid that never comes.
    while not written(sys.argv[1]):
        time.sleep(0.01)
    raise RuntimeError("injected bug")

supervise.supervise = broken
cli.main(sys.argv[2:])
"""


class TestJobrunItselfFails:
    """Trouble inside jobrun never leaves the job running beside the next run."""

    def test_unwritable_log_file_falls_back_to_stderr(self, dsn, key, tmp_path):
        """--log-file on a full disk: the child still runs and the lines go to stderr."""
        marker = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key", key, "--log-file", "/dev/full", "--", "touch", str(marker), dsn=dsn
        )
        assert result.returncode == 0, result.stderr
        assert marker.exists()
        assert event(result.stderr, "finished")["outcome"] == "succeeded"

    def test_a_log_file_that_cannot_be_opened_falls_back_to_stderr(self, dsn, key, tmp_path):
        """A missing directory for --log-file: an error line on stderr, and the run goes on."""
        marker = tmp_path / "ran"
        missing = tmp_path / "no-such-dir" / "events.log"
        result = jobrun_cli.run(
            "--key", key, "--log-file", str(missing), "--", "touch", str(marker), dsn=dsn
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        assert marker.exists()
        assert str(missing) in event(result.stderr, "log_file_unavailable")["error"]
        assert event(result.stderr, "finished")["outcome"] == "succeeded"

    def test_unwritable_stderr_never_stops_the_job(self, dsn, key, tmp_path):
        """stderr on a full disk: the lines are lost, the run is not."""
        marker = tmp_path / "ran"
        with Path("/dev/full").open("w") as full:
            completed = subprocess.run(
                [*jobrun_cli.JOBRUN, "--key", key, "--", "sh", "-c", f'touch "{marker}"; exit 3'],
                env=jobrun_cli.environment(dsn),
                stderr=full,
                timeout=60,
                check=False,
            )
        assert completed.returncode == 3
        assert marker.exists()
        assert advisory_holders(dsn, key) == []

    def test_closed_stderr_is_not_confused_with_the_database_socket(self, dsn, key, tmp_path):
        """``2>&-``: the log lines must not go into the lock session's socket; the child's
        stderr is /dev/null, not closed (where its first open() would land)."""
        marker = tmp_path / "ran"
        child = f'readlink /proc/self/fd/2 > "{marker}"'
        command = [*jobrun_cli.JOBRUN, "--key", key, "--", "sh", "-c", child]
        completed = subprocess.run(
            ["sh", "-c", 'exec "$@" 2>&-', "sh", *command],
            env=jobrun_cli.environment(dsn),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert completed.returncode == 0, completed.stdout
        assert marker.read_text().strip() == "/dev/null"
        with psycopg.connect(dsn) as conn:
            (outcome,) = conn.execute(
                "SELECT outcome FROM jobrun.runs WHERE key = %s ORDER BY started_at DESC LIMIT 1",
                (key,),
            ).fetchone() or (None,)
        assert outcome == "succeeded"

    def test_a_bug_while_the_child_runs_kills_its_group_before_the_release(
        self, dsn, key, tmp_path
    ):
        """exit 70, and a run waiting for the lock finds nothing of the first job alive."""
        pidfile, verdict = tmp_path / "pid", tmp_path / "verdict"
        broken = subprocess.Popen(
            [sys.executable, "-c", BROKEN_SUPERVISOR, str(pidfile), "--key", key, "--",
             "sh", "-c", f'sleep 300 & echo $$ > "{pidfile}"; wait'],
            env=jobrun_cli.environment(dsn),
            stdin=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        try:
            group = int(wait_for_file(pidfile, proc=broken))
            # Queued behind the broken run: it gets the lock the moment that run lets go.
            alive = f"kill -0 -- -{group} 2>/dev/null && echo alive || echo gone"
            waiter = jobrun_cli.run(
                "--key", key, "--wait", "30s", "--", "sh", "-c", f'{alive} > "{verdict}"', dsn=dsn
            )  # fmt: skip
            _, stderr = broken.communicate(timeout=30)
            assert broken.returncode == 70, stderr
            assert "internal error: RuntimeError: injected bug" in stderr
            assert waiter.returncode == 0, waiter.stderr
            assert verdict.read_text().strip() == "gone"
            assert jobrun_cli.group_gone(group)
        finally:
            if pidfile.exists():
                with contextlib.suppress(ProcessLookupError, ValueError):
                    os.killpg(int(pidfile.read_text()), signal.SIGKILL)
            if broken.poll() is None:
                broken.kill()
                broken.communicate()


class TestSpawnedFromTheMainThread:
    """The child's parent-death signal is tied to the thread that forked it: the main one."""

    def test_a_spawn_from_another_thread_is_refused(self):
        """A thread that ends would take the child with it: spawn refuses to run there."""
        from jobrun.run import supervise  # noqa: PLC0415 - the unit under test, in-process

        raised: list[BaseException] = []

        def spawn_here() -> None:
            try:
                supervise.spawn(["true"], os.environ, frozenset())
            except RuntimeError as exc:
                raised.append(exc)

        worker = threading.Thread(target=spawn_here)
        worker.start()
        worker.join(timeout=30)
        assert [str(exc) for exc in raised] == [
            "supervise.spawn must be called from the main thread"
        ]

    def test_the_main_thread_spawns(self):
        """From the main thread the child starts and is reaped as usual."""
        from jobrun.run import supervise  # noqa: PLC0415

        child = supervise.spawn(["true"], os.environ, frozenset())
        assert child.wait(timeout=30) == 0
