"""Every table of the rendered book fits the text column (COLUMN_PX, 52rem).

The browser check (`python -m lab.book --screens`, lab.book.screens.wide_tables) measures the tables in headless
Chromium. This file estimates the same from the rendered HTML, cheaply, for `make test`: a table is at
least as wide as the sum of its columns' narrowest widths (min-content), and a column is as narrow as its
widest unbreakable run of text: a whole cell in a numeric column (class "num", nowrap), the longest word
in the others. Text is measured in the font the browser uses here, DejaVu Sans (matplotlib ships it), at
the table's 0.92em, bold in headers. Against Chromium the estimate is within 0.3% on every table of the book
(test_estimate_matches_chromium), so MARGIN_PX absorbs the rest.
"""

import re
import shutil
from html.parser import HTMLParser

import pytest
from matplotlib.font_manager import FontProperties
from matplotlib.textpath import TextToPath

from lab.book import render, screens
from lab.results import COMMITTED, read

FONT_PX = 16 * 0.92               # table { font-size: 0.92em } on the browser's 16-px default
CODE_SCALE = 0.88                 # code { font-size: 0.88em }, in DejaVu Sans Mono
CELL_PAD_PX = 2 * 0.6 * 16        # th, td { padding: 0.3rem 0.6rem }
BORDER_PX = 1.0                   # border-collapse: one 1-px border between columns, one at each end
MARGIN_PX = 4.0                   # the estimate's error against Chromium, with room to spare
HYPHEN = re.compile(r"(?<=\w)-(?=\w)")  # the browser may break a word after a hyphen: SmolLM2- / 135M

_text = TextToPath()
_widths: dict = {}


def text_px(s, bold=False, code=False) -> float:
    key = (s, bold, code)
    if key not in _widths:
        prop = FontProperties(family="DejaVu Sans Mono" if code else "DejaVu Sans", weight="bold" if bold else "normal",
                              size=FONT_PX * (CODE_SCALE if code else 1.0))
        _widths[key] = _text.get_text_width_height_descent(s, prop, ismath=False)[0] if s else 0.0
    return _widths[key]


class _Tables(HTMLParser):
    """tables: [table][row][cell] with cell = {"th", "num", "lines": [[(text, in code, in math)]]} (a <br>
    starts a line). Inside MathML only the symbols count (the white space between its elements is not laid
    out), and they are not bold."""

    def __init__(self):
        super().__init__()
        self.tables, self.cell, self.code, self.math = [], None, 0, 0

    def handle_starttag(self, tag, attrs):
        if tag == "table":
            self.tables.append([])
        elif tag == "tr" and self.tables:
            self.tables[-1].append([])
        elif tag in ("th", "td") and self.tables:
            self.cell = dict(th=tag == "th", num="num" in (dict(attrs).get("class") or "").split(), lines=[[]])
            self.tables[-1][-1].append(self.cell)
        elif tag == "br" and self.cell is not None:
            self.cell["lines"].append([])
        elif tag == "code":
            self.code += 1
        elif tag == "math":
            self.math += 1

    def handle_endtag(self, tag):
        if tag in ("th", "td"):
            self.cell = None
        elif tag == "code":
            self.code -= 1
        elif tag == "math":
            self.math -= 1

    def handle_data(self, data):
        if self.math:
            data = data.strip()
        if self.cell is not None and data:
            self.cell["lines"][-1].append((data, self.code > 0, self.math > 0))


def cell_min_px(cell) -> float:
    """The narrowest a cell's text can be laid out: its widest line (numeric cells do not wrap) or its widest
    word; a word split over several elements (text, then <code>) adds up."""
    widest = 0.0
    for line in cell["lines"]:
        if cell["num"]:
            widest = max(widest, sum(text_px(t.replace("\n", " "), cell["th"] and not math, code)
                                     for t, code, math in line))
            continue
        word = 0.0
        for t, code, math in line:
            t = HYPHEN.sub("- ", t)
            for i, part in enumerate(t.split()):
                w = text_px(part, cell["th"] and not math, code)
                word = word + w if i == 0 and not t[:1].isspace() else w
                widest = max(widest, word)
            if not t.strip() or t[-1:].isspace():
                word = 0.0
    return widest


