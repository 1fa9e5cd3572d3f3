"""The single-file jobrun (dist/jobrun.pyz): unpack once into a private cache, then run.

tools/build_zipapp.py copies this file into the archive as ``__main__.py``, with BUILD_ID
set. The archive holds ``lib.zip`` (jobrun, click, structlog, psycopg, typing_extensions)
and ``native/*.whl``: psycopg-binary for each CPython version and Linux architecture it
was built for. Compiled modules and the bundled libpq cannot be loaded from inside a zip,
so the first run unpacks the library and the one wheel that fits this interpreter into
``$XDG_CACHE_HOME/jobrun/<BUILD_ID>/`` (else ``~/.cache``, else ``$TMPDIR/jobrun-<uid>``)
and puts them on ``sys.path``; later runs only check that directory and import from it,
where Python keeps its compiled bytecode as for any installed package.

WARNING: whoever can write to that directory, or rename one of its parents, chooses the
code this jobrun runs. It is created 0700, and used only when it and every directory
above it belong to us or root and no one else can write to them (a sticky /tmp is fine).
When it is not (another user made ``/tmp/jobrun-<uid>`` first), the run unpacks into a
new directory of its own (``mkdtemp``, checked the same way) and says so on stderr.

Written for old interpreters too (no syntax newer than 3.6), so that a host whose python3
is too old gets one line saying so instead of a SyntaxError.
"""

from __future__ import annotations

import os
import stat
import sys

#: The archive's content hash, written in by tools/build_zipapp.py ("" outside an archive).
BUILD_ID = ""
#: ``cp312-x86_64`` -> the archive's member with psycopg-binary for it, written in likewise.
NATIVE: dict[str, str] = {}
#: The archive this process runs from: set once the bootstrap has run (None when installed).
ARCHIVE: str | None = None
#: Exit status when this host cannot run this file (as EX_UNAVAILABLE: the command was
#: not started). A bug in the bootstrap itself is not this: it ends in a traceback (70).
UNAVAILABLE = 69
OLDEST = (3, 10)


class CannotRun(Exception):
    """The archive cannot run on this host; the message says why and what to do."""


def native_tag() -> str | None:
    """``cp312-x86_64`` for this interpreter, or None where no manylinux wheel can load."""
    if sys.implementation.name != "cpython" or not sys.platform.startswith("linux"):
        return None
    try:
        libc = os.confstr("CS_GNU_LIBC_VERSION") or ""
    except (ValueError, OSError):
        libc = ""  # musl (Alpine) has no glibc version: manylinux wheels do not load there
    if not libc.startswith("glibc"):
        return None
    return f"cp{sys.version_info[0]}{sys.version_info[1]}-{os.uname().machine}"


def cache_candidates() -> list[str]:
    """Where this user's unpacked copies may live, in the order they are tried."""
    candidates = []
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    if os.path.isabs(xdg):  # the XDG rule: a relative value is ignored
        candidates.append(os.path.join(xdg, "jobrun"))
    home = os.path.expanduser("~")
    if os.path.isabs(home):
        candidates.append(os.path.join(home, ".cache", "jobrun"))
    tmp = os.environ.get("TMPDIR", "")
    tmp = tmp if os.path.isabs(tmp) else "/tmp"  # noqa: S108 - checked like any other parent
    candidates.append(os.path.join(tmp, f"jobrun-{os.geteuid()}"))
    return candidates


def cache_base() -> str:
    """Where this user's unpacked copies live (created 0700 when missing)."""
    candidates = cache_candidates()
    for candidate in candidates:
        try:
            os.makedirs(candidate, mode=0o700, exist_ok=True)
        except OSError:
            continue  # a read-only or missing home: try the next place
        return candidate
    raise CannotRun(f"no directory to unpack into: tried {', '.join(candidates)}")


def check_private(path: str) -> None:
    """Refuse ``path`` unless only we (or root) can change what it contains."""
    me = os.geteuid()
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode):
        raise CannotRun(f"{path} is not a directory (a link?): remove it")
    if info.st_uid != me:
        raise CannotRun(
            f"{path} belongs to uid {info.st_uid}, not to you (uid {me}): another user "
            "could put code there; remove it, or set XDG_CACHE_HOME to a directory of yours"
        )
    if info.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CannotRun(
            f"{path} is open to other users (mode {stat.S_IMODE(info.st_mode):o}): another "
            "user could put code there; remove it (jobrun recreates it 0700)"
        )
    # The directories it is really in: a link in the path (~/.cache to a shared disk) counts.
    parent = os.path.dirname(os.path.realpath(path))
    while True:
        info = os.stat(parent)
        writable = info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        if info.st_uid not in (0, me) or (writable and not info.st_mode & stat.S_ISVTX):
            raise CannotRun(
                f"{parent} can be changed by other users, so {path} inside it could be "
                "swapped for theirs: set XDG_CACHE_HOME to a directory only you can write to"
            )
        if parent == os.path.dirname(parent):
            return
        parent = os.path.dirname(parent)


def fresh_private(refused: CannotRun, near: str) -> str:
    """A new directory of this run's own, 0700, for when the usual one cannot be used.

    Next to the refused one (in ``near``), else in the temporary directory; removed when
    the run ends. Said once on stderr, so that the refused directory gets looked at.

    WARNING: never a predictable name again: whoever made the usual one first could make
    that one first too. mkdtemp creates a name nobody can guess, 0700, or fails; the
    directories above it are checked as the usual one's are, so it cannot be swapped.
    """
    import atexit  # noqa: PLC0415 - only when the usual directory is refused
    import contextlib  # noqa: PLC0415
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415

    for place in dict.fromkeys([near, tempfile.gettempdir()]):
        try:
            fresh = tempfile.mkdtemp(prefix=f"jobrun-{os.geteuid()}-", dir=place)
        except OSError:
            continue  # read-only, full, or gone: the next place
        try:
            check_private(fresh)
        except (CannotRun, OSError):
            with contextlib.suppress(OSError):
                os.rmdir(fresh)  # empty, as made; never a tree someone may have put there
            continue
        atexit.register(shutil.rmtree, fresh, ignore_errors=True)
        sys.stderr.write(
            printable(f"jobrun: {refused} (this run unpacks into a new private directory, {fresh})")
            + "\n"
        )
        return fresh
    raise refused


