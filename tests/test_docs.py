"""The README says what the code does: exit codes, examples, install and test commands."""

from __future__ import annotations

import re
from pathlib import Path

from jobrun.exitcodes import TABLE

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


class TestReadme:
    """The README's promises that code can check."""

    def test_exit_code_table_matches_the_code(self):
        """The table between the exit-codes markers is exactly jobrun.exitcodes.TABLE."""
        block = README.split("<!-- exit-codes")[1].split("<!-- /exit-codes -->")[0]
        rows = re.findall(r"^\| (.+?) \| (.+?) \|$", block, flags=re.MULTILINE)
        assert rows[1:] == list(TABLE)  # after the header row

    def test_ci_runs_the_readme_test_command(self):
        """.ci/run ends with the test command the README gives."""
        readme_command = README.split("## Running the tests")[1].split("```")[1].strip()
        ci = (ROOT / ".ci" / "run").read_text().strip().splitlines()
        assert ci[-1] == readme_command

    def test_examples_exist(self):
        """Every example the README links to is in the tree."""
        for link in re.findall(r"\]\((examples/[^)]+)\)", README):
            assert (ROOT / link).exists(), link
