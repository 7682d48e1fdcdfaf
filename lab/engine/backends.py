"""Backends: the engine's only contract is "ids in, scores out".

`next_logits(ids)` takes the whole sequence so far (a list of token ids) and returns the next token's scores,
`[vocab]`. How a backend gets there (recomputing, or reusing a cache) is its own business: the engine cannot tell,
as the tests check.
"""

import torch

from ..cache import CacheStateError
from ..cache.block_manager import common_length
from ..models import forward, forward_cached
from ..models.checks import tensor_versions
from .identity import check_salt, identity_of, key_for, model_identity, token_ids

common_prefix = common_length      # how many leading ids two lists share


def as_ids(ids, vocab_size: int) -> torch.Tensor:
    """Validate one sequence of token ids (a list, `[T]` or `[1, T]`) and return it as int64 `[1, T]`."""
    return token_ids(ids, vocab_size)[None]


class RecomputeBackend:
    """No cache: every call runs the whole sequence through the model again."""

    def __init__(self, model):
        self.model = model
        self.calls = 0
        self.positions = 0  # token positions pushed through the model, summed over calls

    @torch.inference_mode()
    def next_logits(self, ids) -> torch.Tensor:
        ids = as_ids(ids, self.model.config.vocab_size)  # [1, T]
        logits = forward(ids, self.model.weights, self.model.config, last_only=True)[0, -1]  # [V]
        self.calls += 1  # counted only once the call succeeded
        self.positions += ids.shape[1]
        return logits


class CachedBackend:
    """Keeps a KV cache between calls, serving from it only when it provably holds the right state (chapter 4).

    Each call compares the key the request needs (the state identity and the exact ids `ids[:-k]`, k >= 1) with the
    key of the state the cache holds: equal, only the k new tokens run (a hit); different in any way, the cache is
    discarded and all is recomputed (a miss). With `longest_prefix=True`, a state of the same identity sharing a
    prefix with the request is cropped to it (a crop); a cache that cannot go back that far (an EvictingCache) is a
    miss. The scores are the same either way; an identical copy of the model swapped in is a miss, never an error.
    Counters: calls, hits, misses, crops, positions (pushed through the model)."""

    def __init__(self, model, cache_factory, longest_prefix=False, salt=None):
        model_identity(model)  # refuse at once a model whose identity cannot be computed
        check_salt(salt)
        self.model, self.cache_factory = model, cache_factory
        self.longest_prefix, self.salt = longest_prefix, salt
        self.cache, self.cached_ids, self.cached_identity, self.cached_key = None, [], None, None
        self._held = None      # (cache object, its version, the weights' versions) when it last wrote
        self.calls = self.hits = self.misses = self.crops = self.positions = 0

    def holds_its_state(self) -> bool:
        """Is the cache still exactly what this backend left there? The same object, changed by nobody
        since (its version counter), holding as many positions as the ids it believes it holds, computed
        by the model's tensors as they are now (their storages and versions)."""
        cache, held = self.cache, self._held
        return (cache is not None and held is not None and held[0] is cache and held[1] == cache.version
                and cache.length == len(self.cached_ids)
                and held[2] == tensor_versions(self.model.weights))

    def reusable_prefix(self, ids: list, salt) -> int:
        """How many leading positions of `ids` the current cache provably holds (0: none)."""
        if not self.holds_its_state():
            return 0                                    # no cache, or touched from outside
        identity = identity_of(self.model, self.cache, salt)
        if identity != self.cached_identity:
            return 0                                    # another model, tokenizer, dtype, salt ...
        n = len(self.cached_ids)
        if n < len(ids) and key_for(identity, ids[:n]) == self.cached_key:
            return n                                          # exactly the state of ids[:-k], k >= 1
        if self.longest_prefix:                               # at least one token must be run
            return common_prefix(self.cached_ids, ids[:-1])
        return 0

    @torch.inference_mode()
    def next_logits(self, ids, salt=None) -> torch.Tensor:
        t = as_ids(ids, self.model.config.vocab_size)       # [1, T]
        check_salt(salt)
        ids, salt = t[0].tolist(), self.salt if salt is None else salt
        n = self.reusable_prefix(ids, salt)
        if 0 < n < self.cache.length:
            try:
                self.cache.crop(n)                            # drop the diverging tail (longest-prefix mode)
            except CacheStateError:
                n = 0                                         # it cannot go back there (positions evicted)
        if n == 0:
            self.cache = self.cache_factory()
            if self.cache.max_length or any(self.cache.pending):
                self.cache.reset()                            # a factory's cache holds nothing we computed
        # a hit proved the cache's identity equal to the one it holds; a new cache needs its own
        identity = self.cached_identity if n else identity_of(self.model, self.cache, salt)
        try:
            logits = forward_cached(t[:, n:], self.model.weights, self.model.config, self.cache, last_only=True)
        except Exception:
            self.cache, self.cached_ids, self.cached_identity, self.cached_key = None, [], None, None
            self._held = None
            raise                                             # a half-updated cache is never reused
        crop = 0 < n < len(self.cached_ids)
        self.cached_ids, self.cached_identity, self.cached_key = ids, identity, key_for(identity, t[0])
        self._held = (self.cache, self.cache.version, tensor_versions(self.model.weights))
        self.calls += 1
        self.hits, self.misses, self.crops = self.hits + (n > 0), self.misses + (n == 0), self.crops + crop
        self.positions += len(ids) - n
        return logits[0, -1]                                  # [V]


class LibraryBackend:
    """The transformers model on the same weights, with its own cache (`use_cache=True`: it keeps
    `past_key_values` and reuses them when the ids extend the ids they hold) or without."""

    def __init__(self, model, use_cache=True):
        from ..models.hf import to_transformers

        self.model, self.hf, self.use_cache = model, to_transformers(model), use_cache
        self.past, self.cached_ids = None, []
        self.calls = self.hits = self.misses = self.positions = 0

    @torch.inference_mode()
    def next_logits(self, ids) -> torch.Tensor:
        t = as_ids(ids, self.model.config.vocab_size)
        ids, n = t[0].tolist(), len(self.cached_ids)
        hit = self.use_cache and self.past is not None and n < len(ids) and ids[:n] == self.cached_ids
        if not hit:
            self.past, n = None, 0
        out = self.hf(t[:, n:], past_key_values=self.past, use_cache=self.use_cache)
        if self.use_cache:
            self.past, self.cached_ids = out.past_key_values, ids
        self.calls, self.hits, self.misses = self.calls + 1, self.hits + hit, self.misses + (not hit)
        self.positions += len(ids) - n
        return out.logits[0, -1]
