"""``jobrun deadlocks`` on hand-made logs: the shapes a copy, a paste or a pipe leaves behind.

Each file here is written by hand, line for line in the shape PostgreSQL (or syslog, or a
cloud export) writes it; none comes from a server.
"""

from __future__ import annotations

import gzip
import json
from typing import TYPE_CHECKING

from hypothesis import given, settings
from hypothesis import strategies as st

from jobrun.analysis import deadlocks

if TYPE_CHECKING:
    from pathlib import Path

HEAD = "2026-12-01 02:08:12.163 UTC [4177] jobs@staging jobrun:a "
#: A deadlock as the victim logs it (the statement of pid 4178 left to fill in).
DEADLOCK = (
    f"{HEAD}ERROR:  deadlock detected\n"  # noqa: S608 - a log line, not a query
    f"{HEAD}DETAIL:  Process 4177 waits for ShareLock on transaction 7; blocked by process 4178.\n"
    "\tProcess 4178 waits for ShareLock on transaction 8; blocked by process 4177.\n"
    "\tProcess 4177: UPDATE a SET x = 1\n"
    "\tProcess 4178: {statement}\n"
)


def found_in(tmp_path: Path, text: str, name: str = "log") -> deadlocks.Found:
    """What ``jobrun deadlocks`` finds in a file holding this text."""
    path = tmp_path / name
    path.write_text(text)
    return deadlocks.find([str(path)])


class TestPastedLogs:
    """Logs that went through a terminal, a ticket or a chat before reaching jobrun."""

    def test_a_process_line_without_its_trailing_space_is_a_side(self, tmp_path):
        """``Process 4178:`` with its blank stripped: its own side, not the previous statement."""
        text = DEADLOCK.format(statement="").replace("Process 4178: \n", "Process 4178:\n")
        (deadlock,) = found_in(tmp_path, text).deadlocks
        victim, other = deadlock.sides
        assert victim.statement == "UPDATE a SET x = 1"
        assert other.pid == 4178
        assert other.statement == ""

    def test_detail_lines_pasted_without_indentation_are_kept(self, tmp_path):
        """The cycle's lines at the start of the line (the tab lost): every side read."""
        text = DEADLOCK.format(statement="UPDATE b SET y = 2").replace("\t", "")
        (deadlock,) = found_in(tmp_path, text).deadlocks
        assert [side.statement for side in deadlock.sides] == [
            "UPDATE a SET x = 1",
            "UPDATE b SET y = 2",
        ]
        assert deadlock.sides[1].blocked_by == 4177

    def test_one_space_after_the_severity_is_read(self, tmp_path):
        """``ERROR: deadlock detected`` with one space (a chat squeezes two into one)."""
        text = DEADLOCK.format(statement="UPDATE b").replace(":  ", ": ")
        (deadlock,) = found_in(tmp_path, text).deadlocks
        assert len(deadlock.sides) == 2


class TestDamagedFiles:
    """A file that breaks off while read is reported on its own line; the others are read."""

    def test_a_truncated_archive_exits_66_after_the_other_files(self, jobrun_here, tmp_path):
        """A .gz cut short next to a good log: the good log's deadlock printed, exit 66."""
        good = tmp_path / "good.log"
        good.write_text(DEADLOCK.format(statement="UPDATE b"))
        cut = tmp_path / "cut.log.gz"
        cut.write_bytes(gzip.compress(good.read_bytes() * 50)[:200])
        result = jobrun_here.run("deadlocks", str(cut), str(good), dsn=None)
        assert result.returncode == 66, result.stderr
        assert "jobrun:a" in result.stdout
        assert f"{cut}: not read: cannot read" in result.stdout
        (line,) = result.stderr.strip().splitlines()
        assert str(cut) in line


class TestEscaping:
    """Text from a log reaches the terminal with its control characters made visible."""

    def test_control_characters_in_a_statement_are_escaped(self, jobrun_here, tmp_path):
        """ESC and BEL in a logged statement print as \\x1b and \\x07; a CR never raw."""
        path = tmp_path / "log"
        path.write_text(DEADLOCK.format(statement="UPDATE b /* \x1b[2J\r\x07 */"), newline="")
        result = jobrun_here.run("deadlocks", str(path), dsn=None)
        assert result.returncode == 0, result.stderr
        assert "\\x1b[2J" in result.stdout
        assert "\\x07 */" in result.stdout
        assert not any(ch in result.stdout for ch in "\x1b\r\x07")


