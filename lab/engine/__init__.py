"""The engine: backends that take ids and return scores, and the loop that generates through them."""

from .backends import CachedBackend, RecomputeBackend, as_ids
from .generate import Generation, generate, positions_cached, positions_uncached

__all__ = ["CachedBackend", "RecomputeBackend", "as_ids", "Generation", "generate", "positions_cached",
           "positions_uncached"]
