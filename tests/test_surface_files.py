"""--log-file and --metrics-file never write through a link or into another user's file."""

from __future__ import annotations

import json
import os
import pwd
import threading
from typing import TYPE_CHECKING

import pytest

from harness import jobrun_cli as cli
from jobrun import log
from jobrun.run import metrics

if TYPE_CHECKING:
    from pathlib import Path

VICTIM = "what the victim file holds\n"

as_root = pytest.mark.skipif(os.geteuid() != 0, reason="only root may hand a file to another user")


@pytest.fixture
def victim(tmp_path: Path) -> Path:
    """A file someone wants jobrun to write into."""
    path = tmp_path / "victim"
    path.write_text(VICTIM)
    return path


def run_logging_to(path: Path, dsn: str, key: str) -> dict[str, object]:
    """A run with ``--log-file path``: it goes on, and its log_file_unavailable event."""
    result = cli.run("--key", key, "--log-file", str(path), "--", "true", dsn=dsn, timeout=30)
    assert result.returncode == 0, result.stderr
    return cli.event(result.stderr, "log_file_unavailable")


class TestLogFile:
    """--log-file opens only a file of its own: otherwise the events go to stderr."""

    def test_a_planted_symbolic_link_is_not_followed(self, dsn, key, tmp_path, victim):
        """A link at the path: refused as a link, and what it points to is untouched."""
        link = tmp_path / "jobrun.log"
        link.symlink_to(victim)
        refused = run_logging_to(link, dsn, key)
        assert "symbolic link" in str(refused["error"])
        assert victim.read_text() == VICTIM

    def test_a_fifo_without_a_reader_is_no_hang(self, dsn, key, tmp_path):
        """A FIFO planted at the path (nobody reading): refused at once, the run goes on."""
        fifo = tmp_path / "jobrun.log"
        os.mkfifo(fifo)
        run_logging_to(fifo, dsn, key)

    @as_root
    def test_as_root_a_file_of_another_user_is_refused(self, dsn, key, tmp_path):
        """Root does not append to a file that nobody owns; the file stays empty."""
        path = tmp_path / "jobrun.log"
        path.touch()
        nobody = pwd.getpwnam("nobody")
        os.chown(path, nobody.pw_uid, nobody.pw_gid)
        refused = run_logging_to(path, dsn, key)
        assert "owned by nobody" in str(refused["error"])
        assert path.read_text() == ""

    @as_root
    def test_as_root_a_file_with_another_name_is_refused(self, dsn, key, tmp_path, victim):
        """A hard link to a file of root's: refused, and the file is untouched."""
        path = tmp_path / "jobrun.log"
        path.hardlink_to(victim)
        refused = run_logging_to(path, dsn, key)
        assert "hard links" in str(refused["error"])
        assert victim.read_text() == VICTIM


@pytest.fixture
def warnings(tmp_path: Path):
    """A real logger writing JSON lines to a file, and a reader of the events it wrote."""
    path = tmp_path / "events.jsonl"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)

    def named(name: str) -> list[dict[str, object]]:
        lines = [json.loads(line) for line in path.read_text().splitlines() if line]
        return [line for line in lines if line["event"] == name]

    yield log.configure(fmt="json", fd=fd), named
    os.close(fd)


def sample() -> metrics.Sample:
    return metrics.Sample(
        key="nightly",
        outcome="succeeded",
        exit_code=0,
        started=1.0,
        finished=2.0,
        duration=1.0,
        skip_streak=0,
        failure_streak=0,
    )


class TestMetricsFile:
    """--metrics-file replaces its file atomically, never writing through a planted link."""

    def test_a_planted_symbolic_link_is_refused(self, dsn, key, tmp_path, victim):
        """A link at the path: metrics_failed, the link stays, what it points to is untouched."""
        link = tmp_path / "jobrun.prom"
        link.symlink_to(victim)
        result = cli.run(
            "--key", key, "--metrics-file", str(link), "--", "true", dsn=dsn, timeout=30
        )
        assert result.returncode == 0, result.stderr
        assert "symbolic link" in cli.event(result.stderr, "metrics_failed")["error"]
        assert link.is_symlink()
        assert victim.read_text() == VICTIM

    def test_a_link_at_a_guessable_temporary_name_is_not_written_through(
        self, tmp_path, victim, warnings
    ):
        """The temporary file is a new file of a random name: a link planted beside is unused."""
        logger, named = warnings
        path = tmp_path / "jobrun.prom"
        # The name prometheus_client's write_to_textfile uses: PATH.PID.THREAD.
        (tmp_path / f"jobrun.prom.{os.getpid()}.{threading.current_thread().ident}").symlink_to(
            victim
        )
        metrics.write(str(path), sample(), logger)
        assert named("metrics_failed") == []
        assert victim.read_text() == VICTIM
        assert "jobrun_last_exit_code" in path.read_text()
        assert sorted(p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")) == []
