"""BlockManager: hands out the pages of a paged KV cache to sequences (host-side bookkeeping only, chapter 5).

The pool holds `num_pages` pages of `page_size` positions; the tensors live elsewhere (PagedCache: `[num_pages,
page_size, H_kv, D]` per layer). Position p of a sequence lives in page `block_table[p // page_size]` at offset `p
% page_size`, slot `page * page_size + offset` of the flattened pool.

Pages are counted, not owned: `fork` shares a block table and adds a reference to every page. A shared page is
read-only: `reserve` copies a shared, partly filled last page (copy-on-write) and returns (old, new) for the caller
to copy in its pools. A page at count zero returns to the free list (an ordered dict, as vLLM's free block queue:
front, back and a prefix hit's middle in O(1)).

Every operation checks everything first and changes nothing when it fails; an exhausted pool raises OutOfPagesError
(the caller may preempt and retry). Sequence ids are any hashable but a bool, never reused after release.

A block-table entry may be NULL: the page was given back while the sequence lives on (`drop_pages`, for a sliding
window's past, see lab.cache.hybrid). Only drop_pages and adopt make such entries; every method skips them, and
a partly filled last page is never NULL.
"""

from collections import OrderedDict
from itertools import takewhile

from .checks import int_arg
from .errors import CacheInputError, CacheStateError, OutOfPagesError
from .hashing import page_digest

__all__ = ["BlockManager", "NULL", "OutOfPagesError", "pages_for", "common_length"]

NULL = -1  # a block-table entry whose page was given back (drop_pages): no page, no slots


