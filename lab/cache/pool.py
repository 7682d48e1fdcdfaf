"""PagePool and StepBatch: the pages of every cache shape, and one serving step planned over them.

A PagePool holds a grouped manager (HybridBlockManager) and one pool pair per group, `[layers in the group, pages,
page_size, H_kv, D]`: "full", plus "local" for sliding-window layers (chapter 10). The serving engine, PagedCache
and chapter 11's hand-offs all store their keys and values here.

`plan_step(parts)` lays the new tokens of several sequences end to end as one row `[1, N]` and works out once per
step and group what every layer's attention needs (vLLM's attention metadata): each token's pool slot, the decode
rows' block tables and lengths, each prefill chunk's read slots and mask. Decode block tables stay on the device,
and a step writes only the entries that changed.
"""

import itertools

import torch
import torch.nn.functional as F

from ..kernels import cascade_attention, decode_attention
from ..kernels.fused import store_rows
from . import checks
from .base import CacheStateError, offset_causal_mask, visible
from .block_manager import NULL, common_length
from .hybrid import HybridBlockManager

# A step reads a shared prefix once (cascade_attention) for at least CASCADE_ROWS decodes whose block tables
# begin with the same page and share CASCADE_SHARED positions or more (all of them): the smallest case the ch12
# section of results.json times where the cascade won (4 branches over 1,024 positions); below it, unmeasured,
# the separate kernel call and the rows' gathers may cost more than the reads they save.
CASCADE_ROWS, CASCADE_SHARED = 4, 1024


