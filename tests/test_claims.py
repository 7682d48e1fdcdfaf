"""lab.book.claims: verdicts in words are chosen by the numbers or guarded by claims the build evaluates; a false
claim fails the book and names its sentence."""

import re

import pytest
from test_book import PROVENANCE

from lab.book import claims, render
from lab.results import COMMITTED, REPO_ROOT, lookup, not_run, read, value, write_section


@pytest.fixture
def doc(tmp_path):
    path = tmp_path / "results.json"
    write_section("ch08", {
        "ttft": {"chunked": value(3315.0, "ms"), "whole": value(3403.0, "ms")},
        "goodput": {"r3": value(2.1, "req/s"), "r4": value(1.9, "req/s")},
        "step_ms": {"gpt2-random": {"T16": value(5.0, "ms"), "T512": value(9.0, "ms")}},
        "same": value(True, None),
        "pair": value([1.0, 4.0], "ms"),
        "gpu": not_run("needs a CUDA GPU", "ms"),
    }, PROVENANCE, path=path)
    return read(path)


@pytest.mark.parametrize("expr, expected", [
    ("ch08.ttft.chunked < ch08.ttft.whole", True),
    ("ch08.ttft.chunked > ch08.ttft.whole", False),
    ("0.95 < ch08.ttft.chunked / ch08.ttft.whole < 1", True),         # chained
    ("ch08.step_ms.gpt2-random.T512 - ch08.step_ms.gpt2-random.T16", 4.0),  # hyphen in a key, minus spaced
    ("abs(ch08.goodput.r3 - ch08.goodput.r4) < 0.25 and not ch08.goodput.r4 > ch08.goodput.r3", True),
    ("max(ch08.goodput.r3, ch08.goodput.r4) == ch08.goodput.r3", True),
    ("ch08.pair[1] / ch08.pair[0]", 4.0),
    ("ch08.same or ch08.ttft.chunked > 1e9", True),
    ("-ch08.goodput.r3 < 0", True),
])
def test_evaluate(doc, expr, expected):
    assert claims.evaluate(expr, doc) == expected


@pytest.mark.parametrize("expr, match", [
    ("ch08.ttft.chunkd < 1", "closest keys: ch08.ttft.chunked"),
    ("ch08.gpu < 1", "ch08.gpu was not run"),
    ("__import__('os').system('true')", "a claim reads keys and numbers"),
    ("ch08.ttft.chunked.real", "closest keys"),                      # a key, not an attribute
    ("open('x')", "a claim reads keys and numbers"),
    ("ch08.ttft.chunked <", "not an expression"),
    ("ch08.ttft.chunked / 0", "ZeroDivisionError"),
    ("'earlier' < 'later'", "a claim reads keys and numbers"),
])
def test_evaluate_refuses(doc, expr, match):
    with pytest.raises(claims.ClaimError, match=match):
        claims.evaluate(expr, doc)


def test_a_verdict_renders_the_word_the_numbers_choose(doc):
    text = "It comes {{verdict: ch08.ttft.chunked < ch08.ttft.whole|earlier/later}} in chunks."
    assert render.render_text(text, doc) == "It comes earlier in chunks."
    flipped = text.replace("<", ">")
    assert render.render_text(flipped, doc) == "It comes later in chunks."
    with pytest.raises(render.BookError, match="two words"):
        render.render_text("{{verdict: ch08.same|earlier}}", doc)
    with pytest.raises(render.BookError, match="not a comparison"):
        render.render_text("{{verdict: ch08.ttft.whole|more/less}}", doc)


def test_a_true_claim_renders_nothing_and_references_still_fill(doc):
    text = ("Goodput peaks near 3 requests per second ({{ch08.goodput.r3}}). "
            "{{claim: ch08.goodput.r3 > ch08.goodput.r4}}\nNext.")
    assert render.render_text(text, doc) == "Goodput peaks near 3 requests per second (2.10 req/s). \nNext."
    assert render.references(text) == [("ch08.goodput.r3", "")]


def test_a_false_claim_names_its_sentence_with_its_numbers(doc):
    text = ("First sentence. The long prompt pays: its first token comes after {{ch08.ttft.chunked}} "
            "instead of\n{{ch08.ttft.whole}}. {{claim: ch08.ttft.chunked > ch08.ttft.whole}} Next sentence.")
    with pytest.raises(render.BookError) as e:
        render.render_text(text, doc)
    assert "'ch08.ttft.chunked > ch08.ttft.whole' is false" in str(e.value)
    assert "\u201cThe long prompt pays: its first token comes after 3,315 ms instead of 3,403 ms.\u201d" \
        in str(e.value)


def test_a_claim_inside_a_sentence_names_that_sentence(doc):
    text = "One. It peaks near 4 {{claim: ch08.goodput.r4 > ch08.goodput.r3}} requests per second, and falls. Two."
    with pytest.raises(render.BookError, match="\u201cIt peaks near 4 requests per second, and falls.\u201d"):
        render.render_text(text, doc)


