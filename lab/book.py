"""
The manuscript renderer: book/chNN_name.md -> build/book/chNN_name.html, every number filled in from
results.json.

    python -m lab.book                       # render with the results of the current mode
    python -m lab.book --results PATH --out build/book
    python -m lab.book --check               # list problems (missing notebook, key or figure), render nothing

The manuscript never types a measured number. It writes a reference to a key of results.json:

    Without a cache the model computes {{ch01.positions.uncached}} ...     -> "1,040 positions"
    one decode step takes {{ch01.step_ms.smollm2.T512:.1f}} ...            -> "3.1 ms"

The part after ":" is a Python format spec applied to the number; the unit is appended either way
(see lab.results.format_value). References are filled in everywhere, code blocks included.

Figures are ordinary markdown images pointing at ../results/figures/NAME.png. They are taken from the
figures/ folder beside the results file in use (so a quick-mode book shows quick-mode figures), copied into
the output folder, and the links rewritten. A missing figure is an error, as is a reference that does not
resolve: the book is rendered whole or not at all.
"""

import argparse
import html
import re
import shutil
import sys
from pathlib import Path

import markdown

from lab.results import REPO_ROOT, ResultsError, format_value, lookup, read, results_path

# {{ section.path.to.value }} or {{ section.path.to.value:.1f }}
REF = re.compile(r"\{\{\s*(?P<key>[^\s{}:]+)\s*(?::(?P<spec>[^{}]*?))?\s*\}\}")
# ![alt](target) or ![alt](target "title")
IMAGE = re.compile(r"!\[(?P<alt>[^\]]*)\]\((?P<target>[^)\s]+)(?P<title>\s+\"[^\"]*\")?\)")
FIGURE_LINK = "../results/figures/"  # how chapters link to the figures of results/
# ::: code lab/models/llama.py block   -> the source of that function or class, as a listing
CODE = re.compile(r"^::: code (?P<path>\S+)(?: +(?P<name>\w+))?[ \t]*$", re.MULTILINE)

CSS = """
body { max-width: 46rem; margin: 2rem auto; padding: 0 1rem; line-height: 1.55;
       font-family: system-ui, -apple-system, "Segoe UI", sans-serif; color: #222; }
h1, h2, h3 { line-height: 1.25; }
code, pre { font-family: ui-monospace, "SFMono-Regular", Menlo, monospace; font-size: 0.9em; }
pre { background: #f6f6f4; padding: 0.8rem; overflow-x: auto; border-radius: 4px; }
table { border-collapse: collapse; margin: 1rem 0; }
th, td { border: 1px solid #ccc; padding: 0.3rem 0.6rem; text-align: left; }
img { max-width: 100%; }
nav { font-size: 0.9em; margin-bottom: 1.5rem; }
"""


# TeX in $...$ and $$...$$ is typeset by MathJax when the reader is online, and stays readable TeX when not.
MATHJAX = ("<script>window.MathJax = {tex: {inlineMath: [['$', '$']]}};</script>\n"
           '<script async src="https://cdn.jsdelivr.net/npm/mathjax@3/es5/tex-chtml.js"></script>\n')


class BookError(ValueError):
    """The manuscript cannot be rendered: a missing figure, a bad format spec, or several problems."""


def references(text) -> list[tuple[str, str]]:
    """Every reference in text as (key, format spec), in order; spec is "" when none was given."""
    return [(m["key"], (m["spec"] or "").strip()) for m in REF.finditer(text)]


def _fill(key, spec, doc, source) -> str:
    """One reference as prose; ResultsKeyError when the key does not resolve."""
    leaf = lookup(doc, key, source)
    try:
        return format_value(leaf, spec)
    except (ValueError, TypeError) as e:
        raise BookError(f"{{{{{key}:{spec}}}}}: format spec {spec!r} does not apply to "
                        f"value {leaf['value']!r}: {e}") from None


def render_text(text, doc, source="results") -> str:
    """text with every {{key}} / {{key:spec}} replaced by its formatted value from doc."""
    return REF.sub(lambda m: _fill(m["key"], (m["spec"] or "").strip(), doc, source), text)


def code_listing(path, name=None) -> str:
    """The source of function or class `name` in the repo file `path` (the whole file when name is None).

    Listings in the manuscript are taken from `lab` at render time, so book and code cannot drift apart.
    """
    import ast

    file = REPO_ROOT / path
    if not file.is_file():
        raise BookError(f"code listing: no file {path}")
    source = file.read_text()
    if name is None:
        return source.rstrip()
    for node in ast.parse(source).body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)) and node.name == name:
            first = min([node.lineno] + [d.lineno for d in node.decorator_list])
            return "\n".join(source.splitlines()[first - 1: node.end_lineno])
    raise BookError(f"code listing: no top-level function or class {name!r} in {path}")


def fill_code(text) -> str:
    """Replace every `::: code PATH [NAME]` line with a fenced listing of that code."""
    return CODE.sub(lambda m: f"```python\n# {m['path']}\n{code_listing(m['path'], m['name'])}\n```", text)


def chapters(book_dir) -> list[Path]:
    """The manuscript chapters, book/ch*.md, in order."""
    return sorted(Path(book_dir).glob("ch*.md"))


