"""Fixtures that several test files share: databases, roles and teams of a test's own."""

from __future__ import annotations

import uuid
from typing import TYPE_CHECKING

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from harness import jobrun_cli
from harness.pgtools import create_database, drop_database
from support.tenants import Teams, ok

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator


@pytest.fixture
def fresh_dsn(pg_admin_dsn: str) -> Iterator[str]:
    """A database of this test's own, without the jobrun schema."""
    name = f"jobrun_fresh_{uuid.uuid4().hex[:12]}"
    create_database(pg_admin_dsn, name)
    try:
        yield make_conninfo(pg_admin_dsn, dbname=name)
    finally:
        drop_database(pg_admin_dsn, name)


@pytest.fixture
def role(dsn: str, pg_admin_dsn: str) -> Iterator[Callable[..., str]]:
    """``make(*statements, database_dsn=dsn) -> dsn``: a login role of this test's own.

    Each statement runs in that database with ``{role}`` standing for the new role's name,
    e.g. ``"GRANT USAGE ON SCHEMA jobrun TO {role}"``; without any, the role may only log in.
    The roles are dropped after the test, with everything they own.
    """
    made: list[tuple[str, str]] = []

    def make(*statements: str, database_dsn: str | None = None) -> str:
        name = f"jobrun_role_{uuid.uuid4().hex[:10]}"
        target = database_dsn or dsn
        made.append((name, target))
        with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE ROLE {} LOGIN").format(sql.Identifier(name)))
        with psycopg.connect(target, autocommit=True) as conn:
            for statement in statements:
                conn.execute(sql.SQL(statement).format(role=sql.Identifier(name)))
        return make_conninfo(target, user=name)

    yield make
    for name, target in made:
        with psycopg.connect(target, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(name)))
        with psycopg.connect(pg_admin_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP ROLE IF EXISTS {}").format(sql.Identifier(name)))


@pytest.fixture
def teams(fresh_dsn: str, role: Callable[..., str]) -> Teams:
    """team_a may use a-* keys, team_b b-* keys; both are LOGIN roles of this test."""
    ok(jobrun_cli.run("init", dsn=fresh_dsn))
    team_a = role(database_dsn=fresh_dsn)
    team_b = role(database_dsn=fresh_dsn)
    ok(jobrun_cli.run("grant", Teams.role_of(team_a), "--keys", "a-*", dsn=fresh_dsn))
    ok(jobrun_cli.run("grant", Teams.role_of(team_b), "--keys", "b-*", dsn=fresh_dsn))
    return Teams(owner=fresh_dsn, a=team_a, b=team_b)
