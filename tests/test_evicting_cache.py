"""lab.cache.evicting: which positions each policy keeps, and that attention over them is right.

Oracles, none of which shares code with the cache:
- ConcatCache, for a budget the sequence never reaches: nothing is evicted, so everything must agree.
- MaskedOracle (below): a ConcatCache that keeps every key ever computed and a bool `alive` per layer,
  KV head and position. It attends with its own float64 softmax over the alive keys and a causal mask
  written out by hand, and after each step chooses the alive positions straight from each policy's
  definition with Python sorts (window: positions >= N - budget; sinks: p < 4 or p >= N - (budget - 4);
  H2O: float64 accumulated attention; SnapKV: votes pooled by Python loops). For rerotate it stores each
  key as computed and turns it, at read time, by one rotation from the slot it was computed at to its
  current slot (lab.models.llama's rope), where the cache turns its stored keys once per eviction.
- Hand computations from full attention matrices (H2O after a long prefill, SnapKV's votes), from the q
  and k a ConcatCache prefill recorded.
- The random tiny models attend almost uniformly, so H2O and SnapKV would rank positions by age alone;
  their tests use the same models with the queries scaled by 50 (`sharp`), whose heads choose differently.
- Layer 0's keys depend only on the token and its position: a ConcatCache prefill of the kept tokens at
  positions 0..n-1 recomputes them from scratch.

Tolerances. fp32 rounds ~1e-7 relative per op. The oracle adds the same terms as the cache in another
order and precision (float64, a masked row over every position instead of the held keys): on the tiny
models (2 layers, logits and keys of order 1) a few 1e-7, so 1e-5 absolute, as in tests/test_cache.py.
H2O's scores are sums of at most ~60 probabilities (<= 1 each) accumulated in float32: 1e-5 absolute.
Rerotated keys: the cache's chain of rotations (each in float64, rounded once to fp32) and the oracle's
single rotation (angles in fp32, as the model computes them: ~6e-8 relative of angles below 64 rad) differ
by ~1e-6 x |key|: 1e-5 absolute for keys of order 1. Without eviction window, sinks and snapkv run the
very same SDPA on the very same tensors as ConcatCache: bit-identical. H2O computes its attention
explicitly (to read the probabilities): 1e-6. Kept sets are compared exactly; every H2O and SnapKV
comparison first asserts that the oracle's choice is not a near tie (a gap over 1e-5 at the boundary,
100 times the rounding of scores of order 1-10 in fp32), so agreement is not luck of rounding.
"""

import math
from types import SimpleNamespace

import pytest
import torch

from lab.cache import CacheError, CacheInputError, CacheStateError, ConcatCache, cache_bytes
from lab.cache.evicting import EvictingCache
from lab.models import PositionLimitError, forward_cached, load
from lab.models.llama import rope, rope_tables

TINY_ATOL = 1e-5      # see the module docstring
SCORE_ATOL = 1e-5
MARGIN = 1e-5         # the smallest gap at a selection boundary that the kept-set comparisons accept
_TINY_MODELS = {}

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def tiny(name):
    if name not in _TINY_MODELS:
        _TINY_MODELS[name] = load(name)
    return _TINY_MODELS[name]


def sharp(name, factor=50.0):
    """A tiny model with its queries scaled by `factor`: the random models attend almost uniformly, so every
    head would rank positions by age alone; sharper attention makes heads (and the choices) differ."""
    model = tiny(name)
    weights = dict(model.weights)
    for i in range(model.config.n_layers):
        if model.config.arch == "llama":
            name = f"model.layers.{i}.self_attn.q_proj.weight"
            weights[name] = weights[name] * factor
        else:  # GPT-2's fused q|k|v: the first d_model columns are the queries
            for part in ("weight", "bias"):
                w = weights[f"transformer.h.{i}.attn.c_attn.{part}"].clone()
                w[..., : model.config.d_model] *= factor
                weights[f"transformer.h.{i}.attn.c_attn.{part}"] = w
    return SimpleNamespace(config=model.config, weights=weights)


