"""``jobrun deadlocks`` on logs as they arrive in the wild, each built from a real server's log.

Every log here starts as what a real server wrote around a real deadlock. Where this
machine cannot produce the wrapping itself (syslog, Heroku, Cloud SQL, CloudNativePG,
Azure, a container runtime), the test wraps the real lines the way that system does, and
its docstring says so.
"""

from __future__ import annotations

import bz2
import csv
import io
import json
import lzma
import re
from typing import TYPE_CHECKING

import pytest
from test_deadlocks import (  # the same private logging server and deadlock, once per module
    JOBS,
    PREFIX_WITH_APP,
    logged_deadlock,
    logging_server,
    only_deadlock,
)

from harness import jobrun_cli
from jobrun.analysis import deadlocks

if TYPE_CHECKING:
    from collections.abc import Callable

__all__ = ["logging_server"]  # a fixture, imported for this module's tests

#: Debian and Ubuntu's default log_line_prefix.
DEBIAN = "%m [%p] %q%u@%d "
#: csvlog's columns, named as CloudNativePG names the fields of its JSON ``record``.
CSV_COLUMNS = [
    "log_time",
    "user_name",
    "database_name",
    "process_id",
    "connection_from",
    "session_id",
    "session_line_num",
    "command_tag",
    "session_start_time",
    "virtual_transaction_id",
    "transaction_id",
    "error_severity",
    "sql_state_code",
    "message",
    "detail",
    "hint",
    "internal_query",
    "internal_query_pos",
    "context",
    "query",
    "query_pos",
    "location",
    "application_name",
    "backend_type",
    "leader_pid",
    "query_id",
]


def messages(text: str) -> list[str]:
    """A stderr log cut into messages: a line and the tab-indented lines after it."""
    return re.split(r"\n(?!\t)", text.rstrip("\n"))


def pid_of(message: str) -> str:
    """The pid in a message's ``[pid]``."""
    found = re.search(r"\[(\d+)\]", message)
    assert found, message
    return found[1]


def as_syslog(text: str) -> str:
    """Lines as PostgreSQL sends them to syslog and rsyslog writes them to a file.

    One record per line of a message, numbered ``[message-line]``; a tab written ``#011``.
    """
    out = []
    for seq, message in enumerate(messages(text), start=1):
        pid = pid_of(message)
        for chunk, line in enumerate(message.split("\n"), start=1):
            body = line.replace("\t", "#011")
            out.append(f"Dec  1 02:00:04 db1 postgres[{pid}]: [{seq}-{chunk}] {body}\n")
    return "".join(out)


def as_logplex(text: str) -> str:
    """``heroku logs -p postgres``: a Heroku envelope around the syslog records.

    The server's prefix is ``[%p] sql_error_code = %e ``; the ``[%p] `` is cut here, as
    Heroku carries the pid in ``app[postgres.PID]`` and its prefix is ``sql_error_code =
    %e ``.
    """
    out = []
    for seq, message in enumerate(messages(text), start=1):
        pid = pid_of(message)
        for chunk, line in enumerate(message.split("\n"), start=1):
            body = re.sub(r"^\[\d+\] ", "", line).replace("\t", "#011")
            out.append(
                f"2026-12-01T02:00:04.{seq:06d}+00:00 app[postgres.{pid}]: [DATABASE] "
                f"[{seq}-{chunk}] {body}\n"
            )
    return "".join(out)


def cloud_records(text: str) -> list[dict[str, object]]:
    """Cloud SQL's records: a message in ``textPayload``, the time in ``timestamp``."""
    return [
        {
            "insertId": f"s{n}",
            "logName": "projects/p/logs/cloudsql.googleapis.com%2Fpostgres.log",
            "receiveTimestamp": f"2026-12-01T02:00:05.{n:06d}Z",
            "resource": {"labels": {"database_id": "p:db1"}, "type": "cloudsql_database"},
            "severity": "INFO",
            "textPayload": message,
            "timestamp": f"2026-12-01T02:00:04.{n:06d}Z",
        }
        for n, message in enumerate(messages(text), start=1)
    ]


def as_cloud_lines(text: str) -> str:
    """The Logs Explorer's JSON download: one record per line, oldest first."""
    return "".join(json.dumps(record) + "\n" for record in cloud_records(text))


def as_cloud_array(text: str) -> str:
    """``gcloud logging read --format=json``: one indented array, newest record first."""
    return json.dumps(cloud_records(text)[::-1], indent=2) + "\n"


