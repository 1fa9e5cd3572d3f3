"""psycopg for the example's jobs: this python3's, else that of the Python jobrun runs under.

With jobrun from pipx (or a venv of its own) the system python3 has no psycopg, but jobrun's
own environment has: a job started without it runs itself again with that interpreter,
read from the #! line of the jobrun on PATH. The single file (jobrun.pyz) runs under the
host's python3 and brings no psycopg to it: there, apt install python3-psycopg.
"""

import os
import re
import shutil
import sys

#: Set for the second start: a job never runs itself again twice.
_AGAIN = "EXAMPLE_PSYCOPG_FROM_JOBRUN"


def _jobrun_python() -> str | None:
    """The interpreter of the jobrun on PATH, when it is a Python of its own (else None)."""
    found = shutil.which("jobrun")
    if found is None:
        return None
    try:
        with open(os.path.realpath(found), "rb") as script:  # noqa: PTH123 - two lines of it
            head = script.read(1024).decode(errors="replace")
    except OSError:
        return None
    # pip writes "#!/path/python", or for a long or spaced path a shell line that execs it.
    line = re.match(r"#!(\S+)", head) or re.search(r"exec' \"?([^\"\n]+)\"? \"\$0\"", head)
    python = line[1] if line else None
    if python is None or os.path.basename(python) in {"env", "sh"}:  # noqa: PTH119
        return None
    return python if os.access(python, os.X_OK) else None


try:
    import psycopg
except ModuleNotFoundError:
    python = _jobrun_python()
    if python is None or os.environ.get(_AGAIN):
        sys.exit(
            f"{sys.argv[0]}: needs psycopg: install it for python3 (apt install "
            "python3-psycopg), or install jobrun with pipx or in a venv (docs/install.md)"
        )
    os.environ[_AGAIN] = "1"
    os.execv(python, [python, *sys.argv])  # noqa: S606 - the same script, another Python

__all__ = ["psycopg"]
