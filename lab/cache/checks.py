"""Input and state checks for the caches, kept apart so that a listed cache class shows the idea. Every check
raises a typed CacheError naming what was wrong and what was expected, before anything changes, so a failed call
leaves the cache exactly as it was. The errors come from `.errors`, not from `.base`: base.py imports this module.
"""

import torch

from .errors import CacheFullError, CacheInputError, CacheMismatchError, CacheStateError, OutOfPagesError


# ---- contiguous caches: the checks KVCache (base.py), ConcatCache and StaticCache call
def count(what, n):
    """A number of positions given to advance() or crop() is a whole number."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise CacheStateError(f"{what}() takes a whole number of positions, got {n!r}")


def int_arg(what, n, low=0):
    """An int argument (a count, a page, a slot, a size) of at least `low` (None: any int)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise CacheInputError(f"{what} must be an int, got {n!r}")
    if low is not None and n < low:
        raise CacheInputError(f"{what} must be at least {low}, got {n}")


def kv(cache, layer, k, v):
    """k and v are `[batch, kv_heads, tokens >= 1, head_dim]` tensors of the cache's dtype and device."""
    if not isinstance(layer, int) or not 0 <= layer < cache.n_layers:
        raise CacheInputError(f"layer index {layer!r} out of range: the model has layers 0..{cache.n_layers - 1}")
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor):
            raise CacheInputError(f"{name} must be a tensor, got {type(x).__name__}")
        if x.dim() != 4:
            raise CacheInputError(f"{name} must have rank 4, [batch, kv_heads, tokens, head_dim], "
                                  f"got shape {tuple(x.shape)}")
        B, H, T, D = x.shape
        if (B, H, D) != (cache.batch_size, cache.n_kv_heads, cache.head_dim) or T < 1:
            raise CacheInputError(f"{name} has shape {tuple(x.shape)}, expected [{cache.batch_size}, "
                                  f"{cache.n_kv_heads}, tokens >= 1, {cache.head_dim}]")
        if x.dtype != cache.dtype:
            raise CacheInputError(f"{name} has dtype {x.dtype}, the cache holds {cache.dtype}")
        if x.device != cache.device:
            raise CacheInputError(f"{name} is on {x.device}, the cache is on {cache.device}")
    if k.shape != v.shape:
        raise CacheInputError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")


def update(cache, layer, k, v):
    """update(): valid k, v; the layer not yet served in this step; room for the new positions."""
    kv(cache, layer, k, v)
    if cache.pending[layer]:
        raise CacheStateError(f"layer {layer} was already updated in this step; call advance() first")
    if any(cache.pending) and k.shape[2] != max(cache.pending):
        raise CacheStateError(f"this step stores {max(cache.pending)} positions per layer, layer {layer} got "
                              f"{k.shape[2]}")
    t, capacity, held = k.shape[2], cache.capacity(), cache.max_length
    if capacity is not None and held + t > capacity:
        raise CacheFullError(f"{held} positions held + {t} new > capacity {capacity}")


def equal_rows(cache, what):
    """update() returns every position of every row as one tensor, which needs rows of equal length."""
    lengths = cache.seq_lengths()
    if min(lengths) != max(lengths):
        raise CacheStateError(f"{what}() returns every position, which needs rows of equal length, got {lengths}; "
                              "a batch of different lengths decodes through attend()")


def advance(cache, t):
    """advance(t): every layer stored the same t positions in this step."""
    count("advance", t)
    if any(p != t for p in cache.pending):
        raise CacheStateError(f"advance({t}) but the layers stored {cache.pending} new positions: every layer "
                              f"must be updated once with the same {t} positions before advance")


def crop(cache, n):
    """crop(n): 0 <= n <= the committed length of every row."""
    count("crop", n)
    lengths = cache.seq_lengths()
    if not 0 <= n <= min(lengths):
        held = lengths[0] if min(lengths) == max(lengths) else lengths
        raise CacheStateError(f"crop({n}): the cache holds {held} positions; n must be in 0..{min(lengths)}")


