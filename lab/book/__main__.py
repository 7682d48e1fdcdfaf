"""
`python -m lab.book`: render the manuscript (lab/book/render.py), check it, or take screenshots of it
(lab/book/screens.py).

    python -m lab.book                       # render from the committed results/results.json
    python -m lab.book --results PATH --out build/book
    python -m lab.book --check               # list problems (missing notebook, key, figure, listing), render nothing
    python -m lab.book --screens             # render, then a PNG of every page (chapters, index, glossary,
                                             # next, print.html) in headless Chromium (build/book/screens/;
                                             # installs Debian's chromium if missing); exit 1 if a table is
                                             # wider than the column

The book shows the full measurements, so it renders from the committed results by default, whatever the
mode; `--results` renders another file (e.g. a quick run's /tmp/lab-quick/results.json).
"""

import argparse
import subprocess
import sys
import time
from pathlib import Path

from lab.book import render, screens
from lab.results import COMMITTED, REPO_ROOT, ResultsError


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m lab.book", description=render.__doc__.strip().split("\n\n")[0])
    parser.add_argument("--book", type=Path, default=REPO_ROOT / "book", help="manuscript folder")
    parser.add_argument("--notebooks", type=Path, default=REPO_ROOT / "notebooks", help="notebooks folder")
    parser.add_argument("--results", type=Path, default=COMMITTED,
                        help="results file (default: the committed results/results.json, whatever the mode)")
    parser.add_argument("--out", type=Path, default=REPO_ROOT / "build" / "book", help="output folder")
    parser.add_argument("--check", action="store_true", help="only list problems; exit 1 if any")
    parser.add_argument("--screens", action="store_true",
                        help="render, then save a full-page PNG of every page (chapters, index, glossary, next, "
                             "print.html) to OUT/screens/ "
                             "(headless Chromium); exit 1 if a table is wider than the text column")
    args = parser.parse_args(argv)
    if args.check:
        problems = render.check(args.book, args.notebooks, args.results)
        for p in problems:
            print(p, file=sys.stderr)
        print(f"{len(problems)} problem(s) in {args.book.name}/", file=sys.stderr if problems else sys.stdout)
        return 1 if problems else 0
    try:
        written = render.render(args.book, args.out, args.results)
        for chapter in render.chapters(args.book):
            for problem in render.layout_problems(chapter.read_text()):
                print(f"note: {args.book.name}/{chapter.name}: {problem}", file=sys.stderr)
        if args.screens:
            t0 = time.perf_counter()
            shown = [p for p in written if p.suffix == ".html"]
            screens.screens(shown, args.out / "screens")
            print(f"{len(shown)} screenshot(s) in {time.perf_counter() - t0:.0f} s")
            browser = screens.chromium()
            wide = [problem for page in shown for problem in screens.wide_tables(browser, page)]
            for problem in wide:
                print(problem, file=sys.stderr)
            print(f"{len(wide)} table(s) wider than the text column", file=sys.stderr if wide else sys.stdout)
            if wide:
                return 1
    except (render.BookError, ResultsError, subprocess.SubprocessError) as e:
        print(e, file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
