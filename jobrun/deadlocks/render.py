"""``jobrun deadlocks``' output: the deadlocks for people or as JSON, and the exit status."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from jobrun.deadlocks.formats import NoInputError
from jobrun.deadlocks.scan import find
from jobrun.exitcodes import OutputError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    from jobrun.deadlocks.model import Deadlock, Found, Side


def run(
    paths: Iterable[str],
    *,
    prefix: str | None,
    as_json: bool,
    check: bool,
    echo: Callable[[str], None],
) -> int:
    """``jobrun deadlocks``: print what the logs hold; 1 with ``check`` when any deadlock."""
    paths = list(paths)
    for path in paths:  # every file checked before any output: no half a report
        if path != "-" and not (Path(path).is_file() and os.access(path, os.R_OK)):
            reason = "no such file" if not Path(path).exists() else "not a readable file"
            raise NoInputError(f"cannot read {path}: {reason}")
    found = find(paths, prefix=prefix)
    try:
        echo(json.dumps(found.as_json(), indent=2) if as_json else report(found))
        sys.stdout.flush()
    except OSError as exc:
        raise OutputError(f"cannot write the report: {exc.strerror or exc}") from None
    return 1 if check and found.deadlocks else 0


def describe(side: Side) -> str:
    """``process 123 (jobrun:job-a, job job-a)``, saying where the name came from or why not."""
    if side.application is None:
        return f"process {side.pid} (application unknown: no line of this pid names it)"
    job = f", job {side.job}" if side.job else ""
    source = "" if side.named_by == "this line" else f", named on {side.named_by}"
    return f"process {side.pid} ({side.application}{job}{source})"


def report(found: Found) -> str:
    """The deadlocks for people: each side's process, application, lock and statement."""
    out: list[str] = []
    for deadlock in found.deadlocks:
        when = f" at {deadlock.time}" if deadlock.time else ""
        where = f" in database {deadlock.db}" if deadlock.db else ""
        out.append(f"deadlock{when}{where} ({deadlock.source} line {deadlock.line})")
        for side in deadlock.sides:
            victim = " [aborted by PostgreSQL]" if side.pid == deadlock.victim else ""
            out.append(f"  {describe(side)}{victim}")
            if side.waits_for:
                out.append(f"    waits for {side.waits_for}, held by process {side.blocked_by}")
            if side.statement:
                statement = " ".join(side.statement.split())
                out.append(f"    running: {statement}")
        if deadlock.context:
            out.append(f"  context: {' '.join(deadlock.context.split())}")
        if not any(side.application for side in deadlock.sides):
            out.append(
                "  note: the log does not carry application names: add %a to "
                "log_line_prefix (or use csvlog/jsonlog) to see which jobs these were"
            )
    pairs = _pairs(found.deadlocks)
    files = ", ".join(f"{f['source']} ({f['format']}, {f['entries']} entries)" for f in found.files)
    out.append(f"{len(found.deadlocks)} deadlock(s) in {files}")
    out.extend(f"  {count} x {pair}" for pair, count in pairs.items())
    return "\n".join(out)


def _pairs(deadlocks: Iterable[Deadlock]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for deadlock in deadlocks:
        names = sorted(side.application or f"pid {side.pid}" for side in deadlock.sides)
        label = " <-> ".join(names)
        counts[label] = counts.get(label, 0) + 1
    return dict(sorted(counts.items(), key=lambda item: -item[1]))
