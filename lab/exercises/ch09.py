"""Chapter 9 exercises: the rejection rule of speculative sampling, rolling a cache back after a verify step, and
the acceptance rate of prompt lookup on copied text.

Exercise 1 runs the reader's rule on drafts drawn fresh at every run (`seed=` draws the same ones again) while the
library's own rule, `accept_sampled`, raises, and compares what it emits with the exact law of the rule: the
probability of every output of a verify step (the kept guesses and the token after them), worked out from p and q.
Exercise 2 hands the reader's rollback a ListCache, a cache with no crop of its own, after every verify step of a
draft that guesses wrong at known places, and compares the next logits with recomputation without a cache.
Exercise 3 measures, and sets the number beside the book's.
"""

import collections
import functools
import math
import random

import torch

from ..cache import CacheStateError, KVCache
from ..data import passages, repeat_request
from ..engine import PromptLookup, speculative_generate
from ..engine.speculative import accept_sampled
from ..models import forward, forward_cached, load
from ..results import COMMITTED
from . import compare_with_book
from .rules import drawn_with, fresh_seed, functions_raise, unchanged

# ---- exercise 1: the acceptance rule --------------------------------------------------------------------------

DRAFTS = 3          # drafts per check, each a (p, q) pair; the first guesses k = 3 tokens, the others 2 or 3
DRAWS = 6000        # verify steps per draft: a frequency's standard error is at most sqrt(0.25 / 6000) = 0.0065
# A correct rule fails a check about once in 13,000 (the two tests below, at most 4.5e-5 + 3.2e-5 a check):
# - Z, the standard errors a token's frequency or a rate may stray: at most 3 V + 2 <= 26 of them a draft, 78 a
#   check, each outside Z = 5 with probability 5.7e-7: at most 4.5e-5 a check, once in 22,000;
# - ALPHA, the chi-square test of a draft's whole output against its exact law (MIN_EXPECTED steps or more a cell).
#   With cells that small the chi-square distribution understates the statistic's tail: on 1.8e7 simulated checks
#   of correct rules (multinomial counts from the exact law of 9 drafts, 2e6 each), a nominal 3e-6 failed
#   between 5e-6 and 1.05e-5 of them a draft (a nominal 1e-5, 2.1e-5 to 2.9e-5): at most 3.2e-5 a check.
Z = 5
ALPHA = 3e-6
MIN_EXPECTED = 5    # expected steps per cell of the chi-square test: rarer outputs are pooled (_cells)


def drafts(seed) -> list[tuple]:
    """DRAFTS pairs (p `[k + 1, V]`, q `[k, V]`) drawn from `seed`: V from 5 to 8, k 3 in the first (a rejection
    after two kept guesses happens in every check) and 2 or 3 in the others, every row a softmax of normal logits
    (scale 2). A pair is kept when each guess's exact acceptance, sum_x min(p_i(x), q_i(x)), lies in 0.25..0.75:
    the rule keeps and rejects often, and p and q differ (their total variation is 1 - that)."""
    g, out = torch.Generator().manual_seed(seed), []
    while len(out) < DRAFTS:
        V, k = int(torch.randint(5, 9, (), generator=g)), int(torch.randint(2, 4, (), generator=g))
        k = k if out else 3
        p = torch.softmax(2 * torch.randn(k + 1, V, generator=g), -1)      # [k + 1, V] the target's
        q = torch.softmax(2 * torch.randn(k, V, generator=g), -1)          # [k, V] the draft's
        beta = torch.minimum(p[:k], q).sum(-1)                             # [k]
        if ((beta > 0.25) & (beta < 0.75)).all():
            out.append((p, q))
    return out


def _emitted(accept, p, q, seed) -> tuple:
    """DRAWS guesses drawn from q (each position on its own, as a draft samples), and what accept emitted for
    each, as lists of ints. p and q are copies: the reader's function cannot change them for the next call."""
    g, k = torch.Generator().manual_seed(seed), q.shape[0]
    guesses = torch.stack([torch.multinomial(q[i], DRAWS, replacement=True, generator=g) for i in range(k)], 1)
    guesses = guesses.tolist()                                             # [DRAWS][k]
    with unchanged(__name__), functions_raise(accept_sampled, output_law):
        outs = [accept(p.clone(), q.clone(), list(guess), g) for guess in guesses]
    return guesses, outs


