"""A hostile peer on the same database: its own search_path, its own operators, a squatted lock."""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass

import psycopg
import pytest
from psycopg.conninfo import conninfo_to_dict

from harness import jobrun_cli
from harness.jobrun_cli import wait_for_file
from jobrun.keys import lock_id_for

#: The victims' heartbeat: short, so a run that lost its lock would notice within the test.
HEARTBEAT = "200ms"

#: Operators a peer defines in a schema of its own, each answering "yes" to anything: with
#: that schema first on its search_path, any unqualified ``LIKE``, ``=`` or ``<>`` that
#: PostgreSQL resolves while checking the peer's statements is the peer's.
HIJACK = """
CREATE FUNCTION {s}.yes(text, text) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT true';
CREATE FUNCTION {s}.yes(name, text) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT true';
CREATE FUNCTION {s}.yes(bigint, bigint) RETURNS boolean LANGUAGE sql IMMUTABLE AS 'SELECT true';
CREATE OPERATOR {s}.~~ (LEFTARG = text, RIGHTARG = text, FUNCTION = {s}.yes);
CREATE OPERATOR {s}.= (LEFTARG = text, RIGHTARG = text, FUNCTION = {s}.yes);
CREATE OPERATOR {s}.= (LEFTARG = name, RIGHTARG = text, FUNCTION = {s}.yes);
CREATE OPERATOR {s}.= (LEFTARG = bigint, RIGHTARG = bigint, FUNCTION = {s}.yes);
CREATE OPERATOR {s}.<> (LEFTARG = text, RIGHTARG = text, FUNCTION = {s}.yes);
"""


@dataclass(frozen=True)
class Tenancy:
    """A database after ``jobrun init``: team_a granted a-*, team_b b-* with a schema of its own."""

    owner: str
    a: str
    b: str
    b_schema: str

    @staticmethod
    def role_of(dsn: str) -> str:
        """The role a DSN logs in as."""
        return str(conninfo_to_dict(dsn)["user"])

    def hijacked(self) -> psycopg.Connection[tuple[object, ...]]:
        """team_b's session with its own operators first on its search_path."""
        conn = psycopg.connect(self.b, autocommit=True)
        conn.execute(f"SET search_path = {self.b_schema}, pg_catalog")
        return conn


def _ok(result) -> None:
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.fixture
def tenancy(fresh_dsn, role) -> Tenancy:
    """``jobrun init``; team_a granted a-*; team_b granted b-*, owning schema ``team_b_…``."""
    _ok(jobrun_cli.run("init", dsn=fresh_dsn))
    team_a = role(database_dsn=fresh_dsn)
    schema = f"team_b_{uuid.uuid4().hex[:8]}"
    team_b = role(f"CREATE SCHEMA {schema} AUTHORIZATION {{role}}", database_dsn=fresh_dsn)
    _ok(jobrun_cli.run("grant", Tenancy.role_of(team_a), "--keys", "a-*", dsn=fresh_dsn))
    _ok(jobrun_cli.run("grant", Tenancy.role_of(team_b), "--keys", "b-*", dsn=fresh_dsn))
    with psycopg.connect(team_b, autocommit=True) as conn:
        conn.execute(HIJACK.format(s=schema))
    return Tenancy(owner=fresh_dsn, a=team_a, b=team_b, b_schema=schema)


def _victim(tenancy: Tenancy, mode: str, marker, key: str = "a-victim"):
    """A guarded run of team_a whose child writes ``marker`` and sleeps."""
    proc = jobrun_cli.start(
        "--key", key, "--mode", mode, "--heartbeat", HEARTBEAT, "--",
        *jobrun_cli.holder_marker(marker), dsn=tenancy.a,
    )  # fmt: skip
    wait_for_file(marker, proc=proc)
    return proc


def _refused(conn: psycopg.Connection[tuple[object, ...]], statement: str, params=None) -> str:
    """The SQLSTATE with which ``statement`` failed (the test fails if it went through)."""
    try:
        conn.execute(statement, params)
    except psycopg.Error as exc:
        return str(exc.sqlstate)
    pytest.fail(f"went through: {statement}")


