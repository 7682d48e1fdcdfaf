"""transformers' QuantizedCache run teacher-forced on the lab's models (lab/peers/hf_quantized.py).

The tiny model checks the plumbing and the byte count by hand; SmolLM2 checks that the float run is the
lab's plain forward and that the quantized runs cost what they should. Every run is on one thread: on a
busy 2-core machine a SmolLM2 decode step took 0.06 s on one thread and 0.3 to 0.55 s on two.
"""

import pytest
import torch

from lab import data
from lab.cache import QuantizedCache as LabQuantizedCache
from lab.metrics import compare
from lab.models import forward, load
from lab.models.hf import to_transformers
from lab.peers import hf_quantized as hq

pytestmark = pytest.mark.usefixtures("one_thread")

# quanto compiles its C++ unpacking at its first use in an environment (24-34 s, measured; cached in its package
# folder after that), so the tests that quantize with quanto run in `make test-slow`, keeping it out of `make test`
QUANTO = pytest.mark.slow


# ---- the tiny model: 2 layers, 2 KV heads of 16 channels ---------------------------------------------------

@pytest.fixture(scope="module")
def tiny():
    model = load("tiny-llama")
    ids = torch.randint(0, model.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(0))
    return model, to_transformers(model), ids                                     # ids [2, 24]


def test_dynamic_cache_matches_the_plain_forward_tiny(tiny):
    model, hf, ids = tiny
    got = hq.teacher_forced(hf, ids, 7, hq.make_cache(hf, "dynamic"))
    ref = forward(ids, model.weights, model.config)[:, 6:]                        # [2, 18, V]
    assert got.shape == ref.shape == (2, 18, model.config.vocab_size) and got.dtype == torch.float32
    assert (got - ref).abs().max().item() < 1e-5   # the tiny models' float32 parity bound (test_models.py)


@QUANTO
def test_quality_compares_each_cache_with_the_labs_oracle_tiny(tiny):
    """hf_quantized.quality against lab.metrics.reference (the lab's plain forward): the float DynamicCache
    is the oracle up to float32 rounding (KL < 1e-9 nats, the float cache's bound in test_ch07.py), and
    4-bit quanto moves the distributions; every case keeps its settings and the bytes it stored."""
    from lab.metrics import reference

    model, hf, ids = tiny
    ref = reference(model, ids, 7)
    cases = {"float": dict(backend="dynamic"),
             "quanto_4": dict(backend="quanto", nbits=4, q_group_size=16, residual_length=8)}
    r = hq.quality(model, ids, 7, ref, cases)
    assert r["float"]["kl"] < 1e-9 and r["float"]["top1"] == 1.0 and r["float"]["positions"] == 2 * 17
    assert r["quanto_4"]["kl"] > 1e-6 and r["quanto_4"]["settings"] == cases["quanto_4"]
    assert r["quanto_4"]["nbytes"] < r["float"]["nbytes"] and (r["float"]["length"], r["float"]["batch"]) == (24, 2)


