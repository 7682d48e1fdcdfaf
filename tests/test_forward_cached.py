"""forward_cached and CachedBackend against their oracles, for all three cache designs alike.

Oracles: `lab.models.forward` recomputing the whole prefix without a cache (directly, or through
RecomputeBackend); the transformers model on the same weights (`to_transformers`) stepping with its own
DynamicCache; hand-computed position counts.

Tolerances. fp32 rounds ~1e-7 relative per op. A cached and an uncached forward (or ours and transformers')
add the same terms in different orders: matmuls of other shapes, attention over one row instead of a
masked square. On the tiny models (2 layers, logits and keys of order 1) that is a few 1e-7: we allow
1e-5 absolute. On SmolLM2 (30 layers) and gpt2-random (12 layers, width 768) the differences grow with
depth and with the logits' size: we allow 1e-4 x the largest |logit| (keys: x the largest |key|).
Greedy tokens must be identical.
"""

import pytest
import torch

from lab.cache import CacheFullError, ConcatCache, PagedCache, StaticCache
from lab.data import passages
from lab.engine import CachedBackend, RecomputeBackend, generate
from lab.models import forward, forward_cached, load
from lab.models.hf import to_transformers

MAX_TOKENS = 256  # StaticCache capacity here: the longest sequence is the 150-token chunked prefill
TINY_ATOL = 1e-5  # tiny models: see the module docstring
DESIGNS = [pytest.param(lambda cfg, B=1: ConcatCache(cfg, batch_size=B), id="concat"),
           pytest.param(lambda cfg, B=1: StaticCache(cfg, max_tokens=MAX_TOKENS, batch_size=B), id="static"),
           pytest.param(lambda cfg, B=1: PagedCache(cfg, MAX_TOKENS * B, 16, batch_size=B, max_seq_tokens=MAX_TOKENS),
                        id="paged")]
TINY = ["tiny-gpt2", "tiny-llama", "tiny-mqa"]
_TINY_MODELS = {}


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def tiny(name):
    """The seeded random tiny models, loaded once per module."""
    if name not in _TINY_MODELS:
        _TINY_MODELS[name] = load(name)
    return _TINY_MODELS[name]


def random_ids(n, vocab_size, seed=0):
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def rel_tol(reference):
    """Big models: 1e-4 x the largest magnitude of the reference (module docstring)."""
    return 1e-4 * reference.abs().max().item()


def assert_close(got, want, atol, what="logits"):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err <= atol, f"{what}: max |difference| {err:.3g} > {atol:.3g}"


def stored(cache):
    """Every layer's committed keys and values, [B, H_kv, length, D] each."""
    n = cache.length
    if isinstance(cache, PagedCache):
        return [cache._read(i) for i in range(cache.n_layers)]
    if isinstance(cache, StaticCache):
        return [(cache.k_buf[i, :, :, :n], cache.v_buf[i, :, :, :n]) for i in range(cache.n_layers)]
    return [(k[:, :, :n], v[:, :, :n]) for k, v in zip(cache.keys, cache.values, strict=True)]


class Recording:
    """A backend that remembers the scores of the backend it wraps, step by step."""

    def __init__(self, backend):
        self.backend, self.logits = backend, []

    def next_logits(self, ids):
        logits = self.backend.next_logits(ids)
        self.logits.append(logits)
        return logits


def cached_steps(model, make, ids, P):
    """Prefill ids[:P] through a new cache, then feed ids[P:] one at a time; the logits after each prefix."""
    w, cfg, cache = model.weights, model.config, make(model.config)
    out = [forward_cached(torch.tensor([ids[:P]]), w, cfg, cache)[0, -1]]
    for t in ids[P:]:
        out.append(forward_cached(torch.tensor([[t]]), w, cfg, cache)[0, -1])
    assert cache.length == len(ids)
    return out


def recomputed_steps(model, ids, P):
    """The oracle: the whole prefix ids[:n] recomputed without a cache, for n = P .. len(ids)."""
    return [forward(torch.tensor([ids[:n]]), model.weights, model.config, last_only=True)[0, -1]
            for n in range(P, len(ids) + 1)]