class TestOperatorsOfThePeer:
    """team_b's own LIKE, = and <> first on its search_path bend none of the policies."""

    def test_deleting_team_a_lease_deletes_nothing(self, tenancy, tmp_path):
        """DELETE of team_a's running lease, under hijacked operators: 0 rows, the run goes on."""
        proc = _victim(tenancy, "lease", tmp_path / "child")
        try:
            with tenancy.hijacked() as conn:
                deleted = conn.execute("DELETE FROM jobrun.leases WHERE key = 'a-victim'").rowcount
            assert deleted == 0
            again = jobrun_cli.run(
                "--key", "a-victim", "--mode", "lease", "--", "true", dsn=tenancy.a
            )
            assert again.returncode == 75, again.stderr
            assert proc.poll() is None
        finally:
            jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)

    def test_team_a_history_and_output_stay_unread(self, tenancy):
        """Hijacked operators read none of team_a's rows, kept output included."""
        failed = jobrun_cli.run(
            "--key", "a-kept", "--keep-output", "4KiB", "--",
            "sh", "-c", "echo secret-output; exit 3", dsn=tenancy.a,
        )  # fmt: skip
        assert failed.returncode == 3, failed.stderr
        with psycopg.connect(tenancy.owner) as conn:
            kept = conn.execute("SELECT count(stdout_tail) FROM jobrun.runs").fetchone()
        assert kept == (1,)
        with tenancy.hijacked() as conn:
            rows = conn.execute("SELECT key, stdout_tail FROM jobrun.runs").fetchall()
        assert rows == []

    def test_a_forged_success_is_refused(self, tenancy):
        """A ``succeeded`` row under team_a's key, under hijacked operators: refused."""
        with tenancy.hijacked() as conn:
            state = _refused(
                conn,
                "INSERT INTO jobrun.runs (run_id, key, lock_ids, mode, host, pid, started_at, "
                "outcome) VALUES (gen_random_uuid(), 'a-once', ARRAY[%s]::int8[], 'session', "
                "'h', 1, clock_timestamp(), 'succeeded')",
                (lock_id_for("a-once"),),
            )
        assert state == "42501"

    def test_a_pause_of_team_a_key_is_refused(self, tenancy):
        """A pause row under team_a's key, under hijacked operators: refused."""
        with tenancy.hijacked() as conn:
            state = _refused(
                conn,
                "INSERT INTO jobrun.pauses (key, host, username, pid) "
                "VALUES ('a-victim', 'h', 'u', 1)",
            )
        assert state == "42501"

    def test_a_lease_on_team_a_lock_id_is_refused(self, tenancy):
        """A lease under team_b's key on team_a's lock id (hijacked bigint =): refused."""
        with tenancy.hijacked() as conn:
            state = _refused(
                conn,
                "INSERT INTO jobrun.leases (lock_id, key, owner, host, pid, acquired_at, "
                "renewed_at, expires_at) VALUES (%s, 'b-mine', gen_random_uuid(), 'h', 1, "
                "clock_timestamp(), clock_timestamp(), clock_timestamp() + interval '1 year')",
                (lock_id_for("a-free"),),
            )
        assert state == "42501"
        _ok(jobrun_cli.run("--key", "a-free", "--mode", "lease", "--", "true", dsn=tenancy.a))


