"""``jobrun deadlocks``: find every deadlock in PostgreSQL server logs and name both sides."""

from jobrun.deadlocks.model import Deadlock
from jobrun.deadlocks.render import describe, report, run
from jobrun.deadlocks.scan import find

__all__ = ["Deadlock", "describe", "find", "report", "run"]
