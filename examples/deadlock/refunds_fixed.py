#!/usr/bin/env python3
"""Nightly refunds, fixed: lock both rows first, in id order, then update them."""

import os
import time

from pgjob import psycopg

PAUSE = float(os.environ.get("EXAMPLE_PAUSE", "2"))

with psycopg.connect() as conn:
    conn.execute("SELECT id FROM accounts WHERE id = ANY(%s) ORDER BY id FOR UPDATE", ([1, 2],))
    conn.execute("UPDATE accounts SET balance = balance - 5 WHERE id = 2")  # fees
    time.sleep(PAUSE)
    conn.execute("UPDATE accounts SET balance = balance + 5 WHERE id = 1")  # customers
print("refunds: done")
