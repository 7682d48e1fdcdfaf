"""PagedCache: keys and values in fixed-size pages from one pool per layer, as vLLM does (chapter 5).

Position p lives in page `block_table[p // page_size]` at offset `p % page_size`; growing, cropping, forking and
releasing a sequence are list operations on the host (the BlockManager), and the pool `[num_pages, page_size,
kv_heads, head_dim]` per layer (FlashInfer's "NHD") never moves. Block tables and lengths live in fixed-size int32
buffers (`[batch, max_pages]`, the width padded to a multiple of 16, and `[batch]`), so a compiled kernel is not
recompiled and a captured CUDA graph stays valid; a decode step writes them on the device and reads nothing back.

The pool is a PagePool of one group (pool.py), the one a serving engine keeps for every cache shape: a PagedCache
is a view of some of its sequences as rows, and `plan_step` plans an engine's step over them.
"""

import math

import torch

from ..kernels import decode_attention
from . import checks
from .base import CacheInputError, CacheStateError, KVCache
from .hybrid import HybridBlockManager
from .pool import PagePool, StepBatch, write_changed
from .sizing import cache_bytes


# region paged_cache_init
class PagedCache(KVCache):
    def __init__(self, config, max_tokens: int, page_size: int = 16, batch_size: int = 1,
                 dtype=None, device="cpu", max_seq_tokens: int | None = None):
        super().__init__(config, batch_size, dtype, device)
        checks.paged_sizes(max_tokens, page_size, max_seq_tokens)
        self.page_size, self.num_pages = page_size, math.ceil(max_tokens / page_size)
        pages = {"full": (self.num_pages, 0, 0)}     # (pages, window, sinks): every position kept
        groups = HybridBlockManager(page_size, pages, {"full": range(self.n_layers)})  # every layer
        self.pool = PagePool(config, groups, self.dtype, self.device)
        self.k_pool = self.pool.k_pools["full"]                # [L, pages, page, H_kv, D]
        self.v_pool = self.pool.v_pools["full"]
        longest = max_seq_tokens or max_tokens
        self.max_pages = 16 * math.ceil(longest / (16 * page_size))  # padded: a multiple of 16
        self._rows([self.pool.new_id() for _ in range(batch_size)])

    def _rows(self, seqs):
        """The rows: the manager's sequences `seqs` (new ones start empty), and their buffers."""
        self.seqs = list(seqs)                   # the block manager's id of each batch row
        for s in self.seqs:
            if s not in self.manager:
                self.manager.reserve(s, 0)       # a live, empty sequence
        self._tables = [self.manager.block_table(s) for s in self.seqs]  # host copy of block_tables
        tables = [t + [0] * (self.max_pages - len(t)) for t in self._tables]
        i32 = dict(dtype=torch.int32, device=self.device)
        self.block_tables = torch.tensor(tables, **i32).view(-1, self.max_pages)  # [B, max_pages]
        self._lengths = [self.manager.length(s) for s in self.seqs]     # host copy of lengths
        self.lengths = torch.tensor(self._lengths, **i32)            # [B], after the step in flight
        self.slot_mapping = None                 # [B * T] pool slots of the step in flight
        self._step_T = 0                         # and its T
    # endregion

    @property
    def manager(self):
        """The BlockManager of the pool's one group: which page holds which position."""
        return self.pool.manager.manager("full")

    @manager.setter
    def manager(self, bm):           # another policy's manager, before the first sequence (chapter 6)
        self.pool.manager._bms["full"] = bm

    def view(self, seqs):
        """A cache over the live sequences `seqs` of this pool (one per request, say). Built
        explicitly: it shares the pool (pages, manager, ids), and owns everything else."""
        view = object.__new__(PagedCache)
        KVCache.__init__(view, self.config, len(seqs), self.dtype, self.device)
        view.page_size, view.num_pages, view.max_pages = self.page_size, self.num_pages, self.max_pages
        view.pool, view.k_pool, view.v_pool = self.pool, self.k_pool, self.v_pool
        view._rows(seqs)
        view.owner = self.owner
        return view

    @classmethod
    def from_memory(cls, config, fraction: float, page_size=16, batch_size=1, dtype=None, device="cpu",
                    available_bytes=None):
        """A cache whose pool takes `fraction` of the memory available now (host RAM, or free GPU memory)."""
        checks.memory_fraction(fraction)
        if available_bytes is None:
            if torch.device(device).type == "cuda":
                available_bytes = torch.cuda.mem_get_info(torch.device(device))[0]
            else:
                import psutil

                available_bytes = psutil.virtual_memory().available
        pages = int(fraction * available_bytes) // cache_bytes(config, page_size, 1, dtype)
        if pages < 1:
            raise CacheInputError(f"{fraction:.0%} of {available_bytes:,} bytes holds no page of {page_size} positions")
        return cls(config, pages * page_size, page_size, batch_size, dtype, device)

    # ---- the storage hooks of the protocol ----
    def seq_lengths(self) -> list:
        """Committed positions of each sequence (the manager also counts those reserved by a step in flight)."""
        return [self.manager.length(s) - self._step_T for s in self.seqs]

    @KVCache.length.setter
    def length(self, n):                             # KVCache's getter; no setter
        raise CacheStateError("a paged cache's lengths live in its block manager: use crop(n) to shorten")

    def next_positions(self, T, device=None):
        """As every cache's; a ragged decode step takes the positions from the lengths already on the device
        (when no view changed a row since), so nothing is copied to it."""
        lengths = self.seq_lengths()
        if T == 1 and min(lengths) != max(lengths) and lengths == self._lengths:
            return self.lengths[:, None].to(device=device, dtype=torch.long)             # [B, 1]
        return super().next_positions(T, device)

    def capacity(self) -> int:
        """The most positions one sequence can hold: its block table's width, or the whole pool."""
        return min(self.max_pages, self.num_pages) * self.page_size

    def reserve(self, parts):
        """Room for n more positions of every (seq, n) in `parts`, all or none (PagePool.reserve)."""
        self.pool.reserve(parts)

    # region paged_cache_step
    def _begin_step(self, T):
        """Reserve T positions in every sequence (all or none, copy on write), map their slots"""
        self.reserve([(s, T) for s in self.seqs])
        self._sync_buffers(T)
        P = self.page_size
        pos = self.lengths[:, None] - T + torch.arange(T, device=self.device)  # [B, T] positions
        page = self.block_tables.gather(1, (pos // P).int()).long()            # [B, T]
        self.slot_mapping = (page * P + pos % P).view(-1)                     # [B * T]
        self._step_T = T

    def _sync_buffers(self, T):
        """Bring block_tables and lengths up to the manager's: device writes only, nothing read back."""
        lengths = [self.manager.length(s) for s in self.seqs]
        for row, s in enumerate(self.seqs):           # only the entries that changed: a page
            table = self.manager.block_table(s)      # every page_size steps
            self._tables[row] = write_changed(self.block_tables[row], table, self._tables[row])
        if lengths == [n + T for n in self._lengths]:
            self.lengths += T                         # the usual step: every row grew by T
        else:                                         # rows changed through a view (select) since
            self.lengths.copy_(torch.tensor(lengths, dtype=torch.int32))
        self._lengths = lengths

    def _write(self, layer, k, v):
        if not any(self.pending):
            self._begin_step(k.shape[2])
        B, H, T, D = k.shape
        k_rows = k.transpose(1, 2).reshape(B * T, H, D)              # [B * T, H_kv, D]
        v_rows = v.transpose(1, 2).reshape(B * T, H, D)
        self.k_pool[layer].view(-1, H, D)[self.slot_mapping] = k_rows  # pool as [slots, H_kv, D]
        self.v_pool[layer].view(-1, H, D)[self.slot_mapping] = v_rows

    def _read(self, layer):
        """All positions of every sequence, `[B, H_kv, L, D]` (sequences of equal length only)."""
        L = self.manager.length(self.seqs[0])                                   # the host knows it
        pages = self.block_tables[:, : math.ceil(L / self.page_size)].long()  # [B, P]
        k = self.k_pool[layer][pages].flatten(1, 2)[:, :L]                      # [B, L, H_kv, D]
        v = self.v_pool[layer][pages].flatten(1, 2)[:, :L]
        return k.transpose(1, 2), v.transpose(1, 2)                             # [B, H_kv, L, D]
    # endregion

    def attend(self, layer, q, k, v):
        """Store k, v and attend: a decode step over pages, or a prefill chunk (gather and mask)."""
        if q is None or q.shape[2] > 1:                  # a prefill chunk (or a layer that attends
            return super().attend(layer, q, k, v)        # by itself, ch. 10): gather and mask
        if k is None and v is None:                      # a layer reading an earlier one's cache
            checks.shared_read(self, layer, q)
        else:
            self._put(layer, k, v)                       # decode: one query per sequence
        window, sinks = self.config.window_of(layer)     # (0, 0) but in a local layer (ch. 10)
        out = decode_attention(q[:, :, 0], self.k_pool[layer], self.v_pool[layer], self.block_tables,
                               self.lengths, check_values=False, window=window, sinks=sinks)
        return out[:, :, None]                           # [B, H_q, 1, D]

    def page(self, page: int) -> tuple:
        """A copy of one page's keys and values in every layer, for a tier below (PagePool.page)."""
        return self.pool.page(page)

    def set_page(self, page: int, kv: tuple):
        """Write back a page that `page` copied: a restore from a tier below the pool."""
        self.pool.set_page(page, kv)

    def _commit(self, t):
        self.slot_mapping, self._step_T = None, 0    # the manager already holds the positions

    def _truncate(self, n):
        """Keep the first n positions of every sequence; their pages past n go back to the pool."""
        for s in self.seqs:
            self.manager.crop(s, n)
        keep = -(-n // self.page_size)
        self._tables = [t[:keep] for t in self._tables]
        self.block_tables[:, keep:] = 0
        self.lengths.fill_(n)
        self._lengths = [n] * len(self.seqs)
        self.slot_mapping, self._step_T = None, 0

    # ---- sequences: views, forks, release ----
    def select(self, rows):
        """A cache over some of this batch's sequences, sharing pool and pages (e.g. to prefill one row)."""
        checks.between_steps(self, "select")
        return self.view([self.seqs[r] for r in rows])

    def new_id(self):
        """A sequence id never used in this pool (for `manager.reserve` or `manager.reserve_prefix`)."""
        return self.pool.new_id()

    def plan_step(self, parts) -> "StepBatch":
        """One step over several sequences of this pool, (seq, n) per sequence (PagePool.plan_step)."""
        return self.pool.plan_step(parts)

    def fork(self):
        """Child sequences sharing every page of their parents; a shared partial page is copied on first write.

        All or nothing: if any row fails, the children already made are released."""
        checks.between_steps(self, "fork")
        made = []
        try:
            for src in self.seqs:
                dst = self.pool.new_id()
                self.manager.fork(src, dst)
                made.append(dst)
            return self.view(made)
        except BaseException:
            for dst in made:
                self.manager.release(dst)
            raise

    def release(self):
        """Give every page back to the pool; the cache cannot be used afterwards."""
        for s in self.seqs:                          # pages reserved by a step in flight included
            self.manager.release(s)
        self.pending, self.slot_mapping, self._step_T = [0] * self.n_layers, None, 0

    def nbytes(self) -> int:
        return self.pool.nbytes()

    def __repr__(self):
        return (f"PagedCache(seq_lengths={self.seq_lengths()}, pages={self.num_pages} x {self.page_size}, "
                f"free={self.manager.num_free}, {self.dtype}, {self.nbytes():,} bytes)")


__all__ = ["PagedCache", "PagePool", "StepBatch"]
