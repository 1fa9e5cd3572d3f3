"""Test helpers: private PostgreSQL servers, a fault-injecting TCP proxy and PgBouncer."""
