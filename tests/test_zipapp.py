"""dist/jobrun.pyz, the one file to copy: built, run with python3 only, its cache kept private."""

from __future__ import annotations

import ctypes.util
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import psycopg
import pytest

from harness import jobrun_cli
from jobrun import keys

ROOT = Path(__file__).resolve().parent.parent
BUILD = ROOT / "tools" / "build_zipapp.py"
DOWNLOAD_FAILED = 3  # tools/build_zipapp.py: a wheel could not be downloaded
#: The interpreter this venv was made from: python3 as a host has it, without our packages.
HOST_PYTHON = getattr(sys, "_base_executable", sys.executable)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def pyz(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The file, built once per test session (wheels come from the build's download cache)."""
    out = tmp_path_factory.mktemp("zipapp") / "jobrun.pyz"
    result = subprocess.run(
        [sys.executable, str(BUILD), "--out", str(out)],
        capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    if result.returncode == DOWNLOAD_FAILED and os.environ.get("CI") != "true":
        pytest.skip(f"the wheels cannot be downloaded here: {result.stderr.strip()}")
    assert result.returncode == 0, result.stdout + result.stderr
    return out


@pytest.fixture(scope="session")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An XDG_CACHE_HOME shared by the runs that only use the file (unpacked once)."""
    return tmp_path_factory.mktemp("cache-home")


def run_pyz(
    pyz: Path, *args: str, dsn: str | None, cache: Path, cwd: Path | None = None,
    python: str = HOST_PYTHON, extra: dict[str, str] | None = None,
) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``python3 jobrun.pyz ARGS...`` with nothing of this checkout on its path."""
    env = jobrun_cli.environment(dsn, {"XDG_CACHE_HOME": str(cache), **(extra or {})})
    env.pop("PYTHONPATH", None)
    return subprocess.run(
        [python, str(pyz), *args], env=env, cwd=cwd or cache, capture_output=True,
        text=True, timeout=180, check=False, stdin=subprocess.DEVNULL,
    )  # fmt: skip


def other_pythons() -> dict[str, str]:
    """Version -> python3.N interpreter on this machine, for each version 3.8 or later but ours."""
    found: dict[str, str] = {}
    places = [Path(p) for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    places += sorted(Path.home().glob(".pyenv/versions/3.*/bin"))
    ours = f"{sys.version_info[0]}.{sys.version_info[1]}"
    for place in places:
        if "shims" in place.parts:
            continue  # pyenv's shims answer for versions that are not selected
        for candidate in sorted(place.glob("python3.*")):
            version = candidate.name.removeprefix("python")
            if re.fullmatch(r"3\.\d+", version) and version != ours and int(version[2:]) >= 8:
                found.setdefault(version, str(candidate))
    return dict(sorted(found.items(), key=lambda item: int(item[0][2:])))


class TestRuns:
    """The file does what the installed jobrun does, with nothing but python3."""

    def test_guarded_run_exits_with_the_child(self, pyz, cache_home, dsn, key):
        """`python3 jobrun.pyz --key K -- true` runs the child under the lock: exit 0."""
        result = run_pyz(pyz, "--key", key, "--", "true", dsn=dsn, cache=cache_home)
        assert result.returncode == 0, result.stderr
        assert jobrun_cli.event(result.stderr, "finished")["outcome"] == "succeeded"

    def test_held_lock_is_a_skip(self, pyz, cache_home, dsn, key, tmp_path):
        """With the key's lock held elsewhere, the run skips (75) and the child never runs."""
        marker = tmp_path / "ran"
        with psycopg.connect(dsn, autocommit=True) as holder:
            holder.execute("SELECT pg_advisory_lock(%s)", (keys.from_name(key).lock_id,))
            result = run_pyz(
                pyz, "--key", key, "--", "touch", str(marker), dsn=dsn, cache=cache_home
            )
        assert result.returncode == 75, result.stderr
        assert jobrun_cli.event(result.stderr, "skipped")
        assert not marker.exists()

    def test_doctor_passes(self, pyz, cache_home, dsn):
        """`jobrun doctor` through the file finds the test database fit (exit 0)."""
        result = run_pyz(pyz, "doctor", dsn=dsn, cache=cache_home)
        assert result.returncode == 0, result.stdout + result.stderr

    def test_demo_starts_its_runs_from_the_file(self, pyz, cache_home, fresh_dsn):
        """The demo's three runs are the file's own, under a python3 that has no jobrun."""
        result = run_pyz(pyz, "demo", dsn=fresh_dsn, cache=cache_home)
        assert result.returncode == 0, result.stdout + result.stderr
        assert "demo passed" in result.stdout

    def test_driver_is_the_bundled_binary(self, pyz, cache_home, dsn, key):
        """psycopg runs on the bundled psycopg-binary, not on whatever libpq the host has."""
        # psycopg fails at its import when told to use psycopg-binary and that cannot load
        result = run_pyz(
            pyz, "--key", key, "--", "true", dsn=dsn, cache=cache_home,
            extra={"PSYCOPG_IMPL": "binary"},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr

    @pytest.mark.parametrize("version", list(other_pythons()) or [None])
    def test_other_python_versions(self, pyz, cache_home, dsn, key, version):
        """Each other python3.N >= 3.10 on this machine runs it too; older ones get one line."""
        if version is None:
            pytest.skip("no other python3.N on this machine")
        python = other_pythons()[version]
        result = run_pyz(pyz, "--key", key, "--", "true", dsn=dsn, cache=cache_home, python=python)
        if int(version[2:]) < 10:
            assert result.returncode == 69
            assert len(result.stderr.splitlines()) == 1, result.stderr
        else:
            assert result.returncode == 0, result.stderr


def without_drivers(pyz: Path, out: Path) -> Path:
    """A copy of the file whose bootstrap knows no bundled driver (as on an unknown machine)."""
    with zipfile.ZipFile(pyz) as source, zipfile.ZipFile(out, "w") as copy:
        for info in source.infolist():
            data = source.read(info)
            if info.filename == "__main__.py":
                text, found = re.subn(r"(?m)^NATIVE: dict\[str, str\] = \{.*\}$",
                                      "NATIVE: dict[str, str] = {}", data.decode())  # fmt: skip
                assert found == 1
                data = text.encode()
            copy.writestr(info, data)
    return out


class TestNoDriverFits:
    """Where no bundled driver fits, the host's libpq serves, or one line says what to do."""

    def test_host_libpq_is_used_when_no_driver_fits(self, pyz, dsn, key, tmp_path):
        """psycopg's pure-Python implementation on the host's libpq: the run works."""
        if ctypes.util.find_library("pq") is None:
            pytest.skip("no libpq on this host")
        copy = without_drivers(pyz, tmp_path / "jobrun.pyz")
        result = run_pyz(
            copy, "--key", key, "--", "true", dsn=dsn, cache=tmp_path,
            extra={"PSYCOPG_IMPL": "python"},
        )  # fmt: skip
        assert result.returncode == 0, result.stderr


def build_id(pyz: Path) -> str:
    """The BUILD_ID the file's bootstrap unpacks under."""
    with zipfile.ZipFile(pyz) as archive:
        found = re.search(r"(?m)^BUILD_ID = ['\"](\w+)['\"]$", archive.read("__main__.py").decode())
    assert found is not None
    return found[1]


def plant_code(cache: Path, build: str, planted: Path) -> None:
    """Modules in ``cache`` where an unpacked copy would be, each recording that it ran."""
    lib = cache / build / "lib"
    native = cache / build / f"cp{sys.version_info[0]}{sys.version_info[1]}-{os.uname().machine}"
    for where, module in [(lib, "jobrun"), (lib, "click"), (native, "psycopg_binary")]:
        (where / module).mkdir(parents=True, exist_ok=True)
        (where / module / "__init__.py").write_text(
            f"open({str(planted)!r}, 'a').write({module!r})\n"
        )
    (lib / f".compiled-{sys.implementation.cache_tag}").touch()


def said_fresh_directory(stderr: str, why: str) -> Path:
    """The new private directory named in the run's one line about the refused one."""
    lines = [line for line in stderr.splitlines() if not line.startswith("{")]
    assert len(lines) == 1, stderr
    assert why in lines[0], lines[0]
    found = re.search(r"new private directory, (/.+)\)$", lines[0])
    assert found is not None, lines[0]
    return Path(found[1])


def python_for_others() -> str:
    """A python3 >= 3.10 that another user (nobody) may run, else skip."""
    for candidate in (HOST_PYTHON, "/usr/bin/python3", "/usr/local/bin/python3"):
        path = Path(candidate).resolve()
        reachable = path.exists() and all(
            p.stat().st_mode & stat.S_IXOTH for p in (path, *path.parents)
        )
        if not reachable:
            continue
        check = subprocess.run(
            [str(path), "-c", "import sys; sys.exit(sys.version_info < (3, 10))"],
            capture_output=True, timeout=60, check=False,
        )  # fmt: skip
        if check.returncode == 0:
            return str(path)
    pytest.skip("no python3 >= 3.10 that another user may run")


class TestCache:
    """The unpacked copy is private: no other local user can put code into a run."""

    def test_cache_dir_is_ours_and_closed(self, pyz, dsn, key, tmp_path):
        """The first run creates the cache directory 0700, owned by the user running it."""
        run_pyz(pyz, "--key", key, "--", "true", dsn=dsn, cache=tmp_path)
        info = (tmp_path / "jobrun").stat()
        assert (info.st_uid, info.st_mode & 0o777) == (os.geteuid(), 0o700)

    def test_cache_dir_of_another_user_is_not_used(self, pyz, dsn, key, tmp_path):
        """A cache directory another user made first, with code planted in it: never imported.

        The run goes on from a new private directory (said in one line, removed at the end);
        the squatted directory is left as it was.
        """
        if os.geteuid() != 0:
            pytest.skip("making a directory owned by another user needs root")
        nobody = pwd.getpwnam("nobody")
        squatted = tmp_path / "jobrun"
        planted = tmp_path / "planted-ran"
        plant_code(squatted, build_id(pyz), planted)
        for path in (squatted, *squatted.rglob("*")):
            os.chown(path, nobody.pw_uid, nobody.pw_gid)
        before = sorted(squatted.rglob("*"))
        marker = tmp_path / "ran"
        result = run_pyz(pyz, "--key", key, "--", "touch", str(marker), dsn=dsn, cache=tmp_path)
        assert result.returncode == 0, result.stderr
        assert marker.exists()
        assert not planted.exists()
        fresh = said_fresh_directory(result.stderr, "belongs to uid")
        assert fresh.parent == tmp_path
        assert not fresh.exists()
        assert sorted(squatted.rglob("*")) == before

    def test_cache_dir_open_to_others_is_not_used(self, pyz, dsn, key, tmp_path):
        """Our own cache directory that others may write to is not used (they may have)."""
        (tmp_path / "jobrun").mkdir()
        (tmp_path / "jobrun").chmod(0o777)
        planted = tmp_path / "planted-ran"
        plant_code(tmp_path / "jobrun", build_id(pyz), planted)
        result = run_pyz(pyz, "--key", key, "--", "true", dsn=dsn, cache=tmp_path)
        assert result.returncode == 0, result.stderr
        said_fresh_directory(result.stderr, "open to other users")
        assert not planted.exists()

    def test_cache_under_a_directory_others_can_write_is_not_used(self, pyz, dsn, key, tmp_path):
        """Under a world-writable, non-sticky parent, our directory could be swapped.

        So could a new one beside it: the run unpacks into the temporary directory instead.
        """
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        result = run_pyz(pyz, "--key", key, "--", "true", dsn=dsn, cache=shared)
        assert result.returncode == 0, result.stderr
        fresh = said_fresh_directory(result.stderr, "can be changed by other users")
        assert shared not in fresh.parents

    def test_cache_reached_through_a_link_is_checked_where_it_is(self, pyz, dsn, key, tmp_path):
        """A link to a directory inside a world-writable one: the real parents are checked."""
        shared = tmp_path / "shared"
        (shared / "inner").mkdir(parents=True)
        shared.chmod(0o777)
        (tmp_path / "link").symlink_to(shared / "inner")
        result = run_pyz(pyz, "--key", key, "--", "true", dsn=dsn, cache=tmp_path / "link")
        assert result.returncode == 0, result.stderr
        fresh = said_fresh_directory(result.stderr, "can be changed by other users")
        assert shared not in fresh.resolve().parents

    def test_no_safe_place_at_all_is_69_with_control_characters_escaped(
        self, pyz, dsn, key, tmp_path
    ):
        """Cache and temporary directory both open to others: 69, one escaped line, no run.

        Only the user's own settings can bring this about: no other user can.
        """
        odd = tmp_path / "job\x1b[31mrun.pyz"
        shutil.copyfile(pyz, odd)
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o777)
        marker = tmp_path / "ran"
        result = run_pyz(
            odd, "--key", key, "--", "touch", str(marker), dsn=dsn, cache=shared,
            extra={"TMPDIR": str(shared)},
        )  # fmt: skip
        assert result.returncode == 69
        assert len(result.stderr.splitlines()) == 1, result.stderr
        assert "can be changed by other users" in result.stderr
        assert "job\\x1b[31mrun.pyz" in result.stderr
        assert "\x1b" not in result.stderr
        assert not marker.exists()
        assert not [p for p in shared.iterdir() if p.name.startswith("jobrun-")]

    def test_squatted_tmp_cache_of_an_account_without_home_is_not_used(self, pyz, dsn, key):
        """An account with no writable home unpacks into $TMPDIR/jobrun-<uid>; squatted: run on.

        As ``nobody`` (home /nonexistent), with that directory made first by another user.
        """
        if os.geteuid() != 0:
            pytest.skip("running as nobody, with a directory of another user's, needs root")
        nobody = pwd.getpwnam("nobody")
        python = python_for_others()
        # Not under tmp_path: pytest's directories are closed to other users.
        place = Path(tempfile.mkdtemp(prefix="jobrun-zipapp-", dir="/tmp"))
        try:
            place.chmod(0o755)
            copy = place / "jobrun.pyz"
            shutil.copyfile(pyz, copy)
            copy.chmod(0o644)
            tmp = place / "tmp"
            tmp.mkdir()
            tmp.chmod(0o1777)
            squatted = tmp / f"jobrun-{nobody.pw_uid}"
            squatted.mkdir(mode=0o700)  # root's: another user's, for nobody
            marker = tmp / "ran"
            env = jobrun_cli.environment(
                dsn, {"HOME": nobody.pw_dir, "TMPDIR": str(tmp), "USER": "nobody"}
            )
            for name in ("XDG_CACHE_HOME", "PYTHONPATH"):
                env.pop(name, None)
            result = subprocess.run(
                [python, str(copy), "--key", key, "--", "touch", str(marker)], env=env,
                cwd=place, capture_output=True, text=True, timeout=180, check=False,
                stdin=subprocess.DEVNULL, user=nobody.pw_uid, group=nobody.pw_gid,
                extra_groups=[],
            )  # fmt: skip
            assert result.returncode == 0, result.stderr
            assert marker.exists()
            fresh = said_fresh_directory(result.stderr, "belongs to uid 0")
            assert fresh.parent == tmp
            assert sorted(p.name for p in tmp.iterdir()) == sorted([squatted.name, "ran"])
        finally:
            shutil.rmtree(place, ignore_errors=True)

    def test_runs_from_a_directory_others_can_write(self, pyz, dsn, key, tmp_path):
        """The file in a world-writable directory, run from there: nothing planted is imported."""
        shared = tmp_path / "shared"
        shared.mkdir()
        shared.chmod(0o1777)
        copy = shared / "jobrun.pyz"
        shutil.copyfile(pyz, copy)
        planted = tmp_path / "planted-ran"
        for module in ("psycopg_binary", "click", "jobrun"):
            (shared / module).mkdir()
            (shared / module / "__init__.py").write_text(
                f"open({str(planted)!r}, 'a').write({module!r})\n"
            )
        home = tmp_path / "home"
        home.mkdir(mode=0o700)
        result = run_pyz(copy, "--key", key, "--", "true", dsn=dsn, cache=home, cwd=shared)
        assert result.returncode == 0, result.stderr
        assert not planted.exists()
