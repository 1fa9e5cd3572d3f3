"""--fence: tokens increase with every acquisition; the documented guard refuses stale ones."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import errors
from psycopg.conninfo import make_conninfo

from harness import jobrun_cli as cli
from jobrun import db, log
from jobrun.run import fence
from support.sessions import SessionCounter

DOCS = (Path(__file__).resolve().parent.parent / "docs" / "operators.md").read_text()


def doc_sql(name: str) -> str:
    """The SQL block after ``<!-- fence-sql: NAME -->`` in docs/operators.md, exactly."""
    match = re.search(rf"<!-- fence-sql: {name} -->\n```sql\n(.*?)```", DOCS, re.DOTALL)
    assert match, f"no fence-sql {name} block in docs/operators.md"
    return match.group(1)


@pytest.fixture
def guarded_dsn(fresh_dsn) -> str:
    """A fresh database with the documented guard table and function."""
    with psycopg.connect(fresh_dsn, autocommit=True) as conn:
        conn.execute(doc_sql("setup"))
        conn.execute("CREATE TABLE ledger_sync (synced_at timestamptz, note text)")
    return fresh_dsn


def _log() -> Any:
    return log.configure(fmt="json", level="error", fd=2)


class TestTake:
    def test_tokens_strictly_increase(self, fresh_dsn):
        """Three tokens in a row from a database without the sequence: created, increasing."""
        target = db.Target(dsn=fresh_dsn)
        tokens = [fence.take(target, app_name="test") for _ in range(3)]
        assert tokens == sorted(set(tokens))
        assert len(tokens) == 3

    def test_concurrent_first_uses_create_the_sequence_once(self, fresh_dsn):
        """Ten threads at once on a fresh database: ten distinct tokens, no error."""
        target = db.Target(dsn=fresh_dsn)
        tokens: list[int] = []
        failures: list[BaseException] = []

        def one() -> None:
            try:
                tokens.append(fence.take(target, app_name="test"))
            except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
                failures.append(exc)

        threads = [threading.Thread(target=one) for _ in range(10)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert failures == []
        assert sorted(tokens) == sorted(set(tokens))
        assert len(tokens) == 10

    def test_the_lock_is_confirmed_after_the_token(self, fresh_dsn):
        """issue(): the token first, then the lock check (a token taken after a loss is refused)."""
        target = db.Target(dsn=fresh_dsn)
        seen: list[int] = []

        class Checked:
            """A lock whose check reads how far the sequence has gone when it is called."""

            def check(self) -> None:
                with psycopg.connect(fresh_dsn) as conn:
                    row = conn.execute("SELECT last_value FROM jobrun.fence").fetchone()
                seen.append(row[0] if row else 0)

        token = fence.issue(target, Checked(), app_name="test", log=_log())  # type: ignore[arg-type]
        assert seen == [token]


class TestDocumentedGuard:
    def test_a_newer_token_wins_and_a_stale_one_is_refused(self, guarded_dsn):
        """fence_check: 5 then 7 accepted, 7 again accepted (same run), 5 refused (P0001)."""
        with psycopg.connect(guarded_dsn, autocommit=True) as conn:
            conn.execute("SELECT fence_check('j', 5)")
            conn.execute("SELECT fence_check('j', 7)")
            conn.execute("SELECT fence_check('j', 7)")
            with pytest.raises(errors.RaiseException, match="stale fencing token 5"):
                conn.execute("SELECT fence_check('j', 5)")
            row = conn.execute("SELECT token FROM fence_guard WHERE job = 'j'").fetchone()
        assert row == (7,)

    @pytest.mark.parametrize(("token", "written"), [(9, True), (3, False)])
    def test_the_documented_job_transaction_with_psql(self, guarded_dsn, token, written):
        """The doc's job block through psql: a stale token exits 3 and writes nothing."""
        with psycopg.connect(guarded_dsn, autocommit=True) as conn:
            conn.execute("SELECT fence_check('sync-ledger', 5)")
        uri = make_conninfo(guarded_dsn)
        proc = subprocess.run(
            [
                *("psql", uri, "-X", "-q", "-v", "ON_ERROR_STOP=1", "-v", "job=sync-ledger"),
                *("-v", f"token={token}", "-v", "note=nightly"),
            ],
            input=doc_sql("job"),
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert proc.returncode == (0 if written else 3), proc.stderr
        with psycopg.connect(guarded_dsn) as conn:
            rows = conn.execute("SELECT note FROM ledger_sync").fetchall()
        assert rows == ([("nightly",)] if written else [])


# A child that records its token, then (when asked) does a guarded write.
GUARDED_WRITE = """
import os, sys, psycopg
token = int(os.environ["JOBRUN_FENCE_TOKEN"])
try:
    with psycopg.connect(sys.argv[1]) as conn:
        conn.execute("SELECT fence_check('sync-ledger', %s)", (token,))
        conn.execute("INSERT INTO ledger_sync VALUES (now(), %s)", (sys.argv[2],))
    result = "accepted"
except psycopg.errors.RaiseException:
    result = "rejected"
open(sys.argv[3], "w").write(f"{token} {result}\\n")
"""


class TestEndToEnd:
    def test_the_child_gets_its_token(self, dsn, key):
        """JOBRUN_FENCE_TOKEN in the child's environment, and a fence_taken event with it."""
        proc = cli.run(
            "--key", key, "--fence", "--", sys.executable, "-c",
            "import os; print(os.environ['JOBRUN_FENCE_TOKEN'])", dsn=dsn,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert int(proc.stdout) == cli.event(proc.stderr, "fence_taken")["fence"]

    def test_session_mode_takes_the_token_on_the_lock_session(self, fresh_dsn, key):
        """Once the sequence exists, a --fence run is still one server session."""
        first = cli.run("--key", key, "--fence", "--no-history", "--", "true", dsn=fresh_dsn)
        assert first.returncode == 0, first.stderr  # creates jobrun.fence
        with SessionCounter(fresh_dsn) as counter:
            proc = cli.run("--key", key, "--fence", "--no-history", "--", "true", dsn=fresh_dsn)
            assert proc.returncode == 0, proc.stderr
            assert counter.ended_since_start(1) == 1
        tokens = [cli.event(p.stderr, "fence_taken")["fence"] for p in (first, proc)]
        assert tokens[1] > tokens[0]

    def test_with_slots_the_token_is_taken_on_the_slots_session(self, fresh_dsn, key):
        """--fence --slots 2 (session mode): the token rides the taken slot's lock session."""
        argv = ("--key", key, "--slots", "2", "--fence", "--no-history", "--")
        first = cli.run(*argv, "true", dsn=fresh_dsn)
        assert first.returncode == 0, first.stderr  # creates jobrun.fence
        with SessionCounter(fresh_dsn) as counter:
            proc = cli.run(
                *argv, sys.executable, "-c",
                "import os; print(os.environ['JOBRUN_SLOT'], os.environ['JOBRUN_FENCE_TOKEN'])",
                dsn=fresh_dsn,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr
            assert counter.ended_since_start(1) == 1
        slot, token = proc.stdout.split()
        assert slot == "0"
        assert int(token) == cli.event(proc.stderr, "fence_taken")["fence"]

    def test_without_fence_there_is_no_token(self, dsn, key):
        """No --fence: no JOBRUN_FENCE_TOKEN, no sequence touched."""
        proc = cli.run(
            "--key", key, "--", sys.executable, "-c",
            "import os; print(os.environ.get('JOBRUN_FENCE_TOKEN'))", dsn=dsn,
        )  # fmt: skip
        assert proc.stdout == "None\n"

    def test_fence_with_on_db_error_run_is_a_usage_error(self, dsn, key, tmp_path):
        """An unguarded run would have no token: refused, one line, exit 64."""
        marker = tmp_path / "ran"
        proc = cli.run(
            "--key", key, "--fence", "--on-db-error", "run", "--", "touch", str(marker), dsn=dsn
        )  # fmt: skip
        assert proc.returncode == 64
        assert proc.stderr.count("\n") == 1
        assert "--fence" in proc.stderr
        assert not marker.exists()

    def test_a_token_that_cannot_be_taken_keeps_the_child_from_starting(
        self, fresh_dsn, key, tmp_path
    ):
        """jobrun.fence is not a sequence: exit 69, the child never started."""
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            conn.execute("CREATE SCHEMA jobrun; CREATE TABLE jobrun.fence (x int)")
        marker = tmp_path / "ran"
        proc = cli.run("--key", key, "--fence", "--", "touch", str(marker), dsn=fresh_dsn)
        assert proc.returncode == 69, proc.stderr
        assert cli.event(proc.stderr, "lockstore_unavailable")["fence"] is True
        assert not marker.exists()

    def test_tokens_increase_in_acquisition_order_across_both_modes(self, dsn, key, tmp_path):
        """20 runs at once, 10 per mode, on one key: the tokens the children saw, in the
        order they ran, are strictly increasing (and so unique)."""
        seen = tmp_path / "seen"
        record = (
            "import os, sys, time\n"
            "fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_APPEND)\n"
            "os.write(fd, f\"{sys.argv[2]} {os.environ['JOBRUN_FENCE_TOKEN']}\\n\".encode())\n"
            "time.sleep(0.05)"
        )

        def start(mode: str) -> subprocess.Popen[str]:
            return subprocess.Popen(
                [*cli.JOBRUN, "--key", key, "--mode", mode, "--fence", "--wait", "120s",
                 "--", sys.executable, "-c", record, str(seen), mode],
                env=cli.environment(dsn),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )  # fmt: skip

        # The session-mode runs first (the first one surely runs), then the lease-mode runs
        # join the queue; a session-mode run that finds a lease holding the key skips.
        procs = [start("session")]
        cli.wait_until(seen.exists, what="the first run")
        procs += [start("session") for _ in range(9)] + [start("lease") for _ in range(10)]
        results = [(proc.communicate(timeout=300)[1], proc.returncode) for proc in procs]
        assert all(code in (0, 75) for _, code in results), results
        lines = [line.split() for line in seen.read_text().splitlines()]
        tokens = [int(token) for _, token in lines]
        assert tokens == sorted(tokens)
        assert len(set(tokens)) == len(tokens)
        assert {mode for mode, _ in lines} == {"session", "lease"}
        assert len(lines) == sum(1 for _, code in results if code == 0)

    def test_a_paused_holder_that_wakes_up_is_refused(self, guarded_dsn, key, tmp_path):
        """Lease mode: jobrun A is stopped, its lease expires, B runs and writes; A's child
        then tries to write with its older token and the documented guard refuses it."""
        a_token, a_result, go = tmp_path / "a.token", tmp_path / "a.result", tmp_path / "go"
        b_result = tmp_path / "b.result"
        # A's child ignores SIGTERM so that its stale attempt surely happens.
        a_child = (
            "import os, signal, sys, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
            f"open({str(a_token)!r}, 'w').write(os.environ['JOBRUN_FENCE_TOKEN'] + '\\n')\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.02)\n"
            f"sys.argv = ['', {guarded_dsn!r}, 'from A', {str(a_result)!r}]\n" + GUARDED_WRITE
        )
        # A lease lives 6 s: 4 s of it (less --kill-after and the margin) for A to start its
        # child and B not much longer to wait. A 4 s lease leaves 2 s, which a loaded
        # machine's slow start of A can use up (lock lost before the child started).
        lease = ("--mode", "lease", "--ttl", "6s", "--kill-after", "1s", "--fence")
        holder = cli.start(
            "--key", key, *lease, "--", sys.executable, "-c", a_child, dsn=guarded_dsn
        )
        try:
            cli.wait_for_file(a_token, proc=holder)
            os.kill(holder.pid, signal.SIGSTOP)  # the holder is paused: no renewal, no kill
            b = cli.run(
                "--key", key, *lease, "--wait", "60s", "--",
                sys.executable, "-c", GUARDED_WRITE, guarded_dsn, "from B", str(b_result),
                dsn=guarded_dsn,
            )  # fmt: skip
            assert b.returncode == 0, b.stderr
            go.touch()
            a_said = cli.wait_for_file(a_result)
        finally:
            if holder.poll() is None:
                os.kill(holder.pid, signal.SIGCONT)
            _, holder_stderr = holder.communicate(timeout=60)
        b_token, b_said = b_result.read_text().split()
        assert b_said == "accepted"
        assert a_said.split() == [a_token.read_text().strip(), "rejected"]
        assert int(b_token) > int(a_token.read_text())
        with psycopg.connect(guarded_dsn) as conn:
            notes = conn.execute("SELECT note FROM ledger_sync").fetchall()
        assert notes == [("from B",)]
        assert holder.returncode in (0, 76), holder_stderr


class TestNames:
    """--fence, its variable and the child's token variable are one family of names."""

    def test_jobrun_fence_turns_fencing_on(self, dsn, key):
        """JOBRUN_FENCE=1 is --fence, named after the flag as every other variable."""
        proc = cli.run(
            "--key", key, "--", sys.executable, "-c",
            "import os; print(os.environ['JOBRUN_FENCE_TOKEN'])",
            dsn=dsn, env={"JOBRUN_FENCE": "1"},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert int(proc.stdout) == cli.event(proc.stderr, "fence_taken")["fence"]

    def test_a_jobrun_inside_a_fenced_child_runs(self, dsn, key):
        """The token the child receives is not read as the nested jobrun's --fence.

        The nested run takes no token of its own, so its child gets none: a token reaches
        only the child of the run that took it.
        """
        inner = f"{key}-inner"
        proc = cli.run(
            "--key", key, "--fence", "--pass-env", "JOBRUN_DSN", "--", *cli.JOBRUN,
            "--key", inner, "--",
            sys.executable, "-c", "import os; print(os.environ.get('JOBRUN_FENCE_TOKEN'))",
            dsn=dsn,
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert cli.event(proc.stderr, "fence_taken")["fence"] > 0
        started = [line["key"] for line in cli.events(proc.stderr) if line["event"] == "started"]
        assert sorted(started) == sorted([key, inner])  # both ran, each with its own key
        assert proc.stdout.strip() == "None"

    def test_the_old_variable_still_fences_with_a_warning(self, dsn, key):
        """JOBRUN_FENCING=1 works as before, and the run says to use JOBRUN_FENCE."""
        proc = cli.run(
            "--key", key, "--", sys.executable, "-c",
            "import os; print(os.environ['JOBRUN_FENCE_TOKEN'])",
            dsn=dsn, env={"JOBRUN_FENCING": "1"},
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        assert int(proc.stdout) == cli.event(proc.stderr, "fence_taken")["fence"]
        warning = cli.event(proc.stderr, "deprecated_variable")
        assert (warning["variable"], warning["use_instead"]) == ("JOBRUN_FENCING", "JOBRUN_FENCE")
