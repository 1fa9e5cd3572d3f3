"""The checkout's root on sys.path: benchmarks import harness/, which is not installed.

Run as ``python benchmarks/X.py``, a benchmark has benchmarks/ as sys.path[0], not the root.
The root is appended, not prepended: jobrun itself still comes from the environment.
"""

import sys
from pathlib import Path

ROOT = str(Path(__file__).resolve().parent.parent)
if ROOT not in sys.path:
    sys.path.append(ROOT)
