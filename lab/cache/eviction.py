"""Which cached page a prefix cache forgets when it needs a fresh one: eviction policies beside LRU.

BlockManager evicts the named free page freed the longest ago (LRU, its `victim()`). LFUBlockManager counts, for
every named page, the requests that took it, and evicts the page used the fewest times: a conversation's pages,
taken again at every turn, outlive a document read once, even when the document came later.

A policy is a BlockManager whose `victim()` chooses otherwise; set it as a pool's manager before the first sequence
(`backend.pool.manager = LFUBlockManager(num_pages, page_size)`, as `lab.workloads.hit_rate` does), on a backend
without tiers: those hook their eviction into the manager they made (one swapped in would drop evicted pages).
"""

import heapq
import itertools

from .block_manager import BlockManager


# region eviction_lfu
class LFUBlockManager(BlockManager):
    """Evict the named free page used the fewest times, the least recently freed among equals;
    a free page without a name goes first (it holds nothing reusable). A page's uses: 1 when it
    is named, plus 1 for every request that takes it from the cache; named again after its
    eviction, it starts again at 1.

    The choice costs O(log N): free pages wait in a heap keyed (uses, when freed). A page's uses
    change only while a sequence holds it, so its key stays right while it is free; an entry
    whose page was taken since (allocated, or reused by a prefix hit) is stale, and skipped."""

    def __init__(self, num_pages: int, page_size: int):
        super().__init__(num_pages, page_size)
        self.uses = [0] * num_pages                 # page -> uses since it was named
        self._clock = itertools.count()             # orders the frees
        self._freed_at = [0] * num_pages            # page -> the clock when it was last freed
        self._heap = []                     # (uses, or 0 unnamed; freed at; page), stale ones too
        for page in self.free_pages():
            self._push(page)

    def _push(self, page):
        self._freed_at[page] = t = next(self._clock)
        heapq.heappush(self._heap, (self.uses[page] if page in self._keys else 0, t, page))

    def victim(self) -> int:
        while True:
            _, t, page = self._heap[0]
            if page in self._free and self._freed_at[page] == t:   # free since it was pushed
                return page
            heapq.heappop(self._heap)               # stale: the page was taken after this entry

    def _drop(self, pages) -> list[int]:
        freed = super()._drop(pages)
        for page in freed:                          # in the order they were freed
            self._push(page)
        return freed

    def register(self, seq, index, digest, parent, tokens) -> bool:
        named = super().register(seq, index, digest, parent, tokens)
        if named:
            self.uses[self.block_table(seq)[index]] = 1        # written: its first use
        return named

    def reserve_prefix(self, seq, keys) -> int:
        n = super().reserve_prefix(seq, keys)
        for page in self.block_table(seq):                    # the n pages it took: all it holds
            self.uses[page] += 1
        return n
# endregion


POLICIES = {"lru": BlockManager, "lfu": LFUBlockManager}    # eviction name -> the manager that evicts so
