"""An option written before a subcommand applies to it, or is a usage error: never ignored."""

from __future__ import annotations

import json
import re

import pytest

from harness import jobrun_cli
from jobrun.cli import cli

#: Nothing listens on port 1: a command that uses this database exits 69 quickly.
CLOSED = "postgresql://postgres@127.0.0.1:1/closed"


class TestDatabaseBeforeSubcommand:
    """--dsn and --connect-timeout before a subcommand are the subcommand's."""

    @pytest.mark.parametrize(
        "subcommand",
        [
            ["status"],
            ["history", "some-key"],
            ["doctor"],
            ["overlap", "--first", "true", "--second", "true"],
            ["drill", "--key", "drill-placement"],
        ],
        ids=lambda argv: argv[0],
    )
    def test_dsn_before_the_subcommand_is_used(self, dsn, subcommand):
        """`jobrun --dsn D SUB` connects to D (not to JOBRUN_DSN or libpq's default)."""
        result = jobrun_cli.run(
            "--dsn", CLOSED, "--connect-timeout", "2s", *subcommand, dsn=dsn, timeout=120
        )
        assert result.returncode == 69, result.stdout + result.stderr
        assert "127.0.0.1:1" in result.stderr

    def test_demo_uses_the_dsn_before_it(self, dsn):
        """`jobrun --dsn D demo` uses D: a server that refuses D's role is an error (69)."""
        refused = dsn.replace("user=postgres", "user=no_such_role_xyz")
        assert refused != dsn
        result = jobrun_cli.run("--dsn", refused, "demo", dsn=dsn, timeout=120)
        assert result.returncode == 69, result.stdout + result.stderr
        assert "answered but refused" in result.stderr
        assert "demo passed" not in result.stdout

    def test_connect_timeout_before_the_subcommand_is_validated(self, dsn):
        """A bad --connect-timeout before `status` is a usage error, not ignored."""
        result = jobrun_cli.run("--connect-timeout", "soon", "status", dsn=dsn)
        assert result.returncode == 64, result.stderr
        assert "--connect-timeout" in result.stderr

    def test_given_before_and_after_is_refused(self, dsn):
        """`jobrun --dsn A status --dsn B`: one of them would be ignored, so neither is used."""
        result = jobrun_cli.run("--dsn", CLOSED, "status", "--dsn", dsn, dsn=dsn)
        assert result.returncode == 64, result.stderr
        assert "both before and after" in result.stderr


