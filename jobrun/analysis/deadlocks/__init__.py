"""``jobrun deadlocks``: find every deadlock in PostgreSQL server logs and name both sides."""

from jobrun.analysis.deadlocks.model import Deadlock
from jobrun.analysis.deadlocks.render import describe, json_of, report, run
from jobrun.analysis.deadlocks.scan import find

__all__ = ["Deadlock", "describe", "find", "json_of", "report", "run"]
