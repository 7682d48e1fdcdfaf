"""KV caches behind one interface (update, advance, reset, fork, crop, nbytes), and their sizing."""

from .base import CacheError, CacheFullError, CacheInputError, CacheMismatchError, CacheStateError, KVCache
from .block_manager import BlockManager, OutOfPagesError
from .concat import ConcatCache
from .paged import PagedCache
from .sizing import bytes_per_position, cache_bytes
from .static import StaticCache

__all__ = ["KVCache", "ConcatCache", "StaticCache", "PagedCache", "BlockManager", "OutOfPagesError", "CacheError",
           "CacheFullError", "CacheInputError", "CacheStateError", "CacheMismatchError", "bytes_per_position",
           "cache_bytes"]