class TestSyslog:
    """syslog records as rsyslog writes them (``#011`` for a tab, numbered chunks)."""

    def test_a_line_cut_into_chunks_is_joined_again(self, tmp_path):
        """A statement over 900 bytes: PostgreSQL sends it in pieces, read back whole."""
        statement = "UPDATE b SET y = '" + "z" * 2000 + "'"
        stderr = DEADLOCK.format(statement=statement).splitlines()
        records = []
        for chunk, line in enumerate(stderr[1:], start=1):
            body = line.replace("\t", "#011")
            pieces = [body[n : n + 900] for n in range(0, len(body), 900)]
            records += [(chunk, piece) for piece in pieces]
        text = f"Dec  1 02:08:12 db1 postgres[4177]: [7-1] {stderr[0]}\n" + "".join(
            f"Dec  1 02:08:12 db1 postgres[4177]: [7-{n}] {piece}\n"
            for n, (_, piece) in enumerate(records, start=2)
        )
        found = found_in(tmp_path, text)
        assert found.files[0].format == "syslog"
        (deadlock,) = found.deadlocks
        assert deadlock.sides[1].statement == statement

    def test_a_whole_system_syslog_is_read(self, tmp_path):
        """/var/log/syslog, mostly other daemons' lines (most without a pid): still read."""
        others = (
            "Dec  1 02:08:11 db1 kernel: [ 12.345678] eth0: link up\n"
            "Dec  1 02:08:11 db1 kernel: [ 12.345679] eth1: link up\n"
            "Dec  1 02:08:11 db1 sshd[812]: Accepted publickey for ops from 10.0.0.9\n"
        ) * 5
        server = "".join(
            f"Dec  1 02:08:12 db1 postgres[4177]: [7-{n}] {line.replace(chr(9), '#011')}\n"
            for n, line in enumerate(DEADLOCK.format(statement="UPDATE b").splitlines(), 1)
        )
        found = found_in(tmp_path, others + server + others)
        assert found.files[0].format == "syslog"
        (deadlock,) = found.deadlocks
        assert [side.statement for side in deadlock.sides] == ["UPDATE a SET x = 1", "UPDATE b"]


class TestCloudSql:
    """Cloud SQL's export as its records look: the text without its time, one line each."""

    def test_a_textpayload_without_a_time_takes_the_records_time(self, tmp_path):
        """``[24667]: [1-1] db=…,user=… ERROR: …`` per record: the deadlock at the record's time."""
        lines = [
            "[4177]: [9-1] db=staging,user=jobs ERROR:  deadlock detected",
            (
                "[4177]: [10-1] db=staging,user=jobs DETAIL:  Process 4177 waits for ShareLock "
                "on transaction 7; blocked by process 4178."
            ),
            "\tProcess 4178 waits for ShareLock on transaction 8; blocked by process 4177.",
            "\tProcess 4177: UPDATE a",
            "\tProcess 4178: UPDATE b",
        ]
        text = "".join(
            json.dumps(
                {
                    "textPayload": line,
                    "timestamp": "2026-12-01T02:08:12.163000Z",
                    "severity": "ERROR",
                    "resource": {"type": "cloudsql_database"},
                }
            )
            + "\n"
            for line in lines
        )
        (deadlock,) = found_in(tmp_path, text, "export.json").deadlocks
        assert deadlock.time == "2026-12-01T02:08:12.163000Z"
        assert (deadlock.user, deadlock.db) == ("jobs", "staging")
        assert [side.statement for side in deadlock.sides] == ["UPDATE a", "UPDATE b"]


_NAME = st.text(alphabet="abcdefghijklmnopqrstuvwxyz_0123456789", min_size=1, max_size=12)


class TestPrefixChoice:
    """The layout chosen is the one whose fields read as what they are."""

    @settings(max_examples=100, deadline=None)
    @given(user=_NAME, db=_NAME, app=_NAME)
    def test_debian_lines_read_a_user_and_a_database(self, tmp_path_factory, user, db, app):
        """``%m [%p] %q%u@%d``: user@db is never an application; with ``%a`` after, it is."""
        debian = f"2026-12-01 02:08:12.163 UTC [4177] {user}@{db} "
        with_app = f"{debian}{app} "
        text = DEADLOCK.format(statement="UPDATE b")
        for prefix, application in ((debian, None), (with_app, app)):
            path = tmp_path_factory.mktemp("prefix") / "log"
            path.write_text(text.replace(HEAD, prefix))
            (deadlock,) = deadlocks.find([str(path)]).deadlocks
            assert (deadlock.user, deadlock.db) == (user, db)
            assert deadlock.sides[0].application == application

    def test_a_quiet_start_does_not_hide_the_layout(self, tmp_path):
        """3,000 checkpoint lines first (alike in every layout): Debian's still read right."""
        quiet = "".join(
            f"2026-12-01 01:{n // 60 % 60:02d}:{n % 60:02d}.000 UTC [99] LOG:  checkpoint\n"
            for n in range(3000)
        )
        debian = "2026-12-01 02:08:12.163 UTC [4177] jobs@staging "
        text = quiet + DEADLOCK.format(statement="UPDATE b").replace(HEAD, debian)
        found = found_in(tmp_path, text)
        (deadlock,) = found.deadlocks
        assert found.files[0].prefix == "%m [%p] %q%u@%d "
        assert (deadlock.user, deadlock.db) == ("jobs", "staging")