class TestModeAndKeysBeforeSubcommand:
    """--mode and --key/--lock-id before a subcommand."""

    def test_mode_before_doctor_is_judged(self, dsn):
        """`jobrun --mode lease doctor` is `jobrun doctor --mode lease`."""
        before = jobrun_cli.run("--mode", "lease", "doctor", "--json", dsn=dsn)
        after = jobrun_cli.run("doctor", "--mode", "lease", "--json", dsn=dsn)
        session = jobrun_cli.run("doctor", "--json", dsn=dsn)
        # The doctor's lease probe takes a key of a random name each time.
        probe = re.compile(r"jobrun-doctor-probe-[0-9a-f]+")
        judged = [
            [
                (f["check"], f["status"], probe.sub("jobrun-doctor-probe-*", f["detail"]))
                for f in json.loads(r.stdout)
                if "lease" in f["detail"]
            ]
            for r in (before, after, session)
        ]
        assert judged[0] == judged[1]
        assert judged[0] != judged[2]

    def test_key_before_status_filters(self, dsn, key):
        """`jobrun --key K status` shows K only (it used to list every key)."""
        other = f"{key}-other"
        assert jobrun_cli.run("--key", other, "--", "true", dsn=dsn).returncode == 0
        result = jobrun_cli.run("--key", key, "status", "--json", dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert [row["key"] for row in json.loads(result.stdout)] == [key]

    def test_key_before_history(self, dsn, key):
        """`jobrun --key K history` is `jobrun history K`."""
        assert jobrun_cli.run("--key", key, "--", "true", dsn=dsn).returncode == 0
        result = jobrun_cli.run("--key", key, "history", "--json", dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert len(json.loads(result.stdout)) == 1

    def test_key_before_drill_is_its_key(self, jobrun_here):
        """`jobrun --key K drill` does not say "Missing option '--key'"."""
        result = jobrun_here.run(
            "--key", "drill-before", "--dsn", CLOSED, "--connect-timeout", "1s", "drill", dsn=None
        )
        assert result.returncode == 69, result.stderr
        assert "Missing option" not in result.stderr

    def test_drill_reads_jobrun_mode(self, jobrun_here):
        """JOBRUN_MODE configures the drill as it configures a run and doctor."""
        result = jobrun_here.run(
            "drill", "--key", "drill-env", "--dsn", CLOSED, dsn=None, env={"JOBRUN_MODE": "bogus"}
        )
        assert result.returncode == 64, result.stderr
        assert "JOBRUN_MODE" in result.stderr


class TestRunOptionsBeforeSubcommand:
    """Options that only a run has are refused before a subcommand, naming where they go."""

    @pytest.mark.parametrize(
        ("option", "subcommand"),
        [
            (["--wait", "5s"], ["status"]),
            (["--log-file", "jobrun-never.log"], ["status"]),
            (["--log-format", "json"], ["doctor"]),
            (["--no-history"], ["history", "k"]),
            (["--dsn", CLOSED], ["key", "a"]),
            (["--timeout", "5s"], ["overlap", "--first", "true", "--second", "true"]),
            (["--key", "a"], ["doctor"]),
            (["--lock-id", "5"], ["drill"]),
            (["--pass-env", "HOME"], ["status"]),  # misplaced, before its value is judged
        ],
        ids=lambda value: value[0],
    )
    def test_refused_with_exit_64(self, dsn, option, subcommand):
        """Exit 64, one line naming the option and the subcommand."""
        result = jobrun_cli.run(*option, *subcommand, dsn=dsn)
        assert result.returncode == 64, result.stdout + result.stderr
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert option[0] in lines[0]
        assert subcommand[0] in lines[0]

    def test_the_rule_is_in_help(self, jobrun_here):
        """`jobrun --help` states the rule."""
        result = jobrun_here.run("--help", dsn=None)
        assert "before a subcommand applies to it" in " ".join(result.stdout.split())


class TestEnvironment:
    """Errors from variables name the variable; run-only variables leave subcommands alone."""

    @pytest.mark.parametrize(
        ("variable", "value"),
        [
            ("JOBRUN_WAIT", "abc"),
            ("JOBRUN_MODE", "sometimes"),
            ("JOBRUN_SKIP_EXIT_CODE", "300"),
            ("JOBRUN_HEARTBEAT", "1ms"),
            ("JOBRUN_KEY", "a\u202eb"),
            ("JOBRUN_LOCK_ID", "x"),
            ("JOBRUN_CONNECT_TIMEOUT", "later"),
        ],
    )
    def test_error_names_the_variable(self, jobrun_here, variable, value):
        """A bad value from JOBRUN_X is reported as JOBRUN_X (exit 64)."""
        env = {variable: value}
        args = [] if variable in ("JOBRUN_KEY", "JOBRUN_LOCK_ID") else ["--key", "k"]
        if variable == "JOBRUN_KEY":
            args = []
        result = jobrun_here.run(*args, "--", "true", dsn=CLOSED, env=env)
        assert result.returncode == 64, result.stderr
        assert variable in result.stderr

    @pytest.mark.parametrize(
        "variables",
        [
            {"JOBRUN_WAIT": "abc"},
            {"JOBRUN_MODE": "sometimes"},
            {"JOBRUN_SKIP_EXIT_CODE": "abc"},
            {"JOBRUN_TTL": "1ms", "JOBRUN_KILL_AFTER": "1h"},
            {"JOBRUN_KEY": "\u200b"},
            {"JOBRUN_ON_ALERT": "'unbalanced"},
        ],
        ids=",".join,
    )
    def test_run_variables_do_not_break_key_or_status(self, dsn, variables):
        """`jobrun key` and `jobrun status` ignore what only configures a run."""
        assert jobrun_cli.run("key", "a", dsn=None, env=variables).returncode == 0
        result = jobrun_cli.run("status", dsn=dsn, env=variables)
        assert result.returncode == 0, result.stderr

    def test_help_shows_each_variable(self, jobrun_here):
        """Every option with a variable shows it in --help."""
        result = jobrun_here.run("--help", dsn=None)
        text = " ".join(result.stdout.split())
        for param in cli.params:
            envvar = getattr(param, "envvar", None)
            if envvar:
                assert envvar in text, envvar