class TestVictimSearchPath:
    """A peer's function in a schema on the victim's search_path is never called by jobrun."""

    @pytest.fixture
    def trapped(self, tenancy) -> Tenancy:
        """``public`` open to all (as before PostgreSQL 15), with a peer's ``unnest(bigint[])``.

        The trap records who called it in ``public.stolen`` (exact types beat pg_catalog's
        polymorphic ``unnest(anyarray)``, wherever pg_catalog sits on the path).
        """
        with psycopg.connect(tenancy.owner, autocommit=True) as conn:
            conn.execute("GRANT CREATE ON SCHEMA public TO PUBLIC")
        with psycopg.connect(tenancy.b, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE public.stolen (who text);"
                "GRANT INSERT ON public.stolen TO PUBLIC;"
                "CREATE FUNCTION public.unnest(bigint[]) RETURNS SETOF bigint LANGUAGE sql AS "
                "$$ INSERT INTO public.stolen SELECT current_user; "
                "SELECT pg_catalog.unnest($1) $$"
            )
        return tenancy

    @staticmethod
    def _stolen(tenancy: Tenancy) -> list[tuple[object, ...]]:
        with psycopg.connect(tenancy.owner) as conn:
            return conn.execute("SELECT who FROM public.stolen").fetchall()

    @pytest.mark.parametrize("mode", ["session", "lease"])
    def test_a_run_never_calls_the_trap(self, trapped, mode):
        """A guarded run, its history and its release call only PostgreSQL's own functions."""
        _ok(jobrun_cli.run("--key", "a-trap", "--mode", mode, "--", "true", dsn=trapped.a))
        assert self._stolen(trapped) == []

    @pytest.mark.parametrize("mode", ["session", "lease"])
    def test_the_cron_options_never_call_the_trap(self, trapped, mode):
        """--coalesce, --retries, --warn-after auto, --requires, --tz: PostgreSQL's own only.

        A second trap takes ``unnest(text[])``, which --requires' statement unnests.
        """
        with psycopg.connect(trapped.b, autocommit=True) as conn:
            conn.execute(
                "CREATE FUNCTION public.unnest(text[]) RETURNS SETOF text LANGUAGE sql AS "
                "$$ INSERT INTO public.stolen SELECT current_user; "
                "SELECT pg_catalog.unnest($1) $$"
            )
        key = f"a-cron-{mode}"
        _ok(jobrun_cli.run("--key", key, "--mode", mode, "--", "true", dsn=trapped.a))
        options = (
            ("--coalesce", "--retries", "1", "--retry-delay", "10ms", "--jitter", "10ms"),
            ("--warn-after", "auto", "--requires", key, "--once-per", "1h"),
            ("--once-per", "1d", "--tz", "Europe/Berlin"),
        )
        for extra in options:
            ran = jobrun_cli.run("--key", key, "--mode", mode, *extra, "--", "true", dsn=trapped.a)
            assert ran.returncode in {0, 75}, ran.stderr
        _ok(jobrun_cli.run("history", key, dsn=trapped.a))
        assert self._stolen(trapped) == []

    def test_status_never_calls_the_trap(self, trapped):
        """``status`` of team_a's keys calls only PostgreSQL's own functions."""
        _ok(jobrun_cli.run("--key", "a-trap", "--mode", "lease", "--", "true", dsn=trapped.a))
        _ok(jobrun_cli.run("status", dsn=trapped.a))
        assert self._stolen(trapped) == []


class TestSquattedLease:
    """A role with no grant holding a key's advisory lock id does not make lease runs skip."""

    def test_a_connect_only_squatter_is_ignored_by_lease_mode(self, tenancy, role, tmp_path):
        """A CONNECT-only role's pg_advisory_lock on a-victim's id: the lease run still runs."""
        squatter = role(database_dsn=tenancy.owner)
        with psycopg.connect(squatter, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (lock_id_for("a-victim"),))
            marker = tmp_path / "ran"
            result = jobrun_cli.run(
                "--key", "a-victim", "--mode", "lease", "--", "touch", str(marker), dsn=tenancy.a
            )
            assert result.returncode == 0, result.stderr
            assert marker.exists()

    def test_a_granted_session_run_still_keeps_lease_mode_out(self, tenancy, tmp_path):
        """team_a's own session-mode run of a-victim: a lease-mode run of it skips (75)."""
        proc = _victim(tenancy, "session", tmp_path / "child")
        try:
            result = jobrun_cli.run(
                "--key", "a-victim", "--mode", "lease", "--", "true", dsn=tenancy.a
            )
            assert result.returncode == 75, result.stderr
        finally:
            jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)

    def test_a_squatted_lease_run_keeps_session_mode_out(self, tenancy, role, tmp_path):
        """While a lease run goes on past a squatter, team_a's session-mode run skips."""
        squatter = role(database_dsn=tenancy.owner)
        with psycopg.connect(squatter, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (lock_id_for("a-victim"),))
            proc = _victim(tenancy, "lease", tmp_path / "child")
            try:
                conn.execute("SELECT pg_advisory_unlock_all()")
                result = jobrun_cli.run(
                    "--key", "a-victim", "--mode", "session", "--", "true", dsn=tenancy.a
                )
                assert result.returncode == 75, result.stderr
            finally:
                jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)


