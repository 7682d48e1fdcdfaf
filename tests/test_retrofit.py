"""Retrofits (lab.models.retrofit, chapter 10): fewer KV heads, a latent, local layers, shared layers, and
every cache, the serving engine and the byte counts following them.

Oracles: the original model's uncached forward (for settings that must not change the function); each
retrofit's own uncached forward, `lab.models.forward`, which for a retrofit is `retrofit.forward`, written
apart from the cached `retrofit.block` (a latent reconstructed into keys and values there, attended to in
latent space here; a local layer masked there, windowed by the cache here); the same forward with a window
on every layer, for an evicting cache that keeps a sliding window; numbers worked out by hand for bytes.

Tolerances. All in float32 on a 4-layer tiny model whose logits are below 1 in magnitude (about 0.66 at
most, std 0.16). The cached and the uncached forward add the same terms in different orders (other matrix
shapes; (U^T q) . c instead of q . (U c) for a latent), which costs a few 1e-7 (measured: at most 3e-7):
ATOL = 1e-5 leaves a margin of 30. A full-rank latent is an orthonormal change of basis (eigh in float64,
rounded once to float32), so it too reproduces the model to float rounding: the same ATOL. Settings that
keep the model as trained (`config.as_trained`) run the very same code on the same weights: exactly equal.
Greedy tokens must be identical, and every oracle asserts that its top-two gap is at least GAP = 10 x ATOL,
so a difference in tokens is a bug, never a near tie flipped by rounding. An 8-bit per-token quantized
cache moves logits by about 1e-3 here: QUANT_ATOL = 0.05 is loose on purpose (it catches a broken
quantizer path, not a worse grid), and the difference must also exceed ATOL, proving the quantizer ran.
"""

import dataclasses
import random

import pytest
import torch

from lab.cache import (
    CacheInputError,
    CacheMismatchError,
    CacheStateError,
    ConcatCache,
    EvictingCache,
    PagedCache,
    QuantizedCache,
    StaticCache,
    cache_bytes,
)
from lab.engine import ServingEngine
from lab.models import KNOWN, ModelConfig, forward, forward_cached, load, random_model
from lab.models.retrofit import RetrofitError, latent_kv, local_layers, pool_kv_heads, share_kv

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

ATOL = 1e-5          # cached vs uncached, absorbed vs reconstructing, full-rank latent (module docstring)
GAP = 1e-4           # 10 x ATOL: the smallest top-two gap an oracle accepts
QUANT_ATOL = 0.05    # 8-bit per-token cache vs float (module docstring)
MAX_TOKENS = 64      # StaticCache and PagedCache capacity: the longest sequence here is 48
CHUNKS = (9, 1, 5, 13)                # a 28-token prompt in uneven chunks, a single token among them
NEW_TOKENS = 12
DESIGNS = {"concat": lambda cfg: ConcatCache(cfg),
           "static": lambda cfg: StaticCache(cfg, MAX_TOKENS),
           "paged": lambda cfg: PagedCache(cfg, MAX_TOKENS, page_size=4)}
# every retrofit, and the cache it should hold per position: (cache layers, heads, dim)
LAYOUTS = {"pool1": (4, 1, 16), "latent8": (4, 1, 4), "local8s2": (4, 2, 16), "share2": (2, 2, 16),
           "share2+latent16": (2, 1, 8), "local+latent16": (4, 1, 8)}
NAMES = list(LAYOUTS)
_greedy = {}


def ids_of(n, seed):
    rng = random.Random(seed)
    return [rng.randrange(320) for _ in range(n)]


def tensor(ids):
    return torch.tensor([ids])


def assert_close(got, want, atol, what="logits"):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got - want).abs().max().item()
    assert err <= atol, f"{what}: max |difference| {err:.3g} > {atol:.3g}"


@pytest.fixture(scope="module")
def base():
    """tiny-llama with 4 layers (2 KV heads of 16, 4 query heads), so that sharing and local layers have
    layers to work on."""
    cfg = dataclasses.replace(load("tiny-llama").config, n_layers=4, name="tiny4")
    return random_model(cfg, seed=1)


