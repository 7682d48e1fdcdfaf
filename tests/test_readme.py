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
    assert durations(doc).startswith("The sections of a full `make results`, each measured on its own, took 4 minutes")
    assert "Not timed" not in durations(doc)


def test_measured_on_names_each_machine_with_its_dates_and_sections():
    from lab.book.readme import durations, measured_on

    def prov(processor, date, seconds):
        return {"provenance": {"machine": {"processor": processor, "cpu_count": 2, "torch_threads": 2}, "gpu": None,
                               "versions": {"torch": "2.13.0+cpu"}, "mode": "full", "date": f"{date}T10:00:00+00:00",
                               "wall_seconds": seconds}}

    doc = {"sections": {"ch01": prov("A", "2026-12-01", 60.0), "ch02": prov("B", "2026-12-02", 60.0),
                        "ch03": prov("A", "2026-12-03", 60.0)}}
    text = measured_on(doc)
    assert text.startswith("A (2 CPUs, 2 torch threads), no GPU, torch 2.13.0+cpu, full mode, "
                           "2026-12-01 to 2026-12-03: ch01, ch03; B (")
    assert text.endswith("2026-12-02: ch02")
    assert "on two cores of more than one machine (see above)" in durations(doc)
    del doc["sections"]["ch02"]
    assert "2 minutes on two cores of the A (minutes" in durations(doc)
