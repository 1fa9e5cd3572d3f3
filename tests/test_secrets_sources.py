"""Whatever libpq took the password from, and however a job encodes it, it is never kept."""

from __future__ import annotations

import base64
import json
import os
import shlex
import subprocess
import sys
import uuid
from typing import TYPE_CHECKING, Any
from urllib.parse import quote

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harness import jobrun_cli
from support.monitor import Monitor

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator, Mapping
    from pathlib import Path

    from harness.pgserver import PgServer

#: The role's password, written to the password file (``:`` escaped there as ``\:``). Long
#: and mixed, so that each of its encodings differs from it and from the others.
PASSWORD = "Pg:pass/Word+9=Zq"  # noqa: S105 - made up
#: Printed by the child on stderr, one argument a line; then it fails.
CHILD = "import sys\nfor text in sys.argv[1:]: print(text, file=sys.stderr)\nsys.exit(3)\n"
#: Where libpq could find a password jobrun did not give it: each test sets its own.
PASSWORD_SOURCES = ("PGPASSWORD", "PGPASSFILE", "PGSERVICE", "PGSERVICEFILE")


def run(*args: str, dsn: str, env: Mapping[str, str]) -> subprocess.CompletedProcess[str]:
    """``jobrun ARGS...`` with no password source but those in ``env``."""
    full = jobrun_cli.environment(dsn)
    for name in PASSWORD_SOURCES:
        full.pop(name, None)
    full.update(env)
    return subprocess.run(
        [*jobrun_cli.JOBRUN, *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        check=False,
    )


def pgpass_line(dsn: str, password: str) -> str:
    """The password file's line for ``dsn``'s host, port, database and user."""
    params = conninfo_to_dict(dsn)
    fields = [str(params[name]) for name in ("host", "port", "dbname", "user")]
    return ":".join([*fields, escaped(password)]) + "\n"


def escaped(field: str) -> str:
    """A password file's field with ``\\`` and ``:`` escaped, as libpq reads it."""
    return field.replace("\\", "\\\\").replace(":", "\\:")


def write_private(path: Path, text: str) -> Path:
    """``text`` in a new file only its owner may read (libpq ignores any other password file)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(text)
    return path


def event(stderr: str, name: str) -> dict[str, Any]:
    """The event line ``name`` among jobrun's lines and the child's (which are not JSON)."""
    lines = "\n".join(line for line in stderr.splitlines() if line.startswith("{"))
    return jobrun_cli.event(lines, name)


def run_id_of(stderr: str) -> str:
    """The run id of the ``started`` event."""
    return str(event(stderr, "started")["run_id"])


def stderr_kept(dsn: str, run_id: str) -> bytes:
    """The stderr tail stored for ``run_id``."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT stderr_tail FROM jobrun.runs WHERE run_id = %s", (run_id,)
        ).fetchone()
    assert row is not None
    return bytes(row[0])


class Job:
    """A role with a password on a database of its own, and a password file that gives it."""

    def __init__(self, dsn: str, owner_dsn: str, home: Path) -> None:
        self.dsn = dsn
        self.owner_dsn = owner_dsn
        self.user = str(conninfo_to_dict(dsn)["user"])
        self.home = home
        self.pgpass = write_private(home / ".pgpass", pgpass_line(dsn, PASSWORD))

    @property
    def env(self) -> dict[str, str]:
        """The environment that points libpq at the password file."""
        return {"PGPASSFILE": str(self.pgpass)}

    def fails_printing(self, *printed: str, options: tuple[str, ...] = ()) -> str:
        """Run a child that prints ``printed`` and fails; its run id (exit 3 checked)."""
        ran = run(
            *("--key", f"sources-{uuid.uuid4().hex[:8]}", *options),
            *("--", sys.executable, "-c", CHILD, *printed),
            dsn=self.dsn,
            env=self.env,
        )
        assert ran.returncode == 3, ran.stderr
        return run_id_of(ran.stderr)


@pytest.fixture
def job(fresh_dsn: str, role: Callable[..., str], tmp_path: Path, pg_admin_dsn: str) -> Job:
    """A role with a password (given by a 0600 password file), granted jobrun's tables."""
    made = jobrun_cli.run(
        "--key", "sources-setup", "--keep-output", "1KiB", "--", "true", dsn=fresh_dsn
    )
    assert made.returncode == 0, made.stderr
    dsn = role(
        "GRANT USAGE ON SCHEMA jobrun TO {role}",
        "GRANT SELECT, INSERT, UPDATE, DELETE ON ALL TABLES IN SCHEMA jobrun TO {role}",
        database_dsn=fresh_dsn,
    )
    with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
        user = sql.Identifier(str(conninfo_to_dict(dsn)["user"]))
        conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(user, sql.Literal(PASSWORD)))
    return Job(dsn, fresh_dsn, tmp_path)


