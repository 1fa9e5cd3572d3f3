"""Build dist/jobrun.pyz: jobrun and its dependencies in one file that any python3 >= 3.10 runs.

    python3 tools/build_zipapp.py [--out dist/jobrun.pyz] [--cache DIR]

Any python3 3.10+ builds it, with nothing installed: a host's own python3 (no pip, no
venv) as well as the development venv. The pure-Python packages (click, structlog,
psycopg, typing_extensions, and prometheus_client for --metrics-file) are the versions
installed where this runs when they are (the development venv: the file then holds what the
tests ran against), else the versions in PINNED. psycopg-binary, which has compiled modules
and its own libpq, comes as one wheel per CPython version and Linux architecture (PYTHONS x
MACHINES), pinned to psycopg's version. Wheels are fetched once into the cache (default
``$XDG_CACHE_HOME/jobrun-build``) and reused offline afterwards: with ``pip download``
where pip is installed (it follows the pip configuration), else straight from PyPI
(``$JOBRUN_BUILD_PYPI``, default https://pypi.org; its simple API), each file checked
against the sha256 digest the index gives for it. jobrun/_zipapp.py is the archive's
``__main__.py``: how it unpacks and picks a wheel is described there.
"""

from __future__ import annotations

import argparse
import fcntl
import fnmatch
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.parse
import urllib.request
import zipapp
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: CPython versions and Linux machines the file carries a psycopg-binary wheel for.
PYTHONS = ("3.10", "3.11", "3.12", "3.13", "3.14")
MACHINES = ("x86_64", "aarch64")
#: Pure-Python distributions the file carries, besides jobrun (from this source tree).
PURE = ("click", "structlog", "psycopg", "typing_extensions", "prometheus_client")
#: The versions carried where they are not installed here (a host's own python3): the ones
#: the tests last ran against. psycopg-binary follows psycopg.
PINNED = {
    "click": "8.5.1",
    "structlog": "26.1.0",
    "psycopg": "3.3.9",
    "typing_extensions": "4.16.0",
    "prometheus_client": "0.26.0",
}
#: Where wheels come from without pip (its simple API: file names, URLs, sha256 digests).
PYPI_ENV = "JOBRUN_BUILD_PYPI"
PYPI = "https://pypi.org"


#: Exit status of a build that could not download a wheel it needs (no network?).
DOWNLOAD_FAILED = 3


class BuildError(Exception):
    """The build cannot go on; the message says why."""


class DownloadError(BuildError):
    """pip could not download a wheel that is not in the cache yet."""


def default_cache() -> Path:
    """``$XDG_CACHE_HOME/jobrun-build`` (else ``~/.cache/jobrun-build``)."""
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    base = Path(xdg) if Path(xdg).is_absolute() else Path.home() / ".cache"
    return base / "jobrun-build"


def _fetch(cache: Path, name: str, version: str, pattern: str, *platform: str) -> None:
    """Put the wheel of ``name`` ``version`` matching ``pattern`` into the cache."""
    if importlib.util.find_spec("pip") is not None:
        _download(cache, f"{name}=={version}", *platform)
    else:
        _from_index(cache, name, version, pattern)


def _from_index(cache: Path, name: str, version: str, pattern: str) -> None:
    """Download the file of ``name`` ``version`` named like ``pattern``, its digest checked.

    The index's simple API in JSON (PEP 691): every file's name, URL and sha256 digest.
    """
    index = os.environ.get(PYPI_ENV, PYPI).rstrip("/")
    page = f"{index}/simple/{re.sub(r'[-_.]+', '-', name).lower()}/"
    request = urllib.request.Request(  # noqa: S310 - https by default; the variable is the builder's
        page, headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as reply:  # noqa: S310 - as above
            files = json.load(reply)["files"]
        chosen = sorted(
            (f for f in files if fnmatch.fnmatch(f["filename"], pattern) and not f.get("yanked")),
            key=lambda f: f["filename"],
        )
        if not chosen:
            raise DownloadError(f"{page}: no file {pattern} for {name} {version}")
        entry = chosen[0]
        url = urllib.parse.urljoin(page, entry["url"])
        with urllib.request.urlopen(url, timeout=300) as reply:  # noqa: S310 - the index's URL
            data = reply.read()
    except (OSError, ValueError, KeyError) as exc:  # URLError is an OSError
        raise DownloadError(f"{page}: {name} {version}: {exc}") from None
    if hashlib.sha256(data).hexdigest() != entry["hashes"]["sha256"]:
        raise DownloadError(f"{entry['filename']}: its sha256 is not the one the index gives")
    partial = cache / (entry["filename"] + ".partial")
    partial.write_bytes(data)
    partial.replace(cache / entry["filename"])


def _download(cache: Path, requirement: str, *platform: str) -> None:
    command = [
        sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
        "--only-binary=:all:", "--disable-pip-version-check", "--dest", str(cache),
        *platform, requirement,
    ]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["(no message)"])[-1]
        raise DownloadError(f"pip download {requirement} {' '.join(platform)}: {last}")


def _cached(cache: Path, pattern: str) -> Path | None:
    found = sorted(cache.glob(pattern))
    return found[-1] if found else None


