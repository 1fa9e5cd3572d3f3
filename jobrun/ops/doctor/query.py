"""How a check asks the server: one row of a query, or settings by name."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg

from jobrun import sql

if TYPE_CHECKING:
    from collections.abc import Iterable

    Connection = psycopg.Connection[tuple[Any, ...]]


def one(conn: Connection, query: str, params: dict[str, object] | None = None) -> tuple[Any, ...]:
    """The one row a doctor query returns."""
    row = conn.execute(query, params).fetchone()
    if row is None:  # pragma: no cover - every doctor query returns one row
        raise psycopg.DataError("no row")
    return row


def settings(conn: Connection, names: Iterable[str]) -> dict[str, tuple[str, str]]:
    """Each setting this server knows, by name: (raw value, as SHOW prints it)."""
    rows = conn.execute(sql.DOCTOR_SETTINGS, {"names": list(names)}).fetchall()
    return {str(name): (str(setting), str(shown)) for name, setting, _unit, shown in rows}
