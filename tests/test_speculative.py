"""Speculative decoding (lab/engine/speculative.py): the tokens of plain greedy decoding, for every draft and k,
and a cache that holds no rejected position afterwards.

Oracles: plain greedy decoding through the same cache design (`generate` over a CachedBackend), and the
caches' own lengths and page counts. Equality is exact: a verify step accepts a draft token only where it
equals the target's own greedy choice. The one way the two could differ is a near tie flipped by the
order of a sum (the verify chunk attends with the chunked kernel, plain decoding one query at a time);
the prompts here have no such tie, which `expected` checks on the recomputed logits.
"""

import pytest
import torch

from lab import data
from lab.cache import EvictingCache, PagedCache, QuantizedCache, StaticCache, make_cache
from lab.engine import (
    CachedBackend,
    EarlyExit,
    PromptLookup,
    SelfDraft,
    SpecInputError,
    generate,
    speculative_generate,
)
from lab.models import forward, load

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def factory(model, design, room=256):
    if design == "int8":
        return lambda: QuantizedCache(model.config, bits=8)
    if design == "kivi2":
        return lambda: QuantizedCache(model.config, bits=2, scheme="kivi")
    return lambda: make_cache(design, model.config, room)


def plain(model, prompt, n, design="static"):
    """Greedy tokens through a cache of `design`, one token per forward."""
    return generate(CachedBackend(model, factory(model, design, len(prompt) + n + 1)), prompt, n).tokens


