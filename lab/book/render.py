"""
The manuscript renderer: book/chNN_name.md -> build/book/chNN_name.html, every number filled in from
results.json, plus index.html (book/index.md: who the book is for, the path through it, a generated table of
the chapters), glossary.html (book/glossary.md), next.html (book/next.md, after the last chapter) and
print.html (the whole book on one page, for printing). See "the pages around the chapters" below for the
layout every chapter follows (a summary under the title, fixed closing sections) and "the glossary" for how
the first use of a term in a chapter links to its entry.

`python -m lab.book` renders the book, checks it, or renders it and takes screenshots of every page (see
lab/book/__main__.py and lab/book/screens.py).

References. The manuscript never types a measured number. It writes a reference to a key of results.json:

    Without a cache the model computes {{ch01.positions.uncached}} ...     -> "1,040 positions"
    one decode step takes {{ch01.step_ms.smollm2.T512:.1f}} ...            -> "3.1 ms"
    the loop ran {{ch01.loop.steps|number}} steps ...                      -> "48 steps" (no unit)
    a perplexity of {{ch01.perplexity.heldout:.1f|number}} ...             -> "a perplexity of 46.8"
    the tokens are {{ch02.agreement.tokens_identical|bool:identical/different}} -> "identical"

The part after ":" is a Python format spec applied to the number; the unit is appended unless `|number`
follows. A boolean must be rendered as a word with `|bool:WORD_IF_TRUE/WORD_IF_FALSE`; a bare boolean is
an error, so "true"/"false" never reach the prose (see lab.results.format_value). References are filled
in everywhere, code blocks included.

Verdicts. A sentence that compares measured values in words ("earlier", "beats", "a tenth of") either lets
the result choose the word, {{verdict: KEY_A < KEY_B|earlier/later}}, or is guarded by a claim that
renders nothing, {{claim: KEY_A < KEY_B}}; a false claim is a problem that names the sentence, and the
book is not rendered (lab.book.claims).

Listings. A line `::: code PATH NAME` inserts the source of NAME in the repository file PATH: a top-level
function or class, a method (`Class.method`), or a region marked in the source by a line `# region NAME`
and a line `# endregion` (the marker lines are not shown, the region is dedented). Without NAME the whole
file is listed. A listing longer than 60 lines, or with a line wider than 100 characters (what the
column shows without scrolling), is an error: list a method or a region instead.

Math. $...$ (inline) and $$...$$ (display) are TeX, converted to MathML when the book is rendered (no
script, no network); a $ inside code is left alone, and \\$ is a dollar sign.

Figures are ordinary markdown images pointing at ../results/figures/NAME.png, each a paragraph of its own.
The alt text is the caption: the image becomes a figure numbered within its chapter ("Figure 3.2. ...");
an empty alt text is an error. Figures are taken from the figures/ folder beside the results file in use,
copied into the output folder, and the links rewritten. A missing figure is an error, as is a reference
that does not resolve: the book is rendered whole or not at all.

Every page is self-contained: the CSS (Pygments' highlighting included) is embedded, nothing is loaded
from the network, and no path of the machine it was rendered on appears in it.
"""

import ast
import contextlib
import html
import re
import shutil
import textwrap
import xml.etree.ElementTree as etree
from dataclasses import dataclass
from pathlib import Path

import markdown
from latex2mathml.converter import convert as latex_to_mathml
from markdown.extensions import Extension
from markdown.extensions.toc import slugify
from markdown.inlinepatterns import InlineProcessor
from markdown.treeprocessors import Treeprocessor
from pygments.formatters import HtmlFormatter

from lab.book import claims
from lab.results import REPO_ROOT, ResultsError, format_value, lookup, read

