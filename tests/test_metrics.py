"""``--metrics-file``: the Prometheus textfile after runs and skips, written atomically."""

from __future__ import annotations

import json
import os
import sys
import uuid
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from harness import jobrun_cli
from jobrun import db, keys, log
from jobrun.locks import Identity
from jobrun.run import metrics
from jobrun.run.notify import NoHistory, Notifier
from jobrun.run.recorder import Recorder
from support.history import history_config

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator
    from pathlib import Path


class Events:
    """A real jobrun logger writing JSON lines to a file, and the events written so far."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        self.log = log.configure(fmt="json", fd=self.fd)

    def named(self, name: str) -> list[dict[str, Any]]:
        lines = [json.loads(line) for line in self.path.read_text().splitlines() if line]
        return [line for line in lines if line["event"] == name]


@pytest.fixture
def events(tmp_path) -> Iterator[Events]:
    """What the code under test logged."""
    captured = Events(tmp_path / "events.jsonl")
    yield captured
    os.close(captured.fd)


def read(path: Path, key: str) -> dict[str, float]:
    """Every sample of ``key`` in the file: name (with outcome label if any) -> value."""
    values = {}
    for family in text_string_to_metric_families(path.read_text()):
        for sample in family.samples:
            if sample.labels.get("key") != key:
                continue
            name = sample.name
            if "outcome" in sample.labels:
                name = f"{name}{{{sample.labels['outcome']}}}"
            values[name] = sample.value
    return values


def sample(**overrides: Any) -> metrics.Sample:
    base: dict[str, Any] = {
        "key": "nightly",
        "outcome": "succeeded",
        "exit_code": 0,
        "started": 1_700_000_000.0,
        "finished": 1_700_000_010.0,
        "duration": 10.0,
        "skip_streak": None,
        "failure_streak": None,
    }
    return metrics.Sample(**{**base, **overrides})


class TestFile:
    """What the file holds, and how it is written."""

    def test_every_metric_is_there_labelled_by_key(self, tmp_path, events):
        """A success: start, success, duration, exit code, outcome series, streaks."""
        path = tmp_path / "nightly.prom"
        metrics.write(str(path), sample(), events.log)
        values = read(path, "nightly")
        assert values["jobrun_last_start_timestamp_seconds"] == 1_700_000_000.0
        assert values["jobrun_last_success_timestamp_seconds"] == 1_700_000_010.0
        assert values["jobrun_last_duration_seconds"] == 10.0
        assert values["jobrun_last_exit_code"] == 0
        assert values["jobrun_last_outcome{succeeded}"] == 1
        assert values["jobrun_last_outcome{failed}"] == 0
        assert values["jobrun_skip_streak"] == 0
        assert values["jobrun_failure_streak"] == 0

    def test_one_series_per_outcome_exactly_one_set(self, tmp_path, events):
        """Every outcome has a series (none vanish), and only the last one is 1."""
        path = tmp_path / "m.prom"
        metrics.write(str(path), sample(outcome="timed_out", exit_code=124), events.log)
        outcomes = {k: v for k, v in read(path, "nightly").items() if "outcome{" in k}
        assert len(outcomes) == len(metrics.OUTCOMES)
        assert [k for k, v in outcomes.items() if v == 1] == ["jobrun_last_outcome{timed_out}"]

    def test_written_atomically_leaving_no_temporary_file(self, tmp_path, events):
        """The file is replaced, never rewritten in place; nothing else is left behind."""
        path = tmp_path / "m.prom"
        metrics.write(str(path), sample(), events.log)
        first_inode = path.stat().st_ino
        metrics.write(str(path), sample(outcome="failed", exit_code=1), events.log)
        assert path.stat().st_ino != first_inode
        assert sorted(p.name for p in tmp_path.iterdir()) == ["events.jsonl", "m.prom"]

    def test_last_success_is_kept_across_a_failure(self, tmp_path, events):
        """A failure after a success keeps the success's timestamp."""
        path = tmp_path / "m.prom"
        metrics.write(str(path), sample(finished=1_700_000_010.0), events.log)
        failed = sample(outcome="failed", exit_code=1, finished=1_700_000_500.0)
        metrics.write(str(path), failed, events.log)
        values = read(path, "nightly")
        assert values["jobrun_last_success_timestamp_seconds"] == 1_700_000_010.0
        assert values["jobrun_last_exit_code"] == 1

    def test_no_success_yet_is_zero(self, tmp_path, events):
        """A first run that failed: last success 0 (an alert on its age fires, as it should)."""
        path = tmp_path / "m.prom"
        metrics.write(str(path), sample(outcome="failed", exit_code=1), events.log)
        assert read(path, "nightly")["jobrun_last_success_timestamp_seconds"] == 0

    def test_a_skip_keeps_the_last_duration_and_counts_on_the_streak(self, tmp_path, events):
        """Without history, skips count on from the file; the last run's duration stays."""
        path = tmp_path / "m.prom"
        metrics.write(str(path), sample(duration=42.0), events.log)
        for _ in range(2):
            skip = sample(outcome="skipped", exit_code=75, duration=None)
            metrics.write(str(path), skip, events.log)
        values = read(path, "nightly")
        assert values["jobrun_last_duration_seconds"] == 42.0
        assert values["jobrun_skip_streak"] == 2
        assert values["jobrun_last_outcome{skipped}"] == 1

    def test_a_known_streak_wins_over_the_file(self, tmp_path, events):
        """The history's count (a fleet-wide view) replaces the file's own count."""
        path = tmp_path / "m.prom"
        skip = sample(outcome="skipped", exit_code=75, duration=None, skip_streak=7)
        metrics.write(str(path), skip, events.log)
        assert read(path, "nightly")["jobrun_skip_streak"] == 7

    def test_key_placeholder_gives_each_key_its_own_file(self, tmp_path, events):
        """{key} in the path becomes a file-name-safe form of the key."""
        template = str(tmp_path / "jobrun-{key}.prom")
        metrics.write(template, sample(key="reports/daily"), events.log)
        metrics.write(template, sample(key="nightly"), events.log)
        names = sorted(p.name for p in tmp_path.glob("jobrun-*.prom"))
        assert names == ["jobrun-nightly.prom", "jobrun-reports_daily.prom"]
        assert read(tmp_path / "jobrun-reports_daily.prom", "reports/daily")

    def test_an_unwritable_directory_is_one_warning(self, tmp_path, events):
        """A path in a missing directory: metrics_failed, no exception."""
        metrics.write(str(tmp_path / "missing" / "m.prom"), sample(), events.log)
        (line,) = events.named("metrics_failed")
        assert line["level"] == "warning"

    def test_without_prometheus_client_is_one_warning(self, tmp_path, events, monkeypatch):
        """prometheus-client not installed: metrics_unavailable with the install hint."""
        monkeypatch.setitem(sys.modules, "prometheus_client", None)
        metrics.write(str(tmp_path / "m.prom"), sample(), events.log)
        (line,) = events.named("metrics_unavailable")
        assert "metrics extra" in line["hint"]
        assert not (tmp_path / "m.prom").exists()

    def test_a_file_that_is_not_ours_is_replaced(self, tmp_path, events):
        """Garbage in the file: it is rewritten from scratch."""
        path = tmp_path / "m.prom"
        path.write_text("this is { not prometheus\n")
        metrics.write(str(path), sample(), events.log)
        assert read(path, "nightly")["jobrun_last_exit_code"] == 0


