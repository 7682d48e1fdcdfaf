"""lab.book.render: references resolve against results.json, listings select and stay readable, math and code render
offline, figures are numbered, and the committed book renders to pages a reader can read (no network, no
machine paths, no raw booleans, no unit followed by a noun). lab.experiments.plots keeps figures legible."""

import html
import json
import re
import shutil

import pytest

from lab.book import render
from lab.book.__main__ import main
from lab.results import COMMITTED, REPO_ROOT, ResultsKeyError, not_run, read, value, write_section

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

![Step time against context length.](../results/figures/speedup.png)
"""

SOURCE = '''"""A module to list."""

import math


def top(x):
    return x + 1


class Cache:
    """A cache."""

    def __init__(self):
        self.k = []

    @property
    def size(self):
        return len(self.k)

    def update(self, k):
        # region append
        self.k.append(k)  # [B, H, T, D]
        # region inner
        n = len(self.k)
        # endregion
        return n
        # endregion


# region helpers
def helper():
    return math.pi
# endregion
'''


@pytest.fixture
def lab_dir(tmp_path):
    """A tiny repository: book/, notebooks/, results/results.json and one figure."""
    (tmp_path / "book").mkdir()
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "results" / "figures").mkdir(parents=True)
    (tmp_path / "book" / "ch01_recompute.md").write_text(CHAPTER)
    (tmp_path / "notebooks" / "ch01_recompute.py").write_text("# %%\n")
    (tmp_path / "results" / "figures" / "speedup.png").write_bytes(b"\x89PNG fake")
    (tmp_path / "lab").mkdir()
    (tmp_path / "lab" / "module.py").write_text(SOURCE)
    write_section("ch01", {
        "positions": {"uncached": value(1040, "positions"), "cached": value(64, "positions")},
        "step_ms": {"T512": value(3.14159, "ms")},
        "speedup": value(24.1, "x"),
        "gpu": not_run("needs a CUDA GPU"),
        "steps": value(48, "steps"),
        "identical": value(True, None),
        "perplexity": value(46.8321, "perplexity"),
    }, PROVENANCE, path=tmp_path / "results" / "results.json")
    return tmp_path


def args(lab_dir):
    return lab_dir / "book", lab_dir / "notebooks", lab_dir / "results" / "results.json"


def write_chapter(lab_dir, text, name="ch01_recompute"):
    (lab_dir / "book" / f"{name}.md").write_text(text)


# -----------------------------------------------------------------------------
# references


def test_references_parses_keys_and_specs():
    text = ("a {{ch01.x.y}} b {{  ch02.step_ms.smollm2.T512 : .1f }} c {{ch03.z:,d}} {not one} {{}} "
            "{{ch01.steps|number}} {{ch01.p:.1f|number}} {{ ch01.same | bool:identical/different }}")
    assert render.references(text) == [("ch01.x.y", ""), ("ch02.step_ms.smollm2.T512", ".1f"), ("ch03.z", ",d"),
                                     ("ch01.steps", "|number"), ("ch01.p", ".1f|number"),
                                     ("ch01.same", "|bool:identical/different")]
    assert render.references("no references here") == []


def test_render_text_substitutes(lab_dir):
    doc = read(args(lab_dir)[2])
    text = render.render_text(CHAPTER, doc)
    assert "computes 1,040 positions; with one, 64 positions." in text
    assert "takes 3.1 ms, a speedup of 24.1×. On a GPU: not run (needs a CUDA GPU)." in text
    assert "{{" not in text
    with pytest.raises(ResultsKeyError, match="ch01.positions.uncached"):
        render.render_text("{{ch01.positions.uncachd}}", doc)


def test_render_text_number_and_bool(lab_dir):
    doc = read(args(lab_dir)[2])
    assert render.render_text("{{ch01.steps|number}} steps", doc) == "48 steps"
    assert render.render_text("a perplexity of {{ch01.perplexity:.1f|number}}", doc) == "a perplexity of 46.8"
    assert render.render_text("{{ch01.speedup:.0f|number}}-fold", doc) == "24-fold"
    assert render.render_text("the tokens are {{ch01.identical|bool:identical/different}}", doc) == \
        "the tokens are identical"
    assert render.render_text("{{ch01.gpu|number}}", doc) == "not run (needs a CUDA GPU)"


def test_a_bare_boolean_is_an_error(lab_dir):
    doc = read(args(lab_dir)[2])
    with pytest.raises(render.BookError, match=r"ch01\.identical.*boolean.*\|bool:"):
        render.render_text("{{ch01.identical}}", doc)
    with pytest.raises(render.BookError, match="boolean"):
        render.render_text("{{ch01.identical|number}}", doc)
    write_chapter(lab_dir, "It is {{ch01.identical}}.\n")
    (problem,) = render.check(*args(lab_dir))
    assert "ch01_recompute.md:1" in problem and "|bool:" in problem


def test_a_bad_filter_is_reported(lab_dir):
    write_chapter(lab_dir, "{{ch01.steps|words}} and {{ch01.identical|bool:yes}}\n")
    problems = render.check(*args(lab_dir))
    assert len(problems) == 2
    assert "unknown |words" in problems[0] and "two words" in problems[1]


def test_marks_wrap_each_reference(lab_dir):
    doc = read(args(lab_dir)[2])
    marks = []
    text = render.render_text("{{ch01.steps}} and {{ch01.speedup:.0f|number}}", doc, marks=marks)
    assert text == (f"{render.MARK_OPEN}0{render.MARK_MID}48 steps{render.MARK_CLOSE} and "
                    f"{render.MARK_OPEN}1{render.MARK_MID}24{render.MARK_CLOSE}")
    assert [(k, s, leaf["unit"]) for k, s, leaf in marks] == [("ch01.steps", "", "steps"),
                                                             ("ch01.speedup", ".0f|number", "x")]


# -----------------------------------------------------------------------------
# listings


def test_listing_of_a_function_a_class_and_the_whole_file(lab_dir):
    assert render.code_listing("lab/module.py", "top", lab_dir) == "def top(x):\n    return x + 1"
    cls = render.code_listing("lab/module.py", "Cache", lab_dir)
    assert cls.startswith("class Cache:") and cls.endswith("        n = len(self.k)\n        return n")
    assert "region" not in cls  # marker lines are never shown
    whole = render.code_listing("lab/module.py", None, lab_dir)
    assert whole.startswith('"""A module to list."""') and whole.endswith("return math.pi")
    assert "region" not in whole


def test_listing_of_a_method_is_dedented_with_its_decorator(lab_dir):
    assert render.code_listing("lab/module.py", "Cache.size", lab_dir) == \
        "@property\ndef size(self):\n    return len(self.k)"
    assert render.code_listing("lab/module.py", "Cache.__init__", lab_dir) == "def __init__(self):\n    self.k = []"


def test_listing_of_a_region_drops_the_markers_and_dedents(lab_dir):
    assert render.code_listing("lab/module.py", "append", lab_dir) == \
        "self.k.append(k)  # [B, H, T, D]\nn = len(self.k)\nreturn n"
    assert render.code_listing("lab/module.py", "inner", lab_dir) == "n = len(self.k)"
    assert render.code_listing("lab/module.py", "helpers", lab_dir) == "def helper():\n    return math.pi"


@pytest.mark.parametrize("path, name, match", [
    ("lab/missing.py", "top", "no file lab/missing.py"),
    ("lab/module.py", "nothing", "no top-level function or class, Class.method, or `# region nothing`"),
    ("lab/module.py", "Cache.nothing", "Cache.nothing"),
    ("lab/module.py", "top.inner", "top.inner"),
])
def test_listing_that_does_not_resolve(lab_dir, path, name, match):
    with pytest.raises(render.BookError, match=re.escape(match)):
        render.code_listing(path, name, lab_dir)


def test_listing_region_without_end_or_twice(lab_dir):
    (lab_dir / "lab" / "bad.py").write_text("# region a\nx = 1\n# region b\ny = 2\n# endregion\n"
                                            "# region b\n# endregion\n")
    with pytest.raises(render.BookError, match="region 'a' in lab/bad.py has no `# endregion`"):
        render.code_listing("lab/bad.py", "a", lab_dir)
    with pytest.raises(render.BookError, match="region 'b' is marked 2 times"):
        render.code_listing("lab/bad.py", "b", lab_dir)


def test_long_and_wide_listings_are_reported_and_refused(lab_dir):
    body = "\n".join(f"    x{i} = {i}" for i in range(render.MAX_LISTING_LINES))  # 60 lines + the def: 61
    wide = "    y = '" + "w" * (render.MAX_LISTING_WIDTH - 9) + "'"                  # 101 characters
    (lab_dir / "lab" / "big.py").write_text(f"def long():\n{body}\n\n\ndef wide():\n{wide}\n\n\n"
                                            f"def fits():\n{wide[:-2]}'\n")
    write_chapter(lab_dir, CHAPTER + "\n::: code lab/big.py long\n\n::: code lab/big.py wide\n\n"
                                     "::: code lab/big.py fits\n")
    problems = render.check(*args(lab_dir), root=lab_dir)
    assert len(problems) == 2, problems
    assert "ch01_recompute.md:8: code listing lab/big.py long has 61 lines, more than 60" in problems[0]
    assert "ch01_recompute.md:10: code listing lab/big.py wide has 1 line(s) wider than 100" in problems[1]
    with pytest.raises(render.BookError, match=r"lab/big\.py long has 61 lines[\s\S]*lab/big\.py wide"):
        render.render(lab_dir / "book", lab_dir / "out", args(lab_dir)[2], root=lab_dir)
    assert not (lab_dir / "out").exists()


def test_a_listing_renders_highlighted(lab_dir):
    write_chapter(lab_dir, "# T\n\n::: code lab/module.py Cache.update\n")
    render.render(lab_dir / "book", lab_dir / "out", args(lab_dir)[2], root=lab_dir)
    page = (lab_dir / "out" / "ch01_recompute.html").read_text()
    assert '<div class="codehilite"><pre>' in page
    assert '<span class="k">def</span>' in page and "# lab/module.py" in page
    assert "region" not in page
    assert ".codehilite .k {" in page  # Pygments' CSS is embedded


def test_a_malformed_directive_is_reported(lab_dir):
    write_chapter(lab_dir, CHAPTER + "\n::: code\n\n::: listing lab/module.py top\n")
    problems = render.check(*args(lab_dir), root=lab_dir)
    assert len(problems) == 2 and all("not a listing directive" in p for p in problems)


# -----------------------------------------------------------------------------
# math, figures, tables, pages


def test_math_becomes_mathml_but_not_in_code():
    body, _ = render.to_html("Inline $q_t \\cdot k_j$ and `$x$`, it costs \\$5 or $6.\n\n"
                           "$$\\sum_{i \\le t} a_i = \\frac{n(n-1)}{2}$$\n\n"
                           "```python\nprice = '$a$'\n```\n")
    assert body.count("<math") == 2
    assert '<math xmlns="http://www.w3.org/1998/Math/MathML" display="inline">' in body
    assert 'display="block"' in body and "<mfrac>" in body
    assert "<code>$x$</code>" in body and "$5 or $6" in body
    assert "&#x27;$a$&#x27;" in body or "'$a$'" in body  # the code block is left alone
    assert "\\sum" not in body and "\\cdot" not in body


def test_math_that_does_not_convert_is_reported(lab_dir):
    write_chapter(lab_dir, CHAPTER + "\n$\\left( x$\n")
    (problem,) = render.check(*args(lab_dir))
    assert "MathML" in problem and "ch01_recompute.md" in problem
    write_chapter(lab_dir, CHAPTER + "\n$\\foo{x}$\n")
    (problem,) = render.check(*args(lab_dir))
    assert "unknown TeX \\foo" in problem


def test_figures_are_numbered_with_their_caption(lab_dir):
    shutil.copy(lab_dir / "results" / "figures" / "speedup.png", lab_dir / "results" / "figures" / "two.png")
    write_chapter(lab_dir, "# Three\n\n![First figure.](../results/figures/speedup.png)\n\ntext\n\n"
                           "![Second *figure*.](../results/figures/two.png)\n", "ch03_savings")
    (lab_dir / "book" / "ch01_recompute.md").unlink()
    render.render(lab_dir / "book", lab_dir / "out", args(lab_dir)[2])
    page = (lab_dir / "out" / "ch03_savings.html").read_text()
    assert re.search(r'<figure>\s*<img alt="First figure." src="figures/speedup.png"\s*/?>\s*'
                     r"<figcaption>Figure 3.1. First figure.</figcaption>\s*</figure>", page), page
    assert "<figcaption>Figure 3.2. Second <em>figure</em>.</figcaption>" in page


def test_a_figure_without_caption_or_inside_a_sentence_is_refused(lab_dir):
    write_chapter(lab_dir, "# T\n\n![](../results/figures/speedup.png)\n")
    (problem,) = render.check(*args(lab_dir))
    assert "no alt text" in problem
    write_chapter(lab_dir, "# T\n\nSee ![A figure.](../results/figures/speedup.png) here.\n")
    (problem,) = render.check(*args(lab_dir))
    assert "paragraph of its own" in problem
    write_chapter(lab_dir, "# T\n\n![A remote figure.](https://example.org/x.png)\n")
    (problem,) = render.check(*args(lab_dir))
    assert "not a local file" in problem


def test_numeric_table_columns_are_right_aligned():
    body, _ = render.to_html("| model | step | note |\n|---|---|---|\n| gpt2 | 3.1 ms | fast |\n"
                           "| smollm2 | 1,040 positions | slow |\n| gpt2-xl | — | n/a |\n")
    assert '<th class="num">step</th>' in body and '<td class="num">3.1 ms</td>' in body
    assert "<td>gpt2</td>" in body and "<td>fast</td>" in body


def test_check_of_a_sound_book_is_empty(lab_dir):
    assert render.check(*args(lab_dir)) == []


def test_check_reports_a_chapter_without_notebook(lab_dir):
    (lab_dir / "book" / "ch02_sizing.md").write_text("# Sizing\n")
    problems = render.check(*args(lab_dir))
    assert len(problems) == 1
    assert "ch02_sizing.md" in problems[0] and "ch02_sizing.py" in problems[0]


def test_check_reports_an_unresolved_key_with_its_line(lab_dir):
    write_chapter(lab_dir, CHAPTER + "\nAnd {{ch01.positions.uncahced}}.\n")
    problems = render.check(*args(lab_dir))
    assert len(problems) == 1
    assert "ch01_recompute.md:8" in problems[0]
    assert "ch01.positions.uncahced" in problems[0] and "ch01.positions.uncached" in problems[0]


def test_check_reports_a_bad_format_spec(lab_dir):
    write_chapter(lab_dir, "{{ch01.gpu:.1f}} {{ch01.speedup:d}}\n")
    problems = render.check(*args(lab_dir))
    assert len(problems) == 1 and "'d'" in problems[0]


def test_check_reports_a_missing_figure(lab_dir):
    (lab_dir / "results" / "figures" / "speedup.png").unlink()
    problems = render.check(*args(lab_dir))
    assert len(problems) == 1
    assert "ch01_recompute.md" in problems[0] and "speedup.png" in problems[0]


def test_check_reports_a_corrupt_results_file(lab_dir):
    args(lab_dir)[2].write_text("{")
    problems = render.check(*args(lab_dir))
    assert any("not valid JSON" in p for p in problems)


def test_render_writes_chapters_index_print_and_figures(lab_dir, capsys):
    out = lab_dir / "build" / "book"
    written = render.render(lab_dir / "book", out, args(lab_dir)[2])
    assert [p.name for p in written] == ["ch01_recompute.html", "index.html", "print.html"]
    page = (out / "ch01_recompute.html").read_text()
    assert '<h1 id="the-cost-of-recomputation">The cost of recomputation</h1>' in page
    assert "1,040 positions" in page and "24.1×" in page and "{{" not in page
    assert 'src="figures/speedup.png"' in page
    assert (out / "figures" / "speedup.png").read_bytes() == b"\x89PNG fake"
    index = (out / "index.html").read_text()
    assert '<a href="ch01_recompute.html">The cost of recomputation</a>' in index
    assert "Numbers from results/results.json (quick mode, measured 2025-01-01)." in index
    assert str(lab_dir) not in index and str(lab_dir) not in page
    assert "wrote" in capsys.readouterr().out


def test_chapters_link_to_each_other_and_list_their_sections(lab_dir):
    write_chapter(lab_dir, CHAPTER + "\n## 1. First\n\ntext\n\n### A detail\n\n## 2. Second\n")
    write_chapter(lab_dir, "# Building the cache\n\n## Why\n\ntext\n", "ch02_build")
    write_chapter(lab_dir, "# Savings\n\ntext\n", "ch03_savings")
    for name in ("ch02_build", "ch03_savings"):
        (lab_dir / "notebooks" / f"{name}.py").write_text("# %%\n")
    out = lab_dir / "out"
    render.render(lab_dir / "book", out, args(lab_dir)[2])
    first, second, third = ((out / f"{n}.html").read_text() for n in ("ch01_recompute", "ch02_build", "ch03_savings"))
    assert first.count('<a href="ch02_build.html">Building the cache →</a>') == 2  # top and bottom
    assert "← " not in first
    assert second.count('<a href="ch01_recompute.html">← The cost of recomputation</a>') == 2
    assert second.count('<a href="ch03_savings.html">Savings →</a>') == 2
    assert second.count('<a href="index.html">Contents</a>') == 2
    assert " →</a>" not in third
    toc = re.search(r'<div class="toc">([\s\S]*?)</div>', first)[1]
    assert '<a href="#1-first">1. First</a>' in toc and '<a href="#a-detail">A detail</a>' in toc
    assert first.index("</h1>") < first.index('<div class="toc">')
    printed = (out / "print.html").read_text()
    assert printed.index('id="ch01_recompute"') < printed.index('id="ch02_build"') < printed.index('id="ch03_savings"')
    assert 'id="ch01_recompute-1-first"' in printed  # heading ids stay unique on one page
    assert "<figcaption>Figure 1.1. Step time against context length.</figcaption>" in printed
    assert "@media print" in printed


def test_render_refuses_a_book_with_a_missing_figure(lab_dir):
    (lab_dir / "results" / "figures" / "speedup.png").unlink()
    out = lab_dir / "build" / "book"
    with pytest.raises(render.BookError, match=r"ch01_recompute\.md.*speedup\.png"):
        render.render(lab_dir / "book", out, args(lab_dir)[2])
    assert not out.exists()  # nothing half-rendered


def test_main_check_exit_status(lab_dir):
    book_dir, notebooks, results = args(lab_dir)
    common = ["--book", str(book_dir), "--notebooks", str(notebooks), "--results", str(results), "--check"]
    assert main(common) == 0
    (notebooks / "ch01_recompute.py").unlink()
    assert main(common) == 1


def test_main_renders_the_committed_results_by_default(monkeypatch):
    monkeypatch.setenv("LAB_QUICK", "1")  # the mode does not choose the book's numbers
    seen = []
    monkeypatch.setattr(render, "check", lambda b, n, results: seen.append(results) or [])
    assert main(["--check"]) == 0
    assert seen == [COMMITTED]


# -----------------------------------------------------------------------------
# the pages around the chapters: the layout of a chapter, the glossary and its links, index, next, print

GLOSSARY = """# Glossary