def _as_tokens(out, guess, V) -> list[int]:
    k = len(guess)
    assert isinstance(out, (list, tuple)), f"accept must return a list of token ids, got {type(out).__name__}"
    try:
        out = [int(t) for t in out]
    except (TypeError, ValueError, RuntimeError):
        raise AssertionError(f"accept must return a list of token ids, got {out!r}") from None
    assert 1 <= len(out) <= k + 1, (
        f"accept returned {len(out)} tokens for {k} guesses: a step emits the kept guesses and one more token, "
        f"1 to {k + 1} in all")
    assert all(0 <= t < V for t in out), f"accept returned {out}: token ids run 0..{V - 1}"
    assert out[:-1] == guess[:len(out) - 1], (
        f"accept returned {out} for the guesses {guess}: every token but the last must be a kept guess, in order "
        "(the step ends at the first rejection)")
    return out


def _frequencies(what, tokens, probs, hint):
    """Assert that `tokens` (a list of ids) are distributed as `probs` `[V]`: each id's frequency within Z binomial
    standard errors, sqrt(p (1 - p) / n), taking p (1 - p) at least 0.01 (a rare id seen a few times is no
    evidence). Returns the largest error in standard errors."""
    n, probs = len(tokens), probs.double()
    assert n, f"{what}: none came out. {hint}"
    freq = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=len(probs)).double() / n    # [V]
    se = ((probs * (1 - probs)).clamp(min=0.01) / n).sqrt()                                           # [V]
    z = (freq - probs).abs() / se
    x = int(z.argmax())
    assert z[x] <= Z, (
        f"{what}: token {x} came out in {freq[x]:.3f} of {n} steps, the target's probability is {probs[x]:.3f} "
        f"({Z} standard errors: {Z * se[x]:.3f}). {hint}")
    return float(z.max())


def _rate(what, hits, n, want, hint) -> float:
    se = math.sqrt(want * (1 - want) / n)
    assert abs(hits / n - want) <= Z * se, (
        f"{what} in {hits / n:.3f} of {n} steps; the rule does so with probability {want:.3f} ({Z} standard "
        f"errors: {Z * se:.3f}). {hint}")
    return abs(hits / n - want) / se


def output_law(p, q) -> dict:
    """The oracle: the exact probability of every output of one verify step, the k guesses drawn from q position
    by position, as {tokens emitted: probability}; outputs the rule never emits are left out.

    An output is m kept guesses x_0 .. x_{m-1} and one more token y. Guess i is drawn with probability q_i(x) and
    kept with min(1, p_i(x) / q_i(x)): together min(p_i(x), q_i(x)). A rejection at m (probability 1 - beta_m) draws
    y from max(0, p_m - q_m) / (1 - beta_m): together max(0, p_m(y) - q_m(y)). After k kept guesses, the bonus y has
    probability p_k(y). So P(x_0 .. x_{m-1}, y) = prod_{i < m} min(p_i(x_i), q_i(x_i)) x (max(0, p_m(y) - q_m(y))
    if m < k, else p_k(y)), in float64, normalised (float32 rows sum to 1 within 1e-7)."""
    k = q.shape[0]
    p, q = p.double(), q.double()
    keep = torch.minimum(p[:k], q).tolist()                                  # [k][V] drawn and kept
    last = torch.cat([(p[:k] - q).clamp(min=0), p[k:]]).tolist()              # [k + 1][V] the token after m kept
    law, kept = {}, {(): 1.0}                                                # kept prefix -> its probability
    for m in range(k + 1):
        law |= {prefix + (y,): pr * w for prefix, pr in kept.items() for y, w in enumerate(last[m]) if w > 0}
        if m < k:
            kept = {prefix + (x,): pr * w for prefix, pr in kept.items() for x, w in enumerate(keep[m]) if w > 0}
    total = sum(law.values())
    return {out: pr / total for out, pr in law.items()}