def _figure_source(target, chapter: Path, results: Path) -> Path | None:
    """The file an image link points at; None for a link off the machine (http:, data:)."""
    if re.match(r"^[a-z][a-z0-9+.-]*:", target):
        return None
    if target.startswith(FIGURE_LINK):
        return results.parent / "figures" / target[len(FIGURE_LINK):]
    return chapter.parent / target


def _line(text, pos) -> int:
    return text.count("\n", 0, pos) + 1


def _chapter_problems(chapter: Path, text, doc, results: Path) -> list[str]:
    """Unresolved references and missing figures of one chapter, each with its line."""
    where = f"{chapter.parent.name}/{chapter.name}"
    problems = []
    for m in REF.finditer(text):
        try:
            _fill(m["key"], (m["spec"] or "").strip(), doc, str(results))
        except (ResultsError, BookError) as e:
            problems.append(f"{where}:{_line(text, m.start())}: {e}")
    for m in CODE.finditer(text):
        try:
            code_listing(m["path"], m["name"])
        except BookError as e:
            problems.append(f"{where}:{_line(text, m.start())}: {e}")
    for m in IMAGE.finditer(text):
        source = _figure_source(m["target"], chapter, results)
        if source is not None and not source.is_file():
            problems.append(f"{where}:{_line(text, m.start())}: figure {m['target']} not found "
                            f"(looked for {source}); run the chapter's experiment or `make results`")
    return problems


def check(book_dir, notebooks_dir, results_path) -> list[str]:
    """Problems that would break the book, as readable lines; an empty list when there are none.

    A chapter book/chNN_name.md without notebooks/chNN_name.py, a reference that does not resolve in
    results_path, an image link to a missing file.
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
            problems.append(f"{Path(book_dir).name}/{chapter.name}: no notebook {notebook} for this chapter")
        if doc is not None:
            problems += _chapter_problems(chapter, chapter.read_text(), doc, results_path)
    return problems


def _title(text, default) -> str:
    m = re.search(r"^# +(.+?)\s*$", text, re.MULTILINE)
    return m[1] if m else default


def _page(title, body) -> str:
    return (f'<!doctype html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n'
            f"<title>{html.escape(title)}</title>\n<style>{CSS}</style>\n{MATHJAX}</head>\n<body>\n"
            f"{body}\n</body>\n</html>\n")


def render(book_dir, out_dir, results_path) -> list[Path]:
    """Render every book/ch*.md to out_dir/chNN_name.html plus index.html; return the files written."""
    book_dir, out_dir, results_path = Path(book_dir), Path(out_dir), Path(results_path)
    doc = read(results_path)
    texts = {chapter: chapter.read_text() for chapter in chapters(book_dir)}
    problems = [p for chapter, text in texts.items()
                for p in _chapter_problems(chapter, text, doc, results_path)]
    if problems:
        raise BookError("cannot render the book:\n  " + "\n  ".join(problems))

    out_dir.mkdir(parents=True, exist_ok=True)
    written, contents = [], []
    for chapter, text in texts.items():
        text = fill_code(render_text(text, doc, str(results_path)))

        def copy_figure(m, chapter=chapter):
            source = _figure_source(m["target"], chapter, results_path)
            if source is None:
                return m[0]
            (out_dir / "figures").mkdir(exist_ok=True)
            shutil.copy2(source, out_dir / "figures" / source.name)
            return f"![{m['alt']}](figures/{source.name}{m['title'] or ''})"

        text = IMAGE.sub(copy_figure, text)
        title = _title(text, chapter.stem)
        body = markdown.markdown(text, extensions=["tables", "fenced_code"])
        page = out_dir / f"{chapter.stem}.html"
        page.write_text(_page(title, f'<nav><a href="index.html">Contents</a></nav>\n{body}'))
        written.append(page)
        contents.append(f'<li><a href="{page.name}">{html.escape(title)}</a></li>')

    index = out_dir / "index.html"
    items = "\n".join(contents) or "<li>(no chapters yet)</li>"
    source = html.escape(str(results_path))
    index.write_text(_page("Inference Lab: the KV cache",
                           f"<h1>Inference Lab: the KV cache</h1>\n"
                           f"<p>Numbers from {source} (mode: {_modes(doc)}).</p>\n<ol>\n{items}\n</ol>"))
    written.append(index)
    for path in written:
        print(f"wrote {path}")
    return written


def _modes(doc) -> str:
    """Which modes the sections of doc were measured in, e.g. "full" or "quick, full"."""
    modes = sorted({s["provenance"]["mode"] for s in doc["sections"].values()})
    return ", ".join(modes) or "no results yet"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.book", description=__doc__.split("\n\n")[0])
    parser.add_argument("--book", type=Path, default=REPO_ROOT / "book", help="manuscript folder")
    parser.add_argument("--notebooks", type=Path, default=REPO_ROOT / "notebooks", help="notebooks folder")
    parser.add_argument("--results", type=Path, default=None,
                        help="results file (default: lab.results.results_path(), which follows LAB_QUICK)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "book", help="output folder")
    parser.add_argument("--check", action="store_true", help="only list problems; exit 1 if any")
    args = parser.parse_args(argv)
    results = args.results or results_path()
    if args.check:
        problems = check(args.book, args.notebooks, results)
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{len(problems)} problem(s) in {args.book}", file=sys.stderr if problems else sys.stdout)
        return 1 if problems else 0
    try:
        render(args.book, args.out, results)
    except (BookError, ResultsError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
