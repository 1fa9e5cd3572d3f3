"""Text from the database or another process reaches a person escaped, never as control codes."""

from __future__ import annotations

import json
import os
import pty
import re
import shlex
import subprocess
import sys
from typing import TYPE_CHECKING

import psycopg
import pytest

from harness import jobrun_cli as cli
from jobrun import keys
from jobrun.escape import printable, printable_lines

if TYPE_CHECKING:
    from collections.abc import Iterator

#: What a hostile writer puts in a field: OSC 52 (set the clipboard, ended by BEL), a
#: carriage return to hide it, a C1 CSI (clear the screen), a newline to forge a line.
HOSTILE = "evil\x1b]52;c;ZWNobyBwd25lZA==\x07\r\x9b2J\nforged line"
#: Any C0 control but newline, DEL, or a C1 control: none may reach the output raw.
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f]")
#: How the hostile text reads once escaped.
SHOWN = "evil\\x1b]52;c;ZWNobyBwd25lZA==\\x07\\r\\x9b2J\\nforged line"
#: Hostile text in one word: no space, quote, ``=`` or line break that would make a log
#: renderer quote it (and escape it on the way).
HOSTILE_WORD = "evil\x1b]52;c;ZWNobyBwd25lZA\x07\x9b2J"


def assert_escaped(output: str) -> None:
    """No raw control character (but newline) in ``output``, and the hostile text shown."""
    assert not RAW_CONTROL.search(output), repr(output)
    assert SHOWN in output, output


class TestPrintable:
    def test_every_control_character_is_written_visibly(self):
        """ESC, BEL, CR, LF, tab, NUL, DEL and a C1 control come out as escapes."""
        assert printable("\x1b\x07\r\n\t\x00\x7f\x9b") == "\\x1b\\x07\\r\\n\\t\\x00\\x7f\\x9b"

    def test_bidirectional_controls_are_written_visibly(self):
        """A right-to-left override cannot reorder what the terminal shows."""
        assert printable("a\u202eb\u2066c") == "a\\u202eb\\u2066c"

    def test_bytes_that_were_not_utf8_are_shown_as_the_bytes(self):
        """A surrogateescape stand-in is shown as the byte it stands for."""
        assert printable(b"a\xffb".decode("utf-8", "surrogateescape")) == "a\\xffb"

    def test_ordinary_text_is_unchanged(self):
        """Letters of any script, spaces, punctuation and backslashes stay as they are."""
        text = "nightly-export é 日本語 C:\\temp 100% (ok)"
        assert printable(text) == text

    def test_lines_keep_newlines_and_tabs(self):
        """printable_lines keeps newlines and tabs, and escapes the rest."""
        assert printable_lines("a\tb\nc\x1b[2Jd\r\n") == "a\tb\nc\\x1b[2Jd\\r\n"


@pytest.fixture
def forged_holder(dsn: str, key: str) -> Iterator[None]:
    """``key`` held by a session whose holder comment names a hostile host and run id."""
    announced = json.dumps({"host": HOSTILE, "pid": 4242, "run_id": HOSTILE_WORD, "since": "s"})
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            f"/* jobrun-holder {announced} */ SELECT pg_advisory_lock(%s)",
            (keys.from_name(key).lock_id,),
        )
        yield


class TestEventLines:
    """A skipped run's event names the holder as its session announced it."""

    @pytest.mark.usefixtures("forged_holder")
    @pytest.mark.parametrize("fmt", ["logfmt", "console"])
    def test_holder_host_is_escaped(self, dsn, key, fmt):
        """The skipped line (logfmt, console) shows the hostile host escaped."""
        result = cli.run("--key", key, "--log-format", fmt, "--", "true", dsn=dsn)
        assert result.returncode == 75, result.stderr
        assert "skipped" in result.stderr
        assert not RAW_CONTROL.search(result.stderr), repr(result.stderr)
        if fmt == "logfmt":
            assert "holder_run_id=evil\\x1b]52;c;ZWNobyBwd25lZA\\x07\\x9b2J " in result.stderr
            # The host (quoted: it has spaces) is shown, and forges no line of its own.
            assert "forged line" in result.stderr
        else:  # the holder's host, shortened to keep the line within 120 columns
            assert 'held_by="evil\\x1b]52' in result.stderr
        assert all(line.startswith(("20", "timestamp=")) for line in result.stderr.splitlines())


