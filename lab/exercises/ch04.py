"""Chapter 4 exercises: a store of cached prefixes, keyed by identity, with an eviction rule of your choice;
and (open-ended) the cost of a prefix key on your own machine, beside the book's.

A store keeps the states it is given: it never runs the model (the model's code and matrix products raise
while the store's methods run), and it keeps at most `capacity` of them (the check counts the caches still
alive after the stream). A key's cost is a measurement: it must fit inside the call, and grow with the ids.
"""

import contextlib
import gc
import random
import time

import torch

from .. import results
from ..bench import time_call
from ..cache import CacheMismatchError, ConcatCache, KVCache
from ..engine import identity_of, prefix_key
from ..models import forward, forward_cached, gpt2, llama, load
from ..models.load import scaled_copy
from ..results import COMMITTED
from . import compare_with_book
from .rules import ForbidTorch, functions_raise, unchanged

SYSTEMS = ["You are terse.", "You are a pirate.", "You translate to French.", "You write haiku.",
           "You answer in JSON.", "You are a patient teacher of physics."]
USERS = ["What is a cache?", "Why is the sky blue?", "Name three rivers.", "How do magnets work?",
         "Tell me a joke.", "What is 17 times 3?"]


def request_stream(n=48, seed=0):
    """Requests that share system prompts: (text, who). Most go to the base model; some to a fine-tuned
    variant of it (other weights, same shapes), some come from another tenant (another salt)."""
    rng = random.Random(seed)
    return [(f"<system>{rng.choice(SYSTEMS)}</system><user>{rng.choice(USERS)}</user>",
             rng.choices(["base", "tuned", "tenant-b"], weights=[6, 1, 1])[0]) for _ in range(n)]


NO_MODEL = ("your store ran the model: a store keeps the states it was given and hands out forks of them, it "
            "never computes one")


class _StoreOnly:
    """The reader's store, each of its calls made while the model's code and its matrix products raise."""

    def __init__(self, store):
        self.store = store

    def lookup(self, identity, ids):
        with _no_model():
            return self.store.lookup(identity, ids)

    def insert(self, identity, ids, cache):
        with _no_model():
            return self.store.insert(identity, ids, cache)


def _no_model():
    stack = contextlib.ExitStack()
    stack.enter_context(unchanged(__name__))
    stack.enter_context(functions_raise(forward, forward_cached, gpt2.forward, gpt2.block, llama.forward,
                                        llama.block, why=NO_MODEL))
    stack.enter_context(ForbidTorch(("mm", "matmul", "linear", "embedding", "scaled_dot_product"), NO_MODEL))
    return stack


def _live_caches() -> set:
    gc.collect()
    return {id(x) for x in gc.get_objects() if issubclass(type(x), KVCache)}


def _live_storages() -> dict:
    """{storage address: bytes} of every tensor alive in the process: a store that keeps keys and values as plain
    tensors, not in caches, holds them too."""
    gc.collect()
    return {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in gc.get_objects()
            if issubclass(type(t), torch.Tensor) and not t.is_meta}


@torch.inference_mode()
def check_prefix_store(make_store, capacity=3):
    """make_store(capacity) -> an object with lookup(identity, ids) -> (cache or None, n) and
    insert(identity, ids, cache).

    lookup returns a cache holding exactly ids[:n] (n < len(ids)) stored under the same identity, which the
    caller may extend; insert keeps the state of ids. The check serves a stream of requests through your
    store, compares every answer with recomputation, and reports the hit rate of your eviction rule.
    Rules: the store never runs the model (lookup hands out stored states, it does not compute them), and it
    keeps at most `capacity` caches: after the stream, the caches still alive are counted, and so are the bytes
    of the tensors still alive, which may not exceed `capacity` of the stream's largest states (a store that
    keeps keys and values as tensors of its own keeps them too).
    """
    base = load("tiny-llama")
    # layer 0: the keys and values of layer 1 depend on it (the last layer's MLP changes no cached state)
    tuned = scaled_copy(base, "model.layers.0.mlp.down_proj.weight", 1.5)   # a fine-tune: same shapes
    models = {"base": base, "tuned": tuned, "tenant-b": base}
    cfg = base.config
    with _no_model():
        store = _StoreOnly(make_store(capacity))

    # the rule itself: a state stored for one tenant is never offered to another, whatever the ids
    ids = base.tokenizer.encode("<system>shared</system>")
    cache = ConcatCache(cfg)
    forward_cached(torch.tensor([ids]), base.weights, cfg, cache)
    store.insert(identity_of(base, cache, "tenant-a"), ids, cache)
    other, n = store.lookup(identity_of(base, ConcatCache(cfg), "tenant-c"), ids + [1])
    assert other is None and n == 0, "a state stored under one salt was offered to another tenant"

    # the rule again, for ids alone: a stored state is offered only for ids that extend its own ids
    with _no_model():
        store = _StoreOnly(make_store(capacity))
    a, b = base.tokenizer.encode("<system>one</system>"), base.tokenizer.encode("<system>two</system>")
    cache = ConcatCache(cfg)
    forward_cached(torch.tensor([a]), base.weights, cfg, cache)
    store.insert(identity_of(base, cache), a, cache)
    got, n = store.lookup(identity_of(base, ConcatCache(cfg)), b + [1])
    common = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))
    assert n <= common, (f"lookup offered {n} positions of a state whose ids share only {common} with the "
                         "request: a stored state is reusable only up to the common prefix")

    del store, cache, other, got
    before, tensors_before = _live_caches(), _live_storages()
    largest = 0
    with _no_model():
        store = _StoreOnly(make_store(capacity))
    hits, saved, total = 0, 0, 0
    for text, who in request_stream():
        model, salt = models[who], "tenant-b" if who == "tenant-b" else None
        w = model.weights
        ids = model.tokenizer.encode(text)
        identity = identity_of(model, ConcatCache(cfg), salt)
        cache, n = store.lookup(identity, ids)
        if cache is None:
            cache, n = ConcatCache(cfg), 0
        assert 0 <= n < len(ids) and cache.length == n, f"lookup returned n={n} with a cache of {cache.length}"
        try:
            got = forward_cached(torch.tensor([ids[n:]]), w, cfg, cache)[0, -1]
        except CacheMismatchError as e:  # the cache records which model filled it, and refuses another
            raise AssertionError(f"request {text!r} ({who}): lookup offered a state computed by another model, "
                                 f"and the cache itself refused it ({e}): a stored state is offered only under "
                                 "its own identity") from e
        want = forward(torch.tensor([ids]), w, cfg)[0, -1]
        assert (got - want).abs().max() < 1e-5, (
            f"request {text!r} ({who}): served from a stored prefix of {n} tokens, the scores differ from "
            "recomputation: the stored state was not the state of ids[:n] under this identity")
        largest = max(largest, cache.nbytes())
        store.insert(identity, ids, cache)
        hits, saved, total = hits + (n > 0), saved + n, total + len(ids)
    del cache, got, want
    held = len(_live_caches() - before)
    assert held <= capacity, (f"after the stream {held} caches are still alive, held by your store: more than its "
                              f"capacity of {capacity}. Evict: that is the rule you choose")
    kept = sum(b for a, b in _live_storages().items() if a not in tensors_before)
    assert kept <= STATE_SLACK * capacity * largest, (
        f"after the stream your store holds {kept / 2**10:,.0f} KiB of tensors, {kept / largest:.1f} times the "
        f"largest state of the stream ({largest / 2**10:,.0f} KiB): more than its capacity of {capacity} states, "
        "whether in caches or not. Evict: that is the rule you choose")
    stream = request_stream()
    assert hits >= len(stream) // 4, (f"only {hits} of {len(stream)} requests reused a prefix: "
                                      "the store keeps too little")
    print(f"correct: {hits} of {len(stream)} requests reused a prefix; {saved} of {total} positions "
          f"({saved / total:.0%}) were not recomputed (capacity {capacity})")
    return hits / len(stream)


