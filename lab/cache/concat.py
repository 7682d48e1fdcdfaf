"""ConcatCache: grow each layer's keys and values by concatenation (what transformers' DynamicCache does).

Every step allocates a longer tensor and copies the old one into it: simple and never full, at the cost of a copy
that grows with the length. A concatenation never writes into an existing tensor, so a fork can share them.
"""

import torch

from . import checks
from .base import KVCache


class ConcatCache(KVCache):
    def __init__(self, config, batch_size: int = 1, dtype=None, device="cpu"):
        super().__init__(config, batch_size, dtype, device)
        self.keys = [None] * self.n_layers    # per layer [B, H_kv, length, D], None while empty
        self.values = [None] * self.n_layers

    def _write(self, layer, k, v):
        old_k, old_v = self.keys[layer], self.values[layer]
        # the first store copies: k, v may be views into a larger tensor (GPT-2's fused q|k|v)
        self.keys[layer] = k.clone() if old_k is None else torch.cat([old_k, k], dim=2)
        self.values[layer] = v.clone() if old_v is None else torch.cat([old_v, v], dim=2)

    def _read(self, layer):
        return self.keys[layer], self.values[layer]          # [B, H_kv, length + T, D]

    def _truncate(self, n):
        for i in range(self.n_layers):
            if self.keys[i] is not None:
                # clone: the dropped positions' memory is released (a slice would keep it alive)
                self.keys[i] = self.keys[i][:, :, :n].clone() if n else None
                self.values[i] = self.values[i][:, :, :n].clone() if n else None
        self._length = n

    def fork(self):
        """An independent cache that shares the parent's tensors (neither ever writes into them)."""
        checks.between_steps(self, "fork")
        child = ConcatCache(self.config, self.batch_size, self.dtype, self.device)
        child.keys, child.values = list(self.keys), list(self.values)
        return self._copy_state_to(child)

    def nbytes(self) -> int:
        """Bytes of the storage really held (a view of a larger tensor counts the whole of it)."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in self.keys + self.values if t is not None}
        return sum(storages.values())