class TestTables:
    """``status`` and ``history`` tables show what the database says, escaped."""

    @pytest.mark.usefixtures("forged_holder")
    def test_status_shows_the_holder_escaped(self, dsn, key):
        """The HOLDER cell of a forged holder's host (whole with --wide, shortened without)."""
        result = cli.run("status", key, "--wide", dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert_escaped(result.stdout)
        narrow = cli.run("status", key, dsn=dsn)
        assert narrow.returncode == 0, narrow.stderr
        assert not RAW_CONTROL.search(narrow.stdout), repr(narrow.stdout)

    @pytest.mark.usefixtures("forged_holder")
    def test_history_shows_the_holder_of_a_skip_escaped(self, dsn, key):
        """The skip's NOTE names the holder's host, escaped."""
        assert cli.run("--key", key, "--", "true", dsn=dsn).returncode == 75
        result = cli.run("history", key, dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert_escaped(result.stdout)

    def test_history_shows_a_forged_reason_escaped(self, dsn, key):
        """A reason another role wrote into the history."""
        assert cli.run("--key", key, "--", "true", dsn=dsn).returncode == 0
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute("UPDATE jobrun.runs SET reason = %s WHERE key = %s", (HOSTILE, key))
        result = cli.run("history", key, dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert_escaped(result.stdout)


#: A failing job that prints escapes: the clipboard write, a screen clear, a bell.
NOISY_JOB = (
    "import sys; sys.stdout.buffer.write(b'out\\x1b]52;c;aGk=\\x07\\x1b[2J\\tend\\n'); sys.exit(3)"
)
NOISY_BYTES = b"out\x1b]52;c;aGk=\x07\x1b[2J\tend\n"


@pytest.fixture
def noisy_run(dsn: str, key: str) -> str:
    """The run id of a failed run whose kept output holds terminal escapes."""
    result = cli.run(
        "--key", key, "--keep-output", "1k", "--", sys.executable, "-c", NOISY_JOB, dsn=dsn
    )
    assert result.returncode == 3, result.stderr
    return cli.event(result.stderr, "finished")["run_id"]


class TestShow:
    """``jobrun show``: kept output escaped, exact only with --raw and never to a terminal."""

    def test_kept_output_is_escaped(self, dsn, noisy_run):
        """ESC and BEL are written visibly; the tab and newline stay."""
        result = cli.run("show", noisy_run, dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert "out\\x1b]52;c;aGk=\\x07\\x1b[2J\tend\n" in result.stdout
        assert "\x1b" not in result.stdout
        assert "\x07" not in result.stdout

    def test_raw_gives_the_exact_bytes_to_a_pipe(self, dsn, noisy_run):
        """--raw into a pipe: the job's bytes as they were."""
        result = subprocess.run(
            [*cli.JOBRUN, "show", "--raw", noisy_run],
            env=cli.environment(dsn),
            capture_output=True,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, result.stderr
        assert b"--- stdout (last %d bytes)\n" % len(NOISY_BYTES) + NOISY_BYTES in result.stdout

    def test_raw_to_a_terminal_is_refused(self, dsn, noisy_run):
        """--raw with a terminal as stdout: exit 64, one line, nothing of the job written."""
        leader, follower = pty.openpty()
        try:
            result = subprocess.run(
                [*cli.JOBRUN, "show", "--raw", noisy_run],
                env=cli.environment(dsn),
                stdout=follower,
                stderr=subprocess.PIPE,
                timeout=60,
                check=False,
            )
            os.close(follower)
            written = _drain(leader)
        finally:
            os.close(leader)
        assert result.returncode == 64, result.stderr
        assert b"not to a terminal" in result.stderr
        assert len(result.stderr.splitlines()) == 1
        assert b"aGk=" not in written


def _drain(fd: int) -> bytes:
    """What a pty's other side has to read (its writer closed)."""
    data = b""
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the other side is closed and everything was read
            return data
        if not chunk:
            return data
        data += chunk


class TestOverlapReport:
    def test_a_commands_output_is_escaped(self, dsn):
        """The last output of a failed command, as the human report quotes it."""
        noisy = shlex.join([sys.executable, "-c", NOISY_JOB])
        result = cli.run("overlap", "--first", noisy, "--second", "true", "--runs", "1", dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert "last output of A" in result.stdout
        assert "out\\x1b]52;c;aGk=\\x07\\x1b[2J\\tend" in result.stdout
        assert not RAW_CONTROL.search(result.stdout), repr(result.stdout)


class TestErrorLine:
    def test_a_server_message_is_escaped(self, dsn):
        """A refused connection's error quotes the database name: escaped, on one line."""
        result = cli.run("status", dsn=f"{dsn} dbname='{HOSTILE}'")
        assert result.returncode == 69, result.stderr
        assert len(result.stderr.splitlines()) == 1
        assert not RAW_CONTROL.search(result.stderr), repr(result.stderr)
        assert "\\x1b]52" in result.stderr
