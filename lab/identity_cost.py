"""What checking a state's identity costs, beside the work it guards: a decode step.

Three measurements, each a protocol a chapter (or a reader) runs on any model:
- `key_cost`: `prefix_key` over T ids, CachedBackend's whole check on a call that extends a state of
  T - 1 positions, and one cached decode step at that context.
- `weights_check_cost`: noticing changed weights, per call (the manifest read with the weights unchanged,
  `owner` and the fingerprint inside both) and once per change (the rehash of every tensor).
- `refusal_cost`: a call the backend refuses (it recomputes) against a plain recomputation.
"""

import torch

from . import data
from .bench import time_call, time_rounds, time_steps
from .cache import StaticCache
from .engine.backends import CachedBackend, RecomputeBackend
from .engine.identity import identity_of, key_for, prefix_key
from .models import forward_cached, owner
from .models.checks import fingerprint, tensor_versions
from .models.load import Model


def key_cost(model, lengths=(16, 512, 4096), reps=400, step_reps=9) -> dict:
    """What the identity check costs per call, beside one cached decode step at the same context.

    For each length T: `prefix_key` over T ids (identity and ids, from scratch); the CachedBackend's own
    check on a call that extends a state of T - 1 positions (`reusable_prefix`, then the key of the new
    state, as `next_logits` does: the manifest, with its fingerprint, is read once, and the weights'
    versions once); and one decode step of the model through a StaticCache holding T - 1 positions
    (forward_cached's owner check included). The check reads the ids, the identity and the cache's
    bookkeeping, never the values in the cache, and a step's time does not depend on them: the backend's
    state is set by hand (a cache of T - 1 positions, recorded as the backend records what it wrote)
    rather than prefilled. Returns {T: {key, check, step}}, each a timing summary (lab.bench).
    """
    ident = identity_of(model, StaticCache(model.config, 1, dtype=model.dtype))  # the same at every length
    out = {}
    for T in lengths:
        ids = torch.randint(0, model.config.vocab_size, (T,), generator=torch.Generator().manual_seed(T)).tolist()
        cache = StaticCache(model.config, T, dtype=model.dtype)
        cache.length = T - 1                               # the state of ids[:-1], as the bookkeeping sees it
        key = time_call(lambda ids=ids: prefix_key(ident.manifest, ids, tokenizer=ident.tokenizer,
                                                   compute_dtype=ident.compute_dtype, cache_dtype=ident.cache_dtype,
                                                   cache_kind=ident.cache_kind, rope_theta=ident.rope_theta,
                                                   max_positions=ident.max_positions), warmup=5, reps=reps)
        backend = CachedBackend(model, lambda cache=cache: cache)
        backend.cache, backend.cached_ids, backend.cached_identity = cache, ids[:-1], ident
        backend.cached_key = key_for(ident, ids[:-1])
        backend._held = (cache, cache.version, tensor_versions(model.weights))  # as next_logits records it

        def check(backend=backend, ids=ids):                # what next_logits adds to a hit, besides the step
            n = backend.reusable_prefix(ids, None)
            key_for(backend.cached_identity, ids)          # a hit reuses the identity it just compared
            return n

        assert backend.holds_its_state() and check() == T - 1, "the check must find the state of ids[:-1]"
        chk = time_call(check, warmup=5, reps=reps)
        token = torch.tensor([[ids[-1]]])
        step = time_steps(lambda cache=cache, T=T: cache.crop(T - 1),
                          lambda cache=cache, token=token: forward_cached(token, model.weights, model.config,
                                                                          cache, last_only=True),
                          warmup=1, reps=step_reps)
        out[T] = dict(key=key, check=chk, step=step)
    return out


def weights_check_cost(model, reps=400, rehash_reps=5) -> dict:
    """What noticing changed weights costs. Per call: `Model.manifest` with the weights unchanged (it
    compares every tensor's storage, version counter and fingerprint with the state it last hashed),
    `owner` (what forward_cached records in the cache and compares, on every call) and, inside both, the
    `fingerprint` alone. Once per change: the first `Model.manifest` after a
    weight changed in place, which hashes every tensor again.

    The change is made to a private copy of one weight (`model` is never changed): an in-place add
    before each timed read, untimed. Returns {manifest, owner, fingerprint, rehash}: timing summaries."""
    manifest = time_call(lambda: model.manifest, warmup=5, reps=reps)
    own = time_call(lambda: owner(model.weights, model.config), warmup=5, reps=reps)
    printed = time_call(lambda: fingerprint(model.weights), warmup=5, reps=reps)
    name = next(k for k, w in model.weights.items() if w.dim() == 2)
    with torch.inference_mode(False):
        weights = dict(model.weights) | {name: model.weights[name].clone()}  # the others shared, only read
    copy = Model(model.name, model.config, weights, model.tokenizer, model.files)
    before = copy.manifest
    rehash = time_steps(lambda: weights[name].add_(1e-3), lambda: copy.manifest, warmup=0, reps=rehash_reps)
    assert copy.manifest != before, "the manifest must change when a weight changes in place"
    return dict(manifest=manifest, owner=own, fingerprint=printed, rehash=rehash)


def refusal_cost(model, prefix_len=24, reps=5) -> dict:
    """Seconds of a refused call (the backend discards its cache and recomputes) and of a plain
    recomputation of the same request, medians of `reps` interleaved rounds: {refused, recompute}."""
    p = data.passages(model.tokenizer, 2 * prefix_len + 1, count=1, seed=9)[0]
    request = p[prefix_len:]
    recompute = RecomputeBackend(model)
    backend = CachedBackend(model, lambda: StaticCache(model.config, 128, dtype=model.dtype))
    r = time_rounds({"refused": lambda: backend.next_logits(request),     # refused: recomputes
                     "recompute": lambda: recompute.next_logits(request)},
                    warmup=1, rounds=reps,
                    setup=lambda: backend.next_logits(p[:prefix_len]))  # untimed: holds another prompt's state
    return dict(refused=r["refused"]["median"], recompute=r["recompute"]["median"])
