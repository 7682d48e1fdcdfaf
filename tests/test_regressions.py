"""Regression tests for defects found by probing the caches and the backend as a careful user would.

Each test is named after the defect it pins (F1 ... F8). Oracles: the cache's own state before the failed
call (compared exactly), recomputation without a cache (`forward`), and the error a contract promises.
Tolerances: tiny models (2 layers, logits of order 1) agree with recomputation to a few 1e-7 in float32;
we allow 1e-5 (as tests/test_cache.py). A wrong reuse moves logits by 1e-2 or more, far above that.
"""

import dataclasses

import pytest
import torch

from lab.cache import CacheError, CacheMismatchError, ConcatCache, PagedCache, StaticCache
from lab.engine import CachedBackend, RecomputeBackend, prefix_key
from lab.models import InputError, forward, forward_cached, load
from lab.models.load import Model

ATOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def fresh_tiny():
    """A private copy: the tests that change weights in place must not touch the shared model."""
    return load("tiny-llama")


def ids(*tokens):
    return torch.tensor([list(tokens)])


def kv(cache, t=1, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(cache.batch_size, cache.n_kv_heads, t, cache.head_dim, generator=g),
            torch.randn(cache.batch_size, cache.n_kv_heads, t, cache.head_dim, generator=g))


def pages_state(cache):
    m = cache.manager
    return m.sequences(), m.num_free, [m.owners(p) for p in range(m.num_pages)]


# ---- F1: every error is raised before anything changes ------------------------------------------------------

def test_F1_failed_paged_crop_mid_step_changes_nothing(tiny):
    cache = PagedCache(tiny.config, 64, page_size=4)
    forward_cached(ids(1, 2, 3, 4, 5), tiny.weights, tiny.config, cache)
    cache.update(0, *kv(cache))                        # a step in flight: layer 0 stored position 5
    reserved = cache.manager.length(cache.seqs[0])
    with pytest.raises(CacheError, match=r"crop\(-1\)"):
        cache.crop(-1)
    assert cache.pending == [1, 0] and cache.seq_lengths() == [5]
    assert cache.manager.length(cache.seqs[0]) == reserved == 6   # the step's reservation is still there
    cache.update(1, *kv(cache, seed=1))                 # and the step can finish
    cache.advance(1)
    assert cache.length == 6


# ---- F2: a fork is all or nothing -----------------------------------------------------------------------------