def _cells(law, n) -> list[list]:
    """The outputs of `law` in cells of at least MIN_EXPECTED expected counts in n steps, fixed before any output is
    seen: a likely output alone; the rare ones pooled with the rare ones of the same length and last token (what
    the rule draws after the same number of kept guesses), then of the same length, then all together (a last
    pool still short joins the smallest cell)."""
    cells, rare = [[o] for o in law if n * law[o] >= MIN_EXPECTED], [o for o in law if n * law[o] < MIN_EXPECTED]
    for key in (lambda o: (len(o), o[-1]), len, lambda o: 0):
        groups = {}
        for o in rare:
            groups.setdefault(key(o), []).append(o)
        rare = []
        for group in groups.values():
            if n * sum(law[o] for o in group) >= MIN_EXPECTED:
                cells.append(group)
            else:
                rare += group
    if rare:
        min(cells, key=lambda c: sum(law[o] for o in c)).extend(rare)
    return cells


def _describe(cell) -> str:
    if len(cell) == 1:
        out = cell[0]
        return f"the output {list(out)} ({len(out) - 1} guesses kept, then {out[-1]})"
    lengths, lasts = {len(o) for o in cell}, {o[-1] for o in cell}
    if len(lengths) == 1 and len(lasts) == 1:
        return f"the {len(cell)} rare outputs that keep {len(cell[0]) - 1} guesses and end in token {cell[0][-1]}"
    if len(lengths) == 1:
        return f"the {len(cell)} rare outputs that keep {len(cell[0]) - 1} guesses"
    return f"{len(cell)} rare outputs pooled"


def _whole_output(name, law, outs) -> float:
    """Assert that the outputs `outs` (token tuples) follow `law` as a whole: none the rule never emits, and a
    chi-square test over _cells at significance ALPHA. Returns the test's p-value."""
    counts = collections.Counter(outs)
    never = [o for o in counts if o not in law]
    assert not never, (                       # every kept prefix and every bonus is possible: a rejection's token
        f"{name}: your function emitted {list(never[0])} ({counts[never[0]]} times), which the rule never emits: "
        f"after rejecting guess {len(never[0]) - 1} it draws from max(0, p - q) at that position, where token "
        f"{never[0][-1]} has none (p <= q)")
    n, cells = len(outs), _cells(law, len(outs))
    seen = torch.tensor([sum(counts[o] for o in c) for c in cells], dtype=torch.float64)
    want = n * torch.tensor([sum(law[o] for o in c) for c in cells], dtype=torch.float64)
    parts = (seen - want) ** 2 / want
    chi2, df = float(parts.sum()), len(cells) - 1
    p_value = float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), torch.tensor(chi2 / 2)))
    worst = int(parts.argmax())
    assert p_value >= ALPHA, (
        f"{name}: the outputs as a whole do not follow the rule's exact law (chi-square {chi2:.0f} on {df} degrees "
        f"of freedom, p = {p_value:.1g}; a correct rule falls below {ALPHA:g} about once in 100,000 drafts). Worst: "
        f"{_describe(cells[worst])} came out {int(seen[worst])} times in {n} steps, {float(want[worst]):.1f} "
        "expected. Every output must be as likely as the rule makes it, at every position: keep guess i with "
        "probability min(1, p_i(x) / q_i(x)); at the first rejection draw from max(0, p_i - q_i) normalised (at "
        "every position, not only the first); after k kept guesses draw the bonus from p_k")
    return p_value