def min_width_px(table) -> float:
    """The narrowest the browser can lay a table out (min-content), in CSS pixels."""
    columns: dict[int, float] = {}
    for row in table:
        for j, cell in enumerate(row):
            columns[j] = max(columns.get(j, 0.0), cell_min_px(cell))
    return sum(w + CELL_PAD_PX + BORDER_PX for w in columns.values()) + BORDER_PX


def tables_of(page_html) -> list:
    parser = _Tables()
    parser.feed(page_html)
    return parser.tables


def _describe(table) -> str:
    return " | ".join(" ".join(t for line in c["lines"] for t, *_ in line).strip() for c in table[0])[:80]


# an overflowing table: the workload table of chapter 6 before its headers were broken over two lines
WIDE = ("| workload (synthetic) | requests | mean prompt | distinct pages | from cache, smallest pool "
        "| from cache, a pool that never evicts |\n"
        "|---|---|---|---|---|---|\n"
        "| system prompts | 300 requests | 1193 tokens | 2,085 pages | 32% | 90% |\n")
NARROW = WIDE.replace("from cache, smallest pool", "from cache,<br>smallest pool").replace(
    "from cache, a pool that never evicts", "from cache, a pool<br>that never evicts")


def test_the_estimate_catches_a_wide_table_and_passes_it_rewrapped():
    wide, narrow = (tables_of(render.to_html(md)[0])[0] for md in (WIDE, NARROW))
    assert min_width_px(wide) > render.COLUMN_PX + 100       # Chromium measured 1,051.9 px
    assert min_width_px(narrow) < render.COLUMN_PX - MARGIN_PX


@pytest.mark.parametrize("chapter", [c.name for c in render.chapters(render.REPO_ROOT / "book")])
def test_every_table_fits_the_column(chapter):
    doc = read(COMMITTED)
    body = render.chapter_html(render.REPO_ROOT / "book" / chapter, doc, COMMITTED)
    wide = [f"table {i} ({_describe(t)}): at least {min_width_px(t):.0f} px" for i, t in enumerate(tables_of(body), 1)
            if min_width_px(t) > render.COLUMN_PX - MARGIN_PX]
    assert not wide, (f"{chapter}: tables wider than the {render.COLUMN_PX}-px column: {'; '.join(wide)}. Shorten "
                      f"their headers, drop a column, or break a header with <br>")


@pytest.mark.skipif(not any(shutil.which(b) for b in ("chromium", "chromium-browser", "google-chrome")),
                    reason="needs headless Chromium (make book-check installs it)")
def test_estimate_matches_chromium(tmp_path):
    """The estimate against the browser's own min-content width, and wide_tables against an overflow."""
    body = render.to_html(WIDE + "\n" + NARROW.replace("system prompts", "`few-shot`, SmolLM2-135M"))[0]
    page = tmp_path / "tables.html"
    page.write_text(render._page("tables", body))
    browser = screens.chromium()
    problems = screens.wide_tables(browser, page)
    assert len(problems) == 1 and problems[0].startswith("tables.html: table 1 ('workload (synthetic)")
    probe = screens._with_extra(page, "<script>window.addEventListener('load', () => { document.title = 'W=' + "
                                   "[...document.querySelectorAll('table')].map(t => { t.style.width = 'min-content'; "
                                   "return t.getBoundingClientRect().width; }).join(','); });</script>", "min")
    dom = screens._browser(browser, "--window-size=1280,1000", "--dump-dom", probe.as_uri())
    measured = [float(x) for x in re.search(r"W=([\d.,]+)", dom)[1].split(",")]
    for table, px in zip(tables_of(body), measured, strict=True):
        assert min_width_px(table) == pytest.approx(px, rel=0.005)
