"""The cache protocol every design implements.

A forward step of T new positions calls, for every layer i in order,

    out = cache.attend(i, q, k, v)    # q [B, H_q, T, D]; k, v [B, H_kv, T, D] for the new positions
                                      # stores k, v; returns attention over all positions, [B, H_q, T, D]
then, once every layer was served,
    cache.advance(T)                  # the T positions are now part of the cache

`attend` is `update` (store, and return all keys and values `[B, H_kv, length + T, D]`) followed by
attention with the offset causal mask; a design with its own attention (pages) overrides it. `length`
counts committed positions. Until `advance`, new positions are pending: `crop(length)` or `reset()`
discards them. The checks (checks.py) run before anything changes, so a failed call leaves the cache
exactly as it was. A design implements the hooks of the region "design"; the protocol is written once.
"""

import torch
import torch.nn.functional as F

from . import checks
from .errors import CacheError, CacheFullError, CacheInputError, CacheMismatchError, CacheStateError

__all__ = ["KVCache", "offset_causal_mask", "visible", "attention", "CacheError", "CacheFullError", "CacheInputError",
           "CacheMismatchError", "CacheStateError"]


def offset_causal_mask(start: int, T: int, device=None) -> torch.Tensor:
    """Which keys each of T new queries may see, when `start` positions are already cached.

    Query i sits at absolute position start + i and sees keys 0 .. start + i: a bool
    `[T, start + T]`, the causal triangle shifted right by `start`. With start = 0 this is the
    ordinary causal mask. `is_causal=True` instead aligns the triangle to the top-left corner:
    query i would see keys 0 .. i only, so every query of the chunk, the last one included, would
    miss cached keys (chapter 2).
    """
    q_pos = torch.arange(start, start + T, device=device)[:, None]  # [T, 1]
    k_pos = torch.arange(start + T, device=device)[None, :]          # [1, start+T]
    return k_pos <= q_pos


def visible(start: int, T: int, window: int = 0, sinks: int = 0, device=None) -> torch.Tensor:
    """`offset_causal_mask` for a local layer (chapter 10): query start + i also sees only the keys of the
    last `window` positions, its own included, and the first `sinks` positions. window = 0: every key."""
    mask = offset_causal_mask(start, T, device)                         # [T, start + T]
    if window:
        q_pos = torch.arange(start, start + T, device=device)[:, None]
        k_pos = torch.arange(start + T, device=device)[None, :]
        mask &= (q_pos - k_pos < window) | (k_pos < sinks)
    return mask


def attention(config, layer, q, keys, values):
    """Attention of q `[B, H_q, T, D]`, the newest T positions, over a layer's keys and values `[B, H_kv, L,
    D]`, under the rules the model's architecture sets for cache layer `layer` (chapter 10): a local layer
    sees its window and sinks only. (A latent model's queries arrive already in latent space: to the cache
    its latents are keys and values of one head.)"""
    T, L = q.shape[2], keys.shape[2]
    window, sinks = config.window_of(layer)
    mask = None if T == 1 and not 0 < window < L else visible(L - T, T, window, sinks, q.device)
    return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)


