"""``jobrun status`` and ``jobrun history`` against a real PostgreSQL, in both lock modes."""

from __future__ import annotations

import json
import os
import socket
import uuid
from typing import TYPE_CHECKING, Any

import click
import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql as pgsql

from harness import jobrun_cli
from harness.jobrun_cli import wait_for_file
from jobrun import db, keys, log
from jobrun.cli.ops import (
    deadlocks_command,
    doctor_command,
    history_command,
    show_command,
    status_command,
)
from jobrun.exitcodes import Exit, LockStoreUnavailable, UsageError
from jobrun.history import schema
from jobrun.locks import Identity
from jobrun.run.recorder import Recorder
from support.history import history_config

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

#: The documented fields of one ``jobrun status --json`` object (docs/operations.md).
STATUS_FIELDS = {
    "paused",
    "expect_every",
    "expect_grace",
    "overdue",
    "running_for",
    "stuck",
    "slots_in_use",
    "abandoned_run",
    "key",
    "lock_ids",
    "held",
    "holder",
    "last_outcome",
    "last_exit_code",
    "last_started_at",
    "last_finished_at",
    "last_deadlocks",
    "last_duration",
    "last_success_at",
    "typical_duration",
    "skip_streak",
    "failure_streak",
    "last_skip_at",
}
HOLDER_FIELDS = {
    "mode",
    "host",
    "pid",
    "run_id",
    "since",
    "backend_pid",
    "client_addr",
    "application_name",
    "expires_at",
    "role",
}
HISTORY_FIELDS = {
    "run_id",
    "key",
    "lock_ids",
    "mode",
    "host",
    "pid",
    "child_pid",
    "program",
    "started_at",
    "finished_at",
    "outcome",
    "reason",
    "exit_code",
    "signal",
    "duration",
    "deadlocks",
    "streak",
    "holder",
    # --coalesce, --jitter, --retries
    "queued_seconds",
    "jitter_seconds",
    "attempts",
    "attempt_exit_codes",
}


@pytest.fixture
def ops() -> Callable[..., click.testing.Result]:
    """``invoke(dsn, *args) -> Result``: the subcommands on a throwaway group, in-process."""
    group = click.Group(
        commands=[status_command, history_command, doctor_command, deadlocks_command, show_command]
    )
    runner = CliRunner()

    def invoke(dsn: str, *args: str) -> click.testing.Result:
        return runner.invoke(group, list(args), env={"JOBRUN_DSN": dsn}, standalone_mode=False)

    return invoke


def status_json(ops, dsn: str, *labels: str) -> list[dict[str, Any]]:
    result = ops(dsn, "status", *labels, "--json")
    assert result.exception is None, result.output
    assert result.return_value == 0
    return json.loads(result.stdout)


def one_status(ops, dsn: str, label: str) -> dict[str, Any]:
    (row,) = status_json(ops, dsn, label)
    return row


