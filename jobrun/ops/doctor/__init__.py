"""``jobrun doctor``: check the database, role, settings and capacity a run depends on."""

from jobrun.ops.doctor.checks import diagnose
from jobrun.ops.doctor.finding import Finding, exit_status, report

__all__ = ["Finding", "diagnose", "exit_status", "report"]
