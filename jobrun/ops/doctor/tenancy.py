"""Tenancy: is every jobrun table guarded by row-level security, and what may this role do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from jobrun import sql
from jobrun.escape import printable
from jobrun.ops.doctor import query
from jobrun.ops.doctor.finding import FAIL, NOTE, OK, WARN, Finding
from jobrun.sql.tenants import GUARDED_TABLES

if TYPE_CHECKING:
    from jobrun.ops.doctor.query import Connection


def tenancy(conn: Connection) -> list[Finding]:
    """Row-level security on jobrun's tables, this role's grants, and its fencing tokens."""
    user, superuser, bypass, initialised, unguarded, owned, no_fence = query.one(
        conn, sql.DOCTOR_TENANCY, {"tables": list(GUARDED_TABLES)}
    )
    name = printable(user)
    findings = []
    if unguarded:
        tables = ", ".join(f"jobrun.{table}" for table in unguarded)
        fix = (
            "the owner runs jobrun init again"
            if initialised
            else "the owner runs jobrun init, then jobrun grant ROLE --keys PATTERN per role"
        )
        findings.append(
            Finding(
                WARN,
                "tenancy",
                f"{tables} shared with other roles without row-level security: any of them "
                f"can delete another job's lease, stop or pause it, or forge its history; {fix}",
            )
        )
    elif not initialised:
        findings.append(
            Finding(
                OK,
                "tenancy",
                "one owner (jobrun init not run: fine while no other role "
                "is granted jobrun's tables)",
            )
        )
    else:
        findings.extend(_granted(conn, name, superuser=superuser, bypass=bypass, owned=owned))
    if no_fence:
        findings.append(
            Finding(
                FAIL,
                "jobrun.fence",
                f"{name} may write the history but lacks USAGE on the sequence jobrun.fence: "
                f"--fence will exit 69; fix: jobrun grant {name} --keys PATTERN",
            )
        )
    return findings


def _granted(
    conn: Connection, name: str, *, superuser: bool, bypass: bool, owned: list[str]
) -> list[Finding]:
    """After jobrun init: how row-level security binds this role, and its grants."""
    if superuser or bypass:
        return [
            Finding(
                WARN,
                "tenancy",
                f"{name} bypasses row-level security (superuser or BYPASSRLS): it can change "
                "every key's rows; run jobs as roles granted with jobrun grant",
            )
        ]
    if owned:
        return [
            Finding(
                NOTE,
                "tenancy",
                f"{name} owns {', '.join(f'jobrun.{table}' for table in owned)}: row-level "
                "security does not bind the owner (trusted); run jobs as granted roles",
            )
        ]
    grants = conn.execute(sql.DOCTOR_GRANTS).fetchall()
    if not grants:
        return [
            Finding(
                WARN,
                "tenancy",
                f"{name} has no jobrun grant: row-level security hides every key from it "
                f"(no history, no lease); fix: jobrun grant {name} --keys PATTERN",
            )
        ]
    what = ", ".join(f"{kind} {printable(pattern)}" for kind, pattern in grants)
    return [Finding(OK, "tenancy", f"row-level security on; {name} may use: {what}")]
