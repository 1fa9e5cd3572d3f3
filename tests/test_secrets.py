"""Secrets stay where they are: never in a line, an error, the child, the hook or kept output."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import psycopg
import pytest
import structlog
from hypothesis import given
from hypothesis import strategies as st

from harness import jobrun_cli
from jobrun import db, log, masking
from jobrun.cli import cli
from jobrun.history.config import HistoryConfig
from jobrun.locks import Identity
from jobrun.run import tail
from jobrun.run.notify import Notifier
from jobrun.run.settings import Settings

if TYPE_CHECKING:
    from collections.abc import Iterator
    from pathlib import Path

UNREACHABLE = "host=127.0.0.1 port=1 user=u dbname=d"
#: The DSN's password (the test server trusts every connection, so any password will do).
DSN_PASSWORD = "Dsn/Pw@rd+9=zZ"  # noqa: S105 - made up
PGPASSWORD = "pg-Env-Secret-4711"
PING_PASSWORD = "ping-Pass-8642"  # noqa: S105 - made up
PING_KEY = "3f1a0c9e-5b7d-4e2a-9c61-8d2b7e4f0a15"
API_TOKEN = "tok-Api-97531xyz"  # noqa: S105 - made up
#: Printed by the child: its environment as JSON, then whatever it is asked to print.
CHILD = (
    "import json, os, sys\n"
    "print(json.dumps(dict(os.environ)))\n"
    "for text in sys.argv[1:]: print(text, file=sys.stderr)\n"
    "sys.exit(3)\n"
)


def every_line(stderr: str) -> list[dict[str, object]]:
    """stderr's JSON event lines (a line that is not JSON fails the test)."""
    return jobrun_cli.events(
        "\n".join(line for line in stderr.splitlines() if line.startswith("{"))
    )


class TestUriPassword:
    """A password typed into a URI as it is, ``@`` included."""

    def test_raw_at_sign_is_a_usage_error_that_shows_no_part_of_it(
        self, jobrun_here, key, tmp_path
    ):
        """``u:p@wX@host``: exit 64, told to write %40, and neither ``p`` nor ``wX`` shown."""
        marker = tmp_path / "ran"
        result = jobrun_here.run(
            "--key", key, "--", "touch", str(marker), dsn="postgresql://u:p@wXz9@127.0.0.1:1/db"
        )
        assert result.returncode == 64, result.stderr
        assert "%40" in result.stderr
        assert "wXz9" not in result.stderr
        assert "p@" not in result.stderr
        assert not marker.exists()

    def test_percent_encoded_password_is_masked_in_errors(self, jobrun_here, key):
        """``p%40wXz9``: the server error names neither the password nor its pieces."""
        result = jobrun_here.run(
            "--key", key, "--", "true", dsn="postgresql://u:p%40wXz9@127.0.0.1:1/db"
        )
        assert result.returncode == 69, result.stderr
        assert "wXz9" not in result.stderr
        assert "p%40" not in result.stderr


class TestShortPasswords:
    """A password of a few characters must not rewrite everything that contains them."""

    @pytest.mark.parametrize("password", ["e", "r", "ro", "err", "test"])
    def test_event_names_levels_and_keys_are_intact(self, dsn, password):
        """PGPASSWORD=e: ``started``, ``finished`` and ``"level": "error"`` read as written."""
        key = f"test-{password}-export"
        ran = jobrun_cli.run("--key", key, "--", "true", dsn=dsn, env={"PGPASSWORD": password})
        assert ran.returncode == 0, ran.stderr
        names = [line["event"] for line in every_line(ran.stderr)]
        assert names == ["started", "finished"]
        assert all(line["key"] == key for line in every_line(ran.stderr))
        failed = jobrun_cli.run(
            "--key", key, "--", "true", dsn=UNREACHABLE, env={"PGPASSWORD": password}
        )
        (line,) = every_line(failed.stderr)
        assert line["level"] == "error"
        assert line["event"] == "lockstore_unavailable"
        assert line["reason"] == "unreachable"
        assert line["key"] == key

    @pytest.mark.parametrize("password", ["e", "ab", "hunter2"])
    def test_quoted_in_an_error_it_is_masked(self, password):
        """An error quoting the password (as libpq quotes values) shows ``***`` instead."""
        target = db.Target(dsn=f"host=h password={password} port=1")
        text = db.one_line(Exception(f'bad value "{password}" for option'), target)
        assert f'"{password}"' not in text
        assert '"***"' in text


