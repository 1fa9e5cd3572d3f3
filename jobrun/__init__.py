"""jobrun: run a scheduled job at most once at a time, guarded by PostgreSQL."""

__version__ = "0.1.0"