class TestPasswordFile:
    """A password libpq read from the password file is masked in kept output."""

    def test_printed_it_is_stored_and_shown_as_stars(self, job):
        """PGPASSFILE's password printed by a failing job: the stored tail and show say ***."""
        run_id = job.fails_printing(
            f"connecting with {PASSWORD}", options=("--keep-output", "4KiB")
        )
        assert stderr_kept(job.owner_dsn, run_id) == b"connecting with ***\n"
        shown = jobrun_cli.run("show", run_id, dsn=job.owner_dsn)
        assert shown.returncode == 0, shown.stderr
        assert "connecting with ***" in shown.stdout
        assert PASSWORD not in shown.stdout

    def test_the_file_in_home_is_masked_too(self, job):
        """No PGPASSFILE: libpq reads ~/.pgpass, and that password is masked."""
        ran = run(
            *("--key", f"sources-{uuid.uuid4().hex[:8]}", "--keep-output", "4KiB", "--"),
            *(sys.executable, "-c", CHILD, PASSWORD),
            dsn=job.dsn,
            env={"HOME": str(job.home)},
        )
        assert ran.returncode == 3, ran.stderr
        assert stderr_kept(job.owner_dsn, run_id_of(ran.stderr)) == b"***\n"

    def test_a_tail_cut_inside_it_shows_none_of_it(self, job):
        """A 12-byte window that starts halfway through the password: no piece of it left."""
        run_id = job.fails_printing("x" * 40 + PASSWORD, options=("--keep-output", "12"))
        assert stderr_kept(job.owner_dsn, run_id) == b"***\n"


class TestOtherLines:
    """The password file's other lines hold secrets too: a job may connect with any of them."""

    def test_the_password_of_another_line_is_masked(self, job):
        """A second line (another host, database and user): its password printed is ***."""
        other = "Warehouse-Pw:81/x"
        with job.pgpass.open("a") as file:
            file.write(f"warehouse.internal:5432:dw:etl:{escaped(other)}\n")
        run_id = job.fails_printing(f"dw login {other} failed", options=("--keep-output", "4KiB"))
        assert stderr_kept(job.owner_dsn, run_id) == b"dw login *** failed\n"

    def test_with_the_database_down_the_password_is_still_masked(
        self, jobrun_here, tmp_path, monitor, monkeypatch
    ):
        """No connection (the child runs anyway, --on-db-error run): the end ping says ***."""
        pgpass = write_private(tmp_path / "pgpass", f"*:*:*:*:{escaped(PASSWORD)}\n")
        for name in PASSWORD_SOURCES:  # as run() leaves them out
            monkeypatch.delenv(name, raising=False)
        ran = jobrun_here.run(
            *("--key", "sources-down", "--on-db-error", "run", "--keep-output", "4KiB"),
            *("--ping", monitor.url, "--", sys.executable, "-c", CHILD, PASSWORD),
            dsn="host=127.0.0.1 port=1 user=u dbname=d",
            env={"PGPASSFILE": str(pgpass)},
            forked=True,  # the pinger's thread ends with its process
        )
        assert ran.returncode == 3, ran.stderr
        body = monitor.bodies["/ping/sources/3"]
        assert body.endswith(b"\n***\n"), body


class TestEncodings:
    """The password libpq used, encoded as jobs and HTTP clients encode it, is masked."""

    def test_base64_of_the_password_alone_is_masked(self, job):
        """base64(password), padded or not: ***."""
        encoded = base64.b64encode(PASSWORD.encode()).decode()
        run_id = job.fails_printing(encoded, encoded.rstrip("="), options=("--keep-output", "4KiB"))
        assert stderr_kept(job.owner_dsn, run_id) == b"***\n***\n"

    def test_a_basic_authorization_header_is_masked(self, job):
        """``Authorization: Basic base64(user:password)``: the credentials are ***."""
        header = (
            "Authorization: Basic " + base64.b64encode(f"{job.user}:{PASSWORD}".encode()).decode()
        )
        run_id = job.fails_printing(header, options=("--keep-output", "4KiB"))
        assert stderr_kept(job.owner_dsn, run_id) == b"Authorization: Basic ***\n"

    def test_the_url_encoded_password_is_masked(self, job):
        """``Pg%3Apass%2FWord%2B9%3DZq`` in a URL the job built: ***."""
        url = f"https://api.example/login?pw={quote(PASSWORD, safe='')}&x=1"
        run_id = job.fails_printing(url, options=("--keep-output", "4KiB"))
        assert stderr_kept(job.owner_dsn, run_id) == b"https://api.example/login?pw=***&x=1\n"

    def test_base64_of_a_dsn_password_is_masked(self, job):
        """The password given in the DSN (no password file at all): its base64 is *** too."""
        header = "Basic " + base64.b64encode(f"{job.user}:{PASSWORD}".encode()).decode()
        ran = run(
            *("--key", f"sources-{uuid.uuid4().hex[:8]}", "--keep-output", "4KiB", "--"),
            *(sys.executable, "-c", CHILD, header),
            dsn=make_conninfo(job.dsn, password=PASSWORD),
            env={},
        )
        assert ran.returncode == 3, ran.stderr
        assert stderr_kept(job.owner_dsn, run_id_of(ran.stderr)) == b"Basic ***\n"


