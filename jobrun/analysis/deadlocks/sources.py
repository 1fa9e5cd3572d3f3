"""Open a log as bounded text lines: plain, gzip, bzip2 or xz (by content); strip leads."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import io
import lzma
import re
import sys
from pathlib import Path
from typing import IO, TYPE_CHECKING, cast

from jobrun.exitcodes import Exit, JobrunError

if TYPE_CHECKING:
    from collections.abc import Iterable, Iterator

#: Longest line kept, in characters: the rest of a longer line is dropped, never held. A
#: server writes a line this long only for a one-line statement of 8 MiB; a file of one
#: endless line would otherwise be held whole, several times over (a character may take
#: 4 bytes in memory: a line at the limit and its few copies stay under 200 MiB).
LINE_LIMIT = 8 * 2**20
#: A compressed file is read on while what it unpacks to stays under UNPACK_FLOOR or under
#: UNPACK_RATIO times the packed bytes read: real server logs pack at most about 170 to 1
#: (xz, a quiet server's checkpoint lines), a decompression bomb 1,000 (gzip) to 800,000
#: (bzip2) to 1. So the time spent on a file stays in proportion to its size on disk.
UNPACK_FLOOR = 64 * 2**20
UNPACK_RATIO = 500
#: Leading bytes of each compression, tried on the content rather than the file's name
#: (a rotated ``postgresql.log.1.gz`` renamed, or a compressed log on stdin).
_MAGIC: tuple[tuple[bytes, str], ...] = (
    (b"\x1f\x8b", "gzip"),
    (b"BZh", "bzip2"),
    (b"\xfd7zXZ\x00", "xz"),
)
#: What a tool writes before each line of a server's output: ``docker compose logs``
#: (``dev-postgres-1  | ``) or ``kubectl logs --prefix`` (``[pod/name/container] ``), then
#: the time that ``--timestamps`` (docker, kubectl) or a CloudWatch export adds.
_LEAD = re.compile(
    r"(?:[A-Za-z0-9][\w.-]*\s+\| ?|\[pod/[^\]\s]+\] )?"
    r"(?:\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?Z )?"
)


class NoInputError(JobrunError):
    """A log file is missing or unreadable."""

    exit_code = Exit.NO_INPUT
    event = "no_input"


class LogText:
    """A log's lines, each cut at LINE_LIMIT characters; what was cut and why reading stopped."""

    def __init__(self, text: IO[str], unpacked: _Unpacked | None) -> None:
        self._text = text
        self._unpacked = unpacked
        #: Lines longer than LINE_LIMIT, kept cut at it.
        self.cut = 0

    @property
    def stopped(self) -> str | None:
        """Why the file was not read to its end (a decompression bomb), or None."""
        return self._unpacked.stopped if self._unpacked is not None else None

    def __iter__(self) -> Iterator[str]:
        readline, limit, length = self._text.readline, LINE_LIMIT, len
        while line := readline(limit):
            if length(line) == limit and line[-1] != "\n":
                self.cut += 1
                # WARNING: the rest is read and dropped piece by piece: never joined, never held.
                while (rest := readline(limit)) and not rest.endswith("\n"):
                    pass
            yield line  # without its newline: adding one would copy it


class _Counted:
    """A packed file's bytes, counted as the decompressor reads them."""

    def __init__(self, raw: IO[bytes]) -> None:
        self._raw = raw
        self.count = 0

    def read(self, size: int = -1) -> bytes:
        data = self._raw.read(size)
        self.count += len(data)
        return data


class _Unpacked(io.RawIOBase):
    """What a compressed file unpacks to, ending early past UNPACK_RATIO times its size."""

    def __init__(self, unpacking: IO[bytes], packed: _Counted) -> None:
        super().__init__()
        self._unpacking = unpacking
        self._packed = packed
        self.count = 0
        self.stopped: str | None = None

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        if self.stopped is not None:
            return 0
        data = self._unpacking.read1(len(buffer))  # type: ignore[attr-defined]
        buffer[: len(data)] = data
        self.count += len(data)
        if self.count > UNPACK_FLOOR and self.count > UNPACK_RATIO * self._packed.count:
            self.stopped = (
                f"stopped after {self.count // 2**20} MiB unpacked from "
                f"{max(1, self._packed.count // 1024)} KiB, over {UNPACK_RATIO} times its "
                "size (no server log packs so well: a decompression bomb?); the rest was "
                "not read"
            )
        return len(data)


@contextlib.contextmanager
def open_log(path: str, stdin: IO[bytes] | None) -> Iterator[tuple[LogText, str | None]]:
    """The log's lines, and its compression: undecodable bytes replaced, never an error."""
    try:
        raw = cast(
            "io.BufferedReader",
            io.BufferedReader(
                cast("io.RawIOBase", stdin if stdin is not None else sys.stdin.buffer)
            )
            if path == "-"
            else Path(path).open("rb"),  # noqa: SIM115 - closed by the with below
        )
    except OSError as exc:
        raise NoInputError(f"cannot read {path}: {exc.strerror or exc}") from None
    with raw:
        try:
            head = raw.peek(8)[:8]
        except OSError as exc:  # a directory
            raise NoInputError(f"cannot read {path}: {exc.strerror or exc}") from None
        packed = next((name for magic, name in _MAGIC if head.startswith(magic)), None)
        opened: IO[bytes] = raw
        unpacked: _Unpacked | None = None
        if packed is not None:
            counted = _Counted(raw)
            source = cast("IO[bytes]", counted)
            if packed == "gzip":
                unpacking = cast("IO[bytes]", gzip.GzipFile(fileobj=source, mode="rb"))
            elif packed == "bzip2":
                unpacking = cast("IO[bytes]", bz2.BZ2File(source, "rb"))
            else:
                unpacking = cast("IO[bytes]", lzma.LZMAFile(source, "rb"))  # noqa: SIM115
            unpacked = _Unpacked(unpacking, counted)
            opened = cast("IO[bytes]", io.BufferedReader(unpacked, 2**16))
        # Lines end at a newline only: a carriage return inside a statement stays in it.
        text = io.TextIOWrapper(opened, encoding="utf-8", errors="replace", newline="\n")
        # Decoded 64 KiB at a time rather than 8: a quarter less time per line of a big log.
        text._CHUNK_SIZE = 2**16  # type: ignore[attr-defined]  # noqa: SLF001
        try:
            yield LogText(text, unpacked), packed
        except (OSError, EOFError, lzma.LZMAError) as exc:  # a truncated or damaged archive
            raise NoInputError(f"cannot read {path}: {exc}") from None


def container_lead(line: str) -> re.Pattern[str] | None:
    """The lead pattern when a tool wrote one before this (first) line, else None."""
    match = _LEAD.match(line)
    if match and match.end() and _looks_like_log(line[match.end() :]):
        return _LEAD
    return None


def strip_lead(lines: Iterable[str], lead: re.Pattern[str]) -> Iterator[str]:
    """The lines without the lead (a line without it is kept whole)."""
    for line in lines:
        match = lead.match(line)
        yield line[match.end() :] if match else line


def _looks_like_log(rest: str) -> bool:
    """What follows a lead starts like a server log line: a time, a JSON record, a pid."""
    return bool(re.match(r"\d{4}-\d\d-\d\d|\{|\[\d+\]|\t|\d+-\d+-\d+|[A-Z][a-z]{2} ", rest))