class TestDsnErrors:
    """A connection string that does not parse says what is wrong, minus the password."""

    def test_garbage_is_named(self, jobrun_here, key):
        """``--dsn garbage``: the error quotes ``garbage``."""
        result = jobrun_here.run("--key", key, "--", "true", dsn="garbage")
        assert result.returncode == 64
        assert '"garbage"' in result.stderr

    def test_password_in_a_bad_dsn_is_hidden(self, jobrun_here, key):
        """An unterminated quote after the password: the error does not quote the password."""
        result = jobrun_here.run("--key", key, "--", "true", dsn="host=h password=hunter2 port")
        assert result.returncode == 64
        assert "hunter2" not in result.stderr
        assert "connection string" in result.stderr


class TestReprs:
    """An object's repr (a debugger, a traceback that shows locals) never shows a secret."""

    def test_a_target_hides_its_dsn(self):
        """The DSN may hold the password: a Target's repr leaves it out."""
        target = db.Target(dsn="postgresql://app:hunter2@db.internal/jobs", connect_timeout=3)
        assert "hunter2" not in repr(target)
        assert "connect_timeout=3" in repr(target)

    def test_a_runs_settings_hide_the_dsn_and_the_ping_url(self):
        """--dsn and --ping may carry credentials: the settings' repr shows neither."""
        argv = ["--key", "k", "--dsn", "postgresql://app:hunter2@db/jobs",
                "--ping", "https://hc.example/ping/tok-123"]  # fmt: skip
        context = cli.make_context("jobrun", argv, resilient_parsing=True)
        settings = Settings.from_params(context.params, run_keys=(), dsn_on_command_line=True)
        shown = repr(settings)
        assert "hunter2" not in shown
        assert "tok-123" not in shown
        assert "mode='session'" in shown

    def test_a_notifier_hides_the_hook_environment_and_the_secrets(self):
        """The alert hook's environment and the run's secrets stay out of its repr."""
        notifier = Notifier(
            "backup", [1], Identity(run_id="r", pid=1), mode="session",
            config=HistoryConfig(keep=10, alert_after=3, alert_repeat=3600.0, on_alert=None,
                                 metrics_file=None, expect_every=None, expect_grace=None,
                                 timeout=5.0),
            log=structlog.get_logger(), environ={"API_TOKEN": "tok-123"}, secrets=("hunter2",),
        )  # fmt: skip
        shown = repr(notifier)
        assert "tok-123" not in shown
        assert "hunter2" not in shown
        assert "backup" in shown


SECRET = st.text(
    alphabet=st.characters(min_codepoint=33, max_codepoint=126), min_size=1, max_size=12
)


class TestMaskingProperties:
    """Whatever the password, the masking keeps its promises."""

    @given(secret=SECRET)
    def test_fixed_fields_never_change(self, secret):
        """``timestamp``, ``level`` and ``event`` are never rewritten."""
        redact = log.redactor([secret])
        event = {"level": "error", "event": "lockstore_unavailable", "timestamp": "x"}
        assert redact(None, "error", dict(event)) == event

    @given(secret=SECRET)
    def test_a_secret_standing_as_a_value_is_masked(self, secret):
        """Quoted (as libpq quotes values), or a whole field: the secret is masked."""
        masked = masking.mask_secrets(f'bad value "{secret}" for option', [secret])
        assert f'"{secret}"' not in masked
        assert "***" in masked
        assert masking.mask_secrets(secret, [secret]) == "***"

    @given(secret=st.text(alphabet="abcdefghijklmnopqrstuvwxyz", min_size=1, max_size=3))
    def test_short_secrets_leave_words_alone(self, secret):
        """A one-to-three letter password never changes a word it is part of."""
        words = ["started", "finished", "error", "warning", "skipped", "lockstore_unavailable"]
        for word in words:
            if word != secret:
                assert masking.mask_secrets(word, [secret]) == word
                assert masking.mask_secrets(f"the {word} line", [secret]) == f"the {word} line"

    def test_json_line_round_trips(self):
        """A masked line is still one JSON object."""
        text = masking.mask_secrets('{"a": "hunter2"}', ["hunter2"])
        assert json.loads(text) == {"a": "***"}


