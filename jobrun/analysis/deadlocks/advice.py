"""A suggested fix for a logged deadlock, where its DETAIL and CONTEXT tell the shape."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from jobrun.analysis.deadlocks.model import Deadlock

#: ``ExclusiveLock on advisory lock [16384,0,42,1]``: database, key high, key low, 1 for
#: one bigint key (2 for two int keys).
_ADVISORY = re.compile(r"advisory lock \[\d+,(?P<high>\d+),(?P<low>\d+),(?P<form>\d+)\]")
_RELATION = re.compile(r" on relation \d+ of database \d+")
#: The CONTEXT of the aborted side: ``while updating tuple (0,1) in relation "accounts"``.
_TUPLE = re.compile(r'while (?P<doing>\w+) tuple \(\d+,\d+\) in relation "(?P<table>[^"]+)"')
_INDEX = re.compile(r'while inserting index tuple \(\d+,\d+\) in relation "(?P<index>[^"]+)"')
#: The query a foreign key check runs: ``SELECT 1 FROM ONLY "public"."parents" x WHERE ...
#: FOR KEY SHARE OF x``.
_FOREIGN_KEY = re.compile(
    r'SELECT 1 FROM ONLY "[^"]+"\."(?P<parent>[^"]+)" x WHERE .* FOR KEY SHARE OF x'
)
_CHANGE = re.compile(r"\s*(UPDATE|DELETE)\b", re.IGNORECASE)


@dataclass(frozen=True)
class Suggestion:
    """The shape of a logged deadlock and the suggested fix (a suggestion, from the log)."""

    shape: str
    fix: str

    def as_json(self) -> dict[str, Any]:
        """``suggested_fix`` of a deadlock in ``--json``."""
        return {"shape": self.shape, "fix": self.fix}


def suggest(deadlock: Deadlock) -> Suggestion | None:
    """What the log tells of the cycle's shape, and the order that breaks it; None: too little.

    The log names the locks awaited but not the rows' keys: ``jobrun overlap`` on staging
    names those, and each job's lock order.
    """
    waits = [side.waits_for or "" for side in deadlock.sides]
    context = deadlock.context or ""
    if waits and all("advisory lock" in wait for wait in waits):
        keys = sorted(_advisory_key(wait) for wait in waits)
        return Suggestion(
            "advisory locks in opposite order",
            f"take advisory locks in ascending key order in every job ({', then '.join(keys)})",
        )
    if any(_RELATION.search(wait) for wait in waits):
        return Suggestion(
            "a table lock against row locks",
            "a table lock (LOCK TABLE, or DDL such as a migration's) met a job's row locks: "
            "take the table locks first, in one order, at the start of the transaction, or "
            "run the migration when the job cannot run (under its jobrun --key)",
        )
    index = _INDEX.search(context)
    if index:
        return Suggestion(
            "the same unique key inserted",
            f"both inserted keys of {index['index']} that the other had inserted and not "
            "committed: insert in ascending key order in every job (sort the batch)",
        )
    parent = _FOREIGN_KEY.search(context)
    if parent:
        return Suggestion(
            "a foreign key's share lock against a parent change",
            f"an insert's foreign key check locks its {parent['parent']} row (FOR KEY SHARE): "
            f"lock the {parent['parent']} rows first, in ascending key order, in every job",
        )
    return _rows(deadlock, waits, context)


def _rows(deadlock: Deadlock, waits: list[str], context: str) -> Suggestion | None:
    """Row waits: the same change of one row after sharing it, or rows in opposite order."""
    row = _TUPLE.search(context)
    if row and all(
        wait.startswith(("ShareLock on transaction", "ExclusiveLock on tuple")) for wait in waits
    ):
        statements = {" ".join((side.statement or "").split()) for side in deadlock.sides}
        table = row["table"]
        if (
            len(statements) == 1
            and "$" not in next(iter(statements))
            and _CHANGE.match(next(iter(statements)))
        ):
            return Suggestion(
                "a shared lock upgraded",
                f"both ran the same change of the same {table} row after sharing it (FOR "
                "SHARE, or a foreign key check): take FOR UPDATE at once where the row will "
                "be changed",
            )
        return Suggestion(
            "rows in opposite order",
            f"lock the {table} rows in one order (ascending key) in every job: `SELECT ... "
            "ORDER BY <key> FOR UPDATE` first (jobrun overlap on staging names each job's rows)",
        )
    return None


def _advisory_key(wait: str) -> str:
    match = _ADVISORY.search(wait)
    if match is None:
        return "?"
    high, low = int(match["high"]), int(match["low"])
    if match["form"] == "1":
        key = (high << 32) | low
        return str(key - (1 << 64) if key >= 1 << 63 else key)
    return f"({high}, {low})"
