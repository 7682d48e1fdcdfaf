"""Beam search on copy-on-write pages (lab/engine/beam.py): transformers' choices, and what the pages cost.

Oracles: transformers' own `generate(num_beams=...)` (SmolLM2 from the lab's folder, and the tiny model's
weights in transformers' Llama), and `recompute_beam_search` below, transformers' `_beam_search` transcribed
tensor for tensor with no cache at all (every step runs every beam's whole sequence through `forward`).

Tolerances. The sequences must be identical. The scores are sums of up to max_new_tokens float32 log-probs,
divided by n ** length_penalty; two implementations of the same forward sum in different orders (paged
decode attention and the C++ kernels here, SDPA and F.linear in transformers), so each log-prob differs by
a few 1e-6 on SmolLM2 and a score by at most 2.7e-5 measured (8 tokens, length_penalty -0.5, which
multiplies the sum by 8 ** 0.5), against gaps between neighbouring beams of 1e-3 and more: SCORE_ATOL =
1e-4. On the tiny random model (log-probs near -5.8, 2 layers) cached and uncached differ by under 1e-6:
TINY_ATOL = 1e-5.
"""

import math

import pytest
import torch

from lab.engine import beam
from lab.engine.beam import beam_search
from lab.models import InputError, PositionLimitError, forward, load

pytestmark = pytest.mark.usefixtures("one_thread")

SCORE_ATOL = 1e-4          # SmolLM2 against transformers: see the module docstring
TINY_ATOL = 1e-5           # the tiny model, cached against uncached
SMOLLM2_EOS = 2            # <|im_end|>: config.json's eos_token_id, which transformers' generation_config takes
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPT = list(range(10, 23))   # 13 tokens for the tiny model: its last page is partly filled for page_size > 1


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def hf_smollm2():
    from transformers import AutoModelForCausalLM

    from lab.models.load import smollm2_folder

    return AutoModelForCausalLM.from_pretrained(smollm2_folder(), dtype=torch.float32).eval()


def hf_beam_search(hf, ids, k, T, length_penalty, early_stopping, eos_id):
    """transformers' beam search -> (new tokens per hypothesis, best first; scores; loop iterations)."""
    out = hf.generate(torch.tensor([ids]), num_beams=k, do_sample=False, max_new_tokens=T,
                      length_penalty=length_penalty, early_stopping=early_stopping, num_return_sequences=k,
                      output_scores=True, return_dict_in_generate=True, eos_token_id=eos_id, pad_token_id=eos_id)
    lengths = (out.beam_indices >= 0).sum(1).tolist()          # each hypothesis' new tokens (the rest is padding)
    seqs = [out.sequences[i, len(ids):len(ids) + n].tolist() for i, n in enumerate(lengths)]
    return seqs, out.sequences_scores.tolist(), len(out.scores)


