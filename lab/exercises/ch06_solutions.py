"""Reference solutions for chapter 6: LFU eviction of cached pages; a test that a weight update invalidates
every cached page."""

import torch

from ..engine import RecomputeBackend
from ..models import load


def lfu_cached_tokens(requests, num_pages, page_size):
    # A page's name is the tuple of every token up to its end: what the chained digest stands for. Between
    # requests every page is free, so the pool is just the named pages (the rest hold nothing reusable).
    P, cached, out = page_size, {}, []           # cached: name -> [uses, when it was last freed]
    clock = 0
    for ids in requests:
        names = [tuple(ids[:(i + 1) * P]) for i in range(len(ids) // P)]
        n = 0
        while n < (len(ids) - 1) // P and names[n] in cached:   # the longest cached prefix, one token left
            cached[names[n]][0] += 1                            # used once more
            n += 1
        held = set(names[:n])
        for taken in range(-(-len(ids) // P) - n):              # a fresh page for every page not reused
            if len(cached) + taken >= num_pages:                # no unnamed page left: evict one
                victim = min((k for k in cached if k not in held), key=lambda k: cached[k])  # (uses, freed)
                del cached[victim]
        mine = names[:n] + [k for k in names[n:] if k not in cached]   # a name already held stays where it is
        for k in names[n:]:
            cached.setdefault(k, [1, None])                     # named: its first use
        for k in reversed(mine):                                # freed from the last page to the first
            cached[k][1], clock = clock, clock + 1
        out.append(n * P)
    return out


def weight_update_test(make_backend):
    # A private model: load builds a new one on every call, so the update below touches nothing shared.
    model = load("tiny-llama")
    backend = make_backend(model)
    P = backend.page_size
    ids = [(7 * i + 3) % model.config.vocab_size for i in range(4 * P + 1)]   # four full pages and one token
    backend.next_logits(ids)                                  # fill the cache: four named pages
    with torch.no_grad():
        model.weights["model.layers.0.self_attn.v_proj.weight"].mul_(1.5)  # in place: every page now stale
    for call in ("first", "second"):                           # the second is served from the new pages
        before = backend.stats["cached_tokens"]
        got = backend.next_logits(ids)
        cached = backend.stats["cached_tokens"] - before
        want = RecomputeBackend(model).next_logits(ids)
        # 1e-5: float32, the same sums in another order; a stale page moves the scores by 1e-3 or more
        assert (got - want).abs().max() <= 1e-5, (
            f"{call} call after the update: {cached} tokens from the cache, scores differ from recomputation")
        assert cached == (0 if call == "first" else 4 * P), f"{call} call after the update: {cached} tokens cached"
