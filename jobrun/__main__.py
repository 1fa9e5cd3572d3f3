"""``python -m jobrun``."""

from jobrun.cli import main

main()