def random_ids(n, vocab_size=320, seed=0):
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step(model, cache, tokens, positions=None):
    return forward_cached(torch.tensor([list(tokens)]), model.weights, model.config, cache, positions=positions)


def assert_close(got, want, atol, what="logits"):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.double() - want.double()).abs().max().item()
    assert err <= atol, f"{what}: max |difference| {err:.3g} > {atol:.3g}"


# ---- the oracle ---------------------------------------------------------------------------------------------

def pool_by_hand(row, pool, pooling):
    """A stride-1 pool of width `pool` centred on each element of a list; avg divides by `pool` (the padding
    counts, as F.avg_pool1d does by default), max ignores the padding."""
    r, out = pool // 2, []
    for i in range(len(row)):
        inside = row[max(0, i - r): i + r + 1]
        out.append(sum(inside) / pool if pooling == "avg" else max(inside))
    return out


def snapkv_votes_by_hand(probs, obs, pool, pooling):
    """probs [H_kv, G, T, N] (float64, a prefill's full attention): each KV head's pooled votes for positions
    0..N-obs-1, a list per head, summed over the group's query heads."""
    H, G, T, N = probs.shape
    votes = []
    for h in range(H):
        per_head = [0.0] * (N - obs)
        for g in range(G):
            row = [sum(probs[h, g, t, p].item() for t in range(T - obs, T)) for p in range(N - obs)]
            per_head = [a + b for a, b in zip(per_head, pool_by_hand(row, pool, pooling), strict=True)]
        votes.append(per_head)
    return votes


def best(candidates, priority, k):
    """The k candidates of highest priority, ties to the more recent; and the gap at the boundary."""
    ranked = sorted(candidates, key=lambda p: (priority[p], p), reverse=True)
    kept = ranked[:k]
    gap = math.inf
    if 0 < k < len(ranked) and math.isfinite(priority[ranked[k - 1]]):
        gap = priority[ranked[k - 1]] - priority[ranked[k]]
    return kept, gap


