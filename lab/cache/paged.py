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
kernel is not recompiled and a captured CUDA graph stays valid. A decode step changes them with device
operations only (a length added, a table entry written when a sequence enters a new page), and reads
nothing back: no step waits for the device.

A serving engine runs several sequences of one pool in one forward, each with its own number of new
tokens: `plan_step` lays them end to end as one row and works out, once per step, what every layer's
attention needs (the slot of every token, its position, the decode rows' block tables and lengths, the
pages of every prefill chunk). The forward sees only the cache protocol.

A model with local layers (chapter 10) gets a HybridPool instead: a pool per group of layers of a
HybridBlockManager, whose local group gives back the pages behind the window, and a HybridStep that reads
only the positions each group still holds.
"""

import itertools
import math

import torch
import torch.nn.functional as F

from ..kernels import decode_attention
from ..kernels.fused import store_rows
from . import checks
from .base import CacheInputError, CacheStateError, KVCache, attention, offset_causal_mask, visible
from .block_manager import NULL, BlockManager
from .hybrid import HybridBlockManager
from .sizing import cache_bytes


def round_up(n, multiple):
    return -(-n // multiple) * multiple


# region paged_cache_init
class PagedCache(KVCache):
    def __init__(self, config, max_tokens: int, page_size: int = 16, batch_size: int = 1,
                 dtype=None, device="cpu", max_seq_tokens: int | None = None,
                 manager=BlockManager):
        super().__init__(config, batch_size, dtype, device)
        checks.paged_sizes(max_tokens, page_size, max_seq_tokens)
        self.page_size, self.num_pages = page_size, math.ceil(max_tokens / page_size)
        self.manager = manager(self.num_pages, page_size)   # or a RadixBlockManager (ch. 11)
        L, H, D = self.n_layers, self.n_kv_heads, self.head_dim
        shape = (L, self.num_pages, page_size, H, D)                # [L, N, page, H_kv, D]
        self.k_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_pool = torch.zeros(shape, dtype=self.dtype, device=self.device)
        longest = max_seq_tokens or max_tokens
        self.max_pages = round_up(math.ceil(longest / page_size), 16)  # padded table width
        self._ids = itertools.count()            # sequence ids in the manager, never reused
        self._rows([next(self._ids) for _ in range(batch_size)])

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

    @classmethod
    def pool(cls, config, max_tokens: int, page_size: int = 16, dtype=None, device="cpu", manager=BlockManager):
        """A pool with no rows of its own: a serving engine's, whose sequences come and go (`new_id`,
        `reserve`, `plan_step`, `view`)."""
        cache = cls(config, max_tokens, page_size, 1, dtype, device, manager=manager)
        cache.manager.release(cache.seqs[0])
        cache._rows([])
        cache.batch_size = 0
        return cache

    def _sharing_pool(self, seqs):
        """A cache over sequences `seqs` of this cache's pool. Built explicitly: it shares the pools, the
        manager and the id counter, and owns everything else."""
        view = object.__new__(PagedCache)
        KVCache.__init__(view, self.config, len(seqs), self.dtype, self.device)
        view.page_size, view.num_pages, view.max_pages = self.page_size, self.num_pages, self.max_pages
        view.manager, view.k_pool, view.v_pool, view._ids = self.manager, self.k_pool, self.v_pool, self._ids
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
        per_token = cache_bytes(config, 1, 1, dtype)
        pages = int(fraction * available_bytes) // (per_token * page_size)
        if pages < 1:
            raise CacheInputError(f"{fraction:.0%} of {available_bytes:,} bytes holds no page of {page_size} positions")
        return cls(config, pages * page_size, page_size, batch_size, dtype, device)

    # ---- the storage hooks of the protocol ----
    def seq_lengths(self) -> list:
        """Committed positions of each sequence (the manager also counts those reserved by a step in flight)."""
        return [self.manager.length(s) - self._step_T for s in self.seqs]

    @property
    def length(self) -> int:
        return KVCache.length.fget(self)

    @length.setter
    def length(self, n):
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
        """Room for n more positions of every (seq, n) in `parts` (a new id starts empty), all or none:
        OutOfPagesError changes nothing. A shared, partly filled last page is first copied in every layer's
        pools (copy on write): the one place a page is copied."""
        checks.paged_room(self, parts)                # checked first: a failure changes nothing
        for seq, n in parts:
            for src, dst in self.manager.reserve(seq, n):  # a shared, partly filled page: copy it
                self.k_pool[:, dst] = self.k_pool[:, src]
                self.v_pool[:, dst] = self.v_pool[:, src]

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
        for row, s in enumerate(self.seqs):           # write only the table entries that changed
            table, known = self.manager.block_table(s), self._tables[row]
            same = [a == b for a, b in zip(known, table, strict=False)]
            first = same.index(False) if False in same else len(same)
            for j in range(first, max(len(table), len(known))):  # a page every page_size steps
                self.block_tables[row, j] = table[j] if j < len(table) else 0
            self._tables[row] = table
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
        if not self.config.as_trained or k.shape[2] > 1:   # a prefill chunk (or a retrofit's layer,
            return super().attend(layer, q, k, v)          # ch. 10): gather and mask
        self._put(layer, k, v)                               # decode: one query per sequence
        out = decode_attention(q[:, :, 0], self.k_pool[layer], self.v_pool[layer],
                               self.block_tables, self.lengths, check_values=False)  # [B, H_q, D]
        return out[:, :, None]                               # [B, H_q, 1, D]

    def page(self, page: int) -> tuple:
        """A copy of one page's keys and values in every layer, `[layers, page_size, H_kv, D]` each: what a
        tier below the pool keeps of an evicted page (chapter 11)."""
        return self.k_pool[:, page].clone(), self.v_pool[:, page].clone()

    def set_page(self, page: int, kv: tuple):
        """Write back a page that `page` copied: a restore from a tier below the pool."""
        self.k_pool[:, page], self.v_pool[:, page] = kv

    def _attend_shaped(self, layer, q, k, v):
        """A retrofit's layer (chapter 10): gathered and masked, one row at a time when rows differ."""
        if len(set(self.seq_lengths())) > 1:
            return self._attend_rows(layer, q, k, v)
        return super()._attend_shaped(layer, q, k, v)

    def _attend_rows(self, layer, q, k, v):
        """Decode rows of different lengths under a retrofit's rules: each row's pages gathered, one row at
        a time (the in-place decode kernel knows no windows)."""
        if k is None and v is None:
            checks.shared_read(self, layer, q)
        else:
            self._put(layer, k, v)
        out = []
        for row, s in enumerate(self.seqs):
            L = self.manager.length(s)
            pages = self.block_tables[row, : math.ceil(L / self.page_size)].long()
            keys, values = (pool[layer][pages].flatten(0, 1)[:L].transpose(0, 1)[None]     # [1, H_kv, L, D]
                            for pool in (self.k_pool, self.v_pool))
            out.append(attention(self.config, layer, q[row:row + 1], keys, values))
        return torch.cat(out)

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
        return self._sharing_pool([self.seqs[r] for r in rows])

    def new_id(self):
        """A sequence id never used in this pool (for `manager.reserve` or `manager.reserve_prefix`)."""
        return next(self._ids)

    def room(self, seq, spare: int = 0) -> int:
        """The length live `seq` can grow to with its pages and the free ones, `spare` of them kept back (a
        copy on write aside), as HybridPool.room."""
        return (len(self.manager.block_table(seq)) + self.manager.num_free - spare) * self.page_size

    def held_pages(self) -> dict:
        """group -> pages some sequence holds: {"full": n}, as HybridPool.held_pages."""
        return {"full": self.manager.num_pages - self.manager.num_free}

    def view(self, seqs):
        """A cache over the live sequences `seqs` of this pool, sharing its pages (one per request, say)."""
        return self._sharing_pool(seqs)

    def plan_step(self, parts) -> "StepBatch":
        """One step over several sequences of this pool: `parts` is (seq, n) per sequence, whose n newest
        reserved positions take this step's tokens, laid end to end in this order as one row `[1, N]`."""
        return StepBatch(self, parts)

    def fork(self):
        """Child sequences sharing every page of their parents; a shared partial page is copied on first write.

        All or nothing: if any row fails, the children already made are released."""
        checks.between_steps(self, "fork")
        made = []
        try:
            for src in self.seqs:
                dst = next(self._ids)
                self.manager.fork(src, dst)
                made.append(dst)
            return self._sharing_pool(made)
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
        return self.k_pool.nbytes + self.v_pool.nbytes

    def __repr__(self):
        return (f"PagedCache(seq_lengths={self.seq_lengths()}, pages={self.num_pages} x {self.page_size}, "
                f"free={self.manager.num_free}, {self.dtype}, {self.nbytes():,} bytes)")


