"""Formulas are TeX, rendered as MathML: in the manuscript ($...$ and $$...$$, converted offline by lab.book.render)
and in the notebooks' markdown cells (the same TeX, which JupyterLab typesets with MathJax). A formula typed
as code (`Σ_t p_t s_t`), as plain text with ^ or _ (10^-5, T²), or as TeX that did not convert fails here.

The detectors are tested on their own first, on formulas this book once wrote as code and on real code that
must pass (identifiers with an underscore, tensor shapes, Python expressions)."""

import html
import io
import re
import tokenize
from functools import cache
from pathlib import Path

import pytest
from latex2mathml.converter import convert as latex_to_mathml

from lab.book import render
from lab.results import COMMITTED, REPO_ROOT, read

CHAPTERS = [p.stem for p in render.chapters(REPO_ROOT / "book")]
NOTEBOOKS = sorted((REPO_ROOT / "notebooks").glob("ch*.py"))

# The chapters whose manuscript and notebook hold formulas (all of them, after the pass that wrote every
# formula as TeX); each must render at least one <math> element.
FORMULA_CHAPTERS = ["ch01_recompute", "ch02_build", "ch03_savings", "ch04_identity", "ch05_paged",
                    "ch06_prefix", "ch07_compress", "ch08_serving", "ch09_speculation",
                    "ch10_architecture", "ch11_beyond"]

# -----------------------------------------------------------------------------
# the detectors

# TeX typed into code: a braced sub- or superscript, a TeX command, or TeX between dollars.
TEX_IN_CODE = re.compile(r"_\{|\^\{|\\(?:frac|t?frac|sum|prod|sqrt|cdot|times|le|leq|ge|geq|hat|bar|lVert|rVert"
                         r"|lvert|rvert|Vert|mathrm|mathit|operatorname|text|exp|log|dots|ldots|top|infty|Delta"
                         r"|alpha|sigma|mu|lfloor|rfloor|approx|qquad)(?![A-Za-z])|\$[^$\s][^$]*\$")
# Unicode that only math uses: sums, roots, products, norms, relations, floors, superscript and subscript
# digits, a transpose, a combining hat (x̂) and Greek letters. No identifier or operator of Python has them.
MATH_CHARS = re.compile("[Σ∑∏√·×‖≤≥≠≈∝∈−…⌊⌋⌈⌉∞ᵀ⁰¹²³⁴⁵⁶⁷⁸⁹₀₁₂₃₄₅₆₇₈₉\u0302\u0391-\u03a9\u03b1-\u03c9]")
# A caret as a power (10^30, T^2, x^-1); Python's XOR is written with spaces around it.
POWER = re.compile(r"[\w)\]]\^[\w(\-]")
# A subscript on a single letter: q_t, p_t, x_0. Names like k_pool or n_pages do not match.
SUBSCRIPT = re.compile(r"(?<![\w.])[A-Za-z]_[A-Za-z0-9](?!\w)")
# A bracketed list of names is a tensor layout in code ([B, H_q, D]), not a formula.
SHAPE = re.compile(r"\[[^\[\]]*\]")


@cache
def code_names(root=REPO_ROOT) -> frozenset:
    """Every identifier the project's code uses (lab/ and the notebooks' code cells; comments, and so the
    notebooks' markdown, excluded): a code span naming one of them is code, even when it looks like q_t."""
    names = set()
    for path in [*(Path(root) / "lab").rglob("*.py"), *(Path(root) / "notebooks").glob("*.py")]:
        try:
            names.update(t.string for t in tokenize.generate_tokens(io.StringIO(path.read_text()).readline)
                         if t.type == tokenize.NAME)
        except (tokenize.TokenError, SyntaxError):  # a file mid-edit: its names are simply not counted
            continue
    return frozenset(names)


def math_like(code, names=frozenset()) -> list[str]:
    """Why the text of a code span looks like a formula rather than code; empty when it reads as code.
    `names` are identifiers of real code: a single-letter subscript that is one of them (m_i) is code."""
    reasons = []
    if m := TEX_IN_CODE.search(code):
        reasons.append(f"TeX {m[0]!r}")
    if m := MATH_CHARS.search(code):
        reasons.append(f"math sign {m[0]!r}")
    if m := POWER.search(code):
        reasons.append(f"a power {m[0]!r}")
    subscripts = [s for s in SUBSCRIPT.findall(SHAPE.sub(" ", code)) if s not in names]
    if subscripts:
        reasons.append(f"subscript {subscripts[0]!r}")
    return reasons


# In prose (outside code and math), what only a formula that was not written as TeX leaves: a $ that is not
# a price ($4.50), a TeX command, a $$, a braced or caret power, a single-letter subscript, math-only signs.
PROSE_RESIDUE = re.compile(r"\$(?!\d)|\\[A-Za-z]+|_\{|\^\{|[\w)\]]\^[\w(\-]|(?<![\w.])[A-Za-z]_[A-Za-z0-9](?!\w)"
                           "|[Σ∑∏√ᵀ²³‖⌊⌋⌈⌉\u0302]")


