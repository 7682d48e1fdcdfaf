"""
The book's verdicts beside the reader's own run.

Every sentence of the manuscript that compares measured values is guarded by a {{claim: ...}} or lets a
{{verdict: ...|A/B}} choose its word (lab.book.claims), evaluated on the committed results, a full run. A
reader runs the notebook in quick mode: shorter sweeps, fewer requests, a smaller pool, on another machine.
Their numbers can reverse a verdict, and a notebook that only showed them would contradict the book without
a word. So each measuring section of a notebook ends with

    beside("ch11", "ch11.scheduling", values=ch11.values(m), why="16 requests on 20 pages; the book's 40 on 96")

which takes every claim and verdict of book/ch11_*.md that reads a key under one of the prefixes, evaluates it
on the book's results and on the reader's (`values`: what the chapter's experiment would record from the
measurements so far; without it, the reader's results file, lab.results.results_path()), and prints both:

    §4 "The longest prefix first takes more of the prompts from the cache ..."
        the book: holds · your run: holds
    §4 "... and the first tokens come sooner ..."
        the book: holds · your run: does not hold
        ch11.scheduling.hash_lpm.ttft_s: the book 2.40 s, yours 3.30 s ...

A claim whose keys the reader's run did not write (quick mode skips some measurements) says so. Nothing here
decides anything: the verdicts are the manuscript's own expressions.
"""

import re
import textwrap
from dataclasses import dataclass
from pathlib import Path

from lab.book import claims
from lab.book.render import REF, BookError, render_text
from lab.results import COMMITTED, NOT_RUN, REPO_ROOT, ResultsError, format_value, lookup, quick, read, results_path

BOOK = REPO_ROOT / "book"
HEADING = re.compile(r"^(#{2,3}) +(.+?)\s*$", re.MULTILINE)
MISSING = "not measured in this run"
BOOK_MISSING = "not in its results"                 # the committed results lack a key (a new claim, not yet run)
WIDTH = 100                                      # the printed lines, as wide as the book's listings


@dataclass
class Verdict:
    section: str                                 # the manuscript's "## N. Title" the sentence sits in
    sentence: str                                # with the book's numbers filled in
    kind: str                                    # "claim" or "verdict"
    expr: str
    book: str                                    # "holds" / "does not hold", or the verdict's word
    yours: str                                   # the same on the reader's results, or why there is none
    values: list                                 # (key, the book's value, the reader's) as text


def chapter_file(chapter: str, book_dir=BOOK) -> Path:
    """book/chNN_*.md for "chNN"."""
    found = sorted(Path(book_dir).glob(f"{chapter}_*.md"))
    if not found:
        raise FileNotFoundError(f"no manuscript chapter {chapter}_*.md in {book_dir}")
    return found[0]


def _section_at(text, pos) -> str:
    heads = [m for m in HEADING.finditer(text, 0, pos) if m[1] == "##"]
    return heads[-1][2] if heads else ""


def _judge(m, doc, source) -> str:
    """The word a claim or verdict takes on doc: "holds", "does not hold", the verdict's word, or why none."""
    try:
        value = claims.evaluate(m["expr"], doc, source)
    except claims.ClaimError as e:
        missing = "was not run" in str(e) or "no value" in str(e) or "is a group" in str(e)
        return MISSING if missing else f"cannot be evaluated ({e})"
    if m["kind"] == "verdict" and isinstance(value, bool):
        yes, no = claims.verdict_words(m["words"])
        return " ".join((yes if value else no).split())          # words the source wrapped across lines
    return "holds" if value is True else "does not hold"


def _shown(doc, key, source) -> str:
    try:
        leaf = lookup(doc, key, source)
    except ResultsError:
        return "not measured"
    if leaf["value"] == NOT_RUN:
        return "not run"
    if isinstance(leaf["value"], bool | list):
        return str(leaf["value"]).lower()
    return format_value(leaf)