def set_length(cache, n):
    """`cache.length = n` by hand: a whole number within the capacity, between steps."""
    count("length", n)
    capacity = cache.capacity()
    if n < 0 or capacity is not None and n > capacity:
        raise CacheStateError(f"length {n} outside 0..{capacity}")
    between_steps(cache, "setting length")


def between_steps(cache, what):
    """fork() and the like: no layer holds positions of an unfinished step."""
    if any(cache.pending):
        raise CacheStateError(f"{what}() in the middle of a step (layers hold pending positions {cache.pending}); "
                              "call advance() first")


def same_rules(a, b) -> bool:
    """Two configs hold and read their caches alike: the same latent, the same window in every layer."""
    return a is b or a.kv_rank == b.kv_rank and all(a.window_of(i) == b.window_of(i)
                                                    for i in range(a.kv_layout[0]))


def shared_read(cache, layer, q):
    """attend(layer, q, None, None), a layer reading an earlier layer's cache (share_kv): that layer has
    stored this step's positions, which the reading layer's T queries are."""
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < cache.n_layers:
        raise CacheInputError(f"layer index {layer!r} out of range: the cache has layers 0..{cache.n_layers - 1}")
    if not cache.pending[layer] or q is not None and (not isinstance(q, torch.Tensor) or q.dim() != 4
                                                       or cache.pending[layer] != q.shape[2]):
        raise CacheStateError(f"a shared read of layer {layer} must follow its store in the same step: it holds "
                              f"{cache.pending[layer]} new positions, the queries are "
                              f"{tuple(q.shape) if isinstance(q, torch.Tensor) else q!r}")


def fits(what, holder, config):
    """A cache (or pool) was built for a model of this shape (layers, kv_heads, head_dim), latent
    and windows, and holds keys and values in the dtype the model computes them in."""
    mine, theirs = (holder.n_layers, holder.n_kv_heads, holder.head_dim), config.kv_layout
    if mine != theirs or not same_rules(holder.config, config):
        raise CacheMismatchError(f"{what} built for (layers, kv_heads, head_dim) = {mine}, model has {theirs}"
                                 + ("" if mine != theirs else ", with another latent or other windows"))
    held = holder.dtype
    if held != config.torch_dtype:
        raise CacheMismatchError(f"the {what} holds {held}, the model {config.name or config.arch} computes in "
                                 f"{config.torch_dtype}: build it with the model's dtype (the default)")


def model(cache, config, owner):
    """The cache fits the model, and the positions it holds were computed by `owner`."""
    fits("cache", cache, config)
    held = cache.max_length or any(cache.pending)
    if held and cache.owner is not None and owner != cache.owner:
        raise CacheMismatchError(f"the cache holds {cache.max_length} positions computed by another model (or by "
                                 "these weights before they changed): its keys and values are not this model's. "
                                 "reset() it, or use a new cache")


# ---- pages: the checks PagedCache (paged.py) calls (the BlockManager's own live beside it)
def paged_sizes(max_tokens, page_size, max_seq_tokens):
    """PagedCache(config, max_tokens, page_size, max_seq_tokens=): ints of at least 1 (the last may be None)."""
    for name, v in (("max_tokens", max_tokens), ("page_size", page_size), ("max_seq_tokens", max_seq_tokens)):
        if name == "max_seq_tokens" and v is None:
            continue                                  # None: one sequence may take the whole pool
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CacheInputError(f"{name} must be an int of at least 1, got {v!r}")


def memory_fraction(fraction):
    """PagedCache.from_memory(fraction=): a real number in (0, 1], not a bool (True is not 100%)."""
    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)):
        raise CacheInputError(f"fraction must be a number in (0, 1], got {type(fraction).__name__} {fraction!r}")
    if not 0 < fraction <= 1:
        raise CacheInputError(f"fraction must be in (0, 1], got {fraction}")


