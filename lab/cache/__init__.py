"""KV caches behind one interface (attend, update, advance, reset, fork, crop, nbytes), and their sizing."""

from .base import (
    CacheError,
    CacheFullError,
    CacheInputError,
    CacheMismatchError,
    CacheStateError,
    KVCache,
    offset_causal_mask,
)
from .block_manager import BlockManager, OutOfPagesError
from .concat import ConcatCache
from .evicting import EvictingCache
from .latent import LatentCache
from .paged import PagedCache
from .quantized import QuantizedCache
from .sizing import bytes_per_position, cache_bytes
from .static import StaticCache

DESIGNS = ("concat", "static", "paged")


def make_cache(design: str, config, max_tokens: int, batch_size: int = 1, dtype=None, device="cpu",
               page_size: int = 16):
    """A cache by name, room for max_tokens positions per row: "concat" (grows; max_tokens unused), "static"
    (max_tokens reserved per row) or "paged" (a pool of pages for max_tokens positions in every row)."""
    if design == "concat":
        return ConcatCache(config, batch_size=batch_size, dtype=dtype, device=device)
    if design == "static":
        return StaticCache(config, max_tokens=max_tokens, batch_size=batch_size, dtype=dtype, device=device)
    if design == "paged":
        return PagedCache(config, max_tokens * batch_size, page_size, batch_size, dtype, device,
                          max_seq_tokens=max_tokens)
    raise ValueError(f"design must be one of {', '.join(map(repr, DESIGNS))}, got {design!r}")


__all__ = ["KVCache", "ConcatCache", "StaticCache", "PagedCache", "QuantizedCache", "EvictingCache", "LatentCache",
           "BlockManager", "OutOfPagesError", "CacheError", "CacheFullError", "CacheInputError", "CacheStateError",
           "CacheMismatchError", "bytes_per_position", "cache_bytes", "make_cache", "DESIGNS", "offset_causal_mask"]