def with_password(dsn: str) -> str:
    """The test DSN with DSN_PASSWORD in it (a URI, the password percent-encoded)."""
    params = psycopg.conninfo.conninfo_to_dict(dsn)
    return (
        f"postgresql://{params.get('user') or 'postgres'}:{quote(DSN_PASSWORD, safe='')}@"
        f"{params.get('host') or '127.0.0.1'}:{params.get('port') or 5432}/{params['dbname']}"
    )


def child_env(stdout: str) -> dict[str, str]:
    """The environment the CHILD script printed as its first line."""
    return dict(json.loads(stdout.splitlines()[0]))


class TestChildEnvironment:
    """The child never gets jobrun's own secrets, nor variables of an earlier run."""

    def test_the_dsn_ping_url_and_alert_command_are_withheld(self, dsn, key):
        """JOBRUN_DSN, JOBRUN_PING and JOBRUN_ON_ALERT are not in the child's environment."""
        ping = f"http://u:{PING_PASSWORD}@127.0.0.1:9/{PING_KEY}"
        ran = jobrun_cli.run(
            *("--key", key, "--ping-timeout", "100ms", "--", sys.executable, "-c", CHILD),
            dsn=with_password(dsn),
            env={"JOBRUN_PING": ping, "JOBRUN_ON_ALERT": f"curl {ping}"},
        )
        assert ran.returncode == 3, ran.stderr
        seen = child_env(ran.stdout)
        assert not {"JOBRUN_DSN", "JOBRUN_PING", "JOBRUN_ON_ALERT"} & set(seen)
        for secret in (quote(DSN_PASSWORD, safe=""), PING_PASSWORD, PING_KEY):
            assert secret not in ran.stdout

    def test_pg_variables_the_user_set_stay(self, dsn, key):
        """PGPASSWORD and the other PG* variables reach the child: the job may need them."""
        ran = jobrun_cli.run(
            *("--key", key, "--", sys.executable, "-c", CHILD),
            dsn=dsn,
            env={"PGPASSWORD": PGPASSWORD, "PGDATABASE": "appdb"},
        )
        seen = child_env(ran.stdout)
        assert (seen["PGPASSWORD"], seen["PGDATABASE"]) == (PGPASSWORD, "appdb")

    @pytest.mark.parametrize("where", ["flag", "variable"])
    def test_pass_env_gives_the_child_the_dsn(self, dsn, key, where):
        """--pass-env JOBRUN_DSN (or JOBRUN_PASS_ENV): a nested jobrun can connect as we did."""
        flag = ("--pass-env", "JOBRUN_DSN") if where == "flag" else ()
        env = {"JOBRUN_PASS_ENV": "JOBRUN_DSN"} if where == "variable" else {}
        ran = jobrun_cli.run(
            "--key", key, *flag, "--", sys.executable, "-c", CHILD, dsn=dsn, env=env
        )
        assert child_env(ran.stdout)["JOBRUN_DSN"] == dsn

    def test_pass_env_of_another_variable_is_a_usage_error(self, dsn, key, tmp_path):
        """--pass-env HOME: exit 64 (every other variable reaches the child anyway)."""
        marker = tmp_path / "ran"
        ran = jobrun_cli.run(
            "--key", key, "--pass-env", "HOME", "--", "touch", str(marker), dsn=dsn
        )
        assert ran.returncode == 64
        assert "--pass-env HOME" in ran.stderr
        assert not marker.exists()

    def test_stale_jobrun_variables_never_reach_the_child(self, dsn, key):
        """An inherited JOBRUN_FENCE_TOKEN, JOBRUN_SLOT or JOBRUN_RUN_ID is not the child's."""
        ran = jobrun_cli.run(
            *("--key", key, "--", sys.executable, "-c", CHILD),
            dsn=dsn,
            env={"JOBRUN_FENCE_TOKEN": "999", "JOBRUN_SLOT": "7", "JOBRUN_RUN_ID": "stale"},
        )
        seen = child_env(ran.stdout)
        assert "JOBRUN_FENCE_TOKEN" not in seen
        assert "JOBRUN_SLOT" not in seen
        assert seen["JOBRUN_RUN_ID"] == run_id_of(ran.stderr)

    def test_a_raw_lock_id_run_drops_an_inherited_key_name(self, dsn):
        """--lock-id N: an inherited JOBRUN_KEY names another job, so the child has none."""
        ran = jobrun_cli.run(
            *("--lock-id", "424242", "--", sys.executable, "-c", CHILD),
            dsn=dsn,
            env={"JOBRUN_KEY": "someone-else"},
        )
        seen = child_env(ran.stdout)
        assert "JOBRUN_KEY" not in seen
        assert seen["JOBRUN_LOCK_ID"] == "424242"


