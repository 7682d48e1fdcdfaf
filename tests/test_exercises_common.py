"""compare_with_book reads the committed results and reports the ratio of the reader's figure to the book's."""

import pytest

from lab import results
from lab.exercises import compare_with_book


def test_compare_with_book_reads_committed_value(tmp_path, capsys):
    path = tmp_path / "r.json"
    results.write_section("chx", {"speedup": results.value(4.0, "x")}, results.provenance(mode="full"), path=path)
    assert compare_with_book("chx.speedup", 2.0, path=path) == pytest.approx(0.5)
    out = capsys.readouterr().out
    assert "yours: 2×" in out and "the book's: 4×" in out


def test_compare_with_book_refuses_non_numbers(tmp_path):
    path = tmp_path / "r.json"
    results.write_section("chx", {"same": results.value(True, None)}, results.provenance(mode="full"), path=path)
    with pytest.raises(ValueError, match="not a number"):
        compare_with_book("chx.same", 1.0, path=path)
