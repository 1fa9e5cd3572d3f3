"""``jobrun doctor`` against real servers: what it finds, how it exits, what it never prints."""

from __future__ import annotations

import json
import math
from typing import TYPE_CHECKING, Any

import click
import psycopg
import pytest
from click.testing import CliRunner
from psycopg import sql as pgsql
from psycopg.conninfo import make_conninfo

from harness import jobrun_cli
from jobrun.cli.ops import doctor_command
from jobrun.exitcodes import LockStoreUnavailable
from jobrun.history.schema import ensure as ensure_schema
from jobrun.ops.doctor.capacity import LOCK_TABLE_FAIL, LOCK_TABLE_WARN

if TYPE_CHECKING:
    from collections.abc import Callable


@pytest.fixture
def doctor() -> Callable[..., click.testing.Result]:
    """``doctor(dsn, *args) -> Result``: ``jobrun doctor`` on a throwaway group, in-process."""
    group = click.Group(commands=[doctor_command])
    runner = CliRunner()

    def invoke(dsn: str, *args: str) -> click.testing.Result:
        return runner.invoke(
            group, ["doctor", *args], env={"JOBRUN_DSN": dsn}, standalone_mode=False
        )

    return invoke


def findings(result: click.testing.Result) -> dict[str, dict[str, Any]]:
    """The --json report by check name."""
    assert result.exception is None, result.output
    return {row["check"]: row for row in json.loads(result.stdout)}


class TestReport:
    """One line per check, OK / WARN / FAIL, and an exit status that follows them."""

    def test_every_check_is_one_line_with_a_status(self, doctor, dsn):
        """Each line starts with OK, NOTE, WARN or FAIL; the expected checks are all there."""
        result = doctor(dsn)
        lines = result.stdout.splitlines()
        assert {line.split()[0] for line in lines} <= {"OK", "NOTE", "WARN", "FAIL"}
        checks = {line.split()[1] for line in lines}
        assert {
            "connection",
            "server",
            "role",
            "schema",
            "pooler",
            "idle_session_timeout",
            "idle_in_transaction_session_timeout",
            "connections",
            "advisory",
            "lock",
            "default_transaction_read_only",
            "statement_timeout",
            "log_lock_waits",
            "deadlock_timeout",
            "log_line_prefix",
        } <= checks

    def test_exit_status_is_0_without_a_fail(self, doctor, dsn):
        """Warnings (a superuser, for one) do not fail the run."""
        result = doctor(dsn, "--json")
        assert "FAIL" not in {row["status"] for row in findings(result).values()}
        assert result.return_value == 0

    def test_connection_names_the_server_without_the_password(self, doctor, dsn):
        """host:port/dbname and the user; a password in the DSN is never printed."""
        result = doctor(dsn + " password=hunter2secret", "--json")
        assert "hunter2secret" not in result.output
        detail = findings(result)["connection"]["detail"]
        assert "/jobrun_test_" in detail

    def test_unreachable_is_lockstore_unavailable(self, doctor):
        """No server: LockStoreUnavailable (one line, exit 69), the password masked."""
        result = doctor("host=127.0.0.1 port=1 dbname=x password=hunter2secret")
        assert isinstance(result.exception, LockStoreUnavailable)
        assert result.exception.exit_code == 69
        assert "hunter2secret" not in str(result.exception)
        assert result.stdout == ""