class MaskedOracle(ConcatCache):
    """Every key, a bool `alive` per (layer, KV head, position), float64 attention over the alive ones."""

    def __init__(self, config, policy, budget, sinks=4, window=None, rerotate=False, observation=32, pool=7,
                 pooling="avg"):
        super().__init__(config)
        self.policy, self.budget, self.rerotate, self.sinks = policy, budget, rerotate, sinks
        self.window = budget // 2 if window is None else window
        self.observation, self.pool, self.pooling = observation, pool, pooling
        H, L = config.n_kv_heads, config.n_layers
        self.alive = [torch.zeros(1, H, 0, dtype=torch.bool) for _ in range(L)]
        self.acc = [torch.zeros(1, H, 0, dtype=torch.float64) for _ in range(L)]   # H2O: accumulated attention
        self.priority = [[[] for _ in range(H)] for _ in range(L)]                  # SnapKV: per head, a list
        self.probs = [None] * L      # this step's probabilities [1, H_kv, G, T, N]
        self.births = []             # rerotate: the slot each position was rotated at when computed
        self.gaps = []               # the gap at every H2O / SnapKV selection boundary

    def next_positions(self, T, device=None):
        if not self.rerotate:
            return super().next_positions(T, device)
        n = int(self.alive[0][0, 0].sum())
        self.births += list(range(n, n + T))
        return torch.arange(n, n + T, device=device)

    def at_slots(self, keys, alive):
        """Each alive key turned from the slot it was computed at to its slot now (its rank among the alive)."""
        a = alive[0, 0]                                   # every head keeps the same positions here
        slots = torch.cumsum(a.long(), 0) - 1
        delta = torch.where(a, slots - torch.tensor(self.births), 0)       # [N]
        cos, sin = rope_tables(delta, keys.shape[-1], self.config.rope_theta, torch.float64)
        return rope(keys.double(), cos, sin)

    def attend(self, layer, q, k, v):
        keys, values = self.update(layer, k, v)           # [1, H_kv, N, D]: every position ever seen
        _, H_q, T, D = q.shape
        H, N = keys.shape[1], keys.shape[2]
        alive = torch.cat([self.alive[layer], torch.ones(1, H, T, dtype=torch.bool)], dim=-1)  # [1, H_kv, N]
        keys = self.at_slots(keys, alive) if self.rerotate else keys.double()
        logits = q.double().reshape(1, H, H_q // H, T, D) @ keys[:, :, None].transpose(-1, -2) / math.sqrt(D)
        causal = torch.arange(N)[None, :] <= torch.arange(N - T, N)[:, None]          # [T, N]
        mask = alive[:, :, None, None, :] & causal                                     # [1, H_kv, 1, T, N]
        probs = logits.masked_fill(~mask, -math.inf).softmax(dim=-1)                   # [1, H_kv, G, T, N]
        self.probs[layer] = probs
        return (probs @ values.double()[:, :, None]).reshape(1, H_q, T, D).to(q.dtype)

    def advance(self, t):
        super().advance(t)
        N = self.length
        for i in range(self.n_layers):
            H = self.alive[i].shape[1]
            self.alive[i] = torch.cat([self.alive[i], torch.ones(1, H, t, dtype=torch.bool)], dim=-1)
            self.acc[i] = torch.cat([self.acc[i], torch.zeros(1, H, t, dtype=torch.float64)], -1)
            self.acc[i] += self.probs[i].sum(dim=(2, 3))  # a dead key's probability is exactly 0
            self.snapkv_priorities(i, t)
            for h in range(H):
                live = [p for p in range(N) if self.alive[i][0, h, p]]
                if len(live) > self.budget:
                    keep = set(self.choose(i, h, live, N))
                    assert len(keep) == self.budget and keep <= set(live)
                    for p in live:
                        self.alive[i][0, h, p] = p in keep

    def snapkv_priorities(self, i, t):
        if self.policy != "snapkv":
            return
        probs, H = self.probs[i], self.alive[i].shape[1]
        live = int(self.alive[i][0, 0].sum())
        if t > 1 and live > self.budget:    # an overflowing prefill votes; here every position is alive
            assert live == self.length, "the oracle handles one compression, of a prefill"
            obs = min(self.observation, t)
            votes = snapkv_votes_by_hand(probs[0], obs, self.pool, self.pooling)
            self.priority[i] = [votes[h] + [math.inf] * obs for h in range(H)]
        else:
            self.priority[i] = [self.priority[i][h] + [math.inf] * t for h in range(H)]

    def choose(self, i, h, live, N):
        B = self.budget
        if self.policy == "window":
            return [p for p in live if p >= N - B]
        if self.policy == "sinks":
            return [p for p in live if p < self.sinks or p >= N - (B - self.sinks)]
        if self.policy == "h2o":
            recent = [p for p in live if p >= N - self.window]
            heavy, gap = best([p for p in live if p < N - self.window], self.acc[i][0, h].tolist(), B - len(recent))
            self.gaps.append(gap)
            return recent + heavy
        held = dict(zip(live, self.priority[i][h], strict=True))   # snapkv: positions -> priority
        kept, gap = best(live, held, B)
        self.gaps.append(gap)
        self.priority[i][h] = [held[p] for p in sorted(kept)]
        return kept

    def crop(self, n):
        super().crop(n)
        self.alive = [a[:, :, :n] for a in self.alive]
        self.acc = [a[:, :, :n] for a in self.acc]
        self.births = self.births[:n]

    def kept(self, i):  # [1, H_kv, held] positions alive in layer i
        a = self.alive[i][0]
        return torch.stack([torch.nonzero(a[h])[:, 0] for h in range(a.shape[0])])[None]

    def slot_keys(self, i):  # [1, H_kv, held, D]: the alive keys as the cache should store them
        keys = self.at_slots(self.keys[i], self.alive[i]) if self.rerotate else self.keys[i]
        idx = self.kept(i)
        return keys.gather(2, idx[..., None].expand(-1, -1, -1, keys.shape[-1]))


def run_both(model, cache, oracle, prefill, decode, check_keys=False):
    """Prefill then decode token by token through both; compare logits, kept positions (and keys) each step."""
    steps, differed = [prefill] + [[t] for t in decode], False
    for n, tokens in enumerate(steps):
        got, want = step(model, cache, tokens), step(model, oracle, tokens)
        assert_close(got, want, TINY_ATOL, f"logits of step {n}")
        assert cache.length == oracle.length
        for i in range(model.config.n_layers):
            assert torch.equal(cache.kept_positions[i], oracle.kept(i)), (
                f"step {n}, layer {i}: kept {cache.kept_positions[i].tolist()} != {oracle.kept(i).tolist()}")
            if check_keys:
                assert_close(cache.keys[i], oracle.slot_keys(i), TINY_ATOL, f"keys of step {n}, layer {i}")
        kept = {tuple(p.tolist()) for layer in cache.kept_positions for p in layer[0]}
        differed |= len(kept) > 1
    assert cache.held == cache.budget, "the test never filled the budget"
    return differed  # whether some step's layers or heads kept different positions


# ---- 1. a budget the sequence never reaches -----------------------------------------------------------------

POLICIES = [pytest.param(dict(policy="window"), id="window"),
            pytest.param(dict(policy="sinks"), id="sinks"),
            pytest.param(dict(policy="sinks", rerotate=True), id="sinks-rerotate"),
            pytest.param(dict(policy="window", rerotate=True), id="window-rerotate"),
            pytest.param(dict(policy="h2o"), id="h2o"),
            pytest.param(dict(policy="snapkv", observation=4), id="snapkv")]


@pytest.mark.parametrize("kw", POLICIES)
def test_a_budget_above_the_sequence_equals_concat(kw):
    model = tiny("tiny-llama")
    ids = random_ids(30, seed=1)
    cache, concat = EvictingCache(model.config, 64, **kw), ConcatCache(model.config)
    for tokens in [ids[:12]] + [[t] for t in ids[12:]]:
        got, want = step(model, cache, tokens), step(model, concat, tokens)
        if kw["policy"] == "h2o":  # explicit attention, to read the probabilities: see the module docstring
            assert_close(got, want, 1e-6)
        else:
            assert torch.equal(got, want)
    assert cache.length == cache.held == 30
    for i in range(model.config.n_layers):
        assert torch.equal(cache.kept_positions[i], torch.arange(30).expand(1, 2, 30))
        if kw["policy"] == "h2o":  # layer 1's keys come from layer 0's explicit attention
            assert_close(cache.keys[i], concat.keys[i], 1e-6, "keys")
        else:
            assert torch.equal(cache.keys[i], concat.keys[i]) and torch.equal(cache.values[i], concat.values[i])


def test_prefill_longer_than_the_budget_attends_causally_then_trims():
    model = tiny("tiny-llama")
    ids = random_ids(20, seed=2)
    cache, concat = EvictingCache(model.config, 8), ConcatCache(model.config)
    assert torch.equal(step(model, cache, ids), step(model, concat, ids))   # no eviction inside a step
    assert (cache.length, cache.held) == (20, 8)
    assert torch.equal(cache.kept_positions[0][0, 0], torch.arange(12, 20))
    assert torch.equal(cache.keys[1], concat.keys[1][:, :, 12:])


# ---- 2, 3. window and sinks against the masked oracle -------------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2", "tiny-mqa"])
@pytest.mark.parametrize("policy", ["window", "sinks"])
def test_window_and_sinks_equal_attention_over_exactly_their_positions(name, policy):
    model = tiny(name)
    ids = random_ids(40, seed=3)
    cache = EvictingCache(model.config, 10, policy)
    oracle = MaskedOracle(model.config, policy, 10)
    run_both(model, cache, oracle, ids[:13], ids[13:], check_keys=True)
    want = list(range(30, 40)) if policy == "window" else [0, 1, 2, 3] + list(range(34, 40))
    assert cache.kept_positions[1][0, 0].tolist() == want


def test_next_positions_are_the_tokens_seen_without_rerotation():
    model = tiny("tiny-llama")
    cache = EvictingCache(model.config, 6, "sinks")
    step(model, cache, random_ids(15, seed=4))
    assert cache.held == 6 and torch.equal(cache.next_positions(2), torch.tensor([15, 16]))


# ---- 4. sinks with rerotation ---------------------------------------------------------------------------------

@pytest.mark.parametrize("policy", ["sinks", "window"])
def test_rerotation_equals_one_rotation_from_the_computed_keys(policy):
    model = tiny("tiny-llama")
    ids = random_ids(45, seed=5)
    cache = EvictingCache(model.config, 10, policy, rerotate=True)
    oracle = MaskedOracle(model.config, policy, 10, rerotate=True)
    run_both(model, cache, oracle, ids[:13], ids[13:], check_keys=True)
    assert torch.equal(cache.next_positions(1), torch.tensor([10]))  # contiguous slots: after the 10 held


def test_rerotated_layer_0_keys_equal_keys_computed_at_contiguous_positions():
    # Layer 0's keys depend only on the token and its position: recompute them from scratch, the kept
    # tokens at positions 0..budget-1, and compare with the keys the cache turned into those slots.
    model = tiny("tiny-llama")
    ids = random_ids(50, seed=6)
    cache = EvictingCache(model.config, 12, "sinks", rerotate=True)
    step(model, cache, ids[:20])
    for n, t in enumerate(ids[20:]):
        step(model, cache, [t])
        if n % 7 == 0 or n == 29:
            kept = cache.kept_positions[0][0, 0].tolist()
            fresh = ConcatCache(model.config)
            step(model, fresh, [ids[p] for p in kept], positions=torch.arange(len(kept)))
            assert_close(cache.keys[0], fresh.keys[0], TINY_ATOL, f"layer-0 keys after {21 + n} tokens")
            assert_close(cache.values[0], fresh.values[0], TINY_ATOL, "layer-0 values")
    assert cache.kept_positions[0][0, 0].tolist() == [0, 1, 2, 3] + list(range(42, 50))


# ---- 5. H2O ---------------------------------------------------------------------------------------------------

class Recording(ConcatCache):
    """A ConcatCache that keeps each layer's queries and keys of the last step."""

    def attend(self, layer, q, k, v):
        out = super().attend(layer, q, k, v)
        self.seen = getattr(self, "seen", {})
        self.seen[layer] = q, self.keys[layer]
        return out


def full_attention(q, keys):
    """Causal attention probabilities of a prefill, by hand in float64: [H_kv, G, T, T]."""
    _, H_q, T, D = q.shape
    H = keys.shape[1]
    logits = q.double()[0].reshape(H, H_q // H, T, D) @ keys.double()[0][:, None].transpose(-1, -2) / math.sqrt(D)
    causal = torch.arange(T)[None, :] <= torch.arange(T)[:, None]
    return logits.masked_fill(~causal, -math.inf).softmax(dim=-1)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mqa"])
def test_h2o_after_a_long_prefill_keeps_the_heaviest_columns_of_the_full_attention(name):
    model, budget, window = sharp(name), 12, 4
    ids = random_ids(30, seed=7)
    cache = EvictingCache(model.config, budget, "h2o", window=window)
    rec = Recording(model.config)
    step(model, cache, ids), step(model, rec, ids)
    for i in range(model.config.n_layers):
        acc = full_attention(*rec.seen[i]).sum(dim=(1, 2))     # [H_kv, T]: attention each key received
        for h in range(model.config.n_kv_heads):
            heavy, gap = best(range(30 - window), acc[h].tolist(), budget - window)
            assert gap > MARGIN
            assert cache.kept_positions[i][0, h].tolist() == sorted(heavy) + list(range(30 - window, 30))
            assert_close(cache.scores[i][0, h], acc[h][cache.kept_positions[i][0, h]], SCORE_ATOL, "scores")


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mqa", "tiny-gpt2"])
def test_h2o_while_decoding_equals_brute_force_accumulated_attention(name):
    model = sharp(name)
    ids = random_ids(40, seed=8)
    cache = EvictingCache(model.config, 10, "h2o", window=3)
    oracle = MaskedOracle(model.config, "h2o", 10, window=3)
    differed = run_both(model, cache, oracle, ids[:6], ids[6:], check_keys=True)
    assert differed or model.config.n_kv_heads == 1, "no two heads ever kept different positions"
    assert min(oracle.gaps) > MARGIN
    for i in range(model.config.n_layers):
        assert_close(cache.scores[i], oracle.acc[i].gather(2, oracle.kept(i)), SCORE_ATOL, f"scores, layer {i}")


# ---- 6. SnapKV -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("pool, pooling", [(7, "avg"), (5, "max"), (1, "avg")])
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mqa"])
def test_snapkv_keeps_the_best_pooled_votes_of_the_observation_window(name, pool, pooling):
    model, budget, obs = sharp(name), 14, 5
    ids = random_ids(40, seed=9)
    cache = EvictingCache(model.config, budget, "snapkv", observation=obs, pool=pool, pooling=pooling)
    rec = Recording(model.config)
    step(model, cache, ids), step(model, rec, ids)
    for i in range(model.config.n_layers):
        votes = snapkv_votes_by_hand(full_attention(*rec.seen[i]), obs, pool, pooling)
        for h in range(model.config.n_kv_heads):
            voted, gap = best(range(40 - obs), votes[h], budget - obs)
            assert gap > MARGIN or gap == 0.0  # max pooling copies one vote to its neighbours: exact ties
            assert cache.kept_positions[i][0, h].tolist() == sorted(voted) + list(range(40 - obs, 40))


@pytest.mark.parametrize("pooling", ["avg", "max"])
def test_snapkv_decoding_past_the_budget_drops_the_worst_votes_then_the_oldest(pooling):
    model = sharp("tiny-llama")
    ids = random_ids(50, seed=10)
    cache = EvictingCache(model.config, 12, "snapkv", observation=4, pool=3, pooling=pooling)
    oracle = MaskedOracle(model.config, "snapkv", 12, observation=4, pool=3, pooling=pooling)
    run_both(model, cache, oracle, ids[:25], ids[25:], check_keys=True)  # 25 decode steps: past 8 voted
    assert all(g > MARGIN or g in (0.0, math.inf) for g in oracle.gaps)
    assert cache.kept_positions[0][0, 0].tolist() == list(range(38, 50))  # only decode tokens left: a window


def test_batch_rows_choose_their_own_positions():
    model = tiny("tiny-llama")
    rows = [random_ids(24, seed=11), random_ids(24, seed=12)]
    for kw in (dict(policy="h2o"), dict(policy="snapkv", observation=4)):
        both = EvictingCache(model.config, 9, batch_size=2, **kw)
        got = forward_cached(torch.tensor([r[:16] for r in rows]), model.weights, model.config, both)
        for t in range(16, 24):
            got = forward_cached(torch.tensor([[r[t]] for r in rows]), model.weights, model.config, both)
        for b, row in enumerate(rows):
            alone = EvictingCache(model.config, 9, **kw)
            step(model, alone, row[:16])
            for t in row[16:]:
                want = step(model, alone, [t])
            assert_close(got[b], want[0], TINY_ATOL)
            for i in range(2):
                assert torch.equal(both.kept_positions[i][b], alone.kept_positions[i][0])


# ---- 7. memory ---------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kw", POLICIES)
def test_memory_is_bounded_by_the_budget(kw, dtype):
    model = load("tiny-llama", dtype=dtype)
    ids = random_ids(60, seed=13)
    cache = EvictingCache(model.config, 16, dtype=dtype, **kw)
    step(model, cache, ids[:20])
    for t in ids[20:]:
        step(model, cache, [t])
        # tiny-llama: 2 (K, V) x 2 layers x 2 kv heads x 16 x 4 bytes = 512 bytes per position in fp32
        assert cache.nbytes() == cache_bytes(model.config, 16, dtype=dtype) == 16 * 512 * dtype.itemsize // 4
        held = {x.untyped_storage().data_ptr(): x.untyped_storage().nbytes() for x in cache.keys + cache.values}
        assert sum(held.values()) == cache.nbytes()
    assert all(k.dtype == dtype and k.shape == (1, 2, 16, 16) for k in cache.keys + cache.values)
    assert all(p.shape == (1, 2, 16) for p in cache.kept_positions)


@pytest.mark.parametrize("policy", ["window", "h2o"])
def test_true_positions_stop_at_the_models_context(policy):
    # without rerotation the next token sits at its true position, which GPT-2's table (512 rows here) bounds
    model = tiny("tiny-gpt2")
    cache = EvictingCache(model.config, 16, policy)
    step(model, cache, random_ids(512, seed=24))
    with pytest.raises(PositionLimitError, match=r"513 positions exceed"):
        step(model, cache, [1])
    assert (cache.length, cache.held) == (512, 16)


# ---- 8. bad input -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kw, message", [
    (dict(budget=8, policy="lru"), r"policy must be one of 'window', 'sinks', 'h2o', 'snapkv', got 'lru'"),
    (dict(budget=0), r"budget must be at least 1, got 0"),
    (dict(budget=2.5), r"budget must be an int"),
    (dict(budget=4, policy="sinks"), r"budget 4 must be larger than the 4 sinks"),
    (dict(budget=8, policy="sinks", sinks=-1), r"sinks must be at least 0"),
    (dict(budget=8, policy="snapkv", observation=9), r"observation window 9 must be at most the budget 8"),
    (dict(budget=8, policy="snapkv", observation=4, pool=4), r"pool must be odd"),
    (dict(budget=8, policy="snapkv", observation=4, pooling="median"), r"pooling must be one of 'avg', 'max'"),
    (dict(budget=8, policy="h2o", window=9), r"window 9 must be at most the budget 8"),
    (dict(budget=8, policy="sinks", window=4), r"window sets H2O's recent window"),
    (dict(budget=8, policy="h2o", rerotate=True), r"policy 'h2o' keeps different positions"),
    (dict(budget=8, policy="snapkv", observation=4, rerotate=True), r"policy 'snapkv' keeps different positions"),
    (dict(budget=8, policy="sinks", rerotate=1), r"rerotate must be True or False"),
    (dict(budget=8, policy="sinks", rerotate=True, gpt2=True), r"gpt2 has learned absolute positions"),
])
def test_bad_arguments_raise_cache_input_error(kw, message):
    config = tiny("tiny-gpt2" if kw.pop("gpt2", False) else "tiny-llama").config
    with pytest.raises(CacheInputError, match=message):
        EvictingCache(config, **kw)