def distinct_parts(parts, what: str = "plan_step"):
    """reserve(parts), plan_step(parts): every sequence named once (two parts of one would share its slots)."""
    seqs = [seq for seq, _ in parts]
    if len(set(seqs)) != len(seqs):
        raise CacheInputError(f"{what}() names a sequence twice: {seqs}")


def step_part(manager, seq, n) -> int:
    """plan_step: `seq` is live and holds at least the n >= 1 positions this step runs; returns the first."""
    int_arg("n", n, low=1)
    held = manager.length(seq)                        # CacheStateError for an unknown or released id
    if n > held:
        raise CacheStateError(f"a step of {n} tokens for sequence {seq!r}, which holds {held} reserved "
                              "positions: reserve them first")
    return held - n


def step_model(step, config, owner):
    """A planned step: the pool fits the model, and its pages hold `owner`'s keys."""
    pool = step.pool
    fits("pool", pool, config)
    if pool.owner is not None and owner != pool.owner:
        raise CacheMismatchError("the pool's pages hold keys and values of another model (or of these weights "
                                 "before they changed): use a new pool")


def step_kv(step, layer, k, v):
    """A planned step's attend: a plan not yet run, a layer not yet served, k and v `[1, H_kv, N, D]`."""
    pool = step.pool
    if step.done:
        raise CacheStateError("this planned step has run (advance was called): plan the next step")
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < pool.n_layers:
        raise CacheInputError(f"layer index {layer!r} out of range: the model has layers 0..{pool.n_layers - 1}")
    if step.pending[layer]:
        raise CacheStateError(f"layer {layer} was already served in this step; call advance() first")
    want = (1, pool.n_kv_heads, step.n_tokens, pool.head_dim)
    for name, x in (("k", k), ("v", v)):
        if not isinstance(x, torch.Tensor) or tuple(x.shape) != want:
            shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
            raise CacheInputError(f"{name} must be a tensor of shape {list(want)} (the step's {step.n_tokens} "
                                  f"tokens as one row), got {shape}")
        if x.dtype != pool.dtype or x.device != pool.device:
            raise CacheInputError(f"{name} is {x.dtype} on {x.device}, the pool holds {pool.dtype} on {pool.device}")


def pool_pages(manager):
    """PagePool: every local group holds the window of one sequence (and what a one-token step adds), so
    that a request running alone always makes progress."""
    for group in manager.groups:
        least, have = manager.most_pages(group, 1), manager.manager(group).num_pages
        if least is not None and have < least:
            window, sinks = manager.rule(group)
            raise CacheInputError(f"group {group!r} has {have} pages; one sequence's window ({window} positions, "
                                  f"{sinks} sinks, pages of {manager.page_size}) needs {least}")


def pool_room(pool, parts):
    """PagePool.reserve(parts): every sequence named once, and free pages in every group for all of them
    (what a window gives back counted for its own sequence only), so that a refused call changes nothing."""
    distinct_parts(parts, "reserve")
    seqs = [seq for seq, _ in parts]
    manager, need = pool.manager, dict.fromkeys(pool.manager.groups, 0)
    for seq, n in parts:                               # validates every id and count
        for group, k in pool.pages_needed(seq, n).items():
            need[group] += max(k, 0)
    for group, k in need.items():
        if k > manager.num_free[group]:
            raise OutOfPagesError(f"reserving {[n for _, n in parts]} positions for sequences {seqs} needs {k} "
                                  f"free pages of group {group!r}, which has {manager.num_free[group]} of "
                                  f"{manager.num_pages[group]} free")


def step_query(q):
    """A planned step's attend: queries to attend with (a layer that attends by itself is not served)."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise CacheInputError(f"q must be a tensor [1, H_q, N, D]: a planned step attends for the layer, "
                              f"got {q if q is None else type(q).__name__}")
