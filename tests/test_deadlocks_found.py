"""``jobrun deadlocks`` on logs as they are found: any prefix, pasted, wrapped, any language.

Where a server can write the log, it does: a private server (see ``test_deadlocks``) logs a
real deadlock with the prefix or ``lc_messages`` under test. A paste, a wrap or a cut is
then made from that real log by the test, and its docstring says so; the few logs written
wholly by hand say so too.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from test_deadlocks import (  # the same private logging server and deadlock, once per module
    JOBS,
    LOG_WAIT,
    PREFIX_WITH_APP,
    logged_deadlock,
    logging_server,
)
from test_deadlocks_wild import as_syslog

from harness import jobrun_cli
from harness.pgserver import PgServer
from jobrun.analysis import deadlocks
from jobrun.analysis.deadlocks import catalog, language
from jobrun.ops.throwaway import PGBIN_ENV

if TYPE_CHECKING:
    from collections.abc import Iterator

__all__ = ["logging_server"]  # a fixture, imported for this module's tests

TOOL = Path(__file__).resolve().parent.parent / "tools" / "deadlock_catalog.py"
IN_CI = os.environ.get("CI") == "true"


def one(path: Path, prefix: str | None = None) -> deadlocks.Deadlock:
    """The one deadlock in a file, read with no flag (or the prefix given)."""
    found = deadlocks.find([str(path)], prefix=prefix)
    assert [read.error for read in found.files] == [None], deadlocks.report(found)
    assert len(found.deadlocks) == 1, deadlocks.report(found)
    return found.deadlocks[0]


def assert_whole(deadlock: deadlocks.Deadlock, *, named: bool = True) -> None:
    """Two sides blocking each other, each with its lock and its statement (and its job)."""
    blockers = {side.pid: side.blocked_by for side in deadlock.sides}
    assert len(blockers) == 2, deadlock
    first, second = blockers
    assert blockers == {first: second, second: first}
    for side in deadlock.sides:
        assert side.waits_for is not None
        assert side.waits_for.startswith("ShareLock on transaction "), side
        assert side.statement is not None
        assert side.statement.startswith("UPDATE accounts SET balance = balance + 1"), side
    if named:
        assert {side.application for side in deadlock.sides} == set(JOBS)


def write(tmp_path: Path, text: str, name: str = "pasted.log") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


class TestAnyPrefix:
    """A real server's log with prefixes no list of common ones holds: no flag needed."""

    @pytest.mark.parametrize(
        "prefix",
        [
            "%t [%p]: db=%d,user=%u,app=%a,client=%h ",
            "%t [%p]: [%l-1] user=%u,db=%d,host=%h,app=%a ",
            "%m pid=%p %q<%u/%d> ",
            "%n|%p|%a|",
            "%l|%c|%x|%a|%m|",
        ],
    )
    def test_a_prefix_with_the_pid_names_both_jobs(self, logging_server, tmp_path, prefix):
        """Both jobs (from %a, or log_connections' lines by pid), locks and statements."""
        logs = logged_deadlock(logging_server, tmp_path, prefix)
        assert_whole(one(logs["stderr"]))

    @pytest.mark.parametrize("prefix", ["", "%t ", "%t"])
    def test_a_prefix_without_the_pid_still_gives_every_side(
        self, logging_server, tmp_path, prefix
    ):
        """Empty, ``%t `` and ``%t`` with no space: the cycle's pids, locks and statements."""
        logs = logged_deadlock(logging_server, tmp_path, prefix)
        deadlock = one(logs["stderr"])
        assert_whole(deadlock, named=False)
        if prefix:
            assert deadlock.time is not None

    def test_a_prefix_changed_half_way_is_read_across_the_change(self, logging_server, tmp_path):
        """One file, a deadlock before a reload of log_line_prefix and one after: both read."""
        (tmp_path / "a").mkdir()
        (tmp_path / "b").mkdir()
        before = logged_deadlock(logging_server, tmp_path / "a", PREFIX_WITH_APP)
        after = logged_deadlock(
            logging_server, tmp_path / "b", "%t [%p]: db=%d,user=%u,app=%a,client=%h "
        )
        path = write(tmp_path, before["stderr"].read_text() + after["stderr"].read_text())
        found = deadlocks.find([str(path)])
        assert len(found.deadlocks) == 2, deadlocks.report(found)
        for deadlock in found.deadlocks:
            assert_whole(deadlock)

    def test_syslog_numbered_lines_with_an_unknown_prefix(self, logging_server, tmp_path):
        """``[5-1] db=...,user=...,app=...,client=... `` inside syslog (wrapped by the test)."""
        logs = logged_deadlock(logging_server, tmp_path, "[%p] db=%d,user=%u,app=%a,client=%h ")
        # The server's "[%p] " is syslog's to carry: cut from the text as syslog has it.
        text = re.sub(r"(\]: \[\d+-\d+\] )\[\d+\] ", r"\1", as_syslog(logs["stderr"].read_text()))
        deadlock = one(write(tmp_path, text, "syslog"))
        assert_whole(deadlock)

    def test_the_given_prefix_still_overrides(self, logging_server, tmp_path):
        """Read with no flag; --log-line-prefix reads as given: a wrong one reads nothing (65)."""
        logs = logged_deadlock(logging_server, tmp_path, "%t [%p]: db=%d,user=%u,app=%a,client=%h ")
        assert_whole(one(logs["stderr"]))
        found = deadlocks.find([str(logs["stderr"])], prefix="%t:%r:")
        assert found.files[0].error is not None
        assert not found.deadlocks