def _judge(j, p, q, guesses, outs) -> dict:
    """The oracle, after the answers: the target's own probabilities, exactly."""
    k, V = q.shape
    name = f"draft {j} (V = {V}, k = {k})"
    outs = [_as_tokens(out, guess, V) for out, guess in zip(outs, guesses, strict=True)]
    p64, q64 = p.double(), q.double()
    beta = torch.minimum(p64[:k], q64).sum(-1)                              # [k] exact acceptance of each guess
    z = [_frequencies(f"{name}, the first token emitted", [o[0] for o in outs], p64[0],
                      "Whatever the draft guessed, the first token must be distributed as the target's own "
                      "sample, p_0: keep guess x with probability min(1, p(x) / q(x)), else draw from the "
                      "residual max(0, p - q), normalised")]
    kept = [o for o in outs if len(o) > 1]                                  # the first guess kept
    hint = ("Keep guess x with probability min(1, p_0(x) / q_0(x))"
            + (": your function never kept one" if not kept else ""))
    z.append(_rate(f"{name}: the first guess was kept", len(kept), len(outs), float(beta[0]), hint))
    z.append(_frequencies(f"{name}, after a kept first guess, the second token emitted", [o[1] for o in kept],
                          p64[1], "After a kept guess the next token is judged against p_1, the target's "
                          "probabilities after that guess"))
    full = [o for o in outs if len(o) == k + 1]                             # every guess kept, and a bonus
    z.append(_rate(f"{name}: all {k} guesses were kept and a bonus token drawn", len(full), len(outs),
                   float(beta.prod()), "When every guess is kept, draw one more token from p_k"))
    z.append(_frequencies(f"{name}, the bonus token after {k} kept guesses", [o[k] for o in full], p64[k],
                          "The bonus is a draw from p_k, the target's probabilities after the last guess"))
    p_value = _whole_output(name, output_law(p, q), [tuple(o) for o in outs])
    return dict(V=V, k=k, acceptance=len(kept) / len(outs), expected_acceptance=float(beta[0]),
                worst_error_in_se=max(z), p_value=p_value)


def check_acceptance(accept, seed=None) -> dict:
    """accept(p, q, guess, generator) -> list[int]: the tokens one verify step emits when sampling.

    p `[k + 1, V]`: the target's probabilities after the context and after each guess; q `[k, V]`: the draft's,
    from which guess (a list of k ids) was drawn; generator: a torch.Generator to draw with. Keep guess i with
    probability min(1, p_i(x) / q_i(x)); at the first rejection, draw from max(0, p_i - q_i) normalised, and stop;
    if all k are kept, draw a bonus token from p_k. Return the kept guesses and the one drawn token.

    The check draws three drafts from `seed` (V from 5 to 8, k = 3 in the first, 2 or 3 in the others), DRAWS
    guesses from each q, and runs your function on every one while `lab.engine.speculative.accept_sampled` raises.
    Then it verifies, against p and q themselves: within Z standard errors, the first token emitted is distributed
    as p_0, the first guess is kept at the exact rate sum_x min(p_0(x), q_0(x)), after a kept first guess the
    second token follows p_1, all k are kept at the rate prod_i sum_x min(p_i(x), q_i(x)), and the bonus follows
    p_k; and the outputs as a whole (kept guesses and the last token, every position) follow the rule's exact law
    (`output_law`), by a chi-square test at significance ALPHA. Keeping every guess fails (the tokens follow q), and
    so does rejecting every one (p_0 alone, but nothing accepted: no speed-up), and so does a rule right at the
    first positions only.
    Returns, per draft, the acceptance measured and the exact one, and the whole-output test's p-value.
    """
    seed = fresh_seed(seed)
    results = []
    with drawn_with(seed, "check_acceptance"):
        for j, (p, q) in enumerate(drafts(seed)):
            guesses, outs = _emitted(accept, p, q, seed + j + 1)
            results.append(_judge(j, p, q, guesses, outs))
    for r in results:
        print(f"V = {r['V']}, k = {r['k']}: first guess kept in {r['acceptance']:.3f} of {DRAWS} steps, exactly "
              f"{r['expected_acceptance']:.3f}")
    print(f"correct (drafts drawn with seed={seed})")
    return dict(seed=seed, drafts=results)


# ---- exercise 2: roll a cache back ----------------------------------------------------------------------------