def lead(prefix: str) -> Callable[[str], str]:
    """Every line behind a container log tool's lead (tab-indented lines too)."""
    return lambda text: "".join(prefix + line + "\n" for line in text.rstrip("\n").split("\n"))


def csv_rows(text: str) -> list[dict[str, str]]:
    """A real csvlog's records, by CloudNativePG's names for their columns."""
    return [dict(zip(CSV_COLUMNS, row, strict=False)) for row in csv.reader(io.StringIO(text))]


def as_cloudnativepg(text: str) -> str:
    """``kubectl logs --prefix`` of a CloudNativePG pod: its JSON lines, built from csvlog.

    CloudNativePG reads the server's csvlog and prints each record as ``{"level", "ts",
    "logger": "postgres", "msg": "record", "logging_pod", "record": {csvlog's columns}}``,
    among records of its own other loggers.
    """
    setup = {"level": "info", "ts": "2026-12-01T02:00:00Z", "logger": "setup", "msg": "started"}
    out = [f"[pod/pg-1/postgres] {json.dumps(setup)}\n"]
    for row in csv_rows(text):
        record = {
            "level": "info",
            "ts": "2026-12-01T02:00:04.000000Z",
            "logger": "postgres",
            "msg": "record",
            "logging_pod": "pg-1",
            "record": row,
        }
        out.append(f"[pod/pg-1/postgres] {json.dumps(record)}\n")
    return "".join(out)


def as_azure(text: str) -> str:
    """Azure Log Analytics (``AzureDiagnostics``) rows as JSON: csvlog's columns renamed.

    Each column becomes ``record_<name>_s``, as in a query's JSON export.
    """
    return "".join(
        json.dumps({"Category": "PostgreSQLLogs"} | {f"record_{k}_s": v for k, v in row.items()})
        + "\n"
        for row in csv_rows(text)
    )


#: (server log file, server prefix, wrapping, format reported)
WRAPPINGS = {
    "syslog": ("stderr", PREFIX_WITH_APP, as_syslog, "syslog"),
    "heroku-logplex": ("stderr", "[%p] sql_error_code = %e ", as_logplex, "logplex"),
    "cloud-sql-lines": ("stderr", "[%p]: [%l-1] db=%d,user=%u ", as_cloud_lines, "exported-json"),
    "cloud-sql-array": ("stderr", "[%p]: [%l-1] db=%d,user=%u ", as_cloud_array, "exported-json"),
    "docker-compose": ("stderr", PREFIX_WITH_APP, lead("dev-postgres-1  | "), "stderr"),
    "kubectl-prefix": ("stderr", PREFIX_WITH_APP, lead("[pod/pg-0/postgres] "), "stderr"),
    "kubectl-timestamps": (
        "stderr",
        PREFIX_WITH_APP,
        lead("[pod/pg-0/postgres] 2026-12-01T02:00:04.123456789Z "),
        "stderr",
    ),
    "rds-cloudwatch": ("stderr", "%t:%r:%u@%d:[%p]:", lead("2026-12-01T02:00:04.123Z "), "stderr"),
    "cloudnativepg": ("csv", PREFIX_WITH_APP, as_cloudnativepg, "cloudnativepg"),
    "azure-log-analytics": ("csv", PREFIX_WITH_APP, as_azure, "azure"),
}


class TestWrappedRealLogs:
    """A real server's log, wrapped as each platform delivers it: both jobs still named."""

    @pytest.mark.parametrize("name", list(WRAPPINGS))
    def test_both_jobs_are_named_through_every_wrapping(self, logging_server, tmp_path, name):
        """syslog, Heroku, Cloud SQL, compose, kubectl, CloudWatch, CloudNativePG, Azure.

        ``kubectl-timestamps`` is ``kubectl logs --prefix --timestamps``; ``rds-cloudwatch``
        an RDS log with the time CloudWatch puts before each line.
        """
        fmt, prefix, wrap, reported = WRAPPINGS[name]
        logs = logged_deadlock(logging_server, tmp_path, prefix)
        wrapped = tmp_path / f"{name}.log"
        wrapped.write_text(wrap(logs[fmt].read_text()))
        found = deadlocks.find([str(wrapped)])
        assert found.files[0].format == reported, deadlocks.report(found)
        (deadlock,) = found.deadlocks
        assert {side.application for side in deadlock.sides} == set(JOBS)
        assert all(side.statement for side in deadlock.sides), deadlock
        assert deadlock.time is not None


