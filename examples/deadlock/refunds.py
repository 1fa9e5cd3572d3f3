#!/usr/bin/env python3
"""Nightly refunds: take back fees, then pay customers (locks row 2, then 1).

The opposite order to invoices.py: when the two overlap, each waits for the other's row.
"""

import os
import time

from pgjob import psycopg

PAUSE = float(os.environ.get("EXAMPLE_PAUSE", "2"))

with psycopg.connect() as conn:
    conn.execute("UPDATE accounts SET balance = balance - 5 WHERE id = 2")  # fees
    time.sleep(PAUSE)
    conn.execute("UPDATE accounts SET balance = balance + 5 WHERE id = 1")  # customers
print("refunds: done")
