"""QuantizedCache (lab/cache/quantized.py) and its quantizers (lab/cache/quant.py), against independent oracles.

Oracles: scales computed here in float64 from the float keys and values, straight from the definitions
(absmax / (2^(b-1) - 1); (max - min) / (2^b - 1)); bytes counted by hand; ConcatCache (the same keys and
values, unquantized), with autograd's gradients of its logits for the first-order bounds; SDPA over the
cache's own dequantized keys and values; a fresh cache that never held what was dropped, or that never
forked; clones taken before an operation (for "unchanged", compared bit for bit).

Sections: (1) round trip, (2) packing, (3) logits against ConcatCache, (4) folded scales, (5) bytes,
(6) crop, reset, fork, advance, (7) bad input, (8) the residual window.

Tolerances. Rounding to the nearest of a grid of step s errs by at most s/2; the stored scale may sit one
float step above the ideal one (it is rounded up so no code clips), and dequantizing c * s + z rounds once
more, so an element may exceed s/2 by a few float32 ulps of the values involved: we allow
s/2 x (1 + 1e-6) + 1e-6 x the largest |x| of the layer. Folded-scale attention and SDPA over the
dequantized cache add the same terms in other orders: 1e-5 absolute on outputs of order 1 (fp32 rounds
~1e-7 relative per op). The logit bounds are derived in the docstring of their test.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.cache import CacheError, CacheInputError, CacheStateError, ConcatCache, KVCache, cache_bytes
from lab.cache.quant import pack, quantize_asymmetric, quantize_symmetric, unpack
from lab.cache.quantized import QuantizedCache
from lab.models import ModelConfig, forward_cached, load

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

TINY = load("tiny-llama")   # 2 layers, 4 query heads sharing 2 kv heads of 16 channels
SMOL_CONFIG = ModelConfig(arch="llama", vocab_size=49152, n_layers=30, d_model=576, n_heads=9, n_kv_heads=3,
                          head_dim=64, d_ff=1536)  # SmolLM2-135M's shape, for byte counts without the weights

# Small groups and windows, so that a few positions fill groups, leave the window and reach the prefix.
CONFIGS = {
    "per_token-8": dict(bits=8),
    "per_token-4": dict(bits=4),
    "per_token-8-zero_point": dict(bits=8, zero_point=True),
    "per_token-4-smooth": dict(bits=4, smooth=True),
    "per_token-8-smooth-residual": dict(bits=8, smooth=True, residual=3),
    "kivi-8": dict(scheme="kivi", bits=8, group_size=4, residual=3),
    "kivi-4": dict(scheme="kivi", bits=4, group_size=4, residual=0),
    "kivi-2": dict(scheme="kivi", bits=2, group_size=3, residual=2),
    "kivi-4-value_groups": dict(scheme="kivi", bits=4, group_size=4, residual=1, value_group_size=8),
    "kivi-2-symmetric": dict(scheme="kivi", bits=2, group_size=4, residual=0, zero_point=False),
}
CONFIG_IDS = list(CONFIGS)


def make(name, config=TINY.config, **kw):
    return QuantizedCache(config, **{**CONFIGS[name], **kw})


def random_kv(seed, shape, outliers=0, outlier_scale=1.0, dtype=torch.float32):
    """Keys-like tensors `[B, H, T, D]`: N(0, 1), with `outliers` channels scaled and shifted to one sign,
    as RoPE'd keys have."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if outliers:
        channels = torch.randperm(shape[-1], generator=g)[:outliers]
        x[..., channels] = x[..., channels] * outlier_scale + 2 * outlier_scale
    return x.to(dtype)


def write_step(cache, ks, vs):
    """One step of the protocol by hand: every layer stores its k, v `[B, H, T, D]`, then advance."""
    for i, (k, v) in enumerate(zip(ks, vs, strict=True)):
        cache.update(i, k, v)
    cache.advance(ks[0].shape[2])


def random_step(cache, T, seed, outliers=2, outlier_scale=20.0):
    shape = (cache.batch_size, cache.n_kv_heads, T, cache.head_dim)
    ks = [random_kv(seed + 100 * i, shape, outliers, outlier_scale, cache.dtype) for i in range(cache.n_layers)]
    vs = [random_kv(seed + 100 * i + 1, shape, 0, 1.0, cache.dtype) for i in range(cache.n_layers)]
    write_step(cache, ks, vs)
    return ks, vs


def snapshot(cache):
    """Everything observable: lengths, pending counts, prefix length, and clones of every stored tensor."""
    tensors = [None if t is None else t.clone() for name in QuantizedCache.STATE for t in getattr(cache, name)]
    return (cache.seq_lengths(), list(cache.pending), cache.quantized), tensors


def assert_unchanged(cache, before):
    state, tensors = snapshot(cache)
    assert state == before[0], f"(lengths, pending, quantized) {state} != {before[0]}"
    for i, (now, then) in enumerate(zip(tensors, before[1], strict=True)):
        assert (now is None) == (then is None), f"stored tensor {i} appeared or disappeared"
        assert now is None or (now.dtype == then.dtype and torch.equal(now, then)), f"stored tensor {i} changed"


