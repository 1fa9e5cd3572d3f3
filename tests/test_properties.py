"""Generated command lines, environments and history fields: each ends in a documented way.

For each: no traceback, never exit 70, no secret in the output, an exit status from the
documented table, on a usage error the child never ran, and a child that ran (without a
database, unguarded) was asked to and said so. Most examples call
jobrun.cli.main in-process; a bounded number run ``python -m jobrun`` with raw argv bytes.
Nothing needs a database: every DSN points at a closed port. Set
JOBRUN_HYPOTHESIS_PROFILE=long for a longer search. Whatever text another role wrote into
the run history, or a job printed, the tables, ``show`` and the event lines a person reads
show it escaped: never a control character, never a line of its own.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from urllib.parse import quote, quote_plus

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from harness import jobrun_cli
from jobrun import log
from jobrun.cli import main
from jobrun.exitcodes import Exit
from jobrun.locks import Holder
from jobrun.ops import status
from jobrun.ops.status import kept
from support import EXAMPLES_PROPERTY

SECRET = "s3cr3tpw"  # noqa: S105 - the password the output must never show
#: Nothing listens on port 1: connecting fails at once, so no example needs a server.
CLOSED_HOST = "127.0.0.1"
TOUCH = shutil.which("touch") or "/usr/bin/touch"
#: Exit statuses an example may end with (the child, `touch`, exits 0 when it runs).
DOCUMENTED = {int(code) for code in Exit} - {Exit.INTERNAL} | {0}

#: CI replays the same examples every run (a gate must not fail by the luck of the draw);
#: the long profile explores afresh each time, and what it finds becomes a fix and a case.
settings.register_profile(
    "ci",
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
settings.register_profile(
    "long",
    max_examples=3000,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
PROFILE = os.environ.get("JOBRUN_HYPOTHESIS_PROFILE", "ci")
settings.load_profile(PROFILE)
#: Examples run as real processes (each costs an interpreter start).
PROCESS_EXAMPLES = 25 if PROFILE == "ci" else 300
#: pytest-timeout's limit for one whole property test (all of its examples).
WHOLE_TEST_TIMEOUT = 120 if PROFILE == "ci" else 3600

#: Examples tried per test. Each test's count goes into its report (user_properties, which
#: pytest-xdist carries from its workers), and conftest.py prints them at the end of the run.
TRIED: dict[str, int] = {}


@pytest.fixture(autouse=True)
def _report_examples(request):
    yield
    name = request.node.originalname
    if name in TRIED:
        request.node.user_properties.append((EXAMPLES_PROPERTY, (name, TRIED[name])))


def _has_escaped_bytes(text: str) -> bool:
    """Whether ``text`` carries bytes that were not UTF-8 (surrogateescape U+DC80-U+DCFF)."""
    return any(0xDC80 <= ord(char) <= 0xDCFF for char in text)


def _odd_text() -> st.SearchStrategy[str]:
    """Text as argv or the environment can carry it: any bytes, not UTF-8 included."""
    return st.one_of(
        st.text(min_size=0, max_size=12),
        st.binary(min_size=1, max_size=8).map(lambda b: b.decode("utf-8", "surrogateescape")),
        st.sampled_from([" a", "a ", "   ", "a\u200bb", "a\u2028b", "a\u202eb", "e\u0301", "\x7f"]),
        # Terminal escapes: a screen clear, OSC 52 (a clipboard write), a C1 CSI, CR.
        st.sampled_from(["\x1b[2J", "\x1b]52;c;aGk=\x07", "a\x9b2Jb", "a\rb", "a\nb"]),
    ).filter(lambda text: "\x00" not in text)


durations = st.one_of(
    st.sampled_from(["0", "1s", "250ms", "1h30m", "1d", "3651d", "-1", "5x", "\u0663s", "9" * 40]),
    _odd_text(),
)
key_names = st.one_of(
    st.sampled_from(["nightly", "a,b", "lock-id:5", "日本語", "x" * 201, ""]), _odd_text()
)
lock_ids = st.one_of(
    st.integers(min_value=-(2**64), max_value=2**64).map(str),
    st.sampled_from(["1_000", "abc", " 7 ", "+3"]),
    _odd_text(),
)
dsns = st.one_of(
    st.sampled_from(
        [
            f"postgresql://u:{SECRET}@{CLOSED_HOST}:1/db",
            f"host={CLOSED_HOST} port=1 password={SECRET} connect_timeout=1",
            f"host={CLOSED_HOST} port=1 password='{SECRET} x'",
            f"postgresql://u:{SECRET}%zz@{CLOSED_HOST}:1/db",
            f"password={SECRET} host",
            f"host={CLOSED_HOST} port=1",
        ]
    ),
    _odd_text()
    .filter(lambda text: not _has_escaped_bytes(text))
    .map(lambda text: f"host={CLOSED_HOST} port=1 password={SECRET}{text}"),
    # The database's name is quoted back in the error that the connection failed.
    _odd_text()
    .filter(lambda text: not _has_escaped_bytes(text))
    .map(lambda text: f"host={CLOSED_HOST} port=1 dbname='{text}'"),
)
#: DSNs with bytes that are not UTF-8 (a usage error: libpq takes UTF-8 connection strings).
#: No NUL: neither argv nor the environment can carry one.
dsns_not_utf8 = (
    st.binary(min_size=1, max_size=6)
    .filter(lambda raw: b"\x00" not in raw)
    .map(
        lambda raw: (
            f"host={CLOSED_HOST} port=1 password={SECRET}"
            + (b"\xff" + raw).decode("utf-8", "surrogateescape")
        )
    )
)

#: Group options: (flag, strategy for its value; None for a flag).
RUN_OPTIONS = {
    "--key": key_names,
    "--lock-id": lock_ids,
    "--dsn": dsns,
    "--connect-timeout": st.sampled_from(["1s", "500ms", "x", ""]),
    "--mode": st.sampled_from(["session", "lease", "sometimes"]),
    "--wait": durations,
    "--timeout": durations,
    "--kill-after": durations,
    "--heartbeat": durations,
    "--ttl": durations,
    "--skip-exit-code": st.sampled_from(["0", "75", "256", "-1", "x"]),
    "--on-db-error": st.sampled_from(["fail", "run", "maybe"]),
    "--on-lock-lost": st.sampled_from(["terminate", "ignore", "x"]),
    "--min-hold": durations,
    "--once-per": durations,
    "--no-history": None,
    "--keep": st.sampled_from(["1", "0", "x"]),
    "--alert-after": st.sampled_from(["0", "3", "-1"]),
    "--on-alert": st.sampled_from(["true", "'unbalanced", ""]),
    "--log-format": st.sampled_from(["json", "logfmt", "console", "xml"]),
    "--log-level": st.sampled_from(["debug", "error", "loud"]),
    "--frobnicate": None,
}
#: Variables and values for them.
VARIABLES = {
    "JOBRUN_KEY": key_names,
    "JOBRUN_LOCK_ID": lock_ids,
    "JOBRUN_DSN": dsns,
    "JOBRUN_MODE": st.sampled_from(["session", "lease", "x"]),
    "JOBRUN_WAIT": durations,
    "JOBRUN_TTL": durations,
    "JOBRUN_HEARTBEAT": durations,
    "JOBRUN_SKIP_EXIT_CODE": st.sampled_from(["0", "abc", "999"]),
    "JOBRUN_ON_DB_ERROR": st.sampled_from(["fail", "run", "x"]),
    "JOBRUN_NO_HISTORY": st.sampled_from(["1", "0", "maybe"]),
    "JOBRUN_LOG_FORMAT": st.sampled_from(["json", "x"]),
    "PGPASSWORD": st.just(SECRET),
}
#: Subcommands and what may follow them (never `demo`: it would start a server).
SUBCOMMANDS = {
    "status": st.lists(st.one_of(key_names, st.just("lock-id:1,lock-id:2")), max_size=2),
    "history": st.lists(key_names, min_size=0, max_size=2),
    "doctor": st.sampled_from([[], ["--json"], ["--mode", "lease"], ["--mode", "x"]]),
    "key": st.lists(key_names, max_size=3),
    "drill": st.sampled_from([[], ["--key", "drill-k"], ["--key", "k", "--", "true"]]),
    "overlap": st.sampled_from([[], ["--first", "true", "--second", "true", "--runs", "1"]]),
    "help": st.sampled_from([[], ["status"], ["nope"]]),
    "version": st.just([]),
}


@st.composite
def command_lines(draw) -> tuple[list[str], dict[str, str]]:
    """(argv without the child, environment): options before and after a subcommand."""
    flags = draw(st.lists(st.sampled_from(sorted(RUN_OPTIONS)), max_size=5))
    argv: list[str] = []
    for flag in flags:
        strategy = RUN_OPTIONS[flag]
        argv += [flag] if strategy is None else [flag, draw(strategy)]
    subcommand = draw(st.one_of(st.none(), st.sampled_from(sorted(SUBCOMMANDS))))
    if subcommand is not None:
        argv += [subcommand, *draw(SUBCOMMANDS[subcommand])]
        after = draw(
            st.lists(st.sampled_from(["--dsn", "--connect-timeout", "--json"]), max_size=2)
        )
        for flag in after:
            strategy = RUN_OPTIONS.get(flag)
            argv += [flag] if strategy is None else [flag, draw(strategy)]
    names = draw(st.lists(st.sampled_from(sorted(VARIABLES)), max_size=4, unique=True))
    env = {name: draw(VARIABLES[name]) for name in names}
    return argv, env


def base_environment() -> dict[str, str]:
    """What every example starts from: no real database reachable by any default."""
    return {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": os.environ.get("HOME", str(Path.home())),
        "PGHOST": CLOSED_HOST,
        "PGPORT": "1",
        "PGCONNECT_TIMEOUT": "1",
        "JOBRUN_DSN": f"host={CLOSED_HOST} port=1",
        "JOBRUN_CONNECT_TIMEOUT": "1s",
        "JOBRUN_LOG_FORMAT": "json",
    }


@contextlib.contextmanager
def environment(env: dict[str, str]):
    saved = dict(os.environ)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    os.environ.clear()
    os.environ.update(env)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        for signum, handler in handlers.items():
            signal.signal(signum, handler)


#: What each subcommand takes from the options written before it (the others are refused).
TAKES = {
    "status": {"--dsn", "--connect-timeout", "--key", "--lock-id"},
    "history": {"--dsn", "--connect-timeout", "--key", "--lock-id"},
    "doctor": {"--dsn", "--connect-timeout", "--mode"},
    "drill": {
        "--dsn",
        "--connect-timeout",
        "--mode",
        "--ttl",
        "--kill-after",
        "--heartbeat",
        "--key",
    },
    "overlap": {"--dsn", "--connect-timeout"},
}


def placed_before(argv: list[str]) -> tuple[str | None, set[str]]:
    """The subcommand (None: a run) and the flags written before it."""
    flags: set[str] = set()
    position = 0
    while position < len(argv):
        word = argv[position]
        if word in SUBCOMMANDS:
            return word, flags
        if word == "--":
            return None, flags
        flags.add(word)
        position += 1 if RUN_OPTIONS.get(word) is None else 2
    return None, flags


def on_db_error(argv: list[str], env: dict[str, str]) -> str | None:
    """The --on-db-error a run of ``argv`` gets: the last one written, else the variable's."""
    chosen = None
    position = 0
    while position < len(argv) and argv[position] != "--":
        word = argv[position]
        if word == "--on-db-error" and position + 1 < len(argv):
            chosen = argv[position + 1]
        position += 1 if RUN_OPTIONS.get(word) is None else 2
    return chosen if chosen is not None else env.get("JOBRUN_ON_DB_ERROR")