## Terms

### Page
*Also:* pages

A run of positions. Built in [chapter 1](ch01_recompute.html).

### Block table

A list of pages.

### KV cache
*Also:* key-value cache

What is kept.

## Notation

| symbol | meaning |
|---|---|
| $P$ | page size |
"""

SUMMARIZED = """# Chapter 1 — The cost of recomputation

**In short.** A cache saves work. It costs memory.

Without a cache the model computes {{ch01.positions.uncached}}.

## 1. The problem

Pages hold a KV cache; a block table lists the pages.

## 2. What the numbers do not show

One machine.

## 3. Exercises

1. Count.

## References

- A paper.
"""


def test_glossary_terms_are_headwords_and_aliases():
    terms = render.glossary_terms(GLOSSARY)
    assert [(t.head, t.slug, t.phrases) for t in terms] == [
        ("Page", "page", ("Page", "pages")), ("Block table", "block-table", ("Block table",)),
        ("KV cache", "kv-cache", ("KV cache", "key-value cache"))]
    with pytest.raises(render.BookError, match="'pages' names both 'Page' and 'Pages'"):
        render.glossary_terms(GLOSSARY + "\n### Pages\n\nx\n")


def test_glossary_entry_ids_are_the_slugs():
    body, _ = render.to_html(GLOSSARY)
    for term in render.glossary_terms(GLOSSARY):
        assert f'<h3 id="{term.slug}">{term.head}</h3>' in body
    assert '<p class="also"><em>Also:</em> pages</p>' in body


def test_first_use_of_a_term_links_to_the_glossary():
    text = ("# Pages and the KV cache\n\n"
            "A `page` in code, [a page](elsewhere.html), and $page$ in math are not uses. The Page\nsize and more "
            "pages follow.\n\n## The block table\n\nA key-value\ncache holds a block table; the block table "
            "again, and KV caches.\n\n![A page in a caption.](figure.png)\n\n"
            "| page | KV cache |\n|---|---|\n| x | y |\n")
    body, _ = render.to_html(text, links=render.glossary_terms(GLOSSARY))
    links = re.findall(r'<a class="term" href="glossary.html#([\w-]+)">([^<]*)</a>', body)
    assert links == [("page", "Page"), ("kv-cache", "key-value\ncache"), ("block-table", "block table")]
    assert "<h1 id=\"pages-and-the-kv-cache\">Pages and the KV cache</h1>" in body  # headings: never
    assert "<code>page</code>" in body and '<a href="elsewhere.html">a page</a>' in body
    assert "<figcaption>Figure 1.1. A page in a caption.</figcaption>" in body
    assert body.count('class="term"') == 3  # the first use only, of each term; "KV caches" is no use of it


def test_a_term_in_a_table_or_a_list_is_running_text():
    body, _ = render.to_html("| a | b |\n|---|---|\n| the pages | x |\n\n- a block table\n",
                           links=render.glossary_terms(GLOSSARY))
    assert '<td>the <a class="term" href="glossary.html#page">pages</a></td>' in body
    assert '<li>a <a class="term" href="glossary.html#block-table">block table</a></li>' in body


def test_summary_is_found_and_styled():
    assert render.summary(SUMMARIZED) == "**In short.** A cache saves work. It costs memory."
    assert render.first_sentence(render.summary(SUMMARIZED)) == "A cache saves work."
    assert render.summary(CHAPTER) is None
    assert render.summary(SUMMARIZED.replace("\n\n**In short.**", "\n\nIntro.\n\n**In short.**")) is None
    body, _ = render.to_html(SUMMARIZED)
    assert '<p class="summary"><strong>In short.</strong> A cache saves work.' in body


def test_layout_problems_name_each_departure():
    assert render.layout_problems(SUMMARIZED) == []
    assert render.layout_problems(CHAPTER) == [
        "no summary: the paragraph right under the `# ` title line must start `**In short.**`",
        "the last section must be `## References`, not none",
        "the sections before References must be `## N. What the numbers do not show` then `## N+1. Exercises`, "
        "not []"]
    unnumbered = SUMMARIZED.replace("## 3. Exercises", "## Exercises")
    assert any("must be numbered" in p and "'Exercises'" in p for p in render.layout_problems(unnumbered))
    skipped = SUMMARIZED.replace("## 3. Exercises", "## 4. Exercises")
    assert render.layout_problems(skipped) == ["sections are numbered [1, 2, 4], not 1, 2, 3, ..."]
    swapped = SUMMARIZED.replace("2. What the numbers do not show", "2. X").replace("3. Exercises", "3. Y")
    assert "not ['X', 'Y']" in render.layout_problems(swapped)[0]
    late = SUMMARIZED.replace("## References\n", "## References\n\n## 4. Later\n")
    assert "the last section must be `## References`" in render.layout_problems(late)[0]
    fenced = SUMMARIZED.replace("One machine.", "```\n## not a section\n```")
    assert render.layout_problems(fenced) == []


@pytest.fixture
def whole_book(lab_dir):
    """The tiny repository with a summarized chapter, a second one, a glossary, an index and a next page, and
    the notebooks' run times in its results."""
    write_chapter(lab_dir, SUMMARIZED)
    write_chapter(lab_dir, "# Chapter 2 — Paging\n\n**In short.** Pages. More.\n\nThe pages again.\n", "ch02_paging")
    (lab_dir / "notebooks" / "ch02_paging.py").write_text("# %%\n")
    (lab_dir / "book" / "glossary.md").write_text(GLOSSARY)
    (lab_dir / "book" / "index.md").write_text("# The book\n\nFor engineers.\n\n::: chapters\n\nRead [the "
                                               "glossary](glossary.html#page) and [next](next.html).\n")
    (lab_dir / "book" / "next.md").write_text("# Where to go next\n\n## vLLM\n\nSee [chapter 1]"
                                              "(ch01_recompute.html#1-the-problem).\n")
    write_section("notebooks", {"seconds": {"ch01_recompute": value(30.4, "s")}}, PROVENANCE,
                  path=lab_dir / "results" / "results.json")
    return lab_dir