# ---- the oracle's scales: straight from the definitions, in float64 ---------------------------------------

def ideal_steps(x, bits, zero_point, dim):
    """The grid step of each element of x (float64), its set reduced over `dim`."""
    x = x.double()
    if zero_point:
        return ((x.amax(dim, keepdim=True) - x.amin(dim, keepdim=True)) / (2 ** bits - 1)).expand_as(x)
    return (x.abs().amax(dim, keepdim=True) / (2 ** (bits - 1) - 1)).expand_as(x)


def ideal_key_steps(cache, k, first):
    """Steps of the keys k `[B, H, Q, D]` as `cache` should quantize them; `first` the keys of its first step
    (the smoothing mean)."""
    B, H, Q, D = k.shape
    if cache.scheme == "per_token":
        x = k.double() - (first.double().mean(2, keepdim=True) if cache.smooth else 0)
        return ideal_steps(x, cache.bits, cache.zero_point, -1)
    G = cache.group_size
    return ideal_steps(k.view(B, H, Q // G, G, D), cache.bits, cache.zero_point, 3).reshape(B, H, Q, D)


def ideal_value_steps(cache, v):
    B, H, Q, D = v.shape
    groups = v.reshape(B, H, Q, D // cache.value_group, cache.value_group)
    return ideal_steps(groups, cache.bits, cache.zero_point, -1).reshape(B, H, Q, D)


def assert_within_half_a_step(got, want, step, what):
    """|got - want| <= step/2 (1 + 1e-6) + 1e-6 max|want|: the module docstring's round-trip tolerance."""
    err = (got.double() - want.double()).abs()
    bound = step / 2 * (1 + 1e-6) + 1e-6 * want.double().abs().max()
    worst = (err - bound).max().item()
    assert worst <= 0, f"{what}: an element errs {worst:.3g} beyond half a grid step"


# ---- (1) round trip: every element within half a grid step ---------------------------------------------

@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2 ** 16), rows=st.integers(1, 12), cols=st.sampled_from([4, 8, 16, 64]),
       outliers=st.integers(0, 3), outlier_scale=st.sampled_from([1.0, 10.0, 300.0]),
       magnitude=st.sampled_from([1e-3, 1.0, 1e3]), bits=st.sampled_from([8, 4, 2]), zero_point=st.booleans(),
       dim=st.sampled_from([0, 1]), scale_dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float64]))
def test_quantize_round_trip_is_within_half_a_step(seed, rows, cols, outliers, outlier_scale, magnitude, bits,
                                                   zero_point, dim, scale_dtype):
    x = random_kv(seed, (rows, cols), min(outliers, cols), outlier_scale) * magnitude   # [rows, cols] float32
    if zero_point:
        codes, scale, zero = quantize_asymmetric(x, bits, dim, scale_dtype)
        got = codes.double() * scale.double() + zero.double()
        assert int(codes.max()) <= 2 ** bits - 1
    else:
        codes, scale = quantize_symmetric(x, bits, dim, scale_dtype)
        got = (codes.double() - 2 ** (bits - 1)) * scale.double()
        assert 1 <= int(codes.min()) and int(codes.max()) <= 2 ** bits - 1   # -qmax .. qmax, offset
    assert codes.dtype == torch.uint8 and codes.shape == x.shape and scale.dtype == scale_dtype
    # the stored scale is the ideal step, rounded up by at most one step of its dtype (2^-7 for bfloat16); the
    # asymmetric step spans [zero, max], the zero point rounded down from the minimum by at most as much
    eps, x64 = torch.finfo(scale_dtype).eps, x.double()
    if zero_point:
        low = x64.amin(dim, keepdim=True)
        z = zero.double()
        assert (z <= low).all() and (z >= low - eps * low.abs()).all()
        step = ((x64.amax(dim, keepdim=True) - z) / (2 ** bits - 1)).expand_as(x)
    else:
        step = ideal_steps(x, bits, zero_point, dim)
    stored = scale.double().expand_as(x)
    assert (stored >= step * (1 - 1e-6)).all() and (stored <= step * (1 + eps) * (1 + 1e-6)).all()
    assert_within_half_a_step(got, x, stored, f"{bits}-bit {'asymmetric' if zero_point else 'symmetric'}")


@pytest.mark.parametrize("zero_point", [False, True], ids=["symmetric", "asymmetric"])
def test_a_set_of_zeros_or_a_constant_is_exact(zero_point):
    x = torch.tensor([[0.0, 0.0, 0.0, 0.0], [3.5, 3.5, 3.5, 3.5]])
    for bits in (8, 4, 2):
        if zero_point:
            codes, scale, zero = quantize_asymmetric(x, bits, -1, torch.float32)
            assert torch.equal(codes * scale + zero, x)
        else:
            codes, scale = quantize_symmetric(x[:1], bits, -1, torch.float32)
            assert torch.equal((codes.float() - 2 ** (bits - 1)) * scale, x[:1])


