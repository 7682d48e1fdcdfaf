"""lab.engine: the naive loop's position count, greedy decoding, timing fields, and backend input checks.

Oracles: hand-computed counts, a brute-force sum, and an argmax loop over `forward` written here.
"""

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.engine import Generation, RecomputeBackend, as_ids, generate, positions_cached, positions_uncached
from lab.models import InputError, forward, load


@pytest.fixture(scope="module")
def tiny_llama():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def tiny_mqa():
    return load("tiny-mqa")


def prompt(n, vocab_size=320, seed=0):
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


# ---- counting positions ---------------------------------------------------------------------------------

def test_naive_loop_counts_1040_positions(tiny_llama):
    backend = RecomputeBackend(tiny_llama)
    out = generate(backend, prompt(17), max_new_tokens=32)
    assert len(out.tokens) == 32
    # Hand-computed: sum_{s=0}^{31} (17 + s) = 32 * 17 + 32 * 31 / 2 = 544 + 496 = 1040.
    assert backend.positions == 1040 == positions_uncached(17, 32)
    assert backend.calls == 32
    assert positions_cached(17, 32) == 48  # 17 prompt positions once, then 31 single-token steps


@settings(max_examples=12, deadline=None)
@given(prompt_len=st.integers(1, 40), new_tokens=st.integers(1, 20))
def test_counted_positions_equal_positions_uncached(tiny_mqa, prompt_len, new_tokens):
    backend = RecomputeBackend(tiny_mqa)
    out = generate(backend, prompt(prompt_len, seed=prompt_len), max_new_tokens=new_tokens)
    assert len(out.tokens) == backend.calls == new_tokens
    assert backend.positions == positions_uncached(prompt_len, new_tokens)


def test_positions_formulas_against_brute_force():
    for P in range(0, 60):
        for n in range(1, 40):
            assert positions_uncached(P, n) == sum(P + s for s in range(n)), (P, n)
            assert positions_cached(P, n) == P + n - 1, (P, n)


def test_positions_uncached_is_quadratic():
    # Doubling the new tokens roughly quadruples the work once n >> P: n(n-1)/2 dominates.
    assert positions_uncached(0, 2000) / positions_uncached(0, 1000) == pytest.approx(4, rel=1e-3)


# ---- greedy generation ------------------------------------------------------------------------------------

def hand_greedy(model, ids, n):
    """Independent greedy loop: full uncached forward, argmax of the last row, append."""
    ids, out = list(ids), []
    for _ in range(n):
        logits = forward(torch.tensor([ids]), model.weights, model.config)  # [1, T, V]
        token = int(logits[0, -1].argmax())
        ids.append(token)
        out.append(token)
    return out


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-mqa"])
def test_greedy_generation_equals_hand_loop(name):
    model = load(name)
    p = prompt(10, seed=4)
    out = generate(RecomputeBackend(model), p, max_new_tokens=12)
    assert out.tokens == hand_greedy(model, p, 12)
    assert all(0 <= t < model.config.vocab_size for t in out.tokens)


def test_generate_accepts_a_tensor_prompt(tiny_llama):
    p = prompt(8, seed=5)
    a = generate(RecomputeBackend(tiny_llama), p, max_new_tokens=5).tokens
    b = generate(RecomputeBackend(tiny_llama), torch.tensor(p), max_new_tokens=5).tokens
    assert a == b


def test_generate_does_not_modify_the_prompt(tiny_llama):
    p = prompt(8, seed=6)
    kept = list(p)
    generate(RecomputeBackend(tiny_llama), p, max_new_tokens=4)
    assert p == kept


def test_stop_ids_stop_early(tiny_llama):
    p = prompt(9, seed=7)
    full = generate(RecomputeBackend(tiny_llama), p, max_new_tokens=20).tokens
    stop = full[4]
    first = full.index(stop)  # the first time the stop token appears (at or before index 4)
    backend = RecomputeBackend(tiny_llama)
    out = generate(backend, p, max_new_tokens=20, stop_ids={stop})
    assert out.tokens == full[: first + 1]  # the stop token is emitted, then nothing more
    assert backend.calls == first + 1
    assert len(out.step_seconds) == first + 1