def test_render_writes_the_pages_around_the_chapters(whole_book):
    out = whole_book / "out"
    written = render.render(whole_book / "book", out, args(whole_book)[2])
    names = [p.name for p in written]
    assert names == ["ch01_recompute.html", "ch02_paging.html", "next.html", "glossary.html", "index.html",
                     "print.html"]
    pages = {p.name: p.read_text() for p in written}
    first, second = pages["ch01_recompute.html"], pages["ch02_paging.html"]
    assert '<a class="term" href="glossary.html#page">Pages</a>' in first  # its first use, in running text
    assert first.count('<a href="glossary.html">Glossary</a>') == 2   # in both navigation bars
    assert second.count('<a href="next.html">Where to go next →</a>') == 2
    assert pages["next.html"].count('<a href="ch02_paging.html">← Chapter 2 — Paging</a>') == 2
    assert first.index('<p class="summary">') < first.index('<div class="toc">')  # the box, then the contents
    assert 'class="term"' not in pages["next.html"] + pages["index.html"]           # only chapters link terms
    index = pages["index.html"]
    assert re.search(r'<td class="num">1</td>\s*<td><a href="ch01_recompute.html">The cost of recomputation</a>'
                     r'</td>\s*<td>A cache saves work.</td>\s*<td class="num">1 min</td>\s*'
                     r'<td class="num">30 s</td>', index), index
    assert re.search(r'<td><a href="ch02_paging.html">Paging</a></td>\s*<td>Pages.</td>\s*'
                     r'<td class="num">1 min</td>\s*<td class="num">—</td>', index)
    assert "at 200 words a minute" in index and "measured on test CPU (2 CPUs)." in index
    assert "Numbers from results/results.json" in index and 'href="print.html"' in index
    for name, page in pages.items():
        assert _dangling(page, pages) == [], name


