"""KV caches behind one interface (update, advance, reset, fork, crop, nbytes), and their sizing."""

from .base import CacheError, CacheFullError, CacheInputError, CacheMismatchError, CacheStateError, KVCache
from .block_manager import BlockManager, OutOfPagesError
from .concat import ConcatCache
from .paged import PagedCache
from .sizing import bytes_per_position, cache_bytes
from .static import StaticCache


def make_cache(design: str, config, max_tokens: int, batch_size: int = 1, device="cpu"):
    """A contiguous cache by name: "concat" (grows; max_tokens unused) or "static" (max_tokens reserved)."""
    if design == "concat":
        return ConcatCache(config, batch_size=batch_size, device=device)
    if design == "static":
        return StaticCache(config, max_tokens=max_tokens, batch_size=batch_size, device=device)
    raise ValueError(f"design must be 'concat' or 'static', got {design!r}")


__all__ = ["KVCache", "ConcatCache", "StaticCache", "PagedCache", "BlockManager", "OutOfPagesError", "CacheError",
           "CacheFullError", "CacheInputError", "CacheStateError", "CacheMismatchError", "bytes_per_position",
           "cache_bytes", "make_cache"]