def test_F2_failed_paged_fork_leaks_no_pages(tiny, monkeypatch):
    cache = PagedCache(tiny.config, 64, page_size=4, batch_size=2)
    forward_cached(ids(1, 2, 3, 4, 5).repeat(2, 1), tiny.weights, tiny.config, cache)
    before = pages_state(cache)
    real_fork, calls = cache.manager.fork, []

    def fork_failing_on_the_second_row(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise CacheError("simulated failure on the second row")
        return real_fork(src, dst)

    monkeypatch.setattr(cache.manager, "fork", fork_failing_on_the_second_row)
    with pytest.raises(CacheError, match="second row"):
        cache.fork()
    assert pages_state(cache) == before                 # the first row's child was released again
    cache.manager.check()


# ---- F3: a paged cache's lifecycle on rows never filled ----------------------------------------------------

@pytest.mark.parametrize("operation", ["reset", "reset twice", "crop(0)", "release", "fork"])
def test_F3_paged_lifecycle_on_a_fresh_cache(tiny, operation):
    cache = PagedCache(tiny.config, 64, page_size=4)
    {"reset": cache.reset, "reset twice": lambda: (cache.reset(), cache.reset()), "crop(0)": lambda: cache.crop(0),
     "release": cache.release, "fork": cache.fork}[operation]()
    cache.manager.check()
    if operation != "release":                          # released: the cache is done with
        got = forward_cached(ids(7, 8, 9), tiny.weights, tiny.config, cache)
        assert (got - forward(ids(7, 8, 9), tiny.weights, tiny.config)).abs().max() <= ATOL


def test_F3_reset_with_only_some_rows_filled_leaves_the_cache_usable(tiny):
    cache = PagedCache(tiny.config, 64, page_size=4, batch_size=2)
    forward_cached(ids(1, 2, 3), tiny.weights, tiny.config, cache.select([0]))  # row 0 only
    assert cache.seq_lengths() == [3, 0]
    cache.reset()
    assert cache.seq_lengths() == [0, 0] and cache.manager.num_free == cache.num_pages
    batch = torch.tensor([[4, 5, 6], [7, 8, 9]])
    got = forward_cached(batch, tiny.weights, tiny.config, cache)
    assert (got - forward(batch, tiny.weights, tiny.config)).abs().max() <= ATOL


# ---- F4: a cache records the model that filled it --------------------------------------------------------------

@pytest.mark.parametrize("design", ["concat", "static", "paged"])
@pytest.mark.parametrize("other", ["other weights", "other rope_theta"])
def test_F4_a_cache_refuses_another_model_of_the_same_shape(tiny, design, other):
    make = {"concat": lambda: ConcatCache(tiny.config), "static": lambda: StaticCache(tiny.config, 32),
            "paged": lambda: PagedCache(tiny.config, 32, page_size=4)}[design]
    if other == "other weights":                        # the same shape, other seeded weights
        from lab.models import random_model
        second = random_model(tiny.config, seed=1)
        w2, cfg2 = second.weights, second.config
    else:                                               # the same weights, another RoPE base
        w2, cfg2 = tiny.weights, dataclasses.replace(tiny.config, rope_theta=500_000.0)
    cache = make()
    forward_cached(ids(1, 2, 3), tiny.weights, tiny.config, cache)
    with pytest.raises(CacheMismatchError, match="another model"):
        forward_cached(ids(4), w2, cfg2, cache)
    assert cache.length == 3 and not any(cache.pending)
    cache.reset()                                       # an empty cache takes a new model
    got = forward_cached(ids(4), w2, cfg2, cache)
    assert (got - forward(ids(4), w2, cfg2)).abs().max() <= ATOL


# ---- F5: weights changed in place ------------------------------------------------------------------------------

def test_F5_weights_changed_in_place_are_noticed_by_the_backend():
    model = fresh_tiny()
    backend = CachedBackend(model, lambda: StaticCache(model.config, 32))
    backend.next_logits([1, 2, 3, 4])
    manifest = model.manifest
    with torch.no_grad():
        model.weights["model.layers.0.mlp.down_proj.weight"].mul_(3)   # an in-place update
    assert model.manifest != manifest
    misses = backend.misses
    got = backend.next_logits([1, 2, 3, 4, 5])
    assert backend.misses == misses + 1                 # refused: the state was computed with old weights
    want = RecomputeBackend(model).next_logits([1, 2, 3, 4, 5])
    assert (got - want).abs().max() <= ATOL


def test_F5_file_backed_manifest_notices_in_place_changes(tmp_path):
    base = fresh_tiny()
    weights_file = tmp_path / "model.safetensors"
    weights_file.write_bytes(b"the bytes a manifest of files hashes")
    model = Model("file-backed", base.config, base.weights, base.tokenizer, files=[weights_file])
    as_loaded = model.manifest
    assert model.manifest == as_loaded                  # unchanged weights: the files' hash, remembered
    with torch.no_grad():
        model.weights["model.norm.weight"].add_(1e-3)
    changed = model.manifest
    assert changed != as_loaded                         # the files no longer describe the weights
    with torch.no_grad():
        model.weights["model.norm.weight"].sub_(1e-3)
    assert model.manifest != as_loaded                  # versions only grow: no change is ever undone


def test_F5_forward_cached_refuses_a_cache_filled_before_an_in_place_change():
    model = fresh_tiny()
    cache = ConcatCache(model.config)
    forward_cached(ids(1, 2, 3), model.weights, model.config, cache)
    with torch.no_grad():
        model.weights["model.layers.1.self_attn.k_proj.weight"].mul_(1.01)
    with pytest.raises(CacheMismatchError):
        forward_cached(ids(4), model.weights, model.config, cache)


# ---- F6: the backend checks the cache it holds on every call ---------------------------------------------------

def swap_in_a_modified_fork(backend):
    child = backend.cache.fork()
    child.crop(child.length - 1)
    forward_cached(ids(99), backend.model.weights, backend.model.config, child)  # same length, other token
    backend.cache = child


@pytest.mark.parametrize("tamper", ["cropped from outside", "forked and modified, swapped in"])
def test_F6_backend_does_not_trust_a_cache_changed_behind_its_back(tiny, tamper):
    backend = CachedBackend(tiny, lambda: StaticCache(tiny.config, 32))
    backend.next_logits([1, 2, 3, 4, 5])
    if tamper == "cropped from outside":
        backend.cache.crop(3)
    else:
        swap_in_a_modified_fork(backend)
    misses = backend.misses
    got = backend.next_logits([1, 2, 3, 4, 5, 6])
    assert backend.misses == misses + 1
    want = forward(ids(1, 2, 3, 4, 5, 6), tiny.weights, tiny.config)[0, -1]
    assert (got - want).abs().max() <= ATOL


def test_F6_backend_resets_a_non_empty_cache_from_its_factory(tiny):
    dirty = StaticCache(tiny.config, 32)
    forward_cached(ids(9, 9, 9, 9), tiny.weights, tiny.config, dirty)
    backend = CachedBackend(tiny, lambda: dirty)
    got = backend.next_logits([1, 2, 3])
    want = forward(ids(1, 2, 3), tiny.weights, tiny.config)[0, -1]
    assert (got - want).abs().max() <= ATOL and backend.cache.length == 3


# ---- F7: prefix_key validates the ids ---------------------------------------------------------------------------

@pytest.mark.parametrize("bad", [[1.7, 2.2, 3.9], [True, 2, 3], torch.tensor([1.0, 2.0, 3.0]), [-1],
                                 torch.tensor([[1, 2, 3], [4, 5, 6]]), torch.tensor([[[1, 2, 3]]])],
                         ids=["floats", "bool", "float tensor", "negative", "batch of two", "rank 3"])
def test_F7_prefix_key_refuses_what_is_not_one_sequence_of_ids(bad):
    with pytest.raises(InputError):
        prefix_key("manifest", bad, tokenizer="tok")


def test_F7_prefix_key_accepts_one_sequence_in_every_form():
    key = prefix_key("manifest", [1, 2, 3], tokenizer="tok")
    for same in ((1, 2, 3), torch.tensor([1, 2, 3]), torch.tensor([[1, 2, 3]]),
                 torch.tensor([1, 2, 3], dtype=torch.int32)):
        assert prefix_key("manifest", same, tokenizer="tok") == key


# ---- F8: the Llama family has a position limit, as GPT-2 has ---------------------------------------------------

@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_F8_positions_past_the_context_raise_a_typed_error(name):
    from lab.models import PositionLimitError, random_model

    cfg = dataclasses.replace(load(name).config, max_positions=8)
    model = random_model(cfg)
    with pytest.raises(PositionLimitError, match="9 positions exceed"):
        forward(torch.arange(9)[None], model.weights, cfg)
    cache = ConcatCache(cfg)
    forward_cached(torch.arange(8)[None], model.weights, cfg, cache)
    with pytest.raises(PositionLimitError, match="9 positions exceed"):
        forward_cached(ids(1), model.weights, cfg, cache)
    assert cache.length == 8 and issubclass(PositionLimitError, InputError)
