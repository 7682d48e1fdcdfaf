"""KV caches behind one interface (update, advance, reset, fork, crop, nbytes), and their sizing."""

from .base import CacheError, CacheFullError, CacheInputError, CacheMismatchError, CacheStateError, KVCache
from .concat import ConcatCache
from .sizing import bytes_per_position, cache_bytes
from .static import StaticCache

__all__ = ["KVCache", "ConcatCache", "StaticCache", "CacheError", "CacheFullError", "CacheInputError",
           "CacheStateError", "CacheMismatchError", "bytes_per_position", "cache_bytes"]