#: A control character (but newline) or a bidirectional override, raw.
RAW_CONTROL = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u202a-\u202e\u2066-\u2069]")

#: The lockstore_unavailable event's running_unguarded=true, as JSON, logfmt or console
#: (which says yes).
SAID_UNGUARDED = re.compile(r'\brunning_unguarded"?(?::\s*|=)(?:true|yes)\b')


def check(
    status: int, out: str, err: str, mark: Path, argv: list[str], *, env: dict[str, str]
) -> None:
    """The promises that hold for every command line (``env``: the environment it ran with)."""
    subcommand, before = placed_before(argv)
    if subcommand is not None and before - TAKES.get(subcommand, set()):
        # An option the subcommand does not take, written before it: refused, not ignored.
        assert status == Exit.USAGE, f"{argv!r}: {status}\n{err}"
    shown = f"argv={argv!r}\nstatus={status}\nstdout={out[-2000:]!r}\nstderr={err[-2000:]!r}"
    assert "Traceback" not in out + err, shown
    # Whatever the input held, nothing of it reaches the terminal as a control character.
    assert not RAW_CONTROL.search(out + err), shown
    assert status != Exit.INTERNAL, shown
    assert status in DOCUMENTED, shown
    assert SECRET not in out, shown
    assert SECRET not in err, shown
    if status == Exit.USAGE:
        assert not mark.exists(), shown
        assert len(err.strip().splitlines()) == 1, shown
    if mark.exists():
        # No example can reach a database: a child that ran, ran without the lock. Only a
        # run that asked for that may do it, and it must say so.
        assert subcommand is None, shown
        assert on_db_error(argv, env) == "run", shown
        assert SAID_UNGUARDED.search(err), shown


