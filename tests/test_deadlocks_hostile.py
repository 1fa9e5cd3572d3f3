"""``jobrun deadlocks`` on crafted logs: each is read within bounds and reported on its own."""

from __future__ import annotations

import gzip
import json
from typing import TYPE_CHECKING

from harness import jobrun_inprocess
from jobrun.analysis import deadlocks
from jobrun.analysis.deadlocks import scan, sources
from jobrun.exitcodes import Exit

if TYPE_CHECKING:
    import subprocess
    from pathlib import Path

HEAD = "2026-12-01 02:08:12.163 UTC [4177] jobs@staging jobrun:a "
#: A deadlock as the victim logs it.
DEADLOCK = (
    f"{HEAD}ERROR:  deadlock detected\n"  # noqa: S608 - a log line, not a query
    f"{HEAD}DETAIL:  Process 4177 waits for ShareLock on transaction 7; blocked by process 4178.\n"
    "\tProcess 4178 waits for ShareLock on transaction 8; blocked by process 4177.\n"
    "\tProcess 4177: UPDATE a SET x = 1\n"
    "\tProcess 4178: UPDATE b SET y = 2\n"
)
#: A line the server writes, before a statement of any length.
STATEMENT = "2026-12-01 02:08:11.000 UTC [4180] jobs@staging jobrun:b LOG:  statement: "
#: How long the reader may take on a file the fix makes quick: without it, these run for
#: minutes (quadratic) and the timeout is what fails the test.
QUICK = 30


def good_log(tmp_path: Path) -> Path:
    """A plain stderr log with one deadlock, read next to each crafted file."""
    path = tmp_path / "good.log"
    path.write_text(DEADLOCK)
    return path


def jobrun_deadlocks(*paths: Path) -> subprocess.CompletedProcess[str]:
    """``jobrun deadlocks PATHS...`` as a user runs it (its command line, in this process)."""
    return jobrun_inprocess.run("deadlocks", *map(str, paths), dsn=None, timeout=QUICK)


def array_of(*lines: str) -> str:
    """A Cloud Logging export's start (one record read) followed by these lines."""
    record = {"textPayload": DEADLOCK.splitlines()[0], "timestamp": "2026-12-01T02:08:12Z"}
    return "[\n" + json.dumps(record) + ",\n" + "".join(lines)