@pytest.fixture(scope="module")
def calib():
    return [ids_of(48, seed) for seed in (100, 101, 102)]


@pytest.fixture(scope="module")
def four_kv_heads():
    """tiny-llama with 4 KV heads (multi-head): room to pool 4 -> 2, and 3 does not divide 4."""
    cfg = dataclasses.replace(load("tiny-llama").config, n_heads=4, n_kv_heads=4, name="tiny-mha")
    return random_model(cfg, seed=2)


@pytest.fixture(scope="module")
def retrofits(base, calib):
    """Every retrofit under test, built once: name -> Model (LAYOUTS lists what each cache holds)."""
    return {"pool1": pool_kv_heads(base, 1),
            "latent8": latent_kv(base, 8, calib),
            "local8s2": local_layers(base, 8, 2, sinks=2),
            "share2": share_kv(base, 2),
            "share2+latent16": latent_kv(share_kv(base, 2), 16, calib),
            "local+latent16": latent_kv(local_layers(base, 8, 4, sinks=1), 16, calib)}


def greedy_uncached(model, prompt, n):
    """Greedy tokens from the model's own uncached forward, the logits of the last such forward (every
    position of prompt + tokens[:-1]), and the smallest top-two gap; fails on a near tie."""
    key = (model.name, tuple(prompt), n)
    if key not in _greedy:
        ids, gap = list(prompt), float("inf")
        with torch.inference_mode():
            for _ in range(n):
                logits = forward(tensor(ids), model.weights, model.config)       # [1, T, V]
                top = logits[0, -1].topk(2).values
                gap = min(gap, float(top[0] - top[1]))
                ids.append(int(logits[0, -1].argmax()))
        _greedy[key] = ids[len(prompt):], logits, gap
    tokens, logits, gap = _greedy[key]
    assert gap > GAP, f"{model.name}: near tie (top-two gap {gap:.2e}); pick another prompt"
    return tokens, logits


def run_cached(model, cache, prompt, chunks, n):
    """Prefill `prompt` in `chunks`, then greedy decode one token at a time: tokens and all the logits."""
    outs, at = [], 0
    with torch.inference_mode():
        for size in chunks:
            outs.append(forward_cached(tensor(prompt[at:at + size]), model.weights, model.config, cache))
            at += size
        assert at == len(prompt)
        tokens = [int(outs[-1][0, -1].argmax())]
        for _ in range(n - 1):
            outs.append(forward_cached(tensor(tokens[-1:]), model.weights, model.config, cache))
            tokens.append(int(outs[-1][0, -1].argmax()))
    return tokens, torch.cat(outs, 1)


PROMPT = ids_of(sum(CHUNKS), seed=14)            # seed picked for top-two gaps > 1e-3


# ---- 1. identity settings are the model ----
@pytest.mark.parametrize("setting", ["pool_same", "share1", "global_every1", "window_ge_context", "latent_full"])
def test_identity_settings_compute_the_original_model(setting, base, calib):
    """Each retrofit at its identity setting gives the original logits: exactly where the config stays as
    trained (the same code on equal weights), within ATOL where another path computes them (a masked local
    layer, a full-rank orthonormal latent) - uncached, and cached through a StaticCache."""
    cfg, x = base.config, tensor(PROMPT)
    model = {"pool_same": lambda: pool_kv_heads(base, cfg.n_kv_heads),
             "share1": lambda: share_kv(base, 1),
             "global_every1": lambda: local_layers(base, 4, 1, sinks=1),
             "window_ge_context": lambda: local_layers(base, len(PROMPT), 2, sinks=3),
             "latent_full": lambda: latent_kv(base, 2 * cfg.n_kv_heads * cfg.head_dim, calib)}[setting]()
    want = forward(x, base.weights, cfg)
    got = forward(x, model.weights, model.config)
    if setting in ("pool_same", "share1", "global_every1"):
        assert model.config.as_trained
        assert torch.equal(got, want)
    else:
        assert not model.config.as_trained          # the retrofit's own forward ran, not the original's
        assert_close(got, want, ATOL)
    cache = StaticCache(model.config, MAX_TOKENS)
    assert_close(forward_cached(x, model.weights, model.config, cache), want, ATOL, "cached logits")