class TestRealLogs:
    """Logs a real server wrote with layouts and settings seen in the wild."""

    def test_debians_default_prefix_reads_user_and_database(self, logging_server, tmp_path):
        """``%m [%p] %q%u@%d``: user@db is a user and a database, not an application name."""
        logs = logged_deadlock(logging_server, tmp_path, DEBIAN)
        found = deadlocks.find([str(logs["stderr"])])
        (deadlock,) = found.deadlocks
        assert found.files[0].prefix == DEBIAN
        assert (deadlock.user, deadlock.db) == ("postgres", "postgres")
        # log_connections names both sessions; no side is named "postgres@postgres".
        assert {side.application for side in deadlock.sides} == set(JOBS)

    def test_azures_prefix_is_recognised(self, logging_server, tmp_path):
        """Azure Database for PostgreSQL's ``%t-%c-``: the pid read from the session id."""
        logs = logged_deadlock(logging_server, tmp_path, "%t-%c-")
        deadlock = only_deadlock(logs["stderr"])
        assert {side.application for side in deadlock.sides} == set(JOBS)

    @pytest.mark.parametrize("pack", [bz2.compress, lzma.compress])
    def test_bzip2_and_xz_logs_are_unpacked(self, logging_server, tmp_path, pack):
        """A rotated log packed with bzip2 or xz is read like the plain one."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        packed = tmp_path / "pg.log.packed"
        packed.write_bytes(pack(logs["stderr"].read_bytes()))
        deadlock = only_deadlock(packed)
        assert {side.application for side in deadlock.sides} == set(JOBS)

    def test_csvlog_and_jsonlog_of_one_server_count_a_deadlock_once(self, logging_server, tmp_path):
        """The same deadlock in the csvlog and the jsonlog: one deadlock, seen in both."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        found = deadlocks.find([str(logs["csv"]), str(logs["json"]), str(logs["stderr"])])
        (deadlock,) = found.deadlocks
        assert deadlock.also_in == [str(logs["json"]), str(logs["stderr"])]
        assert [read.duplicates for read in found.files] == [0, 1, 1]

    def test_a_log_copied_through_a_terminal_keeps_every_side(self, logging_server, tmp_path):
        """Tabs turned into spaces: both sides and statements read, and the report says so."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        copied = tmp_path / "pasted.log"
        copied.write_text(logs["stderr"].read_text().replace("\t", "        "))
        found = deadlocks.find([str(copied)])
        (deadlock,) = found.deadlocks
        assert {side.application for side in deadlock.sides} == set(JOBS)
        assert all(side.waits_for and side.statement for side in deadlock.sides)
        assert "looks re-indented" in deadlocks.report(found)

    def test_a_prefix_that_reads_nothing_exits_65_even_with_check(self, logging_server, tmp_path):
        """--log-line-prefix that matches no line of a non-empty log: 65, never a quiet 0."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        result = jobrun_cli.run(
            "deadlocks", "--check", "--log-line-prefix", "%t:%r:", str(logs["stderr"]), dsn=None
        )
        assert result.returncode == 65, result.stdout
        (line,) = result.stderr.strip().splitlines()
        assert "reads no entry" in line

    def test_one_unreadable_file_does_not_hide_the_others(self, logging_server, tmp_path):
        """Two logs and a stranger: both deadlocks printed, the stranger named, exit 65."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        stranger = tmp_path / "notes.txt"
        stranger.write_text("shopping list\nmilk\n")
        result = jobrun_cli.run(
            "deadlocks", str(logs["stderr"]), str(stranger), str(logs["csv"]), dsn=None
        )
        assert result.returncode == 65, result.stderr
        assert all(job in result.stdout for job in JOBS)
        assert f"{stranger}: not read" in result.stdout
        assert "1 deadlock(s) in 3 file(s), 1 not read" in result.stdout
        (line,) = result.stderr.strip().splitlines()
        assert str(stranger) in line

    def test_a_job_retrying_into_the_same_deadlock_is_a_storm(self, logging_server, tmp_path):
        """Two deadlocks of the same two jobs seconds apart: reported as a retry storm."""
        logs = logged_deadlock(logging_server, tmp_path, PREFIX_WITH_APP)
        (tmp_path / "again").mkdir()
        again = logged_deadlock(logging_server, tmp_path / "again", PREFIX_WITH_APP)
        both = tmp_path / "both.csv"
        both.write_bytes(logs["csv"].read_bytes() + again["csv"].read_bytes())
        found = deadlocks.find([str(both)])
        assert len(found.deadlocks) == 2
        (storm,) = found.storms
        assert storm.sides == sorted(JOBS)
        assert "one deadlock turned into a storm" in deadlocks.report(found)
