"""Many answers from one prompt in the serving engine: `add_request(..., n=...)` prefills once, then forks.

Oracles, none of which shares the engine's pages or scheduler:
- greedy answers: each prompt decoded alone through a ConcatCache (tests/test_serving.py `alone`, with its
  top-two-gap guard TINY_GAP);
- sampled answers: recomputation without a cache (`forward` over the whole sequence at every step), drawing
  each token with torch.multinomial from softmax(logits / T) and a generator seeded as the engine seeds
  answer i (seed + i). The engine's logits differ from recomputation's by about 1e-5 on the tiny model, so
  a draw differs only when the uniform falls within that of a boundary of the cumulative distribution: a
  chance of about 1e-4 per token here, and the seeds below are fixed;
- the distribution itself: counts of the first token over many answers against softmax(logits / T),
  five standard errors allowed, as chapter 9's tests allow.
Bookkeeping is checked after every step, and every page is back at the end.
"""

import math

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lab.cache import OutOfPagesError
from lab.engine import PromptLookup, ServingEngine
from lab.engine.speculative import SpecInputError
from lab.models import InputError, forward, load
from lab.models.retrofit import local_layers
from tests.test_serving import TINY_GAP, alone, check_idle, expected, prompts

pytestmark = pytest.mark.usefixtures("one_thread")   # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def run(engine, steps=500):
    """Step until idle, checking the bookkeeping after every step."""
    for _ in range(steps):
        if not (engine.running or engine.waiting):
            return
        engine.step()
        engine.manager.check()
    raise AssertionError(f"not idle after {steps} steps: {engine!r}")


def sampled_alone(model, prompt, n, T, seed) -> list:
    """Recomputation without a cache: the tokens of an answer drawn with torch.Generator().manual_seed(seed)."""
    g, ids = torch.Generator().manual_seed(seed), list(prompt)
    with torch.inference_mode():
        for _ in range(n):
            logits = forward(torch.tensor([ids]), model.weights, model.config)[0, -1]       # [V]
            ids.append(int(torch.multinomial(torch.softmax(logits.float() / T, -1), 1, generator=g)))
    return ids[len(prompt):]


@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("prefix_caching", [False, "hash", "radix"])
def test_greedy_answers_equal_the_prompt_decoded_alone(tiny, page_size, prefix_caching):
    ps = prompts([13, 6, 21], seed=3)
    engine = ServingEngine(tiny, 64, page_size, max_batch_tokens=32, prefix_caching=prefix_caching)
    rids = [engine.add_request(p, 7, n=3) for p in ps]
    run(engine)
    for rid, want in zip(rids, expected(tiny, ps, 7), strict=True):
        assert [engine.output(rid + i) for i in range(3)] == [want] * 3
    check_idle(engine)


@pytest.mark.parametrize("page_size", [1, 4])
def test_sampled_answers_equal_recomputation_with_their_own_seeds(tiny, page_size):
    ps, T, seed = prompts([9, 14], seed=5), 0.7, 11
    engine = ServingEngine(tiny, 64, page_size, max_batch_tokens=16, prefix_caching="hash")
    rids = [engine.add_request(p, 6, n=4, temperature=T, seed=seed + 10 * i) for i, p in enumerate(ps)]
    run(engine)
    for i, (rid, p) in enumerate(zip(rids, ps, strict=True)):
        got = [engine.output(rid + j) for j in range(4)]
        assert got == [sampled_alone(tiny, p, 6, T, seed + 10 * i + j) for j in range(4)]
        assert len({tuple(x) for x in got}) > 1                        # the answers differ
    check_idle(engine)


def test_the_first_tokens_follow_the_models_distribution(tiny):
    """400 answers of one token each, at T = 0.1 (the tiny model's logits are nearly flat): the frequency of
    each of the six likeliest first tokens within five standard errors of softmax(logits / T)."""
    prompt, T, N = prompts([10], seed=8)[0], 0.1, 400
    engine = ServingEngine(tiny, 64, 4, max_batch_tokens=16)
    rid = engine.add_request(prompt, 1, n=N, temperature=T, seed=0)
    run(engine)
    counts = torch.bincount(torch.tensor([engine.output(rid + i)[0] for i in range(N)]),
                            minlength=tiny.config.vocab_size)
    with torch.inference_mode():
        p = torch.softmax(forward(torch.tensor([prompt]), tiny.weights, tiny.config)[0, -1] / T, -1)
    for t in p.topk(6).indices.tolist():
        assert abs(counts[t] / N - p[t]) < 5 * math.sqrt(p[t] * (1 - p[t]) / N), t
    check_idle(engine)


