"""Regression tests for defects found by probing the library: stale state after weight writes that no version
counter sees, a longest-prefix backend over an evicting cache, ids and counts of the wrong type, overflowing
quantization scales, NaN keys in an evicting cache, and an identical copy of the model swapped in.

The oracle is recomputation: `forward` without a cache, on the weights as they are now. Tolerance for the
tiny float32 models: 1e-5 on the logits, where a cached and a recomputed forward differ only by summation
order (about 1e-7); every stale state measured here is off by 1e-3 or more.
"""

import copy

import pytest
import torch

from lab.cache import CacheInputError, CacheMismatchError, EvictingCache, QuantizedCache, StaticCache
from lab.engine import (
    CachedBackend,
    ChatSession,
    PrefixCachingBackend,
    RecomputeBackend,
    ServingEngine,
    block_hashes,
    generate,
    prefix_key,
)
from lab.models import InputError, forward, load
from lab.models.checks import owner
from lab.models.load import Model

TOL = 1e-5
IDS = list(range(3, 43))                       # 40 tokens: the request is IDS, the state before it IDS[:-1]
WEIGHT = "model.layers.0.self_attn.v_proj.weight"  # layer 0's values: every cached position depends on it


def oracle(model, ids) -> torch.Tensor:
    """The next-token scores `[V]` recomputed from scratch with the weights as they are now."""
    with torch.inference_mode():
        return forward(torch.tensor([ids]), model.weights, model.config)[0, -1]


def own_model(inference_tensors=False) -> Model:
    """tiny-llama with weights of its own, to write into. inference_tensors: made inside inference mode, as
    weights loaded there are; such tensors have no version counter at all."""
    model = load("tiny-llama")
    if inference_tensors:
        with torch.inference_mode():
            weights = {k: v.clone() for k, v in model.weights.items()}
        model = Model(model.name, model.config, weights, model.tokenizer)
    return model


def write(model, path):
    """Change the weights in place by a path that the version counters do not see."""
    w = model.weights[WEIGHT]
    if path == "data":
        w.data.mul_(1.5)                                   # through .data: a new view, its own counter
    elif path == "numpy":
        w.numpy()[:] *= 1.5                                # through NumPy: no torch operation at all
    elif path == "inference_mode":
        with torch.inference_mode():                       # an inference tensor: no counter to move
            w.mul_(1.5)
    elif path == "new_checkpoint":                         # every weight, as a weight loader or an RL loop does
        g = torch.Generator().manual_seed(1)
        for t in model.weights.values():
            t.data.copy_(t + 0.02 * torch.randn(t.shape, generator=g))
    return model


PATHS = ["data", "numpy", "inference_mode", "new_checkpoint"]


def backend_for(kind, model):
    if kind == "cached":
        return CachedBackend(model, lambda: StaticCache(model.config, 64, dtype=model.dtype))
    return PrefixCachingBackend(model, num_pages=32, page_size=4)


# ---- 1. weight writes that no version counter sees
@pytest.mark.parametrize("kind", ["cached", "prefix"])
@pytest.mark.parametrize("path", PATHS)
def test_weight_write_unseen_by_version_counters_is_not_served_stale(kind, path):
    model = own_model(inference_tensors=path == "inference_mode")
    backend = backend_for(kind, model)
    backend.next_logits(IDS[:-1])                          # the state of IDS[:-1], computed with the old weights
    stale = backend_for(kind, own_model()).next_logits(IDS)   # what reusing that state would serve (old weights)
    write(model, path)
    want = oracle(model, IDS)
    assert (stale - want).abs().max() > 1e-3               # the write matters: a stale hit would be caught
    assert (backend.next_logits(IDS) - want).abs().max() <= TOL


@pytest.mark.parametrize("path", PATHS)
def test_serving_engine_refuses_to_continue_after_an_unseen_weight_write(path):
    model = own_model(inference_tensors=path == "inference_mode")
    engine = ServingEngine(model, num_pages=16, page_size=4)
    engine.add_request(IDS[:20], 4)
    engine.step()                                          # pages computed with the old weights
    write(model, path)
    with pytest.raises(CacheMismatchError, match="weights changed"):
        engine.step()
    # a new engine over the new weights serves the greedy tokens of recomputation
    tokens, ids = [], IDS[:20]
    for _ in range(4):
        tokens.append(int(oracle(model, ids + tokens).argmax()))
    assert ServingEngine(model, num_pages=16, page_size=4).generate([ids], 4) == [tokens]