class ListCache(KVCache):
    """A cache that keeps what each forward stored as it came: per layer, a list of key chunks and one of value
    chunks, each `[B, H_kv, T_i, D]`, in the order they were stored; attention reads their concatenation, which
    holds exactly `length` positions between steps. It has no crop: rolling it back is exercise 2."""

    def __init__(self, config, batch_size: int = 1, dtype=None, device="cpu"):
        super().__init__(config, batch_size, dtype, device)
        self.keys = [[] for _ in range(self.n_layers)]     # per layer: chunks [B, H_kv, T_i, D]
        self.values = [[] for _ in range(self.n_layers)]

    def _write(self, layer, k, v):
        self.keys[layer].append(k.clone())                  # a copy: k, v may be views of a larger tensor
        self.values[layer].append(v.clone())

    def _read(self, layer):
        return torch.cat(self.keys[layer], 2), torch.cat(self.values[layer], 2)   # [B, H_kv, length + T, D]

    def _truncate(self, n):
        raise CacheStateError("a ListCache has no crop or reset: rolling it back is chapter 9's exercise 2")

    def nbytes(self) -> int:
        return sum(t.nbytes for chunks in self.keys + self.values for t in chunks)


@functools.cache
def tiny_model():
    """tiny-llama (2 layers, width 64, random weights, 320 token ids): a verify step takes about a millisecond."""
    return load("tiny-llama")


K = 4                                  # guesses per verify step
ACCEPTS = (0, 2, 4, 1, 3, 0, 4, 2)     # guesses the draft gets right in each verify step; the next one is wrong
PROMPT = 12                            # prompt tokens, random ids
PROMPT_SEED = 3                        # every greedy token is clear of near ties (tests/test_exercises_ch09.py)
DEEP = 5                               # the last rollback goes this many positions back into the prompt
# Logits through the cache against recomputation: a cached and an uncached forward add the same terms in other
# orders, a few 1e-7 on the tiny model (tests/test_forward_cached.py allows 1e-5); attending to one position
# that should be gone moves them by far more (about 5e-2 here: tests/test_exercises_ch09.py measures it).
ATOL = 1e-5
NO_CROP = "forbidden shortcut: the cache's crop and reset are the library's rollback; cut the chunks yourself"


def _subclasses(cls) -> list:
    return [c for sub in cls.__subclasses__() for c in (sub, *_subclasses(sub))]


# The library's rollback: KVCache's crop and reset, and every cache's own _truncate in lab.cache (a ConcatCache's
# cuts one tensor per layer: concatenate the chunks first, and it would do the exercise)
LIBRARY_ROLLBACK = (KVCache.crop, KVCache.reset, *[c._truncate for c in [KVCache, *_subclasses(KVCache)]
                                                   if c.__module__.startswith("lab.cache") and "_truncate" in vars(c)])


def rollback_prompt() -> list[int]:
    rng = random.Random(PROMPT_SEED)
    return [rng.randrange(tiny_model().config.vocab_size) for _ in range(PROMPT)]


@functools.cache
def greedy(n: int) -> tuple:
    """The oracle: n greedy tokens after rollback_prompt(), each recomputed without a cache (`lab.models.forward`
    over the whole sequence), and the smallest gap between the top two logits on the way."""
    model, ids, gap = tiny_model(), rollback_prompt(), float("inf")
    with torch.inference_mode():
        for _ in range(n):
            logits = forward(torch.tensor([ids]), model.weights, model.config, last_only=True)[0, -1]   # [V]
            top = logits.topk(2).values
            ids, gap = ids + [int(logits.argmax())], min(gap, float(top[0] - top[1]))
    return tuple(ids[PROMPT:]), gap


def guesses(want: list, a: int, vocab: int) -> list[int]:
    """K guesses whose first `a` are the greedy tokens `want` and whose next (when a < K) is not."""
    wrong = [(t + 1 + 7 * i) % vocab for i, t in enumerate(want[a:K])]      # never the greedy token
    return list(want[:a]) + wrong