@torch.inference_mode()
def transformers_steps(hf, ids, P):
    """The other oracle: transformers' model with its own cache, prefilled with ids[:P], then one token a step."""
    out = hf(torch.tensor([ids[:P]]), use_cache=True)
    logits = [out.logits[0, -1]]
    for t in ids[P:]:
        out = hf(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[0, -1])
    return logits


# ---- greedy decoding: the same tokens with and without a cache --------------------------------------------

def check_greedy_and_counters(model, make, prompt, want_tokens):
    backend = CachedBackend(model, lambda: make(model.config))
    got = generate(backend, prompt, len(want_tokens)).tokens
    assert got == want_tokens
    # hand-computed: the prompt once (a miss), then one position per step (hits): P + n - 1 positions
    n = len(want_tokens)
    assert (backend.calls, backend.hits, backend.misses) == (n, n - 1, 1)
    assert backend.positions == len(prompt) + n - 1


@pytest.mark.parametrize("make", DESIGNS)
@pytest.mark.parametrize("name", TINY)
def test_greedy_tokens_cached_equal_uncached_tiny(name, make):
    model = tiny(name)
    prompt = random_ids(17, model.config.vocab_size, seed=1)
    want = generate(RecomputeBackend(model), prompt, 48).tokens
    check_greedy_and_counters(model, make, prompt, want)


def test_backend_counters_hand_computed():
    model = tiny("tiny-llama")
    backend = CachedBackend(model, lambda: ConcatCache(model.config))
    generate(backend, random_ids(17, 320, seed=2), 48)
    assert (backend.positions, backend.hits, backend.misses, backend.calls) == (64, 47, 1, 48)  # 17 + 47 = 64


@pytest.fixture(scope="module")
def smollm2_greedy(smollm2):
    """48 greedy tokens after a 17-token held-out prompt, recomputed without a cache, with every step's logits."""
    prompt = passages(smollm2.tokenizer, 17, 1)[0]
    recording = Recording(RecomputeBackend(smollm2))
    tokens = generate(recording, prompt, 48).tokens
    return prompt, tokens, recording.logits


@pytest.mark.slow  # with its fixtures (smollm2_greedy: 48 uncached SmolLM2 forwards) 15-35 s on 2 cores
@pytest.mark.parametrize("make", DESIGNS)
def test_greedy_tokens_cached_equal_uncached_smollm2(smollm2, smollm2_greedy, make):
    prompt, tokens, _ = smollm2_greedy
    check_greedy_and_counters(smollm2, make, prompt, tokens)


@pytest.fixture(scope="module")
def gpt2_random():
    return load("gpt2-random")


@pytest.fixture(scope="module")
def gpt2_random_greedy(gpt2_random):
    prompt = random_ids(17, gpt2_random.config.vocab_size, seed=3)
    return prompt, generate(RecomputeBackend(gpt2_random), prompt, 32).tokens


@pytest.mark.parametrize("make", DESIGNS)
def test_greedy_tokens_cached_equal_uncached_gpt2_random(gpt2_random, gpt2_random_greedy, make):
    prompt, tokens = gpt2_random_greedy
    check_greedy_and_counters(gpt2_random, make, prompt, tokens)


# ---- logits at every decode step: against recomputation and against transformers' own cache ----------------

@pytest.mark.parametrize("make", DESIGNS)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_logits_each_step_match_recompute_and_transformers_tiny(name, make):
    model = tiny(name)
    P, ids = 17, random_ids(17 + 32, model.config.vocab_size, seed=4)
    got = cached_steps(model, make, ids, P)
    recomputed, library = recomputed_steps(model, ids, P), transformers_steps(to_transformers(model), ids, P)
    assert len(got) == len(recomputed) == len(library) == 33
    for s, (g, r, h) in enumerate(zip(got, recomputed, library, strict=True)):
        assert_close(g, r, TINY_ATOL, f"step {s} vs recomputation")
        assert_close(g, h, TINY_ATOL, f"step {s} vs transformers")


@pytest.fixture(scope="module")
def smollm2_transformers_steps(smollm2, smollm2_greedy):
    prompt, tokens, _ = smollm2_greedy
    return transformers_steps(to_transformers(smollm2), prompt + tokens[:16], len(prompt))