# The bytes a store may keep after the stream, over capacity x the largest state: a state's tensors may sit in a
# buffer somewhat larger than they are (a slice of a grown one); a store that keeps every state keeps ~15x.
STATE_SLACK = 1.5


# How far a reader's key may be from prefix_key's time, either way: on the book's machine the chapter's minimal
# key took 0.78x prefix_key's time over 4,096 ids; a factor of 20 leaves room for a key built another way,
# and refuses a number made up from T.
KEY_AGREE = 20


def _measured_key_cost(fn, n):
    """fn(n), refused unless it is a positive number that fits inside the time fn took."""
    with unchanged(__name__), functions_raise(results.read, results.lookup, compare_with_book):
        t0 = time.perf_counter()
        us = fn(n)
        took_us = (time.perf_counter() - t0) * 1e6
    assert isinstance(us, (int, float)) and not isinstance(us, bool) and us > 0, (
        f"expected a positive number of microseconds, got {us!r}")
    assert us <= took_us, (f"you report {us:.3g} µs for one key, but your function took only {took_us:.3g} "
                           "µs in all: measure the key, do not type or look up a number")
    return us


def check_key_cost(fn, T=4096, path=COMMITTED):
    """fn(T) -> microseconds of one prefix key over T token ids, measured on this machine.

    Open-ended: time lab.engine.prefix_key, or a key of your own (the minimal key of the chapter's first
    cells), however you like (lab.bench.time_call excludes warm-up and reports the median).
    Rule: it is a measurement, so the time you report must fit inside the time your function took, and a key
    over four times as many ids must cost more (the check runs fn(4 * T) too: at least 1.5 times as much, in
    one of three tries; a key reads every id), and agree within a factor of 20 with the check's own timing of
    prefix_key over T ids. lab.results raises while your function runs. Then your number
    is set beside the book's (`ch04.key_cost_us.T<T>` in results/results.json).
    """
    for _ in range(3):               # a busy machine can slow one call: an honest key passes one of three
        costs = [_measured_key_cost(fn, n) for n in (T, 4 * T)]
        if costs[1] >= 1.5 * costs[0]:
            break
    assert costs[1] >= 1.5 * costs[0], (
        f"a key over {4 * T} ids cost you {costs[1]:.3g} µs, over {T} ids {costs[0]:.3g} µs (three tries): a key "
        "reads every id, so four times the ids cost more. Build T ids in your function and measure the key over "
        "them; do not type a number")
    ids = list(range(T))
    mine = time_call(lambda: prefix_key("m" * 64, ids, tokenizer="t" * 64), warmup=3, reps=50)["median"] * 1e6
    assert mine / KEY_AGREE <= costs[0] <= mine * KEY_AGREE, (
        f"you report {costs[0]:.3g} µs for a key over {T} ids; the check timed prefix_key over {T} ids at "
        f"{mine:.3g} µs just now, a factor of {max(costs[0] / mine, mine / costs[0]):.0f} apart: measure a key "
        "on this machine, do not type or compute a number")
    key = f"ch04.key_cost_us.T{T}"
    # A median of timed calls does not land on the book's stored float by chance: equality is a copy.
    assert costs[0] != results.lookup(results.read(path), key, source=str(path))["value"], (
        f"your number is the book's {key} to the last digit: return what your calls measured")
    return compare_with_book(key, costs[0], path=path)
