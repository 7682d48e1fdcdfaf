"""StaticCache: one buffer per layer, allocated once for max_tokens, written in place (as in gpt-fast).

Nothing is allocated while decoding, and the tensors never change shape; the price is memory reserved
for the longest sequence from the start. `reset` only sets the length to zero: stale values stay in the
buffer, and nothing ever reads past `length`.
"""

import torch

from . import checks
from .base import KVCache


class StaticCache(KVCache):
    def __init__(self, config, max_tokens: int, batch_size: int = 1, dtype=torch.float32,
                 device="cpu"):
        super().__init__(config, batch_size, dtype, device)
        checks.at_least_one("max_tokens", max_tokens)
        self.max_tokens = max_tokens
        shape = (self.n_layers, batch_size, self.n_kv_heads, max_tokens, self.head_dim)
        self.k_buf = torch.zeros(shape, dtype=dtype, device=self.device)  # [L, B, H_kv, T_max, D]
        self.v_buf = torch.zeros(shape, dtype=dtype, device=self.device)

    def capacity(self) -> int:
        return self.max_tokens

    def _store(self, layer, k, v):
        start, end = self.length, self.length + k.shape[2]
        self.k_buf[layer, :, :, start:end] = k                # write in place: [B, H_kv, T, D]
        self.v_buf[layer, :, :, start:end] = v
        return self.k_buf[layer, :, :, :end], self.v_buf[layer, :, :, :end]  # [B, H_kv, end, D]

    def _truncate(self, n):
        pass  # positions past the length are never read; the next update overwrites them

    def fork(self):
        """An independent copy: the buffers are written in place, so nothing can be shared."""
        checks.between_steps(self, "fork")
        child = StaticCache.__new__(StaticCache)
        child.__dict__.update(self.__dict__)
        child.k_buf, child.v_buf = self.k_buf.clone(), self.v_buf.clone()
        child.pending = [0] * self.n_layers
        return child

    def nbytes(self) -> int:
        return self.k_buf.nbytes + self.v_buf.nbytes
