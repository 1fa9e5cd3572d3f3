"""``jobrun deadlocks``' output: the deadlocks for people or as JSON, and the exit status."""

from __future__ import annotations

import contextlib
import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jobrun.analysis.deadlocks import together
from jobrun.analysis.deadlocks.advice import suggest
from jobrun.analysis.deadlocks.scan import find
from jobrun.analysis.deadlocks.sources import NoInputError
from jobrun.escape import printable as _printable
from jobrun.exitcodes import OutputError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from jobrun.analysis.deadlocks.model import Deadlock, FileRead, Found, Side


def run(
    paths: Iterable[str],
    *,
    prefix: str | None,
    as_json: bool,
    check: bool,
    echo: Callable[[str], None],
    asked: together.Asked | None = None,
) -> int:
    """``jobrun deadlocks``: print what the logs hold, and the worst status of any file.

    66 or 65 when a file could not be read or understood (every other file's deadlocks are
    printed all the same); else 1 with ``check`` when there is a deadlock; else 0.
    With ``asked``: also who was connected and what was running at each deadlock.
    """
    paths = list(paths)
    for path in [*paths, *(asked.files if asked else ())]:  # a typo: said before any output
        if path != "-" and not (Path(path).is_file() and os.access(path, os.R_OK)):
            reason = "no such file" if not Path(path).exists() else "not a readable file"
            raise NoInputError(f"cannot read {path}: {reason}")
    found = find(paths, prefix=prefix, sessions=asked is not None)
    there = (
        together.gather(found.deadlocks, found.sessions, asked.runs(found.deadlocks))
        if asked
        else None
    )
    try:
        if as_json:
            fields = json_of(found)
            if there is not None:
                fields["sessions"] = there.as_json()
            echo(json.dumps(fields, indent=2))
        else:
            echo(report(found, there))
        sys.stdout.flush()
    except OSError as exc:
        raise OutputError(f"cannot write the report: {exc.strerror or exc}") from None
    for read in found.unread:
        with contextlib.suppress(OSError):  # a closed stderr must not hide the status
            line = _printable(" ".join(str(read.error).split()))
            sys.stderr.write(f"jobrun: error: {line}\n")
    worst = max((read.status for read in found.files), default=0)
    if worst:
        return worst
    return 1 if check and found.deadlocks else 0


def describe(side: Side) -> str:
    """``process 123 (jobrun:job-a, job job-a)``, saying where the name came from or why not."""
    if side.application is None:
        return f"process {side.pid} (application unknown: no line of this pid names it)"
    job = f", job {side.job}" if side.job else ""
    source = "" if side.named_by == "this line" else f", named on {side.named_by}"
    return _printable(f"process {side.pid} ({side.application}{job}{source})")


def json_of(found: Found) -> dict[str, Any]:
    """The whole result for ``--json``: the model's fields, each deadlock with its fix."""
    fields = found.as_json()
    for entry, deadlock in zip(fields["deadlocks"], found.deadlocks, strict=True):
        suggestion = suggest(deadlock)
        entry["suggested_fix"] = suggestion.as_json() if suggestion else None
    return fields


def report(found: Found, there: together.Together | None = None) -> str:
    """The deadlocks for people: each side's process, application, lock and statement.

    With ``there``: under each deadlock who was connected and what was running, and at the
    end the pairs that were there together.
    """
    out: list[str] = []
    for number, deadlock in enumerate(found.deadlocks):
        out.extend(_deadlock(deadlock))
        if there is not None:
            out.extend(together.moment_lines(there.moments[number], there))
    for storm in found.storms:
        first, last = storm.deadlocks[0].time, storm.deadlocks[-1].time
        out.append(
            _printable(
                f"storm: {len(storm.deadlocks)} deadlocks between {' and '.join(storm.sides)} "
                f"from {first} to {last}: one deadlock turned into a storm (a job that "
                "retries at once after a deadlock meets the same cycle again; retry "
                "after a pause, or fix the lock order)"
            )
        )
    out.append("files read:")
    out.extend(f"  {_file(read)}" for read in found.files)
    partial = sum(1 for read in found.unread if read.partial)
    missed = sum(1 for read in found.unread if read.deadlock_unread is not None)
    others = len(found.unread) - partial - missed
    unread = f", {others} not read" if others else ""
    unread += f", {partial} read in part" if partial else ""
    unread += f", {missed} with a deadlock not read" if missed else ""
    out.append(f"{len(found.deadlocks)} deadlock(s) in {len(found.files)} file(s){unread}")
    out.extend(f"  {count} x {pair}" for pair, count in _pairs(found.deadlocks).items())
    if there is not None:
        out.extend(together.table_lines(there))
    return "\n".join(out)


def _deadlock(deadlock: Deadlock) -> list[str]:
    when = f" at {deadlock.time}" if deadlock.time else ""
    where = f" in database {deadlock.db}" if deadlock.db else ""
    also = f"; also in {', '.join(deadlock.also_in)}" if deadlock.also_in else ""
    out = [f"deadlock{when}{where} ({deadlock.source} line {deadlock.line}{also})"]
    for side in deadlock.sides:
        victim = " [aborted by PostgreSQL]" if side.pid == deadlock.victim else ""
        out.append(f"  {describe(side)}{victim}")
        if side.waits_for:
            held = f"process {side.blocked_by}" if side.blocked_by is not None else "(not logged)"
            out.append(f"    waits for {side.waits_for}, held by {held}")
        else:
            out.append(
                "    waits for: not in the log (the DETAIL does not show it, and no lock wait "
                "of this pid was logged before it: log_lock_waits = on)"
            )
        if side.statement:
            out.append(f"    running: {' '.join(side.statement.split())}")
        if side.context and side.context != deadlock.context:
            out.append(f"    context: {' '.join(side.context.split())}")
    if deadlock.context:
        out.append(f"  context: {' '.join(deadlock.context.split())}")
    suggestion = suggest(deadlock)
    if suggestion is not None:
        out.append(f"  suggested fix ({suggestion.shape}): {suggestion.fix}")
    if not any(side.application for side in deadlock.sides):
        out.append(
            "  note: the log does not carry application names: add %a to "
            "log_line_prefix (or use csvlog/jsonlog) to see which jobs these were"
        )
    return [_printable(line) for line in out]


def _file(read: FileRead) -> str:
    """One line per file: what it was read as and what it held, or why it was not read."""
    if read.error is not None and not read.partial and read.deadlock_unread is None:
        return _printable(f"{read.source}: not read: {read.error.removeprefix(read.source + ': ')}")
    layout = f", prefix {read.prefix!r}" if read.prefix is not None else ""
    text = f"{read.source}: {read.format}{layout}, {read.entries} entries"
    text += f", {read.deadlocks} deadlock(s)"
    if read.duplicates:
        text += f" ({read.duplicates} already counted from another file)"
    if read.reindented:
        text += (
            f"; note: {read.reindented} continuation line(s) indented with spaces, not a "
            "tab: the log looks re-indented (copied through a terminal, a ticket or a chat)"
        )
    if read.error is not None:
        label = "deadlock not read" if read.deadlock_unread is not None else "read in part"
        text += f"; {label}: {read.error.removeprefix(read.source + ': ')}"
    return _printable(text)


def _pairs(deadlocks: Iterable[Deadlock]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for deadlock in deadlocks:
        names = sorted(side.application or f"pid {side.pid}" for side in deadlock.sides)
        label = _printable(" <-> ".join(names))
        counts[label] = counts.get(label, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))