class TestUngrantedKeys:
    """After ``jobrun init``, a run of a key the role was not granted never starts its child."""

    @pytest.mark.parametrize("mode", ["session", "lease"])
    def test_a_key_of_another_team_is_refused_before_the_child(self, tenancy, mode, tmp_path):
        """team_a running b-nightly: exit 69, one line naming the grant, the child never ran."""
        marker = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key", "b-nightly", "--mode", mode, "--", "touch", str(marker), dsn=tenancy.a
        )
        assert result.returncode == 69, result.stderr
        assert not marker.exists()
        assert "jobrun grant" in result.stderr
        assert "b-nightly" in result.stderr

    def test_on_db_error_run_does_not_run_an_ungranted_key(self, tenancy, tmp_path):
        """``--on-db-error run`` is for an unreachable server, not for a refusal."""
        marker = tmp_path / "ran"
        result = jobrun_cli.run(
            "--key", "b-nightly", "--on-db-error", "run", "--", "touch", str(marker),
            dsn=tenancy.a,
        )  # fmt: skip
        assert result.returncode == 69, result.stderr
        assert not marker.exists()


def _named_key_whose_id_starts_with(digit: str) -> str:
    """A key name a-N whose lock id, written in decimal, starts with ``digit``."""
    return next(
        name
        for name in (f"a-{n}" for n in range(10_000))
        if str(lock_id_for(name)).startswith(digit)
    )


class TestLockIdGrants:
    """A ``lock-id:`` grant never reaches the lock id of a named key."""

    def test_a_lock_id_range_grant_is_refused(self, tenancy, role):
        """``jobrun grant ROLE --keys 'lock-id:9*'``: exit 64; only exact ids may be granted."""
        team_c = role(database_dsn=tenancy.owner)
        result = jobrun_cli.run(
            "grant", Tenancy.role_of(team_c), "--keys", "lock-id:9*", dsn=tenancy.owner
        )
        assert result.returncode == 64, result.stderr
        assert "exact" in result.stderr

    def test_an_old_range_grant_reaches_no_named_key(self, tenancy, role):
        """A ``lock-id:9*`` row made by an older jobrun lets no lease row onto a named key's id."""
        team_c = role(database_dsn=tenancy.owner)
        _ok(
            jobrun_cli.run(
                "grant", Tenancy.role_of(team_c), "--keys", "lock-id:1", dsn=tenancy.owner
            )
        )
        with psycopg.connect(tenancy.owner, autocommit=True) as conn:
            conn.execute(
                "INSERT INTO jobrun.grants (role, kind, pattern, key_like) "
                "VALUES (%s, 'job', 'lock-id:9*', 'lock-id:9%%')",
                (Tenancy.role_of(team_c),),
            )
        victim = _named_key_whose_id_starts_with("9")
        victim_id = lock_id_for(victim)
        with psycopg.connect(team_c, autocommit=True) as conn:
            state = _refused(
                conn,
                "INSERT INTO jobrun.leases (lock_id, key, owner, host, pid, acquired_at, "
                "renewed_at, expires_at) VALUES (%s, %s, gen_random_uuid(), 'h', 1, "
                "clock_timestamp(), clock_timestamp(), 'infinity')",
                (victim_id, f"lock-id:{victim_id}"),
            )
        assert state == "42501"
        _ok(jobrun_cli.run("--key", victim, "--mode", "lease", "--", "true", dsn=tenancy.a))