class KVCache:
    """What every design shares: the committed length, the positions pending in this step, the owner."""

    def __init__(self, config, batch_size: int = 1, dtype=None, device="cpu"):
        checks.int_arg("batch_size", batch_size, low=1)
        dtype = config.torch_dtype if dtype is None else dtype  # the model's, unless told otherwise
        self.config, self.batch_size, self.dtype = config, batch_size, dtype
        self.device = torch.empty(0, device=device).device  # "cuda" -> "cuda:0", as tensors say it
        self.n_layers, self.n_kv_heads, self.head_dim = config.kv_layout   # as trained: the model's
        self._length = 0                         # committed positions (contiguous designs)
        self.pending = [0] * self.n_layers       # positions stored per layer since the last advance
        self.owner = None                        # identity of the model whose positions these are
        self.version = 0                         # counts every change: a holder can tell if it was touched

    # region design
    def _write(self, layer, k, v):  # keep k, v [B, H_kv, T, D] after the committed positions
        raise NotImplementedError

    def _read(self, layer):         # all keys and values of the layer, pending ones included
        raise NotImplementedError

    def _truncate(self, n):         # keep the first n committed positions; drop the pending ones
        raise NotImplementedError

    def _commit(self, t):           # the t pending positions become committed
        self._length += t

    def seq_lengths(self) -> list:  # committed positions of each row
        return [self._length] * self.batch_size

    def fork(self):                 # an independent cache with the same positions
        raise NotImplementedError

    def nbytes(self) -> int:        # bytes of the storage held
        raise NotImplementedError

    def capacity(self) -> int | None:  # most positions one row can hold; None: grows without bound
        return None
    # endregion

    # region protocol
    def update(self, layer: int, k: torch.Tensor, v: torch.Tensor):
        """Store k, v `[B, H_kv, T, D]` of layer `layer`; return all its keys and values
        `[B, H_kv, length + T, D]`."""
        checks.equal_rows(self, "update")
        self._put(layer, k, v)
        return self._read(layer)

    def _put(self, layer, k, v):
        checks.update(self, layer, k, v)
        self._write(layer, k, v)
        self.pending[layer], self.version = k.shape[2], self.version + 1

    def attend(self, layer: int, q, k, v):
        """Store k, v and attend: q `[B, H_q, T, D]` over every position -> `[B, H_q, T, D]`."""
        if not self.config.as_trained:                        # a cache shaped by the model (ch. 10)
            return self._attend_shaped(layer, q, k, v)
        keys, values = self.update(layer, k, v)               # [B, H_kv, length + T, D]
        T = q.shape[2]                                        # one query (decode) sees every key
        mask = None if T == 1 else offset_causal_mask(keys.shape[2] - T, T, q.device)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def _attend_shaped(self, layer, q, k, v):
        """attend() for a retrofitted model (chapter 10), under its rules (`attention`).
        k = v = None: a layer that reads the cache of an earlier one (share_kv) stores nothing.
        q = None: store and return every key and value (`update`), for a layer that attends by
        itself (a latent's reconstructing form)."""
        if k is None and v is None:
            checks.equal_rows(self, "attend")
            checks.shared_read(self, layer, q)
            keys, values = self._read(layer)
        else:
            keys, values = self.update(layer, k, v)           # [B, H_kv, length + T, D]
        return (keys, values) if q is None else attention(self.config, layer, q, keys, values)

    def advance(self, t: int):
        """Commit the t positions every layer has just stored."""
        checks.advance(self, t)
        self._commit(t)
        self.pending, self.version = [0] * self.n_layers, self.version + 1

    def crop(self, n: int):
        """Keep the first n positions (rollback, e.g. of rejected draft tokens)."""
        checks.crop(self, n)
        self._truncate(n)
        self.pending, self.version = [0] * self.n_layers, self.version + 1
        self.owner = self.owner if n else None

    def reset(self):
        """Forget every position (a new request)."""
        self._truncate(0)
        self.pending, self.version, self.owner = [0] * self.n_layers, self.version + 1, None
    # endregion

    @property
    def length(self) -> int:
        """Committed positions, the same in every row (`seq_lengths()` when rows differ)."""
        lengths = self.seq_lengths()
        if min(lengths) != max(lengths):
            raise CacheStateError(f"the rows hold different lengths {lengths}; use seq_lengths()")
        return lengths[0]

    @length.setter
    def length(self, n: int):  # for a reader filling the buffers by hand (exercises, chapter 4)
        checks.set_length(self, n)
        self._length, self.version = n, self.version + 1

    @property
    def max_length(self) -> int:
        return max(self.seq_lengths())

    def next_positions(self, T: int, device=None) -> torch.Tensor:
        """Positions of the next T tokens: `[T]`, or `[B, 1]` when rows differ in length (decode only)."""
        lengths = self.seq_lengths()
        if min(lengths) == max(lengths):
            return torch.arange(lengths[0], lengths[0] + T, device=device)                      # [T]
        if T != 1:
            raise CacheStateError(f"rows of different lengths {lengths} can only decode (one token each)")
        return torch.tensor(lengths, device=device)[:, None]                                      # [B, 1]

    def check_model(self, config, owner=None):
        """Raise CacheMismatchError unless the cache fits a model of this shape and its positions were
        computed by `owner` (any hashable identity of the model); an empty cache takes a new owner."""
        checks.model(self, config, owner)
        self.owner = owner

    def _copy_state_to(self, child):
        """The bookkeeping a fork inherits: committed length and owner (the storage is the design's)."""
        child._length, child.owner = self._length, self.owner
        return child

    def __repr__(self):
        return (f"{type(self).__name__}(length={self.max_length}, batch={self.batch_size}, "
                f"layers={self.n_layers}, kv_heads={self.n_kv_heads}, head_dim={self.head_dim}, "
                f"{self.dtype}, {self.nbytes():,} bytes)")