class StepBatch:
    """The cache one serving step's forward sees: the new tokens of several sequences of a pool laid end to
    end as one row `[1, N]`, each attending to the pages of its own sequence.

    Planned once per step, read by every layer (vLLM's attention metadata): the pool slot of every token
    (`slot_mapping`), its position, the block tables and lengths of the decode rows (one token each, read
    by the paged decode kernel), and the pages of every prefill chunk (gathered, with the offset causal
    mask). The forward drives it through the protocol: `check_model`, `attend` per layer, `advance`.
    """

    def __init__(self, pool: PagedCache, parts):
        # region step_plan
        manager, P, device = pool.manager, pool.page_size, pool.device
        slots, positions, decode, self.chunks, at = [], [], [], [], 0
        for seq, n in parts:
            start = checks.step_part(manager, seq, n)     # its n newest reserved positions
            table = manager.block_table(seq)
            slots += manager.slots(seq, start, n)
            positions += range(start, start + n)
            if n == 1 and pool.config.as_trained:         # a decode: the paged decode kernel
                decode.append((at, table, start + 1))
            else:                                         # a chunk: its pages, gathered and masked
                pages = torch.tensor(table[:-(-(start + n) // P)], device=device)
                self.chunks.append((at, n, pages, start + n))
            at += n
        width = max((len(t) for _, t, _ in decode), default=1)
        tables = [t + [0] * (width - len(t)) for _, t, _ in decode] or [[0]]   # zero-padded
        i32 = dict(dtype=torch.int32, device=device)
        self.slot_mapping = torch.tensor(slots, device=device)                  # [N] pool slots
        self.positions = torch.tensor(positions, device=device)                 # [N]
        self.decode_at = torch.tensor([a for a, _, _ in decode], device=device)  # [B_d] token index
        self.block_tables = torch.tensor(tables, **i32)                         # [B_d, max_pages]
        self.lengths = torch.tensor([n for _, _, n in decode] or [1], **i32)    # [B_d]
        self.max_length = max((n for _, _, n in decode), default=1)             # host side, for the kernel
        # endregion
        self.pool, self.n_tokens, self.done = pool, at, False
        self.pending = [0] * pool.n_layers                  # tokens stored per layer in this step
        self.n_layers = pool.n_layers

    def check_model(self, config, owner):
        """The pool was built for this model's shape and its pages hold `owner`'s keys and values."""
        checks.step_model(self, config, owner)
        self.pool.owner = owner

    def attend(self, layer: int, q, k, v):
        """Store k, v `[1, H_kv, N, D]` in their slots; q `[1, H_q, N, D]` attends per sequence ->
        `[1, H_q, N, D]`."""
        pool = self.pool
        k_pool, v_pool = pool.k_pool[layer], pool.v_pool[layer]            # [pages, page_size, H_kv, D]
        if k is None and v is None:                  # a layer reading an earlier one's cache (share_kv)
            checks.shared_read(self, layer, q)
        else:
            checks.step_kv(self, layer, k, v)
            H, D = k.shape[1], k.shape[3]
            store_rows(k_pool.view(-1, H, D), self.slot_mapping, k[0].transpose(0, 1), check_values=False)
            store_rows(v_pool.view(-1, H, D), self.slot_mapping, v[0].transpose(0, 1), check_values=False)
            self.pending[layer] = k.shape[2]                                   # [N, H_kv, D] into slots
        if not self.chunks:                          # every token a decode, in order: no copies in or out
            o = decode_attention(q[0].transpose(0, 1), k_pool, v_pool, self.block_tables, self.lengths,
                                 check_values=False, max_length=self.max_length)   # [N, H_q, D]
            return o.transpose(0, 1)[None]                                     # [1, H_q, N, D], a view
        out = torch.empty_like(q)                                              # [1, H_q, N, D]
        if len(self.decode_at):
            q_dec = q[0, :, self.decode_at].transpose(0, 1)                     # [B_d, H_q, D]
            o = decode_attention(q_dec, k_pool, v_pool, self.block_tables, self.lengths,
                                 check_values=False, max_length=self.max_length)
            out[0, :, self.decode_at] = o.transpose(0, 1)                       # [H_q, B_d, D]
        for at, n, pages, L in self.chunks:                                 # L = start + n positions
            keys = k_pool[pages].flatten(0, 1)[:L].transpose(0, 1)[None]        # [1, H_kv, L, D]
            values = v_pool[pages].flatten(0, 1)[:L].transpose(0, 1)[None]
            if not pool.config.as_trained:                                  # a retrofit's rules (ch. 10)
                out[:, :, at:at + n] = attention(pool.config, layer, q[:, :, at:at + n], keys, values)
                continue
            mask = offset_causal_mask(L - n, n, q.device)                       # [n, L]
            out[:, :, at:at + n] = F.scaled_dot_product_attention(q[:, :, at:at + n], keys, values,
                                                                  attn_mask=mask, enable_gqa=True)
        return out

    def advance(self, t: int):
        """Commit the step: every layer stored its t = N tokens, which now hold keys and values. A plan
        runs once."""
        checks.advance(self, t)
        self.done, self.pool.version = True, self.pool.version + 1


class HybridPool:
    """The pages of a model with local and global layers (chapter 10), for a serving engine: a
    HybridBlockManager (`HybridBlockManager.for_model`: a "full" group for the global cache layers, a
    "local" group of `local_pages` pages for the windowed ones) and one pool pair per group that holds only
    that group's cache layers, `[layers in the group, pages, page_size, H_kv, D]`. A local group gives back
    the pages that left the window, so its pool can be smaller than the full one.

    It plays PagedCache's part in the engine: `reserve`, `new_id`, `plan_step`. It remembers, per sequence,
    the first position reserved since the last step: no query has run there yet, so every reservation
    before the step judges the window from it (HybridBlockManager's `first_query`). A draft's lookahead,
    reserved after the decode's own position, thus never gives back a page that the decode's query reads,
    and a verify's crop, which keeps at least that position, is never refused.
    """

    def __init__(self, config, num_pages: int, page_size: int = 16, local_pages: int | None = None,
                 dtype=None, device="cpu"):
        self.manager = HybridBlockManager.for_model(config, num_pages, page_size, local_pages)
        checks.hybrid_pages(self.manager)                # a sequence alone always finds its window's pages
        self.config, self.page_size, self.num_pages = config, page_size, num_pages
        self.dtype = config.torch_dtype if dtype is None else dtype
        self.device = torch.empty(0, device=device).device
        self.n_layers, self.n_kv_heads, self.head_dim = config.kv_layout
        self.k_pools, self.v_pools, self.where = {}, {}, {}   # group -> its pools; cache layer -> (group, index)
        for group in self.manager.groups:
            layers = self.manager.layers(group)
            shape = (len(layers), self.manager.manager(group).num_pages, page_size, self.n_kv_heads, self.head_dim)
            self.k_pools[group] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v_pools[group] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.where |= {layer: (group, i) for i, layer in enumerate(layers)}
        self.owner, self.version, self.seqs = None, 0, []   # no rows of its own: the engine's requests hold pages
        self._ids = itertools.count()
        self._first_query = {}                  # seq -> its first position reserved since the last step

    def new_id(self):
        """A sequence id never used in this pool."""
        return next(self._ids)

    def pages_needed(self, seq, n) -> dict:
        """group -> free pages reserve([(seq, n)]) takes from it (negative: the window gives back more)."""
        return self.manager.pages_needed(seq, n, self._first_query.get(seq))

    def room(self, seq, spare: int = 0) -> int:
        """The length `seq` can grow to with every group's free pages, `spare` of each kept back."""
        return self.manager.room(seq, self._first_query.get(seq), spare)

    def held_pages(self) -> dict:
        """group -> pages some sequence holds."""
        return {g: self.manager.held_pages(g) for g in self.manager.groups}

    def reserve(self, parts):
        """Room for n more positions of every (seq, n) in `parts` (a new id starts empty) in every group, all
        or none: OutOfPagesError changes nothing. A shared, partly filled last page is copied in the pools
        of its group first (copy on write)."""
        checks.hybrid_room(self, parts)                  # checked first: a failure changes nothing
        for seq, n in parts:
            first = self._first_query.get(seq, self.manager.length(seq) if seq in self.manager else 0)
            for group, copies in self.manager.reserve(seq, n, first_query=first).items():
                for src, dst in copies:
                    self.k_pools[group][:, dst] = self.k_pools[group][:, src]
                    self.v_pools[group][:, dst] = self.v_pools[group][:, src]
            self._first_query[seq] = first

    def _computed(self):
        """A step ran: every position reserved holds its keys and values."""
        self._first_query.clear()

    def plan_step(self, parts) -> "HybridStep":
        """One step over sequences of this pool, as PagedCache.plan_step: (seq, n) per sequence."""
        return HybridStep(self, parts)

    def nbytes(self) -> int:
        return sum(pool.nbytes for pools in (self.k_pools, self.v_pools) for pool in pools.values())

    def __repr__(self):
        groups = ", ".join(f"{g}: layers {self.manager.layers(g)}, {self.manager.num_free(g)}/"
                           f"{self.manager.manager(g).num_pages} pages free" for g in self.manager.groups)
        return f"HybridPool({groups}, page_size={self.page_size}, {self.dtype}, {self.nbytes():,} bytes)"


class HybridStep:
    """StepBatch for a HybridPool: the new tokens of several sequences as one row `[1, N]`. Each layer
    stores its keys and values in its group's pool, at the group's slots. The decodes (one token each) of
    every sequence attend together, in the paged decode kernel under the group's window and sinks: it reads
    the sink pages and the pages from the window on, in place, and never a page the window gave back (NULL
    in the block table, 0 in the kernel's). The queries of a prefill chunk attend to the positions their
    group still holds that they may read, gathered slot by slot under the `visible` mask.

    What a group's attention reads is the same in each of its layers, so it is planned once per step: the
    decode rows' block tables and lengths, and per chunk the slots of the positions read and the mask
    `[n, positions read]`.
    """

    def __init__(self, pool: HybridPool, parts):
        # region hybrid_step_plan
        manager, device = pool.manager, pool.device
        slots, positions, at = {g: [] for g in manager.groups}, [], 0
        self.reads = {g: [] for g in manager.groups}  # group -> per chunk (at, n, slots [K], mask [n, K])
        tables, decode_at, lengths = {g: [] for g in manager.groups}, [], []   # the decode rows
        for seq, n in parts:
            start = checks.step_part(manager, seq, n)    # its n newest reserved positions
            end = start + n
            positions += range(start, end)
            if n == 1:
                decode_at.append(at)
                lengths.append(end)
            for group in manager.groups:
                bm, (window, sinks) = manager.manager(group), manager.rule(group)
                slots[group] += bm.slots(seq, start, n)
                if n == 1:                               # pages given back read as page 0, never loaded
                    table, P = bm.block_table(seq), pool.page_size
                    lo = max(0, end - window) if window else 0   # its window's first position
                    if NULL in table[lo // P:] or NULL in table[:-(-min(sinks, lo) // P)]:
                        raise CacheStateError(f"sequence {seq!r}: its decode at position {start} reads a page "
                                              f"of group {group!r} that was given back: {table}")
                    tables[group].append([max(page, 0) for page in table])
                    continue
                lo = max(0, start + 1 - window) if window else 0   # the first query's window
                keys = [*range(min(sinks, lo)), *range(lo, end)]  # what some query reads
                read = bm.slots(seq, 0, min(sinks, lo)) + bm.slots(seq, lo, end - lo)  # never NULL
                mask = None if n == 1 else visible(start, n, window, sinks, device)   # [n, end]
                if mask is not None and len(keys) < end:
                    mask = mask[:, torch.tensor(keys, device=device)]                  # [n, K]
                self.reads[group].append((at, n, torch.tensor(read, device=device), mask))
            at += n
        self.slot_mapping = {g: torch.tensor(s, dtype=torch.long, device=device) for g, s in slots.items()}
        self.positions = torch.tensor(positions, device=device)                     # [N]
        i32 = dict(dtype=torch.int32, device=device)
        width = {g: max(map(len, t), default=1) for g, t in tables.items()}
        self.block_tables = {g: torch.tensor([r + [0] * (width[g] - len(r)) for r in t] or [[0]], **i32)
                             for g, t in tables.items()}                          # [B_d, max_pages] per group
        self.lengths = torch.tensor(lengths or [1], **i32)                          # [B_d]
        self.decode_at = torch.tensor(decode_at, dtype=torch.long, device=device)  # [B_d] token index
        self.max_length = max(lengths, default=1)
        # endregion
        self.pool, self.n_tokens, self.done = pool, at, False
        self.n_layers = pool.n_layers
        self.pending = [0] * pool.n_layers                  # tokens stored per layer in this step

    def check_model(self, config, owner):
        """The pool was built for this model's shape and its pages hold `owner`'s keys and values."""
        checks.step_model(self, config, owner)
        self.pool.owner = owner

    def attend(self, layer: int, q, k, v):
        """Store k, v `[1, H_kv, N, D]` in their group's slots; q `[1, H_q, N, D]` attends per
        sequence to what its group holds -> `[1, H_q, N, D]`."""
        pool = self.pool
        checks.step_query(q)
        if k is None and v is None:                  # a layer reading an earlier one's cache (share_kv)
            checks.shared_read(self, layer, q)
        else:
            checks.step_kv(self, layer, k, v)
        group, i = pool.where[layer]
        H, D = pool.n_kv_heads, pool.head_dim
        k_slots, v_slots = pool.k_pools[group][i].view(-1, H, D), pool.v_pools[group][i].view(-1, H, D)
        if k is not None:
            store_rows(k_slots, self.slot_mapping[group], k[0].transpose(0, 1), check_values=False)
            store_rows(v_slots, self.slot_mapping[group], v[0].transpose(0, 1), check_values=False)
            self.pending[layer] = k.shape[2]
        out = torch.empty_like(q)                                               # [1, H_q, N, D]
        if len(self.decode_at):                                                  # every decode at once
            window, sinks = pool.manager.rule(group)
            o = decode_attention(q[0, :, self.decode_at].transpose(0, 1), pool.k_pools[group][i],
                                 pool.v_pools[group][i], self.block_tables[group], self.lengths, check_values=False,
                                 max_length=self.max_length, window=window, sinks=sinks)   # [B_d, H_q, D]
            out[0, :, self.decode_at] = o.transpose(0, 1)
        for at, n, read, mask in self.reads[group]:
            keys = k_slots[read].transpose(0, 1)[None]                          # [1, H_kv, K, D]
            values = v_slots[read].transpose(0, 1)[None]
            out[:, :, at:at + n] = F.scaled_dot_product_attention(q[:, :, at:at + n], keys, values,
                                                                  attn_mask=mask, enable_gqa=True)
        return out

    def advance(self, t: int):
        """Commit the step: every layer stored its t = N tokens. The reserved positions now hold keys and
        values: the next reservation judges the window from the length again."""
        checks.advance(self, t)
        self.done, self.pool.version = True, self.pool.version + 1
        self.pool._computed()
