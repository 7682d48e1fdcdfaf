"""PagedCache: keys and values in fixed-size pages from one pool per layer, as vLLM does.

A sequence owns a block table: the list of its pages. Position p of a sequence lives in page
`block_table[p // page_size]` at offset `p % page_size`; its slot in the flattened pool is
`page * page_size + offset`. Growing, cropping, forking and releasing a sequence are list operations on
the host (the BlockManager); the pool itself never moves, so there is no copy when a sequence grows.

The pool layout is `[num_pages, page_size, kv_heads, head_dim]` per layer (FlashInfer's "NHD"): one page
of one layer is a single contiguous block of memory, so a decode kernel reads a whole page of keys with
one coalesced load, and writing a new position touches one `[kv_heads, head_dim]` row.

The block tables and lengths live in fixed-size buffers (`[batch, max_pages]` int32, the width padded to
a multiple of 16, and `[batch]` int32): their shapes never change from step to step, so a compiled
kernel is not recompiled and a captured CUDA graph stays valid.
"""

import itertools
import math

import torch
import torch.nn.functional as F

from . import checks
from .base import CacheInputError, CacheStateError, KVCache
from .block_manager import BlockManager, OutOfPagesError


def round_up(n, multiple):
    return -(-n // multiple) * multiple


# region paged_cache_init
class PagedCache(KVCache):
    def __init__(self, config, max_tokens: int, page_size: int = 16, batch_size: int = 1,
                 dtype=torch.float32, device="cpu", max_seq_tokens: int | None = None):
        super().__init__(config, batch_size, dtype, device)
        checks.paged_sizes(max_tokens, page_size)
        self.page_size, self.num_pages = page_size, math.ceil(max_tokens / page_size)
        self.manager = BlockManager(self.num_pages, page_size)
        L, H, D = self.n_layers, self.n_kv_heads, self.head_dim
        shape = (L, self.num_pages, page_size, H, D)                # [L, N, page, H_kv, D]
        self.k_pool = torch.zeros(shape, dtype=dtype, device=self.device)
        self.v_pool = torch.zeros(shape, dtype=dtype, device=self.device)
        longest = max_seq_tokens or max_tokens
        self.max_pages = round_up(math.ceil(longest / page_size), 16)  # padded table width
        self.block_tables = torch.zeros(batch_size, self.max_pages, dtype=torch.int32,
                                        device=self.device)         # [B, max_pages]
        self.lengths = torch.zeros(batch_size, dtype=torch.int32,
                                   device=self.device)              # [B], after this step
        self.seqs = list(range(batch_size))     # the block manager's id of each batch row
        self._ids = itertools.count(batch_size)  # fresh sequence ids, for forks and views
        self.slot_mapping = None                 # [B * T] slots of the step in flight
        self._step_T = 0                         # and its T
    # endregion

    @classmethod
    def from_memory(cls, config, fraction: float, page_size=16, batch_size=1, dtype=torch.float32, device="cpu",
                    available_bytes=None):
        """A cache whose pool takes `fraction` of the memory available now (host RAM, or free GPU memory)."""
        if not 0 < fraction <= 1:
            raise CacheInputError(f"fraction must be in (0, 1], got {fraction}")
        if available_bytes is None:
            if torch.device(device).type == "cuda":
                available_bytes = torch.cuda.mem_get_info(torch.device(device))[0]
            else:
                import psutil

                available_bytes = psutil.virtual_memory().available
        from .sizing import cache_bytes

        per_token = cache_bytes(config, 1, 1, dtype)
        pages = int(fraction * available_bytes) // (per_token * page_size)
        if pages < 1:
            raise CacheInputError(f"{fraction:.0%} of {available_bytes:,} bytes holds no page of {page_size} positions")
        return cls(config, pages * page_size, page_size, batch_size, dtype, device)

    # ---- lengths ----
    def seq_lengths(self) -> list:
        """Committed positions of each sequence (the manager also counts those reserved by a step in flight)."""
        return [(self.manager.length(s) if s in self.manager else 0) - self._step_T for s in self.seqs]

    @property
    def length(self) -> int:
        lengths = set(self.seq_lengths())
        if len(lengths) != 1:
            raise CacheStateError(f"the sequences hold different lengths {self.seq_lengths()}; use seq_lengths()")
        return lengths.pop()

    @length.setter
    def length(self, value):  # the base class sets it; a paged cache's lengths live in the block manager
        pass

    @property
    def max_length(self) -> int:
        return max(self.seq_lengths())

    def next_positions(self, T, device=None):
        lengths = self.seq_lengths()
        if len(set(lengths)) == 1:
            return torch.arange(lengths[0], lengths[0] + T, device=device)                    # [T]
        if T != 1:
            raise CacheStateError(f"sequences of different lengths {lengths} can only decode (one token each)")
        return torch.tensor(lengths, device=device)[:, None]                                    # [B, 1]

    # ---- one step: reserve, write, attend ----
    # region paged_cache_step
    def _begin_step(self, T):
        """Reserve T positions for every sequence (all or none), copy on write, compute the slots."""
        checks.paged_room(self, T)                    # checked first: a failure changes nothing
        done = []
        try:
            for s in self.seqs:
                copies = self.manager.reserve(s, T)
                done.append(s)
                for src, dst in copies:               # a shared, partly filled page: copy it
                    self.k_pool[:, dst] = self.k_pool[:, src]
                    self.v_pool[:, dst] = self.v_pool[:, src]
        except OutOfPagesError:
            for s in done:                            # undo the rows already reserved
                self.manager.crop(s, self.manager.length(s) - T)
            raise
        slots = []
        for row, s in enumerate(self.seqs):           # fixed-size buffers: same shapes every step
            n, table = self.manager.length(s), self.manager.block_table(s)
            slots += self.manager.slots(s, n - T, T)
            self.block_tables[row, :len(table)] = torch.tensor(table, dtype=torch.int32)
            self.block_tables[row, len(table):] = 0
            self.lengths[row] = n
        self.slot_mapping = torch.tensor(slots, dtype=torch.long, device=self.device)  # [B * T]
        self._step_T = T

    def _write(self, layer, k, v):
        if not any(self.pending):
            self._begin_step(k.shape[2])
        B, H, T, D = k.shape
        k_rows = k.transpose(1, 2).reshape(B * T, H, D)              # [B * T, H_kv, D]
        v_rows = v.transpose(1, 2).reshape(B * T, H, D)
        self.k_pool[layer].view(-1, H, D)[self.slot_mapping] = k_rows  # pool as [slots, H_kv, D]
        self.v_pool[layer].view(-1, H, D)[self.slot_mapping] = v_rows

    def gather(self, layer):
        """All positions of every sequence, `[B, H_kv, L, D]` (sequences of equal length only)."""
        L = int(self.lengths[0])
        pages = self.block_tables[:, : math.ceil(L / self.page_size)].long()  # [B, P]
        k = self.k_pool[layer][pages].flatten(1, 2)[:, :L]                      # [B, L, H_kv, D]
        v = self.v_pool[layer][pages].flatten(1, 2)[:, :L]
        return k.transpose(1, 2), v.transpose(1, 2)                             # [B, H_kv, L, D]
    # endregion

    def update(self, layer, k, v):
        checks.paged_step(self, layer, k, v)
        checks.paged_equal_lengths(self)
        self._write(layer, k, v)
        self.pending[layer] = k.shape[2]
        return self.gather(layer)

    def attend(self, layer, q, k, v):
        """Store k, v and attend: a decode step over pages, or a prefill chunk (gather and mask)."""
        from ..kernels import decode_attention
        from ..models.attention import offset_causal_mask

        checks.paged_step(self, layer, k, v)
        T = k.shape[2]
        if T == 1:                                           # decode: one query per sequence
            self._write(layer, k, v)
            self.pending[layer] = 1
            out = decode_attention(q[:, :, 0], self.k_pool[layer], self.v_pool[layer],
                                   self.block_tables, self.lengths)  # [B, H_q, D]
            return out[:, :, None]                           # [B, H_q, 1, D]
        keys, values = self.update(layer, k, v)              # prefill chunk: gather and mask
        mask = offset_causal_mask(keys.shape[2] - T, T, q.device)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    def advance(self, t: int):
        checks.advance(self, t)
        self.pending, self.slot_mapping, self._step_T = [0] * self.n_layers, None, 0

    def _drop_pending(self):
        if self._step_T:
            for s in self.seqs:
                self.manager.crop(s, self.manager.length(s) - self._step_T)
        self.pending, self.slot_mapping, self._step_T = [0] * self.n_layers, None, 0

    def crop(self, n: int):
        """Keep the first n positions of every sequence; their pages past n go back to the pool."""
        checks.count("crop", n)
        self._drop_pending()
        checks.paged_crop(self, n)
        for s in self.seqs:
            self.manager.crop(s, n)

    def reset(self):
        """Release every page; the batch starts again with empty sequences."""
        self._drop_pending()
        for s in self.seqs:
            self.manager.release(s)
        self.seqs = [next(self._ids) for _ in range(self.batch_size)]

    def release(self):
        """Give every page back to the pool; the cache cannot be used afterwards."""
        self._drop_pending()
        for s in self.seqs:
            self.manager.release(s)

    def _view(self, seqs):
        view = PagedCache.__new__(PagedCache)
        view.__dict__.update(self.__dict__)
        view.seqs, view.batch_size = list(seqs), len(seqs)
        view.block_tables = torch.zeros(len(seqs), self.max_pages, dtype=torch.int32, device=self.device)
        view.lengths = torch.zeros(len(seqs), dtype=torch.int32, device=self.device)
        view.pending, view.slot_mapping, view._step_T = [0] * self.n_layers, None, 0
        return view

    def select(self, rows):
        """A cache over some of this batch's sequences, sharing pool and pages (e.g. to prefill one row)."""
        checks.between_steps(self, "select")
        return self._view([self.seqs[r] for r in rows])

    def fork(self):
        """Child sequences sharing every page of their parents; a shared partial page is copied on first write."""
        checks.between_steps(self, "fork")
        new = [next(self._ids) for _ in self.seqs]
        for src, dst in zip(self.seqs, new, strict=True):
            self.manager.fork(src, dst)
        child = self._view(new)
        return child

    def nbytes(self) -> int:
        return self.k_pool.nbytes + self.v_pool.nbytes

    def __repr__(self):
        return (f"PagedCache(seq_lengths={self.seq_lengths()}, pages={self.num_pages} x {self.page_size}, "
                f"free={self.manager.num_free}, {self.dtype}, {self.nbytes():,} bytes)")