def test_latent_basis_is_orthonormal(retrofits, base):
    """U_k^T U_k = U_v^T U_v = I for every cache layer's bases (float32 rounding of a float64 eigh: 1e-6), one
    pair per cache layer, stored under the cache layer's lowest model layer, rank / 2 columns each."""
    for name, layers in (("latent8", (0, 1, 2, 3)), ("share2+latent16", (0, 2))):
        w = retrofits[name].weights
        for part in ("k_latent", "v_latent"):
            names = sorted(k for k in w if k.endswith(part))
            assert names == [f"model.layers.{i}.self_attn.{part}" for i in layers]
            for k in names:
                U = w[k]
                assert U.shape == (base.config.n_kv_heads * base.config.head_dim, retrofits[name].config.kv_rank // 2)
                assert_close(U.T @ U, torch.eye(U.shape[1]), 1e-6, f"{name} {k}: U^T U")


def test_pooling_averages_neighbouring_heads(four_kv_heads):
    """Pooling 4 KV heads to 2 averages heads (0, 1) and (2, 3), and query heads 0, 1 read the first: on a
    model whose heads 0 and 1 (and 2 and 3) have equal key and value projections, it is the same function
    (ATOL: grouped attention adds in another order). Pairing other heads, or the queries with the wrong
    pooled head, would change the logits by far more (checked: swapping the pairs moves them > 1e-3)."""
    w, D = dict(four_kv_heads.weights), four_kv_heads.config.head_dim
    for i in range(four_kv_heads.config.n_layers):
        for x in "kv":
            name = f"model.layers.{i}.self_attn.{x}_proj.weight"
            t = w[name].clone().view(2, 2, D, -1)
            t[:, 1] = t[:, 0]                                        # head 1 = head 0, head 3 = head 2
            w[name] = t.flatten(0, 2)
    paired = dataclasses.replace(four_kv_heads, weights=w)
    x = tensor(PROMPT)
    want = forward(x, w, paired.config)
    pooled = pool_kv_heads(paired, 2)
    assert_close(forward(x, pooled.weights, pooled.config), want, ATOL)
    swapped = dict(pooled.weights)                                   # the two pooled heads exchanged
    for i in range(pooled.config.n_layers):
        for x_ in "kv":
            name = f"model.layers.{i}.self_attn.{x_}_proj.weight"
            swapped[name] = swapped[name].view(2, D, -1).flip(0).flatten(0, 1)
    assert (forward(x, swapped, pooled.config) - want).abs().max() > 1e-3


def test_shared_layers_read_the_lowest_layers_cache(retrofits):
    """share2: layers 1 and 3 read the keys and values layers 0 and 2 wrote, so their own key and value
    projections are unused (changing them changes nothing, exactly), while layer 0's are used."""
    model, x = retrofits["share2"], tensor(PROMPT)
    want = forward(x, model.weights, model.config)
    for layer, used in ((1, False), (3, False), (0, True), (2, True)):
        w = dict(model.weights)
        name = f"model.layers.{layer}.self_attn.k_proj.weight"
        w[name] = w[name] * 3
        uncached = forward(x, w, model.config)
        cached = forward_cached(x, w, model.config, ConcatCache(model.config))
        if used:
            assert (uncached - want).abs().max() > 1e-3
            assert_close(cached, uncached, ATOL)
        else:
            assert torch.equal(uncached, want)
            assert_close(cached, want, ATOL)


def test_latent_basis_is_the_principal_directions(base, calib):
    """U_k and U_v hold the calibration's principal directions of the keys (after RoPE) and of the values,
    largest first: a rank-8 latent's bases are the first 4 columns of the rank-16 one's (up to sign), and
    each keeps more of the calibration's energy than 4 random orthonormal directions do."""
    w8, w16 = latent_kv(base, 8, calib).weights, latent_kv(base, 16, calib).weights
    cache = ConcatCache(base.config)
    forward_cached(tensor(calib[0]), base.weights, base.config, cache)
    R = torch.linalg.qr(torch.randn(32, 4, generator=torch.Generator().manual_seed(0)))[0]
    for part, held in (("k_latent", cache.keys[0]), ("v_latent", cache.values[0])):
        U8, U16 = (w[f"model.layers.0.self_attn.{part}"] for w in (w8, w16))
        assert_close((U8.T @ U16[:, :4]).abs(), torch.eye(4), 1e-4, f"{part}: U8 against U16's first columns")
        x = held[0].transpose(0, 1).flatten(1)                                       # [T, H_kv D = 32]
        assert (x @ U8).square().sum() > (x @ R).square().sum()


# ---- 2. absorbed (cached) vs reconstructing (uncached) latent ----
@pytest.mark.parametrize("share", [1, 2])
@pytest.mark.parametrize("rank", [2, 8, 16, 32, 64])
def test_absorbed_latent_matches_reconstructing_form(rank, share, base, calib):
    """The cached forward attends in latent space ((U_k^T q) . c, outputs expanded by U_v); the uncached one
    rebuilds keys and values as U c. Equal up to summation order: ATOL (module docstring). Below full rank
    the latent really changes the model (by far more than ATOL), so the agreement is not the trivial one."""
    src = share_kv(base, share) if share > 1 else base
    model = latent_kv(src, rank, calib)
    x = tensor(PROMPT)
    want = forward(x, model.weights, model.config)
    got = forward_cached(x, model.weights, model.config, StaticCache(model.config, MAX_TOKENS))
    assert_close(got, want, ATOL)
    moved = (want - forward(x, src.weights, src.config)).abs().max().item()
    assert moved < ATOL if rank == 64 else moved > 1e-2


# ---- 3. every retrofit under every cache design ----
@pytest.mark.parametrize("design", list(DESIGNS))
@pytest.mark.parametrize("name", NAMES)
def test_cached_forward_matches_uncached(name, design, retrofits):
    """Prefill in uneven chunks (one of a single token), then single-token greedy decodes: every logit
    within ATOL of the retrofit's uncached forward, and the same greedy tokens. The sequence (39 positions)
    is longer than the local window (8 + 2 sinks), so windows and sinks are exercised in every design."""
    model = retrofits[name]
    want_tokens, want = greedy_uncached(model, PROMPT, NEW_TOKENS)
    cache = DESIGNS[design](model.config)
    tokens, got = run_cached(model, cache, PROMPT, CHUNKS, NEW_TOKENS)
    assert tokens == want_tokens
    assert_close(got, want, ATOL)
    assert cache.length == len(PROMPT) + NEW_TOKENS - 1


# ---- 4. the serving engine ----
ENGINE_PROMPTS = [ids_of(n, seed=50 + n) for n in (5, 17, 30, 9)]


@pytest.mark.parametrize("name", NAMES)
def test_engine_gives_each_request_its_uncached_greedy_tokens(name, retrofits):
    """Four prompts of different lengths, batched, prefill chunked by max_batch_tokens=8, pages of 4: each
    request's tokens are exactly those of the retrofit's own uncached forward on that prompt alone."""
    model = retrofits[name]
    want = [greedy_uncached(model, p, 10)[0] for p in ENGINE_PROMPTS]
    engine = ServingEngine(model, num_pages=64, page_size=4, max_batch_tokens=8)
    assert engine.generate(ENGINE_PROMPTS, 10) == want
    assert max(len(t["chunks"]) for t in engine.timeline()) > 1           # prefill really was chunked
    assert max(engine.stats["batch_sizes"]) > 1                            # requests really were batched


@pytest.mark.parametrize("name", ["local+latent16", "share2"])
def test_engine_preemption_and_prefix_pages_keep_the_tokens(name, retrofits):
    """A pool too small for all four requests (preempted and recomputed), and a second call that reuses the
    first call's named pages: the tokens stay the uncached greedy ones."""
    model = retrofits[name]
    want = [greedy_uncached(model, p, 10)[0] for p in ENGINE_PROMPTS]
    tight = ServingEngine(model, num_pages=14, page_size=4, max_batch_tokens=8)
    assert tight.generate(ENGINE_PROMPTS, 10) == want
    assert tight.stats["preemptions"] > 0
    roomy = ServingEngine(model, num_pages=64, page_size=4, max_batch_tokens=8)
    assert roomy.generate(ENGINE_PROMPTS, 10) == want
    assert roomy.generate(ENGINE_PROMPTS, 10) == want
    assert roomy.stats["cached_tokens"] > 0


# ---- 5. bytes ----
@pytest.mark.parametrize("name", NAMES)
def test_caches_hold_what_kv_layout_says(name, retrofits):
    """kv_layout is the table above; every contiguous cache holds exactly layout x positions x 4 bytes x 2
    (keys and values): StaticCache for its capacity, ConcatCache for what it was given (after a prefill and
    after a decode), PagedCache for its whole pool whatever it holds."""
    cfg = retrofits[name].config
    layers, heads, dim = cfg.kv_layout
    assert (layers, heads, dim) == LAYOUTS[name]
    per_position = 2 * layers * heads * dim * 4                       # float32
    assert cfg.kv_bytes_per_position() == per_position
    N = 50
    assert StaticCache(cfg, N).nbytes() == cache_bytes(cfg, N) == N * per_position
    model, x = retrofits[name], tensor(PROMPT)
    concat, paged = ConcatCache(cfg), PagedCache(cfg, MAX_TOKENS, page_size=4)
    assert paged.nbytes() == MAX_TOKENS * per_position
    for cache in (concat, paged):
        forward_cached(x, model.weights, cfg, cache)
        forward_cached(x[:, :1], model.weights, cfg, cache)
    assert concat.nbytes() == (len(PROMPT) + 1) * per_position
    assert paged.nbytes() == MAX_TOKENS * per_position


SMOLLM2 = ModelConfig(arch="llama", n_layers=30, d_model=576, n_heads=9, n_kv_heads=3, head_dim=64,
                      dtype="bfloat16")


@pytest.mark.parametrize("fields,expected", [
    ({}, 23_040),                                  # 2 x 30 layers x 3 heads x 64 x 2 bytes
    ({"kv_rank": 96}, 30 * 96 * 2),                # one latent of 96 per layer: 5,760
    ({"kv_share": 2}, 23_040 // 2),                # 15 cache layers
    ({"n_kv_heads": 1}, 23_040 // 3),              # multi-query
    ({"kv_share": 2, "kv_rank": 96}, 15 * 96 * 2),
], ids=["as_trained", "latent96", "share2", "mqa", "share2+latent96"])
def test_published_bytes_per_position(fields, expected):
    """The chapter's figures for SmolLM2's shape in bfloat16, and the same in float32 (twice as many)."""
    cfg = dataclasses.replace(SMOLLM2, **fields)
    assert cfg.kv_bytes_per_position() == expected
    assert cfg.kv_bytes_per_position(torch.float32) == 2 * expected
    assert cache_bytes(cfg, 1000) == 1000 * expected
    assert cfg.kv_bytes(1000) == 1000 * expected                   # no local layer: every position


def test_kv_bytes_bounds_local_layers_by_window_and_sinks(retrofits):
    """local8s2 (global_every 2): layers 0 and 2 keep at most 8 + 2 positions, layers 1 and 3 every one.
    Per layer and position: 2 x 2 heads x 16 x 4 bytes = 256."""
    cfg = retrofits["local8s2"].config
    assert [cfg.window_of(j) for j in range(4)] == [(8, 2), (0, 0), (8, 2), (0, 0)]
    assert cfg.kv_bytes(5) == 5 * cfg.kv_bytes_per_position() == 5 * 4 * 256    # all within the window
    assert cfg.kv_bytes(10) == 10 * 4 * 256
    assert cfg.kv_bytes(40) == 256 * (2 * 10 + 2 * 40)
    smol = dataclasses.replace(SMOLLM2, window=1024, global_every=6, sinks=4)  # 5 local : 1 global
    per_layer = 23_040 // 30
    assert smol.kv_bytes(100_000) == per_layer * (25 * 1028 + 5 * 100_000)
    assert smol.kv_bytes_per_position() == 23_040                   # a plain cache holds every position


# ---- 6. quantized and evicting caches ----
@pytest.mark.parametrize("name", ["latent8", "local8s2", "share2"])
def test_quantized_cache_is_close_to_the_float_cache(name, retrofits):
    """An 8-bit per-token cache: logits within QUANT_ATOL of the float ones, but not within ATOL (the
    quantizer really rounded what the retrofit stores)."""
    model = retrofits[name]
    _, want = greedy_uncached(model, PROMPT, NEW_TOKENS)
    ids = PROMPT + greedy_uncached(model, PROMPT, NEW_TOKENS)[0][:-1]
    cache = QuantizedCache(model.config, bits=8, scheme="per_token")
    with torch.inference_mode():
        got = torch.cat([forward_cached(tensor(ids[:28]), model.weights, model.config, cache)]
                        + [forward_cached(tensor(ids[t:t + 1]), model.weights, model.config, cache)
                           for t in range(28, len(ids))], 1)
    err = (got - want).abs().max().item()
    assert ATOL < err < QUANT_ATOL, f"{name}: max |difference| {err:.3g}"


@pytest.mark.parametrize("policy,budget,sinks", [("window", 12, 0), ("sinks", 12, 3)])
@pytest.mark.parametrize("name", ["share2", "share2+latent16"])
def test_evicting_cache_is_a_sliding_window(name, policy, budget, sinks, retrofits):
    """Decoding token by token after a prefill within the budget, an evicting cache that keeps the first
    `sinks` and the most recent positions is a local layer everywhere: each query sees its own position, the
    last budget - sinks before it and the sinks. For a model that shares every 2 layers, global_every=2
    makes every cache layer local, so the oracle is the uncached forward with that window: within ATOL.
    It holds the budget's positions and bytes, no more."""
    model = retrofits[name]
    x = tensor(ids_of(40, seed=5))
    kwargs = {"sinks": sinks} if policy == "sinks" else {}
    cache = EvictingCache(model.config, budget, policy, **kwargs)
    with torch.inference_mode():
        got = torch.cat([forward_cached(x[:, :10], model.weights, model.config, cache)]
                        + [forward_cached(x[:, t:t + 1], model.weights, model.config, cache) for t in range(10, 40)], 1)
    window = dataclasses.replace(model.config, window=budget - sinks + 1, global_every=2, sinks=sinks)
    assert all(window.window_of(j)[0] for j in range(window.kv_layout[0]))   # every cache layer local
    assert_close(got, forward(x, model.weights, window), ATOL)
    assert (got - forward(x, model.weights, model.config)).abs().max() > 1e-2  # eviction changed the result
    assert cache.held == budget and cache.nbytes() == budget * model.config.kv_bytes_per_position()


@pytest.mark.parametrize("name", ["latent8", "share2", "share2+latent16", "pool1"])
def test_evicting_cache_with_room_is_the_model(name, retrofits):
    """A budget no sequence reaches evicts nothing: the cached logits are the uncached ones (ATOL)."""
    model = retrofits[name]
    _, want = greedy_uncached(model, PROMPT, NEW_TOKENS)
    ids = PROMPT + greedy_uncached(model, PROMPT, NEW_TOKENS)[0][:-1]
    for policy in ("window", "sinks"):
        cache = EvictingCache(model.config, 64, policy)
        with torch.inference_mode():
            got = torch.cat([forward_cached(tensor(ids[:28]), model.weights, model.config, cache)]
                            + [forward_cached(tensor(ids[t:t + 1]), model.weights, model.config, cache)
                               for t in range(28, len(ids))], 1)
        assert_close(got, want, ATOL, f"{policy} logits")


@pytest.mark.parametrize("name,kwargs", [
    ("local8s2", dict(policy="window")),
    ("local8s2", dict(policy="sinks")),
    ("local+latent16", dict(policy="sinks")),
    ("share2", dict(policy="h2o")),
    ("latent8", dict(policy="h2o")),
    ("latent8", dict(policy="snapkv", observation=4)),
    ("share2", dict(policy="window", rerotate=True)),
])
def test_evicting_cache_refuses_what_it_cannot_keep(name, kwargs, retrofits):
    """Local layers count their window in positions an evicting cache no longer has; h2o and snapkv score
    per KV head and rerotate renumbers positions, which a latent or a shared cache does not fit."""
    with pytest.raises(CacheInputError):
        EvictingCache(retrofits[name].config, 16, **kwargs)


def test_evicting_cache_policies_still_run_on_the_original_model(base):
    """The refusals above are the retrofits': the original model still takes h2o and rerotate."""
    for kwargs in (dict(policy="h2o"), dict(policy="window", rerotate=True)):
        cache = EvictingCache(base.config, 16, **kwargs)
        out = forward_cached(tensor(PROMPT), base.weights, base.config, cache)
        assert out.shape == (1, len(PROMPT), base.config.vocab_size) and cache.held == 16


# ---- 7. typed errors ----
BAD = {
    "rank 0": lambda m, c: latent_kv(m, 0, c),
    "rank above 2 x kv_heads x head_dim": lambda m, c: latent_kv(m, 66, c),
    "rank odd": lambda m, c: latent_kv(m, 7, c),
    "rank not an int": lambda m, c: latent_kv(m, 8.0, c),
    "calibration empty": lambda m, c: latent_kv(m, 8, []),
    "calibration of an empty sequence": lambda m, c: latent_kv(m, 8, [[]]),
    "latent twice": lambda m, c: latent_kv(latent_kv(m, 8, c), 8, c),
    "window 0": lambda m, c: local_layers(m, 0, 2),
    "global_every 0": lambda m, c: local_layers(m, 8, 0),
    "global_every above n_layers": lambda m, c: local_layers(m, 8, 5),
    "sinks negative": lambda m, c: local_layers(m, 8, 2, sinks=-1),
    "local twice": lambda m, c: local_layers(local_layers(m, 8, 2), 4, 2),
    "kv_heads 0": lambda m, c: pool_kv_heads(m, 0),
    "kv_heads above the model's": lambda m, c: pool_kv_heads(m, 3),
    "pool after share": lambda m, c: pool_kv_heads(share_kv(m, 2), 1),
    "share every 0": lambda m, c: share_kv(m, 0),
    "share every above n_layers": lambda m, c: share_kv(m, 5),
    "share after latent": lambda m, c: share_kv(latent_kv(m, 8, c), 2),
}


@pytest.mark.parametrize("what", list(BAD))
def test_bad_settings_raise_retrofit_error(what, base, calib):
    with pytest.raises(RetrofitError):
        BAD[what](base, calib)


def test_retrofit_error_is_a_value_error(four_kv_heads):
    """A ValueError, so callers that catch bad arguments catch it; kv_heads must divide the KV heads."""
    assert issubclass(RetrofitError, ValueError)
    with pytest.raises(ValueError, match="divide"):
        pool_kv_heads(four_kv_heads, 3)
    assert pool_kv_heads(four_kv_heads, 2).config.kv_layout == (2, 2, 16)


@pytest.mark.parametrize("retrofit", ["pool", "latent", "local", "share", "share1"])
def test_gpt2_is_refused(retrofit, calib):
    """GPT-2 has learned positions and no grouped KV heads: every retrofit refuses it, even an identity."""
    assert "tiny-gpt2" in KNOWN
    gpt2 = load("tiny-gpt2")
    make = {"pool": lambda: pool_kv_heads(gpt2, 2), "latent": lambda: latent_kv(gpt2, 8, calib),
            "local": lambda: local_layers(gpt2, 8, 2), "share": lambda: share_kv(gpt2, 2),
            "share1": lambda: share_kv(gpt2, 1)}[retrofit]
    with pytest.raises(RetrofitError, match="Llama"):
        make()


@pytest.mark.parametrize("design", ["concat", "static", "paged", "quantized"])
@pytest.mark.parametrize("pair", [("base", "local8s2"), ("local8s2", "base"), ("base", "latent8"),
                                  ("latent8", "base"), ("base", "share2"), ("pool1", "share2+latent16"),
                                  ("local8s2", "local+latent16")])
def test_a_cache_refuses_another_layout_or_rules(pair, design, base, retrofits):
    """A cache built for one model refuses the other, in both directions: another layout (fewer heads, a
    latent, fewer cache layers) or other rules (local windows on the original's shape), before it stores
    anything."""
    built, used = (base if n == "base" else retrofits[n] for n in pair)
    make = dict(DESIGNS, quantized=lambda cfg: QuantizedCache(cfg, bits=8))[design]
    cache = make(built.config)
    with pytest.raises(CacheMismatchError):
        forward_cached(tensor(PROMPT[:5]), used.weights, used.config, cache)
    assert cache.max_length == 0                                  # refused before anything was stored


@pytest.mark.parametrize("design", list(DESIGNS))
def test_same_layout_other_rules_is_refused(design, base, calib, retrofits):
    """pool1 and a latent of 32 hold the same (4, 1, 16) per position, the original and local8s2 the same
    (4, 2, 16): only the rules (a latent, windows) tell them apart, and the cache does."""
    for built, used in ((retrofits["pool1"], latent_kv(base, 32, calib)), (base, retrofits["local8s2"])):
        assert built.config.kv_layout == used.config.kv_layout
        with pytest.raises(CacheMismatchError):
            forward_cached(tensor(PROMPT[:5]), used.weights, used.config, DESIGNS[design](built.config))


# ---- 8. a shared read out of order ----
SHARED_DESIGNS = dict(DESIGNS, quantized=lambda cfg: QuantizedCache(cfg, bits=8),
                      evicting=lambda cfg: EvictingCache(cfg, 16, "window"))


@pytest.mark.parametrize("design", list(SHARED_DESIGNS))
def test_shared_read_before_the_store_is_refused(design, retrofits):
    """share2: layer 1 reads cache layer 0 with attend(0, q, None, None). Before layer 0 stored this step's
    positions, with another number of queries, or after advance, that read would see the wrong positions:
    CacheStateError, and the cache unchanged. After the store it reads exactly what the store attended to."""
    cfg = retrofits["share2"].config
    cache = SHARED_DESIGNS[design](cfg)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, h, 3, 16, generator=g) for h in (4, 2, 2))
    for layer in (0, 1):
        before = cache.version
        with pytest.raises(CacheStateError):
            cache.attend(layer, q, None, None)
        assert cache.version == before and cache.pending == [0, 0]
    with pytest.raises(CacheInputError):
        cache.attend(2, q, None, None)                            # no cache layer 2: share2 has two
    stored = cache.attend(0, q, k, v)
    assert torch.equal(cache.attend(0, q, None, None), stored)
    with pytest.raises(CacheStateError):
        cache.attend(0, q[:, :, :1], None, None)                  # 1 query, 3 positions stored
    with pytest.raises(CacheStateError):
        cache.attend(1, q, None, None)                            # layer 1 has not stored yet
    cache.attend(1, q, k, v)
    cache.advance(3)
    with pytest.raises(CacheStateError):
        cache.attend(0, q, None, None)                            # a new step: nothing stored yet


def test_shared_read_before_the_store_is_refused_in_a_serving_step(retrofits):
    """The engine's StepBatch makes the same check."""
    pool = PagedCache(retrofits["share2"].config, MAX_TOKENS, page_size=4)
    seq = pool.new_id()
    pool.reserve([(seq, 3)])
    step = pool.plan_step([(seq, 3)])
    with pytest.raises(CacheStateError):
        step.attend(0, torch.zeros(1, 4, 3, 16), None, None)