def test_fingerprint_blind_spot_a_write_between_samples_is_unseen():
    """What the fingerprint cannot see, stated as a test: one element between the sampled ones, written
    through `.data`, leaves the owner unchanged. The same write as an ordinary in-place operation moves the
    version counter and is seen."""
    from lab.models.checks import FINGERPRINT_RUN, FINGERPRINT_SAMPLES, fingerprint

    model = own_model()
    w = model.weights["model.embed_tokens.weight"]         # [320, 64]: 8 runs of 8, 2,560 elements apart
    runs = FINGERPRINT_SAMPLES // FINGERPRINT_RUN
    gap = FINGERPRINT_RUN                                  # the element just after the first run
    assert w.numel() // runs > gap + 1                     # lies between two runs
    before, printed = owner(model.weights, model.config), fingerprint(model.weights)
    w.data.view(-1)[gap] += 1.0                            # unsampled, and .data moves no counter
    assert fingerprint(model.weights) == printed and owner(model.weights, model.config) == before
    w.view(-1)[gap:gap + 1].add_(1.0)                      # the same kind of write, counted
    assert owner(model.weights, model.config) != before
    w.data.view(-1)[0] += 1.0                              # a sampled element, uncounted: the fingerprint sees it
    assert fingerprint(model.weights) != printed


# ---- 2. longest prefix over an evicting cache
def test_longest_prefix_over_an_evicting_cache_recomputes_what_it_cannot_crop_to():
    model = load("tiny-llama")
    backend = CachedBackend(model, lambda: EvictingCache(model.config, budget=8), longest_prefix=True)
    first = list(range(1, 41))
    backend.next_logits(first)                             # 40 tokens: positions 0 .. 31 evicted
    request = first[:20] + list(range(100, 120))           # shares 20 tokens: crop(20) is impossible
    misses = backend.misses
    # recomputed in one prefill, which attends to every position: exactly the uncached forward
    assert (backend.next_logits(request) - oracle(model, request)).abs().max() <= TOL
    assert backend.misses == misses + 1
    for _ in range(2):                                     # every retry is served, never an error
        assert torch.isfinite(backend.next_logits(request)).all()


# ---- 7. an id past int64
@pytest.mark.parametrize("call", ["prefix_key", "block_hashes", "recompute", "cached", "prefix", "serving"])
@pytest.mark.parametrize("big", [2**63, -2**63 - 1])
def test_an_id_past_int64_is_an_input_error(call, big):
    model = load("tiny-llama")
    ids = [1, 2, big]
    run = {"prefix_key": lambda: prefix_key("m" * 64, ids, tokenizer="t" * 64),
           "block_hashes": lambda: block_hashes(ids, 1),
           "recompute": lambda: RecomputeBackend(model).next_logits(ids),
           "cached": lambda: backend_for("cached", model).next_logits(ids),
           "prefix": lambda: backend_for("prefix", model).next_logits(ids),
           "serving": lambda: ServingEngine(model, num_pages=8, page_size=4).generate([ids], 2)}[call]
    with pytest.raises(InputError, match="outside the vocabulary"):
        run()


# ---- 8. float16 scales overflowing
SETTINGS = [dict(), dict(bits=4), dict(zero_point=True), dict(smooth=True), dict(smooth=True, zero_point=True),
            dict(scheme="kivi", group_size=2, residual=0), dict(scheme="kivi", bits=2, group_size=2, residual=0)]


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_float16_scales_never_turn_finite_keys_into_inf(settings):
    model = load("tiny-llama")
    cache = QuantizedCache(model.config, scale_dtype=torch.float16, **settings)
    k = torch.randn(1, 2, 4, 16, generator=torch.Generator().manual_seed(0))
    k[0, 0, 0, 0], k[0, 1, 1, 1] = 1e7, -1e7               # finite, but 1e7 / 127 is past float16's 65,504
    with pytest.raises(CacheInputError, match="float16"):
        cache.update(0, k, k)
    assert cache.length == 0 and cache.k_tail[0] is None  # refused before anything changed


@pytest.mark.parametrize("settings", SETTINGS, ids=str)
def test_float16_scales_stay_finite_up_to_the_largest_accepted_value(settings):
    model = load("tiny-llama")
    cache = QuantizedCache(model.config, scale_dtype=torch.float16, **settings)
    largest_k, largest_v = cache.largest()
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(1, 2, 4, 16, generator=g), torch.randn(1, 2, 4, 16, generator=g)
    k[0, 0, 0, 0], k[0, 0, 0, 1], k[0, 1, 1, 1] = largest_k, -largest_k, largest_k   # one token spans both
    v[0, 0, 0, 0], v[0, 0, 0, 1] = largest_v, -largest_v
    for layer in range(model.config.n_layers):
        cache.update(layer, k, v)
    cache.advance(4)
    assert cache.quantized == 4                             # every position went through the quantizer
    keys, values = cache._read(0)                           # what attention reads: [1, 2, 4, 16]
    assert torch.isfinite(keys).all() and torch.isfinite(values).all()
    # within the grid's error of the input: half a scale, the scale at most 2 x largest / 3 (2 bits)
    assert (keys - k).abs().max() <= largest_k and (values - v).abs().max() <= largest_v


