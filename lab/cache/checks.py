"""Input and state checks for the caches, kept apart so that a listed cache class shows the idea.

Every check raises a typed CacheError naming what was wrong and what was expected, before anything
changes, so a failed call leaves the cache exactly as it was.

The errors come from `.errors`, not from `.base`: base.py imports this module.
"""

import torch

from .errors import CacheFullError, CacheInputError, CacheMismatchError, CacheStateError

# ---- contiguous caches: the checks KVCache (base.py), ConcatCache and StaticCache call


def count(what, n):
    """A number of positions given to advance() or crop() is a whole number."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise CacheStateError(f"{what}() takes a whole number of positions, got {n!r}")


def at_least_one(name, n):
    """A constructor argument (batch_size, max_tokens) is an int of at least 1."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise CacheInputError(f"{name} must be an int, got {n!r}")
    if n < 1:
        raise CacheInputError(f"{name} must be at least 1, got {n}")


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


def model(cache, config, owner):
    """The cache was built for a model of this shape (layers, kv_heads, head_dim), and the positions it
    holds were computed by `owner`."""
    mine = (cache.n_layers, cache.n_kv_heads, cache.head_dim)
    theirs = (config.n_layers, config.n_kv_heads, config.head_dim)
    if mine != theirs:
        raise CacheMismatchError(f"cache built for (layers, kv_heads, head_dim) = {mine}, model has {theirs}")
    held = cache.max_length or any(cache.pending)
    if held and cache.owner is not None and owner != cache.owner:
        raise CacheMismatchError(f"the cache holds {cache.max_length} positions computed by another model (or by "
                                 "these weights before they changed): its keys and values are not this model's. "
                                 "reset() it, or use a new cache")

# ---- end of contiguous caches


# ---- pages: the checks BlockManager (block_manager.py) and PagedCache (paged.py) call


def int_arg(what, n, low=0):
    """An int argument (a count, a page, a slot) of at least `low` (None: any int)."""
    if isinstance(n, bool) or not isinstance(n, int):
        raise CacheInputError(f"{what} must be an int, got {n!r}")
    if low is not None and n < low:
        raise CacheInputError(f"{what} must be at least {low}, got {n}")


def sequence_id(bm, seq):
    """A sequence id is hashable and was never released."""
    try:
        hash(seq)
    except TypeError:
        raise CacheInputError(f"a sequence id must be hashable, got {type(seq).__name__} {seq!r}") from None
    if seq in bm._released:
        raise CacheStateError(f"sequence {seq!r} was released: use after release (ids are never reused)")


def page_id(bm, page):
    """A page id names a page of the pool."""
    int_arg("page", page)
    if page >= bm.num_pages:
        raise CacheInputError(f"page {page} out of range: the pool has pages 0..{bm.num_pages - 1}")


def slot_range(bm, seq, start, n):
    """slots(seq, start, n): positions start..start+n-1 are reserved for the live sequence `seq`."""
    int_arg("start", start)
    int_arg("n", n)
    length = bm._lengths[seq]
    if start + n > length:
        raise CacheStateError(f"slots({seq!r}, {start}, {n}): positions {start}..{start + n - 1} but the "
                              f"sequence holds {length} positions; reserve() them first")


def writable(bm, seq, slot):
    """The live sequence `seq` may write `slot`: in range, in its own unshared page, a reserved position."""
    int_arg("slot", slot)
    if slot >= bm.num_pages * bm.page_size:
        raise CacheInputError(f"slot {slot} out of range: the pool has slots 0..{bm.num_pages * bm.page_size - 1}")
    table, page, offset = bm._tables[seq], slot // bm.page_size, slot % bm.page_size
    if page not in table:
        raise CacheStateError(f"slot {slot} is in page {page}, which sequence {seq!r} does not own "
                              f"(its block table is {table})")
    if bm._refs[page] > 1:
        raise CacheStateError(f"slot {slot} is in page {page}, shared by {bm._refs[page]} sequences since a "
                              f"fork: a shared page is read-only (reserve() gives {seq!r} a private copy)")
    position = table.index(page) * bm.page_size + offset
    if position >= bm._lengths[seq]:
        raise CacheStateError(f"slot {slot} holds position {position} of {seq!r}, which holds "
                              f"{bm._lengths[seq]} positions; reserve() it first")


