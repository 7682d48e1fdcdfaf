"""Chapter 9 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut.

Oracles: for the rejection rule, the target's own probabilities and the exact acceptance sum_x min(p, q), which
the library's rule (`accept_sampled`, called outside the check) is checked against here, and which every common
mistake misses by many standard errors on every drawn draft (worked out exactly below); for the rollback, plain
greedy decoding and the logits of `lab.models.forward` recomputing the whole sequence, cross-checked against
`speculative_generate`, with a tolerance shown to lie far below what one stale position changes; for the
measurement, `speculative_generate`'s own counters.
"""

import pytest
import torch

from lab import results
from lab.data import passages
from lab.engine import PromptLookup, speculative_generate
from lab.engine.speculative import accept_sampled
from lab.exercises import ch09
from lab.exercises import ch09_solutions as sol9
from lab.models import forward, forward_cached

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

TINY_GAP = 1e-4   # 10 x the 1e-5 bound on tiny-model logit differences between cache designs (test_serving.py)


# ---- exercise 1: the acceptance rule --------------------------------------------------------------------------

def test_the_oracle_passes_the_librarys_own_rule():
    """accept_sampled, run outside the check (where it is not forbidden), is what the oracle accepts."""
    for j, (p, q) in enumerate(ch09.drafts(5)):
        g, k = torch.Generator().manual_seed(j), q.shape[0]
        guesses = torch.stack([torch.multinomial(q[i], ch09.DRAWS, True, generator=g) for i in range(k)], 1).tolist()
        result = ch09._judge(j, p, q, guesses, [accept_sampled(p, q, guess, g) for guess in guesses])
        assert result["worst_error_in_se"] < ch09.Z


def first_token(rule, p, q):
    """The exact distribution `[V]` of the first token a rule emits, guesses drawn from q."""
    p0, q0 = p[0].double(), q[0].double()
    if rule == "accept everything":
        return q0
    if rule == "resample from p":               # a rejection draws from p instead of the residual
        return torch.minimum(p0, q0) + (1 - torch.minimum(p0, q0).sum()) * p0
    keep = q0 * (q0 / p0).clamp(max=1)          # "inverted": keeps x with probability min(1, q/p)
    residual = (p0 - q0).clamp(min=0)
    return keep + (1 - keep.sum()) * residual / residual.sum()


@pytest.mark.parametrize("rule", ["accept everything", "resample from p", "inverted"])
def test_every_drawn_draft_set_tells_the_common_mistakes_apart(rule):
    """On 100 seeds, some draft puts a wrong rule's first token at least 2 Z standard errors from p_0 (at least
    14 on 300 seeds): the check fails it whatever the seed, not by luck."""
    for seed in range(100):
        z = []
        for p, q in ch09.drafts(seed):
            p0 = p[0].double()
            se = ((p0 * (1 - p0)).clamp(min=0.01) / ch09.DRAWS).sqrt()
            z.append(float(((first_token(rule, p, q) - p0).abs() / se).max()))
        assert max(z) > 2 * ch09.Z, (rule, seed)


def test_the_drafts_keep_and_reject_often_and_vary():
    shapes = set()
    for seed in range(20):
        for p, q in ch09.drafts(seed):
            k, V = q.shape
            beta = torch.minimum(p[:k], q).sum(-1)
            assert p.shape == (k + 1, V) and 2 <= k <= 3 and 5 <= V <= 8 and ((beta > 0.25) & (beta < 0.75)).all()
            shapes.add((k, V))
    assert len(shapes) >= 6


def test_acceptance_reference_passes(capsys):
    assert ch09.check_acceptance(sol9.accept)["drafts"]                     # fresh drafts
    result = ch09.check_acceptance(sol9.accept, seed=7)
    assert all(abs(d["acceptance"] - d["expected_acceptance"]) < 0.05 for d in result["drafts"])
    assert "correct (drafts drawn with seed=7)" in capsys.readouterr().out


def accept_everything(p, q, guess, g):
    return list(guess) + [int(torch.multinomial(p[len(guess)], 1, generator=g))]


def accept_nothing(p, q, guess, g):
    return [int(torch.multinomial(p[0], 1, generator=g))]


def calls_the_library(p, q, guess, g):
    return accept_sampled(p, q, guess, g)