@pytest.fixture
def record(dsn, key, tmp_path) -> Iterator[Callable[..., Recorder]]:
    """``record(host=...) -> Recorder`` for this test's key (a new run each time)."""
    fd = os.open(tmp_path / "events.jsonl", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    logger = log.configure(fmt="json", fd=fd)

    def make(host: str = "host-a", label: str = key) -> Recorder:
        return Recorder(
            db.Target(dsn=dsn),
            Identity(run_id=str(uuid.uuid4()), host=host, pid=4242),
            keys.resolve((label,), ()),
            mode="session",
            program="job",
            config=history_config(alert_after=0),
            log=logger,
        )

    yield make
    os.close(fd)


def negative_key(prefix: str) -> str:
    """A key name whose lock id is negative (its classid has the high bit set)."""
    for n in range(1000):
        name = f"{prefix}-neg-{n}"
        if keys.lock_id_for(name) < 0:
            return name
    raise AssertionError("no negative lock id in 1000 names")  # pragma: no cover


class TestStatusWhileHeld:
    """A run holding the lock shows up with who holds it, in both modes."""

    @pytest.mark.parametrize("mode", ["session", "lease"])
    def test_shows_the_holder_of_a_running_job(self, ops, dsn, key, tmp_path, mode):
        """held, the mode, and the holder's host, jobrun pid, run id and start."""
        marker = tmp_path / "child"
        proc = jobrun_cli.start(
            "--key", key, "--mode", mode, "--", *jobrun_cli.holder_marker(marker), dsn=dsn
        )
        try:
            wait_for_file(marker)
            row = one_status(ops, dsn, key)
        finally:
            jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)
        assert row["held"] is True
        holder = row["holder"]
        assert holder["mode"] == mode
        assert (holder["host"], holder["pid"]) == (socket.gethostname(), proc.pid)
        assert uuid.UUID(holder["run_id"])
        assert holder["since"]
        if mode == "lease":
            assert holder["expires_at"] > holder["since"]
        else:
            assert holder["application_name"] == f"jobrun:{key}"

    def test_a_negative_lock_id_is_found(self, ops, dsn, key, tmp_path):
        """pg_locks' classid/objid pair of a negative id maps back to the key."""
        name = negative_key(key)
        marker = tmp_path / "child"
        proc = jobrun_cli.start("--key", name, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            wait_for_file(marker)
            row = one_status(ops, dsn, name)
        finally:
            jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)
        assert row["lock_ids"] == [keys.lock_id_for(name)]
        assert row["held"] is True
        assert row["holder"]["pid"] == proc.pid

    def test_without_keys_jobrun_sessions_are_listed(self, ops, dsn, key, tmp_path):
        """With no KEY, a key held by a jobrun session shows even without history."""
        marker = tmp_path / "child"
        proc = jobrun_cli.start(
            "--key", key, "--no-history", "--", *jobrun_cli.holder_marker(marker), dsn=dsn
        )
        try:
            wait_for_file(marker)
            rows = {row["key"]: row for row in status_json(ops, dsn)}
        finally:
            jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)
        assert rows[key]["held"] is True
        assert rows[key]["holder"]["pid"] == proc.pid

    def test_a_foreign_holder_is_named_by_its_backend(self, ops, dsn, key):
        """A session that is not jobrun holding the key: held, by backend pid."""
        with psycopg.connect(dsn, autocommit=True, application_name="legacy-app") as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (keys.lock_id_for(key),))
            row = one_status(ops, dsn, key)
            assert row["holder"]["backend_pid"] == conn.info.backend_pid
        assert row["holder"]["host"] is None
        assert row["holder"]["application_name"] == "legacy-app"

    def test_a_multi_key_run_without_history_is_found(self, ops, dsn, key, tmp_path):
        """--no-history --key x --key y: `status x,y` finds it held through each part."""
        names = (f"{key}-x", f"{key}-y")
        run_keys = keys.resolve(names, ())
        marker = tmp_path / "child"
        proc = jobrun_cli.start(
            "--no-history", "--key", names[0], "--key", names[1],
            "--", *jobrun_cli.holder_marker(marker), dsn=dsn,
        )  # fmt: skip
        try:
            wait_for_file(marker)
            row = one_status(ops, dsn, keys.describe(run_keys))
        finally:
            jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)
        assert row["lock_ids"] == [k.lock_id for k in run_keys]
        assert row["held"] is True
        assert row["holder"]["pid"] == proc.pid

    @pytest.mark.parametrize(
        "announced",
        [
            '{"pid": 1.5}',
            '{"pid": "12ab"}',
            '{"pid": true, "host": "web1"}',
            # Deeper than json's recursion limit, within the default track_activity_query_size.
            '{"pid": ' + "[" * 960 + "}",
        ],
        ids=["float", "not-digits", "bool", "too-deep"],
    )
    def test_a_malformed_holder_comment_still_shows_the_holder(self, ops, dsn, key, announced):
        """Any session can write the comment: a bad pid is unknown, the holder still shows."""
        query = pgsql.SQL("/* jobrun-holder {} */ SELECT pg_advisory_lock(%s)")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(query.format(pgsql.SQL(announced)), (keys.lock_id_for(key),))
            row = one_status(ops, dsn, key)
            assert row["holder"]["backend_pid"] == conn.info.backend_pid
        assert row["held"] is True
        assert row["holder"]["pid"] is None

    def test_an_expired_lease_is_not_held(self, ops, dsn, key):
        """A lease row past its expiry is free, whatever the row says."""
        with psycopg.connect(dsn, autocommit=True) as conn:
            schema.ensure(conn)
            conn.execute(
                "INSERT INTO jobrun.leases VALUES (%s, %s, %s, 'gone', 1, now() - interval '1h',"
                " now() - interval '1h', now() - interval '1s')",
                (keys.lock_id_for(key), key, str(uuid.uuid4())),
            )
        assert one_status(ops, dsn, key)["held"] is False

    def test_a_free_unknown_key_is_one_empty_row(self, ops, dsn, key):
        """A key nobody holds and nothing recorded: held false, no history."""
        row = one_status(ops, dsn, key)
        assert row["held"] is False
        assert row["holder"] is None
        assert row["last_outcome"] is None
        assert (row["skip_streak"], row["failure_streak"]) == (0, 0)