def registrable(bm, seq, index, digest, parent, tokens):
    """register(): page `index` of `seq` is full, and `digest` is the digest of `parent` and its `tokens`."""
    from .hashing import page_digest

    int_arg("index", index)
    table, length = bm._tables[seq], bm._lengths[seq]
    if (index + 1) * bm.page_size > length:
        raise CacheStateError(f"register({seq!r}, {index}): page {index} is not full ({length} positions held, "
                              f"pages of {bm.page_size}); only a full page's positions are final")
    if len(tokens) != bm.page_size or page_digest(parent, tokens) != digest:
        raise CacheInputError(f"register({seq!r}, {index}): the digest is not that of the parent and the "
                              f"{len(tokens)} tokens given (a page holds {bm.page_size})")
    return table[index]


def sequence_crop(seq, n, length):
    """BlockManager.crop(seq, n): 0 <= n <= the sequence's length."""
    int_arg("n", n, low=None)           # a negative n is a range error, below
    if not 0 <= n <= length:
        raise CacheStateError(f"crop({seq!r}, {n}): the sequence holds {length} positions; n must be in 0..{length}")


def block_manager(bm):
    """Raise AssertionError naming the first broken invariant of a BlockManager's bookkeeping."""
    pages_for = lambda length: -(-length // bm.page_size)
    free = set(bm._free)
    assert len(free) == len(bm._free), f"the free list holds a page twice: {sorted(bm._free)}"
    assert free <= set(range(bm.num_pages)), f"the free list holds unknown pages: {sorted(free)}"
    counted = [0] * bm.num_pages
    for seq, table in bm._tables.items():
        length = bm._lengths[seq]
        assert len(table) == pages_for(length), (
            f"sequence {seq!r} holds {length} positions in {len(table)} pages, expected "
            f"{pages_for(length)} pages of {bm.page_size}")
        assert len(set(table)) == len(table), f"sequence {seq!r} lists a page twice: {table}"
        for page in table:
            counted[page] += 1
    for page in range(bm.num_pages):
        assert bm._refs[page] == counted[page], (
            f"page {page} has reference count {bm._refs[page]} but {counted[page]} block tables hold it")
        assert (page in free) != (counted[page] > 0), (
            f"page {page} is {'both free and' if page in free else 'neither free nor'} owned "
            f"(reference count {counted[page]})")
    assert not bm._released & bm._tables.keys(), f"released ids are live again: {bm._released & bm._tables.keys()}"
    from .hashing import page_digest

    assert len(bm._cached) == len(bm._keys), "a digest names two pages, or a page two digests"
    for page, (digest, parent, tokens) in bm._keys.items():
        assert bm._cached.get(digest) == page, f"page {page} is registered under a digest that names another"
        assert page_digest(parent, tokens) == digest, f"page {page}'s digest is not that of its tokens"


def paged_sizes(max_tokens, page_size):
    """PagedCache(config, max_tokens, page_size): both ints of at least 1."""
    for name, v in (("max_tokens", max_tokens), ("page_size", page_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise CacheInputError(f"{name} must be an int of at least 1, got {v!r}")


def paged_room(cache, T):
    """A step of T positions fits the pool's free pages (capacity(), checked by update, bounds each row)."""
    need = sum(cache.manager.pages_needed(s, T) for s in cache.seqs)  # may overstate by a shared page
    if need > cache.manager.num_free:
        from .block_manager import OutOfPagesError

        raise OutOfPagesError(f"this step needs {need} free pages for {len(cache.seqs)} sequences, the pool "
                              f"has {cache.manager.num_free} of {cache.num_pages} free")


# ---- end of pages