def snapshot(cache):
    tensors = [t for store in (cache.keys, cache.values, cache.kept_positions, cache.scores) for t in store]
    return (cache.length, cache.held, list(cache.pending), cache.version), [None if t is None else t.clone()
                                                                            for t in tensors]


def assert_unchanged(cache, before):
    state, tensors = snapshot(cache)
    assert state == before[0]
    for now, then in zip(tensors, before[1], strict=True):
        assert (now is None and then is None) or torch.equal(now, then)


OK = torch.zeros(1, 2, 1, 16)
BAD_CALLS = [  # id, bad(cache, model), error, message
    ("k_wrong_shape", lambda c, m: c.attend(0, torch.zeros(1, 4, 1, 16), torch.zeros(1, 3, 1, 16), OK),
     CacheInputError, r"k has shape \(1, 3, 1, 16\)"),
    ("k_wrong_dtype", lambda c, m: c.update(0, OK.double(), OK), CacheInputError, r"k has dtype torch.float64"),
    ("layer_out_of_range", lambda c, m: c.attend(2, torch.zeros(1, 4, 1, 16), OK, OK), CacheInputError,
     r"layer index 2 out of range"),
    ("advance_without_update", lambda c, m: c.advance(1), CacheStateError, r"stored \[0, 0\]"),
    ("crop_an_evicted_position", lambda c, m: c.crop(5), CacheStateError, r"crop\(5\): position \d+ was evicted"),
    ("crop_beyond_length", lambda c, m: c.crop(26), CacheStateError, r"crop\(26\): the cache holds 25"),
    ("set_length", lambda c, m: setattr(c, "length", 3), CacheStateError, r"cannot be set"),
    ("model_mismatch", lambda c, m: step(tiny("tiny-mqa"), c, [1]), CacheError, r"model has \(2, 1, 8\)"),
]


