"""StaticCache: one buffer per layer, allocated once for max_tokens, written in place (as in gpt-fast).

Nothing is allocated while decoding and the tensors never change shape; the price is memory reserved for the
longest sequence from the start. `reset` only sets the length to zero: nothing ever reads past `length`.
"""

import torch

from . import checks
from .base import KVCache


class StaticCache(KVCache):
    def __init__(self, config, max_tokens: int, batch_size: int = 1, dtype=None,
                 device="cpu"):                    # dtype None: the model's (config.dtype)
        super().__init__(config, batch_size, dtype, device)
        checks.int_arg("max_tokens", max_tokens, low=1)
        self.max_tokens = max_tokens
        shape = (self.n_layers, batch_size, self.n_kv_heads, max_tokens, self.head_dim)
        like = dict(dtype=self.dtype, device=self.device)
        self.k_buf = torch.zeros(shape, **like)       # [L, B, H_kv, T_max, D]
        self.v_buf = torch.zeros(shape, **like)

    def capacity(self) -> int:
        return self.max_tokens

    def _write(self, layer, k, v):
        start, end = self._length, self._length + k.shape[2]
        self.k_buf[layer, :, :, start:end] = k                # write in place: [B, H_kv, T, D]
        self.v_buf[layer, :, :, start:end] = v

    def _read(self, layer):
        end = self._length + self.pending[layer]
        return self.k_buf[layer, :, :, :end], self.v_buf[layer, :, :, :end]  # [B, H_kv, end, D]

    def _truncate(self, n):
        self._length = n  # positions past the length are never read; the next step overwrites them

    def fork(self):
        """An independent copy: the buffers are written in place, so nothing can be shared."""
        checks.between_steps(self, "fork")
        child = StaticCache(self.config, self.max_tokens, self.batch_size, self.dtype, self.device)
        child.k_buf.copy_(self.k_buf), child.v_buf.copy_(self.v_buf)
        return self._copy_state_to(child)

    def nbytes(self) -> int:
        return self.k_buf.nbytes + self.v_buf.nbytes