def prose_residue(text) -> list[str]:
    """Each formula left in plain text or TeX left unconverted, with a little context."""
    return [text[max(0, m.start() - 30):m.end() + 30].replace("\n", " ") for m in PROSE_RESIDUE.finditer(text)]


# -----------------------------------------------------------------------------
# the detectors, tested

FORMULAS_AS_CODE = [
    "digest_{i−1}",
    "digest_i = sha256(digest_{i−1} ‖ the page's token ids)",
    "Σ_d |q_d| · s / 2",
    "Σ_t (p_t s_t)",
    "Σ_t p_t v̂_t = Σ_t (p_t s_t) · code_t",
    "|q · k̂ − q · k| ≤ Σ_d |q_d| · s / 2 = ‖q‖₁ · s / 2",
    "x̂ = s · code",
    "q · μ",
    "R(p − Δ) = R(−Δ) R(p)",
    "2 × layers × kv_heads × head_dim × bytes per element",
    "√(2 · page_cost · n)",
    "⌊(n − 1)/P⌋",
    "s = q @ kᵀ",
    "0 … start + i",
    "exp(score − m_i)",
    "10^30",
    "T^2",
    "q_t",
    "p_t s_t",
    r"\frac{n(n-1)}{2}",
    r"\sum_{i \le t} a_i",
    "$x^2$",
    "a^{2}",
]

REAL_CODE = [
    "k_pool",
    "v_pool",
    "n_pages",
    "m_new",
    "[B, H, T, D]",
    "[B, H_kv, T, D]",
    "[num_pages, page_size, kv_heads, head_dim]",
    "(q [B, H_q, D], k_pool, v_pool [pages, page_size, H_kv, D], block_tables int32 [B, max_pages],",
    "[T, start + T]",
    "block_table[p // page_size]",
    "p % page_size",
    "page * page_size + offset",
    "i * PAGE + PAGE - 1",
    "(len - 1) // PAGE",
    "key_position <= start + i",
    "start = 3",
    "T = 1",
    "ids[:-k]",
    "acc / l_i",
    "alpha = tl.exp(m_i - m_new)",
    "k_buf[layer, :, :, start:end] = k",
    'result["median"] * 1e6',
    "scaled_dot_product_attention(..., is_causal=True)",
    "LAB_FULL=1 python -m lab.experiments.gpu",
    "lab/exercises/ch01_solutions.py",
    "x ^ y",
    "a**2",
    "torch.randint(0, model.config.vocab_size, (1, T))",
    "{{ch01.step_ms.smollm2.T256}}",
]


@pytest.mark.parametrize("code", FORMULAS_AS_CODE)
def test_a_formula_written_as_code_is_flagged(code):
    assert math_like(code), f"not flagged: {code!r}"


@pytest.mark.parametrize("code", REAL_CODE)
def test_real_code_is_not_flagged(code):
    assert math_like(code, names=frozenset({"m_i", "l_i"})) == [], code


def test_a_subscript_that_names_real_code_is_code():
    assert math_like("m_i") and math_like("m_i", names=frozenset({"m_i"})) == []
    assert {"m_i", "l_i", "k_pool"} <= code_names()  # the kernel's running max and sum, named in chapter 5


@pytest.mark.parametrize("text", ["costs $x^2$ here", r"\frac{a}{b} of it", "a $$ left", "grows as T² does",
                                  "Σ_t over positions", "10^-5 absolute", "10^{30}", "the key q_t of t", "‖q‖",
                                  "at most ⌊n/P⌋", "the $T$ stays"])
def test_prose_residue_is_flagged(text):
    assert prose_residue(text), text


@pytest.mark.parametrize("text", ["storage $4.50 per million tokens", "it costs $5 or $6", "k_pool and n_pages",
                                  "2.6× faster", "0.1× the price", "20.4–38.2% of memory", "ch05.speed.B1.T4096",
                                  "a − b is fine in prose", "q · k in words"])
def test_plain_prose_is_not_flagged(text):
    assert prose_residue(text) == [], text


def test_the_detectors_agree_with_the_renderer():
    body, _ = render.to_html("Inline $q_t \\cdot k_j$, a price of $4.50, and `Σ_t p_t` as code.\n\n$$T^2$$\n")
    assert _math_count(body) == 2
    assert [c for c in _code_spans(body) if math_like(c)] == ["Σ_t p_t"]
    assert prose_residue(_prose(body)) == []
    body, _ = render.to_html("Left as text: $ x^2$ and 10^-5.\n")
    assert _math_count(body) == 0
    assert any("text: $ x" in r for r in prose_residue(_prose(body)))
    assert any("10^-5" in r for r in prose_residue(_prose(body)))


# -----------------------------------------------------------------------------
# the manuscript, rendered

def _math_count(body) -> int:
    return len(re.findall(r"<math\b", body))


def _code_spans(body) -> list[str]:
    """The text of every <code> outside <pre> (listings and code blocks are code by construction)."""
    body = re.sub(r"<pre\b[\s\S]*?</pre>", " ", body)
    return [html.unescape(re.sub(r"<[^>]+>", "", c)) for c in re.findall(r"<code\b[^>]*>([\s\S]*?)</code>", body)]