def resamples_from_p(p, q, guess, g):
    for i, x in enumerate(guess):
        if torch.rand((), generator=g) >= p[i, x] / q[i, x]:
            return list(guess[:i]) + [int(torch.multinomial(p[i], 1, generator=g))]
    return list(guess) + [int(torch.multinomial(p[len(guess)], 1, generator=g))]


def inverted_ratio(p, q, guess, g):
    for i, x in enumerate(guess):
        if torch.rand((), generator=g) >= q[i, x] / p[i, x]:   # keeps x with probability min(1, q/p)
            residual = (p[i] - q[i]).clamp(min=0)
            return list(guess[:i]) + [int(torch.multinomial(residual / residual.sum(), 1, generator=g))]
    return list(guess) + [int(torch.multinomial(p[len(guess)], 1, generator=g))]


def forgets_the_bonus(p, q, guess, g):
    out = sol9.accept(p, q, guess, g)
    return out[:len(guess)]


def patches_the_oracle(p, q, guess, g):
    ch09._frequencies = lambda *args: 0.0
    return accept_everything(p, q, guess, g)


@pytest.mark.parametrize("wrong, message", [
    (accept_everything, "the first token emitted"),
    (accept_nothing, "your function never kept one"),
    (calls_the_library, "forbidden shortcut"),
    (resamples_from_p, "the first token emitted"),
    (inverted_ratio, "the first token emitted"),
    (forgets_the_bonus, "draw one more token from p_k"),
    (patches_the_oracle, "changed lab.exercises.ch09._frequencies"),
], ids=["accept-everything", "accept-nothing", "calls-accept_sampled", "resamples-from-p", "inverted-ratio",
        "forgets-the-bonus", "patches-the-oracle"])
def test_acceptance_wrong_answers_fail(wrong, message):
    with pytest.raises(AssertionError, match=message) as e:
        ch09.check_acceptance(wrong, seed=11)
    assert "seed=11" in str(e.value)
    assert ch09._frequencies.__name__ == "_frequencies"


# ---- exercise 2: roll a cache back ----------------------------------------------------------------------------

def test_the_greedy_oracle_is_clear_of_ties_and_is_speculative_decodings():
    n = 1 + sum(a + 1 for a in ch09.ACCEPTS) + ch09.K
    tokens, gap = ch09.greedy(n)
    assert gap > TINY_GAP                                       # no near tie: an inequality is a bug
    r = speculative_generate(ch09.tiny_model(), ch09.rollback_prompt(), n, PromptLookup(2), k=ch09.K)
    assert r.tokens == list(tokens)


def test_the_tolerance_lies_between_rounding_and_one_stale_position():
    """Through the reference's rollback, the logits after every step differ from recomputation by rounding only
    (a few 1e-7); a cache that still holds one rejected position (length right, one key and value too many) moves
    them by more than 100 x ATOL."""
    model = ch09.tiny_model()
    w, cfg, prompt = model.weights, model.config, ch09.rollback_prompt()
    want, K = list(ch09.greedy(12)[0]), ch09.K
    errors = {"rolled back": [], "one stale": []}
    for how in errors:
        cache = ch09.ListCache(cfg)
        with torch.inference_mode():
            forward_cached(torch.tensor([prompt[:-1]]), w, cfg, cache)
            for i in range(3):                                  # verify steps whose guesses are all rejected
                context, guess = prompt + want[:i], ch09.guesses(want[i:], 0, cfg.vocab_size)
                logits = forward_cached(torch.tensor([[context[-1]] + guess]), w, cfg, cache)[0]   # [K + 1, V]
                if i:
                    want_logits = forward(torch.tensor([context + guess]), w, cfg)[0, -(K + 1):]    # [K + 1, V]
                    errors[how].append(float((logits - want_logits).abs().max()))
                sol9.rollback(cache, len(context) + (how == "one stale"))
                cache.length = len(context)
    assert max(errors["rolled back"]) < ch09.ATOL / 10
    assert min(errors["one stale"]) > 100 * ch09.ATOL


def test_rollback_reference_passes(capsys):
    result = ch09.check_rollback(sol9.rollback)
    assert result["lengths"][-1] == ch09.PROMPT - ch09.DEEP
    assert result["tokens"] == list(ch09.greedy(len(result["tokens"]))[0])
    assert "correct" in capsys.readouterr().out


def test_a_list_cache_has_no_crop():
    cache = ch09.ListCache(ch09.tiny_model().config)
    with pytest.raises(ch09.CacheStateError, match="exercise 2"):
        cache.crop(0)


