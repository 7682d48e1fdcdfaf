"""16-bit models: bfloat16 weights, activations and caches, against transformers in the same dtype.

Oracles: transformers' own model loaded in bfloat16 from the same weights (`to_transformers`), the lab's
uncached bfloat16 forward (recomputation), transformers' greedy `generate`, and the unmerged projections.

Tolerances. bfloat16 keeps 8 significant bits: one step of a value x is 2^-8 |x| (0.4%), and every
operation rounds its result to that. Two computations that do the same operations in the same order
agree exactly; where the order of a sum differs (a kernel blocks it differently, one decode query instead
of a prefill's T), one rounding can land one step apart, and the difference travels on through the
layers. Every bound below is a number of steps of the largest logit, `STEP * max|logit|`, with the count
justified where it is used.
"""

import pytest
import torch

from lab import data
from lab.cache import (
    CacheMismatchError,
    ConcatCache,
    EvictingCache,
    PagedCache,
    QuantizedCache,
    StaticCache,
    make_cache,
)
from lab.models import forward, forward_cached, load

BF16 = torch.bfloat16
STEP = 2.0 ** -8                        # one bfloat16 step, relative
needs_bf16 = pytest.mark.skipif(not torch.ops.mkldnn._is_mkldnn_bf16_supported(),
                                reason="this CPU has no native bfloat16 (AVX-512 BF16 or AMX)")