# ---- 9. NaN keys in an evicting cache
@pytest.mark.parametrize("policy", ["window", "sinks", "h2o", "snapkv"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_evicting_cache_refuses_non_finite_keys(policy, bad):
    model = load("tiny-llama")
    cache = EvictingCache(model.config, budget=8, policy=policy, observation=2)
    k = torch.randn(1, 2, 3, 16)
    k[0, 1, 2, 5] = bad
    with pytest.raises(CacheInputError, match="NaN or infinite"):
        cache.attend(0, torch.randn(1, 4, 3, 16), k, torch.randn(1, 2, 3, 16))
    assert cache.keys[0] is None and cache.length == 0      # nothing stored


# ---- 11. booleans, floats and unordered containers taken as ids or counts
def test_chat_say_refuses_anything_but_text(smollm2):
    session = ChatSession(smollm2, RecomputeBackend(smollm2), max_new_tokens=2)
    for text in (None, 5, b"hi"):
        with pytest.raises(TypeError, match="string"):
            session.say(text)
    assert session.messages == [] and session.turns == []


@pytest.mark.parametrize("n, error", [(0, ValueError), (-1, ValueError), (2.5, TypeError), (True, TypeError)])
def test_counts_must_be_ints_of_at_least_one(n, error):
    model = load("tiny-llama")
    with pytest.raises(error, match="max_new_tokens"):
        ChatSession(model, RecomputeBackend(model), max_new_tokens=n)
    backend = RecomputeBackend(model)
    with pytest.raises(error, match="max_new_tokens"):
        generate(backend, [1, 2, 3], max_new_tokens=n)
    assert backend.calls == 0


@pytest.mark.parametrize("ids", [{1: 2, 3: 4}, {1, 2, 3}, "abc", b"abc"], ids=lambda x: type(x).__name__)
def test_ids_must_be_an_ordered_sequence_of_ints(ids):
    model = load("tiny-llama")
    with pytest.raises(InputError, match="ids must be"):
        prefix_key("m" * 64, ids, tokenizer="t" * 64)
    for backend in (backend_for("cached", model), backend_for("prefix", model), RecomputeBackend(model)):
        with pytest.raises(InputError, match="ids must be"):
            backend.next_logits(ids)


@pytest.mark.parametrize("salt", [5, b"tenant", 1.5, True])
def test_a_salt_is_a_string_everywhere(salt):
    """A salt is a string or None, and every entry point refuses anything else with the same error."""
    model = load("tiny-llama")
    calls = [lambda: prefix_key("m" * 64, [1, 2], tokenizer="t" * 64, salt=salt),
             lambda: CachedBackend(model, lambda: StaticCache(model.config, 8), salt=salt),
             lambda: backend_for("cached", model).next_logits([1, 2], salt=salt),
             lambda: PrefixCachingBackend(model, num_pages=4, page_size=4, salt=salt),
             lambda: backend_for("prefix", model).next_logits([1, 2], salt=salt)]
    for call in calls:
        with pytest.raises(TypeError, match="salt must be a string or None"):
            call()


# ---- 13. an identical copy of the model swapped in
@pytest.mark.parametrize("kind", ["cached", "prefix"])
@pytest.mark.parametrize("how", ["deepcopy", "load_again"])
def test_identical_copy_swapped_in_is_served_not_refused(kind, how):
    model = load("tiny-llama")
    backend = backend_for(kind, model)
    backend.next_logits(IDS[:-1])
    backend.model = copy.deepcopy(model) if how == "deepcopy" else load("tiny-llama")
    misses = getattr(backend, "misses", None)
    assert (backend.next_logits(IDS) - oracle(backend.model, IDS)).abs().max() <= TOL
    if kind == "cached":                                   # other tensors: a miss that recomputes
        assert backend.misses == misses + 1
        assert (backend.next_logits(IDS + [7]) - oracle(backend.model, IDS + [7])).abs().max() <= TOL
        assert backend.hits == 1                           # and the state it computed is then reused