@pytest.mark.parametrize("n", [0, -1])
def test_max_new_tokens_below_one_raises(tiny_llama, n):
    backend = RecomputeBackend(tiny_llama)
    with pytest.raises(ValueError, match="max_new_tokens"):
        generate(backend, prompt(5), max_new_tokens=n)
    assert backend.calls == 0


# ---- timing fields ----------------------------------------------------------------------------------------------

def test_ttft_and_tpot_by_hand():
    g = Generation(tokens=[1, 2, 3, 4], step_seconds=[0.5, 0.1, 0.2, 0.3])
    assert g.ttft == 0.5
    assert g.tpot == pytest.approx(0.2, rel=1e-12)  # (0.1 + 0.2 + 0.3) / 3, one float rounding
    assert math.isnan(Generation(tokens=[1], step_seconds=[0.4]).tpot)  # no decode step


def test_ttft_and_tpot_of_a_real_run(tiny_llama):
    out = generate(RecomputeBackend(tiny_llama), prompt(6), max_new_tokens=5)
    assert len(out.step_seconds) == len(out.tokens) == 5
    assert all(s > 0 for s in out.step_seconds)
    assert out.ttft == out.step_seconds[0]
    assert out.tpot == pytest.approx(sum(out.step_seconds[1:]) / 4, rel=1e-12)


# ---- backend input checks -------------------------------------------------------------------------------------------

BAD_IDS = {
    "empty_list": ([], "empty"),
    "nested_list": ([[1, 2], [3, 4]], "nested"),
    "float_tensor": (torch.tensor([1.0, 2.0]), "integers"),
    "batch_of_two": (torch.tensor([[1, 2, 3], [4, 5, 6]]), "batch of several"),
    "rank3_tensor": (torch.tensor([[[1, 2, 3]]]), r"shape \(1, 1, 3\)"),
    "id_out_of_vocabulary": ([1, 320], "vocabulary"),
    "negative_id": ([-1, 2], "vocabulary"),
    "float_list": ([1.0, 2.0], "integers"),
    "bool_tensor": (torch.tensor([True, False]), "integers"),
    "empty_tensor": (torch.zeros(0, dtype=torch.long), "empty"),
}


@pytest.mark.parametrize("case", list(BAD_IDS))
def test_backend_rejects_bad_ids_and_keeps_its_counters(tiny_llama, case):
    ids, word = BAD_IDS[case]
    backend = RecomputeBackend(tiny_llama)
    backend.next_logits([1, 2, 3])
    assert (backend.calls, backend.positions) == (1, 3)
    with pytest.raises(InputError, match=word):
        backend.next_logits(ids)
    assert (backend.calls, backend.positions) == (1, 3)


def test_backend_error_names_the_bad_id(tiny_llama):
    with pytest.raises(InputError, match=r"token id 320 .*0 \.\. 319"):
        RecomputeBackend(tiny_llama).next_logits([0, 320])


def test_as_ids_shapes_and_dtypes():
    for ids in ([3, 1, 4], (3, 1, 4), torch.tensor([3, 1, 4]), torch.tensor([3, 1, 4], dtype=torch.int32),
                [torch.tensor(3), 1, 4], torch.tensor([[3, 1, 4]]), [[3, 1, 4]]):  # [T], list, [1, T]
        t = as_ids(ids, 320)
        assert t.dtype == torch.int64
        assert t.tolist() == [[3, 1, 4]]


def test_backend_scores_equal_forward_last_row(tiny_llama):
    ids = prompt(11, seed=8)
    scores = RecomputeBackend(tiny_llama).next_logits(ids)
    full = forward(torch.tensor([ids]), tiny_llama.weights, tiny_llama.config)
    assert scores.shape == (320,)
    # fp32 defaults of assert_close: the same layers; only the head's matmul shape differs (last_only).
    torch.testing.assert_close(scores, full[0, -1])


def test_backend_counters_unchanged_when_forward_rejects_too_many_positions():
    backend = RecomputeBackend(load("tiny-gpt2"))  # learned position table of 512
    backend.next_logits([1, 2, 3])
    with pytest.raises(InputError, match="position"):
        backend.next_logits([1] * 513)
    assert (backend.calls, backend.positions) == (1, 3)