def test_print_keeps_every_link_on_its_own_page(whole_book):
    out = whole_book / "out"
    render.render(whole_book / "book", out, args(whole_book)[2])
    printed = (out / "print.html").read_text()
    ids = set(re.findall(r'\bid="([^"]+)"', printed))
    hrefs = re.findall(r'href="([^"]*)"', printed)
    assert hrefs and all(h.startswith("#") or h == "print.html" for h in hrefs), hrefs
    assert {h[1:] for h in hrefs if h.startswith("#")} <= ids
    assert '<a class="term" href="#glossary-page">Pages</a>' in printed   # a term's anchor is the glossary's
    assert 'href="#ch01_recompute-1-the-problem"' in printed and 'href="#ch01_recompute"' in printed
    assert printed.index('id="index"') < printed.index('id="ch01_recompute"') < printed.index('id="next"') \
        < printed.index('id="glossary"')


def test_book_renders_without_the_pages_around_the_chapters(lab_dir):
    written = render.render(lab_dir / "book", lab_dir / "out", args(lab_dir)[2])
    assert [p.name for p in written] == ["ch01_recompute.html", "index.html", "print.html"]
    assert "Glossary" not in (lab_dir / "out" / "ch01_recompute.html").read_text()


def test_a_bad_reference_around_the_chapters_is_a_problem(whole_book):
    (whole_book / "book" / "next.md").write_text("# Next\n\n{{ch01.nothing}}\n")
    (problem,) = render.check(*args(whole_book))
    assert problem.startswith("book/next.md:3:") and "ch01.nothing" in problem