class TestSchemaAndPrivileges:
    """Whether jobrun's tables exist or can be created, for this role and mode."""

    def test_missing_schema_that_can_be_created_is_ok(self, doctor, fresh_dsn):
        """A superuser on a fresh database: the schema will be created on first use."""
        row = findings(doctor(fresh_dsn, "--json"))["schema"]
        assert row["status"] == "OK"
        assert "first use" in row["detail"]

    def test_lease_mode_fails_when_nothing_can_be_created(self, doctor, fresh_dsn, role):
        """No schema and no CREATE on the database: FAIL in lease mode, exit 1."""
        limited = role(database_dsn=fresh_dsn)
        result = doctor(limited, "--mode", "lease", "--json")
        assert findings(result)["schema"]["status"] == "FAIL"
        assert result.return_value == 1

    def test_session_mode_only_warns_when_nothing_can_be_created(self, doctor, fresh_dsn, role):
        """The same in session mode: WARN (only the history is lost), exit 0."""
        limited = role(database_dsn=fresh_dsn)
        result = doctor(limited, "--json")
        assert findings(result)["schema"]["status"] == "WARN"
        assert result.return_value == 0

    def test_missing_privileges_on_runs_are_a_warn(self, doctor, fresh_dsn, role):
        """jobrun.runs readable but not writable: WARN naming what is missing."""
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            ensure_schema(conn)
        limited = role(
            "GRANT USAGE ON SCHEMA jobrun TO {role}",
            "GRANT SELECT ON jobrun.runs TO {role}",
            database_dsn=fresh_dsn,
        )
        row = findings(doctor(limited, "--json"))["jobrun.runs"]
        assert row["status"] == "WARN"
        assert "INSERT, UPDATE, DELETE" in row["detail"]

    def test_operators_tables_without_grants_are_named(self, doctor, fresh_dsn, role):
        """Only runs granted: stop_requests, pauses, expectations each a WARN."""
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            ensure_schema(conn)
        limited = role(
            "GRANT USAGE ON SCHEMA jobrun TO {role}",
            "GRANT SELECT, INSERT, UPDATE, DELETE ON jobrun.runs TO {role}",
            database_dsn=fresh_dsn,
        )
        rows = findings(doctor(limited, "--json"))
        assert rows["jobrun.runs"]["status"] == "OK"
        for table, consequence in (
            ("stop_requests", "jobrun stop"),
            ("pauses", "jobrun pause"),
            ("expectations", "--expect-every"),
        ):
            row = rows[f"jobrun.{table}"]
            assert row["status"] == "WARN", row
            assert "lacks SELECT, INSERT, UPDATE, DELETE" in row["detail"], row
            assert consequence in row["detail"], row

    def test_a_superuser_is_a_warn(self, doctor, dsn):
        """Running jobs as a superuser is flagged."""
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT rolsuper FROM pg_roles WHERE rolname = current_user")
            superuser = row.fetchone()
        if not (superuser and superuser[0]):
            pytest.skip("the test server's role is not a superuser")
        assert findings(doctor(dsn, "--json"))["role"]["status"] == "WARN"

    def test_a_plain_role_is_ok(self, doctor, role):
        """A role that is neither superuser nor privileged: OK."""
        row = findings(doctor(role(), "--json"))["role"]
        assert row["status"] == "OK"
        assert "not a superuser" in row["detail"]


class TestRolesThatCannotWork:
    """Role settings that break jobrun are named, and a check that cannot run never passes."""

    def test_a_read_only_role_fails_lease_mode(self, doctor, fresh_dsn, role):
        """default_transaction_read_only = on: FAIL in lease mode, naming the setting; exit 1."""
        limited = role(
            "ALTER ROLE {role} SET default_transaction_read_only = on", database_dsn=fresh_dsn
        )
        result = doctor(limited, "--mode", "lease", "--json")
        rows = findings(result)
        assert rows["default_transaction_read_only"]["status"] == "FAIL"
        assert "lease" in rows["default_transaction_read_only"]["detail"]
        assert rows["schema"]["status"] == "FAIL"
        assert "read-only" in rows["schema"]["detail"]
        assert result.return_value == 1

    def test_a_read_only_role_warns_session_mode(self, doctor, fresh_dsn, role):
        """The same role in session mode: runs work, history and --once-per do not: WARN."""
        limited = role(
            "ALTER ROLE {role} SET default_transaction_read_only = on", database_dsn=fresh_dsn
        )
        result = doctor(limited, "--json")
        row = findings(result)["default_transaction_read_only"]
        assert row["status"] == "WARN"
        assert "--once-per" in row["detail"]
        assert findings(result)["schema"]["status"] == "WARN"

    def test_a_one_millisecond_statement_timeout_is_named(self, doctor, fresh_dsn, role):
        """statement_timeout = 1 ms: every check still runs, and the setting is the finding."""
        limited = role("ALTER ROLE {role} SET statement_timeout = 1", database_dsn=fresh_dsn)
        session = doctor(limited, "--json")
        rows = findings(session)
        assert not [row for row in rows.values() if "could not check" in row["detail"]], rows
        assert rows["statement_timeout"]["status"] == "WARN"
        assert "1ms" in rows["statement_timeout"]["detail"]
        lease = doctor(limited, "--mode", "lease", "--json")
        assert findings(lease)["statement_timeout"]["status"] == "FAIL"
        assert lease.return_value == 1

    def test_a_check_that_cannot_run_is_unknown_and_fails(self, doctor, fresh_dsn, role):
        """Check queries refused (catalog access revoked): UNKNOWN lines, exit 1, never OK."""
        limited = role(
            "REVOKE SELECT ON pg_catalog.pg_settings FROM PUBLIC",
            "REVOKE EXECUTE ON FUNCTION pg_catalog.current_setting(text) FROM PUBLIC",
            "REVOKE EXECUTE ON FUNCTION pg_catalog.current_setting(text, boolean) FROM PUBLIC",
            "REVOKE EXECUTE ON FUNCTION pg_catalog.pg_is_in_recovery() FROM PUBLIC",
            database_dsn=fresh_dsn,
        )
        result = doctor(limited, "--json")
        rows = findings(result)
        unknown = {name for name, row in rows.items() if row["status"] == "UNKNOWN"}
        assert {"server", "session defaults", "idle timeouts", "connections"} <= unknown
        assert all("could not check" in rows[name]["detail"] for name in unknown)
        assert result.return_value == 1
        text = doctor(limited)
        assert any(line.startswith("UNKNOWN  server") for line in text.stdout.splitlines())
        assert text.return_value == 1