def seeded_ids(vocab_size, batch, tokens, seed=0):
    return torch.randint(0, vocab_size, (batch, tokens), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def smol16():
    return load("smollm2", dtype=BF16)


@pytest.fixture(scope="module")
def smol16_ids(smol16):
    return torch.tensor(data.passages(smol16.tokenizer, n_tokens=128, count=1, seed=0))  # [1, 128]


# ---- parity with transformers in bfloat16 --------------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mqa", "tiny-gpt2"])
def test_tiny_bf16_forward_matches_transformers_bf16(name):
    from lab.models.hf import to_transformers

    model = load(name, dtype=BF16)
    ids = seeded_ids(model.config.vocab_size, 2, 40)
    with torch.inference_mode():
        ours, ref = forward(ids, model.weights, model.config), to_transformers(model)(ids).logits
    assert ours.dtype == ref.dtype == BF16
    # Llama: the same operations with the same casts (norms in float32, RoPE tables cast to bfloat16 before
    # the rotation, as transformers' Llama does): one step of the largest logit covers a kernel's other
    # order. GPT-2: transformers' Conv1D adds the bias inside addmm, before rounding, the lab's `x @ W + b`
    # after it: one more rounding in each of 4 products per layer, over 2 layers; 4 steps (measured: 1.2).
    steps = 4 if model.config.arch == "gpt2" else 1
    assert (ours.float() - ref.float()).abs().max() <= steps * STEP * ref.float().abs().max()


def test_smollm2_bf16_forward_matches_transformers_bf16(smol16, smol16_ids):
    from lab.models.hf import to_transformers

    with torch.inference_mode():
        ours = forward(smol16_ids, smol16.weights, smol16.config).float()
        ref = to_transformers(smol16)(smol16_ids).logits.float()
    # Measured equal bit for bit on this machine (AVX-512 BF16). One step of the largest logit (about 0.14 at
    # |logit| 35) leaves room for another kernel's order; a wrong cast is far outside it: rotating by RoPE in
    # float32 and rounding afterwards (not transformers' order) moves the logits by 1.06 and changes 3% of
    # the argmaxes.
    assert (ours - ref).abs().max() <= STEP * ref.abs().max()
    assert torch.equal(ours.argmax(-1), ref.argmax(-1))


@pytest.mark.slow            # over 5 s: make test within 15 minutes (make test-slow runs it)
def test_smollm2_bf16_greedy_tokens_equal_transformers_generate(smol16, smol16_ids):
    """64 greedy tokens through a bfloat16 StaticCache against transformers' generate (its DynamicCache) in
    bfloat16: measured equal over all 64 (no divergence); the test asks for all 64."""
    from lab.models.hf import to_transformers

    prompt, n = smol16_ids[:, :32], 64
    with torch.inference_mode():
        want = to_transformers(smol16).generate(prompt, max_new_tokens=n, min_new_tokens=n, do_sample=False)
        cache, tokens = StaticCache(smol16.config, 32 + n), []
        logits = forward_cached(prompt, smol16.weights, smol16.config, cache, last_only=True)
        for _ in range(n):
            tokens.append(int(logits[0, -1].argmax()))
            logits = forward_cached(torch.tensor([tokens[-1:]]), smol16.weights, smol16.config, cache, last_only=True)
    assert tokens == want[0, 32:].tolist()


# ---- every cache in bfloat16, against recomputation -----------------------------------------------------

CACHES = {
    "concat": lambda cfg, B, T: ConcatCache(cfg, B),
    "static": lambda cfg, B, T: StaticCache(cfg, T, B),
    "paged": lambda cfg, B, T: PagedCache(cfg, B * T, 4, B),
    "evicting": lambda cfg, B, T: EvictingCache(cfg, T, batch_size=B),     # a budget that evicts nothing
}


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("design", CACHES)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_16bit_prefill_and_decode_match_recomputation(design, name, dtype):
    model = load(name, dtype=dtype)
    cfg, w = model.config, model.weights
    ids = seeded_ids(cfg.vocab_size, 2, 24, seed=1)
    cache = CACHES[design](cfg, 2, 24)
    with torch.inference_mode():
        want = forward(ids, w, cfg).float()
        got = [forward_cached(ids[:, :16], w, cfg, cache)]                               # prefill
        got += [forward_cached(ids[:, t:t + 1], w, cfg, cache) for t in range(16, 24)]  # decode
    got = torch.cat(got, dim=1)
    assert cache.dtype == got.dtype == dtype
    # A decode step sums attention over one query, recomputation over 24: the roundings can land a step
    # apart in each of the ~6 roundings per layer, over 2 layers; 8 steps of the largest logit (measured:
    # at most 1.5 in bfloat16, 1.7 in float16, whose step is 2^-11: 11 significant bits)
    step = STEP if dtype == BF16 else 2.0 ** -11
    assert (got.float() - want).abs().max() <= 8 * step * want.abs().max()


def test_smollm2_bf16_cached_decode_matches_recomputation(smol16, smol16_ids):
    cfg, w = smol16.config, smol16.weights
    cache = StaticCache(cfg, 128)
    with torch.inference_mode():
        want = forward(smol16_ids, w, cfg).float()
        got = [forward_cached(smol16_ids[:, :96], w, cfg, cache)]
        got += [forward_cached(smol16_ids[:, t:t + 1], w, cfg, cache) for t in range(96, 128)]
    got = torch.cat(got, dim=1).float()
    # 30 layers of roundings that can each land a step apart (decode sums over one query, recomputation
    # over 128): measured 0.75 at |logit| 35, 5.4 steps of the largest; 16 steps (about 2.2) bound it, while
    # a wrong offset or mask moves logits by several units. The greedy choice agrees everywhere.
    assert (got - want).abs().max() <= 16 * STEP * want.abs().max()
    assert torch.equal(got.argmax(-1), want.argmax(-1))


def test_quantized_cache_in_bf16_keeps_a_bf16_tail_and_bf16_scales():
    model = load("tiny-llama", dtype=BF16)
    cache = QuantizedCache(model.config, bits=8, scheme="kivi", batch_size=1, residual=4, group_size=4)
    ids = seeded_ids(model.config.vocab_size, 1, 20)
    with torch.inference_mode():
        want = forward(ids, model.weights, model.config).float()
        got = forward_cached(ids, model.weights, model.config, cache).float()
    assert cache.dtype == cache.scale_dtype == BF16
    # 8-bit codes on top of bfloat16: the quantization step (1/255 of a group's range, per key) is the
    # larger error; a quarter of the largest logit bounds it loosely and still catches a wrong scale
    assert (got - want).abs().max() <= 0.25 * want.abs().max()


# ---- caches take the model's dtype; a cache of another dtype is refused -----------------------------------

@pytest.mark.parametrize("make", [
    lambda cfg: ConcatCache(cfg), lambda cfg: StaticCache(cfg, 8), lambda cfg: PagedCache(cfg, 16, 4),
    lambda cfg: QuantizedCache(cfg), lambda cfg: EvictingCache(cfg, 8), lambda cfg: make_cache("paged", cfg, 8)])
def test_caches_take_the_models_dtype(make):
    """Regression: every cache stored float32 unless told otherwise, so a bfloat16 model's forward failed
    on the default cache ('k has dtype torch.bfloat16, the cache holds torch.float32')."""
    model = load("tiny-llama", dtype=BF16)
    cache = make(model.config)
    assert cache.dtype == BF16
    with torch.inference_mode():
        forward_cached(seeded_ids(320, 1, 3), model.weights, model.config, cache)


def test_cache_of_another_dtype_is_refused_naming_both():
    """Regression: a float32 cache given to a bfloat16 model failed inside the first layer's update, after
    check_model had taken the model as the cache's owner; now check_model refuses it, changing nothing."""
    model = load("tiny-llama", dtype=BF16)
    cache = StaticCache(model.config, 8, dtype=torch.float32)
    with pytest.raises(CacheMismatchError, match=r"torch\.float32.*torch\.bfloat16"):
        forward_cached(seeded_ids(320, 1, 3), model.weights, model.config, cache)
    assert cache.owner is None and cache.length == 0


def test_paged_step_of_another_dtype_is_refused_naming_both():
    model = load("tiny-llama", dtype=BF16)
    pool = PagedCache(model.config, 16, 4, dtype=torch.float32)
    seq = pool.new_id()
    pool.reserve([(seq, 3)])
    step = pool.plan_step([(seq, 3)])
    with pytest.raises(CacheMismatchError, match=r"torch\.float32.*torch\.bfloat16"):
        forward_cached(seeded_ids(320, 1, 3), model.weights, model.config, step, positions=step.positions)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float64, "float8_e4m3fn"])