@pytest.mark.slow  # with its fixtures (smollm2_greedy: 48 uncached SmolLM2 forwards) 15-35 s on 2 cores
@pytest.mark.parametrize("make", DESIGNS)
def test_logits_each_step_match_recompute_and_transformers_smollm2(smollm2, smollm2_greedy,
                                                                   smollm2_transformers_steps, make):
    prompt, tokens, recomputed = smollm2_greedy  # recomputed[s]: forward on prompt + tokens[:s]
    got = cached_steps(smollm2, make, prompt + tokens[:16], len(prompt))  # 17-token prefill, 16 decode steps
    assert len(got) == len(smollm2_transformers_steps) == 17
    for s, (g, r, h) in enumerate(zip(got, recomputed[:17], smollm2_transformers_steps, strict=True)):
        assert_close(g, r, rel_tol(r), f"step {s} vs recomputation")
        assert_close(g, h, rel_tol(h), f"step {s} vs transformers")


@pytest.mark.parametrize("make", DESIGNS)
@pytest.mark.parametrize("name", TINY)
def test_prefill_stores_the_keys_and_values_transformers_stores(name, make):
    model = tiny(name)
    ids = torch.tensor([random_ids(40, model.config.vocab_size, seed=5)])
    cache = make(model.config)
    forward_cached(ids, model.weights, model.config, cache)
    with torch.inference_mode():
        theirs = to_transformers(model)(ids, use_cache=True).past_key_values.layers  # post-RoPE for Llama
    for i, ((k, v), layer) in enumerate(zip(stored(cache), theirs, strict=True)):
        assert_close(k, layer.keys, TINY_ATOL, f"keys of layer {i}")
        assert_close(v, layer.values, TINY_ATOL, f"values of layer {i}")


# ---- chunked prefill: any chunking gives the one-shot result ------------------------------------------------

def prefill_in_chunks(model, cache, ids, chunk):  # ids [B, T] -> logits [B, T, V]
    parts = [forward_cached(ids[:, s:s + chunk], model.weights, model.config, cache)
             for s in range(0, ids.shape[1], chunk)]
    return torch.cat(parts, dim=1)


@pytest.mark.parametrize("chunk", [1, 7, 64])
@pytest.mark.parametrize("make", DESIGNS)
@pytest.mark.parametrize("name", TINY)
def test_chunked_prefill_equals_one_shot(name, make, chunk):
    model = tiny(name)
    ids = torch.tensor([random_ids(150, model.config.vocab_size, seed=6)])
    one_shot_cache, chunked_cache = make(model.config), make(model.config)
    one_shot = forward_cached(ids, model.weights, model.config, one_shot_cache)
    chunked = prefill_in_chunks(model, chunked_cache, ids, chunk)
    assert one_shot_cache.length == chunked_cache.length == 150
    assert_close(chunked, one_shot, TINY_ATOL, "logits, chunked vs one-shot")
    assert_close(chunked, forward(ids, model.weights, model.config), TINY_ATOL, "logits vs recomputation")
    for i, ((k, v), (k1, v1)) in enumerate(zip(stored(chunked_cache), stored(one_shot_cache), strict=True)):
        assert_close(k, k1, TINY_ATOL, f"keys of layer {i}")
        assert_close(v, v1, TINY_ATOL, f"values of layer {i}")


def test_chunked_prefill_equals_one_shot_smollm2(smollm2):
    # chunks of 64 into a StaticCache against one shot into a ConcatCache and against recomputation
    ids = torch.tensor([passages(smollm2.tokenizer, 150, 1, seed=1)[0]])
    w, cfg = smollm2.weights, smollm2.config
    with torch.inference_mode():
        want = forward(ids, w, cfg)
        one_shot_cache, chunked_cache = ConcatCache(cfg), StaticCache(cfg, max_tokens=150)
        one_shot = forward_cached(ids, w, cfg, one_shot_cache)
        chunked = prefill_in_chunks(smollm2, chunked_cache, ids, 64)
    assert_close(chunked, one_shot, rel_tol(one_shot), "logits, chunked vs one-shot")
    assert_close(chunked, want, rel_tol(want), "logits vs recomputation")
    for i, ((k, v), (k1, v1)) in enumerate(zip(stored(chunked_cache), stored(one_shot_cache), strict=True)):
        assert_close(k, k1, rel_tol(k1), f"keys of layer {i}")
        assert_close(v, v1, rel_tol(v1), f"values of layer {i}")


