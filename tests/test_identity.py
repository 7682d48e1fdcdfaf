"""State identity: prefix keys, and a CachedBackend that serves from its cache only when it provably
holds the requested state. The oracle is recomputation (RecomputeBackend / forward)."""

import pytest
import torch

from lab import data
from lab.cache import CacheMismatchError, ConcatCache, StaticCache
from lab.engine import CachedBackend, IdentityError, LibraryBackend, RecomputeBackend, generate, identity_of, prefix_key
from lab.experiments import ch04_identity as ch04
from lab.identity_cost import key_cost, weights_check_cost
from lab.models import InputError, forward, forward_cached, load
from lab.models.load import Model, scaled_copy
from lab.updates import optimizer_step, private_copy, step_signs

TOL = 1e-5  # tiny models, float32: cached and recomputed logits differ only by summation order


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def factory(model, kind="static", n=256):
    if kind == "static":
        return lambda: StaticCache(model.config, n, dtype=model.dtype)
    return lambda: ConcatCache(model.config, dtype=model.dtype)


BASE = dict(tokenizer="t" * 64, compute_dtype="torch.float32", cache_dtype="torch.float32", cache_kind="StaticCache",
            rope_theta=10000.0, max_positions=2048, salt=None)


@pytest.mark.parametrize("change", [
    ("manifest", None), ("tokenizer", "u" * 64), ("compute_dtype", "torch.bfloat16"),
    ("cache_dtype", "torch.bfloat16"), ("cache_kind", "ConcatCache"), ("rope_theta", 100000.0),
    ("max_positions", 8192), ("salt", "tenant-b"), ("ids", None)])
def test_prefix_key_changes_when_any_one_input_changes(change):
    field, new = change
    key = prefix_key("m" * 64, [1, 2, 3], **BASE)
    if field == "manifest":
        other = prefix_key("n" * 64, [1, 2, 3], **BASE)
    elif field == "ids":
        other = prefix_key("m" * 64, [1, 2, 4], **BASE)
    else:
        other = prefix_key("m" * 64, [1, 2, 3], **{**BASE, field: new})
    assert key != other and len(key) == 64
    assert key == prefix_key("m" * 64, [1, 2, 3], **BASE)  # and it is deterministic


def test_prefix_key_distinguishes_lengths_and_tensors():
    assert prefix_key("m", [1, 2], **BASE) != prefix_key("m", [1, 2, 0], **BASE)
    assert prefix_key("m", torch.tensor([5, 6]), **BASE) == prefix_key("m", [5, 6], **BASE)


def test_engine_five_requests_give_5_misses_and_155_hits(tiny):
    """5 requests x 32 greedy tokens -> 160 calls, 5 misses (each request's first), 155 hits, 48 positions each."""
    backend, recompute = CachedBackend(tiny, factory(tiny, n=64)), RecomputeBackend(tiny)
    g = torch.Generator().manual_seed(0)
    for _ in range(5):
        prompt = torch.randint(0, 320, (17,), generator=g).tolist()
        before = backend.positions
        assert generate(backend, prompt, 32).tokens == generate(recompute, prompt, 32).tokens
        assert backend.positions - before == 48
    assert (backend.calls, backend.misses, backend.hits) == (160, 5, 155)


def _logits_ok(backend, ids, model):
    want = RecomputeBackend(model).next_logits(ids)
    got = backend.next_logits(ids)
    assert (got - want).abs().max() < TOL
    return got


def test_identical_ids_are_a_miss(tiny):
    b = CachedBackend(tiny, factory(tiny))
    _logits_ok(b, [1, 2, 3], tiny)
    _logits_ok(b, [1, 2, 3], tiny)  # k = 0 new tokens: the state for ids[:-k] does not exist
    assert (b.hits, b.misses) == (0, 2)


def test_diverging_prefix_is_a_miss_and_correct(tiny):
    b = CachedBackend(tiny, factory(tiny))
    _logits_ok(b, [1, 2, 3, 4], tiny)
    _logits_ok(b, [1, 2, 9, 4, 5], tiny)
    assert (b.hits, b.misses, b.crops) == (0, 2, 0)


def test_longest_prefix_mode_crops_and_runs_only_the_rest(tiny):
    b = CachedBackend(tiny, factory(tiny), longest_prefix=True)
    _logits_ok(b, [1, 2, 3, 4, 5, 6], tiny)
    before = b.positions
    _logits_ok(b, [1, 2, 3, 9, 9], tiny)        # common prefix 3: crop to 3, run 2
    assert (b.hits, b.misses, b.crops) == (1, 1, 1) and b.positions - before == 2
    _logits_ok(b, [1, 2, 3, 9, 9], tiny)        # identical ids: crop to 4, run the last one
    assert b.crops == 2 and b.cache.length == 5


@pytest.mark.parametrize("kind", ["static", "concat"])
def test_salt_separates_tenants(tiny, kind):
    b = CachedBackend(tiny, factory(tiny, kind))
    b.next_logits([1, 2, 3], salt="tenant-a")
    _ = b.next_logits([1, 2, 3, 4], salt="tenant-b")
    assert b.misses == 2 and b.hits == 0
    b.next_logits([1, 2, 3, 4, 5], salt="tenant-b")
    assert b.hits == 1