def pages_for(length, page_size):  # ceil(length / page_size)
    return -(-length // page_size)


def common_length(a, b) -> int:
    """How many leading entries the sequences a and b share (token ids, block tables)."""
    return next((j for j, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


# region block_manager_state
class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        int_arg("num_pages", num_pages, low=1)
        int_arg("page_size", page_size, low=1)
        self.num_pages, self.page_size = num_pages, page_size
        self._free = OrderedDict.fromkeys(range(num_pages))  # free pages, least recent first
        self._refs = [0] * num_pages          # how many block tables hold each page
        self._tables = {}                     # seq -> [page ids], ceil(length / page_size) of them
        self._lengths = {}                    # seq -> positions reserved
        self._released = set()                # ids that were released: never valid again
        self._cached = {}                     # prefix caching: digest -> page holding those tokens
        self._keys = {}                       # page -> its (digest, parent digest, tokens)
        self.evicted = 0                      # cached pages reused for other positions
        self.on_evict = None                  # on_evict(page, key): a named page about to be reused
        self.on_name = None                   # on_name(page, key): a page just named (KV events)

    def block_table(self, seq) -> list[int]:
        """A copy of the sequence's page ids, in position order."""
        return list(self._tables[self._live(seq)])

    def slots(self, seq, start: int, n: int) -> list[int]:
        """The slot mapping: pool slots (page * page_size + offset) of positions start..start+n-1"""
        _slot_range(self, self._live(seq), start, n)
        table, P = self._tables[seq], self.page_size
        if any(table[p // P] == NULL for p in range(start, start + n)):
            raise CacheStateError(f"slots({seq!r}, {start}, {n}): a page of these positions was "
                                  f"given back (block table {table})")
        return [table[p // P] * P + p % P for p in range(start, start + n)]
    # endregion

    # ---- looking ----
    @property
    def num_free(self) -> int:
        return len(self._free)

    def __contains__(self, seq) -> bool:
        return seq in self._tables

    def sequences(self) -> list:
        """The live sequence ids, in the order they were created."""
        return list(self._tables)

    def length(self, seq) -> int:
        return self._lengths[self._live(seq)]

    def owners(self, page: int) -> list:
        """The live sequences whose block table holds `page` (for debugging and teaching)."""
        _page_id(self, page)
        return [seq for seq, table in self._tables.items() if page in table]

    def refs(self, page: int) -> int:
        """How many block tables hold `page` (0: it is free)."""
        _page_id(self, page)
        return self._refs[page]

    def pages_needed(self, seq, n: int) -> int:
        """How many free pages `reserve(seq, n)` would take, a copy-on-write page included."""
        int_arg("n", n)
        if not self._new_or_live(seq) or n == 0:
            return pages_for(n, self.page_size)
        length, table = self._lengths[seq], self._tables[seq]
        copy = 1 if length % self.page_size and self._refs[table[-1]] > 1 else 0  # shared, partial
        return copy + pages_for(length + n, self.page_size) - len(table)

    def check_writable(self, seq, slot: int):
        """Raise CacheStateError unless `seq` may write `slot`: its own unshared page, reserved."""
        _writable(self, self._live(seq), slot)

    # region block_manager_reserve
    def reserve(self, seq, n: int) -> list[tuple[int, int]]:
        """Make room for n more positions of `seq` (a new id starts empty). Returns the copies to do
        on the pools before writing, (src_page, dst_page) pairs: at most one, the shared, partially
        filled last page (copy on write). OutOfPagesError, changing nothing, if pages are short."""
        need = self.pages_needed(seq, n)                 # validates seq and n
        if need > self.num_free:
            raise OutOfPagesError(f"reserve({seq!r}, {n}) needs {need} free pages, the pool has "
                                  f"{self.num_free} of {self.num_pages} free "
                                  f"({self.page_size} positions per page)")
        table = self._tables.setdefault(seq, [])
        length = self._lengths.setdefault(seq, 0)
        if n == 0:
            return []
        copies = []
        if length % self.page_size and table[-1] in self._keys and self._refs[table[-1]] == 1:
            self._forget(table[-1])               # named for prefix caching (ch. 6), cropped short
        if length % self.page_size and self._refs[table[-1]] > 1:   # copy on write
            old, new = table[-1], self._allocate()
            self._refs[old] -= 1                         # still >= 1: another sequence keeps it
            table[-1] = new
            copies.append((old, new))
        while len(table) < pages_for(length + n, self.page_size):
            table.append(self._allocate())
        self._lengths[seq] = length + n
        return copies

    def victim(self) -> int:
        """The free page the next allocation takes: the least recently freed (a policy
        overrides this, as chapter 6's LFU exercise does)."""
        return next(iter(self._free))

    def free_pages(self) -> list[int]:
        """The free pages, least recently freed first (a named one is cached: evicted if taken)."""
        return list(self._free)

    def _allocate(self) -> int:
        page = self.victim()
        del self._free[page]
        if page in self._keys:                # a cached page nobody holds: evict it, forget its digest
            if self.on_evict is not None:     # a lower tier keeps it first (lab/engine/tiers.py)
                self.on_evict(page, self._keys[page])
            self._forget(page)
            self.evicted += 1
        self._refs[page] = 1
        return page
    # endregion

    # region block_manager_return
    def crop(self, seq, n: int) -> list[int]:
        """Keep the first n positions of `seq`; return the pages that went back to the free list."""
        _sequence_crop(seq, n, self._lengths[self._live(seq)])
        table = self._tables[seq]
        keep = pages_for(n, self.page_size)
        if n % self.page_size and table[keep - 1] == NULL:
            raise CacheStateError(f"crop({seq!r}, {n}): page {keep - 1}, which position {n} would "
                                  "be written into, was given back (drop_pages)")
        freed = self._drop(table[keep:])
        del table[keep:]
        self._lengths[seq] = n
        return freed

    def release(self, seq) -> list[int]:
        """Give back every page of `seq` and retire its id; return the pages freed."""
        freed = self._drop(self._tables.pop(self._live(seq)))
        del self._lengths[seq]
        self._released.add(seq)
        return freed

    def fork(self, src, dst):
        """Make `dst` a new sequence that shares all of `src`'s pages and has its length."""
        self._live(src)
        if self._new_or_live(dst):
            raise CacheStateError(f"fork({src!r}, {dst!r}): {dst!r} already exists; "
                                  "fork needs a new id")
        for page in self._tables[src]:
            if page != NULL:
                self._refs[page] += 1
        self._tables[dst], self._lengths[dst] = list(self._tables[src]), self._lengths[src]

    def _forget(self, page):
        del self._cached[self._keys.pop(page)[0]]

    def _drop(self, pages) -> list[int]:  # one reference less each; free those nobody holds
        freed = []
        for page in reversed(pages):
            if page == NULL:
                continue
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free[page] = None       # at the back: the most recently freed
                freed.append(page)
        return freed
    # endregion

    def drop_pages(self, seq, indices) -> list[int]:
        """Give back the pages at block-table `indices` of `seq`, which keeps its length: the entries become
        NULL (a sliding window's past, lab.cache.hybrid). Returns the pages freed (those no other sequence
        holds); a freed named page stays cached, as after release. The partially filled last page stays."""
        table, indices = self._tables[self._live(seq)], list(indices)
        for i in indices:
            int_arg("index", i)
            if i >= len(table):
                raise CacheInputError(f"drop_pages({seq!r}): index {i}, but the block table has {len(table)} pages")
        indices = sorted(set(indices))
        if self._lengths[seq] % self.page_size and len(table) - 1 in indices:
            raise CacheStateError(f"drop_pages({seq!r}): page {len(table) - 1} is partially filled, still written")
        pages = [table[i] for i in indices]
        for i in indices:
            table[i] = NULL
        return self._drop(pages)

    # region block_manager_prefix
    def register(self, seq, index: int, digest: bytes, parent: bytes, tokens) -> bool:
        """Name the full page `index` of `seq` by `digest` (of `parent` and the page's `tokens`),
        so that later sequences starting with the same tokens take it instead of computing it.
        False when the digest already names another page, this page has a name (the first
        page keeps it) or the entry is NULL."""
        page = _registrable(self, self._live(seq), index, digest, parent, tokens)
        if page == NULL or digest in self._cached or page in self._keys:
            return False                      # NULL: given back (drop_pages), nothing to name
        self._cached[digest], self._keys[page] = page, (digest, parent, tuple(tokens))
        if self.on_name is not None:
            self.on_name(page, self._keys[page])
        return True

    def reserve_prefix(self, seq, keys) -> int:
        """Start the new sequence `seq` with the cached pages of its leading `keys`, (digest,
        parent, tokens) per full page, as far as they are cached; returns how many pages it took.
        A page is taken only if its stored parent and tokens equal the request's, so a hash
        collision is a miss, never wrong state."""
        if self._new_or_live(seq):
            raise CacheStateError(f"reserve_prefix({seq!r}): the sequence exists; "
                                  "a prefix starts a new one")
        pages = self._hits(keys)
        for page in pages:
            if self._refs[page] == 0:
                del self._free[page]          # cached but free: now owned again, O(1)
            self._refs[page] += 1
        self._tables[seq], self._lengths[seq] = pages, len(pages) * self.page_size
        return len(pages)

    def cached_prefix(self, keys) -> int:
        """Positions a new sequence would take from the cache now for `keys` (as reserve_prefix),
        changing nothing: what a scheduler or a router ranks by."""
        return len(self._hits(keys)) * self.page_size

    def _hits(self, keys) -> list[int]:
        """The pages named by the leading keys, up to the first miss."""
        return list(takewhile(lambda page: page is not None, map(self.cached, keys)))

    def cached(self, key) -> int | None:
        """The page named by `key`, (digest, parent, tokens), owned or free; None for a miss or a
        collision."""
        digest, parent, tokens = key
        page = self._cached.get(digest)
        if page is None or self._keys[page][1:] != (parent, tuple(tokens)):
            return None
        return page

    def cached_pages(self) -> int:
        """How many pages hold a registered prefix (owned, or free and evictable)."""
        return len(self._keys)

    def named_tokens(self) -> dict:
        """page -> the tokens it was registered for, for every named page (to check and teach)."""
        return {page: list(tokens) for page, (_, _, tokens) in self._keys.items()}
    # endregion

    def adopt(self, seq, pages):
        """Start the new sequence `seq` with `pages`, each a named page (`cached`) or NULL, one per page_size
        positions: a prefix hit whose pages the caller chose (lab.cache.hybrid takes only a window's)."""
        if self._new_or_live(seq):
            raise CacheStateError(f"adopt({seq!r}): the sequence exists; a prefix starts a new one")
        pages = list(pages)
        held = [page for page in pages if page != NULL]
        for page in held:
            _page_id(self, page)
            if page not in self._keys:
                raise CacheStateError(f"adopt({seq!r}): page {page} holds no named prefix")
        if len(set(held)) != len(held):
            raise CacheInputError(f"adopt({seq!r}): a page is listed twice in {pages}")
        for page in held:
            if self._refs[page] == 0:
                del self._free[page]
            self._refs[page] += 1
        self._tables[seq], self._lengths[seq] = pages, len(pages) * self.page_size

    # ---- checking ----
    def check(self):
        """Raise AssertionError naming the first broken invariant of the bookkeeping."""
        free = set(self.free_pages())
        assert free <= set(range(self.num_pages)), f"the free list holds unknown pages: {sorted(free)}"
        counted = [0] * self.num_pages
        for seq, table in self._tables.items():
            length = self._lengths[seq]
            assert len(table) == pages_for(length, self.page_size), (
                f"sequence {seq!r} holds {length} positions in {len(table)} pages, expected "
                f"{pages_for(length, self.page_size)} pages of {self.page_size}")
            held = [page for page in table if page != NULL]
            assert len(set(held)) == len(held), f"sequence {seq!r} lists a page twice: {table}"
            assert not (length % self.page_size and table[-1] == NULL), (
                f"sequence {seq!r}'s partially filled last page is NULL: {table}")
            for page in held:
                counted[page] += 1
        for page in range(self.num_pages):
            assert self._refs[page] == counted[page], (
                f"page {page} has reference count {self._refs[page]} but {counted[page]} block tables hold it")
            assert (page in free) != (counted[page] > 0 or self._kept(page)), (
                f"page {page} is {'both free and' if page in free else 'neither free nor'} owned "
                f"(reference count {counted[page]})")
        live_released = self._released & self._tables.keys()
        assert not live_released, f"released ids are live again: {live_released}"
        assert len(self._cached) == len(self._keys), "a digest names two pages, or a page two digests"
        for page, (digest, parent, tokens) in self._keys.items():
            assert self._cached.get(digest) == page, f"page {page} is registered under a digest that names another"
            assert page_digest(parent, tokens) == digest, f"page {page}'s digest is not that of its tokens"

    def _kept(self, page) -> bool:
        """Held by the prefix index itself, with no sequence holding it (a radix tree's node)."""
        return False

    def __repr__(self):
        return (f"BlockManager({self.num_free}/{self.num_pages} pages free, "
                f"page_size={self.page_size}, {len(self._tables)} sequences)")

    def _live(self, seq):
        """`seq` if it is a live sequence, else a CacheStateError that says why not."""
        _sequence_id(self, seq)
        if seq not in self._tables:
            raise CacheStateError(f"unknown sequence {seq!r}: reserve() or fork() creates one")
        return seq

    def _new_or_live(self, seq) -> bool:
        """True for a live sequence, False for an id never seen; a released id raises."""
        _sequence_id(self, seq)
        return seq in self._tables


# ---- the checks the operations run first: each raises a typed CacheError and changes nothing

def _sequence_id(bm, seq):
    """A sequence id is hashable, not a bool (True == 1 would alias sequence 1), and was never released."""
    if isinstance(seq, bool):
        raise CacheInputError(f"a sequence id must not be a bool, got {seq!r} (it would name sequence {int(seq)})")
    try:
        hash(seq)
    except TypeError:
        raise CacheInputError(f"a sequence id must be hashable, got {type(seq).__name__} {seq!r}") from None
    if seq in bm._released:
        raise CacheStateError(f"sequence {seq!r} was released: use after release (ids are never reused)")


def _page_id(bm, page):
    """A page id names a page of the pool."""
    int_arg("page", page)
    if page >= bm.num_pages:
        raise CacheInputError(f"page {page} out of range: the pool has pages 0..{bm.num_pages - 1}")


def _slot_range(bm, seq, start, n):
    """slots(seq, start, n): positions start..start+n-1 are reserved for the live sequence `seq`."""
    int_arg("start", start)
    int_arg("n", n)
    length = bm._lengths[seq]
    if start + n > length:
        raise CacheStateError(f"slots({seq!r}, {start}, {n}): positions {start}..{start + n - 1} but the "
                              f"sequence holds {length} positions; reserve() them first")


def _writable(bm, seq, slot):
    """The live sequence `seq` may write `slot`: in range, in its own unshared page, a reserved position."""
    int_arg("slot", slot)
    if slot >= bm.num_pages * bm.page_size:
        raise CacheInputError(f"slot {slot} out of range: the pool has slots 0..{bm.num_pages * bm.page_size - 1}")
    table, page, offset = bm._tables[seq], slot // bm.page_size, slot % bm.page_size
    if page not in table:
        raise CacheStateError(f"slot {slot} is in page {page}, which sequence {seq!r} does not own "
                              f"(its block table is {table})")
    if bm._refs[page] > 1:
        raise CacheStateError(f"slot {slot} is in page {page}, shared by {bm._refs[page]} sequences since a "
                              f"fork: a shared page is read-only (reserve() gives {seq!r} a private copy)")
    position = table.index(page) * bm.page_size + offset
    if position >= bm._lengths[seq]:
        raise CacheStateError(f"slot {slot} holds position {position} of {seq!r}, which holds "
                              f"{bm._lengths[seq]} positions; reserve() it first")


def _registrable(bm, seq, index, digest, parent, tokens):
    """register(): page `index` of `seq` is full, and `digest` is the digest of `parent` and its `tokens`."""
    int_arg("index", index)
    table, length = bm._tables[seq], bm._lengths[seq]
    if (index + 1) * bm.page_size > length:
        raise CacheStateError(f"register({seq!r}, {index}): page {index} is not full ({length} positions held, "
                              f"pages of {bm.page_size}); only a full page's positions are final")
    if len(tokens) != bm.page_size or page_digest(parent, tokens) != digest:
        raise CacheInputError(f"register({seq!r}, {index}): the digest is not that of the parent and the "
                              f"{len(tokens)} tokens given (a page holds {bm.page_size})")
    return table[index]


def _sequence_crop(seq, n, length):
    """crop(seq, n): 0 <= n <= the sequence's length."""
    int_arg("n", n, low=None)           # a negative n is a range error, below
    if not 0 <= n <= length:
        raise CacheStateError(f"crop({seq!r}, {n}): the sequence holds {length} positions; n must be in 0..{length}")