def counting_cascades(monkeypatch, shared=None) -> list:
    """Record the shared positions of every cascade_attention call the planned step makes (CASCADE_SHARED
    lowered to `shared` if given)."""
    import lab.cache.pool as pool_module

    calls, real = [], pool_module.cascade_attention
    if shared is not None:
        monkeypatch.setattr(pool_module, "CASCADE_SHARED", shared)
    monkeypatch.setattr(pool_module, "cascade_attention", lambda *a, **kw: calls.append(a[4]) or real(*a, **kw))
    return calls


@pytest.mark.parametrize("page_size", [1, 4, 16])
def test_answers_read_their_prompt_once_and_still_answer_as_alone(tiny, page_size, monkeypatch):
    """With the threshold lowered to 16 shared positions, the step reads the prompt's pages once for the 5
    answers of each prompt (cascade_attention over the prompt's full pages), and every answer, greedy or
    sampled, is still what it is alone."""
    calls = counting_cascades(monkeypatch, shared=16)
    ps = prompts([37, 24], seed=12)
    engine = ServingEngine(tiny, 96, page_size, max_batch_tokens=64)
    greedy = engine.add_request(ps[0], 6, n=5)
    sampled = engine.add_request(ps[1], 6, n=5, temperature=0.6, seed=4)
    run(engine)
    assert calls and set(calls) <= {37 // page_size * page_size, 24 // page_size * page_size}
    assert [engine.output(greedy + i) for i in range(5)] == expected(tiny, ps[:1], 6) * 5
    assert [engine.output(sampled + i) for i in range(5)] == [sampled_alone(tiny, ps[1], 6, 0.6, 4 + i)
                                                               for i in range(5)]
    check_idle(engine)


def test_the_cascade_at_its_own_threshold(tiny, monkeypatch):
    """The default threshold (4 answers over 1,024 shared positions): a prompt of 1,040 tokens takes the
    cascade, and its answers are the prompt's alone; fewer answers than CASCADE_ROWS never take it."""
    calls = counting_cascades(monkeypatch)
    p = prompts([1040], seed=13)[0]
    engine = ServingEngine(tiny, 160, 16, max_batch_tokens=256)
    rid = engine.add_request(p, 3, n=4)
    run(engine)
    assert calls and set(calls) == {1040}
    assert [engine.output(rid + i) for i in range(4)] == expected(tiny, [p], 3) * 4
    calls.clear()
    engine.add_request(p, 3, n=3)
    run(engine)
    assert not calls
    check_idle(engine)


def test_branches_share_the_prompts_pages(tiny):
    """n answers hold the prompt's full pages once: at the peak, n branches of a 32-token prompt (8 pages of 4)
    and 8 new tokens hold at most 8 + n * 3 pages, where n separate requests hold n * 11."""
    prompt, n = prompts([32], seed=2)[0], 6
    together = ServingEngine(tiny, 128, 4, max_batch_tokens=64, prefix_caching=False)
    together.add_request(prompt, 8, n=n)
    run(together)
    apart = ServingEngine(tiny, 128, 4, max_batch_tokens=64, prefix_caching=False)
    for _ in range(n):
        apart.add_request(prompt, 8)
    run(apart)
    assert together.stats["peak_held_pages"]["full"] <= 8 + n * 3 < apart.stats["peak_held_pages"]["full"]
    assert together.stats["computed_tokens"] < apart.stats["computed_tokens"]   # one prefill, not n


def test_branches_survive_preemption_and_local_layers(tiny):
    """A pool that holds each prompt's answers but not both prompts': branches are preempted and recomputed
    (their prompt from the cache), and still answer as the prompt alone does; the same with local layers
    (two groups of pages, a window's given back)."""
    ps = prompts([11, 18], seed=9)
    for model, kw in [(tiny, {}), (local_layers(tiny, window=8, global_every=2), dict(local_pages=24))]:
        engine = ServingEngine(model, 24, 2, max_batch_tokens=16, **kw)
        rids = [engine.add_request(p, 12, n=2) for p in ps]
        run(engine)
        assert engine.stats["preemptions"] > 0
        for rid, want in zip(rids, expected(model, ps, 12), strict=True):
            assert [engine.output(rid + i) for i in range(2)] == [want] * 2
        check_idle(engine)


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
@pytest.mark.parametrize("prefix_caching", ["hash", "radix"])
def test_answers_of_a_prompt_that_shares_pages_computed_beside_it(tiny, page_size, prefix_caching):
    """Two prompts that share 17 tokens, admitted in one step, the second with 3 answers: both compute the
    shared pages, the first publishes them, and the second's (held by its forks too) is swapped for the
    cached one in every table that holds it. Before, the radix tree took the page back from the first
    answer only, and the next publish failed ("insert: slot ... was not allocated")."""
    q = prompts([21, 21], seed=3)
    q[1] = q[0][:17] + q[1][17:]
    engine = ServingEngine(tiny, 120, page_size, max_batch_tokens=256, prefix_caching=prefix_caching)
    a, b = engine.add_request(q[0], 4), engine.add_request(q[1], 4, n=3)
    run(engine)
    want = expected(tiny, q, 4)
    assert engine.output(a) == want[0] and [engine.output(b + i) for i in range(3)] == [want[1]] * 3
    check_idle(engine)


@pytest.mark.parametrize("temperature", [5e-324, 1e-40, 9e-6])
def test_a_temperature_too_small_to_divide_by_decodes_greedily(tiny, temperature):
    """softmax(logits / 1e-40) holds inf and nan, and multinomial refused it mid-step; below 1e-5 the engine
    decodes greedily, as vLLM does."""
    p = prompts([11], seed=14)[0]
    engine = ServingEngine(tiny, 64, 4)
    rid = engine.add_request(p, 5, n=2, temperature=temperature, seed=1)
    run(engine)
    assert [engine.output(rid + i) for i in range(2)] == expected(tiny, [p], 5) * 2
    check_idle(engine)


def test_cancelling_the_first_before_its_first_token_cancels_the_n(tiny):
    engine = ServingEngine(tiny, 64, 4, max_batch_tokens=4)
    rid = engine.add_request(prompts([20], seed=1)[0], 5, n=3)
    engine.step()                                                      # a first chunk only
    assert engine.cancel(rid)
    assert [engine.requests[rid + i].state for i in range(3)] == ["cancelled"] * 3
    check_idle(engine)


def test_a_branch_cancelled_before_or_after_the_fork_leaves_the_others(tiny):
    p = prompts([10], seed=4)[0]
    want, = expected(tiny, [p], 6)
    engine = ServingEngine(tiny, 64, 4, max_batch_tokens=32)
    rid = engine.add_request(p, 6, n=3)
    assert engine.cancel(rid + 1)                                      # before the fork
    engine.step()
    assert engine.cancel(rid + 2) and engine.manager.check() is None   # after it, pages shared
    run(engine)
    assert engine.output(rid) == want and engine.requests[rid + 2].state == "cancelled"
    check_idle(engine)


@pytest.mark.parametrize("bad", [dict(n=0), dict(n=-1), dict(n=True), dict(n=2.0), dict(temperature=-1.0),
                                 dict(temperature=True), dict(temperature=float("nan")), dict(seed=-1),
                                 dict(seed=1.5), dict(seed=False)])
def test_bad_n_temperature_or_seed_changes_nothing(tiny, bad):
    engine = ServingEngine(tiny, 64, 4)
    with pytest.raises(InputError):
        engine.add_request([1, 2, 3], 4, **bad)
    assert not engine.requests and not engine.waiting
    check_idle(engine)


def test_n_too_large_for_the_pool_and_sampling_with_a_draft_are_refused(tiny):
    engine = ServingEngine(tiny, 16, 4)
    engine.add_request(list(range(1, 33)), 4, n=8)                    # 9 pages + 7 x 1 = 16: fits
    with pytest.raises(OutOfPagesError, match="9 answers"):
        engine.add_request(list(range(1, 33)), 4, n=9)
    assert len(engine.requests) == 8
    with pytest.raises(SpecInputError):
        ServingEngine(tiny, 16, 4, draft=PromptLookup(2)).add_request([1, 2, 3], 4, temperature=0.5)


@given(st.data())
def test_fork_step_cancel_preempt_returns_every_page(tiny, data):
    """Hypothesis: prompts with n answers, sampled or greedy, arriving and cancelled at random steps in a
    small pool (preemption), with prefix caching by hash chain or radix tree: after every step the
    bookkeeping holds, and at the end every page is free and every greedy answer is its prompt's alone."""
    index = data.draw(st.sampled_from([False, "hash", "radix"]))
    page_size = data.draw(st.sampled_from([1, 2, 4]))
    engine = ServingEngine(tiny, 40 // page_size * 2, page_size, max_batch_tokens=12, prefix_caching=index)
    reqs = data.draw(st.lists(st.tuples(st.integers(0, 10), st.integers(1, 8), st.integers(1, 4),
                                        st.integers(1, 6), st.booleans()), min_size=1, max_size=4))
    head = prompts([10], seed=99)[0]                                  # prompts share a head of up to 10 tokens
    rids = []
    for i, (shared, length, n, new, sampled) in enumerate(reqs):
        p = head[:shared] + prompts([length], seed=i)[0]
        rids.append((engine.add_request(p, new, n=n, temperature=0.8 * sampled, seed=i), n, new, sampled, p))
        engine.step()
        engine.manager.check()
        if data.draw(st.booleans()):
            victim = data.draw(st.sampled_from([r + j for r, n, *_ in rids for j in range(n)]))
            engine.cancel(victim)
            engine.manager.check()
    run(engine)
    for rid, n, new, sampled, p in rids:
        for j in range(n):
            req = engine.requests[rid + j]
            want, gap = alone(tiny, p, new)
            if req.state == "finished" and not sampled and gap > TINY_GAP:
                assert req.output == want
    check_idle(engine)
