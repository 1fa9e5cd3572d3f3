"""``jobrun show``: a run's kept output tails, escaped for a person or (``--raw``) exact."""

from __future__ import annotations

import datetime as dt
from typing import TYPE_CHECKING

from jobrun.escape import printable, printable_lines
from jobrun.run import tail

if TYPE_CHECKING:
    from collections.abc import Mapping


def render(run: Mapping[str, object], *, raw: bool = False, zone: str | None = None) -> bytes:
    """A header line, then each stream under a ``--- stdout (last N bytes)`` line.

    The streams are what the job printed, and the header's key and host were written by
    whoever could insert into the history: escaped (see printable) unless ``raw``, which
    gives the streams' exact bytes. Either way a stream that does not end in a newline is
    followed by one, so the next header starts a line. ``zone`` (--tz): the start's zone.
    """
    started = run["started_at"]
    if zone is not None and isinstance(started, dt.datetime):
        import zoneinfo  # noqa: PLC0415 - only with --tz

        started = started.astimezone(zoneinfo.ZoneInfo(zone))  # --tz: the start in that zone
    when = started.isoformat(timespec="seconds") if hasattr(started, "isoformat") else started
    header = printable(
        f"run {run['run_id']}  key {run['key']}  host {run['host']}  started {when}  "
        f"outcome {run['outcome']}  exit {run['exit_code']}"
    )
    parts = [f"{header}\n".encode()]
    for name in ("stdout", "stderr"):
        data = run[name]
        if not isinstance(data, (bytes, bytearray, memoryview)):
            parts.append(f"--- {name}: not kept\n".encode())
            continue
        data = bytes(data)
        body = data if raw else printable_lines(tail.text(data)).encode()
        parts.append(f"--- {name} (last {len(data)} bytes)\n".encode())
        parts.append(body if not body or body.endswith(b"\n") else body + b"\n")
    return b"".join(parts)
