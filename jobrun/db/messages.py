"""Several statements as ONE message: one round trip to a distant database, not one each."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, TypeVar

import psycopg
from psycopg.rows import dict_row

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    Connection = psycopg.Connection[Any]

R = TypeVar("R")


def results(
    conn: Connection, statements: Sequence[str], params: Mapping[str, object]
) -> list[list[tuple[Any, ...]]]:
    """The rows of each statement (none for a statement without rows), in order.

    Bound on the client, the statements go joined by ";" as one simple-protocol message,
    which the server runs as one implicit transaction (settings made local end with it): an
    error in any of them fails the whole, and on an autocommit connection nothing is left
    open. Literal percent signs in the statements must be doubled.
    """
    return _sets(psycopg.ClientCursor(conn), statements, params)


def dict_results(
    conn: Connection, statements: Sequence[str], params: Mapping[str, object]
) -> list[list[dict[str, Any]]]:
    """As ``results``, each row a dict by column name."""
    return _sets(psycopg.ClientCursor(conn, row_factory=dict_row), statements, params)


def _sets(
    cursor: psycopg.ClientCursor[R], statements: Sequence[str], params: Mapping[str, object]
) -> list[list[R]]:
    cursor.execute(";\n".join(statements), params)
    found = [cursor.fetchall() if cursor.description else []]
    while cursor.nextset():
        found.append(cursor.fetchall() if cursor.description else [])
    return found