def _reader(section, values, mine) -> tuple[dict, str]:
    """The reader's results as a document, and what to call it: `values` (a section's values dict) as section
    `section`, else the file `mine` (by default lab.results.results_path())."""
    if values is not None:
        return {"sections": {section: {"values": values}}}, "your run"
    mine = Path(mine or results_path())
    return (read(mine) if mine.exists() else {"sections": {}}), str(mine)


def _render(said, doc, source) -> str:
    """said with every reference, verdict and calc filled in from doc; one that doc cannot fill reads "…"."""
    def one(m):
        try:
            return render_text(m[0], doc, source)
        except (ResultsError, BookError, claims.ClaimError):
            return "…"

    return REF.sub(one, claims.CLAIM.sub(one, said))


def verdicts(chapter, *prefixes, values=None, section=None, mine=None, book=COMMITTED,
             book_dir=BOOK) -> list[Verdict]:
    """Every claim and verdict of chapter `chapter` ("ch11") that reads a key starting with one of `prefixes`
    (all of them when none is given), judged on the book's results (`book`) and on the reader's (see _reader:
    `values` stand for section `section`, the chapter's by default). The sentences are rendered with the
    book's numbers."""
    text = chapter_file(chapter, book_dir).read_text()
    book_doc, (mine_doc, mine) = read(book), _reader(section or chapter, values, mine)
    out = []
    for m in claims.CLAIM.finditer(text):
        if m["kind"] == "calc":
            continue
        keys = claims.keys(m["expr"])
        if prefixes and not any(k.startswith(p) for k in keys for p in prefixes):
            continue
        said = _render(claims.sentence(text, m.start(), m.end(), keep=True), book_doc, str(book))
        out.append(Verdict(section=_section_at(text, m.start()), sentence=said, kind=m["kind"], expr=m["expr"],
                           book=_judge(m, book_doc, str(book)).replace(MISSING, BOOK_MISSING),
                           yours=_judge(m, mine_doc, str(mine)),
                           values=[(k, _shown(book_doc, k, str(book)), _shown(mine_doc, k, str(mine)))
                                   for k in dict.fromkeys(keys)]))
    return out


def beside(chapter, *prefixes, why="", values=None, section=None, mine=None, book=COMMITTED,
           book_dir=BOOK) -> None:
    """Print the book's verdict beside the reader's for every claim of `chapter` under `prefixes` (see verdicts());
    where they differ, the values each read. `why`: what the reader's quick run does differently, said once
    where a verdict differs."""
    rows = verdicts(chapter, *prefixes, values=values, section=section, mine=mine, book=book, book_dir=book_dir)
    if not rows:
        raise ValueError(f"no claim or verdict of {chapter} reads a key under {', '.join(prefixes) or '(any)'}")
    if not quick():
        print("A full run: its verdicts are measured as the book's were, on this machine.")
    judged = [r for r in rows if MISSING != r.yours and r.book != BOOK_MISSING]
    differ = [r for r in judged if r.yours != r.book]
    said = set()
    for r in rows:
        flag = "   <- differs" if r in differ else ""
        if (r.section, r.sentence) in said:                 # another comparison in a sentence already shown
            keys = ", ".join(dict.fromkeys(key for key, _, _ in r.values))
            print("    " + textwrap.shorten(f"and on {keys}:", WIDTH - 4, placeholder=" ...:"))
        else:
            where = f"§{r.section.split('.')[0]}" if r.section else "The summary:"
            print(textwrap.shorten(f"{where} \u201c{r.sentence}\u201d", WIDTH, placeholder=" ...\u201d"))
            said.add((r.section, r.sentence))
        print(f"    the book: {r.book} · your run: {r.yours}{flag}")
        for key, b, y in r.values if r in differ else ():
            print("      " + textwrap.shorten(f"{key}: the book {b}, yours {y}", WIDTH - 6))
    print(f"Your run agrees with the book on {len(judged) - len(differ)} of the {len(judged)} verdict(s) it "
          f"measured" + (f" ({len(rows) - len(judged)} not measured: quick mode skips them, or a later cell "
                         "measures them)." if len(judged) < len(rows) else "."))
    if differ:
        print("Where it differs: " + (why or "your run is shorter than the book's, and on another machine."))
