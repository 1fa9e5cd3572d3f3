"""``jobrun demo``: three real runs of one key, showing a run, a skip and a later run."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from typing import TYPE_CHECKING

import psycopg

from jobrun import keys, sql, throwaway

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


@contextlib.contextmanager
def database(dsn: str, say: Callable[[str], None]) -> Iterator[str]:
    """The configured database when one answers, else a throwaway server for the demo."""
    try:
        with psycopg.connect(dsn, connect_timeout=3):
            pass
    except psycopg.Error:
        say("no database answers (JOBRUN_DSN / PG* variables): starting a throwaway PostgreSQL")
        with throwaway.server() as private:
            yield private
        say("throwaway PostgreSQL stopped and removed")
        return
    yield dsn


def run(dsn: str, say: Callable[[str], None]) -> int:
    """Run the demo; 0 when the three runs behave as promised (0, 75, 0)."""
    key = f"demo-{uuid.uuid4().hex[:8]}"
    with database(dsn, say) as target:
        # The DSN goes through the environment: a password must not show up in ps.
        env = {**os.environ, "JOBRUN_DSN": target}
        env_args = [sys.executable, "-m", "jobrun", "--key", key, "--log-format", "console"]
        say(f"\n1) jobrun --key {key} -- sleep 3   (takes the lock, runs for 3 seconds)")
        first = subprocess.Popen([*env_args, "--", "sleep", "3"], env=env)
        _wait_until_held(target, key, first)
        say(f"\n2) jobrun --key {key} -- echo never   (same key while the first runs)")
        second = subprocess.run([*env_args, "--", "echo", "never"], env=env, check=False)
        say(f"   -> exit {second.returncode} (75 = skipped: the lock is held)")
        first_status = first.wait()
        say(f"\n   first run -> exit {first_status}")
        say(f"\n3) jobrun --key {key} -- echo hello   (after the first finished)")
        third = subprocess.run([*env_args, "--", "echo", "hello"], env=env, check=False)
        say(f"   -> exit {third.returncode}")
    ok = (first_status, second.returncode, third.returncode) == (0, 75, 0)
    say("\ndemo " + ("passed: one run at a time." if ok else "FAILED"))
    return 0 if ok else 1


def _wait_until_held(dsn: str, key: str, proc: subprocess.Popen[bytes]) -> None:
    classid, objid = keys.from_name(key).pg_locks_pair
    deadline = time.monotonic() + 30
    with psycopg.connect(dsn, autocommit=True) as conn:
        while proc.poll() is None and time.monotonic() < deadline:
            if conn.execute(sql.ADVISORY_HOLDER, (classid, objid)).fetchone():
                return
            time.sleep(0.05)