class TestStatusFromHistory:
    """Last outcome, typical duration and streaks come from jobrun.runs."""

    def test_last_outcome_success_and_typical_duration(self, ops, dsn, key, record):
        """Three successes (1s, 2s, 10s) then a failure: last failed, typical 2s."""
        for duration in (1.0, 2.0, 10.0):
            recorder = record()
            recorder.started(1)
            recorder.finished("succeeded", 0, None, duration)
        last = record()
        last.started(1)
        last.finished("failed", 3, None, 4.0)
        row = one_status(ops, dsn, key)
        assert (row["last_outcome"], row["last_exit_code"], row["last_duration"]) == (
            "failed",
            3,
            4.0,
        )
        assert row["typical_duration"] == 2.0
        assert row["last_success_at"] <= row["last_finished_at"]
        assert row["failure_streak"] == 1

    def test_streaks(self, ops, dsn, key, record):
        """Two failures, then three skips behind one holder: failures 2, skips 3."""
        for _ in range(2):
            record().finished("failed", 1, None, 1.0)
        blocker = {"holder_run_id": str(uuid.uuid4())}
        for _ in range(3):
            record().skipped("locked", blocker, 75)
        row = one_status(ops, dsn, key)
        assert (row["failure_streak"], row["skip_streak"]) == (2, 3)
        assert row["last_skip_at"]

    def test_a_run_resets_the_skip_streak(self, ops, dsn, key, record):
        """Skips followed by a started run: skip streak 0."""
        record().skipped("locked", {"holder_run_id": str(uuid.uuid4())}, 75)
        running = record()
        running.acquired(None)  # the running row, as a run that took the lock writes it
        running.started(1)
        running.finished("succeeded", 0, None, 1.0)
        assert one_status(ops, dsn, key)["skip_streak"] == 0

    def test_without_keys_every_key_in_history_is_listed(self, ops, dsn, key, record):
        """Two keys with history both appear, sorted."""
        record(label=f"{key}-b").finished("succeeded", 0, None, 1.0)
        record(label=f"{key}-a").finished("succeeded", 0, None, 1.0)
        listed = [row["key"] for row in status_json(ops, dsn) if row["key"].startswith(key)]
        assert listed == [f"{key}-a", f"{key}-b"]

    def test_json_has_exactly_the_documented_fields(self, ops, dsn, key, record):
        """Every object has the documented fields; a holder has the documented ones."""
        record().finished("succeeded", 0, None, 1.0)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (keys.lock_id_for(key),))
            row = one_status(ops, dsn, key)
        assert set(row) == STATUS_FIELDS
        assert set(row["holder"]) == HOLDER_FIELDS

    def test_the_table_is_for_people(self, ops, dsn, key, record):
        """Without --json: a header line and one aligned line per key."""
        record().finished("succeeded", 0, None, 1.0)
        result = ops(dsn, "status", key)
        header, line = result.stdout.splitlines()
        assert header.split()[:3] == ["KEY", "HOLDER", "SINCE"]
        assert line.startswith(key)
        assert "succeeded" in line
        assert header.index("LAST") == line.index("succeeded")