# ---- batches: three sequences together equal each alone ---------------------------------------------------

@pytest.mark.parametrize("make", DESIGNS)
@pytest.mark.parametrize("name", TINY)
def test_batch_of_three_equals_each_alone(name, make):
    model, B = tiny(name), 3
    w, cfg = model.weights, model.config
    ids = torch.tensor([random_ids(12 + 10, cfg.vocab_size, seed=10 + b) for b in range(B)])  # [3, 22]
    batch_cache = make(cfg, B)
    together = [forward_cached(ids[:, :12], w, cfg, batch_cache)]  # prefill, then 10 decode steps
    together += [forward_cached(ids[:, t:t + 1], w, cfg, batch_cache) for t in range(12, 22)]
    for b in range(B):
        alone_cache = make(cfg, 1)
        alone = [forward_cached(ids[b:b + 1, :12], w, cfg, alone_cache)]
        alone += [forward_cached(ids[b:b + 1, t:t + 1], w, cfg, alone_cache) for t in range(12, 22)]
        for s, (x, y) in enumerate(zip(together, alone, strict=True)):
            assert_close(x[b:b + 1], y, TINY_ATOL, f"sequence {b}, step {s}")
        for i, ((k, v), (k1, v1)) in enumerate(zip(stored(batch_cache), stored(alone_cache), strict=True)):
            assert_close(k[b:b + 1], k1, TINY_ATOL, f"sequence {b}, keys of layer {i}")
            assert_close(v[b:b + 1], v1, TINY_ATOL, f"sequence {b}, values of layer {i}")
    assert_close(together[-1][:, -1], forward(ids, w, cfg)[:, -1], TINY_ATOL, "last step vs recomputation")


# ---- the backend never reuses a cache that a failed call left behind ------------------------------------------

class FailingCache(ConcatCache):
    """A ConcatCache whose next update of the last layer raises, once armed: a step that fails half-way."""

    armed = False

    def update(self, layer, k, v):
        if self.armed and layer == self.n_layers - 1:
            self.armed = False
            raise RuntimeError("injected failure in the last layer")
        return super().update(layer, k, v)


def test_backend_discards_a_half_updated_cache():
    model = tiny("tiny-llama")
    ids = random_ids(12, 320, seed=20)
    made = []

    def factory():
        made.append(FailingCache(model.config))
        return made[-1]

    backend = CachedBackend(model, factory)
    backend.next_logits(ids[:10])
    made[-1].armed = True
    with pytest.raises(RuntimeError, match="injected"):
        backend.next_logits(ids[:11])
    assert made[-1].pending[0] == 1  # the failed step did leave layer 0 half-updated
    got = backend.next_logits(ids[:11])
    assert len(made) == 2 and backend.cache is made[1]  # a new cache, not the half-updated one
    assert (backend.hits, backend.misses, backend.calls) == (0, 2, 2)
    assert_close(got, forward(torch.tensor([ids[:11]]), model.weights, model.config)[0, -1], TINY_ATOL)
    assert_close(backend.next_logits(ids), forward(torch.tensor([ids]), model.weights, model.config)[0, -1],
                 TINY_ATOL)  # and it keeps going from there (a hit)
    assert backend.hits == 1


def test_backend_after_a_full_static_cache_starts_over():
    model = tiny("tiny-llama")
    ids = random_ids(21, 320, seed=21)
    backend = CachedBackend(model, lambda: StaticCache(model.config, max_tokens=20))
    for n in range(17, 21):
        backend.next_logits(ids[:n])  # 17 (miss), 18, 19, 20 (hits)
    full = backend.cache
    with pytest.raises(CacheFullError, match="capacity 20"):
        backend.next_logits(ids)  # 21 positions
    got = backend.next_logits(ids[:15])
    assert backend.cache is not full
    assert (backend.hits, backend.misses, backend.calls) == (3, 2, 5)
    assert_close(got, forward(torch.tensor([ids[:15]]), model.weights, model.config)[0, -1], TINY_ATOL)