# -----------------------------------------------------------------------------
# figures: lab.experiments.plots


def test_plots_column_is_the_books():
    from lab.experiments import plots

    assert plots.COLUMN_PX == render.COLUMN_PX
    assert f"max-width: {render.COLUMN_REM}rem" in render.CSS
    assert plots.COLUMN_IN * plots.DPI == pytest.approx(render.COLUMN_PX)


def test_plots_refuse_small_text_at_the_shown_size(tmp_path):
    from lab.experiments import plots

    fig, ax = plots.plt.subplots(figsize=(12, 4))
    ax.plot([1, 2], [3, 4], label="five points")
    ax.legend(fontsize=5)
    assert plots.shown_scale(fig) == pytest.approx(render.COLUMN_PX / (12 * plots.DPI))
    with pytest.raises(plots.FigureLegibilityError, match=r"wide\.png: .*'five points' \(5 pt -> 2\.9 pt\)"):
        plots.check_legible(fig, "wide.png")
    # finish() narrows the figure to the column, but 5-pt text is still under 8 pt: nothing is saved
    with pytest.raises(plots.FigureLegibilityError, match=r"small\.png: .*'five points' \(5 pt -> 5\.0 pt\)"):
        plots.finish(fig, tmp_path / "small.png")
    assert not (tmp_path / "small.png").exists()
    plots.plt.close(fig)