@pytest.mark.parametrize("bad, error, message", [pytest.param(*case[1:], id=case[0]) for case in BAD_CALLS])
@pytest.mark.parametrize("policy", ["window", "h2o", "snapkv"])
def test_bad_calls_after_eviction_raise_and_change_nothing(policy, bad, error, message):
    model = tiny("tiny-llama")
    ids = random_ids(25, seed=14)
    cache = EvictingCache(model.config, 8, policy, window=None if policy != "h2o" else 4, observation=4)
    step(model, cache, ids[:20])
    for t in ids[20:]:
        step(model, cache, [t])
    before = snapshot(cache)
    with pytest.raises(error, match=message):
        bad(cache, model)
    assert_unchanged(cache, before)
    step(model, cache, [9])  # and it still works
    assert (cache.length, cache.held) == (26, 8)


# ---- 9. reset, fork, crop ------------------------------------------------------------------------------------------

def fill(model, cache, ids, prefill=10):
    step(model, cache, ids[:prefill])
    for t in ids[prefill:]:
        out = step(model, cache, [t])
    return out


@pytest.mark.parametrize("kw", POLICIES)
def test_reset_is_bit_identical_to_a_fresh_cache(kw):
    model = tiny("tiny-llama")
    cache = EvictingCache(model.config, 8, **kw)
    fill(model, cache, random_ids(30, seed=15))
    cache.reset()
    assert (cache.length, cache.held) == (0, 0)
    fresh = EvictingCache(model.config, 8, **kw)
    b = random_ids(20, seed=16)
    assert torch.equal(fill(model, cache, b), fill(model, fresh, b))
    for store in ("keys", "values", "kept_positions", "scores"):
        for x, y in zip(getattr(cache, store), getattr(fresh, store), strict=True):
            assert (x is None and y is None) or torch.equal(x, y)