def stored(cache) -> list:
    """Per layer, (keys, values) `[B, H_kv, T, D]` as attention will read them: the chunks concatenated."""
    try:
        return [(torch.cat(list(k), 2), torch.cat(list(v), 2)) for k, v in zip(cache.keys, cache.values, strict=True)]
    except (TypeError, RuntimeError, ValueError) as e:
        raise AssertionError(f"the cache's chunks no longer concatenate ({e}): keep cache.keys[layer] and "
                             "cache.values[layer] lists of tensors [B, H_kv, T_i, D]") from None


def _roll_back(rollback, cache, n, what):
    """Run the reader's rollback(cache, n) while crop and reset raise, then check what the cache holds."""
    before, length = stored(cache), cache.length
    with unchanged(__name__), functions_raise(*LIBRARY_ROLLBACK, why=NO_CROP):
        rollback(cache, n)
    assert not any(cache.pending), f"{what}: the cache holds pending positions {cache.pending}: leave them be"
    got = cache.length
    assert got == n, (
        f"{what}: after rollback(cache, {n}) the cache's length is {got}, not {n}"
        + (" (unchanged)" if got == length else f" ({got - n:+d})")
        + ": keep exactly the accepted positions, 0 .. n - 1 (the context before the last token, that token, and "
        "the kept guesses), and set cache.length = n")
    for layer, ((k, v), (k0, v0)) in enumerate(zip(stored(cache), before, strict=True)):
        assert k.shape[2] == v.shape[2] == n, (
            f"{what}: after rollback(cache, {n}) layer {layer} holds {k.shape[2]} positions of keys and {v.shape[2]} "
            f"of values, not {n}: drop the positions from n on out of its chunks (the last chunk, or more)")
        assert torch.equal(k, k0[:, :, :n]) and torch.equal(v, v0[:, :, :n]), (
            f"{what}: after rollback(cache, {n}) layer {layer}'s positions 0 .. {n - 1} are not the ones it held "
            "before: keep the first n positions as they were, and drop the rest")


def _check_logits(logits, ids, what):
    """The logits `[T, V]` of the last T of `ids` through the cache equal recomputation without one."""
    model = tiny_model()
    want = forward(torch.tensor([ids]), model.weights, model.config)[0, -logits.shape[0]:]    # [T, V]
    err = float((logits - want).abs().max())
    assert err <= ATOL, (
        f"{what}: the logits through the cache differ from recomputing the sequence without one by {err:.2g} "
        f"(rounding alone stays below {ATOL:g}): attention still reads positions that were rolled back, or lost "
        "some that were kept")


