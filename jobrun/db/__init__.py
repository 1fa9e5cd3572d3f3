"""Connecting to PostgreSQL the libpq way, and translating psycopg errors at this boundary.

Split by job: ``dsn`` (a connection string and what may be shown of it), ``connecting``
(a bounded, settings-pinned connection), ``errors`` (a database error as jobrun's) and
``pooler`` (the transaction-pooler probe). Every name is here too: ``db.connect``.
"""

from __future__ import annotations

from .connecting import (
    APPLICATION_NAME_BYTES,
    PINNED_SETTINGS,
    REFUSED,
    SLOW_CONNECT,
    UNREACHABLE,
    Connection,
    application_name,
    classify,
    connect,
    cut,
    text_param,
)
from .dsn import Target, describe, parse_dsn, redact
from .errors import one_line, translate_errors, unavailable
from .pooler import backend_pid, detect_transaction_pooler

__all__ = [
    "APPLICATION_NAME_BYTES",
    "PINNED_SETTINGS",
    "REFUSED",
    "SLOW_CONNECT",
    "UNREACHABLE",
    "Connection",
    "Target",
    "application_name",
    "backend_pid",
    "classify",
    "connect",
    "cut",
    "describe",
    "detect_transaction_pooler",
    "one_line",
    "parse_dsn",
    "redact",
    "text_param",
    "translate_errors",
    "unavailable",
]
