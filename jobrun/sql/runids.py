"""Statements that find a run by what a person types: a run id's first digits, or a key."""

from __future__ import annotations

#: Runs whose id lies between the prefix padded with 0s and with fs (the primary key's
#: index answers it); two are enough to tell a unique prefix from an ambiguous one, a few
#: more to list in the error.
RUN_IDS_BY_PREFIX = """
SELECT run_id, key, started_at FROM jobrun.runs
WHERE run_id BETWEEN %(low)s::uuid AND %(high)s::uuid
ORDER BY started_at DESC
LIMIT %(limit)s
"""

#: The newest run of a key label that kept output (``--keep-output``).
NEWEST_KEPT_OF_KEY = """
SELECT run_id FROM jobrun.runs
WHERE key = %(key)s AND (stdout_tail IS NOT NULL OR stderr_tail IS NOT NULL)
ORDER BY started_at DESC
LIMIT 1
"""
