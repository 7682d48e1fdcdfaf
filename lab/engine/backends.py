"""Backends: the engine's only contract is "ids in, scores out".

`next_logits(ids)` takes the whole sequence so far (a list of token ids) and returns the scores for the
next token, `[vocab]`. How a backend gets there (recomputing everything, or reusing a cache) is its own
business; the engine cannot tell, and the tests check that it cannot.
"""

import numbers

import torch

from ..models import forward
from ..models.checks import InputError


def as_ids(ids, vocab_size: int) -> torch.Tensor:
    """Validate one sequence of token ids (list or 1-D tensor) and return it as int64 `[1, T]`."""
    if isinstance(ids, torch.Tensor):
        if ids.dim() != 1:
            raise InputError(f"a backend takes one sequence of ids, rank 1 [tokens]; got shape {tuple(ids.shape)}")
        if ids.dtype.is_floating_point or ids.dtype == torch.bool:
            raise InputError(f"ids must be integers, got {ids.dtype}")
        t = ids.long()
    else:
        ids = list(ids)
        if any(isinstance(i, (list, tuple)) for i in ids):
            raise InputError("a backend takes one sequence of ids, rank 1 [tokens]; got a nested list")
        if not all(isinstance(i, numbers.Integral) and not isinstance(i, bool)
                   or (isinstance(i, torch.Tensor) and i.dim() == 0 and not i.dtype.is_floating_point) for i in ids):
            raise InputError("ids must be integers")
        t = torch.tensor([int(i) for i in ids], dtype=torch.long)
    if t.numel() == 0:
        raise InputError("ids is empty: a backend needs at least one token to score the next")
    if int(t.min()) < 0 or int(t.max()) >= vocab_size:
        bad = int(t.min()) if int(t.min()) < 0 else int(t.max())
        raise InputError(f"token id {bad} is outside the vocabulary (valid ids are 0 .. {vocab_size - 1})")
    return t[None]


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
    """Keeps a KV cache between calls and reuses it when it holds exactly the state for `ids[:-k]`, k >= 1.

    `cache_factory()` makes an empty cache for the model. A call whose ids extend the ids the cache
    holds by at least one token runs only the new tokens (a hit); any other call starts a new cache and
    runs everything (a miss). The scores are the same either way; only the work differs.
    """

    def __init__(self, model, cache_factory):
        self.model, self.cache_factory = model, cache_factory
        self.cache, self.cached_ids = None, []  # the cache holds the state of exactly cached_ids
        self.calls = self.hits = self.misses = 0
        self.positions = 0

    @torch.inference_mode()
    def next_logits(self, ids) -> torch.Tensor:
        from ..models import forward_cached

        t = as_ids(ids, self.model.config.vocab_size)  # [1, T]
        ids, n = t[0].tolist(), len(self.cached_ids)
        hit = self.cache is not None and len(ids) > n and ids[:n] == self.cached_ids
        if not hit:
            self.cache, self.cached_ids, n = self.cache_factory(), [], 0
        new = t[:, n:]                                   # [1, T - n]: only what the cache lacks
        try:
            logits = forward_cached(new, self.model.weights, self.model.config, self.cache, last_only=True)
        except Exception:
            self.cache, self.cached_ids = None, []      # a half-updated cache is never reused
            raise
        self.cached_ids = ids
        self.calls += 1
        self.hits, self.misses = self.hits + hit, self.misses + (not hit)
        self.positions += new.shape[1]
        return logits[0, -1]                             # [V]