def run_id_of(stderr: str) -> str:
    """The run id of the ``started`` event among jobrun's and the child's stderr lines."""
    (started,) = [line for line in every_line(stderr) if line["event"] == "started"]
    return str(started["run_id"])


def kept(dsn: str, stderr: str) -> tuple[bytes, bytes]:
    """The output tails stored for the run whose events are ``stderr``."""
    run_id = run_id_of(stderr)
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT stdout_tail, stderr_tail FROM jobrun.runs WHERE run_id = %s", (run_id,)
        ).fetchone()
    assert row is not None
    return bytes(row[0]), bytes(row[1])


class TestKeptOutput:
    """A failed job that prints its secrets leaves none in the history (readable by others)."""

    def test_the_dsn_password_in_every_form_is_masked(self, dsn, key):
        """The password as is, URL-encoded, in a URI and in PGPASSWORD: stored as ***."""
        app_uri = f"postgresql://app:{DSN_PASSWORD}@db.internal/app"
        ran = jobrun_cli.run(
            *("--key", key, "--keep-output", "16KiB", "--"),
            *(sys.executable, "-c", CHILD, DSN_PASSWORD, quote(DSN_PASSWORD, safe="")),
            *(app_uri, f"password={PGPASSWORD}", f"pg={PGPASSWORD}"),
            dsn=with_password(dsn),
            env={"PGPASSWORD": PGPASSWORD},
        )
        assert ran.returncode == 3, ran.stderr
        _, err = kept(dsn, ran.stderr)
        for secret in (DSN_PASSWORD, quote(DSN_PASSWORD, safe=""), PGPASSWORD):
            assert secret.encode() not in err
        assert err.count(b"***") == 5, err
        shown = jobrun_cli.run("show", run_id_of(ran.stderr), dsn=dsn)
        assert DSN_PASSWORD not in shown.stdout

    def test_a_uri_password_jobrun_does_not_know_is_masked(self, dsn, key):
        """The job's own connection string (any scheme, any characters): its password goes."""
        printed = "cannot connect: postgresql+psycopg://app:q8Zr/Tk3+Vb9w=@db/app failed"
        ran = jobrun_cli.run(
            *("--key", key, "--keep-output", "4KiB", "--", sys.executable, "-c", CHILD, printed),
            dsn=dsn,
        )
        _, err = kept(dsn, ran.stderr)
        assert err == b"cannot connect: postgresql+psycopg://app:***@db/app failed\n"

    def test_variables_named_like_secrets_are_masked(self, dsn, key):
        """*TOKEN*, *SECRET*, *PASSWORD*, *_KEY: masked; a short value is not (it is left)."""
        env = {
            "MY_API_TOKEN": API_TOKEN,
            "Service_Secret": "svc-Secret-2468",
            "DEPLOY_KEY": "deploy-Key-1357",
            "FEATURE_TOKEN_ON": "yes",
            "TOKEN_FILE": "/run/secrets/token",
        }
        ran = jobrun_cli.run(
            *("--key", key, "--keep-output", "4KiB", "--", sys.executable, "-c", CHILD),
            *(*env.values(), "key", "no"),
            dsn=dsn,
            env=env,
        )
        _, err = kept(dsn, ran.stderr)
        lines = err.decode().splitlines()
        assert lines == ["***", "***", "***", "yes", "/run/secrets/token", "key", "no"]

    @pytest.mark.parametrize("where", ["flag", "variable"])
    def test_mask_env_masks_a_variable_of_any_name(self, dsn, key, where):
        """--mask-env APP_DSN (or JOBRUN_MASK_ENV): that variable's value is masked."""
        app = "host=db.internal user=app sslkey=/k"
        flag = ("--mask-env", "APP_DSN") if where == "flag" else ()
        env = {"APP_DSN": app, **({"JOBRUN_MASK_ENV": "APP_DSN"} if where == "variable" else {})}
        ran = jobrun_cli.run(
            *("--key", key, "--keep-output", "4KiB", *flag),
            *("--", sys.executable, "-c", CHILD, f"using {app}"),
            dsn=dsn,
            env=env,
        )
        _, err = kept(dsn, ran.stderr)
        assert err == b"using ***\n"

    def test_a_name_that_cannot_be_a_variable_is_a_usage_error(self, jobrun_here, key, tmp_path):
        """--mask-env 'A B': exit 64, the child never started."""
        marker = tmp_path / "ran"
        ran = jobrun_here.run(
            "--key", key, "--mask-env", "A B", "--", "touch", str(marker), dsn=UNREACHABLE
        )
        assert ran.returncode == 64
        assert "not an environment variable name" in ran.stderr
        assert not marker.exists()

    def test_the_environment_the_child_prints_is_masked(self, dsn, key):
        """A child that dumps its environment: no secret of it survives in the kept stdout."""
        ran = jobrun_cli.run(
            *("--key", key, "--keep-output", "64KiB", "--", sys.executable, "-c", CHILD),
            dsn=dsn,
            env={"PGPASSWORD": PGPASSWORD, "MY_API_TOKEN": API_TOKEN},
        )
        out, _ = kept(dsn, ran.stderr)
        assert PGPASSWORD.encode() not in out
        assert API_TOKEN.encode() not in out
        assert json.loads(out)["MY_API_TOKEN"] == "***"  # noqa: S105 - the mask