class TestDeadlockLogging:
    """Whether the server log can confirm a deadlock and name both jobs: NOTE, never FAIL."""

    def test_missing_forensics_settings_are_notes(self, doctor, private_server_factory):
        """log_lock_waits, log_connections, log_disconnections off, no %a: NOTE lines, exit 0."""
        server = private_server_factory({"log_lock_waits": "off", "log_connections": "off"})
        result = doctor(server.dsn(), "--json")
        rows = findings(result)
        for name in ("log_lock_waits", "log_connections", "log_disconnections", "log_line_prefix"):
            assert rows[name]["status"] == "NOTE", rows[name]
        assert "%a" in rows["log_line_prefix"]["detail"]
        assert rows["deadlock_timeout"]["status"] == "OK"
        assert result.return_value == 0

    def test_forensics_settings_in_place_are_ok(self, doctor, private_server_factory):
        """log_lock_waits, log_(dis)connections, %a and a usual deadlock_timeout: all OK."""
        server = private_server_factory(
            {
                "log_lock_waits": "on",
                "log_connections": "on",
                "log_disconnections": "on",
                "log_line_prefix": "%m [%p] %q%u@%d %a ",
                "deadlock_timeout": "200ms",
            }
        )
        rows = findings(doctor(server.dsn(), "--json"))
        names = ("log_lock_waits", "log_connections", "log_disconnections", "log_line_prefix")
        for name in (*names, "deadlock_timeout"):
            assert rows[name]["status"] == "OK", rows[name]


class TestSettings:
    """Settings that endanger held sessions, as a fresh session sees them."""

    def test_a_role_level_idle_session_timeout_is_reported(self, doctor, dsn, role):
        """ALTER ROLE ... SET idle_session_timeout shows, with why it is harmless here."""
        limited = role()
        user = psycopg.conninfo.conninfo_to_dict(limited)["user"]
        with psycopg.connect(dsn, autocommit=True) as conn:
            if conn.info.server_version < 140000:
                pytest.skip("idle_session_timeout is new in PostgreSQL 14")
            conn.execute(
                pgsql.SQL("ALTER ROLE {} SET idle_session_timeout = '1min'").format(
                    pgsql.Identifier(str(user))
                )
            )
        row = findings(doctor(limited, "--json"))["idle_session_timeout"]
        assert "1min" in row["detail"]
        assert "sets it to 0" in row["detail"]

    def test_a_standby_fails(self, doctor, private_server):
        """A standby's locks are its own: FAIL, and the way out named."""
        private_server.become_standby()
        result = doctor(private_server.dsn(), "--json")
        row = findings(result)["server"]
        assert row["status"] == "FAIL"
        assert "standby" in row["detail"]
        assert "target_session_attrs=read-write" in row["detail"]
        assert result.return_value == 1

    def test_long_server_keepalives_are_a_note_not_a_warning(self, doctor, private_server_factory):
        """Default keepalives over TCP: OK, because the lock session sets its own."""
        server = private_server_factory({"tcp_keepalives_idle": "7200"})
        tcp = make_conninfo(server.dsn(), host="127.0.0.1")
        row = findings(doctor(tcp, "--json"))["tcp keepalives"]
        assert row["status"] == "OK"
        assert "sets its own" in row["detail"]
        lease = findings(doctor(tcp, "--mode", "lease", "--json"))["tcp keepalives"]
        assert lease["status"] == "OK"

    def test_short_server_keepalives_are_ok(self, doctor, private_server_factory):
        """tcp_keepalives_idle 30, interval 5, count 3: OK."""
        server = private_server_factory(
            {
                "tcp_keepalives_idle": "30",
                "tcp_keepalives_interval": "5",
                "tcp_keepalives_count": "3",
            }
        )
        tcp = make_conninfo(server.dsn(), host="127.0.0.1")
        row = findings(doctor(tcp, "--json"))["tcp keepalives"]
        assert row["status"] == "OK"
        assert "45s" in row["detail"]