class TestCompressedFiles:
    """A compressed file is read while it unpacks the way a log does, no further."""

    def test_a_gzip_bomb_is_stopped_and_the_other_files_deadlock_counted(self, tmp_path):
        """Zeros packed 1000 to 1: stopped after the floor's MiB, exit 65, the good log read."""
        member = gzip.compress(b"\0" * 2**20, compresslevel=9)
        bomb = tmp_path / "bomb.log.gz"
        bomb.write_bytes(member * (sources.UNPACK_FLOOR // 2**20 + 8))  # members: one stream
        result = jobrun_deadlocks(bomb, good_log(tmp_path))
        assert result.returncode == Exit.DATA_ERROR, result.stderr
        assert f"stopped after {sources.UNPACK_FLOOR // 2**20} MiB unpacked" in result.stdout
        assert "1 deadlock(s) in 2 file(s), 1 not read" in result.stdout
        assert "internal error" not in result.stderr


class TestLongLines:
    """A line or a message longer than any server writes is cut, said so, and read past."""

    def test_a_long_line_is_cut_said_so_and_the_next_lines_read(self, tmp_path):
        """A statement line past the limit: one line cut, said so, the deadlock after it found."""
        log = tmp_path / "long.log"
        with log.open("w") as out:
            out.write(STATEMENT + "x" * (sources.LINE_LIMIT + 2**20) + "\n")
            out.write(DEADLOCK)
        result = jobrun_deadlocks(log)
        assert result.returncode == Exit.DATA_ERROR, result.stderr
        assert f"1 line(s) cut at {sources.LINE_LIMIT // 1024} KiB" in result.stdout
        assert "1 deadlock(s) in 1 file(s), 1 read in part" in result.stdout
        assert "jobrun:a" in result.stdout

    def test_a_message_of_endless_continuation_lines_is_cut_in_linear_time(self, tmp_path):
        """Tab-indented lines past the limit under one message: cut there, read quickly."""
        log = tmp_path / "continued.log"
        piece = "\t" + "y" * 1023 + "\n"
        with log.open("w") as out:
            out.write(STATEMENT + "SELECT\n")
            out.write(piece * ((sources.LINE_LIMIT + 2**20) // len(piece)))
            out.write(DEADLOCK)
        result = jobrun_deadlocks(log)
        assert result.returncode == Exit.DATA_ERROR, result.stderr
        assert "1 line(s) cut at" in result.stdout
        assert "1 deadlock(s) in 1 file(s)" in result.stdout


class TestJsonArrays:
    """A Cloud Logging array is decoded once per element, however the elements are cut."""

    def test_an_array_whose_first_object_never_ends_finishes_and_reports(self, tmp_path):
        """1 MiB of one object that never closes: reported as ending inside it, exit 65."""
        export = tmp_path / "export.json"
        export.write_text(array_of('{"textPayload": [\n', '"0123456789",\n' * 80_000))
        result = jobrun_deadlocks(export, good_log(tmp_path))
        assert result.returncode == Exit.DATA_ERROR, result.stderr
        assert "ends inside the JSON value begun at line 3" in result.stdout
        assert "1 deadlock(s) in 2 file(s)" in result.stdout

    def test_an_object_past_the_limit_stops_the_file(self, tmp_path):
        """An object still open after the line limit: the file stops there, said so."""
        export = tmp_path / "export.json"
        line = '"' + "0123456789" * 100 + '",\n'
        lines = [line] * ((sources.LINE_LIMIT + 2**20) // len(line))
        export.write_text(array_of('{"textPayload": [\n', *lines, "1]}\n]\n"))
        result = jobrun_deadlocks(export)
        assert result.returncode == Exit.DATA_ERROR, result.stderr
        assert f"not ended within {sources.LINE_LIMIT // 1024} KiB" in result.stdout


class TestNesting:
    """JSON nested deeper than Python's recursion is a file not read, never an internal error."""

    def test_a_deeply_nested_json_line_is_reported_per_file_with_65(self, tmp_path):
        """One jsonlog line nested 100,000 deep: that file not read, exit 65 not 70."""
        nested = tmp_path / "nested.json"
        nested.write_text('{"a":' * 100_000 + "0" + "}" * 100_000 + "\n")
        result = jobrun_deadlocks(nested, good_log(tmp_path))
        assert result.returncode == Exit.DATA_ERROR, result.stderr
        assert f"{nested}: not read" in result.stdout
        assert "1 deadlock(s) in 2 file(s), 1 not read" in result.stdout

    def test_a_deeply_nested_array_element_stops_that_file_with_65(self, tmp_path):
        """An export's element nested 100,000 deep: the file stops there, exit 65 not 70."""
        export = tmp_path / "export.json"
        export.write_text(array_of("[" * 100_000 + "]" * 100_000 + "\n]\n"))
        result = jobrun_deadlocks(export, good_log(tmp_path))
        assert result.returncode == Exit.DATA_ERROR, result.stderr
        assert "nested too deeply to read" in result.stdout
        assert "1 deadlock(s) in 2 file(s)" in result.stdout

    def test_a_deeply_nested_journal_line_is_skipped(self, jobrun_here, tmp_path):
        """``--journal`` with a line nested 100,000 deep: the line skipped, the report made."""
        journal = tmp_path / "journal.json"
        journal.write_text("[" * 100_000 + "]" * 100_000 + "\n")
        result = jobrun_here.run(
            "deadlocks", "--journal", str(journal), str(good_log(tmp_path)), dsn=None
        )
        assert result.returncode == 0, result.stderr
        assert "1 deadlock(s) in 1 file(s)" in result.stdout


class TestMemory:
    """Running out of memory on one file ends that file, not the command."""

    def test_a_memory_error_ends_that_file_alone(self, tmp_path, monkeypatch):
        """MemoryError while one file is read: it is reported, the other's deadlock counted."""
        huge = tmp_path / "huge.log"
        huge.write_text(DEADLOCK)
        read_entries = scan.read_entries

        def failing(stream, source, prefix):
            if source == str(huge):
                raise MemoryError
            return read_entries(stream, source, prefix)

        monkeypatch.setattr(scan, "read_entries", failing)
        out: list[str] = []
        status = deadlocks.run(
            [str(huge), str(good_log(tmp_path))],
            prefix=None,
            as_json=False,
            check=False,
            echo=out.append,
        )
        assert status == Exit.DATA_ERROR
        assert "out of memory while reading it" in out[0]
        assert "1 deadlock(s) in 2 file(s), 1 not read" in out[0]
