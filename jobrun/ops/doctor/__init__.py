"""``jobrun doctor``: check the database, role, settings and capacity a run depends on."""

from jobrun.doctor.checks import diagnose
from jobrun.doctor.finding import Finding, exit_status, report

__all__ = ["Finding", "diagnose", "exit_status", "report"]