class TestStatusWithoutHistory:
    """A database without jobrun's schema still shows what is held."""

    def test_held_locks_show_and_a_note_says_why_history_is_empty(self, ops, fresh_dsn, key):
        """No jobrun.runs: the held key shows, and stderr says there is no history yet."""
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (keys.lock_id_for(key),))
            result = ops(fresh_dsn, "status", key, "--json")
        assert result.return_value == 0
        (row,) = json.loads(result.stdout)
        assert row["held"] is True
        assert "no run history" in result.stderr

    def test_nothing_at_all_says_so(self, ops, fresh_dsn):
        """An empty database: one line saying nothing is held, exit 0."""
        result = ops(fresh_dsn, "status")
        assert result.return_value == 0
        assert result.stdout.strip() == "nothing held, no run history"


class TestHistoryCommand:
    """``jobrun history KEY``: newest first, limited, readable or JSON."""

    def test_lists_runs_newest_first_within_the_limit(self, ops, dsn, key, record):
        """Three runs, --limit 2: the two newest, newest first."""
        exit_codes = (0, 1, 2)
        for code in exit_codes:
            record().finished("succeeded" if code == 0 else "failed", code, None, 1.0)
        result = ops(dsn, "history", key, "--limit", "2", "--json")
        runs = json.loads(result.stdout)
        assert [run["exit_code"] for run in runs] == [2, 1]
        assert set(runs[0]) == HISTORY_FIELDS
        assert runs[0]["lock_ids"] == [keys.lock_id_for(key)]

    def test_the_table_names_who_held_a_skipped_run(self, ops, dsn, key, record):
        """A skip's line says who held the lock."""
        holder = {"holder_run_id": str(uuid.uuid4()), "holder_host": "web9", "holder_pid": 7}
        record().skipped("locked", holder, 75)
        lines = ops(dsn, "history", key).stdout.splitlines()
        assert lines[0].split() == [
            "STARTED",
            "OUTCOME",
            "EXIT",
            "DURATION",
            "DEADLOCKS",
            "HOST",
            "PID",
            "RUN",
            "NOTE",
        ]
        assert "skipped" in lines[1]
        assert "locked, held by web9 pid 7" in lines[1]

    def test_an_unknown_key_is_an_empty_history(self, ops, dsn, key):
        """No rows: a line saying so, exit 0."""
        result = ops(dsn, "history", key)
        assert result.return_value == 0
        assert "no runs" in result.stdout

    def test_a_bad_key_is_a_usage_error(self, ops, dsn):
        """A key with a control character: UsageError (exit 64)."""
        result = ops(dsn, "history", "bad\x01key")
        assert isinstance(result.exception, UsageError)


class TestConnectionErrors:
    """Unreachable: one line, exit 69, never the password."""

    def test_unreachable_is_lockstore_unavailable_without_the_password(self, ops):
        """A DSN with a password and a dead port: exit 69 and the password masked."""
        result = ops("host=127.0.0.1 port=1 dbname=x password=hunter2secret", "status")
        assert isinstance(result.exception, LockStoreUnavailable)
        assert result.exception.exit_code == Exit.UNAVAILABLE
        assert "hunter2secret" not in str(result.exception)
        assert "127.0.0.1" in str(result.exception)

    def test_a_bad_connect_timeout_is_a_usage_error(self, ops, dsn):
        """--connect-timeout soon: UsageError."""
        result = ops(dsn, "status", "--connect-timeout", "soon")
        assert isinstance(result.exception, UsageError)


class TestWiredThroughCli:
    """``python -m jobrun status``/``history``: the subcommands wired into the group."""

    def test_status_json_through_the_real_cli(self, dsn, key, tmp_path):
        """A run holding the key, and `jobrun status KEY --json` in another process."""
        marker = tmp_path / "child"
        proc = jobrun_cli.start("--key", key, "--", *jobrun_cli.holder_marker(marker), dsn=dsn)
        try:
            wait_for_file(marker)
            result = jobrun_cli.run("status", key, "--json", dsn=dsn)
        finally:
            jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)
        assert result.returncode == 0, result.stderr
        (row,) = json.loads(result.stdout)
        assert row["holder"]["pid"] == proc.pid

    def test_history_after_a_real_run(self, dsn, key):
        """`jobrun history KEY --json` lists the run that just ended."""
        assert jobrun_cli.run("--key", key, "--", "sh", "-c", "exit 3", dsn=dsn).returncode == 3
        result = jobrun_cli.run("history", key, "--json", dsn=dsn)
        assert result.returncode == 0, result.stderr
        (run,) = json.loads(result.stdout)
        assert (run["outcome"], run["exit_code"], run["program"]) == ("failed", 3, "sh")

    def test_unreachable_exits_69_with_one_line(self, jobrun_here, key):
        """No database: exit 69 and one error line on stderr."""
        result = jobrun_here.run("status", key, dsn="host=127.0.0.1 port=1 connect_timeout=2")
        assert result.returncode == 69
        assert len(result.stderr.strip().splitlines()) == 1


