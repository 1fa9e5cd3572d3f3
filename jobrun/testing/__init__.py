"""Test harness shipped with jobrun: private PostgreSQL servers, fault proxies, PgBouncer.

Used by jobrun's own tests and benchmarks, never by a run (nothing in jobrun imports it):
``pgserver`` (throwaway servers: create, stop, crash, start), ``proxy`` (a TCP proxy that
cuts, pauses or black-holes), ``pgbouncer``, ``failover`` (a primary and its standby),
``jobrun_cli`` (the real CLI as a subprocess) and ``overlap_scenarios`` (deadlocking pairs).
"""
