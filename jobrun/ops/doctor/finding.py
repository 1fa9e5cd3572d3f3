"""A doctor's finding and its statuses, and the report and exit status findings make."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Iterable

OK, NOTE, WARN, FAIL, UNKNOWN = "OK", "NOTE", "WARN", "FAIL", "UNKNOWN"
#: A check that could not run proves nothing: it fails the doctor like a FAIL does.
FAILING = frozenset({FAIL, UNKNOWN})


@dataclass(frozen=True)
class Finding:
    """One line of the report."""

    status: str  # OK, NOTE, WARN, FAIL or UNKNOWN
    check: str
    detail: str

    def as_json(self) -> dict[str, str]:
        """``{"check": ..., "status": ..., "detail": ...}``."""
        return {"check": self.check, "status": self.status, "detail": self.detail}


def exit_status(findings: Iterable[Finding]) -> int:
    """0 when every check ran and nothing FAILs, else 1."""
    return 1 if any(finding.status in FAILING for finding in findings) else 0


def report(findings: Iterable[Finding]) -> str:
    """``STATUS  CHECK  DETAIL`` lines, aligned."""
    rows = list(findings)
    width = max((len(row.check) for row in rows), default=0)
    status_width = max((len(row.status) for row in rows), default=4)
    return "\n".join(
        f"{row.status:<{status_width}}  {row.check:<{width}}  {row.detail}" for row in rows
    )
