"""Open a log as text: plain, gzip, bzip2 or xz (by content), and strip container log leads."""

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


@contextlib.contextmanager
def open_log(path: str, stdin: IO[bytes] | None) -> Iterator[tuple[IO[str], str | None]]:
    """The log as text, and its compression: undecodable bytes replaced, never an error."""
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
        if packed == "gzip":
            opened = cast("IO[bytes]", gzip.GzipFile(fileobj=raw, mode="rb"))
        elif packed == "bzip2":
            opened = cast("IO[bytes]", bz2.BZ2File(raw, "rb"))
        elif packed == "xz":
            opened = cast("IO[bytes]", lzma.LZMAFile(raw, "rb"))  # noqa: SIM115
        # Lines end at a newline only: a carriage return inside a statement stays in it.
        text = io.TextIOWrapper(opened, encoding="utf-8", errors="replace", newline="\n")
        try:
            yield text, packed
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
