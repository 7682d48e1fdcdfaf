"""lab.book: references resolve against results.json, figures are copied, check() finds what would break."""

import pytest

from lab import book
from lab.results import COMMITTED, REPO_ROOT, ResultsKeyError, not_run, value, write_section

PROVENANCE = {
    "date": "2025-01-01T00:00:00+00:00",
    "git": {"commit": "abc1234", "dirty": False},
    "machine": {"arch": "x86_64", "processor": "test CPU", "os": "Linux", "cpu_count": 2, "torch_threads": 2},
    "gpu": None,
    "versions": {"python": "3.11", "torch": "2.13.0", "transformers": "5.23.0"},
    "manifest": None,
    "mode": "quick",
}

CHAPTER = """# The cost of recomputation

Without a cache the model computes {{ch01.positions.uncached}}; with one, {{ ch01.positions.cached }}.
One step takes {{ch01.step_ms.T512:.1f}}, a speedup of {{ch01.speedup}}. On a GPU: {{ch01.gpu}}.

![speedup](../results/figures/speedup.png)
"""


@pytest.fixture
def lab_dir(tmp_path):
    """A tiny repository: book/, notebooks/, results/results.json and one figure."""
    (tmp_path / "book").mkdir()
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "results" / "figures").mkdir(parents=True)
    (tmp_path / "book" / "ch01_recompute.md").write_text(CHAPTER)
    (tmp_path / "notebooks" / "ch01_recompute.py").write_text("# %%\n")
    (tmp_path / "results" / "figures" / "speedup.png").write_bytes(b"\x89PNG fake")
    write_section("ch01", {
        "positions": {"uncached": value(1040, "positions"), "cached": value(64, "positions")},
        "step_ms": {"T512": value(3.14159, "ms")},
        "speedup": value(24.1, "x"),
        "gpu": not_run("needs a CUDA GPU"),
    }, PROVENANCE, path=tmp_path / "results" / "results.json")
    return tmp_path


def args(lab_dir):
    return lab_dir / "book", lab_dir / "notebooks", lab_dir / "results" / "results.json"


def test_references_parses_keys_and_specs():
    text = "a {{ch01.x.y}} b {{  ch02.step_ms.smollm2.T512 : .1f }} c {{ch03.z:,d}} {not one} {{}}"
    assert book.references(text) == [("ch01.x.y", ""), ("ch02.step_ms.smollm2.T512", ".1f"), ("ch03.z", ",d")]
    assert book.references("no references here") == []


def test_render_text_substitutes(lab_dir):
    from lab.results import read

    doc = read(args(lab_dir)[2])
    text = book.render_text(CHAPTER, doc)
    assert "computes 1,040 positions; with one, 64 positions." in text
    assert "takes 3.1 ms, a speedup of 24.1×. On a GPU: not run (needs a CUDA GPU)." in text
    assert "{{" not in text
    with pytest.raises(ResultsKeyError, match="ch01.positions.uncached"):
        book.render_text("{{ch01.positions.uncachd}}", doc)


def test_check_of_a_sound_book_is_empty(lab_dir):
    assert book.check(*args(lab_dir)) == []


def test_check_reports_a_chapter_without_notebook(lab_dir):
    (lab_dir / "book" / "ch02_sizing.md").write_text("# Sizing\n")
    problems = book.check(*args(lab_dir))
    assert len(problems) == 1
    assert "ch02_sizing.md" in problems[0] and "ch02_sizing.py" in problems[0]


def test_check_reports_an_unresolved_key_with_its_line(lab_dir):
    chapter = lab_dir / "book" / "ch01_recompute.md"
    chapter.write_text(CHAPTER + "\nAnd {{ch01.positions.uncahced}}.\n")
    problems = book.check(*args(lab_dir))
    assert len(problems) == 1
    assert "ch01_recompute.md:8" in problems[0]
    assert "ch01.positions.uncahced" in problems[0] and "ch01.positions.uncached" in problems[0]


def test_check_reports_a_bad_format_spec(lab_dir):
    (lab_dir / "book" / "ch01_recompute.md").write_text("{{ch01.gpu:.1f}} {{ch01.speedup:d}}\n")
    problems = book.check(*args(lab_dir))
    assert len(problems) == 1 and "'d'" in problems[0]


def test_check_reports_a_missing_figure(lab_dir):
    (lab_dir / "results" / "figures" / "speedup.png").unlink()
    problems = book.check(*args(lab_dir))
    assert len(problems) == 1
    assert "ch01_recompute.md" in problems[0] and "speedup.png" in problems[0]


def test_check_reports_a_corrupt_results_file(lab_dir):
    args(lab_dir)[2].write_text("{")
    problems = book.check(*args(lab_dir))
    assert any("not valid JSON" in p for p in problems)


def test_render_writes_chapters_index_and_figures(lab_dir, capsys):
    out = lab_dir / "build" / "book"
    written = book.render(lab_dir / "book", out, args(lab_dir)[2])
    assert [p.name for p in written] == ["ch01_recompute.html", "index.html"]
    page = (out / "ch01_recompute.html").read_text()
    assert "<h1>The cost of recomputation</h1>" in page
    assert "1,040 positions" in page and "24.1×" in page and "{{" not in page
    assert 'src="figures/speedup.png"' in page
    assert (out / "figures" / "speedup.png").read_bytes() == b"\x89PNG fake"
    index = (out / "index.html").read_text()
    assert '<a href="ch01_recompute.html">The cost of recomputation</a>' in index
    assert "wrote" in capsys.readouterr().out


def test_render_refuses_a_book_with_a_missing_figure(lab_dir):
    (lab_dir / "results" / "figures" / "speedup.png").unlink()
    out = lab_dir / "build" / "book"
    with pytest.raises(book.BookError, match=r"ch01_recompute\.md.*speedup\.png"):
        book.render(lab_dir / "book", out, args(lab_dir)[2])
    assert not out.exists()  # nothing half-rendered


def test_main_check_exit_status(lab_dir):
    book_dir, notebooks, results = args(lab_dir)
    common = ["--book", str(book_dir), "--notebooks", str(notebooks), "--results", str(results), "--check"]
    assert book.main(common) == 0
    (notebooks / "ch01_recompute.py").unlink()
    assert book.main(common) == 1


def test_committed_book_references_resolve():
    if not book.chapters(REPO_ROOT / "book"):
        pytest.skip("book/ has no chapters yet")
    assert book.check(REPO_ROOT / "book", REPO_ROOT / "notebooks", COMMITTED) == []