def test_plots_defaults_pass_and_a_wide_figure_is_narrowed(tmp_path):
    from lab.experiments import plots

    fig, (a, b) = plots.plt.subplots(1, 2, figsize=(10, 4))  # wider than the column: 0.69 of it shown
    for ax in (a, b):
        ax.plot([1, 2], [3, 4], label="cached")
        ax.set_title("Step time")
        ax.set_xlabel("context (tokens)")
        ax.legend()
    assert plots.too_small(fig)  # at 10 in, the default 9-pt ticks would read at 6.2 pt
    plots.finish(fig, tmp_path / "ok.png")
    assert fig.get_figwidth() == pytest.approx(plots.COLUMN_IN)
    assert (tmp_path / "ok.png").stat().st_size > 0
    fig, ax = plots.figure(ncols=2)
    assert fig.get_size_inches() == pytest.approx((plots.COLUMN_IN, plots.PANEL_HEIGHT_IN))
    ax[0].set_title("hidden", fontsize=4)
    ax[0].set_axis_off()
    ax[0].title.set_visible(False)
    plots.finish(fig, tmp_path / "hidden.png")  # invisible text is not checked
    plots.plt.close("all")


# -----------------------------------------------------------------------------
# the committed book, rendered


CHAPTERS = [c.stem for c in render.chapters(REPO_ROOT / "book")]
# a unit word followed by one of these reads wrong: "48 steps tokens", "512 tokens prefix", "5 calls misses"
NOUNS = {"tokens", "positions", "steps", "calls", "misses", "hits", "prefix", "logits", "trials", "bytes",
         "requests", "pages", "entries", "heads", "layers", "seconds"}
NOT_UNITS = {"perplexity"}  # a quantity, not a unit: "is 46.8 perplexity" reads wrong; write "a perplexity of"
MACHINE_PATHS = ("/root/", "/home/", "/tmp/", "/work/", "/Users/", str(REPO_ROOT))


def _vocabulary() -> set:
    """Every unit word of the committed results, singular and plural, and the nouns above."""
    words = set(NOUNS)
    for unit in _units(read(COMMITTED)):
        for w in re.findall(r"[A-Za-z]+", unit):
            w = w.lower()
            words |= {w, w + "s", w[:-1] if w.endswith("s") else w}
    return {w for w in words if w}


def _units(doc) -> set:
    units = set()

    def walk(node):
        for child in node.values():
            if isinstance(child, dict) and "value" in child:
                units.add(child.get("unit") or "")
            elif isinstance(child, dict):
                walk(child)

    for section in doc["sections"].values():
        walk(section["values"])
    return units - {""}


BLOCK_TAG = re.compile(r"</?(?:p|div|td|th|tr|li|ul|ol|h\d|pre|figure|figcaption|table|thead|tbody|br|"
                       r"blockquote|nav|section)\b[^>]*>")


def _text(page_html) -> str:
    """The text a reader sees: math and tags dropped, a line break at every block boundary."""
    text = re.sub(r"<math\b[\s\S]*?</math>", "\n", page_html)
    text = BLOCK_TAG.sub("\n", text)
    return html.unescape(re.sub(r"<[^>]+>", "", text))


def _prose(page_html) -> str:
    """The text outside code: <pre> and <code> dropped too."""
    return _text(re.sub(r"<(pre|code)\b[\s\S]*?</\1>", " ", page_html))


@pytest.fixture(scope="module")
def committed():
    if not CHAPTERS:
        pytest.skip("book/ has no chapters yet")
    return read(COMMITTED)


@pytest.fixture(scope="module")
def rendered(tmp_path_factory, committed):
    """Each committed chapter rendered alone (its page, index.html and print.html) from the committed results,
    so that a problem in one chapter fails that chapter's tests only."""
    pages = {}
    for name in CHAPTERS:
        book_dir = tmp_path_factory.mktemp(name) / "book"
        book_dir.mkdir()
        shutil.copy(REPO_ROOT / "book" / f"{name}.md", book_dir)
        try:
            pages[name] = render.render(book_dir, book_dir.parent / "out", COMMITTED)
        except render.BookError as e:
            pages[name] = e
    return pages


