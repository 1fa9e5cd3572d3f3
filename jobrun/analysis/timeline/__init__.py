"""``jobrun timeline``: the runs of some jobs, their overlaps and deadlocks, as one picture."""