@pytest.fixture
def monitor() -> Iterator[Monitor]:
    made = Monitor("sources")
    yield made
    made.close()


class TestPingBody:
    """The end ping's body, read by whoever reads the monitor, carries no password."""

    def test_the_pgpass_password_in_the_end_ping_is_masked(self, job, monitor):
        """The password file's password, raw and in a Basic header: *** in the body."""
        header = "Basic " + base64.b64encode(f"{job.user}:{PASSWORD}".encode()).decode()
        job.fails_printing(
            PASSWORD, header, options=("--keep-output", "4KiB", "--ping", monitor.url)
        )
        body = monitor.bodies["/ping/sources/3"]
        assert body.endswith(b"\n***\nBasic ***\n"), body
        assert PASSWORD.encode() not in body


class TestAlertHook:
    """The --on-alert hook's input, read by a pager or a chat, carries no password."""

    HOOK = (
        "import json, os, sys\n"
        "json.dump({'stdin': sys.stdin.read(), 'env': dict(os.environ)}, open(sys.argv[1], 'w'))\n"
    )

    def test_the_hooks_stdin_and_variables_are_masked(self, job, tmp_path):
        """The password file's password in the tail: *** on stdin and in JOBRUN_ALERT_*."""
        seen = tmp_path / "hook.json"
        hook = shlex.join([sys.executable, "-c", self.HOOK, str(seen)])
        job.fails_printing(
            PASSWORD,
            options=("--keep-output", "4KiB", "--alert-after", "1", "--on-alert", hook),
        )
        called = json.loads(seen.read_text())
        assert json.loads(called["stdin"])["stderr_tail"] == "***\n"
        assert called["env"]["JOBRUN_ALERT_STDERR_TAIL"] == "***\n"
        alert_vars = {k: v for k, v in called["env"].items() if k.startswith("JOBRUN_ALERT_")}
        assert PASSWORD not in called["stdin"] + json.dumps(alert_vars)

    def test_a_failing_hooks_stderr_is_masked_in_the_log(self, job):
        """The hook prints the password file's password and fails: alert_failed shows ***."""
        hook = shlex.join([sys.executable, "-c", f"import sys; sys.exit({PASSWORD!r})"])
        ran = run(
            *("--key", f"sources-{uuid.uuid4().hex[:8]}", "--alert-after", "1"),
            *("--on-alert", hook, "--", "false"),
            dsn=job.dsn,
            env=job.env,
        )
        failed = event(ran.stderr, "alert_failed")
        assert failed["stderr"] == "***"
        assert PASSWORD not in ran.stderr


def require_password(server: PgServer, user: str) -> None:
    """Make ``server`` ask ``user`` for a SCRAM password over TCP; return once it does."""
    hba = server.data_dir / "pg_hba.conf"
    hba.write_text(f"host all {user} 127.0.0.1/32 scram-sha-256\n" + hba.read_text())
    with psycopg.connect(server.dsn(), autocommit=True) as conn:
        conn.execute("SELECT pg_reload_conf()")

    def asks() -> bool:
        try:
            psycopg.connect(
                make_conninfo(
                    server.dsn(), user=user, passfile=str(server.data_dir / "no-such-file")
                )
            ).close()
        except psycopg.OperationalError as exc:
            return "password" in str(exc)
        return False

    jobrun_cli.wait_until(asks, what="the server to ask for a password")


class TestPasswordAuthentication:
    """A server that checks the password: the one libpq sent is the one masked."""

    def test_a_service_file_password_the_server_checked_is_masked(
        self, private_server_factory, tmp_path
    ):
        """SCRAM auth, the password from PGSERVICEFILE: the run connects, the tail says ***."""
        server = private_server_factory()
        user = f"jobrun_scram_{uuid.uuid4().hex[:8]}"
        with psycopg.connect(server.dsn(), autocommit=True) as conn:
            conn.execute(
                sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(
                    sql.Identifier(user), sql.Literal(PASSWORD)
                )
            )
            conn.execute(
                sql.SQL("GRANT CREATE ON DATABASE postgres TO {}").format(sql.Identifier(user))
            )
        require_password(server, user)
        services = write_private(
            tmp_path / "services.conf",
            f"[job]\nhost={server.host}\nport={server.port}\ndbname=postgres\n"
            f"user={user}\npassword={PASSWORD}\n",
        )
        ran = run(
            *("--key", "scram", "--keep-output", "4KiB", "--"),
            *(sys.executable, "-c", CHILD, f"logged in with {PASSWORD}"),
            dsn="service=job",
            env={"PGSERVICEFILE": str(services)},
        )
        assert ran.returncode == 3, ran.stderr
        assert stderr_kept(server.dsn(), run_id_of(ran.stderr)) == b"logged in with ***\n"
