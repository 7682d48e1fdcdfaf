"""The book's verdicts beside the reader's (lab.book.verdicts): the manuscript's own claims and verdicts, judged on two
results documents, with the sentence each guards; and every claim of a chapter set beside the reader's run by
some cell of its notebook.

Oracle: the claims' expressions evaluated by hand on the documents the test writes.
"""

import ast
import json
import re

import pytest

from lab.book import claims, verdicts
from lab.results import REPO_ROOT, provenance

CHAPTER = """# Chapter 98 — A test

## 1. Speed

The cache is {{verdict: ch98.speed.cached < ch98.speed.plain|faster/slower}} than recomputing,
{{ch98.speed.cached}} against {{ch98.speed.plain}}.

## 2. Hits

The tier adds hits. {{claim: ch98.hits.tier > ch98.hits.none}}
The disk adds more. {{claim: ch98.hits.disk > ch98.hits.tier}}
Both add to nothing. {{claim: ch98.hits.tier > 0}} {{claim: ch98.hits.disk > 0}}
"""


def leaf(v, unit=None):
    return {"value": v, "unit": unit}


def doc(values):
    return {"schema_version": 1, "sections": {"ch98": {"provenance": provenance(mode="full"), "values": values}}}


@pytest.fixture
def book(tmp_path):
    (tmp_path / "book").mkdir()
    (tmp_path / "book" / "ch98_test.md").write_text(CHAPTER)
    values = {"speed": {"cached": leaf(2.0, "ms"), "plain": leaf(9.0, "ms")},
              "hits": {"none": leaf(10.0, "%"), "tier": leaf(50.0, "%"), "disk": leaf(70.0, "%")}}
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc(values)))
    return tmp_path / "book", path


def test_each_verdict_is_judged_on_both_runs_with_the_sentence_it_guards(book):
    book_dir, results = book
    mine = {"speed": {"cached": leaf(12.0, "ms"), "plain": leaf(9.0, "ms")},      # the reader's run reverses it
            "hits": {"none": leaf(10.0, "%"), "tier": leaf(40.0, "%")}}          # and has no disk tier
    rows = verdicts.verdicts("ch98", values=mine, book=results, book_dir=book_dir)
    assert [(r.book, r.yours) for r in rows] == [("faster", "slower"), ("holds", "holds"),
                                                 ("holds", verdicts.MISSING), ("holds", "holds"),
                                                 ("holds", verdicts.MISSING)]
    assert rows[0].sentence == "The cache is faster than recomputing, 2.00 ms against 9.00 ms."   # the book's words
    assert rows[2].sentence == "The disk adds more."
    assert rows[0].section == "1. Speed"
    assert rows[0].values == [("ch98.speed.cached", "2.00 ms", "12.0 ms"), ("ch98.speed.plain", "9.00 ms", "9.00 ms")]


def test_prefixes_choose_the_claims_and_beside_says_where_the_run_differs(book, capsys):
    book_dir, results = book
    mine = {"speed": {"cached": leaf(12.0, "ms"), "plain": leaf(9.0, "ms")}}
    assert len(verdicts.verdicts("ch98", "ch98.hits", values=mine, book=results, book_dir=book_dir)) == 4
    verdicts.beside("ch98", "ch98.speed", values=mine, book=results, book_dir=book_dir, why="a short run")
    out = capsys.readouterr().out
    assert "the book: faster · your run: slower   <- differs" in out
    assert "ch98.speed.cached: the book 2.00 ms, yours 12.0 ms" in out
    assert "agrees with the book on 0 of the 1 verdict(s)" in out and "Where it differs: a short run" in out
    with pytest.raises(ValueError, match="no claim or verdict"):
        verdicts.beside("ch98", "ch98.nothing", values=mine, book=results, book_dir=book_dir)


def test_a_run_that_agrees_is_said_to_agree(book, capsys):
    book_dir, results = book
    mine = {"hits": {"none": leaf(1.0, "%"), "tier": leaf(2.0, "%"), "disk": leaf(3.0, "%")}}
    verdicts.beside("ch98", "ch98.hits", values=mine, book=results, book_dir=book_dir)
    out = capsys.readouterr().out
    assert "differs" not in out and "agrees with the book on 4 of the 4" in out
    assert out.count("Both add to nothing.") == 1 and "    and on ch98.hits.disk:" in out   # a sentence said once


# ---- the chapters: every claim is set beside the reader's run -------------------------------------------------

def beside_prefixes(notebook) -> list[str]:
    """The key prefixes of every beside("chNN", ...) call in a notebook's source."""
    found = []
    for node in ast.walk(ast.parse(notebook.read_text())):
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "beside":
            found += [a.value for a in node.args[1:] if isinstance(a, ast.Constant)]
    return found


CHAPTERS = sorted(p.name[:4] for p in (REPO_ROOT / "book").glob("ch[0-9][0-9]_*.md"))


def test_the_book_has_its_chapters():
    assert CHAPTERS[:11] == [f"ch{n:02d}" for n in range(1, 12)]


@pytest.mark.parametrize("chapter", CHAPTERS)
def test_every_claim_of_the_chapter_is_set_beside_the_readers_run(chapter):
    text = verdicts.chapter_file(chapter).read_text()
    notebook = next((REPO_ROOT / "notebooks").glob(f"{chapter}_*.py"))
    prefixes = beside_prefixes(notebook)
    missing = [" ".join(m["expr"].split())[:100] for m in claims.CLAIM.finditer(text) if m["kind"] != "calc"
               and not any(k.startswith(p) for k in claims.keys(m["expr"]) for p in prefixes)]
    assert prefixes and not missing, f"{notebook.name} sets no verdict beside the book's for: {missing}"


def test_sentences_keep_their_verdict_words_when_asked():
    text = "It is {{verdict: a.b < a.c|faster/slower}} here. {{claim: a.b > 0}}"
    m = list(claims.CLAIM.finditer(text))
    assert claims.sentence(text, m[1].start(), m[1].end()) == "It is here."
    assert re.fullmatch(r"It is \{\{verdict: .*\}\} here\.", claims.sentence(text, m[1].start(), m[1].end(),
                                                                          keep=True))
