"""Run history in ``jobrun.runs``: config, database calls, run rows, alerts (one module each)."""
