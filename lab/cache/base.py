"""The cache protocol every design implements, and the checks they share.

A forward step of T new positions calls, for every layer i in order,

    keys, values = cache.update(i, k, v)    # k, v: [B, H_kv, T, D] for the new positions
                                            # keys, values: [B, H_kv, length + T, D], all of them
then, once every layer was served,
    cache.advance(T)                        # the T positions are now part of the cache

`length` counts committed positions. Until `advance`, new positions are pending: `crop(length)` or
`reset()` discards them. Every error is raised before anything changes, so a failed call leaves the
cache exactly as it was.
"""

import torch


class CacheError(Exception):
    """Base class of every cache error."""


class CacheFullError(CacheError):
    """More positions than a fixed-capacity cache holds."""


class CacheInputError(CacheError, ValueError):
    """Keys or values of the wrong rank, shape, dtype or device, or a layer index out of range."""


class CacheStateError(CacheError):
    """An operation that the cache's state does not allow: uneven layers, a bad advance or crop."""


class CacheMismatchError(CacheError):
    """A cache used with a model it was not built for."""


def _check_count(what, n):
    if isinstance(n, bool) or not isinstance(n, int):
        raise CacheStateError(f"{what}() takes a whole number of positions, got {n!r}")


class KVCache:
    """Shared bookkeeping: shapes, validation, pending positions. Designs implement the storage."""

    def __init__(self, config, batch_size: int = 1, dtype=torch.float32, device="cpu"):
        if batch_size < 1:
            raise CacheInputError(f"batch_size must be at least 1, got {batch_size}")
        # torch.empty(0, device=...) resolves "cuda" to "cuda:0" and "cpu:0" to "cpu", as tensors report them
        self.config, self.batch_size, self.dtype = config, batch_size, dtype
        self.device = torch.empty(0, device=device).device
        self.n_layers, self.n_kv_heads, self.head_dim = config.n_layers, config.n_kv_heads, config.head_dim
        self.length = 0                          # committed positions
        self.pending = [0] * config.n_layers     # positions stored per layer since the last advance

    # ---- what a design implements ----
    def _store(self, layer, k, v):               # keep k, v after the committed positions; return all
        raise NotImplementedError

    def _truncate(self, n):                      # keep the first n positions of every layer
        raise NotImplementedError

    def fork(self):
        raise NotImplementedError

    def nbytes(self) -> int:
        raise NotImplementedError

    def capacity(self) -> int | None:            # None: grows without bound
        return None

    # ---- the protocol ----
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v `[B, H_kv, T, D]` for layer `layer`; return all its keys and values `[B, H_kv, length+T, D]`."""
        self._check_kv(layer, k, v)
        if self.pending[layer]:
            raise CacheStateError(f"layer {layer} was already updated in this step; call advance() first")
        t = k.shape[2]
        if self.capacity() is not None and self.length + t > self.capacity():
            raise CacheFullError(f"{self.length} positions held + {t} new > capacity {self.capacity()}")
        out = self._store(layer, k, v)
        self.pending[layer] = t
        return out

    def advance(self, t: int):
        """Commit the t positions every layer has just stored."""
        _check_count("advance", t)
        if any(p != t for p in self.pending):
            raise CacheStateError(f"advance({t}) but the layers stored {self.pending} new positions: every layer "
                                  f"must be updated once with the same {t} positions before advance")
        self.length += t
        self.pending = [0] * self.n_layers

    def reset(self):
        """Forget every position (a new request)."""
        self._truncate(0)
        self.length, self.pending = 0, [0] * self.n_layers

    def crop(self, n: int):
        """Keep the first n positions (rollback, e.g. of rejected draft tokens); drops pending ones too."""
        _check_count("crop", n)
        if not 0 <= n <= self.length:
            raise CacheStateError(f"crop({n}): the cache holds {self.length} positions; n must be in 0..{self.length}")
        self._truncate(n)
        self.length, self.pending = n, [0] * self.n_layers

    @property
    def max_length(self) -> int:
        return self.length

    def next_positions(self, T: int, device=None) -> torch.Tensor:
        """Positions of the next T tokens: `[T]`, or `[B, T]` in a cache whose sequences differ in length."""
        return torch.arange(self.length, self.length + T, device=device)

    def _check_between_steps(self, what):
        if any(self.pending):
            raise CacheStateError(f"{what}() in the middle of a step (layers hold pending positions {self.pending}); "
                                  "call advance() first")

    def check_model(self, config):
        """Raise CacheMismatchError unless the cache was built for a model of this shape."""
        mine = (self.n_layers, self.n_kv_heads, self.head_dim)
        theirs = (config.n_layers, config.n_kv_heads, config.head_dim)
        if mine != theirs:
            raise CacheMismatchError(f"cache built for (layers, kv_heads, head_dim) = {mine}, model has {theirs}")

    def _check_kv(self, layer, k, v):
        if not isinstance(layer, int) or not 0 <= layer < self.n_layers:
            raise CacheInputError(f"layer index {layer!r} out of range: the model has layers 0..{self.n_layers - 1}")
        for name, x in (("k", k), ("v", v)):
            if not isinstance(x, torch.Tensor):
                raise CacheInputError(f"{name} must be a tensor, got {type(x).__name__}")
            if x.dim() != 4:
                raise CacheInputError(f"{name} must have rank 4, [batch, kv_heads, tokens, head_dim], "
                                      f"got shape {tuple(x.shape)}")
            B, H, T, D = x.shape
            if (B, H, D) != (self.batch_size, self.n_kv_heads, self.head_dim) or T < 1:
                raise CacheInputError(f"{name} has shape {tuple(x.shape)}, expected [{self.batch_size}, "
                                      f"{self.n_kv_heads}, tokens >= 1, {self.head_dim}]")
            if x.dtype != self.dtype:
                raise CacheInputError(f"{name} has dtype {x.dtype}, the cache holds {self.dtype}")
            if x.device != self.device:
                raise CacheInputError(f"{name} is on {x.device}, the cache is on {self.device}")
        if k.shape != v.shape:
            raise CacheInputError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape")

    def __repr__(self):
        return (f"{type(self).__name__}(length={self.length}, batch={self.batch_size}, layers={self.n_layers}, "
                f"kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, {self.dtype}, {self.nbytes():,} bytes)")