@st.composite
def prefixes(draw: st.DrawFn) -> tuple[str, str]:
    """A log_line_prefix of any shape, and one line's prefix as the server writes it."""
    parts = draw(
        st.lists(
            st.sampled_from(
                [
                    ("%m", "2026-12-01 02:08:12.163 UTC"),
                    ("%t", "2026-12-01 02:08:12 CET"),
                    ("[%p]", "[4177]"),
                    ("%u@%d", "jobs@staging"),
                    ("app=%a", "app=jobrun:a"),
                    ("%l", "17"),
                    ("%x", "0"),
                    ("<%r>", "<10.0.0.1(5432)>"),
                    ("literal", "literal"),
                ]
            ),
            max_size=6,
        )
    )
    glue = draw(st.sampled_from([" ", "|", ": ", ","]))
    end = draw(st.sampled_from(["", " ", ": "]))
    return glue.join(p for p, _ in parts) + end, glue.join(t for _, t in parts) + end


class TestPrefixProperty:
    """Hand-written lines in the server's shape, under any prefix: the cycle always reads."""

    @settings(max_examples=150, deadline=None)
    @given(prefix=prefixes(), trailing=st.sampled_from(["", " ", "  \t", "\r"]))
    def test_any_prefix_reads_the_deadlock(self, tmp_path_factory, prefix, trailing):
        """Whatever the prefix (and blanks at the line ends): one deadlock, both sides."""
        _, head = prefix
        lines = [
            f"{head}LOG:  checkpoint starting: time",
            f"{head}ERROR:  deadlock detected",
            (
                f"{head}DETAIL:  Process 4177 waits for ShareLock on transaction 7; "
                "blocked by process 4178."
            ),
            "\tProcess 4178 waits for ShareLock on transaction 8; blocked by process 4177.",
            "\tProcess 4177: UPDATE a SET x = 1",
            "\tProcess 4178: UPDATE b SET x = 2",
            f"{head}STATEMENT:  UPDATE a SET x = 1",  # noqa: S608 - a log line
        ]
        path = tmp_path_factory.mktemp("prefix") / "log"
        path.write_text("".join(line + trailing + "\n" for line in lines))
        (deadlock,) = deadlocks.find([str(path)]).deadlocks
        assert {side.pid: side.blocked_by for side in deadlock.sides} == {4177: 4178, 4178: 4177}
        assert [side.statement for side in deadlock.sides] == [
            "UPDATE a SET x = 1",
            "UPDATE b SET x = 2",
        ]
        assert deadlock.statement == "UPDATE a SET x = 1"