@QUANTO
def test_stored_bytes_counted_by_hand_tiny(tiny):
    """4-bit quanto, groups of 16 (one token of one head), residual 8: a prefill of 12 quantized at once,
    then 5 steps left in the float residual."""
    model, hf, ids = tiny
    cache = hq.make_cache(hf, "quanto", nbits=4, q_group_size=16, residual_length=8)
    hq.teacher_forced(hf, ids[:, :17], 12, cache)
    L, B, H, D = 2, 2, 2, 16
    per_tensor = dict(codes=B * H * 12 * D // 2,                 # 4-bit codes, two to a byte
                      scales=B * H * 12 * 4,                     # one float32 scale per group
                      zero_points=B * H * 12 * 4,                # and one float32 shift
                      float=B * H * 5 * D * 4)                   # the residual, float32
    assert hq.held(cache) == {part: 2 * L * n for part, n in per_tensor.items()}  # K and V, every layer
    assert hq.stored_bytes(cache) == 2 * L * sum(per_tensor.values()) == 8192
    assert hq.compressed_positions(cache) == 12
    assert hq.bytes_per_position(cache) == 2 * L * B * H * (D // 2 + 8) == 256


@QUANTO
def test_bytes_per_position_equals_the_labs_per_token_4_bit_with_zero_points(tiny):
    """A group of head_dim channels is the lab's per_token scheme with zero points and float32 scales:
    the same codes, scales and zero points per position."""
    model, hf, ids = tiny
    cache = hq.make_cache(hf, "quanto", nbits=4, q_group_size=16, residual_length=8)
    hq.teacher_forced(hf, ids, 12, cache)
    lab = LabQuantizedCache(model.config, bits=4, scheme="per_token", batch_size=2, zero_point=True,
                            value_group_size=16)
    assert hq.bytes_per_position(cache) == lab.bytes_per_position()


def test_fp8_holds_one_byte_per_value_and_two_scalar_scales_tiny(tiny):
    model, hf, ids = tiny
    cache = hq.make_cache(hf, "fp8")
    hq.teacher_forced(hf, ids, 7, cache)
    L, B, H, T, D = 2, 2, 2, 24, 16
    assert hq.held(cache) == dict(codes=2 * L * B * H * T * D, scales=2 * L * 4, zero_points=0, float=0)


@QUANTO
@pytest.mark.parametrize("residual, kept", [(8, 17 % 8), (5, 17 % 5), (0, 0)])
def test_residual_holds_the_steps_since_the_last_flush_tiny(tiny, residual, kept):
    """The residual flushes when it would reach residual_length: after 17 decode steps it holds 17 mod R
    positions (none at R = 0, which re-quantizes every step)."""
    model, hf, ids = tiny
    cache = hq.make_cache(hf, "quanto", nbits=2, q_group_size=16, residual_length=residual)
    hq.teacher_forced(hf, ids, 7, cache)
    assert [layer.keys.shape[-2] if layer.keys.dim() == 4 else 0 for layer in cache.layers] == [kept] * 2
    assert hq.compressed_positions(cache) == 24 - kept and cache.get_seq_length() == 24


@QUANTO
def test_a_used_cache_is_refused_and_a_new_one_reproduces_the_run_tiny(tiny):
    model, hf, ids = tiny
    cache = hq.make_cache(hf, "quanto", nbits=4, q_group_size=16, residual_length=4)
    first = hq.teacher_forced(hf, ids, 7, cache)
    with pytest.raises(ValueError, match="already holds 24 positions"):
        hq.teacher_forced(hf, ids, 7, cache)
    again = hq.teacher_forced(hf, ids, 7, hq.make_cache(hf, "quanto", nbits=4, q_group_size=16, residual_length=4))
    assert torch.equal(first, again)


def test_bad_arguments_are_refused(tiny):
    _, hf, ids = tiny
    with pytest.raises(ValueError, match="backend must be one of"):
        hq.make_cache(hf, "hqq4")
    with pytest.raises(ValueError, match="takes no settings"):
        hq.make_cache(hf, "dynamic", nbits=4)
    with pytest.raises(ValueError, match="prefill must be in 1..24"):
        hq.teacher_forced(hf, ids, 0, hq.make_cache(hf, "dynamic"))
    with pytest.raises(ValueError, match=r"must be \[B, T\]"):
        hq.teacher_forced(hf, ids[0], 7, hq.make_cache(hf, "dynamic"))


# ---- SmolLM2: one held-out passage of 80 tokens, a prefill of 32, 48 decode steps ---------------------------

PREFILL = 32


@pytest.fixture(scope="module")
def smollm2_runs(smollm2):
    """{name: (logits [1, 49, V], cache)} for the float cache and three quantized ones, and the plain
    forward's logits at the same positions. Residual 16: the decode steps go through three flushes."""
    hf = to_transformers(smollm2)
    ids = torch.tensor(data.passages(smollm2.tokenizer, 80, 1))                   # [1, 80]
    with torch.inference_mode():
        ref = forward(ids, smollm2.weights, smollm2.config)[:, PREFILL - 1:]       # [1, 49, V]
    cases = dict(float=dict(backend="dynamic"), quanto_4=dict(backend="quanto", nbits=4, residual_length=16),
                 quanto_2=dict(backend="quanto", nbits=2, residual_length=16), fp8=dict(backend="fp8"))
    runs = {}
    for name, kw in cases.items():
        cache = hq.make_cache(hf, **kw)
        runs[name] = hq.teacher_forced(hf, ids, PREFILL, cache), cache
    return runs, ref, ids


def kl(runs, ref, ids, name):
    return compare(runs[name][0], ref, ids[:, PREFILL:])["kl"]


@pytest.mark.slow   # the three SmolLM2 runs share a 13 s fixture
def test_dynamic_cache_matches_the_plain_forward_smollm2(smollm2_runs):
    runs, ref, _ = smollm2_runs
    # Same bound and reason as the lab's SmolLM2 parity test (test_models.py): 30 layers of float32 dot
    # products, ~1e-7 relative per op, so 1e-4 of the largest |logit| (28.6 here: 2.9e-3). Measured
    # 7.1e-5, a 40th of the bound; a wrong position or mask moves logits by whole units.
    assert (runs["float"][0] - ref).abs().max().item() < 1e-4 * ref.abs().max().item()


@pytest.mark.slow   # the three SmolLM2 runs share a 13 s fixture
def test_quantized_kl_is_small_at_4_bits_and_much_larger_at_2_smollm2(smollm2_runs):
    runs, ref, ids = smollm2_runs
    kl4, kl2, kl8 = (kl(runs, ref, ids, name) for name in ("quanto_4", "quanto_2", "fp8"))
    # Measured on this passage (one thread, deterministic): 4-bit 0.027 nats, 2-bit 1.41, fp8 0.011;
    # on two 512-token passages the 4-bit settings gave 0.006 to 0.06. Bounds: about 4x the measurement.
    assert 0 < kl4 < 0.1
    assert 0 < kl8 < 0.05
    assert kl2 > 10 * kl4            # measured 53x: a 2-bit grid has 4 levels where 4 bits have 16
    assert kl(runs, ref, ids, "float") < 1e-9                                    # rounding only: 1.6e-11


@pytest.mark.slow   # the three SmolLM2 runs share a 13 s fixture
def test_stored_bytes_below_the_float_cache_and_counted_by_hand_smollm2(smollm2_runs):
    runs, _, _ = smollm2_runs
    L, H, T, D = 30, 3, 80, 64                                   # SmolLM2: 30 layers, 3 KV heads of 64
    stored = {name: hq.stored_bytes(cache) for name, (_, cache) in runs.items()}
    assert stored["float"] == 2 * L * H * T * D * 4              # float32 keys and values
    # 48 steps with residual 16 end on a flush: everything quantized, one 64-channel group per head-token
    assert stored["quanto_4"] == 2 * L * H * T * (D // 2 + 4 + 4)
    assert stored["quanto_2"] == 2 * L * H * T * (D // 4 + 4 + 4)
    assert stored["fp8"] == 2 * L * (H * T * D + 4)
    assert stored["quanto_2"] < stored["quanto_4"] < stored["fp8"] < stored["float"]