def test_model_swap_is_refused(tiny):
    """An adapter swap: same shapes, other weights, another manifest -> the cache is never reused."""
    other = scaled_copy(tiny, "model.layers.1.mlp.down_proj.weight", 1.02)
    assert other.manifest != tiny.manifest and other.weights["model.norm.weight"] is tiny.weights["model.norm.weight"]
    b = CachedBackend(other, factory(other))
    b.next_logits([1, 2, 3])
    b.model = tiny
    _logits_ok(b, [1, 2, 3, 4], tiny)
    assert b.misses == 2 and b.hits == 0


def test_precision_change_is_refused(tiny):
    half = tiny.to(dtype=torch.bfloat16)
    b = CachedBackend(half, factory(half))
    b.next_logits([1, 2, 3])
    b.model, b.cache_factory = tiny, factory(tiny)
    _logits_ok(b, [1, 2, 3, 4], tiny)
    assert b.misses == 2


def test_tokenizer_change_is_refused(tiny):
    class OtherTokenizer(type(tiny.tokenizer)):
        sha256 = "0" * 64

    b = CachedBackend(tiny, factory(tiny))
    b.next_logits([1, 2, 3])
    b.model = Model(tiny.name, tiny.config, tiny.weights, OtherTokenizer(), tiny.files, tiny.manifest)
    b.next_logits([1, 2, 3, 4])
    assert b.misses == 2


def test_a_model_without_a_manifest_is_refused(tmp_path, tiny):
    broken = Model("gone", tiny.config, tiny.weights, tiny.tokenizer, [tmp_path / "deleted.safetensors"])
    with pytest.raises(IdentityError, match="manifest"):
        CachedBackend(broken, factory(tiny))
    b = CachedBackend(tiny, factory(tiny))
    b.next_logits([1, 2])
    b.model = broken
    with pytest.raises(IdentityError):
        b.next_logits([1, 2, 3])


@pytest.mark.parametrize("bad, word", [([], "empty"), ([[1, 2], [3, 4]], "nested"), ([1, 320], "vocabulary"),
                                       (torch.zeros(2, 3, dtype=torch.long), "batch"), ([-1], "vocabulary")])
def test_bad_ids_are_refused_without_touching_the_state(tiny, bad, word):
    b = CachedBackend(tiny, factory(tiny))
    b.next_logits([1, 2, 3])
    state = (b.cached_key, b.cache.length, b.calls)
    with pytest.raises(InputError, match=word):
        b.next_logits(bad)
    assert (b.cached_key, b.cache.length, b.calls) == state
    b.next_logits([1, 2, 3, 4])
    assert b.hits == 1


def test_identity_records_cache_kind_and_dtype(tiny):
    a = identity_of(tiny, StaticCache(tiny.config, 8))
    b = identity_of(tiny, ConcatCache(tiny.config))
    c = identity_of(tiny, StaticCache(tiny.config, 8, dtype=torch.bfloat16))
    assert len({a, b, c}) == 3


@pytest.mark.parametrize("use_cache", [True, False])
def test_library_backend_matches_recompute(tiny, use_cache):
    lib, ref = LibraryBackend(tiny, use_cache=use_cache), RecomputeBackend(tiny)
    prompt = [5, 6, 7, 8]
    assert generate(lib, prompt, 12).tokens == generate(ref, prompt, 12).tokens
    assert lib.hits == (11 if use_cache else 0)


def test_key_cost_measures_the_hit_path_and_a_step(tiny):
    """ch04's key-cost measurement: the backend's check finds the state of ids[:-1] (asserted inside the
    measurement), and every time is positive. No comparison of times: this machine may be loaded."""
    r = key_cost(tiny, lengths=(4, 60), reps=30, step_reps=1)
    assert set(r) == {4, 60}
    for c in r.values():
        assert all(c[k]["median"] > 0 for k in ("key", "check", "step"))


def test_hazards_figure_is_legible_at_column_width(tmp_path):
    row = dict(delta_median=0.5, delta_max=5.0, argmax_agree=3, trials=5)
    fig = ch04.plot_hazards({name: row for name in ch04.HAZARDS}, tmp_path / "h.png")  # raises if too small
    assert (tmp_path / "h.png").is_file() and fig.axes[1].get_title() == "Top token still right"


# ---- weights changed in place, and a cache touched from outside