class _Sink:
    """Two temporary files standing in for jobrun's stdout and stderr."""

    def __init__(self, tmp_path: Path) -> None:
        self.paths = (tmp_path / "out", tmp_path / "err")
        self.fds = tuple(os.open(p, os.O_WRONLY | os.O_CREAT | os.O_APPEND) for p in self.paths)

    def close(self) -> None:
        for fd in self.fds:
            os.close(fd)


class TestMaskingAcrossReads:
    """A secret that arrives in pieces, or is cut by the tail's window, is still masked."""

    def test_a_secret_written_in_two_reads_is_masked(self, tmp_path):
        """The first half is read (and forwarded) before the second is written: masked whole."""
        sink = _Sink(tmp_path)
        go = tmp_path / "go"
        half = len(API_TOKEN) // 2
        script = (
            "import os, sys, time\n"
            f"sys.stdout.write({API_TOKEN[:half]!r}); sys.stdout.flush()\n"
            f"while not os.path.exists({str(go)!r}): time.sleep(0.01)\n"
            f"sys.stdout.write({API_TOKEN[half:]!r} + ' done')\n"
        )
        capture = tail.Capture(4096, targets=sink.fds, masker=masking.Masker([API_TOKEN]))
        out, err = capture.child_fds()
        child = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=err)
        try:
            capture.begin()
            # Forwarded only after it went into the ring: the first half is a chunk of its own.
            jobrun_cli.wait_until(
                lambda: sink.paths[0].read_bytes() == API_TOKEN[:half].encode(),
                what="the first half forwarded",
            )
            go.touch()
            child.wait(timeout=30)
            capture.finish()
        finally:
            sink.close()
        assert sink.paths[0].read_bytes() == f"{API_TOKEN} done".encode()  # passed through
        assert capture.stdout_tail == b"*** done"

    def test_a_tail_that_starts_inside_a_secret_shows_none_of_it(self, tmp_path):
        """A 12-byte window that begins halfway through the token: its second half is masked."""
        sink = _Sink(tmp_path)
        script = f"import sys; sys.stdout.write('x' * 100 + {API_TOKEN!r} + '!')"
        capture = tail.Capture(12, targets=sink.fds, masker=masking.Masker([API_TOKEN]))
        out, err = capture.child_fds()
        child = subprocess.Popen([sys.executable, "-c", script], stdout=out, stderr=err)
        try:
            capture.begin()
            child.wait(timeout=30)
            capture.finish()
        finally:
            sink.close()
        assert capture.stdout_tail == b"***!"

    @given(secret=st.text(min_size=8, max_size=24), cut=st.integers(min_value=1, max_value=23))
    def test_no_suffix_of_a_secret_survives_a_cut(self, secret, cut):
        """Whatever the secret and wherever the window starts in it, no piece of it is left."""
        cut = min(cut, len(secret) - 1)
        piece = secret[cut:]
        masked = masking.Masker([secret]).data((piece + " end").encode(), cut=True)
        # All of the piece is masked. The mask may reach a little further when what follows
        # also matches the secret's end (a secret ending in spaces, then " end"): more
        # masked than needed, never less.
        assert masked.startswith(b"***"), masked
        assert b" end".endswith(masked[3:]), masked


