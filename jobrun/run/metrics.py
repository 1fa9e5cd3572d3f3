"""``--metrics-file``: a Prometheus textfile (node_exporter collector), written atomically."""

from __future__ import annotations

import contextlib
import errno
import os
import re
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from structlog.typing import FilteringBoundLogger

#: Every outcome a run or skip can end with; each gets a series, 1 for the last one.
OUTCOMES = ("succeeded", "failed", "timed_out", "lock_lost", "exec_failed", "skipped")
KEY_PLACEHOLDER = "{key}"
_UNSAFE = re.compile(r"[^A-Za-z0-9_.-]")


@dataclass(frozen=True)
class Sample:
    """What one jobrun invocation reports; None means "keep what the file said before"."""

    key: str
    outcome: str
    exit_code: int
    #: When this invocation started (Unix time, the host's clock).
    started: float
    #: When it finished (Unix time); counts as the last success when ``outcome`` succeeded.
    finished: float
    #: How long the child ran; None for a skip (the last run's duration is kept).
    duration: float | None
    skip_streak: int | None
    failure_streak: int | None


def path_for(template: str, key: str) -> str:
    """``template`` with ``{key}`` replaced by a file-name-safe form of the key."""
    return template.replace(KEY_PLACEHOLDER, _UNSAFE.sub("_", key))


def write(template: str, sample: Sample, log: FilteringBoundLogger) -> None:
    """Write the metrics of ``sample`` to the file; a problem is one warning line, never more."""
    path = path_for(template, sample.key)
    try:
        import prometheus_client  # noqa: PLC0415 - only with --metrics-file
    except ImportError:
        log.warning(
            "metrics_unavailable",
            path=path,
            hint=(
                "--metrics-file needs prometheus-client: install jobrun with the metrics extra "
                "(docs/install.md), or use the single file, which carries it"
            ),
        )
        return
    try:
        previous = _previous(path, sample.key)
        registry = prometheus_client.CollectorRegistry()
        for name, help_text, value in _values(sample, previous):
            gauge = prometheus_client.Gauge(name, help_text, ["key"], registry=registry)
            gauge.labels(key=sample.key).set(value)
        outcome = prometheus_client.Gauge(
            "jobrun_last_outcome",
            "1 for the outcome of the last run or skip, 0 for the others.",
            ["key", "outcome"],
            registry=registry,
        )
        for name in OUTCOMES:
            outcome.labels(key=sample.key, outcome=name).set(1 if name == sample.outcome else 0)
        _replace(path, prometheus_client.generate_latest(registry))
    except OSError as exc:
        log.warning("metrics_failed", path=path, error=_reason(exc))
    except ValueError as exc:
        log.warning("metrics_failed", path=path, error=str(exc))


def _replace(path: str, data: bytes) -> None:
    """Make ``data`` the file ``path``: a new file in its directory, then rename(2) over it.

    The collector never reads half a file. WARNING: the new file's name is random and it is
    created with O_EXCL|O_NOFOLLOW (mkstemp): a name known in advance (``path.PID``) in a
    directory another user can write lets them plant a symbolic link there first, and
    jobrun (root, often) would write through it.
    """
    target = Path(path).absolute()
    fd, name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    temporary = Path(name)
    try:
        with os.fdopen(fd, "wb") as file:
            os.fchmod(file.fileno(), 0o644)  # node_exporter reads it as another user
            file.write(data)
        temporary.replace(target)
    except BaseException:
        with contextlib.suppress(OSError):
            temporary.unlink()
        raise


def _reason(exc: OSError) -> str:
    if exc.errno == errno.ELOOP:
        return "is a symbolic link, which jobrun neither follows nor replaces"
    return f"{exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else "")


def _values(sample: Sample, previous: dict[str, float]) -> list[tuple[str, str, float]]:
    succeeded = sample.outcome == "succeeded"
    return [
        (
            "jobrun_last_start_timestamp_seconds",
            "When the last run or skip of the key started (Unix time).",
            sample.started,
        ),
        (
            "jobrun_last_success_timestamp_seconds",
            "When the last successful run of the key finished (Unix time; 0: none recorded).",
            sample.finished if succeeded else previous.get("last_success_timestamp_seconds", 0.0),
        ),
        (
            "jobrun_last_duration_seconds",
            "How long the child of the last run that started one ran.",
            sample.duration
            if sample.duration is not None
            else previous.get("last_duration_seconds", 0.0),
        ),
        (
            "jobrun_last_exit_code",
            "jobrun's exit status of the last run or skip.",
            float(sample.exit_code),
        ),
        (
            "jobrun_skip_streak",
            "Skips in a row (0 once a run starts).",
            _streak(sample.skip_streak, sample.outcome == "skipped", previous, "skip_streak"),
        ),
        (
            "jobrun_failure_streak",
            "Failed runs in a row (0 once a run succeeds).",
            _failure_streak(sample, previous),
        ),
    ]


def _streak(known: int | None, extends: bool, previous: dict[str, float], name: str) -> float:
    """The streak from the history, or else counted on from the file's last value."""
    if known is not None:
        return float(known)
    return previous.get(name, 0.0) + 1 if extends else 0.0


def _failure_streak(sample: Sample, previous: dict[str, float]) -> float:
    if sample.outcome == "skipped":  # a skip says nothing about whether the job works
        return previous.get("failure_streak", 0.0)
    failed = sample.outcome != "succeeded"
    return _streak(sample.failure_streak, failed, previous, "failure_streak")


def _previous(path: str, key: str) -> dict[str, float]:
    """The key's values in the file as it is now (without the ``jobrun_`` prefix), if any."""
    from prometheus_client.parser import text_string_to_metric_families  # noqa: PLC0415

    values: dict[str, float] = {}
    try:
        # O_NOFOLLOW: a symbolic link planted at the path is refused (ELOOP), never read or
        # replaced; O_NONBLOCK: a FIFO there is not a hang.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        with os.fdopen(fd, encoding="utf-8") as file:
            text = file.read()
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.labels.get("key") == key and sample.name.startswith("jobrun_"):
                    values[sample.name.removeprefix("jobrun_")] = float(sample.value)
    except FileNotFoundError:
        return {}
    except ValueError:  # not our format, or not text: start afresh
        return {}
    return values
