"""KV caches behind one interface (update, advance, reset, fork, crop, nbytes), and their sizing."""

from .sizing import bytes_per_position, cache_bytes

__all__ = ["bytes_per_position", "cache_bytes"]
