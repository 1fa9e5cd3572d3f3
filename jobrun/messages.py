"""Several statements as ONE message: one round trip to a distant database, not one each."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import psycopg

if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

    Connection = psycopg.Connection[Any]


def results(
    conn: Connection, statements: Sequence[str], params: Mapping[str, object]
) -> list[list[tuple[Any, ...]]]:
    """The rows of each statement (none for a statement without rows), in order.

    Bound on the client, the statements go joined by ";" as one simple-protocol message,
    which the server runs as one implicit transaction (settings made local end with it): an
    error in any of them fails the whole, and on an autocommit connection nothing is left
    open. Literal percent signs in the statements must be doubled.
    """
    cursor = psycopg.ClientCursor(conn)
    cursor.execute(";\n".join(statements), params)
    found = [cursor.fetchall() if cursor.description else []]
    while cursor.nextset():
        found.append(cursor.fetchall() if cursor.description else [])
    return found