@pytest.fixture
def mark_dir():
    with tempfile.TemporaryDirectory(prefix="jobrun-prop-") as directory:
        yield Path(directory)


@pytest.mark.timeout(WHOLE_TEST_TIMEOUT)
class TestCommandLines:
    """Whatever the command line and the environment, jobrun ends in a documented way."""

    # Generated lines seldom make a valid run; these always do, so that the unguarded-child
    # promise is exercised on every run: asked for on the command line, in the environment,
    # overruled by the command line, not asked for, and said in each log format.
    @example(line=(["--key", "k", "--on-db-error", "run"], {}))
    @example(line=(["--key", "k"], {"JOBRUN_ON_DB_ERROR": "run"}))
    @example(line=(["--key", "k", "--on-db-error", "fail"], {"JOBRUN_ON_DB_ERROR": "run"}))
    @example(line=(["--key", "k"], {}))
    @example(line=(["--log-format", "logfmt", "--key", "k", "--on-db-error", "run"], {}))
    @example(line=(["--log-format", "console", "--key", "k", "--on-db-error", "run"], {}))
    # An error line that quotes what the input held (the database's name): escaped.
    @example(
        line=(["status"], {"JOBRUN_DSN": f"host={CLOSED_HOST} port=1 dbname='\x1b]52;c;aGk=\x07'"})
    )
    @given(line=command_lines())
    def test_in_process(self, line, capfd, mark_dir):
        """jobrun.cli.main(argv) with a generated environment."""
        TRIED["test_in_process"] = TRIED.get("test_in_process", 0) + 1
        argv, variables = line
        mark = mark_dir / "ran"
        mark.unlink(missing_ok=True)
        full = [*argv, "--", TOUCH, str(mark)] if "--" not in argv else argv
        env = {**base_environment(), **variables}
        capfd.readouterr()
        with environment(env):
            try:
                main(full)
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        out, err = capfd.readouterr()
        check(status, out, err, mark, full, env=env)

    @pytest.mark.process  # raw argv bytes through the real entry point
    @settings(max_examples=PROCESS_EXAMPLES)
    @given(line=command_lines())
    def test_as_a_process(self, line, mark_dir):
        """`python -m jobrun` with the same lines, argv as raw bytes (surrogateescape)."""
        TRIED["test_as_a_process"] = TRIED.get("test_as_a_process", 0) + 1
        argv, variables = line
        assume(all("\x00" not in part for part in argv))
        mark = mark_dir / "ran"
        mark.unlink(missing_ok=True)
        full = [*argv, "--", TOUCH, str(mark)] if "--" not in argv else argv
        env = {**base_environment(), **variables}
        env["PYTHONPATH"] = os.pathsep.join(sys.path)
        result = subprocess.run(
            [os.fsencode(sys.executable), b"-m", b"jobrun", *(os.fsencode(a) for a in full)],
            env={os.fsencode(k): os.fsencode(v) for k, v in env.items()},
            capture_output=True,
            timeout=60,
            check=False,
        )
        out = result.stdout.decode("utf-8", "replace")
        err = result.stderr.decode("utf-8", "replace")
        check(result.returncode, out, err, mark, full, env=env)


