"""``jobrun overlap``: run two commands against each other on purpose and catch their deadlocks."""

from jobrun.analysis.overlap.model import JOBS, Lock, Session, Wait, find_cycle
from jobrun.analysis.overlap.render import summary, text
from jobrun.analysis.overlap.report import Attempt, Report
from jobrun.analysis.overlap.run import Plan, Schedule, environment, parse_command, parse_start, run
from jobrun.analysis.overlap.watch import app_name

__all__ = [
    "JOBS",
    "Attempt",
    "Lock",
    "Plan",
    "Report",
    "Schedule",
    "Session",
    "Wait",
    "app_name",
    "environment",
    "find_cycle",
    "parse_command",
    "parse_start",
    "run",
    "summary",
    "text",
]