def repeated_prompt(model, seed=0, length=24):
    """A prompt that repeats itself, so that prompt lookup finds matches."""
    g = torch.Generator().manual_seed(seed)
    part = torch.randint(0, model.config.vocab_size, (length,), generator=g).tolist()
    return part + part[: length // 2]


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def drafts(model):
    return {"lookup": PromptLookup(2), "self-window": SelfDraft(lambda: EvictingCache(model.config, 16, "window")),
            "self-full": SelfDraft(lambda: StaticCache(model.config, 256)), "early-exit": EarlyExit(1)}


@pytest.mark.parametrize("design", ["static", "paged", "concat", "int8", "kivi2"])
@pytest.mark.parametrize("name", ["lookup", "self-window", "self-full", "early-exit"])
def test_greedy_tokens_equal_plain_decoding_for_every_k(tiny, design, name):
    prompt = repeated_prompt(tiny)
    want = plain(tiny, prompt, 24, design)
    for k in range(1, 9):
        got = speculative_generate(tiny, prompt, 24, drafts(tiny)[name], k=k, cache=factory(tiny, design))
        assert got.tokens == want, f"k={k}"
        assert got.accepted <= got.proposed and got.steps >= 1 + (24 - 1) // (k + 1)


def test_a_draft_that_is_the_target_is_always_accepted(tiny):
    """The same weights over a full cache propose the target's own greedy tokens: nothing is rejected, and
    each verify step yields k + 1 tokens."""
    r = speculative_generate(tiny, repeated_prompt(tiny, 1), 21, SelfDraft(lambda: StaticCache(tiny.config, 256)), k=4)
    assert r.accepted == r.proposed == 16 and r.steps == 1 + 4 and r.tokens_per_step == 5


def test_the_target_cache_holds_only_accepted_positions_and_pages(tiny):
    caches = []

    def paged():
        caches.append(PagedCache(tiny.config, 256, page_size=4))
        return caches[-1]

    prompt = repeated_prompt(tiny, 2)
    r = speculative_generate(tiny, prompt, 20, PromptLookup(1), k=6, cache=paged)
    cache = caches[0]
    assert cache.length == len(prompt) + len(r.tokens) - 1          # the last token is not yet run
    held = cache.manager.num_pages - cache.manager.num_free
    assert held == -(-cache.length // 4)                            # rejected drafts' pages were freed


def test_a_self_draft_rolls_its_own_cache_back(tiny):
    d = SelfDraft(lambda: StaticCache(tiny.config, 256))
    prompt = repeated_prompt(tiny, 3)
    d.bind(tiny, prompt)
    guess = d.propose(prompt, 4)                          # its cache: the prompt and the first 3 guesses
    assert len(guess) == 4 and d.cache.length == len(prompt) + 3 and d.rollbacks == 0
    context = prompt + [guess[0], guess[1] ^ 1]           # the target kept one guess, then chose another
    before = d.positions
    d.propose(context, 2)
    assert d.rollbacks == 1 and d.positions == before + 2  # cropped to prompt + guess[0]: nothing run again
    assert d.cache.length == len(context) + 1 and d.ids[:len(context)] == context


def test_bad_settings_are_refused(tiny):
    prompt = repeated_prompt(tiny)
    for k in (0, -1, 1.5, True):
        with pytest.raises(SpecInputError):
            speculative_generate(tiny, prompt, 4, PromptLookup(), k=k)
    for n in (0, -2, 2.0):
        with pytest.raises(SpecInputError):
            PromptLookup(n)
    with pytest.raises(SpecInputError, match="evicting"):   # a chunk evicts what plain decoding would keep
        speculative_generate(tiny, prompt, 4, PromptLookup(), cache=lambda: EvictingCache(tiny.config, 16, "window"))
    with pytest.raises(SpecInputError):
        EarlyExit(0)
    with pytest.raises(SpecInputError):
        speculative_generate(tiny, prompt, 4, EarlyExit(tiny.config.n_layers + 1))

    class Wild(PromptLookup):
        def propose(self, context, k):
            return [tiny.config.vocab_size] * k                      # an id the target has no row for

    with pytest.raises(SpecInputError):
        speculative_generate(tiny, prompt, 4, Wild())


def test_smollm2_prompt_lookup_on_copied_text(smollm2):
    """A copy-heavy prompt (a passage, then its first half again): prompt lookup proposes the passage's
    continuation, the target accepts much of it, and the tokens are plain greedy decoding's."""
    passage = data.passages(smollm2.tokenizer, n_tokens=96, count=1, seed=11)[0]
    prompt = passage + passage[:48]
    r = speculative_generate(smollm2, prompt, 24, PromptLookup(3), k=4)
    assert r.tokens == plain(smollm2, prompt, 24)
    assert r.accepted > r.proposed / 2 and r.steps < 24


# ---- sampling: the rejection rule ---------------------------------------------------------------------------

P = torch.tensor([[0.5, 0.2, 0.1, 0.1, 0.1], [0.05, 0.05, 0.6, 0.2, 0.1], [0.2] * 5])   # target [k + 1, V]
Q = torch.tensor([[0.1, 0.6, 0.1, 0.1, 0.1], [0.3, 0.1, 0.1, 0.4, 0.1]])                  # draft [k, V]
N = 20_000          # draws: a frequency's standard error is at most sqrt(0.25 / N) = 0.0035
TOL = 5 * (0.25 / N) ** 0.5


def emitted(rule, seed=0):
    """Frequencies of the first emitted token, and of the second after a kept first guess, over N steps of
    `rule(p, q, guess, generator)` with guesses drawn from Q."""
    g = torch.Generator().manual_seed(seed)
    first, second = torch.zeros(5), torch.zeros(5)
    guesses = torch.stack([torch.multinomial(Q[i], N, replacement=True, generator=g) for i in range(2)], 1)
    for guess in guesses.tolist():
        out = rule(P, Q, guess, g)
        first[out[0]] += 1
        if len(out) > 1 and out[0] == guess[0]:
            second[out[1]] += 1
    return first / N, second / max(second.sum(), 1), int(second.sum())


def test_the_rejection_rule_samples_the_target_distribution():
    """Oracle: the target's own distribution. On a vocabulary of 5, with a draft that disagrees with the
    target, the first emitted token follows p_0, and after a kept first guess the second follows p_1; five
    standard errors of N draws allowed."""
    from lab.engine.speculative import accept_sampled

    first, second, kept = emitted(accept_sampled)
    assert (first - P[0]).abs().max() < TOL
    assert kept > 2_000 and (second - P[1]).abs().max() < 5 * (0.25 / kept) ** 0.5


def test_the_check_fails_accepting_everything_and_rejecting_everything():
    """The same check on the two shortcuts: keeping every guess emits the draft's distribution, rejecting
    every guess (a draw from the target each time, the guess ignored) is plain sampling's but accepts
    nothing; the first fails the distribution, the second the acceptance."""
    accept_all = lambda p, q, guess, g: list(guess) + [int(torch.multinomial(p[-1], 1, generator=g))]
    reject_all = lambda p, q, guess, g: [int(torch.multinomial(p[0], 1, generator=g))]
    assert (emitted(accept_all)[0] - P[0]).abs().max() > TOL
    assert emitted(reject_all)[2] < 2_000          # after rejecting, the second token is never a kept guess's


def test_sampled_speculation_draws_the_target_distribution(tiny):
    """Oracle: the target's joint probability of its first two new tokens, p(t1) p(t2 | t1), computed by
    recomputation at the same temperature. The second token comes out of a verify step (the draft, the
    target's own greedy token, is kept or replaced by the rule), so its frequency tests the rejection rule
    as speculative_generate wires it; five standard errors of N runs allowed, on the six likeliest pairs."""
    T, N = 0.1, 600          # the tiny model's logits are nearly flat: a low temperature gives pairs to count
    prompt = repeated_prompt(tiny, seed=4)
    logits = lambda ids: forward(torch.tensor([ids]), tiny.weights, tiny.config)[0, -1]   # [V], no cache
    p1 = torch.softmax(logits(prompt) / T, -1)
    joint = {}
    for t1 in p1.topk(8).indices.tolist():
        p2 = torch.softmax(logits(prompt + [t1]) / T, -1)
        joint |= {(t1, t2): float(p1[t1] * p2[t2]) for t2 in p2.topk(8).indices.tolist()}
    top = sorted(joint, key=joint.get)[-6:]
    g, counts, proposed, accepted = torch.Generator().manual_seed(0), dict.fromkeys(top, 0), 0, 0
    for _ in range(N):
        draft = SelfDraft(lambda: StaticCache(tiny.config, 64))
        r = speculative_generate(tiny, prompt, 3, draft, k=2, temperature=T, generator=g)
        proposed, accepted = proposed + r.proposed, accepted + r.accepted
        pair = tuple(r.tokens[:2])
        if pair in counts:
            counts[pair] += 1
    assert proposed == N and N // 20 < accepted < N - N // 20            # guesses kept and guesses replaced
    for pair in top:
        assert abs(counts[pair] / N - joint[pair]) < 5 * (joint[pair] * (1 - joint[pair]) / N) ** 0.5, pair


@pytest.mark.parametrize("k", [1, 8])
def test_a_prompt_at_the_context_limit(tiny, k):
    """A prompt whose last new token takes the model's last position: the guesses shrink to the positions
    left, and the tokens are still plain greedy decoding's."""
    prompt = (repeated_prompt(tiny, seed=2, length=40) * 60)[:tiny.config.max_positions - 9]
    r = speculative_generate(tiny, prompt, 10, EarlyExit(1, max_tokens=2048), k=k, cache="paged")
    assert r.proposed and r.tokens == plain(tiny, prompt, 10, "concat")
