#!/usr/bin/env python3
"""Nightly invoices, fixed: lock both rows first, in id order, then update them.

Every job that touches several accounts takes their row locks in one global order (by id),
so two jobs can make each other wait, but never each wait for the other.
"""

import os
import time

from pgjob import psycopg

PAUSE = float(os.environ.get("EXAMPLE_PAUSE", "2"))

with psycopg.connect() as conn:
    conn.execute("SELECT id FROM accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE", ([1, 2],))
    conn.execute("UPDATE accounts SET balance = balance - 10 WHERE id = 1")  # customers
    time.sleep(PAUSE)
    conn.execute("UPDATE accounts SET balance = balance + 10 WHERE id = 2")  # fees
print("invoices: done")