def check_rollback(rollback) -> dict:
    """rollback(cache, n): make `cache`, a ListCache, forget every position from n on. n is the accepted length:
    the positions before the verify chunk, its first token (the last one emitted) and the guesses kept.

    A ListCache keeps, per layer, the chunks each forward stored, `cache.keys[layer]` and `cache.values[layer]`,
    lists of `[B, H_kv, T_i, D]` tensors; its `length` counts the positions they hold. It has no crop: cut the
    chunks (the last one, or more, whole or in part) so that they hold positions 0 .. n - 1, and set
    `cache.length = n`. The check runs tiny-llama: a prefill of a 12-token prompt, then eight verify steps of
    K = 4 guesses each, through one ListCache; the draft guesses right ACCEPTS[i] times in step i, then wrong
    (all 4 right, or none, in some). After each step it calls rollback(cache, n) while `cache.crop`,
    `cache.reset` and every lab cache's own truncation raise, and verifies: the cache's length is n; every layer
    holds exactly the first n positions it held before; the next step's logits equal recomputation without a
    cache (`lab.models.forward`) within ATOL; the tokens are plain greedy decoding's. Last, it rolls back 5
    positions into the prompt (as a draft's own cache must when the target rejected what it ran ahead) and checks
    the logits of everything fed again.
    Returns the lengths rolled back to and the tokens.
    """
    model = tiny_model()
    w, cfg = model.weights, model.config
    want = list(greedy(1 + sum(a + 1 for a in ACCEPTS) + K)[0])          # K more: the last step's guesses
    prompt, cache, lengths = rollback_prompt(), ListCache(cfg), []
    run = lambda ids: forward_cached(torch.tensor([ids]), w, cfg, cache)[0]     # [len(ids), V]
    with torch.inference_mode():
        tokens = [int(run(prompt)[-1].argmax())]                                # the prefill's token
        for step, a in enumerate(ACCEPTS):
            context = prompt + tokens
            guess = guesses(want[len(tokens):], a, cfg.vocab_size)
            logits = run([context[-1]] + guess)                                 # [K + 1, V] one verify forward
            _check_logits(logits, context + guess, f"verify step {step}")
            greedy_ids = logits.argmax(-1).tolist()
            kept = 0
            while kept < K and guess[kept] == greedy_ids[kept]:
                kept += 1
            n = len(context) + kept                       # the context and the kept guesses
            _roll_back(rollback, cache, n, f"verify step {step} ({kept} of {K} guesses kept)")
            tokens += guess[:kept] + [greedy_ids[kept]]
            lengths.append(n)
            assert tokens == want[:len(tokens)], (
                f"after verify step {step}, the tokens {tokens} differ from plain greedy decoding's "
                f"{want[:len(tokens)]}")
        ids = prompt + tokens
        _check_logits(run(ids[-1:]), ids, "the decode step after the last rollback")
        n = PROMPT - DEEP
        _roll_back(rollback, cache, n, f"rolling back {DEEP} positions into the prompt")
        _check_logits(run(ids[n:]), ids, f"feeding positions {n} .. {len(ids) - 1} again after that")
    print(f"rolled back to lengths {lengths} and {n}; {len(tokens)} tokens, as plain greedy decoding gives them")
    print("correct")
    return dict(lengths=lengths + [n], tokens=tokens)


# ---- exercise 3: acceptance of prompt lookup on copied text (open-ended) ------------------------------------

def copy_prompt(tokenizer, tokens: int = 256, seed: int = 0) -> list[int]:
    """The chapter's copy workload: a chat turn asking for a held-out passage of `tokens` ids repeated word for
    word (`lab.data.repeat_request`). The answer repeats the prompt, which prompt lookup finds there."""
    return repeat_request(tokenizer, passages(tokenizer, tokens, count=1, seed=seed)[0])


# where the chapter's experiment (lab/experiments/ch09_speculation.py) records prompt lookup's acceptance on its
# copy workload, k guesses a step: a group per k, whose "acceptance" is the percentage of guesses accepted
BOOK_KEY = "ch09.acceptance.copy.lookup.k{k}.acceptance"


def measure_acceptance(k: int = 4, n: int = 3, tokens: int = 256, new_tokens: int = 32, model="smollm2",
                       prompt=None, path=COMMITTED) -> float:
    """Speculative decoding of new_tokens after `prompt` (by default copy_prompt(tokenizer, tokens)), drafted by
    PromptLookup(n), k guesses a step: prints the share of guesses accepted and the tokens per target forward,
    and sets the share beside the book's (BOOK_KEY in results/results.json; the book measured k = 4, n = 3 on
    SmolLM2). Returns yours over the book's. `model`: a name for `load`, or a loaded model.

    Open-ended: vary n and k, or give it a prompt with nothing to copy (`lab.data.passages` alone). Where does
    acceptance fall, and what does that do to the tokens per forward?
    """
    model = load(model) if isinstance(model, str) else model
    prompt = copy_prompt(model.tokenizer, tokens) if prompt is None else list(prompt)
    r = speculative_generate(model, prompt, new_tokens, PromptLookup(n), k=k)
    if not r.proposed:
        raise ValueError("prompt lookup proposed nothing: no n-gram of the context occurred earlier in it")
    print(f"PromptLookup({n}), k = {k}: {r.accepted} of {r.proposed} guesses accepted; "
          f"{r.tokens_per_step:.2f} tokens per target forward after the prefill")
    return compare_with_book(BOOK_KEY.format(k=k), 100 * r.acceptance, "%", path=path)