def pages_of(rendered, name):
    if isinstance(rendered[name], Exception):
        pytest.fail(f"book/{name}.md does not render: {rendered[name]}")
    return {p.name: p.read_text() for p in rendered[name]}


def test_committed_book_references_resolve():
    if not CHAPTERS:
        pytest.skip("book/ has no chapters yet")
    assert render.check(REPO_ROOT / "book", REPO_ROOT / "notebooks", COMMITTED) == []


def test_committed_book_renders_whole(tmp_path, committed):
    written = render.render(REPO_ROOT / "book", tmp_path, COMMITTED)
    assert [p.name for p in written] == [f"{n}.html" for n in CHAPTERS] + \
        ["next.html", "glossary.html", "index.html", "print.html"]
    pages = {p.name: p.read_text() for p in written}
    for name, page in pages.items():
        assert _dangling(page, pages) == [], f"{name} links to what the book does not have"
        assert not render.REF.search(page) and "{{" not in _prose(page), f"{name}: an unresolved reference"
        assert [p for p in MACHINE_PATHS if p in page] == [], f"{name} shows a path of this machine"
        assert "<script" not in page, f"{name} has a script; the book needs none"
    index = pages["index.html"]
    for n in CHAPTERS:  # the generated table: every chapter, linked, with its reading and notebook times
        row = re.search(rf'<tr>\s*<td class="num">\d+</td>\s*<td><a href="{n}.html">[\s\S]*?</tr>', index)
        assert row, f"index.html has no row for {n}"
        assert re.search(r'<td class="num">\d+ min</td>', row[0]), row[0]
    assert f"at {render.READING_WPM} words a minute" in index and "measured on " in index
    last = pages[f"{CHAPTERS[-1]}.html"]
    assert last.count('<a href="next.html">Where to go next →</a>') == 2  # the last chapter leads to next.html
    printed = pages["print.html"]
    assert printed.index(f'id="{CHAPTERS[-1]}"') < printed.index('id="next"') < printed.index('id="glossary"')


def _dangling(page, pages) -> list[str]:
    """The links of a rendered page to a page of the book that was not written, or to an id that page (or this
    one, for a bare #anchor) does not have."""
    wrong = []
    ids = {name: set(re.findall(r'\bid="([^"]+)"', text)) for name, text in pages.items()}
    own = set(re.findall(r'\bid="([^"]+)"', page))
    for target in re.findall(r'href="([^"]+)"', page):
        if re.match(r"[a-z]+:", target):
            continue
        name, _, frag = target.partition("#")
        if not (frag in own if not name else name in pages and (not frag or frag in ids[name])):
            wrong.append(target)
    return wrong


@pytest.mark.parametrize("name", CHAPTERS)
def test_rendered_pages_load_nothing_from_the_network(rendered, name):
    for file, page in pages_of(rendered, name).items():
        external = re.findall(r"<(?:script|link|img|iframe)\b[^>]*\b(?:src|href)\s*=\s*[\"']?(?:https?:)?//[^>]*>",
                              page, re.IGNORECASE)
        assert external == [], f"{file} loads from the network: {external}"
        assert "<script" not in page, f"{file} has a script; the book needs none"


@pytest.mark.parametrize("name", CHAPTERS)
def test_rendered_pages_have_no_unresolved_reference_or_directive(rendered, name):
    for file, page in pages_of(rendered, name).items():
        assert not render.REF.search(page), f"{file}: unresolved reference {render.REF.search(page)[0]}"
        prose = _prose(page)
        assert "{{" not in prose and "}}" not in prose, f"{file}: stray braces in the prose"
        directives = re.findall(r"^\s*:::.*$", _text(page), re.MULTILINE)
        assert directives == [], f"{file}: unresolved directive(s) {directives}"


@pytest.mark.parametrize("name", CHAPTERS)
def test_rendered_pages_show_no_path_of_this_machine(rendered, name):
    for file, page in pages_of(rendered, name).items():
        found = [p for p in MACHINE_PATHS if p in page]
        assert found == [], f"{file} shows a path of the machine it was rendered on: {found}"


@pytest.mark.parametrize("name", CHAPTERS)
def test_rendered_figures_are_numbered_with_a_caption(rendered, name):
    page = pages_of(rendered, name)[f"{name}.html"]
    figures = re.findall(r"<figure>([\s\S]*?)</figure>", page)
    assert page.count("<img") == sum(f.count("<img") for f in figures), "an image outside a <figure>"
    number = int(name[2:4])
    for k, figure in enumerate(figures, 1):
        caption = re.search(r"<figcaption>([\s\S]*?)</figcaption>", figure)
        assert caption, f"figure {k} of {name} has no caption"
        assert re.match(rf"Figure {number}\.{k}\. \S", caption[1]), caption[1]


@pytest.mark.parametrize("name", CHAPTERS)
def test_rendered_prose_has_no_raw_boolean(committed, name):
    body = render.chapter_html(REPO_ROOT / "book" / f"{name}.md", committed, COMMITTED)
    raw = [m[0] for m in re.finditer(r".{0,40}\b(?:true|false)\b.{0,20}", _prose(body), re.IGNORECASE)]
    assert raw == [], f"raw booleans in the prose of {name}: {raw}"


def _rendered_references(name, committed):
    """(key, spec, leaf, rendered text, the word right after it) for every reference of a chapter, read off
    the chapter's rendered text."""
    marks = []
    body = render.chapter_html(REPO_ROOT / "book" / f"{name}.md", committed, COMMITTED, marks=marks)
    found = re.finditer(rf"{render.MARK_OPEN}(\d+){render.MARK_MID}([^{render.MARK_CLOSE}]*){render.MARK_CLOSE}"
                        rf"(?:[ \t]+([A-Za-z]+))?", _text(body))
    return [(*marks[int(m[1])], m[2], m[3]) for m in found]