def does_nothing(cache, n):
    pass


def calls_crop(cache, n):
    cache.crop(n)


def keeps_one_too_many(cache, n):
    sol9.rollback(cache, n + 1)


def keeps_one_too_few(cache, n):
    sol9.rollback(cache, n - 1)


def sets_the_length_only(cache, n):
    cache.length = n


def forgets_the_length(cache, n):
    length = cache.length
    sol9.rollback(cache, n)
    cache.length = length


def drops_the_first_positions(cache, n):
    for chunks in cache.keys + cache.values:
        whole = torch.cat(chunks, 2)                           # [B, H_kv, T, D]
        chunks[:] = [whole[:, :, whole.shape[2] - n:]]
    cache.length = n


def cuts_the_last_chunk_only(cache, n):
    for chunks in cache.keys + cache.values:
        before = sum(c.shape[2] for c in chunks[:-1])
        chunks[-1] = chunks[-1][:, :, :max(n - before, 0)]
    cache.length = n


@pytest.mark.parametrize("wrong, message", [
    (does_nothing, r"length is \d+, not \d+ \(unchanged\)"),
    (calls_crop, "forbidden shortcut"),
    (keeps_one_too_many, r"length is \d+, not \d+ \(\+1\)"),
    (keeps_one_too_few, r"length is \d+, not \d+ \(-1\)"),
    (sets_the_length_only, "positions of keys"),
    (forgets_the_length, r"\(unchanged\)"),
    (drops_the_first_positions, "are not the ones it held"),
    (cuts_the_last_chunk_only, "rolling back 5 positions into the prompt"),
], ids=["does-nothing", "calls-crop", "one-too-many", "one-too-few", "sets-the-length-only", "forgets-the-length",
        "drops-the-first-positions", "cuts-the-last-chunk-only"])
def test_rollback_wrong_answers_fail(wrong, message):
    with pytest.raises(AssertionError, match=message):
        ch09.check_rollback(wrong)


# ---- exercise 3: acceptance of prompt lookup on copied text ----------------------------------------------------

@pytest.fixture
def book(tmp_path):
    """A results file holding a book value where the chapter's experiment writes it (ch09.BOOK_KEY)."""
    path = tmp_path / "results.json"
    k4 = {"acceptance": results.value(80.0, "%"), "per_step": results.value(3.0, "tokens")}
    results.write_section("ch09", {"acceptance": {"copy": {"lookup": {"k4": k4}}}}, results.provenance(mode="full"),
                          path=path)
    assert ch09.BOOK_KEY.format(k=4) == "ch09.acceptance.copy.lookup.k4.acceptance"
    return path


def test_the_copy_prompt_asks_for_the_passage_in_the_models_chat_turn(smollm2):
    tokenizer = smollm2.tokenizer
    prompt = tokenizer.decode(ch09.copy_prompt(tokenizer, 64))
    passage = tokenizer.decode(passages(tokenizer, 64, count=1)[0])
    assert passage in prompt and prompt.rstrip().endswith("assistant")      # the answer's turn is open


def tiny_copy(tokens):
    """What the tiny model (no chat template) gets instead: a passage, a blank line, its first half again."""
    tokenizer = ch09.tiny_model().tokenizer
    passage = passages(tokenizer, tokens, count=1)[0]
    return passage + tokenizer.encode("\n\n") + passage[:tokens // 2]


def test_measure_acceptance_measures(book, capsys):
    """On the tiny model (fast; its random weights seldom copy): the share it prints and sets beside the book's is
    speculative_generate's own on the same prompt."""
    model = ch09.tiny_model()
    ratio = ch09.measure_acceptance(new_tokens=12, model=model, prompt=tiny_copy(48), path=book)
    r = speculative_generate(model, tiny_copy(48), 12, PromptLookup(3), k=4)
    assert r.proposed and ratio == pytest.approx(100 * r.acceptance / 80.0)
    assert f"{r.accepted} of {r.proposed} guesses accepted" in capsys.readouterr().out


def test_measure_acceptance_on_smollm2_accepts_the_copy(smollm2, book, capsys):
    ratio = ch09.measure_acceptance(tokens=200, new_tokens=24, model=smollm2, path=book)
    assert ratio * 80.0 > 50                                     # most of the copied continuation is accepted
    assert "the book's: 80%" in capsys.readouterr().out