def recompute_beam_search(model, ids, k, T, length_penalty, early_stopping, eos_id):
    """transformers' `_beam_search` for one prompt (generation/utils.py, v5.23.0), transcribed tensor for tensor
    with its -1e9 masks, and no cache: each step runs every beam's whole sequence through `forward`."""
    P, NEG = len(ids), -1.0e9
    running = torch.tensor([ids] * k)                        # [k, P + t - 1]
    running_scores = torch.tensor([0.0] + [NEG] * (k - 1))   # the first step expands the first beam only
    kept, kept_scores = [None] * k, torch.full((k,), NEG)    # the finished hypotheses' slots
    kept_done = torch.zeros(k, dtype=torch.bool)
    for t in range(1, T + 1):
        logp = torch.log_softmax(forward(running, model.weights, model.config)[:, -1].float(), dim=-1)  # [k, V]
        V = logp.shape[-1]
        top, at = torch.topk((logp + running_scores[:, None]).flatten(), 2 * k)     # [2k]
        cand = torch.cat([running[at // V], (at % V)[:, None]], dim=1)              # [2k, P + t]
        ends = (at % V == (-1 if eos_id is None else eos_id)) | (t == T)           # stopping criteria
        alive = top + ends.float() * NEG
        nxt = torch.topk(alive, k).indices                     # _get_running_beams_for_next_iteration
        just = ends & (torch.arange(2 * k) < k)                # _update_finished_beams: the first k only
        merged = torch.cat([kept_scores, top / t ** length_penalty + (~just).float() * NEG])
        best = torch.topk(merged, k).indices
        kept = [(kept + [c[P:].tolist() for c in cand])[i] for i in best.tolist()]
        kept_scores, kept_done = merged[best], torch.cat([kept_done, just])[best]
        running, running_scores = cand[nxt], alive[nxt]
        n = T if early_stopping == "never" and length_penalty > 0 else t   # _check_early_stop_heuristic
        improvable = not kept_done.all() or bool(running_scores[0] / n ** length_penalty > kept_scores.min())
        if t == T or not improvable or kept_done.all() and early_stopping is True:
            break
    return kept, kept_scores.tolist()


# ---- the same sequences and scores as transformers ----

@pytest.mark.parametrize("text, k, length_penalty, early_stopping", [
    pytest.param("The capital of France is", 2, 1.0, False, id="france"),
    pytest.param("def fibonacci(n):", 4, 2.0, True, id="code"),
    pytest.param("Once upon a time", 4, -0.5, False, id="story"),
    pytest.param(CHAT.format("Is the sky blue? Answer yes or no."), 2, 1.0, False, id="sky-stops-early"),
    pytest.param(CHAT.format("Is the sky blue? Answer yes or no."), 2, 1.0, "never", id="sky-never"),
    pytest.param(CHAT.format("What is 2+2? Answer with a number only."), 4, -0.5, True, id="sum-eos"),
])
def test_smollm2_matches_transformers(smollm2, hf_smollm2, text, k, length_penalty, early_stopping):
    ids = smollm2.tokenizer.encode(text)
    want, want_scores, iterations = hf_beam_search(hf_smollm2, ids, k, 8, length_penalty, early_stopping,
                                                   SMOLLM2_EOS)
    got = beam_search(smollm2, ids, k, 8, length_penalty, early_stopping, eos_id=SMOLLM2_EOS)
    assert got.sequences == want
    assert got.scores == pytest.approx(want_scores, abs=SCORE_ATOL)
    assert len(got.stats["forks"]) + 1 == iterations         # it stopped at the same step


@pytest.mark.parametrize("k, eos_id, length_penalty, early_stopping", [
    (3, 8, 1.0, True),               # every slot filled: stops at once
    (4, 88, 1.0, False),             # stops early: the best running beam cannot beat the worst hypothesis
    (4, 88, 1.0, "never"),           # one step more: judged at max_new_tokens' length
    (3, 8, 2.0, False), (4, 236, -1.0, False), (2, 13, 0.0, True)])
def test_tiny_matches_transformers(tiny, k, eos_id, length_penalty, early_stopping):
    """eos inside the search, and every way of stopping, against the library itself on the same weights."""
    from lab.models.hf import to_transformers

    want, want_scores, iterations = hf_beam_search(to_transformers(tiny), PROMPT, k, 10, length_penalty,
                                                   early_stopping, eos_id)
    got = beam_search(tiny, PROMPT, k, 10, length_penalty, early_stopping, eos_id, page_size=4)
    assert got.sequences == want
    assert got.scores == pytest.approx(want_scores, abs=TINY_ATOL)
    assert len(got.stats["forks"]) + 1 == iterations


@pytest.mark.parametrize("page_size", [1, 2, 4, 16])
@pytest.mark.parametrize("k, eos_id, length_penalty, early_stopping, T", [
    (3, 8, 1.0, True, 10),           # stops early: every slot holds a hypothesis ending in eos
    (4, 236, -1.0, False, 10),       # a short hypothesis wins under a negative penalty
    (4, 88, 1.0, "never", 10),      # runs one step past where early_stopping=False stops
    (4, None, 1.0, False, 12),       # no eos: every hypothesis has max_new_tokens tokens
])
def test_tiny_matches_recomputation(tiny, page_size, k, eos_id, length_penalty, early_stopping, T):
    want, want_scores = recompute_beam_search(tiny, PROMPT, k, T, length_penalty, early_stopping, eos_id)
    got = beam_search(tiny, PROMPT, k, T, length_penalty, early_stopping, eos_id, page_size=page_size)
    assert got.sequences == want
    assert got.scores == pytest.approx(want_scores, abs=TINY_ATOL)
    assert eos_id is None or any(s[-1] == eos_id for s in got.sequences)   # the eos case was exercised


# ---- pages: only a shared, partly filled last page is copied, and every page comes back ----

@pytest.mark.parametrize("prompt_len, page_size", [(13, 1), (13, 2), (13, 4), (16, 4), (13, 16), (16, 16)])
def test_only_shared_partial_pages_are_copied(tiny, monkeypatch, prompt_len, page_size):
    pools = []

    class RecordingPool(beam.PagePool):
        @classmethod
        def for_model(cls, *args, **kwargs):
            pools.append(super().for_model(*args, **kwargs))
            return pools[-1]

    monkeypatch.setattr(beam, "PagePool", RecordingPool)
    k, T, P = 4, 12, prompt_len
    stats = beam_search(tiny, list(range(10, 10 + P)), k, T, page_size=page_size).stats
    (pool,) = pools
    layers, H, D = tiny.config.kv_layout
    position_bytes = 2 * layers * H * D * 4                    # keys and values, float32
    assert len(stats["forks"]) == T - 1                        # no eos: every step ran
    for i, (forks, copied) in enumerate(zip(stats["forks"], stats["copied_pages"], strict=True)):
        length = P + i                                         # positions held before this step's token
        # each fork shares its source's pages; the first write to a partly filled shared last page copies
        # it once per fork, and a full page (length a multiple of page_size) is never copied
        assert copied == (forks if length % page_size else 0)
        assert stats["copied_bytes"][i] == copied * page_size * position_bytes
        assert stats["index_select_bytes"][i] == k * length * position_bytes
        pages = -(-(length + 1) // page_size)                  # one beam's pages after this step's token
        assert pages <= stats["held_pages"][i] <= k * pages
    assert (sum(stats["copied_pages"]) == 0) == (page_size == 1)
    assert sum(stats["copied_bytes"]) < sum(stats["index_select_bytes"])
    assert pool.manager.num_free == pool.manager.num_pages     # every page came back
    assert pool.held_pages() == {"full": 0}


def test_prompt_is_prefilled_once_and_forked(tiny, monkeypatch):
    """One sequence holds the prompt; the beams are its forks: the first step's k - 1 forks copy at most
    its partly filled last page, never the prompt's full pages."""
    reserved = []
    real = beam.PagePool.reserve
    monkeypatch.setattr(beam.PagePool, "reserve", lambda self, parts: reserved.append(list(parts)) or real(self, parts))
    stats = beam_search(tiny, PROMPT, 4, 3, page_size=4).stats
    assert reserved[0] == [(0, len(PROMPT))]                   # the prefill: one sequence
    assert all(n == 1 for parts in reserved[1:] for _, n in parts)   # then decodes only
    assert stats["forks"][0] == 3 and stats["copied_pages"][0] == 3  # 13 % 4: the last page is partial


# ---- typed errors, before anything is built ----

@pytest.mark.parametrize("kwargs, error", [
    (dict(num_beams=0), InputError), (dict(num_beams=True), InputError), (dict(num_beams=2.0), InputError),
    (dict(num_beams="2"), InputError), (dict(num_beams=161), InputError),   # 2 * 161 candidates > 320 tokens
    (dict(max_new_tokens=0), InputError), (dict(max_new_tokens=True), InputError),
    (dict(max_new_tokens=1.5), InputError),
    (dict(length_penalty="1"), InputError), (dict(length_penalty=True), InputError),
    (dict(length_penalty=math.nan), InputError), (dict(length_penalty=math.inf), InputError),
    (dict(length_penalty=None), InputError),
    (dict(early_stopping="always"), InputError), (dict(early_stopping=1), InputError),
    (dict(early_stopping=None), InputError),
    (dict(eos_id=320), InputError), (dict(eos_id=-1), InputError), (dict(eos_id=True), InputError),
    (dict(eos_id=2.0), InputError),
    (dict(ids=[]), InputError), (dict(ids="abc"), InputError), (dict(ids=[[1, 2], [3, 4]]), InputError),
    (dict(ids=[1.5]), InputError), (dict(ids=[320]), InputError), (dict(ids=torch.ones(2, 3, dtype=torch.long)),
                                                                   InputError),
    (dict(ids=list(range(10)) * 204), PositionLimitError),   # 2,040 prompt tokens + 12 new > 2,048 positions
    (dict(page_size=0), InputError), (dict(page_size=True), InputError),
    (dict(num_pages=0), InputError), (dict(num_pages=3), InputError),   # 4 beams of 24 positions: 24 pages
])
def test_bad_input_raises_typed_error(tiny, monkeypatch, kwargs, error):
    def no_pool(*args, **kwargs):
        raise AssertionError("a pool was built before the arguments were checked")

    monkeypatch.setattr(beam.PagePool, "for_model", no_pool)
    args = dict(ids=PROMPT, num_beams=4, max_new_tokens=12, page_size=4) | kwargs
    with pytest.raises(error) as info:
        beam_search(tiny, **args)
    assert isinstance(info.value, ValueError)