def test_book_check_reports_a_false_claim_with_its_line(tmp_path, doc):
    (tmp_path / "book").mkdir()
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "notebooks" / "ch08_serving.py").write_text("# %%\n")
    results = tmp_path / "results.json"
    results.write_text(__import__("json").dumps(doc))
    (tmp_path / "book" / "ch08_serving.md").write_text(
        "# Serving\n\nChunks come earlier. {{claim: ch08.ttft.chunked < ch08.ttft.whole}}\n\n"
        "They come later.\n{{claim: ch08.ttft.chunked > ch08.ttft.whole}}\n")
    (problem,) = render.check(tmp_path / "book", tmp_path / "notebooks", results)
    assert problem.startswith("book/ch08_serving.md:6: ") and "\u201cThey come later.\u201d" in problem
    with pytest.raises(render.BookError, match="They come later"):
        render.render(tmp_path / "book", tmp_path / "out", results)
    assert not (tmp_path / "out").exists()


def test_a_claim_with_words_is_refused(doc):
    with pytest.raises(render.BookError, match="belongs to a verdict"):
        render.render_text("{{claim: ch08.ttft.chunked < ch08.ttft.whole|earlier/later}}", doc)


def test_a_calc_renders_a_number_the_values_determine(doc):
    assert render.render_text("{{calc: ch08.ttft.whole - ch08.ttft.chunked|,.0f}} ms", doc) == "88 ms"
    assert render.render_text("{{calc: 2 ** 3}}", doc) == "8"
    with pytest.raises(render.BookError, match="not a number"):
        render.render_text("{{calc: ch08.ttft.whole > 1|.1f}}", doc)
    with pytest.raises(render.BookError, match="format"):
        render.render_text("{{calc: ch08.ttft.whole|.1q}}", doc)


# -----------------------------------------------------------------------------
# the committed book: every comparison in words is chosen by the numbers or guarded

# Words that compare measured values. A sentence of the manuscript that reads a result ({{key}}) with one
# of them must carry a claim, verdict or calc (in the sentence, or a claim right after it), or read a word the
# experiment itself computed (a string value such as ch03.faster.*).
COMPARATIVES = re.compile(
    r"\b(faster|slower|earlier than|later than|beats?|loses? to|peaks|a tenth|twice|half as|more than|less than|"
    r"fewer than|larger than|smaller than|higher than|lower than|exceeds?|better|worse|cheaper|outperforms?|shorter|"
    r"longer than|far (?:above|below|less|more|from)|nearly|quietest|loudest|the same speed)\b", re.IGNORECASE)
SENTENCE = re.compile(r"(?<=[.!?])\s+(?=[A-Z*_`{(\[])")


def unguarded_comparisons(text, doc) -> list[str]:
    """Sentences of a chapter's markdown that compare results in words with nothing checking the words. The
    exercises are left out: they state the rules of a check ("refuses a time longer than the call"), not
    readings of the book's results."""
    text = re.sub(r"```[\s\S]*?```", "", text)
    text = re.split(r"^##\s+(?:\d+\.\s+)?Exercises\b", text, flags=re.MULTILINE)[0]
    found = []
    for para in re.split(r"\n\s*\n", text):
        sentences = SENTENCE.split(para)
        for i, s in enumerate(sentences):
            plain = claims.CLAIM.sub("", s)
            if not (render.references(plain) and COMPARATIVES.search(plain)):
                continue
            nxt = sentences[i + 1].lstrip() if i + 1 < len(sentences) else ""
            guarded = claims.CLAIM.search(s) or nxt.startswith("{{claim:")
            computed = any(isinstance(lookup(doc, key)["value"], str | list) for key, _ in render.references(plain))
            if not (guarded or computed):
                found.append(" ".join(plain.split()))
    return found


def test_the_comparison_lint_finds_an_unguarded_verdict(doc):
    text = ("The long prompt pays: it comes after {{ch08.ttft.chunked}}, later than {{ch08.ttft.whole}}.\n\n"
            "Chunks make it faster: {{ch08.ttft.chunked}}. {{claim: ch08.ttft.chunked < ch08.ttft.whole}}\n\n"
            "It is {{verdict: ch08.ttft.chunked < ch08.ttft.whole|faster/slower}} here, {{ch08.ttft.whole}}.\n\n"
            "Faster machines differ.\n")
    assert unguarded_comparisons(text, doc) == [
        "The long prompt pays: it comes after {{ch08.ttft.chunked}}, later than {{ch08.ttft.whole}}."]


@pytest.mark.parametrize("name", [c.stem for c in render.chapters(REPO_ROOT / "book")])
def test_committed_comparisons_are_guarded(name):
    doc = read(COMMITTED)
    found = unguarded_comparisons((REPO_ROOT / "book" / f"{name}.md").read_text(), doc)
    assert found == [], (f"{name}: sentences that compare results in words with no claim, verdict or calc "
                         f"(lab.book.claims):\n  " + "\n  ".join(found))