class TestPastes:
    """A real server's log, then pasted, re-saved or cut by the test as a person would."""

    @pytest.mark.parametrize(
        "damage",
        [
            pytest.param(lambda text: text.replace("\n", "   \n"), id="trailing-blanks"),
            pytest.param(lambda text: text.replace("\n", " \r\n"), id="crlf-and-a-blank"),
            pytest.param(lambda text: text.replace("\n", "\t\n\n"), id="blank-lines-and-tabs"),
            pytest.param(
                lambda text: "".join(f"    {line}\n" for line in text.splitlines()),
                id="indented-block",
            ),
            pytest.param(
                lambda text: text.replace("\t", "  ").replace("\n", " \n"),
                id="tabs-lost-and-blanks",
            ),
        ],
    )
    def test_a_re_saved_or_indented_log_reads(self, logging_server, tmp_path, damage):
        """Blanks at line ends (docker, an editor), blank lines, CRLF, an indented block."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        assert_whole(one(write(tmp_path, damage(logs["stderr"].read_text()))))

    def test_trailing_blanks_are_no_quiet_zero_under_check(self, logging_server, tmp_path):
        """The CLI with --check: exit 1 and the deadlock, not "0 deadlock(s)" and 0."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        path = write(tmp_path, logs["stderr"].read_text().replace("\n", "  \n"))
        result = jobrun_cli.run("deadlocks", "--check", str(path), dsn=None)
        assert result.returncode == 1, result.stdout + result.stderr
        assert "1 deadlock(s)" in result.stdout

    def test_a_note_and_other_sessions_between_error_and_detail(self, logging_server, tmp_path):
        """A note, and a line of another pid, put between the ERROR and its DETAIL."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        lines = logs["stderr"].read_text().splitlines()
        at = next(n for n, line in enumerate(lines) if "ERROR:  deadlock detected" in line)
        head = lines[at].split("ERROR:")[0]
        other = re.sub(r"\[\d+\]", "[1]", head) + "LOG:  checkpoint starting: time"
        lines[at + 1 : at + 1] = ["", "(the next lines came a moment later)", other]
        deadlock = one(write(tmp_path, "\n".join(lines) + "\n"))
        assert_whole(deadlock)
        assert deadlock.context is not None

    def test_a_detail_without_its_error(self, logging_server, tmp_path):
        """The ERROR line left out of the paste: the DETAIL's cycle is the deadlock."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        text = "".join(
            line
            for line in logs["stderr"].read_text().splitlines(keepends=True)
            if "ERROR:  deadlock detected" not in line
        )
        deadlock = one(write(tmp_path, text))
        assert_whole(deadlock)
        assert deadlock.victim in {side.pid for side in deadlock.sides}

    def test_an_error_whose_detail_was_cut_takes_the_lock_waits(self, logging_server, tmp_path):
        """Only the DETAIL's first line kept: the other side from its pid's lock wait."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        lines = logs["stderr"].read_text().splitlines()
        at = next(n for n, line in enumerate(lines) if " waits for " in line)
        end = at + 1
        while end < len(lines) and lines[end].startswith("\t"):
            end += 1
        del lines[at + 1 : end]
        deadlock = one(write(tmp_path, "\n".join(lines) + "\n"))
        assert len(deadlock.sides) == 2
        victim = next(side for side in deadlock.sides if side.pid == deadlock.victim)
        assert victim.waits_for
        assert victim.blocked_by
        assert {side.application for side in deadlock.sides} == set(JOBS)

    def test_an_error_without_its_detail_takes_the_lock_waits(self, logging_server, tmp_path):
        """No DETAIL at all: the victim's ``detected deadlock`` lock wait names the other pid."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        lines = logs["stderr"].read_text().splitlines()
        at = next(n for n, line in enumerate(lines) if " waits for " in line)
        end = at + 1
        while end < len(lines) and lines[end].startswith("\t"):
            end += 1
        del lines[at:end]
        deadlock = one(write(tmp_path, "\n".join(lines) + "\n"))
        assert len(deadlock.sides) == 2
        victim = next(side for side in deadlock.sides if side.pid == deadlock.victim)
        assert victim.waits_for is not None
        assert victim.waits_for.startswith("ShareLock on transaction ")
        assert victim.context is not None
        assert 'relation "accounts"' in victim.context

    @pytest.mark.parametrize("width", [80, 100, 120])
    def test_lines_wrapped_by_a_terminal(self, logging_server, tmp_path, width):
        """Every line longer than the terminal cut at its width, as a copy of it gives."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        wrapped = []
        for line in logs["stderr"].read_text().splitlines():
            line = line.replace("\t", "        ")  # noqa: PLW2901 - a terminal shows tabs so
            wrapped.extend(line[n : n + width] for n in range(0, max(len(line), 1), width))
        deadlock = one(write(tmp_path, "\n".join(wrapped) + "\n"))
        assert_whole(deadlock)

    def test_lines_wrapped_by_a_ticket_at_word_boundaries(self, logging_server, tmp_path):
        """A ticket system's soft wrap at 72 columns between words (the space dropped).

        Wrapped by the test as textwrap does, words kept whole, hyphens too.
        """
        import textwrap  # noqa: PLC0415

        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        wrapped = []
        for line in logs["stderr"].read_text().splitlines():
            wrapped.extend(
                textwrap.wrap(line, 72, break_long_words=False, break_on_hyphens=False) or [""]
            )
        deadlock = one(write(tmp_path, "\n".join(wrapped) + "\n"))
        assert_whole(deadlock)

    def test_psqls_output_pasted(self, tmp_path):
        """What psql prints for the error (written by hand: no prefix, no pids, no tabs)."""
        text = (
            "ERROR:  deadlock detected\n"
            "DETAIL:  Process 4177 waits for ShareLock on transaction 7; blocked by process "
            "4178.\n"
            "Process 4178 waits for ShareLock on transaction 8; blocked by process 4177.\n"
            "HINT:  See server log for query details.\n"
            'CONTEXT:  while updating tuple (0,2) in relation "accounts"\n'
        )
        deadlock = one(write(tmp_path, text))
        assert {side.pid: side.blocked_by for side in deadlock.sides} == {4177: 4178, 4178: 4177}
        assert deadlock.context == 'while updating tuple (0,2) in relation "accounts"'


class TestNeverASilentZero:
    """A file with a deadlock's wording from which none could be read: 65, with the line."""

    @settings(max_examples=60, deadline=None)
    @given(
        text=st.sampled_from(language.DEADLOCK_TEXTS),
        mangle=st.sampled_from(["ERROR => {}", "[error] {}", "E {}!", "{} (ERROR)"]),
    )
    def test_a_deadlock_in_a_shape_not_read_is_said(self, tmp_path_factory, text, mangle):
        """Hand-written: a server log whose deadlock line a shipper rewrote, any language."""
        head = "2026-12-01 02:08:12.163 UTC [4177] jobs@staging jobrun:a "
        lines = [f"{head}LOG:  checkpoint starting: time", "x", head + mangle.format(text)]
        path = tmp_path_factory.mktemp("zero") / "log"
        path.write_text("\n".join(lines) + "\n")
        found = deadlocks.find([str(path)])
        assert not found.deadlocks
        (read,) = found.files
        assert read.status == 65
        assert "line 3" in str(read.error)

    def test_the_cli_exits_65_even_with_check(self, jobrun_here, tmp_path):
        """Hand-written: ``--check`` on such a file: 65 and the line, never 0."""
        head = "2026-12-01 02:08:12.163 UTC [4177] jobs@staging jobrun:a "
        path = write(tmp_path, f"{head}LOG:  ready\n{head}ERROR => deadlock detected\n")
        result = jobrun_here.run("deadlocks", "--check", str(path), dsn=None)
        assert result.returncode == 65, result.stdout
        assert "line 2" in result.stderr
        assert "0 deadlock(s) in 1 file(s), 1 with a deadlock not read" in result.stdout

    def test_a_statement_quoting_the_words_is_no_deadlock(self, jobrun_here, tmp_path):
        """Hand-written: a logged statement holding the words is neither a deadlock nor 65."""
        head = "2026-12-01 02:08:12 UTC "  # %t: no pid, a layout no list held
        path = write(tmp_path, f"{head}LOG:  statement: SELECT 'deadlock detected'\n")
        result = jobrun_here.run("deadlocks", "--check", str(path), dsn=None)
        assert result.returncode == 0, result.stdout + result.stderr