def unpack(archive: str, member: str, target: str, *, inner: str | None = None) -> None:
    """Unpack ``member`` of the archive (a zip itself) to ``target``, all or nothing.

    A run that finds ``target`` can use it: it is renamed into place only when complete, so
    runs starting together on a new file unpack side by side and the first rename wins.
    """
    import io  # noqa: PLC0415 - the first run only
    import shutil  # noqa: PLC0415
    import tempfile  # noqa: PLC0415
    import zipfile  # noqa: PLC0415

    scratch = tempfile.mkdtemp(prefix=".unpacking-", dir=os.path.dirname(target))
    try:
        with zipfile.ZipFile(archive) as outer:
            data = outer.read(member)
        with zipfile.ZipFile(io.BytesIO(data)) as payload:
            for name in payload.namelist():
                if inner is None or name.split("/")[0].startswith(inner):
                    payload.extract(name, scratch)  # zipfile refuses ../ and absolute names
        try:
            os.rename(scratch, target)
        except OSError:
            if not os.path.isdir(target):
                raise
            shutil.rmtree(scratch, ignore_errors=True)  # another run unpacked it first
    except BaseException:
        shutil.rmtree(scratch, ignore_errors=True)
        raise


def has_host_libpq() -> bool:
    """Whether the host has a libpq for psycopg's pure-Python implementation."""
    import ctypes.util  # noqa: PLC0415 - only when no bundled driver fits

    return ctypes.util.find_library("pq") is not None


def prepare(archive: str) -> list[str]:
    """The directories to import jobrun and its driver from, unpacked if needed."""
    if sys.version_info < OLDEST:
        needs = "needs Python {}.{} or later, this is {}"
        raise CannotRun(needs.format(*OLDEST, sys.version.split()[0]))
    base = ""
    fresh = False
    try:
        base = cache_base()
        check_private(base)
    except CannotRun as refused:
        # Another user may have made (or may be able to change) the usual directory: it is
        # not used, and neither does it stop this user's jobs.
        base = fresh_private(refused, os.path.dirname(base or cache_candidates()[-1]))
        fresh = True
    home = os.path.join(base, BUILD_ID or "unbuilt")
    if not os.path.isdir(home):
        os.makedirs(home, mode=0o700, exist_ok=True)
    lib = os.path.join(home, "lib")
    if not os.path.isdir(lib):
        unpack(archive, "lib.zip", lib)
    compiled = os.path.join(lib, f".compiled-{sys.implementation.cache_tag}")
    if not fresh and not os.path.exists(compiled):
        # Bytecode for this Python, once: compiling every module on every run would cost as
        # much as the run itself. Written even where PYTHONDONTWRITEBYTECODE is set. Not for
        # a directory of this run alone: only what it imports is compiled, as it goes.
        import compileall  # noqa: PLC0415 - the first run with this Python only

        compileall.compile_dir(lib, quiet=2)
        with open(compiled, "w"):
            pass
    tag = native_tag()
    if tag is None or tag not in NATIVE:
        if has_host_libpq():
            return [lib]  # psycopg's pure-Python implementation, on the host's libpq
        raise CannotRun(
            f"no bundled PostgreSQL driver fits this Python ({tag or sys.implementation.name}"
            f" on {sys.platform}; this file has {', '.join(sorted(NATIVE)) or 'none'}) and "
            "the host has no libpq: install libpq (apt install libpq5), or run it with a "
            "Python the file has a driver for"
        )
    native = os.path.join(home, tag)
    if not os.path.isdir(native):
        unpack(archive, NATIVE[tag], native, inner="psycopg_binary")
    return [lib, native]


def printable(text: str) -> str:
    """``text`` with control characters escaped: a path can hold any byte but ``/``."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def quiet_interrupts() -> None:
    """A Ctrl-C while starting exits 130 at once, as the installed jobrun does."""
    import signal  # noqa: PLC0415 - built in

    def interrupted(signum: int, _frame: object) -> None:
        os._exit(128 + signum)

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        signal.signal(signal.SIGINT, interrupted)


def main() -> None:
    """Make jobrun importable from the private cache, then run it as the installed one."""
    quiet_interrupts()
    archive = os.path.abspath(sys.argv[0])
    try:
        paths = prepare(archive)
    except (CannotRun, OSError) as exc:
        sys.stderr.write(printable(f"jobrun: cannot run {archive}: {exc}") + "\n")
        sys.exit(UNAVAILABLE)
    # Nothing is imported from the archive itself any more: only from our own directory.
    sys.path[:] = [*paths, *(p for p in sys.path if os.path.abspath(p) != archive)]
    from jobrun import _zipapp  # noqa: PLC0415 - only now importable: our copy in the cache
    from jobrun.__main__ import main as run  # noqa: PLC0415

    _zipapp.ARCHIVE = archive
    run()


def command() -> list[str]:
    """How to start this same jobrun again in a child process (the demo's runs)."""
    if ARCHIVE is not None:
        return [sys.executable, ARCHIVE]
    return [sys.executable, "-m", "jobrun"]


if __name__ == "__main__":
    main()
