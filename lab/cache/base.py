"""The cache protocol every design implements.

A forward step of T new positions calls, for every layer i in order,

    keys, values = cache.update(i, k, v)    # k, v: [B, H_kv, T, D] for the new positions
                                            # keys, values: [B, H_kv, length + T, D], all of them
then, once every layer was served,
    cache.advance(T)                        # the T positions are now part of the cache

`length` counts committed positions. Until `advance`, new positions are pending: `crop(length)` or
`reset()` discards them. The checks (checks.py) run before anything changes, so a failed call leaves
the cache exactly as it was.
"""

import torch

from . import checks
from .errors import CacheError, CacheFullError, CacheInputError, CacheMismatchError, CacheStateError

__all__ = ["KVCache", "CacheError", "CacheFullError", "CacheInputError", "CacheMismatchError", "CacheStateError"]


class KVCache:
    """What every design shares: the committed length and the positions pending in this step."""

    def __init__(self, config, batch_size: int = 1, dtype=torch.float32, device="cpu"):
        checks.at_least_one("batch_size", batch_size)
        self.config, self.batch_size, self.dtype = config, batch_size, dtype
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors say it
        self.n_layers, self.n_kv_heads = config.n_layers, config.n_kv_heads
        self.head_dim = config.head_dim
        self.length = 0                          # committed positions
        self.pending = [0] * config.n_layers     # positions stored per layer since the last advance

    # region design
    def _store(self, layer, k, v):  # keep k, v after the committed positions; return all of them
        raise NotImplementedError

    def _truncate(self, n):         # keep the first n positions of every layer
        raise NotImplementedError

    def fork(self):                 # an independent cache with the same positions
        raise NotImplementedError

    def nbytes(self) -> int:        # bytes of the storage held
        raise NotImplementedError

    def capacity(self) -> int | None:  # None: grows without bound
        return None
    # endregion

    # region protocol
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v `[B, H_kv, T, D]` of layer `layer`; return all its keys and values
        `[B, H_kv, length + T, D]`."""
        checks.update(self, layer, k, v)
        out = self._store(layer, k, v)
        self.pending[layer] = k.shape[2]
        return out

    def advance(self, t: int):
        """Commit the t positions every layer has just stored."""
        checks.advance(self, t)
        self.length += t
        self.pending = [0] * self.n_layers

    def reset(self):
        """Forget every position (a new request)."""
        self._truncate(0)
        self.length, self.pending = 0, [0] * self.n_layers

    def crop(self, n: int):
        """Keep the first n positions (rollback, e.g. of rejected draft tokens)."""
        checks.crop(self, n)
        self._truncate(n)
        self.length, self.pending = n, [0] * self.n_layers
    # endregion

    @property
    def max_length(self) -> int:
        return self.length

    def next_positions(self, T: int, device=None) -> torch.Tensor:
        """Positions of the next T tokens: `[T]`, or `[B, T]` where sequences differ in length."""
        return torch.arange(self.length, self.length + T, device=device)

    def check_model(self, config):
        """Raise CacheMismatchError unless the cache was built for a model of this shape."""
        checks.model(self, config)

    _check_kv = checks.kv                       # for designs with their own update (PagedCache)
    _check_between_steps = checks.between_steps

    def __repr__(self):
        return (f"{type(self).__name__}(length={self.length}, batch={self.batch_size}, "
                f"layers={self.n_layers}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"{self.dtype}, {self.nbytes():,} bytes)")