class TestDsnNotUtf8:
    """A DSN with bytes that are not UTF-8 (from argv or JOBRUN_DSN)."""

    @settings(max_examples=20)
    @given(
        dsn=dsns_not_utf8,
        where=st.sampled_from(["flag", "variable"]),
        subcommand=st.sampled_from([[], ["status"]]),
    )
    def test_is_a_usage_error(self, dsn, where, subcommand, capfd, mark_dir):
        """Exit 64 (or 69), never 70, and the password is not shown."""
        mark = mark_dir / "ran"
        argv = [*subcommand, "--dsn", dsn] if where == "flag" else [*subcommand]
        full = [*argv, "--key", "k", "--", TOUCH, str(mark)] if not subcommand else argv
        env = {**base_environment(), **({"JOBRUN_DSN": dsn} if where == "variable" else {})}
        capfd.readouterr()
        with environment(env):
            try:
                main(full)
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
        out, err = capfd.readouterr()
        check(status, out, err, mark, full, env=env)


#: A password from the full printable range (ASCII and beyond, no spaces): long enough that
#: finding it in the output can only mean it was shown.
passwords = st.text(
    alphabet=st.characters(
        min_codepoint=0x21, max_codepoint=0x2FF, exclude_categories=("Cc", "Cs", "Zs", "Zl")
    ),
    min_size=8,
    max_size=16,
)