def test_load_rejects_a_dtype_the_lab_cannot_run(dtype):
    """Regression: load(name, dtype=torch.int8) cast every weight to integers and returned a model that
    failed later with a message about matrix products; now DtypeError names the dtypes the lab runs in."""
    with pytest.raises(TypeError, match="float32, bfloat16, float16") as refused:
        load("tiny-llama", dtype=dtype)
    from lab.models import DtypeError

    assert isinstance(refused.value, DtypeError) and isinstance(refused.value, ValueError)


def test_config_says_the_dtype_and_its_bytes_per_position(smol16, smollm2):
    # Hand-computed: 2 (K and V) x 30 layers x 3 kv heads x 64 dims x 2 bytes = 23,040 bytes (4 bytes: 46,080)
    assert (smol16.config.dtype, smollm2.config.dtype) == ("bfloat16", "float32")
    assert smol16.config.kv_bytes_per_position() == 23_040 == smollm2.config.kv_bytes_per_position(BF16)
    assert smollm2.config.kv_bytes_per_position() == 46_080
    assert StaticCache(smol16.config, 10).nbytes() == 10 * 23_040
    assert smollm2.to(dtype=BF16).config == smol16.config        # a cast model says its new dtype


def test_identity_separates_dtypes_the_manifest_does_not(smol16, smollm2):
    """The manifest describes the files (the same for both dtypes); the state identity in every prefix key
    and page name carries the compute and cache dtypes, so a bfloat16 prefix is never served to float32."""
    from lab.engine.identity import identity_of

    assert smol16.manifest == smollm2.manifest
    a = identity_of(smollm2, StaticCache(smollm2.config, 4))
    b = identity_of(smol16, StaticCache(smol16.config, 4))
    assert a != b and (b.compute_dtype, b.cache_dtype) == ("torch.bfloat16", "torch.bfloat16")


# ---- merged projections (Prepacked) and the serving engine ------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, pytest.param(BF16, marks=needs_bf16)])
def test_merged_projections_compute_the_unmerged_forward(dtype):
    """Prepacked holds q, k, v as one matrix and gate, up as another; with biases (as Qwen2 has on q, k, v)
    the merged bias is the three concatenated. Against the unmerged F.linear forward: the same products,
    each row summed by oneDNN in its own order, so float32 agrees to rounding (1e-5 of logits below 1:
    ~1e-7 per operation, 2 layers) and bfloat16 to one step of the largest logit."""
    from lab.models.llama import Prepacked

    model = load("tiny-llama", dtype=dtype)
    g = torch.Generator().manual_seed(3)
    w = dict(model.weights)
    for i in range(model.config.n_layers):
        for x in "qkv":
            rows = w[f"model.layers.{i}.self_attn.{x}_proj.weight"].shape[0]
            w[f"model.layers.{i}.self_attn.{x}_proj.bias"] = (0.1 * torch.randn(rows, generator=g)).to(dtype)
    packed = Prepacked(w)
    assert len(packed.packed) == 4 * model.config.n_layers + 1    # qkv, o, gate_up, down; the head
    ids = seeded_ids(320, 2, 17)
    with torch.inference_mode():
        want, got = forward(ids, w, model.config).float(), forward(ids, packed, model.config).float()
    bound = 1e-5 if dtype == torch.float32 else STEP * want.abs().max()
    assert (got - want).abs().max() <= bound


@needs_bf16
def test_serving_engine_runs_bf16_prepacked_and_matches_cached_greedy():
    """Regression: the engine prepacked only float32 weights, so bfloat16 ran every projection through
    F.linear (slower at a decode step's rows). Its tokens against greedy decoding through a StaticCache."""
    from lab.engine import ServingEngine
    from lab.models.llama import Prepacked

    model = load("tiny-llama", dtype=BF16)
    engine = ServingEngine(model, num_pages=32, page_size=4, max_batch_tokens=32)
    assert isinstance(engine.weights, Prepacked) and engine.pool.dtype == BF16
    prompts = [seeded_ids(320, 1, n, seed=n)[0].tolist() for n in (5, 9, 3)]
    got = engine.generate(prompts, 6)
    for prompt, tokens in zip(prompts, got, strict=True):
        cache, want = StaticCache(model.config, 16), []
        with torch.inference_mode():
            logits = forward_cached(torch.tensor([prompt]), model.weights, model.config, cache, last_only=True)
            for _ in range(6):
                want.append(int(logits[0, -1].argmax()))
                logits = forward_cached(torch.tensor([want[-1:]]), model.weights, model.config, cache,
                                        last_only=True)
        # random tiny weights give near-ties, but the same bfloat16 products decide them alike
        assert tokens == want


def test_serve_takes_a_dtype():
    """Regression: `python -m lab.serve` always loaded float32; --dtype chooses, and a dtype the lab cannot
    run is refused before anything starts."""
    from lab.serve.engine_loop import EngineProcess

    client = EngineProcess("tiny-llama", num_pages=8, dtype="bfloat16")   # not started: config only
    assert client.config.dtype == "bfloat16"
    from lab.serve.cli import main

    with pytest.raises(SystemExit):
        main(["--dtype", "int8"])