class Monitor:
    """A local HTTP server standing in for a Healthchecks-style monitor: keeps each body."""

    def __init__(self) -> None:
        self.bodies: dict[str, bytes] = {}
        monitor = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                monitor.bodies[self.path.split("?")[0].rsplit("/", 1)[1]] = self.rfile.read(length)
                self.send_response(200)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *_args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        port = self.server.server_address[1]
        self.url = f"http://u:{PING_PASSWORD}@127.0.0.1:{port}/ping/{PING_KEY}"


@pytest.fixture
def monitor() -> Iterator[Monitor]:
    made = Monitor()
    yield made
    made.server.shutdown()
    made.server.server_close()


class TestPingBody:
    """The end ping's body (read by whoever reads the monitor) carries no secret."""

    def test_the_tail_in_the_end_ping_is_masked(self, dsn, key, monitor):
        """The DSN's password, the ping URL's password and check key: *** in the body."""
        ran = jobrun_cli.run(
            *("--key", key, "--keep-output", "4KiB", "--ping", monitor.url, "--"),
            *(sys.executable, "-c", CHILD, DSN_PASSWORD, monitor.url, PING_KEY),
            dsn=with_password(dsn),
        )
        assert ran.returncode == 3, ran.stderr
        body = monitor.bodies["3"]
        assert b"--- stderr" in body
        for secret in (DSN_PASSWORD, PING_PASSWORD, PING_KEY):
            assert secret.encode() not in body
        assert body.endswith(b"--- stderr (last 25 bytes)\n***\nhttp://u:***@***\n***\n")