class TestCapacity:
    """Connection headroom and the shared lock table."""

    def test_advisory_locks_held_by_jobrun_sessions_are_counted(self, doctor, fresh_dsn, key):
        """Two locks held by a session named jobrun:<key>: counted as jobrun's."""
        with psycopg.connect(fresh_dsn, autocommit=True, application_name=f"jobrun:{key}") as c:
            c.execute("SELECT pg_advisory_lock(%s), pg_advisory_lock(%s)", (1, -2))
            row = findings(doctor(fresh_dsn, "--json"))["advisory locks"]
        assert row["detail"].startswith("2 held in this database now, 2 of them by jobrun")

    def test_lock_table_capacity_is_reported(self, doctor, dsn):
        """The capacity formula's result and the share advisory locks take."""
        with psycopg.connect(dsn) as conn:
            row = conn.execute(
                "SELECT current_setting('max_locks_per_transaction')::int"
                " * (current_setting('max_connections')::int"
                " + current_setting('max_prepared_transactions')::int)"
            ).fetchone()
        assert row is not None
        finding = findings(doctor(dsn, "--json"))["lock table"]
        assert f"room for about {row[0]} locks" in finding["detail"]

    @pytest.mark.parametrize(
        ("share", "status"),
        [(LOCK_TABLE_WARN / 2, "OK"), (LOCK_TABLE_WARN, "WARN"), (LOCK_TABLE_FAIL, "FAIL")],
    )
    def test_a_filling_lock_table_warns_then_fails(
        self, doctor, private_server_factory, share, status
    ):
        """Advisory locks taking half the lock table: WARN; nine tenths: FAIL."""
        # A small lock table (10 x (20 + 0) = 200 locks), so filling it costs nothing.
        server = private_server_factory(
            {"max_locks_per_transaction": "10", "max_connections": "20"}
        )
        dsn = server.dsn()
        capacity = 10 * 20
        with psycopg.connect(dsn, autocommit=True) as holder:
            holder.execute(
                "SELECT count(pg_advisory_lock(g)) FROM generate_series(1, %s) AS g",
                (math.ceil(capacity * share),),
            )
            finding = findings(doctor(dsn, "--json"))["lock table"]
        assert f"room for about {capacity} locks" in finding["detail"]
        assert finding["status"] == status

    def test_connection_headroom_is_reported(self, doctor, dsn):
        """In use, reserved and free connection slots."""
        finding = findings(doctor(dsn, "--json"))["connections"]
        assert finding["status"] in {"OK", "WARN"}
        assert " free" in finding["detail"]


class TestPooler:
    """A transaction pooler fails session mode and is fine for lease mode."""

    def test_transaction_pooler_fails_session_mode(self, doctor, pgbouncer, pg_address, dsn):
        """Through PgBouncer in transaction mode: FAIL and exit 1 in session mode."""
        bouncer = pgbouncer(*pg_address, pool_mode="transaction")
        through = bouncer.dsn_for(dsn)
        result = doctor(through, "--json")
        assert findings(result)["pooler"]["status"] == "FAIL"
        assert result.return_value == 1

    def test_transaction_pooler_is_fine_for_lease_mode(self, doctor, pgbouncer, pg_address, dsn):
        """The same pooler in lease mode: OK."""
        bouncer = pgbouncer(*pg_address, pool_mode="transaction")
        through = bouncer.dsn_for(dsn)
        assert findings(doctor(through, "--mode", "lease", "--json"))["pooler"]["status"] == "OK"

    def test_direct_connection_is_ok(self, doctor, dsn):
        """No pooler: OK."""
        assert findings(doctor(dsn, "--json"))["pooler"]["status"] == "OK"


class TestWiredThroughCli:
    """``python -m jobrun doctor``: the subcommands wired into the group."""

    def test_doctor_exits_0_through_the_real_cli(self, dsn):
        """A healthy database: exit 0, one line per check."""
        result = jobrun_cli.run("doctor", dsn=dsn)
        assert result.returncode == 0, result.stderr
        assert result.stdout.splitlines()[0].startswith("OK    connection")

    def test_doctor_unreachable_exits_69_with_one_line(self, jobrun_here):
        """No database: exit 69, one line on stderr, the password masked."""
        result = jobrun_here.run(
            "doctor", dsn="host=127.0.0.1 port=1 password=hunter2secret connect_timeout=2"
        )
        assert result.returncode == 69
        (line,) = result.stderr.strip().splitlines()
        assert "hunter2secret" not in line
