"""Helpers and fixtures of the run-history tests: recorders, rows, hooks, limited roles."""

from __future__ import annotations

import json
import os
import sys
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
import pytest
from psycopg.rows import dict_row

from jobrun import db, keys, log
from jobrun.db.server_session import ServerSession
from jobrun.history.config import CALL_TIMEOUT, HistoryConfig
from jobrun.history.schema import ensure as ensure_schema
from jobrun.locks import Identity
from jobrun.run.recorder import Recorder

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from pathlib import Path


# --- helpers ---------------------------------------------------------------------------------


class Captured:
    """A real jobrun logger writing JSON lines to a file, and the events written so far."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.log = log.configure(fmt="json", level="info", fd=self._fd)

    def events(self, name: str | None = None) -> list[dict[str, Any]]:
        lines = self.path.read_text().splitlines()
        found = [json.loads(line) for line in lines if line.strip()]
        return [e for e in found if name is None or e["event"] == name]

    def close(self) -> None:
        os.close(self._fd)


@pytest.fixture
def captured(tmp_path) -> Iterator[Captured]:
    """Events logged by the recorders of a test."""
    capture = Captured(tmp_path / "events.jsonl")
    yield capture
    capture.close()


#: A run's history settings as the run command's defaults make them.
PLAIN_RUN = {
    "keep": 100,
    "alert_after": 3,
    "alert_repeat": 3600.0,
    "on_alert": None,
    "metrics_file": None,
    "timeout": CALL_TIMEOUT,
    "expect_every": None,
    "expect_grace": None,
}


def history_config(**values: Any) -> HistoryConfig:
    """A plain run's HistoryConfig, with ``values`` in place of its own."""
    return HistoryConfig(**{**PLAIN_RUN, **values})


def lock_session(conn: psycopg.Connection[Any], target: db.Target) -> ServerSession:
    """A run's session (session mode) over ``conn``, opened by the test as the lock opens it."""
    session = ServerSession(
        target, app_name="jobrun:test", held=True, comment="/* jobrun-holder {} */ "
    )
    session._conn = conn  # noqa: SLF001 - the connection the test made stands for the lock's
    return session


@dataclass
class Run:
    """A Recorder with the run id and key label it records under."""

    recorder: Recorder
    run_id: str
    label: str
    dsn: str

    def __getattr__(self, name: str) -> Any:
        return getattr(self.recorder, name)

    def finished(self, outcome: str, exit_code: int, signal: str | None, duration: float) -> None:
        """End the run as a run does: its end row, then (after the release) its alert hooks."""
        self.recorder.finished(outcome, exit_code, signal, duration)
        self.recorder.flush()

    def exec_failed(self, exit_code: int) -> None:
        """The command could not be started, as a run records it (hooks after the release)."""
        self.recorder.exec_failed(exit_code)
        self.recorder.flush()

    def running(self, child_pid: int = 1) -> None:
        """Take the lock as a run does: acquired() writes the running row, then the child."""
        self.recorder.acquired(None)
        self.recorder.started(child_pid)


@pytest.fixture
def make_recorder(dsn, key, captured) -> Callable[..., Run]:
    """``make(host=..., config=..., ...) -> Run`` for this test's key, a new run id each."""

    def make(
        *,
        host: str = "host-a",
        pid: int = 4242,
        config: HistoryConfig | None = None,
        names: tuple[str, ...] = (key,),
        target_dsn: str | None = None,
        mode: str = "session",
        program: str = "backup.sh",
        environ: Mapping[str, str] | None = None,
        shared: psycopg.Connection[Any] | None = None,
    ) -> Run:
        identity = Identity(run_id=str(uuid.uuid4()), host=host, pid=pid)
        run_keys = keys.resolve(names, ())
        target = db.Target(dsn=target_dsn if target_dsn is not None else dsn)
        recorder = Recorder(
            target,
            identity,
            run_keys,
            mode=mode,
            program=program,
            config=config or history_config(),
            # As the CLI does: every line names the run.
            log=captured.log.bind(run_id=identity.run_id, host=host, pid=pid),
            environ=environ,
            session=None if shared is None else lock_session(shared, target),
        )
        return Run(
            recorder,
            identity.run_id,
            keys.describe(run_keys),
            target_dsn if target_dsn is not None else dsn,
        )

    return make


def rows_of(dsn: str, label: str) -> list[dict[str, Any]]:
    """Every history row of ``label``, newest first (none while there is no table)."""
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        try:
            return conn.execute(
                "SELECT * FROM jobrun.runs WHERE key = %s ORDER BY started_at DESC", (label,)
            ).fetchall()
        except psycopg.errors.UndefinedTable:
            return []


def row_of(dsn: str, run_id: str) -> dict[str, Any]:
    """The history row of one run."""
    with psycopg.connect(dsn, row_factory=dict_row) as conn:
        row = conn.execute("SELECT * FROM jobrun.runs WHERE run_id = %s", (run_id,)).fetchone()
    assert row is not None, f"no row for run {run_id}"
    return row


def table_exists(dsn: str) -> bool:
    with psycopg.connect(dsn) as conn:
        row = conn.execute("SELECT to_regclass('jobrun.runs') IS NOT NULL").fetchone()
    return bool(row and row[0])


def holder(run_id: str, host: str = "holder-host") -> dict[str, object]:
    """Skip fields as the runner passes them for a jobrun holder."""
    return {"holder_run_id": run_id, "holder_host": host, "holder_pid": 99}


def hook(path: Path) -> tuple[str, ...]:
    """An --on-alert hook that appends its stdin and JOBRUN_ALERT_* variables to ``path``."""
    body = (
        "import json, os, sys\n"
        "data = sys.stdin.read()\n"
        "env = {k: v for k, v in os.environ.items() if k.startswith('JOBRUN_ALERT_')}\n"
        "with open(sys.argv[1], 'a') as f:\n"
        "    f.write(json.dumps({'stdin': data, 'env': env}) + '\\n')\n"
    )
    return (sys.executable, "-c", body, str(path))


def hook_calls(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines()]


def ensure_runs_table(dsn: str) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        ensure_schema(conn)
