"""Test harness shipped with jobrun: private PostgreSQL servers, fault proxies, PgBouncer.

Used by jobrun's own tests and benchmarks, never by a run (nothing in jobrun imports it):
``pgserver`` (throwaway servers: create, stop, crash, start; ``pgtools`` around them),
``proxy`` (a TCP proxy that cuts, pauses or black-holes), ``delay_proxy`` (a distant
database), ``pgbouncer``, ``failover`` (a primary and its standby), ``statement_log`` (a
server's statements counted), ``jobrun_cli`` (the real CLI as a subprocess),
``overlap_scenarios`` (deadlocking pairs), ``memory`` (a lock in this process, for tests
without a server) and ``bench`` (what benchmarks share: a timed run, a ping endpoint, the
run done by hand that a run is held against).
"""