def _keyword_value(password: str) -> str:
    escaped = password.replace("\\", "\\\\").replace("'", "\\'")
    return f"'{escaped}'"


#: Each way a password can be written into a connection string, and into which place.
URI_FORMS = {
    "uri": lambda pw: f"postgresql://u:{pw}@{CLOSED_HOST}:1/db",
    "uri_encoded": lambda pw: f"postgresql://u:{quote(pw, safe='')}@{CLOSED_HOST}:1/db",
    "uri_driver": lambda pw: f"postgresql+psycopg://u:{pw}@{CLOSED_HOST}:1/db",
    "uri_no_user": lambda pw: f"postgres://:{pw}@{CLOSED_HOST}:1/db?connect_timeout=1",
    "keyword": lambda pw: f"host={CLOSED_HOST} port=1 user=u password={_keyword_value(pw)}",
}


class TestPasswordsInUris:
    """Whatever characters a password holds, no output of a failing command shows it."""

    @settings(max_examples=120 if PROFILE == "ci" else 2000)
    @example(password="q8Zr/Tk3+Vb9w=", form="uri", where="flag", command="run")  # noqa: S106 - made up
    @example(password="q8Zr/Tk3+Vb9w=", form="uri", where="variable", command="doctor")  # noqa: S106 - made up
    @example(password="q8Zr/Tk3+Vb9w=", form="uri", where="variable", command="status")  # noqa: S106 - made up
    @example(password="pw9Secret", form="uri_driver", where="variable", command="run")  # noqa: S106 - made up
    @example(password="postgres", form="uri_driver", where="flag", command="run")  # noqa: S106 - in the scheme
    @example(password="p@ss:w%41rd", form="uri", where="variable", command="run")  # noqa: S106 - made up
    @example(password="pässwörd+=", form="uri_encoded", where="variable", command="doctor")  # noqa: S106 - made up
    @given(
        password=passwords,
        form=st.sampled_from(sorted(URI_FORMS)),
        where=st.sampled_from(["flag", "variable"]),
        command=st.sampled_from(["run", "status", "doctor"]),
    )
    def test_the_password_is_never_shown(  # noqa: PLR0917 - Hypothesis passes them by name
        self, password, form, where, command, capfd, mark_dir
    ):
        """Exit 64 or 69 (never 70), and neither the password nor its encoded forms appear."""
        TRIED["test_the_password_is_never_shown"] = (
            TRIED.get("test_the_password_is_never_shown", 0) + 1
        )
        mark = mark_dir / "ran"

        def attempt(secret: str) -> tuple[int, str, str]:
            dsn = URI_FORMS[form](secret)
            given_dsn = ["--dsn", dsn] if where == "flag" else []
            argv = (
                [*given_dsn, "--key", "k", "--", TOUCH, str(mark)]
                if command == "run"
                else [command, *given_dsn]
            )
            env = {**base_environment(), **({"JOBRUN_DSN": dsn} if where == "variable" else {})}
            capfd.readouterr()
            status = 0
            with environment(env):
                try:
                    main(argv)
                except SystemExit as exc:
                    status = exc.code if isinstance(exc.code, int) else 1
            out, err = capfd.readouterr()
            return status, dsn, out + err

        status, dsn, printed = attempt(password)
        shown = f"dsn={dsn!r}\nstatus={status}\nprinted={printed!r}"
        assert status in {Exit.USAGE, Exit.UNAVAILABLE}, shown
        assert not mark.exists(), shown
        # The same attempt with another password of the same length: text jobrun prints
        # whatever the password (a scheme such as "postgresql", a word of a message) may
        # contain this one by chance; shown is only what appears more often than there.
        _, _, reference = attempt(
            "Z" * len(password) if "Z" not in password else "Y" * len(password)
        )
        for written in {password, quote(password, safe=""), quote(password), quote_plus(password)}:
            assert printed.count(written) <= reference.count(written), shown


