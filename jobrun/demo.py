"""``jobrun demo``: three real runs of one key, showing a run, a skip and a later run."""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import tempfile
import time
import uuid
from typing import TYPE_CHECKING

import psycopg

from jobrun import db, keys, sql, throwaway
from jobrun.exitcodes import LockStoreUnavailable

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


#: Signs in libpq's message that a server answered and refused us (rather than no server):
#: an error the server sent (its severity) or an authentication request we cannot meet.
_ANSWERED = ("FATAL:", "ERROR:", "fe_sendauth")


@contextlib.contextmanager
def database(target: db.Target, say: Callable[[str], None]) -> Iterator[str]:
    """The configured database when one answers, else a throwaway server for the demo.

    A server that answers but refuses us (no such role or database, wrong password) is
    an error: the demo must not pass on a throwaway server while the real one is misused.
    """
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
        say(
            f"no database answers at {where} (JOBRUN_DSN / PG* variables): "
            "starting a throwaway PostgreSQL"
        )
        with throwaway.server() as private:
            say(f"using the throwaway PostgreSQL at {db.describe(db.Target(dsn=private))}")
            yield private
        say("throwaway PostgreSQL stopped and removed")
        return
    say(f"using the database at {where}")
    yield target.dsn


def run(dsn: str, say: Callable[[str], None], *, connect_timeout: float = 3.0) -> int:
    """Run the demo; 0 when the three runs behave as promised (0, 75, 0)."""
    key = f"demo-{uuid.uuid4().hex[:8]}"
    with database(db.Target(dsn=dsn, connect_timeout=connect_timeout), say) as target:
        # The DSN goes through the environment: a password must not show up in ps.
        env = {**os.environ, "JOBRUN_DSN": target}
        env_args = [sys.executable, "-m", "jobrun", "--key", key, "--log-format", "console"]
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