@pytest.mark.parametrize("kw", POLICIES)
def test_fork_leaves_parent_untouched_and_continues_like_it(kw):
    model = tiny("tiny-llama")
    ids = random_ids(30, seed=17)
    parent = EvictingCache(model.config, 8, **kw)
    fill(model, parent, ids)
    before = snapshot(parent)
    child = parent.fork()
    a, b = random_ids(6, seed=18), random_ids(6, seed=19)
    child_logits = fill(model, child, b, prefill=1)
    assert_unchanged(parent, before)
    child_after = snapshot(child)
    parent_logits = fill(model, parent, a, prefill=1)
    assert_unchanged(child, child_after)
    # each equals a cache that saw its tokens alone, start to end
    for tokens, got in ((a, parent_logits), (b, child_logits)):
        alone = EvictingCache(model.config, 8, **kw)
        fill(model, alone, ids)
        assert torch.equal(fill(model, alone, tokens, prefill=1), got)


@pytest.mark.parametrize("policy, rerotate", [("window", False), ("sinks", False), ("sinks", True), ("h2o", False)])
def test_crop_after_eviction_forgets_the_newest_tokens_and_continues_over_the_survivors(policy, rerotate):
    model = tiny("tiny-llama")
    ids = random_ids(30, seed=20)
    for back in (0, 1, 3):
        cache = EvictingCache(model.config, 10, policy, rerotate=rerotate)
        oracle = MaskedOracle(model.config, policy, 10, rerotate=rerotate)
        run_both(model, cache, oracle, ids[:12], ids[12:])
        n = max(cache.lowest_crop(), 30 - back)
        cache.crop(n), oracle.crop(n)
        assert (cache.length, cache.held) == (n, 10 - (30 - n))
        for i in range(2):
            assert torch.equal(cache.kept_positions[i], oracle.kept(i))
        for t in random_ids(5, seed=21):
            assert_close(step(model, cache, [t]), step(model, oracle, [t]), TINY_ATOL, f"after crop({n})")


def test_crop_to_zero_is_a_reset():
    model = tiny("tiny-llama")
    cache, fresh = EvictingCache(model.config, 8, "h2o"), EvictingCache(model.config, 8, "h2o")
    fill(model, cache, random_ids(20, seed=22))
    cache.crop(0)
    b = random_ids(12, seed=23)
    assert torch.equal(fill(model, cache, b), fill(model, fresh, b))