class TestAlertHook:
    """The --on-alert hook gets the event masked and none of jobrun's own secrets."""

    HOOK = (
        "import json, os, sys\n"
        "json.dump({'stdin': sys.stdin.read(), 'env': dict(os.environ)}, open(sys.argv[1], 'w'))\n"
    )

    def test_the_hooks_stdin_and_variables_are_masked(self, dsn, key, tmp_path):
        """stdin's event, JOBRUN_ALERT_STDERR_TAIL: *** for the password; no JOBRUN_DSN."""
        seen = tmp_path / "hook.json"
        hook = shlex.join([sys.executable, "-c", self.HOOK, str(seen)])
        ran = jobrun_cli.run(
            *("--key", key, "--keep-output", "4KiB", "--alert-after", "1"),
            *("--on-alert", hook, "--", sys.executable, "-c", CHILD, DSN_PASSWORD, API_TOKEN),
            dsn=with_password(dsn),
            env={"MY_API_TOKEN": API_TOKEN},
        )
        assert ran.returncode == 3, ran.stderr
        called = json.loads(seen.read_text())
        event = json.loads(called["stdin"])
        assert event["stderr_tail"] == "***\n***\n"
        assert called["env"]["JOBRUN_ALERT_STDERR_TAIL"] == "***\n***\n"
        assert "JOBRUN_DSN" not in called["env"]
        assert "JOBRUN_ON_ALERT" not in called["env"]
        assert DSN_PASSWORD not in called["stdin"]
        assert API_TOKEN not in json.dumps(event)

    def test_a_failing_hooks_stderr_is_masked_in_the_log(self, dsn, key):
        """The hook prints --mask-env's variable and fails: alert_failed shows ***."""
        app = "host=db.internal user=app"
        hook = shlex.join([sys.executable, "-c", "import os, sys; sys.exit(os.environ['APP'])"])
        ran = jobrun_cli.run(
            *("--key", key, "--alert-after", "1", "--on-alert", hook, "--mask-env", "APP"),
            *("--", "false"),
            dsn=dsn,
            env={"APP": app},
        )
        (failed,) = [line for line in every_line(ran.stderr) if line["event"] == "alert_failed"]
        assert failed["stderr"] == "***"
        assert app not in ran.stderr


class TestUriForms:
    """Every way of writing a URI is masked or refused, wherever jobrun prints it."""

    @pytest.mark.parametrize("command", [[], ["status"], ["doctor"]])
    def test_a_raw_slash_in_the_password_is_a_usage_error(self, jobrun_here, key, command):
        """``u:q8Zr/Tk3+Vb9w=@h``: exit 64, told to write %2F, no piece of it shown."""
        argv = [*command] if command else ["--key", key, "--", "true"]
        ran = jobrun_here.run(*argv, dsn="postgresql://u:q8Zr/Tk3+Vb9w=@127.0.0.1:1/db")
        assert ran.returncode == 64, ran.stderr
        assert "%2F" in ran.stderr
        assert "q8Zr" not in ran.stderr
        assert "Tk3" not in ran.stderr

    @pytest.mark.parametrize("scheme", ["postgresql+psycopg", "postgresql+asyncpg"])
    def test_a_driver_qualified_uri_is_refused_without_its_password(self, jobrun_here, key, scheme):
        """SQLAlchemy's ``postgresql+psycopg://``: exit 64, names the fix, not the password."""
        ran = jobrun_here.run(
            "--key", key, "--", "true", dsn=f"{scheme}://u:pw9Secret@127.0.0.1:1/db"
        )
        assert ran.returncode == 64, ran.stderr
        assert "pw9Secret" not in ran.stderr
        assert f"{scheme}://" in ran.stderr
        assert "postgresql://" in ran.stderr

    def test_an_unknown_password_in_a_uri_of_any_scheme_is_masked(self):
        """Text quoting a URI jobrun was not given: its password is masked to the last '@'."""
        text = "see https://u:a/b@c:d%41é@host/x and postgresql+psycopg://:p@w@h/db"
        assert db.redact(text) == "see https://u:***@host/x and postgresql+psycopg://:***@h/db"

    def test_a_uri_password_in_any_log_field_is_masked(self):
        """An event field quoting a URI (a library warning, a hook's stderr): masked."""
        redact = log.redactor([])
        event = {"event": "library_warning", "message": "at postgresql://u:a/b@c@h/db: gone"}
        assert redact(None, "warning", event)["message"] == "at postgresql://u:***@h/db: gone"
