#!/usr/bin/env python3
"""Nightly invoices: charge customers, then credit the fees account (locks row 1, then 2).

The connection comes from the libpq environment (PGHOST, PGDATABASE, ... or PGSERVICE);
under jobrun, PGAPPNAME names its session jobrun:<key> in pg_stat_activity and the log.
"""

import os
import time

from pgjob import psycopg

#: The work between the two updates (rendering invoices): long enough to overlap.
PAUSE = float(os.environ.get("EXAMPLE_PAUSE", "2"))

with psycopg.connect() as conn:
    conn.execute("UPDATE accounts SET balance = balance - 10 WHERE id = 1")  # customers
    time.sleep(PAUSE)
    conn.execute("UPDATE accounts SET balance = balance + 10 WHERE id = 2")  # fees
print("invoices: done")
