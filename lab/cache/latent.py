"""LatentCache: the cache of a latent model (chapter 10, `latent_kv`), one tensor per layer, as MLA keeps it.

A latent model caches c_k = U_k^T k and c_v = U_v^T v, `rank` values per position and layer, instead of keys and
values (the other designs hold them as one head's keys and values, `config.kv_layout`). This one shows the layout
itself: one buffer `[layers, batch, max_tokens, rank]`, written in place like StaticCache's, with no head
dimension: every query head reads the same latent, so a latent model decodes like multi-query attention.
"""

import torch

from . import checks
from .base import CacheInputError, KVCache


class LatentCache(KVCache):
    def __init__(self, config, max_tokens: int, batch_size: int = 1, dtype=None, device="cpu"):
        if not config.kv_rank:
            raise CacheInputError(f"LatentCache holds a latent model's cache (latent_kv); {config.name or config.arch} "
                                  "caches keys and values: use StaticCache")
        super().__init__(config, batch_size, dtype, device)
        checks.int_arg("max_tokens", max_tokens, low=1)
        self.max_tokens, self.rank = max_tokens, config.kv_rank
        self.latent = torch.zeros(self.n_layers, batch_size, max_tokens, self.rank,
                                  dtype=self.dtype, device=self.device)      # [L, B, T_max, r]

    def capacity(self) -> int:
        return self.max_tokens

    def _write(self, layer, k, v):           # k, v [B, 1, T, r/2]: the keys' and the values' latents
        start, end = self._length, self._length + k.shape[2]
        self.latent[layer, :, start:end] = torch.cat([k[:, 0], v[:, 0]], dim=-1)    # [B, T, r]

    def _read(self, layer):                  # both again, as views: [B, 1, end, r/2] each
        c = self.latent[layer, :, None, : self._length + self.pending[layer]]
        return c[..., : self.rank // 2], c[..., self.rank // 2:]

    def _truncate(self, n):
        self._length = n

    def fork(self):
        checks.between_steps(self, "fork")
        child = LatentCache(self.config, self.max_tokens, self.batch_size, self.dtype, self.device)
        child.latent.copy_(self.latent)
        return self._copy_state_to(child)

    def nbytes(self) -> int:
        return self.latent.nbytes