# --- every language the server ships -------------------------------------------------------

#: The locale each catalog's language is set with (lc_messages).
LOCALES = {
    "de": "de_DE",
    "es": "es_ES",
    "fr": "fr_FR",
    "it": "it_IT",
    "ja": "ja_JP",
    "ka": "ka_GE",
    "ko": "ko_KR",
    "pl": "pl_PL",
    "pt_BR": "pt_BR",
    "ru": "ru_RU",
    "sv": "sv_SE",
    "tr": "tr_TR",
    "uk": "uk_UA",
    "zh_CN": "zh_CN",
    "zh_TW": "zh_TW",
}


def nls_bin() -> Path | None:
    """A system PostgreSQL whose own message catalogs are installed (Debian's packages)."""
    for binary in sorted(Path("/usr/lib/postgresql").glob("*/bin"), reverse=True):
        version = binary.parent.name
        if (binary / "postgres").is_file() and any(
            Path("/usr/share/locale").glob(f"*/LC_MESSAGES/postgres-{version}.mo")
        ):
            return binary
    return None


def missing(reason: str) -> None:
    """Skip, saying why; under CI (which installs them, see .ci/run) fail instead."""
    if IN_CI:
        pytest.fail(reason)
    pytest.skip(reason)


@pytest.fixture(scope="module")
def locale_dir() -> Iterator[Path]:
    """Every catalog's locale compiled into a directory the server reads through LOCPATH.

    The machine needs no generated locales: ``localedef`` builds them from the ``locales``
    package's sources, readable by the server's user.
    """
    if shutil.which("localedef") is None or not Path("/usr/share/i18n/locales").is_dir():
        missing("no localedef or /usr/share/i18n/locales (Debian: apt-get install locales)")
    where = Path(tempfile.mkdtemp(prefix="jobrun-locales-"))
    where.chmod(0o755)
    jobs = [
        subprocess.Popen(
            ["localedef", "-i", name, "-f", "UTF-8", str(where / f"{name}.UTF-8")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for lang, name in LOCALES.items()
        if lang in catalog.SOURCES and Path(f"/usr/share/i18n/locales/{name}").is_file()
    ]
    for job in jobs:
        job.wait(timeout=300)
    yield where
    shutil.rmtree(where, ignore_errors=True)


@pytest.fixture(scope="module")
def nls_server(locale_dir: Path) -> Iterator[PgServer]:
    """Like ``logging_server``, on a PostgreSQL built with its message catalogs."""
    binary = nls_bin()
    if binary is None:
        missing("no PostgreSQL with its message catalogs (Debian: apt-get install postgresql-15)")
    saved = {name: os.environ.get(name) for name in (PGBIN_ENV, "LOCPATH")}
    os.environ[PGBIN_ENV], os.environ["LOCPATH"] = str(binary), str(locale_dir)
    try:
        server = PgServer.start(
            {
                "logging_collector": "on",
                "log_destination": "stderr,csvlog,jsonlog",
                "log_directory": "log",
                "log_filename": "pg",
                "log_line_prefix": PREFIX_WITH_APP,
                "log_lock_waits": "on",
                "log_connections": "on",
                "deadlock_timeout": "100ms",
            }
        )
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    with server, psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("CREATE TABLE accounts (id int PRIMARY KEY, balance int NOT NULL)")
        conn.execute("INSERT INTO accounts VALUES (1, 100), (2, 100)")
        yield server


def speak(server: PgServer, lang: str) -> None:
    """ALTER SYSTEM SET lc_messages to the language's locale; returns once sessions use it."""
    wanted = f"{LOCALES[lang]}.UTF-8"
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute(f"ALTER SYSTEM SET lc_messages = '{wanted}'")
        conn.execute("SELECT pg_reload_conf()")
    deadline = time.monotonic() + LOG_WAIT
    while True:
        with psycopg.connect(server.dsn()) as conn:
            row = conn.execute("SELECT current_setting('lc_messages')").fetchone()
        if row is not None and row[0] == wanted:
            return
        assert time.monotonic() < deadline, f"lc_messages still {row}"
        time.sleep(0.05)


LANGUAGES = sorted(lang for lang in catalog.SOURCES if lang in LOCALES)


class TestLanguages:
    """A real server speaking each language it has a catalog for: every format reads."""

    @pytest.mark.parametrize("lang", LANGUAGES)
    def test_every_format_reads_in_every_language(self, nls_server, locale_dir, tmp_path, lang):
        """stderr, csvlog, jsonlog with lc_messages in the language: both jobs, in English."""
        if not (locale_dir / f"{LOCALES[lang]}.UTF-8").is_dir():
            missing(f"localedef could not build {LOCALES[lang]}.UTF-8")
        speak(nls_server, lang)
        try:
            logs = logged_deadlock(nls_server, tmp_path, PREFIX_WITH_APP)
        finally:
            with psycopg.connect(nls_server.dsn(), autocommit=True) as conn:
                conn.execute("ALTER SYSTEM RESET lc_messages")
                conn.execute("SELECT pg_reload_conf()")
        text = logs["stderr"].read_text()
        (said,) = catalog.MESSAGES["deadlock detected"][lang]
        assert said in text, f"the server did not speak {lang}: {text[:2000]}"
        # The common layout is chosen with the language's words (the fast way), not per line.
        assert deadlocks.find([str(logs["stderr"])]).files[0].prefix == PREFIX_WITH_APP
        for fmt, path in logs.items():
            deadlock = one(path)
            assert_whole(deadlock)
            assert deadlock.context is not None, fmt
            assert deadlock.context.startswith("while updating tuple"), (fmt, deadlock.context)

    @pytest.mark.parametrize("lang", LANGUAGES)
    def test_a_cut_detail_in_every_language(self, nls_server, locale_dir, tmp_path, lang):
        """The DETAIL cut to its first line (by the test): the lock waits give the other side."""
        if not (locale_dir / f"{LOCALES[lang]}.UTF-8").is_dir():
            missing(f"localedef could not build {LOCALES[lang]}.UTF-8")
        speak(nls_server, lang)
        try:
            logs = logged_deadlock(nls_server, tmp_path, "%m [%p] ")
        finally:
            with psycopg.connect(nls_server.dsn(), autocommit=True) as conn:
                conn.execute("ALTER SYSTEM RESET lc_messages")
                conn.execute("SELECT pg_reload_conf()")
        lines = logs["stderr"].read_text().splitlines()
        (said,) = catalog.MESSAGES["deadlock detected"][lang]
        at = next(n for n, line in enumerate(lines) if said in line) + 1
        end = at + 1
        while end < len(lines) and lines[end].startswith("\t"):
            end += 1
        del lines[at + 1 : end]
        deadlock = one(write(tmp_path, "\n".join(lines) + "\n"))
        assert len(deadlock.sides) == 2, deadlock
        victim = next(side for side in deadlock.sides if side.pid == deadlock.victim)
        assert victim.waits_for is not None
        assert victim.waits_for.startswith("ShareLock on transaction ")


class TestCatalogTable:
    """jobrun's table of translations is what the catalogs on this machine hold."""

    def test_the_table_matches_the_catalogs_it_was_made_from(self):
        """tools/deadlock_catalog.py, run on the same catalogs, makes the same table."""
        import importlib.util  # noqa: PLC0415

        spec = importlib.util.spec_from_file_location("deadlock_catalog", TOOL)
        assert spec is not None
        assert spec.loader is not None
        tool = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tool)
        paths = [
            path
            for path in tool.catalogs(tool.default_roots())
            if path.name in catalog.SOURCES.get(path.parts[-3], ())
        ]
        if {path.parts[-3] for path in paths} != set(catalog.SOURCES):
            missing("the message catalogs the table was made from are not all installed here")
        if tool.checksums(paths) != catalog.CHECKSUMS:
            pytest.skip(
                "the catalogs installed here are other versions than those the table was made "
                "from: regenerate it with tools/deadlock_catalog.py"
            )
        sources, messages = tool.tables(paths)
        assert sources == catalog.SOURCES
        assert messages == catalog.MESSAGES

    def test_every_translated_wording_reads_back_into_english(self):
        """Each catalog's deadlock DETAIL line, filled in, reads as PostgreSQL's English."""
        msgid = "Process %d waits for %s on %s; blocked by process %d."
        for lang, forms in catalog.MESSAGES[msgid].items():
            tag = catalog.MESSAGES["transaction %u"].get(lang, ("transaction %u",))[0]
            for form in forms:
                line = _fill(form, ["4177", "ShareLock", tag.replace("%u", "758"), "4178"])
                assert language.detail(line) == (
                    "Process 4177 waits for ShareLock on transaction 758; blocked by process 4178."
                ), (lang, line)


def _fill(form: str, values: list[str]) -> str:
    """A printf format filled as PostgreSQL fills it (``%2$s`` takes the second value)."""
    count = 0

    def one_value(spec: re.Match[str]) -> str:
        nonlocal count
        index = int(spec[1]) - 1 if spec[1] else count
        count += 1
        return values[index]

    return re.sub(r"%(?:(\d+)\$)?[a-z]+", one_value, form)


class TestCraftedLines:
    """Hand-written crafted files: the per-line reader stays bounded and linear on them."""

    #: Seconds the reader may take: the quadratic readers these guard against take minutes.
    QUICK = 30
    HEAD = "2026-12-01 02:08:12 UTC <4177> "  # a layout no common one fits: read per line

    def deadlock(self) -> str:
        return (
            f"{self.HEAD}ERROR:  deadlock detected\n"
            f"{self.HEAD}DETAIL:  Process 4177 waits for ShareLock on transaction 7; "
            "blocked by process 4178.\n"
            "\tProcess 4178 waits for ShareLock on transaction 8; blocked by process 4177.\n"
        )

    def test_endless_wrapped_lines_are_cut_at_the_line_limit(self, jobrun_here, tmp_path):
        """Unindented lines after a long one (a wrap, joined) past 8 MiB: cut there, said."""
        from jobrun.analysis.deadlocks import sources  # noqa: PLC0415

        log = tmp_path / "wrapped.log"
        piece = "y" * 1023 + "\n"
        with log.open("w") as out:
            out.write(f"{self.HEAD}LOG:  statement: SELECT " + "x" * 60 + "\n")
            out.write(piece * ((sources.LINE_LIMIT + 2**20) // len(piece)))
            out.write(self.deadlock())
        result = jobrun_here.run("deadlocks", str(log), dsn=None, timeout=self.QUICK)
        assert result.returncode == 65, result.stderr
        assert "1 line(s) cut at" in result.stdout
        assert "1 deadlock(s) in 1 file(s)" in result.stdout

    @pytest.mark.parametrize(
        "line",
        [
            pytest.param(": " * 500, id="colons"),
            pytest.param("LOG:  process 1 still waiting for " + "a on " * 400, id="lock-wait"),
            pytest.param("DETAIL:  Process 1 waits for " + "a on " * 400, id="cycle"),
            pytest.param("ERROR:  " + "Process 1 waits for a on b; " * 70, id="wording"),
            pytest.param("[1]" * 200 + "a@" * 100 + " LOG:  x", id="prefix-fields"),
        ],
    )
    def test_crafted_lines_read_per_line_stay_quick(self, tmp_path, line):
        """16 MiB of lines built to make a per-line search backtrack: read in linear time."""
        log = tmp_path / "crafted.log"
        with log.open("w") as out:
            out.write(f"{self.HEAD}LOG:  database system is ready to accept connections\n")
            out.write((self.HEAD + line + "\n") * (16 * 2**20 // (len(self.HEAD) + len(line))))
            out.write(self.deadlock())
        started = time.monotonic()
        found = deadlocks.find([str(log)])
        assert time.monotonic() - started < self.QUICK
        assert len(found.deadlocks) == 1, deadlocks.report(found)