class PagePool:
    """The pages of `manager`'s groups for a model of shape `config` (no rows of its own: sequences come and
    go through `new_id`, `reserve`, `plan_step`). It remembers, per sequence, the first position reserved
    since the last step: no query has run there yet, so every reservation before the step judges a window
    from it (HybridBlockManager's `first_query`). A draft's lookahead, reserved after the decode's own
    position, thus never gives back a page that the decode's query reads."""

    def __init__(self, config, manager: HybridBlockManager, dtype=None, device="cpu"):
        checks.pool_pages(manager)                  # a sequence alone always finds its window's pages
        self.config, self.manager, self.page_size = config, manager, manager.page_size
        self.dtype = config.torch_dtype if dtype is None else dtype
        self.device = torch.empty(0, device=device).device
        self.n_layers, self.n_kv_heads, self.head_dim = L, H, D = config.kv_layout
        self.k_pools, self.v_pools, self.where = {}, {}, {}   # group -> its pools; cache layer -> (group, index)
        for group in manager.groups:
            layers = manager.layers(group)
            shape = (len(layers), manager.num_pages[group], self.page_size, H, D)
            self.k_pools[group] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.v_pools[group] = torch.zeros(shape, dtype=self.dtype, device=self.device)
            self.where |= {layer: (group, i) for i, layer in enumerate(layers)}
        if sorted(self.where) != list(range(L)):
            raise checks.CacheInputError(f"the groups hold cache layers {sorted(self.where)}; the model has 0..{L - 1}")
        self.owner, self.version = None, 0
        self._ids = itertools.count()                 # sequence ids, never reused
        self._first_query = {}                        # seq -> its first position reserved since the last step
        self._windowed = any(manager.rule(g)[0] for g in manager.groups)   # (only a window needs it)
        self._rows, self._free_rows = {}, []          # seq -> its row of the device tables; rows to reuse
        self._known = {g: {} for g in manager.groups}  # group -> seq -> the entries its row holds
        self.tables = {g: torch.zeros(1, 16, dtype=torch.int32, device=self.device) for g in manager.groups}

    @classmethod
    def for_model(cls, config, num_pages: int, page_size: int = 16, local_pages: int | None = None,
                  index: str | None = None, dtype=None, device="cpu"):
        """A serving engine's pool: HybridBlockManager.for_model's groups and prefix index."""
        manager = HybridBlockManager.for_model(config, num_pages, page_size, local_pages, index)
        return cls(config, manager, dtype, device)

    # ---- sequences and pages ----
    def new_id(self):
        """A sequence id never used in this pool."""
        return next(self._ids)

    def pages_needed(self, seq, n) -> dict:
        """group -> free pages reserve([(seq, n)]) takes from it (negative: the window gives back more)."""
        return self.manager.pages_needed(seq, n, self._first_query.get(seq))

    def room(self, seq, spare: int = 0) -> int:
        """HybridBlockManager.room, the window judged from the first query still to run."""
        return self.manager.room(seq, self._first_query.get(seq), spare)

    def fit(self, seq, n: int, spare: int = 0) -> int:
        """HybridBlockManager.fit, the window judged from the first query still to run."""
        return self.manager.fit(seq, n, self._first_query.get(seq), spare)

    def held_pages(self) -> dict:
        """group -> pages some sequence holds."""
        return {g: self.manager.held_pages(g) for g in self.manager.groups}

    def reserve(self, parts):
        """Room for n more positions of every (seq, n) in `parts` (a new id starts empty) in every
        group, all or none; a shared, partly filled last page is copied first (copy on write, the
        one place a page is copied). Returns the copies, (group, src, dst)."""
        checks.pool_room(self, parts)               # checked first: a failure changes nothing
        copied = []
        for seq, n in parts:
            first = self._first_query.get(seq, self.manager.length(seq) if seq in self.manager else 0)
            for group, copies in self.manager.reserve(seq, n, first_query=first).items():
                for src, dst in copies:
                    self.k_pools[group][:, dst] = self.k_pools[group][:, src]
                    self.v_pools[group][:, dst] = self.v_pools[group][:, src]
                    copied.append((group, src, dst))
            if self._windowed:
                self._first_query[seq] = first
        return copied

    def fork(self, src):
        """A new sequence sharing every page of `src` (copied on write only); its id."""
        dst = self.new_id()
        self.manager.fork(src, dst)
        return dst

    def page(self, page: int, group: str | None = None) -> tuple:
        """A copy of one page's keys and values in every layer of `group` (the first by default), `[layers,
        page_size, H_kv, D]` each: what a tier below the pool keeps, or a hand-off sends (chapter 11)."""
        group = group or self.manager.groups[0]
        return self.k_pools[group][:, page].clone(), self.v_pools[group][:, page].clone()

    def set_page(self, page: int, kv: tuple, group: str | None = None):
        """Write back a page that `page` copied: a restore from a tier below the pool, or a hand-off."""
        group = group or self.manager.groups[0]
        self.k_pools[group][:, page], self.v_pools[group][:, page] = kv

    def plan_step(self, parts) -> "StepBatch":
        """One step over sequences of this pool: `parts` is (seq, n) per sequence, whose n newest reserved
        positions take this step's tokens, laid end to end in this order as one row `[1, N]`."""
        return StepBatch(self, parts)

    def nbytes(self) -> int:
        return sum(pool.nbytes for pools in (self.k_pools, self.v_pools) for pool in pools.values())

    def __repr__(self):
        groups = ", ".join(f"{g}: layers {self.manager.layers(g)}, {self.manager.num_free[g]}/"
                           f"{self.manager.num_pages[g]} pages free" for g in self.manager.groups)
        return f"PagePool({groups}, page_size={self.page_size}, {self.dtype}, {self.nbytes():,} bytes)"

    # ---- the device block tables, kept between steps ----
    def _table_rows(self, seqs) -> torch.Tensor:
        """The rows of `seqs` in every group's device table `[rows, width]`, brought up to the manager's
        block tables (write_changed). Rows of sequences no longer live are reused."""
        for seq in [s for s in self._rows if s not in self.manager]:
            self._free_rows.append(self._rows.pop(seq))
            for known in self._known.values():
                known.pop(seq, None)
        for seq in seqs:
            if seq not in self._rows:
                self._rows[seq] = self._free_rows.pop() if self._free_rows else len(self._rows)
        rows = [self._rows[s] for s in seqs]
        if not rows:
            return torch.zeros(1, dtype=torch.long, device=self.device)  # a row of zeros, never read
        for group in self.manager.groups:
            bm, known = self.manager.manager(group), self._known[group]
            width = max([len(bm._tables[s]) for s in seqs] + [1])
            tables = self.tables[group]
            if max(rows) >= tables.shape[0] or width > tables.shape[1]:   # grow: twice the rows or width
                grown = tables.new_zeros(max(2 * tables.shape[0], max(rows) + 1),
                                         max(tables.shape[1], 2 * width if width > tables.shape[1] else 0))
                grown[:tables.shape[0], :tables.shape[1]] = tables
                self.tables[group] = tables = grown
            for seq, row in zip(seqs, rows, strict=True):    # write only what changed since the last step
                known[seq] = write_changed(tables[row], bm._tables[seq], known.get(seq, []))
        return torch.tensor(rows, dtype=torch.long, device=self.device)


def write_changed(row, table: list, old: list) -> list:
    """Bring a device block-table row, which holds `old`, up to the manager's `table`: only the
    entries from the first difference on are written (a new page, a copy on write, a crop), a page
    given back (NULL) as 0, which the kernel never loads. Returns what the row holds now."""
    if table == old:
        return old                                   # the usual decode step: nothing to write
    first = common_length(table, old)
    new = [max(page, 0) for page in table[first:]] + [0] * max(0, len(old) - len(table))
    row[first:first + len(new)] = torch.tensor(new, dtype=row.dtype)
    return list(table)