def _prose(body) -> str:
    """The text a reader sees outside code and math."""
    body = re.sub(r"<(pre|code|math)\b[\s\S]*?</\1>", " ", body)
    return html.unescape(re.sub(r"<[^>]+>", " ", body))


@pytest.fixture(scope="module")
def bodies():
    if not CHAPTERS:
        pytest.skip("book/ has no chapters yet")
    doc = read(COMMITTED)
    return {name: render.chapter_html(REPO_ROOT / "book" / f"{name}.md", doc, COMMITTED) for name in CHAPTERS}


@pytest.mark.parametrize("name", CHAPTERS)
def test_no_formula_is_written_as_code(bodies, name):
    names = code_names()
    found = [(c, why) for c in _code_spans(bodies[name]) if (why := math_like(c, names))]
    assert found == [], f"book/{name}.md: formulas written as code (write them as $TeX$): {found}"


@pytest.mark.parametrize("name", CHAPTERS)
def test_no_formula_is_left_as_text_or_unconverted_tex(bodies, name):
    residue = prose_residue(_prose(bodies[name]))
    assert residue == [], f"book/{name}.md: math left as plain text or TeX that did not convert: {residue}"


@pytest.mark.parametrize("name", FORMULA_CHAPTERS)
def test_chapters_with_formulas_render_mathml(bodies, name):
    assert name in bodies, f"book/{name}.md is missing"
    assert _math_count(bodies[name]) >= 1, f"book/{name}.md renders no <math>"


# -----------------------------------------------------------------------------
# the notebooks' markdown cells

def markdown_cells(path) -> list[tuple[int, str]]:
    """(first line, text) of every markdown cell of a jupytext percent-format notebook."""
    cells, current, start = [], None, 0
    for no, line in enumerate(Path(path).read_text().splitlines(), 1):
        if line.startswith("# %%"):
            if current is not None:
                cells.append((start, "\n".join(current)))
            current, start = ([] if "[markdown]" in line else None), no + 1
        elif current is not None:
            current.append(re.sub(r"^# ?", "", line))
    if current is not None:
        cells.append((start, "\n".join(current)))
    return cells


CODE_SPAN = re.compile(r"(?<!`)`((?:[^`\n]|\n(?![ \t]*\n))+)`(?!`)")  # may wrap, not across a blank line


def _notebook_math(text) -> list[tuple[str, str]]:
    """(TeX, "block" or "inline") of every formula of a markdown cell, found as lab.book.render finds them."""
    return [(m["display"], "block") if m["display"] is not None else (m["inline"], "inline")
            for m in re.finditer(render.MATH, CODE_SPAN.sub(" ", text))]


def test_markdown_cells_are_read_from_the_percent_format(tmp_path):
    nb = tmp_path / "ch99.py"
    nb.write_text("# %%\nx = 1  # `q_t`\n\n# %% [markdown]\n# One $q_t$ and `code`.\n#\n# More.\n\n# %%\ny = 2\n")
    assert markdown_cells(nb) == [(5, "One $q_t$ and `code`.\n\nMore.\n")]
    assert _notebook_math(markdown_cells(nb)[0][1]) == [("q_t", "inline")]


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_formulas_are_tex_not_code(path):
    names = code_names()
    found = [(f"{path.name}:{line}", span, why) for line, text in markdown_cells(path)
             for span in CODE_SPAN.findall(text) if (why := math_like(span, names))]
    assert found == [], f"formulas written as code in markdown cells (write them as $TeX$): {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_prose_has_no_formula_left_as_text(path):
    found = []
    for line, text in markdown_cells(path):
        prose = re.sub(render.MATH, " ", CODE_SPAN.sub(" ", text))
        found += [f"{path.name}:{line}: {r}" for r in prose_residue(prose)]
    assert found == [], f"math left as plain text or unpaired $: {found}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=lambda p: p.stem)
def test_notebook_tex_converts(path):
    """The TeX of a markdown cell must be what the book accepts (latex2mathml, no unknown command): the same
    subset renders in JupyterLab's MathJax."""
    bad = []
    for line, text in markdown_cells(path):
        for tex, display in _notebook_math(text):
            try:
                mathml = latex_to_mathml(tex.strip(), display=display)
            except Exception as e:  # latex2mathml raises a variety of errors on TeX it cannot parse
                bad.append(f"{path.name}:{line}: ${tex}$: {type(e).__name__} {e}")
                continue
            unknown = re.findall(r"<m[ion][^>]*>(\\[A-Za-z]+)<", mathml)
            if unknown:
                bad.append(f"{path.name}:{line}: ${tex}$: unknown TeX {', '.join(unknown)}")
    assert bad == []


@pytest.mark.parametrize("name", FORMULA_CHAPTERS)
def test_notebooks_of_chapters_with_formulas_write_tex(name):
    path = REPO_ROOT / "notebooks" / f"{name}.py"
    assert any(_notebook_math(text) for _, text in markdown_cells(path)), f"{path.name} has no $TeX$"