@pytest.mark.parametrize("name", CHAPTERS)
def test_rendered_prose_has_no_unit_followed_by_a_noun(committed, name):
    vocabulary = _vocabulary()
    wrong = []
    for key, spec, leaf, text, word in _rendered_references(name, committed):
        how = spec.partition("|")[2].strip()
        if not leaf.get("unit") or how or leaf["value"] == "NOT_RUN":
            continue  # no unit was rendered
        if word and word.lower() in vocabulary:
            wrong.append(f"{{{{{key}}}}} reads {text!r} then {word!r}: write {{{{{key}|number}}}} {word}")
        if leaf["unit"] in NOT_UNITS:
            wrong.append(f"{{{{{key}}}}} reads {text!r}: {leaf['unit']} is not a unit; write "
                         f"'a {leaf['unit']} of {{{{{key}|number}}}}'")
    assert wrong == [], f"{name}:\n  " + "\n  ".join(wrong)


def _repeated_units(text, marks) -> list[str]:
    """References rendered with a word unit whose noun comes again within six words of the same clause:
    "one of 4 prompts secret system prompts", "42,192 tokens of the conversation's prompt tokens"."""
    wrong = []
    marked = rf"{render.MARK_OPEN}(\d+){render.MARK_MID}([^{render.MARK_CLOSE}]*){render.MARK_CLOSE}"
    for m in re.finditer(marked, text):
        key, spec, leaf = marks[int(m[1])]
        unit = (leaf.get("unit") or "").lower()
        if len(unit) < 3 or not unit.isalpha() or spec.partition("|")[2].strip() or leaf["value"] == "NOT_RUN":
            continue  # no word unit, or rendered without it
        stem = unit[:-1] if unit.endswith("s") else unit
        after = " ".join(re.split(rf"[.;:,()\n{render.MARK_OPEN}]", text[m.end():], maxsplit=1)[0].split()[:6])
        if re.search(rf"\b{re.escape(stem)}s?\b", after, re.IGNORECASE):
            wrong.append(f"{{{{{key}}}}} reads {m[2]!r}, then {after!r}: write {{{{{key}|number}}}} and the noun once")
    return wrong


def test_a_repeated_unit_is_found(lab_dir):
    doc = read(args(lab_dir)[2])
    marks = []
    text = render.render_text("one of {{ch01.steps}} secret steps; {{ch01.steps}} of the run. {{ch01.steps|number}} "
                            "steps", doc, marks=marks)
    assert _repeated_units(text, marks) == ["{{ch01.steps}} reads '48 steps', then 'secret steps': write "
                                            "{{ch01.steps|number}} and the noun once"]


@pytest.mark.parametrize("name", CHAPTERS)
def test_rendered_prose_does_not_repeat_a_unit(committed, name):
    marks = []
    body = render.chapter_html(REPO_ROOT / "book" / f"{name}.md", committed, COMMITTED, marks=marks)
    wrong = _repeated_units(_text(body), marks)
    assert wrong == [], f"{name}:\n  " + "\n  ".join(wrong)


@pytest.mark.parametrize("name", CHAPTERS)
def test_rendered_values_do_not_round_to_zero(committed, name):
    wrong = []
    for key, spec, leaf, text, _ in _rendered_references(name, committed):
        values = leaf["value"] if isinstance(leaf["value"], list) else [leaf["value"]]
        numbers = re.findall(r"-?[\d.,]+(?:e[+-]?\d+)?", text)
        if (any(isinstance(v, float) and v != 0 for v in values) and numbers
                and all(re.fullmatch(r"-?[0.,]+", n) for n in numbers)):
            wrong.append(f"{{{{{key}:{spec}}}}} = {leaf['value']!r} reads {text!r}")
    assert wrong == [], f"{name}: non-zero values shown as zero (use a format spec such as .1e or .2g):\n  " \
        + "\n  ".join(wrong)


def test_committed_results_units_make_the_vocabulary():
    vocabulary = _vocabulary()
    assert {"tokens", "token", "positions", "position", "ms", "steps", "step"} <= vocabulary
    assert json.loads(COMMITTED.read_text())  # the file the vocabulary was read from


@pytest.mark.parametrize("name", CHAPTERS)
def test_committed_chapter_has_the_books_layout(name):
    """A summary (`**In short.** ...`) right under the title; sections numbered 1, 2, 3, ... whose last two are
    "What the numbers do not show" and "Exercises"; then `## References`, last."""
    problems = render.layout_problems((REPO_ROOT / "book" / f"{name}.md").read_text())
    assert problems == [], f"book/{name}.md:\n  " + "\n  ".join(problems)


def test_committed_glossary_defines_the_books_terms():
    terms = render.glossary_terms((REPO_ROOT / "book" / "glossary.md").read_text())
    slugs = {t.slug for t in terms}
    for needed in ("prefill", "decode", "page", "slot", "block-table", "slot-mapping", "lookahead", "state-identity",
                   "prefix-caching", "copy-on-write", "kl-divergence", "perplexity", "top-1-agreement", "ttft", "itl",
                   "goodput", "throughput", "roofline", "gqa-and-mqa", "rope", "quantization", "int8", "kivi",
                   "eviction", "window", "attention-sinks", "h2o", "snapkv", "speculative-decoding", "draft",
                   "target", "acceptance", "radix-tree", "tier", "disaggregation", "quick-mode-and-full-mode",
                   "resultsjson-reference"):
        assert needed in slugs, f"the glossary has no entry {needed!r}"
    text = (REPO_ROOT / "book" / "glossary.md").read_text()
    assert "## Notation" in text
    for symbol in ("$B$", "$T$", "$D$", "$H_q$", "$H_{kv}$", "$L$", "$P$", "$k$", "$n$", "$w$", "$s$", "$r$"):
        assert symbol in text, f"the notation has no {symbol}"