class StepBatch:
    """The cache one serving step's forward sees (`plan_step` in the module docstring): planned
    once, read by every layer through the protocol, `check_model`, `attend` per layer, `advance`."""

    def __init__(self, pool: PagePool, parts):
        # region step_plan
        checks.distinct_parts(parts)                      # each sequence once
        manager, P, device = pool.manager, pool.page_size, pool.device
        groups = manager.groups                           # "full", and "local" with local layers
        slots, positions, decode, at = {g: [] for g in groups}, [], [], 0
        self.chunks = {g: [] for g in groups}    # per chunk: (at, n, slots read [K], start, lo)
        for seq, n in parts:
            start = checks.step_part(manager, seq, n)     # its n newest reserved positions
            positions += range(start, start + n)
            for g in groups:
                bm, (window, sinks) = manager.manager(g), manager.rule(g)
                slots[g] += bm.slots(seq, start, n)       # where its keys and values go
                lo = max(0, start + 1 - window) if window else 0   # the first query's window
                if n == 1:                                # a decode: the kernel reads in place
                    if window:                            # (only a window gives pages back)
                        _window_held(bm._tables[seq], seq, g, start, lo, sinks, P)
                    continue
                # a chunk: the slots its queries read (the sinks, then from the first query's window on)
                read = bm.slots(seq, 0, min(sinks, lo)) + bm.slots(seq, lo, start + n - lo)
                self.chunks[g].append((at, n, torch.tensor(read, device=device), start, lo))
            if n == 1:
                decode.append((at, seq, start + 1))
            at += n
        long = dict(dtype=torch.long, device=device)
        self.slot_mapping = {g: torch.tensor(s, **long) for g, s in slots.items()}   # [N]
        self.positions = torch.tensor(positions, device=device)                      # [N]
        self.decode_at = torch.tensor([a for a, _, _ in decode], **long)           # [B_d]
        lengths = [length for _, _, length in decode] or [1]
        width = -(-max(lengths) // P)                     # the pages the longest decode reads
        rows = pool._table_rows([seq for _, seq, _ in decode])   # kept on the device
        self.block_tables = {g: pool.tables[g][rows, :width] for g in groups}  # [B_d, width]
        self.lengths = torch.tensor(lengths, dtype=torch.int32, device=device)     # [B_d]
        self.max_length = max(lengths)                    # on the host, for the kernel
        # endregion
        self.plain = {g: (self.decode_at, self.block_tables[g], self.lengths, self.max_length) for g in groups}
        self.cascades = {g: self._cascades(pool, g, decode, lengths, device) for g in groups}
        self.pool, self.n_tokens, self.done, self._masks = pool, at, False, {}
        self.n_layers = pool.n_layers
        self.pending = [0] * pool.n_layers                  # tokens stored per layer in this step

    def check_model(self, config, owner):
        """The pool was built for this model's shape and its pages hold `owner`'s keys and values."""
        checks.step_model(self, config, owner)
        self.pool.owner = owner

    def attend(self, layer: int, q, k, v):
        """Store k, v `[1, H_kv, N, D]` in their group's slots; q `[1, H_q, N, D]` attends per sequence to
        what its group holds -> `[1, H_q, N, D]`."""
        pool = self.pool
        checks.step_query(q)
        if k is None and v is None:                  # a layer reading an earlier one's cache (share_kv)
            checks.shared_read(self, layer, q)
        else:
            checks.step_kv(self, layer, k, v)
        group, i = pool.where[layer]
        k_pool, v_pool = pool.k_pools[group][i], pool.v_pools[group][i]          # [pages, page_size, H_kv, D]
        k_slots, v_slots = k_pool.view(-1, *k_pool.shape[2:]), v_pool.view(-1, *v_pool.shape[2:])
        if k is not None:
            store_rows(k_slots, self.slot_mapping[group], k[0].transpose(0, 1), check_values=False)
            store_rows(v_slots, self.slot_mapping[group], v[0].transpose(0, 1), check_values=False)
            self.pending[layer] = k.shape[2]
        window, sinks = pool.config.window_of(layer)         # the layer's rule (its group's, in an engine)
        if len(self.decode_at) == self.n_tokens and not self.cascades[group]:   # every token a decode, in order
            o = decode_attention(q[0].transpose(0, 1), k_pool, v_pool, self.block_tables[group], self.lengths,
                                 check_values=False, max_length=self.max_length, window=window, sinks=sinks)
            return o.transpose(0, 1)[None]                                     # [1, H_q, N, D], a view
        out = torch.empty_like(q)                                               # [1, H_q, N, D]
        at, tables, lengths, longest = self.plain[group]
        if len(at):
            o = decode_attention(q[0, :, at].transpose(0, 1), k_pool, v_pool, tables, lengths, check_values=False,
                                 max_length=longest, window=window, sinks=sinks)  # [B_d, H_q, D]
            out[0, :, at] = o.transpose(0, 1)
        for at, shared, shared_length, tables, lengths, longest in self.cascades[group]:   # a prefix read once
            o = cascade_attention(q[0, :, at].transpose(0, 1), k_pool, v_pool, shared, shared_length, tables,
                                  lengths, check_values=False, max_length=longest)
            out[0, :, at] = o.transpose(0, 1)
        for at, n, read, start, lo in self.chunks[group]:
            keys = k_slots[read].transpose(0, 1)[None]                          # [1, H_kv, K, D]
            values = v_slots[read].transpose(0, 1)[None]
            out[:, :, at:at + n] = F.scaled_dot_product_attention(q[:, :, at:at + n], keys, values, enable_gqa=True,
                                                                  attn_mask=self._mask(start, n, lo, window, sinks))
        return out

    def _cascades(self, pool, group, decode, lengths, device) -> list:
        """The decodes of `group` that share a prefix worth reading once: groups of at least CASCADE_ROWS whose
        block tables start with the same CASCADE_SHARED positions or more (a full group of layers with no
        window only), each (where its tokens are [R], the shared pages [S], their positions, its rows' own
        pages [R, width - S] and positions [R], the most of those). Those rows leave `self.plain[group]`."""
        manager, P = pool.manager, pool.page_size
        if len(decode) < CASCADE_ROWS or any(pool.config.window_of(layer)[0] for layer in manager.layers(group)):
            return []
        tables = [manager.manager(group)._tables[seq] for _, seq, _ in decode]
        by_first_page = {}                               # forks of one prompt start alike
        for r, table in enumerate(tables):
            by_first_page.setdefault(table[0], []).append(r)
        families, taken = [], []
        for rows in by_first_page.values():
            shared = min(min(common_length(tables[rows[0]], tables[r]), len(tables[r]) - 1) for r in rows)
            if len(rows) >= CASCADE_ROWS and shared * P >= CASCADE_SHARED:   # (never a row's own last page)
                i = torch.tensor(rows, device=device)
                families.append((self.decode_at[i], torch.tensor(tables[rows[0]][:shared], dtype=torch.int32,
                                 device=device), shared * P, self.block_tables[group][i, shared:],
                                 self.lengths[i] - shared * P, max(lengths[r] for r in rows) - shared * P))
                taken += rows
        if taken:
            i = torch.tensor([r for r in range(len(decode)) if r not in taken], dtype=torch.long, device=device)
            rest = [lengths[r] for r in range(len(decode)) if r not in taken]
            self.plain[group] = (self.decode_at[i], self.block_tables[group][i], self.lengths[i], max(rest, default=1))
        return families

    def _mask(self, start, n, lo, window, sinks):
        """`[n, K]`: which of the K positions a chunk reads (its group's sinks, then lo..start + n - 1) each of
        its queries sees; made once per step for each rule."""
        key = (start, n, lo, window, sinks)
        if key not in self._masks:
            device = self.pool.device
            mask = visible(start, n, window, sinks, device) if window else offset_causal_mask(start, n, device)
            if lo:                                                  # the group keeps only sinks and lo.. on
                cols = [*range(min(sinks, lo)), *range(lo, start + n)]
                mask = mask[:, torch.tensor(cols, device=device)]
            self._masks[key] = mask
        return self._masks[key]

    def in_place(self) -> tuple:
        """What a step run in one call over every layer reads and writes (lab/engine/fast.py; a step of decodes
        only, on a pool of one group, "full"): the pools k, v `[L, pages, page_size, H_kv, D]`, each decode's
        slot `[B]`, block table `[B, width]` (contiguous) and length `[B]` (its new position counted), and the
        longest length."""
        return (self.pool.k_pools["full"], self.pool.v_pools["full"], self.slot_mapping["full"],
                self.block_tables["full"].contiguous(), self.lengths, self.max_length)

    def stored(self, t: int):
        """Every layer stored its t tokens' keys and values in their slots without `attend` (one call for the
        whole step: lab/engine/fast.py)."""
        self.pending = [t] * self.n_layers

    def advance(self, t: int):
        """Commit the step (every layer stored its t = N tokens): the next reservation judges a
        window from the length again. A plan runs once."""
        checks.advance(self, t)
        self.done, self.pool.version = True, self.pool.version + 1
        self.pool._first_query.clear()


def _window_held(table, seq, group, start, lo, sinks, page_size):
    """A planned decode at position `start` of `seq`: every page its query reads in `group` (the sinks, and
    from `lo`, its window's first position, on) is still held, not given back (NULL)."""
    if NULL in table[lo // page_size:] or NULL in table[:-(-min(sinks, lo) // page_size)]:
        raise CacheStateError(f"sequence {seq!r}: its decode at position {start} reads a page of group "
                              f"{group!r} that was given back: {table}")
