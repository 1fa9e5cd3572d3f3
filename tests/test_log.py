"""Event lines: one JSON object per line, secrets masked, library warnings kept in format."""

from __future__ import annotations

import json
import logging
import os
import pty

import pytest

from jobrun import log


@pytest.fixture(autouse=True)
def _restore_psycopg_logger():
    """configure() takes over psycopg's logger: give it back after each test."""
    library = logging.getLogger("psycopg")
    handlers, propagate = list(library.handlers), library.propagate
    yield
    library.handlers, library.propagate = handlers, propagate


def lines_from(fd_reader: int) -> list[dict[str, object]]:
    """Everything written so far to the pipe, as parsed JSON lines."""
    data = os.read(fd_reader, 65536).decode()
    return [json.loads(line) for line in data.splitlines()]


class TestEventLines:
    """The logger jobrun hands to every module."""

    def test_fields_lead_with_time_level_event(self):
        """timestamp, level and event come first; the rest follows."""
        reader, writer = os.pipe()
        logger = log.configure(fmt="json", fd=writer)
        logger.info("started", key="k")
        (line,) = lines_from(reader)
        assert list(line)[:3] == ["timestamp", "level", "event"]
        assert line["key"] == "k"

    def test_known_secrets_are_masked_in_every_field(self):
        """A password handed to configure() never appears in a line."""
        reader, writer = os.pipe()
        logger = log.configure(fmt="json", fd=writer, secrets=["s3cret-pw"])
        logger.error("lockstore_unavailable", error="auth failed for password s3cret-pw")
        (line,) = lines_from(reader)
        assert "s3cret-pw" not in json.dumps(line)

    def test_library_warnings_become_event_lines(self):
        """A psycopg warning through `logging` is a JSON `library_warning` line."""
        reader, writer = os.pipe()
        log.configure(fmt="json", fd=writer)
        logging.getLogger("psycopg").warning("error ignored in rollback on %s", "conn")
        (line,) = lines_from(reader)
        assert line["event"] == "library_warning"
        assert line["message"] == "error ignored in rollback on conn"

    def test_level_filter(self):
        """--log-level warning drops info lines."""
        reader, writer = os.pipe()
        logger = log.configure(fmt="json", fd=writer, level="warning")
        logger.info("started")
        logger.warning("heartbeat_failed")
        assert [line["event"] for line in lines_from(reader)] == ["heartbeat_failed"]


class TestBytesThatAreNotUtf8:
    """argv and environment bytes that are not UTF-8 arrive as lone surrogates (U+DCxx)."""

    @pytest.mark.parametrize("fmt", ["json", "logfmt", "console"])
    def test_every_format_writes_them_escaped(self, fmt):
        """A field holding U+DCFF is written as ``\\xff``, and the line is valid UTF-8."""
        reader, writer = os.pipe()
        logger = log.configure(fmt=fmt, fd=writer, secrets=["s\udcfe"])
        logger.error("exec_failed", command="echo\udcff", argv=["a\udcff"], **{"k\udcff": 1})
        data = os.read(reader, 65536).decode("utf-8")
        assert "echo\\xff" in data.replace("\\\\", "\\")
        assert "\udcff" not in data

    def test_safe_text_keeps_valid_text(self):
        """Text that is valid UTF-8 comes back unchanged."""
        assert log.safe_text("nightly-экспорт") == "nightly-экспорт"
        assert log.safe_text("a\udcffb") == "a\\xffb"


RUN_CONTEXT = {
    "key": "nightly-export",
    "lock_id": -9211252734361870055,
    "run_id": "72e34052-3aec-46db-b812-dc2cab459d5e",
    "host": "web1.example.internal",
    "pid": 14365,
    "mode": "session",
    "version": "0.1.0",
}


def console_line(fd: int | None = None, **fields: object) -> str:
    """One ``finished`` line of a run, rendered for the console."""
    reader, writer = os.pipe()
    logger = log.configure(fmt="console", fd=writer if fd is None else fd).bind(**RUN_CONTEXT)
    logger.info(
        "finished", outcome="succeeded", exit_code=0, child_exit_code=0, signal=None, **fields
    )
    os.close(writer)
    return os.read(reader, 65536).decode()


class TestConsoleLines:
    """Console lines are for a person at a terminal: what matters first, nothing empty."""

    def test_a_line_leads_with_time_level_event_and_key(self):
        """The key comes right after the event name, before the event's own fields."""
        line = console_line()
        assert line.index("finished") < line.index("key=nightly-export") < line.index("outcome=")

    def test_empty_fields_and_the_runs_fixed_context_are_left_out(self):
        """No signal=None, no host/pid/lock id/version on every line, exit code said once."""
        line = console_line()
        for absent in ("signal=", "host=", "pid=", "lock_id=", "version=", "child_exit_code="):
            assert absent not in line
        assert "run_id=72e34052" in line.split()  # the 8 characters `jobrun show` takes

    def test_a_finished_line_fits_120_columns(self):
        """The usual end of a run, with a realistic key, fits a 120-column terminal."""
        assert len(console_line(duration=1234.567).rstrip("\n")) <= 120

    def test_no_color_is_honoured_on_a_terminal(self, monkeypatch):
        """On a terminal the line is coloured, unless NO_COLOR is set (no-color.org)."""
        parent, child = pty.openpty()
        try:
            monkeypatch.delenv("NO_COLOR", raising=False)
            assert log.colors_wanted(child)
            monkeypatch.setenv("NO_COLOR", "1")
            assert not log.colors_wanted(child)
        finally:
            os.close(parent)
            os.close(child)