def version_of(name: str) -> str:
    """The version of ``name`` installed here, else the pinned one."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return PINNED[name]


def pure_wheel(cache: Path, name: str) -> Path:
    """The py3 wheel of ``name`` at the version installed here (else PINNED), fetched once."""
    version = version_of(name)
    stem = re.sub(r"[-_.]+", "_", name).lower()
    pattern = f"{stem}-{version}-py3-none-any.whl"
    found = _cached(cache, pattern)
    if found is None:
        _fetch(cache, name, version, pattern)
        found = _cached(cache, pattern)
    if found is None:
        raise BuildError(f"no pure-Python wheel {pattern} after pip download")
    return found


def binary_wheels(cache: Path, version: str) -> dict[str, Path]:
    """``cp312-x86_64`` -> psycopg-binary's wheel for it, for each one that exists."""
    wheels: dict[str, Path] = {}
    missed: dict[str, DownloadError] = {}
    for python in PYTHONS:
        abi = "cp" + python.replace(".", "")
        for machine in MACHINES:
            pattern = f"psycopg_binary-{version}-{abi}-{abi}-*manylinux*{machine}*.whl"
            found = _cached(cache, pattern)
            if found is None:
                platforms = [f"manylinux2014_{machine}", f"manylinux_2_17_{machine}",
                             f"manylinux_2_28_{machine}"]  # fmt: skip
                try:
                    _fetch(
                        cache, "psycopg-binary", version, pattern,
                        "--python-version", python, "--implementation", "cp", "--abi", abi,
                        *(arg for p in platforms for arg in ("--platform", p)),
                    )  # fmt: skip
                except DownloadError as exc:
                    missed[f"{abi}-{machine}"] = exc
                    print(f"  no psycopg-binary {version} for {abi} {machine}: {exc}")
                    continue
                found = _cached(cache, pattern)
            if found is not None:
                wheels[f"{abi}-{machine}"] = found
    host = f"cp{sys.version_info[0]}{sys.version_info[1]}-{os.uname().machine}"
    if host in missed:
        raise missed[host]  # the one the file must have: it is tested with this Python
    return wheels


def _library(staging: Path, pure: list[Path]) -> Path:
    """lib.zip: jobrun from this tree and the pure wheels' packages, without metadata."""
    lib = staging / "lib.zip"
    with zipfile.ZipFile(lib, "w", zipfile.ZIP_DEFLATED) as out:
        for path in sorted((ROOT / "jobrun").rglob("*")):
            if (
                path.is_file()
                and "__pycache__" not in path.parts
                and path.suffix in {".py", ".typed"}
            ):
                out.write(path, path.relative_to(ROOT).as_posix())
        for wheel in pure:
            with zipfile.ZipFile(wheel) as source:
                for info in source.infolist():
                    if ".dist-info/" not in info.filename and not info.is_dir():
                        out.writestr(info.filename, source.read(info), zipfile.ZIP_DEFLATED)
    return lib


def _bootstrap(build_id: str, native: dict[str, str]) -> str:
    """jobrun/_zipapp.py with this build's id and wheel table written in."""
    source = (ROOT / "jobrun" / "_zipapp.py").read_text()
    for line, value in (
        ('BUILD_ID = ""', f"BUILD_ID = {build_id!r}"),
        ("NATIVE: dict[str, str] = {}", f"NATIVE: dict[str, str] = {native!r}"),
    ):
        if source.count(f"\n{line}\n") != 1:
            raise BuildError(f"jobrun/_zipapp.py lost its line {line!r}")
        source = source.replace(f"\n{line}\n", f"\n{value}\n")
    return source


def build(out: Path, cache: Path) -> dict[str, str]:
    """Write the archive to ``out``; return its wheel table (tag -> member)."""
    cache.mkdir(parents=True, exist_ok=True)
    with (cache / ".lock").open("w") as lock:
        # Builds at once (two test workers) must not read a wheel another is still writing.
        fcntl.flock(lock, fcntl.LOCK_EX)
        pure = [pure_wheel(cache, name) for name in PURE]
        wheels = binary_wheels(cache, version_of("psycopg"))
    host = f"cp{sys.version_info[0]}{sys.version_info[1]}-{os.uname().machine}"
    if host not in wheels:
        raise BuildError(f"no psycopg-binary wheel for this host ({host}): cannot test the file")
    with tempfile.TemporaryDirectory(prefix="jobrun-zipapp-") as scratch:
        staging = Path(scratch) / "app"
        (staging / "native").mkdir(parents=True)
        digest = hashlib.sha256(_library(staging, pure).read_bytes())
        native = {}
        for tag, wheel in sorted(wheels.items()):
            shutil.copyfile(wheel, staging / "native" / wheel.name)
            native[tag] = f"native/{wheel.name}"
            digest.update(wheel.name.encode() + wheel.read_bytes())
        digest.update((ROOT / "jobrun" / "_zipapp.py").read_bytes())
        (staging / "__main__.py").write_text(_bootstrap(digest.hexdigest()[:16], native))
        out.parent.mkdir(parents=True, exist_ok=True)
        partial = out.with_name(out.name + ".partial")
        zipapp.create_archive(staging, partial, interpreter="/usr/bin/env python3", compressed=True)
        partial.replace(out)  # never a half-written file under the real name
    return native


def main() -> int:
    """Build the archive and say what is in it."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "dist" / "jobrun.pyz")
    parser.add_argument("--cache", type=Path, default=default_cache())
    args = parser.parse_args()
    try:
        native = build(args.out, args.cache)
    except BuildError as exc:
        print(f"build_zipapp: {exc}", file=sys.stderr)
        return DOWNLOAD_FAILED if isinstance(exc, DownloadError) else 1
    size = args.out.stat().st_size
    print(f"{args.out}: {size / 2**20:.1f} MiB; psycopg-binary for {', '.join(sorted(native))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