def test_weights_changed_in_place_are_refused_by_the_backend_and_the_cache(tiny):
    """An RL loop: the policy's weights are updated in place between rollouts. The backend's manifest notices
    (a miss, then the new weights' scores), and a cache filled before the update refuses the new weights."""
    policy = private_copy(tiny)                      # the shared fixture is never changed
    backend = CachedBackend(policy, factory(policy))
    backend.next_logits([1, 2, 3])
    cache = StaticCache(policy.config, 16)
    with torch.inference_mode():
        forward_cached(torch.tensor([[1, 2, 3]]), policy.weights, policy.config, cache)
    before = policy.manifest
    optimizer_step(policy.weights, step_signs(policy.weights), lr=1e-3)
    assert policy.manifest != before and tiny.manifest != policy.manifest
    _logits_ok(backend, [1, 2, 3, 4], policy)        # recomputed with the new weights, within TOL
    assert (backend.hits, backend.misses) == (0, 2)
    with pytest.raises(CacheMismatchError, match="before they changed"):
        forward_cached(torch.tensor([[4]]), policy.weights, policy.config, cache)
    assert cache.length == 3                         # the refused call changed nothing


def test_a_cache_touched_from_outside_is_not_reused(tiny):
    """The backend serves from its cache only while the cache is exactly what it left there."""
    b = CachedBackend(tiny, factory(tiny))
    b.next_logits([1, 2, 3, 4])
    b.cache.crop(2)                                  # someone else rolls it back
    _logits_ok(b, [1, 2, 3, 4, 5], tiny)
    assert (b.hits, b.misses) == (0, 2)
    _logits_ok(b, [1, 2, 3, 4, 5, 6], tiny)          # its own state again: a hit
    assert b.hits == 1


@pytest.fixture(scope="module")
def smol_variants(smollm2):
    return ch04.variants_of(smollm2)


# Which hazards forward_cached itself refuses: those that continue a cache with other weights. The others
# keep the model (or copy the values into a new cache, which carries no record).
REFUSED_BY_CACHE = {"adapter_weights", "weights_in_place"}


@pytest.mark.parametrize("hazard", list(ch04.HAZARDS))
def test_every_hazard_trial_damages_and_the_backend_is_correct(smollm2, smol_variants, hazard):
    """One trial of every hazard on SmolLM2: the wrong reuse moves the scores measurably (its median |Δ logit|
    is more than ten times the largest difference between a correct cached step and recomputation, the
    float32 noise of two summation orders: 3e-5 here, against 2e-3 for the smallest hazard, one optimizer
    step); the cache refuses exactly the hazards that change the weights; the backend refuses every
    hazard that changes the identity, and serves the correct scores."""
    p = data.passages(smollm2.tokenizer, 25, count=2, seed=7)
    prefix, nxt, other = p[0][:24], p[0][24], p[1][:24]
    r = ch04.trial(hazard, smollm2, prefix, nxt, other, smol_variants)
    cache = ch04.prefill(smollm2, prefix)
    with torch.inference_mode():
        floor = (ch04.step(smollm2, nxt, cache)
                 - forward(torch.tensor([prefix + [nxt]]), smollm2.weights, smollm2.config)[0, -1]).abs().max()
    assert (r["wrong"] - r["right"]).abs().median() > 10 * floor
    assert r["refused_by_cache"] == (hazard in REFUSED_BY_CACHE)
    assert r["refused"] == (ch04.IDENTITY_CHANGES[hazard] is not None) and r["correct"]


def test_check_cost_measurement_and_its_record(tiny, tmp_path, monkeypatch):
    """ch04's cost of noticing in-place changes: the manifest read, the owner, the rehash after a change;
    recorded beside the decode step as a share. Times only positive: this machine may be loaded."""
    monkeypatch.setenv("LAB_RESULTS", str(tmp_path / "results.json"))
    c = weights_check_cost(tiny, reps=10, rehash_reps=2)  # asserts inside that a change changes the manifest
    assert set(c) == {"manifest", "owner", "fingerprint", "rehash"}
    assert all(c[k]["median"] > 0 for k in c) and c["rehash"]["n"] == 2 and c["manifest"]["n"] == 10
    kc = key_cost(tiny, lengths=(4, 60), reps=10, step_reps=1)
    row = dict(delta_median=0.5, delta_max=5.0, argmax_agree=3, kl_median=0.1, kl_max=0.2, refused_by_cache=0,
               refused=5, backend_correct=5, trials=5)
    hazards = {name: dict(row) for name in ch04.HAZARDS}
    hazards["weights_in_place"] |= dict(lr=5e-6, relative_update=1e-4)
    m = dict(settings=ch04.settings(True), manifest=tiny.manifest, hazards=hazards,
             refusal=dict(refused=1, recompute=1),
             engine=dict(calls=3, hits=2, misses=1, positions=[3], tokens_identical=True, recompute_positions=3),
             key_cost=kc, check_cost=c)
    values = ch04.record(m)
    w = values["weights_check"]
    assert {k: w[k]["unit"] for k in ("manifest_us", "owner_us", "fingerprint_us", "rehash_s", "per_call_us")} == \
        {"manifest_us": "µs", "owner_us": "µs", "fingerprint_us": "µs", "rehash_s": "s", "per_call_us": "µs"}
    assert set(w["share"]) == {"T4", "T60"} and all(v["unit"] == "%" and v["value"] > 0 for v in w["share"].values())
    assert values["hazards"]["weights_in_place"]["lr"]["value"] == 5e-6
    assert "refused_by_cache" in values["hazards"]["other_prompt"]