@pytest.mark.process  # the guard of test_as_a_process, with it in the full suite
def test_the_process_examples_use_the_real_entry_point():
    """The subprocess examples run what users run (a broken command would pass vacuously)."""
    result = jobrun_cli.run("key", "a", dsn=None)
    assert result.returncode == 0


#: Text another role can write into a history field (host, reason, outcome, a holder's
#: announcement), or a job can print: any characters, control characters often.
foreign_text = st.one_of(
    st.text(max_size=16),
    st.text(st.characters(max_codepoint=0xA0, exclude_characters="\x00"), max_size=16),
    st.sampled_from(["\x1b]52;c;aGk=\x07", "\x1b[2J", "a\x9b2Jb", "ok\rforged", "a\nb\u202e"]),
)


class TestForeignText:
    """Whatever the history holds, what a person reads shows it escaped, on its own line."""

    @given(host=foreign_text, reason=foreign_text, outcome=foreign_text, holder=foreign_text)
    def test_history_table(self, host, reason, outcome, holder):
        """A run's host, reason and outcome and a skip's holder: one line, no control character."""
        run = {
            "started_at": "2026-12-02T01:00:00+00:00",
            "outcome": outcome,
            "exit_code": 1,
            "duration": 1.5,
            "deadlocks": None,
            "host": host,
            "pid": 7,
            "run_id": reason,
            "reason": reason,
            "signal": None,
            "holder": {"holder_host": holder, "holder_pid": 8},
        }
        table = status.history_table([run, {**run, "outcome": "skipped"}])
        assert not RAW_CONTROL.search(table), repr(table)
        assert len(table.splitlines()) == 3, repr(table)

    @given(key=foreign_text, host=foreign_text, outcome=foreign_text, user=foreign_text)
    def test_status_table_and_check_lines(self, key, host, outcome, user):
        """A key's holder, last outcome and pause: one line each, no control character."""
        row = status.KeyStatus(
            key=key,
            lock_ids=[1],
            holder=Holder(key=key, mode="session", host=host, pid=7, run_id=user, since=user),
            last_outcome=outcome,
            last_finished_at=user,
            failure_streak=5,
            paused={"until": None, "user": user, "host": host},
        )
        table = status.status_table([row])
        assert not RAW_CONTROL.search(table), repr(table)
        assert len(table.splitlines()) == 2, repr(table)
        (line,) = status.check_lines([row], alert_after=3)
        assert not RAW_CONTROL.search(line), repr(line)
        assert "\n" not in line

    @given(key=foreign_text, host=foreign_text, stdout=st.binary(max_size=64))
    def test_kept_output(self, key, host, stdout):
        """``show``: the header on one line, the job's bytes with only newlines and tabs raw."""
        run = {
            "run_id": "0c6d08eb-8b18-42d0-8f9c-d6028c86839b",
            "key": key,
            "host": host,
            "outcome": "failed",
            "exit_code": 1,
            "started_at": "2026-12-02T01:00:00+00:00",
            "stdout": stdout,
            "stderr": None,
        }
        shown = kept.render(run).decode()
        assert not RAW_CONTROL.search(shown.replace("\t", "")), repr(shown)
        assert shown.splitlines()[1].startswith("--- stdout (last ")

    @given(fmt=st.sampled_from(["console", "logfmt", "json"]), value=foreign_text)
    def test_event_line(self, fmt, value, tmp_path_factory):
        """An event field holding the text: one line, no control character (JSON: its escapes)."""
        path = tmp_path_factory.mktemp("events") / "events.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        try:
            log.configure(fmt=fmt, fd=fd).info("skipped", holder_host=value, reason=[value])
        finally:
            os.close(fd)
        written = path.read_text()
        assert not RAW_CONTROL.search(written), repr(written)
        assert len(written.splitlines()) == 1, repr(written)
