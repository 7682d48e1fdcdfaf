"""Speculation in the serving engine (ServingEngine(draft=..., k=...)): lookahead pages reserved before a
verify step and given back after it, guesses of many requests verified in one ragged step, and page names
for accepted tokens only.

Oracle: each request decoded greedily on its own through a ConcatCache (tests/test_serving.py's `expected`,
which also checks that no near tie makes a prompt fragile), and the engine without a draft. Tolerance:
none, the tokens must be equal: a guess is accepted only where it equals the engine's own greedy token.
The bookkeeping is checked after every step against the request's accepted length: its sequence holds
exactly `computed` positions, in pages_for(computed) pages, and every named page holds accepted tokens.
"""

import random

import pytest
from test_serving import check_idle, expected, prompts

from lab.cache.block_manager import pages_for
from lab.engine import PromptLookup, ServingEngine, SpecInputError
from lab.models import load

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


class Wrong:
    """A draft that guesses the token after the last one, modulo the vocabulary: mostly rejected."""

    def bind(self, model, prompt):
        pass

    def propose(self, context, k):
        return [(context[-1] + 1 + i) % 320 for i in range(k)]


def copied(seed, length=24):
    """Prompts that repeat their first part, so prompt lookup finds matches (and misses some)."""
    rng = random.Random(seed)
    part = [rng.randrange(320) for _ in range(length)]
    return part + part[: length // 2 + seed % 5]


def check_step(engine):
    """After a step: every running request holds its accepted positions only, in as many pages as they
    need, and every name covers accepted tokens."""
    P, named = engine.page_size, engine.manager.manager("full").named_tokens()
    for req in engine.running:
        assert not req.guess
        assert engine.manager.length(req.seq) == req.computed             # no rejected slot reserved
        table = engine.manager.block_table(req.seq)
        assert len(table) == pages_for(req.computed, P)
        assert req.named * P <= req.computed
        for i, page in enumerate(table[:req.named]):
            if page in named:
                assert named[page] == req.tokens[i * P:(i + 1) * P]       # accepted tokens, not guesses
    engine.manager.check()


def run(engine, ps, n):
    """Step until these requests finish, checking after each step; their tokens as streamed."""
    rids = [engine.add_request(p, n) for p in ps]
    streamed = {r: [] for r in rids}
    while engine.running or engine.waiting:
        for rid, tokens in engine.step().items():
            streamed[rid] += tokens
        check_step(engine)
    assert [streamed[r] for r in rids] == [engine.output(r) for r in rids]      # each token reported once
    return [engine.output(r) for r in rids]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
@pytest.mark.parametrize("draft", ["lookup", "wrong"])
def test_speculation_gives_each_request_its_greedy_tokens(tiny, k, draft):
    ps = [copied(s) for s in range(5)] + prompts((7, 1, 19), seed=3)
    engine = ServingEngine(tiny, num_pages=64, page_size=4, max_batch_tokens=64,
                           draft=PromptLookup(2) if draft == "lookup" else Wrong(), k=k)
    assert run(engine, ps, 16) == expected(tiny, ps, 16)
    s = engine.stats
    assert s["proposed"] > s["accepted"] and (s["accepted"] > 0) == (draft == "lookup")
    assert s["lookahead_pages"] > 0 and s["rollback_pages"] <= s["lookahead_pages"]
    assert s["rollback_pages"] > 0 or k < 4                   # guesses past a page's end, rejected, give it back
    assert max(s["batch_tokens"]) > len(ps) or draft == "wrong"       # several tokens of one request per step
    check_idle(engine)


def test_guesses_of_many_requests_are_verified_in_one_step(tiny):
    """Every request decoding, each with guesses: one forward holds them all (the ragged verify step)."""
    ps = [copied(s) for s in range(4)]
    engine = ServingEngine(tiny, num_pages=64, page_size=4, max_batch_tokens=256, draft=Wrong(), k=3)
    assert engine.generate(ps, 8) == expected(tiny, ps, 8)
    assert engine.stats["batch_sizes"][:2] == [4, 4]           # the prompts, then every request's verify
    assert engine.stats["batch_tokens"][1] == 4 * (1 + 3)


def test_a_prompt_at_the_context_limit(tiny):
    """A request that ends at the model's last position: the guesses stop there."""
    p = (copied(0, 100) * 21)[:2048 - 6]                  # 2,042 + 7 - 1 = 2,048 positions, the model's all
    engine = ServingEngine(tiny, num_pages=600, page_size=4, max_batch_tokens=512, draft=PromptLookup(2), k=8)
    assert run(engine, [p], 7) == expected(tiny, [p], 7)
    check_idle(engine)


def test_lookahead_never_preempts(tiny):
    """A pool with no page to spare: the requests decode without guesses rather than preempt each other."""
    ps = [copied(s, 8)[:11] for s in range(3)]
    plain = ServingEngine(tiny, num_pages=9, page_size=4, max_batch_tokens=64)
    want = plain.generate(ps, 6)
    engine = ServingEngine(tiny, num_pages=9, page_size=4, max_batch_tokens=64, draft=PromptLookup(1), k=8)
    assert run(engine, ps, 6) == want == expected(tiny, ps, 6)
    assert engine.stats["preemptions"] == plain.stats["preemptions"]
    check_idle(engine)


def test_prefix_hits_are_the_same_with_speculation(tiny):
    """A multi-turn workload: each turn sends the conversation so far plus a new message. With prefix
    caching, the next turn finds the pages of the last one named, with a draft as without: a name given to
    a page with rejected guesses in it would change the hits (or the tokens)."""
    rng = random.Random(7)
    results = {}
    for draft in (None, PromptLookup(2), Wrong()):
        engine = ServingEngine(tiny, num_pages=200, page_size=4, max_batch_tokens=64, draft=draft, k=4)
        chats = [copied(s, 16) for s in range(3)]
        rng.seed(7)
        for _turn in range(4):
            outs = run(engine, chats, 9)
            chats = [c + o + [rng.randrange(320) for _ in range(rng.randrange(1, 6))]
                     for c, o in zip(chats, outs, strict=True)]
        results[draft.__class__.__name__] = (chats, engine.stats["cached_tokens"], engine.manager.cached_pages())
        check_idle(engine)
    (plain, *_), hits = results["NoneType"], {name: r[1:] for name, r in results.items()}
    assert all(r[0] == plain for r in results.values())
    assert hits["PromptLookup"] == hits["Wrong"] == hits["NoneType"] and hits["NoneType"][0] > 0


@pytest.mark.parametrize("seed", [0, 1])
def test_random_adds_steps_and_cancels_with_speculation_return_every_page(tiny, seed):
    rng = random.Random(seed)
    engine = ServingEngine(tiny, num_pages=14, page_size=4, max_batch_tokens=rng.choice([6, 16, 64]),
                           draft=rng.choice([PromptLookup(1), Wrong()]), k=rng.randrange(1, 9))
    asked, streamed = {}, {}
    for _ in range(60):
        op = rng.random()
        if op < 0.3:
            p = copied(rng.randrange(50), rng.randrange(4, 14))
            rid = engine.add_request(p, rng.randrange(1, 16))
            asked[rid], streamed[rid] = p, []
        elif op < 0.4 and asked:
            engine.cancel(rng.choice(list(asked)))
        else:
            for rid, tokens in engine.step().items():
                streamed[rid] += tokens
            check_step(engine)
    while engine.running or engine.waiting:
        for rid, tokens in engine.step().items():
            streamed[rid] += tokens
        check_step(engine)
    check_idle(engine)
    for rid, p in asked.items():
        req = engine.requests[rid]
        want = expected(tiny, [p], req.max_new_tokens)[0]
        assert streamed[rid] == req.output == want[:len(req.output)]
        assert req.state == "cancelled" or req.output == want


def test_bad_speculative_settings_are_refused(tiny):
    for k in (0, -1, 2.0, True):
        with pytest.raises(SpecInputError):
            ServingEngine(tiny, 8, draft=PromptLookup(2), k=k)
    with pytest.raises(SpecInputError):
        ServingEngine(tiny, 8, draft="ngram")

    class OutOfVocab(Wrong):
        def propose(self, context, k):
            return [320]
    engine = ServingEngine(tiny, 8, page_size=4, draft=OutOfVocab())
    engine.add_request([1, 2, 3], 4)
    engine.step()                                     # the prefill: no guess yet
    with pytest.raises(SpecInputError):
        engine.step()