@settings(max_examples=25, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("name", CONFIG_IDS)
def test_cache_keeps_every_position_within_half_a_step(name, data):
    """Through the cache: the quantized prefix within half a step of the ideal grid, the tail exact."""
    steps = data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=4), label="step lengths")
    seed = data.draw(st.integers(0, 2 ** 16), label="seed")
    outlier_scale = data.draw(st.sampled_from([1.0, 20.0, 200.0]), label="outlier scale")
    cache = make(name, batch_size=2)
    written = [random_step(cache, T, seed + 7 * j, outlier_scale=outlier_scale) for j, T in enumerate(steps)]
    n, G, R = sum(steps), cache.group, cache.residual
    assert cache.length == n and cache.quantized == max(0, (n - R) // G * G)
    Q = cache.quantized
    for i in range(cache.n_layers):
        k0 = torch.cat([ks[i] for ks, _ in written], dim=2)         # [2, 2, n, 16], as written
        v0 = torch.cat([vs[i] for _, vs in written], dim=2)
        k, v = cache._read(i)
        assert k.shape == k0.shape and k.dtype == k0.dtype
        assert torch.equal(k[:, :, Q:], k0[:, :, Q:]) and torch.equal(v[:, :, Q:], v0[:, :, Q:]), "tail not exact"
        if Q:
            first = written[0][0][i]
            assert_within_half_a_step(k[:, :, :Q], k0[:, :, :Q], ideal_key_steps(cache, k0[:, :, :Q], first),
                                      f"keys of layer {i}")
            assert_within_half_a_step(v[:, :, :Q], v0[:, :, :Q], ideal_value_steps(cache, v0[:, :, :Q]),
                                      f"values of layer {i}")


# ---- (2) packing ------------------------------------------------------------------------------------------

@settings(max_examples=50, deadline=None)
@given(bits=st.sampled_from([8, 4, 2]), rows=st.integers(1, 5), runs=st.integers(1, 9), seed=st.integers(0, 999))
def test_pack_round_trip_is_exact(bits, rows, runs, seed):
    n = runs * 8 // bits
    codes = torch.randint(0, 2 ** bits, (rows, n), generator=torch.Generator().manual_seed(seed), dtype=torch.uint8)
    packed = pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape == (rows, n * bits // 8)
    assert torch.equal(unpack(packed, bits), codes)


def test_pack_layout_by_hand():
    # element j of each run sits in bits j*b .. j*b + b - 1: 4 bits [0x1, 0x2] -> 0x21; 2 bits [1, 2, 3, 0] ->
    # 0b00_11_10_01 = 0x39
    assert pack(torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8), 4).tolist() == [[0x21, 0x0F]]
    assert pack(torch.tensor([[1, 2, 3, 0]], dtype=torch.uint8), 2).tolist() == [[0x39]]


# ---- (3) logits through forward_cached against ConcatCache ----------------------------------------------

def per_token_steps(x, bits, mean=None):  # symmetric, one step per token per head, float64
    return ideal_steps(x.double() - (0 if mean is None else mean), bits, False, -1)


def reference(model, ids, prefill, top=3):
    """A prefill, then one decode step, through ConcatCache: the prefill's logits `[1, prefill, V]`, the decode
    step's logits `[V]`, and for each of its `top` largest logits l the gradient dl/dx with respect to every
    stored key and value x (keys of each layer, then values), by autograd through the same forward."""
    with torch.inference_mode():
        base = ConcatCache(model.config)
        prefill_logits = forward_cached(ids[:, :prefill], model.weights, model.config, base)
    keys = [k.clone().requires_grad_() for k in base.keys]     # each [1, H_kv, prefill, D]
    values = [v.clone().requires_grad_() for v in base.values]
    cache = ConcatCache(model.config)
    cache.keys, cache.values, cache.length = list(keys), list(values), prefill
    logits = forward_cached(ids[:, prefill:prefill + 1], model.weights, model.config, cache)[0, -1]
    grads = {tok: torch.autograd.grad(logits[tok], keys + values, retain_graph=True)
             for tok in logits.topk(top).indices.tolist()}
    return prefill_logits, logits.detach(), grads, (base.keys, base.values)


def check_logits_against_concat(model, ids, prefill, ref, name, kw, key_steps, value_steps):
    """The quantized cache's decode logits within the first-order bounds (the tiny model's test docstring):
    worst = sum |dl/dx| step/2 (all signs aligned) and sigma = sqrt(sum (dl/dx)^2 step^2 / 12) (independent
    errors, uniform on [-step/2, step/2])."""
    want_prefill, want, grads, (keys, values) = ref
    steps = [key_steps(k) for k in keys] + [value_steps(v) for v in values]
    with torch.inference_mode():
        cache = QuantizedCache(model.config, scale_dtype=torch.float64, **kw)
        got_prefill = forward_cached(ids[:, :prefill], model.weights, model.config, cache)
        assert torch.equal(got_prefill, want_prefill), "a prefill attends to its own positions in float"
        assert cache.quantized > 0, "the test must reach the quantized prefix"
        got = forward_cached(ids[:, prefill:prefill + 1], model.weights, model.config, cache)[0, -1]
    rounding = 1e-4 * want.abs().max().item()   # fp32 order effects on SmolLM2's logits (tests/test_cache.py)
    for tok, g in grads.items():
        worst = sum((d.double().abs() * s / 2).sum().item() for d, s in zip(g, steps, strict=True))
        sigma = sum((d.double() ** 2 * s ** 2 / 12).sum().item() for d, s in zip(g, steps, strict=True)) ** 0.5
        err = (got[tok] - want[tok]).abs().item()
        assert err <= worst + rounding, f"{name}: logit {tok} moved {err:.3g} > first-order worst case {worst:.3g}"
        assert err <= 6 * sigma + rounding, f"{name}: logit {tok} moved {err:.3g} > 6 sigma = {6 * sigma:.3g}"


def kivi_steps(bits, G, Q):
    """Steps of kivi's keys (per channel over groups of G of the first Q positions) and values (per token over
    the first Q); 0 past Q, where the cache keeps the float values."""
    def keys(k):
        B, H, T, D = k.shape
        s = torch.zeros(B, H, T, D, dtype=torch.float64)
        s[:, :, :Q] = ideal_steps(k[:, :, :Q].reshape(B, H, Q // G, G, D), bits, True, 3).reshape(B, H, Q, D)
        return s

    def values(v):
        s = torch.zeros(v.shape, dtype=torch.float64)
        s[:, :, :Q] = ideal_steps(v[:, :, :Q], bits, True, -1)
        return s
    return keys, values


LOGIT_CASES = [  # name, settings, key steps, value steps (prefill of 48: kivi quantizes 48 - 8 -> 32 positions)
    ("per_token-8", dict(bits=8), lambda k: per_token_steps(k, 8), lambda v: per_token_steps(v, 8)),
    ("per_token-8-smooth", dict(bits=8, smooth=True),
     lambda k: per_token_steps(k, 8, k.double().mean(2, keepdim=True)), lambda v: per_token_steps(v, 8)),
    ("kivi-8", dict(scheme="kivi", bits=8, group_size=16, residual=8), *kivi_steps(8, 16, 32)),
]


@pytest.mark.parametrize("name, kw, key_steps, value_steps", LOGIT_CASES, ids=[c[0] for c in LOGIT_CASES])
def test_8_bit_logits_stay_within_the_first_order_bound_tiny(name, kw, key_steps, value_steps):
    """A prefill, then one decode step, against ConcatCache. The bound, derived from the quantization error:
    the prefill attends to its own keys in float, so both caches hold the same keys and values (the prefill
    logits are the same bits), and the quantized cache then stores each element within step/2 of them,
    step computed here in float64 (the cache computes its scales in float64 too, scale_dtype). The decode
    step's logit l is a smooth function of the stored keys and values x, so to first order its change is
    sum (dl/dx) e with |e| <= step/2: at most worst = sum |dl/dx| step/2, gradients by autograd through
    the same forward. That worst case aligns every sign; rounding errors are close to independent and
    uniform, so the change is close to normal with sigma = sqrt(sum (dl/dx)^2 step^2 / 12), and 6 sigma
    is exceeded with probability ~2e-9. At 8 bits e is <= 0.4% of each set's range, so second-order terms
    are far below either bound. Both bounds, plus fp32 order effects (1e-4 x max |logit|), on the three
    largest logits."""
    ids = torch.randint(0, TINY.config.vocab_size, (1, 49), generator=torch.Generator().manual_seed(11))
    check_logits_against_concat(TINY, ids, 48, reference(TINY, ids, 48), name, kw, key_steps, value_steps)


def test_8_bit_logits_stay_within_the_first_order_bound_smollm2(smollm2):
    """The same bound (derivation in the tiny model's test above) on SmolLM2: 48 tokens of held-out text,
    then one decode step, for per-token scales with and without key smoothing and for kivi."""
    from lab.data import passages

    ids = torch.tensor([passages(smollm2.tokenizer, 49, count=1)[0]])
    ref = reference(smollm2, ids, 48)                                # the gradients serve every case
    for name, kw, key_steps, value_steps in LOGIT_CASES:
        check_logits_against_concat(smollm2, ids, 48, ref, name, kw, key_steps, value_steps)


@pytest.mark.parametrize("name", ["per_token-8", "kivi-4"])
def test_a_bfloat16_cache_keeps_bfloat16_scales_and_tracks_its_float32_twin(name):
    """The same steps in bfloat16 and in float32 (tiny-llama, a prefill of 20 and 20 decode steps). The
    bfloat16 cache's logits are as far from a bfloat16 ConcatCache's as the float32 cache's are from a
    float32 ConcatCache's, plus bfloat16 rounding: 8 significant bits, 2^-8 of the largest logit per rounding,
    of which we allow 4."""
    ids = torch.randint(0, 320, (1, 40), generator=torch.Generator().manual_seed(0))
    errs = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = load("tiny-llama", dtype=dtype)
        logits = {}
        for kind, cache in (("plain", ConcatCache(model.config, dtype=dtype)), ("quantized", make(name, dtype=dtype))):
            steps = [forward_cached(ids[:, :20], model.weights, model.config, cache)]
            steps += [forward_cached(ids[:, t:t + 1], model.weights, model.config, cache) for t in range(20, 40)]
            logits[kind] = torch.cat(steps, dim=1)
        assert logits["quantized"].dtype == dtype and cache.quantized > 0
        assert all(t.dtype == dtype for t in cache.k_scale + cache.v_scale + cache.k_tail if t is not None)
        errs[dtype] = (logits["quantized"].float() - logits["plain"].float()).abs().max().item()
        largest = logits["plain"].float().abs().max().item()
    assert errs[torch.bfloat16] <= errs[torch.float32] + 4 * 2 ** -8 * largest


# ---- (4) folded scales against attention over the dequantized cache -------------------------------------

@pytest.mark.parametrize("T", [1, 3], ids=["decode", "chunk_of_3"])
@pytest.mark.parametrize("name", CONFIG_IDS)
def test_folded_scale_attention_equals_attention_over_the_dequantized_cache(name, T):
    cache = make(name, batch_size=2)
    for j, t in enumerate([7, 1, 5]):                               # a prefix and a tail, in every config
        random_step(cache, t, seed=j, outliers=2, outlier_scale=4.0)
    assert cache.quantized > 0
    g = torch.Generator().manual_seed(5)
    q = torch.randn(2, 4, T, 16, generator=g)                        # [B, H_q, T, D]: 2 queries per kv head
    k, v = torch.randn(2, 2, T, 16, generator=g), torch.randn(2, 2, T, 16, generator=g)
    oracle = cache.fork()
    got = cache.attend(1, q, k, v)                                   # folded scales
    want = KVCache.attend(oracle, 1, q, k, v)                        # SDPA over update(): the dequantized cache
    assert got.shape == want.shape == (2, 4, T, 16)
    err = (got - want).abs().max().item()
    assert err <= 1e-5, f"folded attention differs from attention over the dequantized cache by {err:.3g}"


# ---- (5) bytes -------------------------------------------------------------------------------------------

def held_bytes(cache):
    """Bytes of the distinct storages behind every stored tensor: what the cache really keeps alive."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for name in QuantizedCache.STATE for t in getattr(cache, name) if t is not None}
    return sum(storages.values())


def test_nbytes_by_hand_and_half_a_16_bit_cache_at_8_bits():
    # SmolLM2's shape, bfloat16: 30 layers x 3 kv heads x 64 channels. 200 positions, per-token 8 bits:
    # each position and head holds K and V codes of 64 bytes and one 2-byte scale each: 132 bytes.
    L, H, D, n = 30, 3, 64, 200
    cache = QuantizedCache(SMOL_CONFIG, bits=8, dtype=torch.bfloat16)
    random_step(cache, n, seed=1)
    assert cache.quantized == n
    assert cache.nbytes() == L * H * n * (2 * 64 + 2 * 2) == 2_376_000 == held_bytes(cache)
    sixteen_bit = cache_bytes(SMOL_CONFIG, n, dtype=torch.bfloat16)     # L x H x n x 2 x 64 x 2 = 4,608,000
    assert cache.nbytes() / sixteen_bit == 132 / 256 < 0.52
    assert cache.bytes_per_position() == L * H * 132

    # kivi 4 bits, groups of 32, window 20, smoothing off: 200 - 20 -> 160 quantized positions (5 groups).
    # Keys: 32 code bytes per position and head, a 2-byte scale and zero per channel per group; values: 32
    # code bytes, a scale and zero per position; the 40 float positions at 2 x 64 x 2 bytes each.
    cache = QuantizedCache(SMOL_CONFIG, bits=4, scheme="kivi", group_size=32, residual=20, dtype=torch.bfloat16)
    random_step(cache, 150, seed=2)
    random_step(cache, 50, seed=3)
    Q = 160
    want = L * H * (Q * (32 + 32) + (Q // 32) * D * 2 * 2 + Q * 2 * 2 + (n - Q) * 2 * D * 2)
    assert cache.quantized == Q and cache.nbytes() == want == held_bytes(cache)
    assert cache.nbytes() == Q * cache.bytes_per_position() + L * H * (n - Q) * 2 * D * 2

    # kivi 2 bits in float32 after a crop into a group (tiny-llama's shape, 2 rows):
    # 2 layers x 2 heads x 16 channels; codes 4 bytes per position and head, each of K and V.
    cache = make("kivi-2", batch_size=2)                              # groups of 3, window 2, float32 scales
    random_step(cache, 20, seed=4)
    assert cache.quantized == 18
    cache.crop(10)                                                    # keeps 9 quantized, 1 back in float
    B, L, H, D = 2, 2, 2, 16
    want = B * L * H * (9 * (4 + 4) + 3 * D * 4 * 2 + 9 * 4 * 2 + 1 * 2 * D * 4)
    assert cache.quantized == 9 and cache.nbytes() == want == held_bytes(cache)


def test_smoothing_means_are_counted():
    cache = make("per_token-8-smooth-residual")                       # window of 3, 16 channels, fp32
    random_step(cache, 10, seed=1)
    L, H, D = 2, 2, 16
    want = 7 * cache.bytes_per_position() + L * H * 3 * 2 * D * 4 + L * H * D * 4   # prefix, tail, means
    assert cache.nbytes() == want == held_bytes(cache)


# ---- (6) crop, reset, fork, advance ---------------------------------------------------------------------

def step(model, cache, tokens):
    return forward_cached(torch.tensor([list(tokens)]), model.weights, model.config, cache)


def random_ids(n, seed):
    return torch.randint(0, 320, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.mark.parametrize("name", ["per_token-4-smooth", "kivi-4-value_groups"])
def test_reset_is_bit_identical(name):
    a, b = random_ids(30, 1), random_ids(9, 2)
    cache = make(name)
    step(TINY, cache, a)
    for t in random_ids(5, 3):
        step(TINY, cache, [t])
    cache.reset()
    assert (cache.length, cache.quantized, cache.nbytes()) == (0, 0, 0)
    got = [step(TINY, cache, b), step(TINY, cache, [7]), step(TINY, cache, [8])]
    fresh = make(name)
    want = [step(TINY, fresh, b), step(TINY, fresh, [7]), step(TINY, fresh, [8])]
    assert all(torch.equal(g, w) for g, w in zip(got, want, strict=True))
    assert_unchanged(cache, snapshot(fresh))   # the same state, the smoothing means recomputed from b included


@pytest.mark.parametrize("name", ["per_token-8-smooth-residual", "kivi-2"])
def test_fork_leaves_parent_untouched_and_the_child_continues_as_one_cache_would(name):
    prefix, x, y = random_ids(20, 4), random_ids(4, 5), random_ids(4, 6)
    parent = make(name)
    step(TINY, parent, prefix)
    before = snapshot(parent)
    child = parent.fork()
    assert child.length == 20 and child.quantized == parent.quantized
    for field in QuantizedCache.STATE:                               # a fork copies no tensor: it shares them
        assert all(c is p for c, p in zip(getattr(child, field), getattr(parent, field), strict=True))
    child_logits = [step(TINY, child, [t]) for t in x]
    assert_unchanged(parent, before)
    child_after = snapshot(child)
    parent_logits = [step(TINY, parent, [t]) for t in y]
    assert_unchanged(child, child_after)
    for tokens, got in ((x, child_logits), (y, parent_logits)):     # as if there had been no fork
        straight = make(name)
        step(TINY, straight, prefix)
        assert all(torch.equal(g, step(TINY, straight, [t])) for g, t in zip(got, tokens, strict=True))


@pytest.mark.parametrize("name", ["kivi-4", "per_token-8-smooth-residual"])
def test_crop_of_pending_positions_restores_the_cache_exactly(name):
    cache = make(name)
    random_step(cache, 6, seed=1)
    before = snapshot(cache)
    for i in range(cache.n_layers):                                  # a step of 9 that would quantize groups
        cache.update(i, random_kv(i, (1, 2, 9, 16)), random_kv(i + 9, (1, 2, 9, 16)))
    cache.crop(cache.length)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("name, n, kept", [("kivi-4", 6, 4), ("kivi-4", 8, 8), ("kivi-2", 7, 6),
                                           ("per_token-4-smooth", 5, 5)])
def test_crop_into_the_quantized_prefix_keeps_what_attention_saw(name, n, kept):
    """A crop keeps whole groups quantized and moves the cut group's kept positions to the float tail, as the
    values the cache was serving: every key and value of a kept position is unchanged, bit for bit. When
    the group fills again it is quantized a second time, within half a step of what the cache served."""
    cache = make(name)
    written = random_step(cache, 13, seed=2)
    served = [cache._read(i) for i in range(cache.n_layers)]
    assert cache.quantized > n
    cache.crop(n)
    assert (cache.length, cache.quantized) == (n, kept)
    for i in range(cache.n_layers):
        k, v = cache._read(i)
        assert torch.equal(k, served[i][0][:, :, :n]) and torch.equal(v, served[i][1][:, :, :n])
        assert (cache.k_tail[i] is None) == (n == kept)
    assert cache.nbytes() == held_bytes(cache)
    more = random_step(cache, 9, seed=3)                             # refills and requantizes the cut group
    Q, G = cache.quantized, cache.group
    assert Q >= n + 1 and kept % G == 0
    for i in range(cache.n_layers):
        k, v = cache._read(i)
        k_in = torch.cat([served[i][0][:, :, :n], more[0][i]], dim=2)  # what the second quantization saw
        v_in = torch.cat([served[i][1][:, :, :n], more[1][i]], dim=2)
        assert torch.equal(k[:, :, :kept], served[i][0][:, :, :kept]), "whole groups kept as they were"
        first = written[0][i]                                        # the smoothing mean's keys
        assert_within_half_a_step(k[:, :, kept:Q], k_in[:, :, kept:Q],
                                  ideal_key_steps(cache, k_in[:, :, :Q], first)[:, :, kept:Q], "requantized keys")
        assert_within_half_a_step(v[:, :, kept:Q], v_in[:, :, kept:Q],
                                  ideal_value_steps(cache, v_in[:, :, kept:Q]), "requantized values")


OPS = st.lists(st.one_of(st.tuples(st.just("step"), st.integers(1, 7)),
                         st.tuples(st.just("crop"), st.floats(0, 1)),
                         st.tuples(st.just("abort"), st.integers(1, 7)),   # a step dropped before advance
                         st.just(("reset", 0))), min_size=1, max_size=10)


@settings(max_examples=40, deadline=None)
@given(ops=OPS, seed=st.integers(0, 999))
@pytest.mark.parametrize("name", ["kivi-8", "per_token-8-smooth-residual"])
def test_operations_track_a_concat_cache(name, ops, seed):
    """Any sequence of steps, crops, aborted steps and resets leaves the quantized cache holding the same
    positions as a ConcatCache fed the same keys and values: the same length, a prefix of whole groups,
    storage held exactly as counted, and every position within `roundings` half steps of the layer's
    largest |x| / (2^(b-1) - 1), a step no set exceeds (|x - mu| <= 2 max|x| for smoothed keys). A
    position is rounded once, and once more each time a crop cuts its group and the group refills."""
    cache, plain = make(name), ConcatCache(TINY.config)
    roundings = 1
    for j, (op, arg) in enumerate(ops):
        if op == "step":
            ks, vs = random_step(cache, arg, seed + j)
            write_step(plain, ks, vs)
        elif op == "abort":
            for i in range(cache.n_layers):
                cache.update(i, random_kv(j, (1, 2, arg, 16)), random_kv(j + 1, (1, 2, arg, 16)))
            cache.crop(cache.length)
        elif op == "crop":
            n = int(arg * cache.length)
            roundings += n < cache.quantized
            cache.crop(n)
            plain.crop(n)
        else:
            cache.reset()
            plain.reset()
        assert cache.length == plain.length and cache.pending == [0, 0]
        assert cache.quantized % cache.group == 0 and cache.quantized <= cache.length
        assert cache.nbytes() == held_bytes(cache)
    for i in range(cache.n_layers):
        if not plain.length:
            assert cache.k_tail[i] is None and cache.k_codes[i] is None
            continue
        for got, want in zip(cache._read(i), (plain.keys[i], plain.values[i]), strict=True):
            assert got.shape == want.shape
            step = 2 * want.abs().max().item() / (2 ** (cache.bits - 1) - 1)
            assert (got - want).abs().max().item() <= roundings * step / 2 * (1 + 1e-6)


# ---- (7) bad input: a typed error, and nothing changed ---------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(bits=3), r"per_token scheme stores 8 or 4 bits, got 3"),
    (dict(bits=2), r"per_token scheme stores 8 or 4 bits, got 2"),
    (dict(bits=16, scheme="kivi"), r"kivi scheme stores 8 or 4 or 2 bits, got 16"),
    (dict(bits=True), r"stores 8 or 4 bits, got True"),
    (dict(bits=8.0), r"stores 8 or 4 bits, got 8\.0"),
    (dict(scheme="per_channel"), r"scheme must be one of 'per_token', 'kivi', got 'per_channel'"),
    (dict(scheme="kivi", group_size=0), r"group_size must be at least 1, got 0"),
    (dict(scheme="kivi", group_size=-4), r"group_size must be at least 1, got -4"),
    (dict(scheme="kivi", group_size=2.5), r"group_size must be an int, got 2\.5"),
    (dict(scheme="kivi", residual=-1), r"residual must be at least 0, got -1"),
    (dict(scheme="kivi", value_group_size=5), r"value_group_size 5 does not divide head_dim 16"),
    (dict(scheme="kivi", value_group_size=0), r"value_group_size must be at least 1, got 0"),
    (dict(scheme="kivi", smooth=True), r"kivi's per-channel scales"),
    (dict(smooth=1), r"smooth must be True or False, got 1"),
    (dict(scale_dtype=torch.int8), r"scale_dtype must be a floating-point torch dtype"),
    (dict(batch_size=0), r"batch_size must be at least 1, got 0"),
])
def test_bad_settings_raise_cache_input_error(kw, message):
    with pytest.raises(CacheInputError, match=message):
        QuantizedCache(TINY.config, **kw)


def test_codes_must_pack_along_the_head_dimension():
    odd = ModelConfig(arch="llama", vocab_size=320, n_layers=1, d_model=12, n_heads=2, n_kv_heads=2, head_dim=6)
    QuantizedCache(odd, bits=4)                                       # two 4-bit codes a byte: 6 channels pack
    with pytest.raises(CacheInputError, match=r"2-bit codes pack 4 to a byte .* head_dim 6 does not divide"):
        QuantizedCache(odd, bits=2, scheme="kivi")


def nan_at(shape, where, value=float("nan")):
    x = random_kv(3, shape)
    x.view(-1)[where] = value
    return x


GOOD = random_kv(4, (1, 2, 1, 16))
Q_GOOD = random_kv(5, (1, 4, 1, 16))
BAD_CALLS = [  # id, prepare(cache) (a step half done), bad(cache), message
    ("nan_key", None, lambda c: c.update(0, nan_at((1, 2, 1, 16), 7), GOOD), r"k holds 1 NaN or infinite"),
    ("inf_value", None, lambda c: c.update(0, GOOD, nan_at((1, 2, 1, 16), 0, float("inf"))),
     r"v holds 1 NaN or infinite"),
    ("minus_inf_key_in_a_chunk", None, lambda c: c.update(1, nan_at((1, 2, 3, 16), 40, float("-inf")),
                                                          random_kv(6, (1, 2, 3, 16))), r"k holds 1 NaN"),
    ("nan_key_in_layer_1_after_layer_0", lambda c: c.update(0, GOOD, GOOD),
     lambda c: c.update(1, nan_at((1, 2, 1, 16), 3), GOOD), r"k holds 1 NaN"),
    ("nan_through_attend", None, lambda c: c.attend(0, Q_GOOD, nan_at((1, 2, 1, 16), 1), GOOD), r"k holds 1 NaN"),
    ("query_wrong_head_dim", None, lambda c: c.attend(0, random_kv(1, (1, 4, 1, 8)), GOOD, GOOD),
     r"q has shape \(1, 4, 1, 8\), expected \[1, a multiple of 2, 1, 16\]"),
    ("query_heads_not_a_multiple", None, lambda c: c.attend(0, random_kv(1, (1, 3, 1, 16)), GOOD, GOOD),
     r"q has shape \(1, 3, 1, 16\)"),
    ("query_rank_3", None, lambda c: c.attend(0, random_kv(1, (1, 4, 16)), GOOD, GOOD), r"q must be a rank-4"),
    ("key_wrong_dtype", None, lambda c: c.attend(0, Q_GOOD, GOOD.double(), GOOD), r"k has dtype torch.float64"),
    ("layer_out_of_range", None, lambda c: c.attend(2, Q_GOOD, GOOD, GOOD), r"layer index 2 out of range"),
]


@pytest.mark.parametrize("name", ["per_token-8-smooth-residual", "kivi-2"])
@pytest.mark.parametrize("prepare, bad, message", [c[1:] for c in BAD_CALLS], ids=[c[0] for c in BAD_CALLS])
def test_bad_input_raises_a_typed_error_and_changes_nothing(name, prepare, bad, message):
    cache = make(name)
    prefix = random_ids(9, 8)
    step(TINY, cache, prefix)                                         # a quantized prefix, a tail, the means
    assert cache.quantized > 0
    if prepare:
        prepare(cache)
    before = snapshot(cache)
    with pytest.raises(CacheInputError, match=message):
        bad(cache)
    assert_unchanged(cache, before)
    cache.crop(cache.length)                                          # drop what a step left pending; go on
    got = step(TINY, cache, [9])
    clean = make(name)
    step(TINY, clean, prefix)
    assert torch.equal(got, step(TINY, clean, [9]))


def test_errors_are_the_protocols():
    cache = make("kivi-8")
    random_step(cache, 5, seed=1)
    with pytest.raises(CacheStateError, match=r"crop\(6\): the cache holds 5"):
        cache.crop(6)
    cache.update(0, GOOD, GOOD)
    with pytest.raises(CacheStateError, match=r"fork\(\) in the middle of a step"):
        cache.fork()
    with pytest.raises(CacheError):
        cache.advance(1)


# ---- (8) the residual window holds the newest positions exactly -------------------------------------------

class RecordingCache(QuantizedCache):
    """Remembers every k and v it was given, per layer."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.given = [[] for _ in range(self.n_layers)]

    def attend(self, layer, q, k, v):
        self.given[layer].append((k.clone(), v.clone()))
        return super().attend(layer, q, k, v)


def test_kivi_residual_window_is_the_float_keys_exactly():
    G, R = 4, 6
    cache = RecordingCache(TINY.config, bits=2, scheme="kivi", group_size=G, residual=R)
    plain = ConcatCache(TINY.config)
    ids = random_ids(30, 9)
    step(TINY, cache, ids[:21])
    step(TINY, plain, ids[:21])
    assert cache.quantized == 12                                      # 21 - 6 = 15 -> 3 whole groups
    for i in range(cache.n_layers):                                  # after the prefill: ConcatCache's keys
        assert torch.equal(cache.k_tail[i], plain.keys[i][:, :, 12:])
        assert torch.equal(cache.v_tail[i], plain.values[i][:, :, 12:])
    for n, t in enumerate(ids[21:], start=22):                        # decoding: the keys each step computed
        step(TINY, cache, [t])
        assert cache.quantized == (n - R) // G * G
        assert R <= cache.length - cache.quantized <= R + G - 1
        for i in range(cache.n_layers):
            k = torch.cat([k for k, _ in cache.given[i]], dim=2)
            v = torch.cat([v for _, v in cache.given[i]], dim=2)
            assert torch.equal(cache.k_tail[i], k[:, :, cache.quantized:])
            assert torch.equal(cache.v_tail[i], v[:, :, cache.quantized:])