def int4(unsigned: int) -> int:
    """An unsigned 32-bit half as the signed int4 PostgreSQL's two-key functions take."""
    return unsigned - 2**32 if unsigned >= 2**31 else unsigned


#: How another session takes a key's lock: the bigint form jobrun uses, or the pair of int4
#: halves with the very same classid/objid in pg_locks.
FORMS = {
    "bigint": ("SELECT pg_advisory_lock(%s)", lambda key: (key.lock_id,)),
    "int4-pair": (
        "SELECT pg_advisory_lock(%s::int4, %s::int4)",
        lambda key: tuple(int4(half) for half in key.pg_locks_pair),
    ),
}


@pytest.fixture
def held_in_form(dsn, key, request) -> Iterator[tuple[str, keys.Key, int]]:
    """Another session holding ``key`` in the form named by the parameter.

    Yields (form, key, pg_locks objsubid of that session's lock), and ends the session after.
    """
    form = request.param
    statement, args = FORMS[form]
    parsed = keys.from_name(key)
    with psycopg.connect(dsn, autocommit=True, application_name="other-app") as conn:
        conn.execute(statement, args(parsed))
        row = conn.execute(
            "SELECT classid::int8, objid::int8, objsubid FROM pg_locks"
            " WHERE locktype = 'advisory' AND granted AND pid = pg_backend_pid()"
        ).fetchone()
        assert row is not None
        classid, objid, objsubid = row
        # The same classid/objid either way: only objsubid tells the two locks apart.
        assert (classid, objid) == parsed.pg_locks_pair
        yield form, parsed, int(objsubid)


class TestInt4PairIsAnotherLock:
    """pg_advisory_lock(int4, int4) on a key's classid/objid is not the key's lock.

    In pg_locks both show the same classid and objid: the bigint form has objsubid 1, the
    pair objsubid 2, and the server treats them as two locks that never conflict.
    """

    @pytest.mark.parametrize(
        ("held_in_form", "objsubid"),
        [("bigint", 1), ("int4-pair", 2)],
        indirect=["held_in_form"],
    )
    def test_pg_locks_tells_the_forms_apart_by_objsubid(self, held_in_form, objsubid):
        """The bigint form is objsubid 1, the int4 pair with the same classid/objid 2."""
        _, _, shown = held_in_form
        assert shown == objsubid

    @pytest.mark.parametrize(
        ("held_in_form", "held"),
        [("bigint", True), ("int4-pair", False)],
        indirect=["held_in_form"],
    )
    def test_status_shows_only_the_bigint_form_as_held(self, dsn, held_in_form, held):
        """`jobrun status KEY --json`: held behind the bigint form, free beside the pair."""
        _, parsed, _ = held_in_form
        result = jobrun_cli.run("status", parsed.label, "--json", dsn=dsn)
        assert result.returncode == 0, result.stderr
        (row,) = json.loads(result.stdout)
        assert row["held"] is held
        assert (row["holder"] is not None) is held

    @pytest.mark.parametrize(
        ("held_in_form", "status"),
        [("bigint", int(Exit.SKIPPED)), ("int4-pair", 0)],
        indirect=["held_in_form"],
    )
    def test_a_run_skips_only_behind_the_bigint_form(self, dsn, held_in_form, status, tmp_path):
        """`jobrun --key KEY -- touch F`: skips (75) behind the bigint form, runs beside it."""
        _, parsed, _ = held_in_form
        marker = tmp_path / "ran"
        result = jobrun_cli.run("--key", parsed.label, "--", "touch", str(marker), dsn=dsn)
        assert result.returncode == status, result.stderr
        assert marker.exists() is (status == 0)