# {{ key }}, {{ key:spec }}, {{ key|number }}, {{ key:.1f|number }}, {{ key|bool:identical/different }}
REF = re.compile(r"\{\{\s*(?P<key>[^\s{}:|]+)\s*(?::(?P<spec>[^{}|]*?))?\s*(?:\|\s*(?P<how>[^{}]*?))?\s*\}\}")
# ![alt](target) or ![alt](target "title")
IMAGE = re.compile(r"!\[(?P<alt>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
FIGURE_LINK = "../results/figures/"  # how chapters link to the figures of results/
# ::: code lab/models/llama.py block   -> the source of that function, class, Class.method or region
CODE = re.compile(r"^::: code (?P<path>\S+)(?: +(?P<name>[\w.-]+))?[ \t]*$", re.MULTILINE)
DIRECTIVE = re.compile(r"^:::.*$", re.MULTILINE)  # any ::: line; those CODE does not match are errors
REGION = re.compile(r"^\s*#\s*region\s+(?P<name>\S+)\s*$")
ENDREGION = re.compile(r"^\s*#\s*endregion\b")

MAX_LISTING_LINES = 60
MAX_LISTING_WIDTH = 100  # characters; the column below shows this many in a <pre> without scrolling
COLUMN_REM = 52  # the text column; lab/experiments/plots.py sizes figures for it
COLUMN_PX = COLUMN_REM * 16  # at the browser's default font size

CSS = f"""
body {{ max-width: {COLUMN_REM}rem; margin: 2rem auto; padding: 0 1rem; line-height: 1.55;
       font-family: system-ui, -apple-system, "Segoe UI", Roboto, "DejaVu Sans", sans-serif; color: #222; }}
h1, h2, h3 {{ line-height: 1.25; }}
h1 {{ margin-top: 0.5rem; }}
a {{ color: #1a5b9c; }}
code, pre {{ font-family: ui-monospace, "SFMono-Regular", Menlo, "DejaVu Sans Mono", monospace; }}
code {{ font-size: 0.88em; background: #f3f3f0; padding: 0 0.2em; border-radius: 3px; }}
pre {{ font-size: 0.8rem; line-height: 1.4; background: #f6f6f4; padding: 0.6rem 0.7rem; overflow-x: auto;
      border-radius: 4px; border: 1px solid #e6e6e2; }}
pre code {{ font-size: 1em; background: none; padding: 0; }}
table {{ border-collapse: collapse; margin: 1rem 0; font-size: 0.92em; }}
th, td {{ border: 1px solid #d4d4d0; padding: 0.3rem 0.6rem; text-align: left; vertical-align: top; }}
th {{ background: #ecebe6; font-weight: 600; }}
tbody tr:nth-child(even) {{ background: #fafaf8; }}
td.num, th.num {{ text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }}
figure {{ margin: 1.5rem 0; }}
img {{ max-width: 100%; height: auto; }}
figcaption {{ font-size: 0.9em; color: #444; margin-top: 0.4rem; }}
math[display="block"] {{ margin: 1rem 0; padding: 0.25em 0; overflow-x: auto; overflow-y: hidden; }}
nav.chapters {{ font-size: 0.9em; display: flex; justify-content: space-between; gap: 1rem;
               border-bottom: 1px solid #ddd; padding-bottom: 0.5rem; margin-bottom: 1rem; }}
nav.chapters.bottom {{ border-bottom: none; border-top: 1px solid #ddd; padding-top: 0.5rem; margin-top: 2rem; }}
div.toc {{ font-size: 0.92em; background: #f8f8f6; border-left: 3px solid #ccc; padding: 0.3rem 1rem;
          margin-bottom: 1.5rem; }}
div.toc ul {{ margin: 0.2rem 0; padding-left: 1.2rem; }}
p.summary {{ background: #f2f6fb; border: 1px solid #d6e2ef; border-left: 4px solid #1a5b9c; border-radius: 4px;
            padding: 0.6rem 0.9rem; margin: 0.8rem 0 1.2rem; }}
p.also {{ margin-top: -0.6rem; font-size: 0.9em; color: #555; }}
a.term {{ color: inherit; text-decoration: underline dotted #1a5b9c; text-underline-offset: 2px; }}
@media print {{
  body {{ max-width: none; margin: 0; font-size: 10.5pt; }}
  nav.chapters, div.toc {{ display: none; }}
  section.chapter {{ break-before: page; }}
  pre {{ white-space: pre-wrap; font-size: 8pt; }}
  figure, pre, table, p.summary {{ break-inside: avoid; }}
  a {{ color: inherit; text-decoration: none; }}
}}
"""
PYGMENTS_CSS = HtmlFormatter(style="default").get_style_defs(".codehilite")

# private-use characters around a reference's text when a page is rendered for the prose checks
MARK_OPEN, MARK_MID, MARK_CLOSE = "\ue000", "\ue001", "\ue002"


class BookError(ValueError):
    """The manuscript cannot be rendered: a missing figure, a bad format spec, or several problems."""


# -----------------------------------------------------------------------------
# references


def _spec(m) -> str:
    """The format spec of a REF match as lab.results.format_value reads it: "FORMAT" or "FORMAT|how"."""
    spec = (m["spec"] or "").strip()
    return f"{spec}|{m['how'].strip()}" if m["how"] is not None else spec


def references(text) -> list[tuple[str, str]]:
    """Every reference in text as (key, spec), in order; spec is "" when none was given, and carries
    `|number` or `|bool:A/B` when the reference has one (".1f|number"). Claims and verdicts are not
    references (see lab.book.claims)."""
    return [(m["key"], _spec(m)) for m in REF.finditer(_blank_claims(text))]


def _blank_claims(text) -> str:
    """text with every {{claim: ...}} and {{verdict: ...}} replaced by its line breaks alone, so that the
    references can be found, and their lines counted, without them."""
    return claims.CLAIM.sub(lambda m: "\n" * m[0].count("\n"), text)


def _claim_problem(text, m, doc, source) -> str | None:
    """Why the claim or verdict m of text fails, with the sentence it guards (its references filled in);
    None when it holds."""
    try:
        claims.fill(m, doc, source)
        return None
    except claims.ClaimError as e:
        said = claims.sentence(text, m.start(), m.end())
        with contextlib.suppress(ResultsError, BookError, claims.ClaimError):
            said = render_text(said, doc, source)
        return f"{e}; in the sentence: \u201c{said}\u201d"


def _is_bool(v) -> bool:
    return isinstance(v, bool) or (isinstance(v, list) and any(isinstance(x, bool) for x in v))


def _fill(key, spec, doc, source) -> str:
    """One reference as prose; ResultsKeyError when the key does not resolve."""
    leaf = lookup(doc, key, source)
    how = spec.partition("|")[2].strip()
    if _is_bool(leaf["value"]) and not how.startswith("bool:"):
        raise BookError(f"{{{{{key}}}}} is a boolean ({leaf['value']!r}); write it as a word: "
                        f"{{{{{key}|bool:WORD_IF_TRUE/WORD_IF_FALSE}}}}, e.g. |bool:identical/different")
    try:
        return format_value(leaf, spec)
    except (ValueError, TypeError) as e:
        raise BookError(f"{{{{{key}:{spec}}}}}: format spec {spec!r} does not apply to "
                        f"value {leaf['value']!r}: {e}") from None


def render_text(text, doc, source="results", marks=None) -> str:
    """text with every reference replaced by its formatted value from doc.

    marks: a list to collect (key, spec, leaf) of every reference; each rendered reference is then wrapped
    in private-use characters (MARK_OPEN index MARK_MID text MARK_CLOSE), for the prose checks.
    """
    def fill(m):
        spec = _spec(m)
        out = _fill(m["key"], spec, doc, source)
        if marks is None:
            return out
        marks.append((m["key"], spec, lookup(doc, m["key"], source)))
        return f"{MARK_OPEN}{len(marks) - 1}{MARK_MID}{out}{MARK_CLOSE}"

    def decide(m):  # a claim renders nothing, a verdict its word; a false claim stops the rendering
        if (problem := _claim_problem(text, m, doc, source)) is not None:
            raise BookError(problem)
        return claims.fill(m, doc, source)

    return REF.sub(fill, claims.CLAIM.sub(decide, text))


# -----------------------------------------------------------------------------
# listings


def _find_def(body, parts):
    """The def or class at dotted path `parts` (["PagedCache", "update"]) in an ast body, or None."""
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name == parts[0]:
            return node if len(parts) == 1 else _find_def(node.body, parts[1:])
    return None


def _region(lines, name, path) -> list[str] | None:
    """The lines between `# region NAME` and its `# endregion`; None if there is no such region."""
    starts = [i for i, line in enumerate(lines) if (m := REGION.match(line)) and m["name"] == name]
    if not starts:
        return None
    if len(starts) > 1:
        raise BookError(f"code listing: region {name!r} is marked {len(starts)} times in {path}")
    depth = 0
    for j in range(starts[0] + 1, len(lines)):
        if REGION.match(lines[j]):
            depth += 1
        elif ENDREGION.match(lines[j]):
            if depth == 0:
                return lines[starts[0] + 1: j]
            depth -= 1
    raise BookError(f"code listing: region {name!r} in {path} has no `# endregion` line")


def code_listing(path, name=None, root=REPO_ROOT) -> str:
    """The source of `name` in the file `path` (relative to root): a top-level function or class, a method
    (`Class.method`), or a region marked `# region NAME` ... `# endregion`; the whole file when name is None.
    Region marker lines are never shown, and the listing is dedented.

    Listings in the manuscript are taken from `lab` at render time, so book and code cannot drift apart.
    Limits (listing_problems) are checked by check() and render(), not here.
    """
    file = Path(root) / path
    if not file.is_file():
        raise BookError(f"code listing: no file {path}")
    source = file.read_text()
    lines = source.splitlines()
    if name is None:
        body = lines
    elif (node := _find_def(ast.parse(source).body, name.split("."))) is not None:
        first = min([node.lineno] + [d.lineno for d in node.decorator_list])
        body = lines[first - 1: node.end_lineno]
    else:
        body = _region(lines, name, path)
        if body is None:
            raise BookError(f"code listing: no top-level function or class, Class.method, or "
                            f"`# region {name}` named {name!r} in {path}")
    body = [line for line in body if not REGION.match(line) and not ENDREGION.match(line)]  # markers: not shown
    return textwrap.dedent("\n".join(body)).strip("\n")


def listing_problems(code, path, name=None) -> list[str]:
    """What makes a listing unreadable in the book: too long, or a line wider than the column."""
    what = f"code listing {path}" + (f" {name}" if name else "")
    lines = code.expandtabs(4).splitlines()
    problems = []
    if len(lines) > MAX_LISTING_LINES:
        problems.append(f"{what} has {len(lines)} lines, more than {MAX_LISTING_LINES}; list a method "
                        f"(Class.method) or a `# region NAME` of it instead")
    wide = [(i, len(line)) for i, line in enumerate(lines, 1) if len(line) > MAX_LISTING_WIDTH]
    if wide:
        shown = ", ".join(f"line {i} has {n}" for i, n in wide[:3])
        problems.append(f"{what} has {len(wide)} line(s) wider than {MAX_LISTING_WIDTH} characters ({shown}); "
                        f"wrap them in the source")
    return problems


def fill_code(text, root=REPO_ROOT) -> str:
    """Replace every `::: code PATH [NAME]` line with a fenced listing of that code; BookError if a listing
    breaks the limits."""
    def listing(m):
        code = code_listing(m["path"], m["name"], root)
        problems = listing_problems(code, m["path"], m["name"])
        if problems:
            raise BookError("; ".join(problems))
        return f"```python\n# {m['path']}\n{code}\n```"

    return CODE.sub(listing, text)


# -----------------------------------------------------------------------------
# markdown: math, figures, tables


class _Math(InlineProcessor):
    """$$...$$ and $...$ -> MathML. Runs after code spans (which it therefore never sees), before escapes."""

    def handleMatch(self, m, data):
        tex, display = (m["display"], "block") if m["display"] is not None else (m["inline"], "inline")
        try:
            mathml = latex_to_mathml(tex.strip(), display=display)
        except Exception as e:  # latex2mathml raises a variety of errors on TeX it cannot parse
            raise BookError(f"math ${tex}$ cannot be converted to MathML: {type(e).__name__} {e}") from None
        unknown = re.findall(r"<m[ion][^>]*>(\\[A-Za-z]+)<", mathml)  # a command it does not know stays text
        if unknown:
            raise BookError(f"math ${tex}$ cannot be converted to MathML: unknown TeX {', '.join(unknown)}")
        return self.md.htmlStash.store(mathml), m.start(0), m.end(0)


# $$...$$ first; an inline $...$ neither starts nor ends with a space and is not followed by a digit
# (so "$5 and $6" stays text); \$ is a dollar sign.
MATH = (r"(?<!\\)\$\$(?P<display>.+?)(?<!\\)\$\$"
        r"|(?<![\\$])\$(?P<inline>[^\s$](?:[^$]*?[^\s\\$])?)\$(?![\d$])")

NUMERIC = re.compile(r"^[−+\-±~≈<>≤≥]?\s?\d[\d,.]*(?:e[+-]?\d+)?\s*(?:[×%]|[^\s\d]{1,12})?$")


class _Figures(Treeprocessor):
    """Every image -> <figure><img><figcaption>Figure N.k. alt</figcaption></figure>; numeric columns."""

    def __init__(self, md, chapter_no):
        super().__init__(md)
        self.chapter_no = chapter_no

    def run(self, root):
        parents = {child: parent for parent in root.iter() for child in parent}
        k = 0
        for img in list(root.iter("img")):
            parent = parents.get(img)
            alt = (img.get("alt") or "").strip()
            if not alt:
                raise BookError(f"figure {img.get('src')}: the alt text is empty; it is the figure's caption")
            alone = (parent is not None and parent.tag == "p" and len(parent) == 1
                     and not (parent.text or "").strip() and not (img.tail or "").strip())
            if not alone:
                raise BookError(f"figure {img.get('src')}: an image must be a paragraph of its own "
                                f"(a blank line before and after it)")
            k += 1
            parent.tag = "figure"
            img.tail = None
            parent.append(_caption(f"Figure {self.chapter_no}.{k}. ", alt))
        for table in root.iter("table"):
            self._numeric_columns(table)

    @staticmethod
    def _numeric_columns(table):
        """Right-align (class "num") the columns whose every body cell is a number, with its unit."""
        rows = [list(tr) for tr in table.iter("tr")]
        body = [r for r in rows if r and all(c.tag == "td" for c in r)]
        if not body:
            return
        width = max(len(r) for r in rows)
        for col in range(width):
            cells = [r[col] for r in body if col < len(r)]
            texts = ["".join(c.itertext()).strip() for c in cells]
            texts = [t for t in texts if t not in ("", "—", "–", "-", "n/a")]  # a dash: no value here
            if texts and all(NUMERIC.match(t) for t in texts):
                for r in rows:
                    if col < len(r) and "style" not in r[col].attrib:
                        r[col].set("class", "num")


def _caption(prefix, alt):
    """<figcaption>prefix + alt</figcaption>, alt's inline markdown (*emphasis*, `code`) rendered."""
    caption = etree.Element("figcaption")
    inner = re.sub(r"^<p>|</p>$", "", markdown.markdown(alt).strip())
    try:
        parsed = etree.fromstring(f"<figcaption>{inner}</figcaption>")
    except etree.ParseError:  # an entity XML does not know: keep the text as written
        caption.text = prefix + alt
        return caption
    caption.text = prefix + (parsed.text or "")
    caption.extend(list(parsed))
    return caption


class _Marked(Treeprocessor):
    """The paragraphs with a fixed form get a class for the CSS: a chapter's summary (`**In short.** ...`,
    class "summary") and a glossary entry's aliases (`*Also:* ...`, class "also")."""

    FORMS = (("strong", "In short.", "summary"), ("em", "Also:", "also"))

    def run(self, root):
        for p in root.iter("p"):
            first = p[0] if len(p) else None
            if first is None or (p.text or "").strip():
                continue
            for tag, text, cls in self.FORMS:
                if first.tag == tag and (first.text or "").strip() == text:
                    p.set("class", cls)


class _BookExtension(Extension):
    def __init__(self, chapter_no, links=None, **kwargs):
        self.chapter_no = chapter_no
        self.links = links
        super().__init__(**kwargs)

    def extendMarkdown(self, md):
        md.ESCAPED_CHARS.append("$")
        md.inlinePatterns.register(_Math(MATH, md), "math", 185)  # after backtick (190), before escape (180)
        md.treeprocessors.register(_Figures(md, self.chapter_no), "figures", 15)  # after inline (20)
        md.treeprocessors.register(_Marked(md), "marked", 14)
        if self.links is not None:
            md.treeprocessors.register(_FirstUses(md, self.links), "glossary", 13)  # after figures: no captions


def _chapter_no(chapter: Path, default: int) -> int:
    m = re.match(r"ch(\d+)", chapter.stem)
    return int(m[1]) if m else default


def to_html(text, chapter_no=1, id_prefix="", links=None) -> tuple[str, str]:
    """Markdown (references and listings already filled) -> (body HTML, table of contents HTML).

    id_prefix keeps heading ids unique when several chapters share a page (print.html). links: the glossary's
    terms (a list of Term); the first use of each in the running text links to glossary.html#<slug>.
    """
    def slug(value, separator):
        return f"{id_prefix}{slugify(value, separator)}"

    md = markdown.Markdown(
        extensions=["tables", "fenced_code", "codehilite", "toc", _BookExtension(chapter_no, links)],
        extension_configs={"codehilite": {"guess_lang": False},
                           "toc": {"toc_depth": "2-3", "slugify": slug}})
    body = md.convert(text)
    return body, md.toc


# -----------------------------------------------------------------------------
# the glossary: its terms, read from book/glossary.md, and their first uses in a chapter linked to it
#
# An entry of glossary.md is a `### Headword` heading, optionally followed on the next line by
# `*Also:* alias, alias`, then its definition. The first use in a chapter's running text of the headword or an
# alias (case-insensitive, whole words) links to glossary.html#<slug>, the heading's id. Headings, code,
# existing links, figure captions and math are never linked.

GLOSSARY_ENTRY = re.compile(r"^### +(?P<head>[^\n]+?)[ \t]*\n(?:\*Also:\*[ \t]*(?P<also>[^\n]*?)[ \t]*\n)?",
                            re.MULTILINE)
NOT_LINKED = {"h1", "h2", "h3", "h4", "h5", "h6", "pre", "code", "a", "figcaption", "math", "script", "style"}


@dataclass(frozen=True)
class Term:
    """A glossary entry: its headword, the id of its heading on glossary.html, and every phrase that names it."""
    head: str
    slug: str
    phrases: tuple


def glossary_terms(text) -> list[Term]:
    """The entries of glossary.md, in order; BookError on two entries with the same slug or phrase."""
    terms, seen = [], {}
    for m in GLOSSARY_ENTRY.finditer(text):
        head = m["head"].strip()
        aliases = [a.strip() for a in (m["also"] or "").split(",") if a.strip()]
        term = Term(head, slugify(head, "-"), tuple(dict.fromkeys([head, *aliases])))
        for phrase in (term.slug, *(p.lower() for p in term.phrases)):
            if phrase in seen and seen[phrase] != head:
                raise BookError(f"glossary: {phrase!r} names both {seen[phrase]!r} and {head!r}")
            seen[phrase] = head
        terms.append(term)
    return terms


def _phrase_pattern(terms) -> re.Pattern:
    """One pattern for every phrase of terms, longest first, whole words (a hyphen joins words), any case;
    a space in a phrase matches any run of white space (a line break of the source)."""
    phrases = sorted({p for t in terms for p in t.phrases}, key=len, reverse=True)
    alternatives = "|".join(r"\s+".join(map(re.escape, p.split())) for p in phrases)
    return re.compile(rf"(?<![\w-])(?:{alternatives})(?![\w-])", re.IGNORECASE)


class _FirstUses(Treeprocessor):
    """Links the first use of each glossary term in the running text of one page to its entry."""

    def __init__(self, md, terms, href="glossary.html#"):
        super().__init__(md)
        self.href = href
        self.pattern = _phrase_pattern(terms)
        self.slug = {" ".join(p.lower().split()): t.slug for t in terms for p in t.phrases}

    def run(self, root):
        self.linked = set()
        self._walk(root)

    def _walk(self, elem):
        """elem's own text, then each child's subtree and its tail (which is elem's text): document order."""
        children = list(elem)
        elem.text, links = self._split(elem.text)
        for k, a in enumerate(links):
            elem.insert(k, a)
        for child in children:
            if child.tag not in NOT_LINKED:
                self._walk(child)
            child.tail, links = self._split(child.tail)
            at = list(elem).index(child) + 1
            for k, a in enumerate(links):
                elem.insert(at + k, a)

    def _split(self, text):
        """text before the first new term, and an <a> per new term with the text up to the next as its tail."""
        if not text:
            return text, []
        head, links, last = None, [], 0
        for m in self.pattern.finditer(text):
            slug = self.slug[" ".join(m[0].lower().split())]
            if slug in self.linked:
                continue
            self.linked.add(slug)
            a = etree.Element("a", {"href": f"{self.href}{slug}", "class": "term"})
            a.text = m[0]
            if links:
                links[-1].tail = text[last:m.start()]
            else:
                head = text[:m.start()]
            links.append(a)
            last = m.end()
        if not links:
            return text, []
        links[-1].tail = text[last:]
        return head, links


# -----------------------------------------------------------------------------
# chapters, problems


def chapters(book_dir) -> list[Path]:
    """The manuscript chapters, book/ch*.md, in order."""
    return sorted(Path(book_dir).glob("ch*.md"))


def _figure_source(target, chapter: Path, results: Path) -> Path | None:
    """The file an image link points at; None for a link off the machine (http:, data:)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("//"):
        return None
    if target.startswith(FIGURE_LINK):
        return results.parent / "figures" / target[len(FIGURE_LINK):]
    return chapter.parent / target


def _line(text, pos) -> int:
    return text.count("\n", 0, pos) + 1


def _chapter_problems(chapter: Path, text, doc, results: Path, root=REPO_ROOT) -> list[str]:
    """Unresolved references, bad listings, missing figures and unconvertible markdown of one chapter,
    each with its line."""
    where = f"{chapter.parent.name}/{chapter.name}"
    problems = []
    for m in claims.CLAIM.finditer(text):
        if (problem := _claim_problem(text, m, doc, str(results))) is not None:
            problems.append(f"{where}:{_line(text, m.start())}: {problem}")
    for m in REF.finditer(_blank_claims(text)):
        try:
            _fill(m["key"], _spec(m), doc, str(results))
        except (ResultsError, BookError) as e:
            problems.append(f"{where}:{_line(text, m.start())}: {e}")
    for m in DIRECTIVE.finditer(text):
        if not CODE.match(m[0]):
            problems.append(f"{where}:{_line(text, m.start())}: not a listing directive: {m[0]!r} "
                            f"(write `::: code PATH [NAME]`)")
    for m in CODE.finditer(text):
        try:
            code = code_listing(m["path"], m["name"], root)
        except BookError as e:
            problems.append(f"{where}:{_line(text, m.start())}: {e}")
            continue
        problems += [f"{where}:{_line(text, m.start())}: {p}" for p in listing_problems(code, m["path"], m["name"])]
    for m in IMAGE.finditer(text):
        line = _line(text, m.start())
        if not m["alt"].strip():
            problems.append(f"{where}:{line}: figure {m['target']} has no alt text; it is the figure's caption")
        source = _figure_source(m["target"], chapter, results)
        if source is None:
            problems.append(f"{where}:{line}: figure {m['target']} is not a local file; the book must work offline")
        elif not source.is_file():
            problems.append(f"{where}:{line}: figure {m['target']} not found "
                            f"(looked for {source}); run the chapter's experiment or `make results`")
    problems.sort(key=lambda p: int(re.match(r"[^:]*:(\d+):", p)[1]))  # in the order of the chapter
    if not problems:  # what only the conversion finds: TeX that does not convert, an image inside a sentence
        try:
            to_html(fill_code(render_text(text, doc, str(results)), root), _chapter_no(chapter, 0))
        except BookError as e:
            problems.append(f"{where}: {e}")
    return problems


def check(book_dir, notebooks_dir, results_path, root=REPO_ROOT) -> list[str]:
    """Problems that would break the book, as readable lines; an empty list when there are none.

    A chapter book/chNN_name.md without notebooks/chNN_name.py, a reference that does not resolve in
    results_path (or a bare boolean), a listing that is missing, too long or too wide, an image link to a
    missing file or without alt text, TeX that does not convert; the same in the pages around the chapters,
    and glossary entries that clash. A chapter's layout (layout_problems) is checked by the tests, not here.
    """
    results_path = Path(results_path)
    problems = []
    try:
        doc = read(results_path)
    except ResultsError as e:
        problems.append(str(e))
        doc = None
    for chapter in chapters(book_dir):
        notebook = Path(notebooks_dir) / f"{chapter.stem}.py"
        if not notebook.is_file():
            problems.append(f"{Path(book_dir).name}/{chapter.name}: no notebook "
                            f"{Path(notebooks_dir).name}/{notebook.name} for this chapter")
        if doc is not None:
            problems += _chapter_problems(chapter, chapter.read_text(), doc, results_path, root)
    if doc is not None:
        problems += _around_problems(book_dir, around(book_dir), doc, results_path, root)
    return problems


# -----------------------------------------------------------------------------
# the pages around the chapters: book/index.md (who the book is for, the path through it, and a generated
# table of what each chapter takes), book/glossary.md (terms and notation) and book/next.md (where to go
# next). Each is optional; none is a chapter.
#
# A chapter opens with its summary, one paragraph right under the `# Chapter N — Title` line that starts
# `**In short.**`, and closes with `## N. What the numbers do not show`, `## N+1. Exercises` and
# `## References`, in that order, every section before References numbered 1, 2, 3, ... (layout_problems).

FRONT, GLOSSARY, NEXT = "index.md", "glossary.md", "next.md"
CHAPTER_TABLE = re.compile(r"^::: chapters[ \t]*$", re.MULTILINE)  # in index.md: where the table goes
READING_WPM = 200  # words a minute, for reading time: a careful pace for technical prose (the index says so)
SUMMARY = "**In short.**"
CLOSING = ("What the numbers do not show", "Exercises")


def around(book_dir) -> dict:
    """The pages around the chapters that book_dir holds: {file name: markdown}."""
    return {name: (Path(book_dir) / name).read_text() for name in (FRONT, GLOSSARY, NEXT)
            if (Path(book_dir) / name).is_file()}


def _around_problems(book_dir, extra, doc, results_path, root) -> list[str]:
    """What would break the pages around the chapters: the same problems as a chapter's, and a glossary
    whose entries clash."""
    problems = []
    for name, text in extra.items():
        problems += _chapter_problems(Path(book_dir) / name, CHAPTER_TABLE.sub("", text), doc, results_path, root)
    if GLOSSARY in extra:
        try:
            glossary_terms(extra[GLOSSARY])
        except BookError as e:
            problems.append(f"{Path(book_dir).name}/{GLOSSARY}: {e}")
    return problems


def summary(text) -> str | None:
    """A chapter's summary: the paragraph right under its title line, starting **In short.**, on one line;
    None when there is none."""
    m = re.search(r"\A(?:[ \t]*\n)*# [^\n]*\n[ \t]*\n((?:[^\n]*\S[^\n]*\n?)+)", text)
    return " ".join(m[1].split()) if m and m[1].startswith(SUMMARY) else None


def first_sentence(text) -> str:
    """The first sentence of a summary, without its **In short.** (a sentence ends at a full stop and a space)."""
    text = text.removeprefix(SUMMARY).strip()
    m = re.match(r"(.+?[.!?])(?:\s|$)", text)
    return m[1] if m else text


def _sections(text) -> list[str]:
    """The `## ` headings of a markdown page, in order, outside fenced code."""
    heads, fenced = [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and line.startswith("## "):
            heads.append(line[3:].strip())
    return heads


def layout_problems(text) -> list[str]:
    """How a chapter departs from the book's fixed layout: the summary under the title, the sections numbered
    1, 2, 3, ..., the last two numbered ones "What the numbers do not show" and "Exercises", then References
    last. An empty list when it follows it."""
    problems = []
    if summary(text) is None:
        problems.append(f"no summary: the paragraph right under the `# ` title line must start `{SUMMARY}`")
    heads = _sections(text)
    if not heads or heads[-1] != "References":
        problems.append(f"the last section must be `## References`, not {heads[-1:] or 'none'}")
    body = heads[:-1] if heads[-1:] == ["References"] else heads
    numbered = [re.match(r"(\d+)\. (.+)$", h) for h in body]
    if not all(numbered):
        loose = [h for h, m in zip(body, numbered, strict=True) if not m]
        problems.append(f"sections before References must be numbered `## N. Title`: {loose}")
    elif [int(m[1]) for m in numbered] != list(range(1, len(numbered) + 1)):
        problems.append(f"sections are numbered {[int(m[1]) for m in numbered]}, not 1, 2, 3, ...")
    titles = tuple(m[2] if m else h for h, m in zip(body[-2:], numbered[-2:], strict=True))
    if titles != CLOSING:
        problems.append(f"the sections before References must be `## N. {CLOSING[0]}` then "
                        f"`## N+1. {CLOSING[1]}`, not {list(titles)}")
    return problems


def reading_minutes(body_html) -> int:
    """Minutes to read a rendered page at READING_WPM: the words of its text, code listings and math excluded."""
    text = html.unescape(re.sub(r"<[^>]+>", " ", re.sub(r"<(pre|math)\b[\s\S]*?</\1>", " ", body_html)))
    return max(1, round(sum(1 for w in text.split() if re.search(r"\w", w)) / READING_WPM))


def chapter_table(pages, doc) -> str:
    """Markdown: a row per chapter (its number, its title linked, the first sentence of its summary, its
    reading time and its notebook's quick-mode run time as a reference into results.json), then a note that
    says how both times were counted and on what machine the notebooks ran."""
    rows = ["| | chapter | what it does | reading | notebook |", "|---|---|---|---|---|"]
    for p in pages:
        title = re.sub(r"^Chapter \d+ — ", "", p["title"])
        what = first_sentence(p["summary"]) if p["summary"] else "—"
        key = f"notebooks.seconds.{p['stem']}"
        try:
            lookup(doc, key)
            run = f"{{{{{key}:.0f}}}}"
        except ResultsError:
            run = "—"
        rows.append(f"| {p['number']} | [{title}]({p['stem']}.html) | {what} | {p['minutes']} min | {run} |")
    machine = (doc["sections"].get("notebooks") or {}).get("provenance", {}).get("machine", {})
    where = (f"measured on {machine['processor']} ({machine.get('cpu_count', '?')} CPUs)" if machine.get("processor")
             else "not measured yet")
    note = (f"Reading time counts the words of each chapter's text, code listings excluded, at {READING_WPM} words "
            f"a minute, a careful pace for technical prose. Notebook time is one run of the chapter's notebook "
            f"in quick mode, every cell, from a fresh kernel, {where}.")
    return "\n".join(rows) + "\n\n" + note + "\n"


# -----------------------------------------------------------------------------
# pages


def _title(text, default) -> str:
    m = re.search(r"^# +(.+?)\s*$", text, re.MULTILINE)
    return m[1] if m else default


def _page(title, body) -> str:
    return (f'<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">\n'
            f"<title>{html.escape(title)}</title>\n<style>{CSS}\n{PYGMENTS_CSS}</style>\n</head>\n<body>\n"
            f"{body}\n</body>\n</html>\n")


def _nav(prev, nxt, where, glossary=False) -> str:
    """Previous / contents (and glossary) / next links; prev and nxt are (file name, title) or None."""
    left = f'<a href="{prev[0]}">← {html.escape(prev[1])}</a>' if prev else "<span></span>"
    right = f'<a href="{nxt[0]}">{html.escape(nxt[1])} →</a>' if nxt else "<span></span>"
    middle = '<a href="index.html">Contents</a>' + (' · <a href="glossary.html">Glossary</a>' if glossary else "")
    return f'<nav class="chapters {where}">{left}<span>{middle}</span>{right}</nav>'


def _after_h1(body, insert) -> str:
    """insert placed right after the page's first </h1> (at the top when there is none)."""
    i = body.find("</h1>")
    return f"{insert}\n{body}" if i < 0 else f"{body[:i + 5]}\n{insert}{body[i + 5:]}"


def _after_summary(body, insert) -> str:
    """insert placed after the summary paragraph right under the title, or right after the title."""
    m = re.search(r'</h1>\s*<p class="summary">[\s\S]*?</p>', body)
    return f"{body[:m.end()]}\n{insert}{body[m.end():]}" if m else _after_h1(body, insert)


def _print_links(body, stems) -> str:
    """Links to the book's own pages (ch05_paged.html, glossary.html#page, next.html) rewritten to anchors of
    print.html, where each page is a section whose id is its stem and whose heading ids carry it as a prefix."""
    def local(m):
        if m["stem"] not in stems:
            return m[0]
        return f'href="#{m["stem"]}-{m["frag"]}"' if m["frag"] else f'href="#{m["stem"]}"'

    return re.sub(r'href="(?P<stem>[\w-]+)\.html(?:#(?P<frag>[^"]*))?"', local, body)


def _shown(path: Path, book_dir: Path) -> str:
    """A results path as the index shows it: relative to the repository, never a path of this machine."""
    path = Path(path).resolve()
    for base in (Path(book_dir).resolve().parent, REPO_ROOT):
        if path.is_relative_to(base):
            return path.relative_to(base).as_posix()
    return f"{path.name} (a file outside the repository)"


def _measured(doc) -> str:
    """The mode(s) and date(s) of the sections of doc, e.g. "full mode, measured 2026-11-29"."""
    sections = doc["sections"].values()
    if not sections:
        return "no results yet"
    modes = ", ".join(sorted({s["provenance"]["mode"] for s in sections}))
    dates = sorted({s["provenance"]["date"][:10] for s in sections})
    when = dates[0] if len(dates) == 1 else f"{dates[0]} to {dates[-1]}"
    return f"{modes} mode, measured {when}"


def _prepare(chapter, text, doc, results_path, out_dir, root, marks=None) -> str:
    """A chapter's markdown with references, listings and figure links filled in (figures copied to out_dir)."""
    text = fill_code(render_text(text, doc, str(results_path), marks), root)

    def copy_figure(m):
        source = _figure_source(m["target"], chapter, results_path)
        if source is None:
            return m[0]
        if out_dir is not None:
            (out_dir / "figures").mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, out_dir / "figures" / source.name)
        return f"![{m['alt']}](figures/{source.name}{m['title'] or ''})"

    return IMAGE.sub(copy_figure, text)


def chapter_html(chapter, doc, results_path, marks=None, root=REPO_ROOT) -> str:
    """The body HTML of one chapter as render() writes it (nothing is written); with marks, every reference
    is wrapped in MARK_* characters and listed in marks (see render_text), for the prose checks."""
    chapter = Path(chapter)
    text = _prepare(chapter, chapter.read_text(), doc, Path(results_path), None, root, marks)
    return to_html(text, _chapter_no(chapter, 0))[0]


def render(book_dir, out_dir, results_path, root=REPO_ROOT) -> list[Path]:
    """Render every book/ch*.md to out_dir/chNN_name.html, the pages around them that exist (index.md, next.md,
    glossary.md), index.html and print.html; return the files written. Nothing is written unless the whole
    book renders."""
    book_dir, out_dir, results_path = Path(book_dir), Path(out_dir), Path(results_path)
    doc = read(results_path)
    texts = {chapter: chapter.read_text() for chapter in chapters(book_dir)}
    extra = around(book_dir)
    problems = [p for chapter, text in texts.items()
                for p in _chapter_problems(chapter, text, doc, results_path, root)]
    problems += _around_problems(book_dir, extra, doc, results_path, root)
    if problems:
        raise BookError("cannot render the book:\n  " + "\n  ".join(problems))
    terms = glossary_terms(extra[GLOSSARY]) if GLOSSARY in extra else None

    out_dir.mkdir(parents=True, exist_ok=True)
    pages = []  # one dict per chapter, then next.md: stem, title, body, toc, print body, minutes, summary
    for no, (chapter, text) in enumerate(texts.items(), 1):
        pages.append(_render_page(chapter, text, _chapter_no(chapter, no), doc, results_path, out_dir, root, terms))
    chapter_pages = list(pages)
    if NEXT in extra:
        pages.append(_render_page(book_dir / NEXT, extra[NEXT], 0, doc, results_path, out_dir, root, None))

    written = []
    links = [(f"{p['stem']}.html", p["title"]) for p in pages]
    for i, p in enumerate(pages):
        prev = links[i - 1] if i > 0 else None
        nxt = links[i + 1] if i + 1 < len(links) else None
        label = "In this chapter" if p in chapter_pages else "On this page"
        contents = f'<div class="toc"><strong>{label}</strong>\n{_strip_div(p["toc"])}</div>' if p["toc"] else ""
        page = out_dir / f"{p['stem']}.html"
        nav = (_nav(prev, nxt, where, terms is not None) for where in ("top", "bottom"))
        page.write_text(_page(p["title"], f"{next(nav)}\n{_after_summary(p['body'], contents)}\n{next(nav)}"))
        written.append(page)

    book_title = "Inference Lab: the KV cache"
    source = f"Numbers from {html.escape(_shown(results_path, book_dir))} ({html.escape(_measured(doc))})."
    printing = 'The whole book on one page, for printing: <a href="print.html">print.html</a>.'
    extras = []  # (stem, title, print body) of the pages printed around the chapters
    if GLOSSARY in extra:
        glossary = _prepare(book_dir / GLOSSARY, extra[GLOSSARY], doc, results_path, out_dir, root)
        body, _ = to_html(glossary, 0)
        page = out_dir / "glossary.html"
        nav = (_nav(None, None, where, True) for where in ("top", "bottom"))
        page.write_text(_page(_title(glossary, "Glossary"), f"{next(nav)}\n{body}\n{next(nav)}"))
        written.append(page)
        extras.append(("glossary", _title(glossary, "Glossary"), to_html(glossary, 0, id_prefix="glossary-")[0]))

    index = out_dir / "index.html"
    if FRONT in extra:
        front = CHAPTER_TABLE.sub(lambda m: chapter_table(chapter_pages, doc), extra[FRONT])
        if not CHAPTER_TABLE.search(extra[FRONT]):
            front += "\n\n" + chapter_table(chapter_pages, doc)
        front = _prepare(book_dir / FRONT, front, doc, results_path, out_dir, root)
        body = to_html(front, 0)[0] + f"\n<p>{source} {printing}</p>"
        index.write_text(_page(_title(front, book_title), f"{_nav(None, None, 'top', terms is not None)}\n{body}"))
        head = to_html(front, 0, id_prefix="index-")[0] + f"\n<p>{source}</p>"
    else:
        items = "\n".join(f'<li><a href="{name}">{html.escape(title)}</a></li>' for name, title in links)
        index.write_text(_page(book_title, f"<h1>{book_title}</h1>\n<p>{source}</p>\n"
                                           f"<ol>\n{items or '<li>(no chapters yet)</li>'}\n</ol>\n<p>{printing}</p>"))
        head = f"<h1>{book_title}</h1>\n<p>{source}</p>"
    written.append(index)

    printed = [(p["stem"], p["title"], p["print_body"]) for p in pages] + extras
    stems = {stem for stem, *_ in printed} | {"index"}
    toc = "\n".join(f'<li><a href="#{stem}">{html.escape(title)}</a></li>' for stem, title, _ in printed)
    sections = "\n".join(f'<section class="chapter" id="{stem}">\n{body}\n</section>' for stem, _, body in printed)
    whole = out_dir / "print.html"
    whole.write_text(_page(book_title, _print_links(f'<section id="index">\n{head}\n</section>\n'
                                                    f'<div class="toc"><ol>\n{toc}\n</ol></div>\n{sections}', stems)))
    written.append(whole)
    for path in written:
        print(f"wrote {_console(path)}")
    return written


def _render_page(path, text, number, doc, results_path, out_dir, root, terms) -> dict:
    """One chapter (or next.md) rendered for its own page and for print.html, with what the index shows of it."""
    text = _prepare(path, text, doc, results_path, out_dir, root)
    body, toc = to_html(text, number, links=terms)
    print_body, _ = to_html(text, number, id_prefix=f"{path.stem}-", links=terms)
    return dict(stem=path.stem, number=number, title=_title(text, path.stem), body=body, toc=toc,
                print_body=print_body, minutes=reading_minutes(body), summary=summary(text))


def _console(path) -> str:
    """A path as the terminal shows it: relative to the current folder when inside it."""
    path = Path(path).resolve()
    return str(path.relative_to(Path.cwd())) if path.is_relative_to(Path.cwd()) else str(path)


def _strip_div(toc) -> str:
    """The <ul> of a toc extension's <div class="toc">...</div>."""
    return re.sub(r'^\s*<div class="toc">\s*|\s*</div>\s*$', "", toc)
