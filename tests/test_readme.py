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


def test_durations_sum_the_sections_clocks_and_name_the_untimed():
    from lab.book.readme import durations

    doc = {"sections": {"ch01": {"provenance": {"wall_seconds": 60.0}}, "ch02": {"provenance": {"wall_seconds": 150.0}},
                        "ch03": {"provenance": {}}}}
    text = durations(doc)
    assert text.startswith("The sections that recorded their time took 4 minutes") and "ch01 1.0, ch02 2.5" in text
    assert text.endswith("Not timed (measured before sections recorded their time): ch03.")
    del doc["sections"]["ch03"]
    assert durations(doc).startswith("A full `make results` measured its sections in 4 minutes")
    assert "Not timed" not in durations(doc)