@pytest.fixture
def recorder_for(dsn, key, events) -> Callable[..., Recorder]:
    """``make(metrics_file) -> Recorder`` for this test's key."""

    def make(metrics_file: str) -> Recorder:
        return Recorder(
            db.Target(dsn=dsn),
            Identity(run_id=str(uuid.uuid4()), host="host-a", pid=1),
            keys.resolve((key,), ()),
            mode="session",
            program="job",
            config=history_config(metrics_file=metrics_file, alert_after=0),
            log=events.log,
        )

    return make


class TestRecorders:
    """Both recorders write the file after every run and skip."""

    def test_recorder_writes_after_a_run(self, tmp_path, key, recorder_for):
        """A finished run: its outcome, exit code and duration."""
        path = tmp_path / "m.prom"
        recorder = recorder_for(str(path))
        recorder.started(1)
        recorder.finished("failed", 2, None, 3.5)
        values = read(path, key)
        assert values["jobrun_last_exit_code"] == 2
        assert values["jobrun_last_duration_seconds"] == 3.5
        assert values["jobrun_failure_streak"] == 1

    def test_recorder_writes_the_historys_skip_streak(self, tmp_path, key, recorder_for):
        """Three skips behind one holder: skip streak 3 from the history."""
        path = tmp_path / "m.prom"
        blocker = {"holder_run_id": str(uuid.uuid4())}
        for _ in range(3):
            recorder_for(str(path)).skipped("locked", blocker, 75)
        assert read(path, key)["jobrun_skip_streak"] == 3

    def test_null_recorder_writes_too(self, tmp_path, key, events):
        """--no-history still writes metrics."""
        path = tmp_path / "m.prom"
        config = history_config(metrics_file=str(path))
        identity = Identity(run_id=str(uuid.uuid4()))
        notifier = Notifier(
            key, [keys.lock_id_for(key)], identity, mode="session", config=config, log=events.log
        )
        null = NoHistory(notifier)
        null.exec_failed(127)
        values = read(path, key)
        assert values["jobrun_last_outcome{exec_failed}"] == 1
        assert values["jobrun_last_exit_code"] == 127


class TestWiredThroughCli:
    """``--metrics-file`` on the run command: needs the lead's wiring in cli.py."""

    def test_a_run_writes_the_file(self, dsn, key, tmp_path):
        """jobrun --metrics-file PATH: the file exists with the run's exit code."""
        path = tmp_path / "jobrun-{key}.prom"
        result = jobrun_cli.run(
            "--key", key, "--metrics-file", str(path), "--", "sh", "-c", "exit 4", dsn=dsn
        )
        assert result.returncode == 4, result.stderr
        written = tmp_path / metrics.path_for("jobrun-{key}.prom", key)
        assert read(written, key)["jobrun_last_exit_code"] == 4
