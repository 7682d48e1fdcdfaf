"""The README's headline table is what the committed results.json produces."""

import pytest

from lab.book import readme
from lab.results import COMMITTED, REPO_ROOT, read


def test_readme_table_is_current():
    if not COMMITTED.exists():
        pytest.skip("no committed results.json yet")
    text = (REPO_ROOT / "README.md").read_text()
    assert readme.block(read(COMMITTED)) in text, "README is stale: run `python -m lab.book.readme` (make results does)"


def test_readme_names_the_two_commands():
    text = (REPO_ROOT / "README.md").read_text()
    assert "make test" in text and "make results" in text
    mk = (REPO_ROOT / "Makefile").read_text()
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "\ntest:" in mk and "\nresults:" in mk