class TestUpgradeInPlace:
    """``jobrun init`` on a database initialised by an older jobrun replaces its functions."""

    def test_init_again_replaces_an_unqualified_policy_function(self, tenancy, tmp_path):
        """An old ``patterns()`` with a bare ``=``, then ``jobrun init``: the hijack fails again.

        (The policies look the grants up with ``patterns()``, once per statement.)
        """
        with psycopg.connect(tenancy.owner, autocommit=True) as conn:
            conn.execute(
                "CREATE OR REPLACE FUNCTION jobrun.patterns(need text) "
                "RETURNS text[] LANGUAGE sql STABLE AS $$ SELECT coalesce("
                "pg_catalog.array_agg(g.key_like), '{}') FROM jobrun.grants AS g "
                "JOIN pg_catalog.pg_roles AS r ON r.rolname = g.role "
                "WHERE pg_catalog.pg_has_role(current_user, r.oid, 'MEMBER') $$"
            )
        proc = _victim(tenancy, "lease", tmp_path / "child")
        try:
            with tenancy.hijacked() as conn:
                assert conn.execute("SELECT count(*) FROM jobrun.leases").fetchone() == (1,)
            _ok(jobrun_cli.run("init", dsn=tenancy.owner))
            with tenancy.hijacked() as conn:
                assert conn.execute("SELECT count(*) FROM jobrun.leases").fetchone() == (0,)
        finally:
            jobrun_cli.signal_and_wait(proc, jobrun_cli.SIGTERM)


class TestSquatterNamed:
    """``doctor`` names a session outside jobrun that holds a key's lock id."""

    def test_doctor_names_the_squatter_role(self, tenancy, role):
        """A CONNECT-only role holding a-victim's id: doctor's NOTE names the role and id."""
        squatter = role(database_dsn=tenancy.owner)
        with psycopg.connect(squatter, autocommit=True) as conn:
            conn.execute("SELECT pg_advisory_lock(%s)", (lock_id_for("a-victim"),))
            result = jobrun_cli.run("doctor", "--json", dsn=tenancy.a)
        assert result.returncode in {0, 1}, result.stderr
        found = [
            f for f in json.loads(result.stdout) if f["check"] == "advisory locks outside jobrun"
        ]
        assert len(found) == 1, result.stdout
        assert Tenancy.role_of(squatter) in found[0]["detail"]
        assert str(lock_id_for("a-victim")) in found[0]["detail"]


class TestVictimSearchPathThroughAPooler:
    """Through a transaction pooler that drops start-up options, lease mode calls no trap."""

    def test_a_lease_run_through_pgbouncer_never_calls_the_trap(
        self, fresh_dsn, pgbouncer, pg_address
    ):
        """PgBouncer ignoring ``options``: the run, its history and release stay qualified."""
        with psycopg.connect(fresh_dsn, autocommit=True) as conn:
            conn.execute(
                "CREATE TABLE public.stolen (who text);"
                "CREATE FUNCTION public.unnest(bigint[]) RETURNS SETOF bigint LANGUAGE sql AS "
                "$$ INSERT INTO public.stolen SELECT current_user; "
                "SELECT pg_catalog.unnest($1) $$"
            )
        bouncer = pgbouncer(
            *pg_address, ignore_startup_parameters=("extra_float_digits", "options")
        )
        pooled = bouncer.dsn_for(fresh_dsn)
        for _ in range(2):  # the first run creates jobrun's tables, the second finds them
            _ok(jobrun_cli.run("--key", "a-pooled", "--mode", "lease", "--", "true", dsn=pooled))
        with psycopg.connect(fresh_dsn) as conn:
            assert conn.execute("SELECT who FROM public.stolen").fetchall() == []
            runs = conn.execute("SELECT count(*) FROM jobrun.runs").fetchone()
        assert runs == (2,)
