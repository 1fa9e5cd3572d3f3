"""The guarded run: its settings, assembly, child, watchdog and what it tells the outside."""
