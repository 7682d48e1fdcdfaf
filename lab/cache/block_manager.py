"""BlockManager: hands out the pages of a paged KV cache to sequences (host-side bookkeeping only).

The pool holds `num_pages` pages of `page_size` positions each; the tensors live elsewhere (PagedCache keeps
one pool per layer, `[num_pages, page_size, H_kv, D]`). This class only decides which page holds which
position. Each sequence owns a block table, the list of its page ids in order, so position p of a sequence
lives in page `block_table[p // page_size]` at offset `p % page_size`, which is slot
`page * page_size + offset` of the pool flattened to `[num_pages * page_size, H_kv, D]`.

Pages are counted, not owned: `fork` gives a new sequence the same block table and adds one reference to
every page, so a shared prompt is stored once. A shared page is read-only. Full pages are never written
again, so sharing them is free; the only page a sequence still writes is its last, partially filled one.
When that page is shared, `reserve` first gives the sequence a private copy (copy-on-write): it takes a
free page, puts it in the sequence's block table, drops a reference from the old one, and returns the
pair (old, new) so the caller copies the page in its pools before writing. A page whose count drops to
zero goes back to the free list.

Every operation checks everything first and changes nothing when it fails: an exhausted pool raises
OutOfPagesError and the caller (a scheduler) may preempt a sequence and try again. Sequence ids are any
hashable value the caller picks; a released id is never reused, so a stale handle fails loudly
("use after release") instead of reading another request's keys.
"""

from collections import deque

from .base import CacheError, CacheInputError, CacheStateError


class OutOfPagesError(CacheError):
    """The pool has fewer free pages than an operation needs; nothing was changed."""


def _check_int(what, n, low=0):
    if isinstance(n, bool) or not isinstance(n, int):
        raise CacheInputError(f"{what} must be an int, got {n!r}")
    if low is not None and n < low:
        raise CacheInputError(f"{what} must be at least {low}, got {n}")


def _pages_for(length, page_size):  # ceil(length / page_size)
    return -(-length // page_size)


class BlockManager:
    def __init__(self, num_pages: int, page_size: int):
        _check_int("num_pages", num_pages, low=1)
        _check_int("page_size", page_size, low=1)
        self.num_pages, self.page_size = num_pages, page_size
        self._free = deque(range(num_pages))   # free page ids: allocate from the left, return on the right
        self._refs = [0] * num_pages           # sequences whose block table holds each page
        self._tables = {}                      # seq -> [page ids], ceil(length / page_size) of them
        self._lengths = {}                     # seq -> positions reserved
        self._released = set()                 # ids that were released: never valid again

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

    def block_table(self, seq) -> list[int]:
        """A copy of the sequence's page ids, in position order."""
        return list(self._tables[self._live(seq)])

    def owners(self, page: int) -> list:
        """The live sequences whose block table holds `page` (for debugging and teaching; it scans them all)."""
        _check_int("page", page)
        if page >= self.num_pages:
            raise CacheInputError(f"page {page} out of range: the pool has pages 0..{self.num_pages - 1}")
        return [seq for seq, table in self._tables.items() if page in table]

    def pages_needed(self, seq, n: int) -> int:
        """How many free pages `reserve(seq, n)` would take, a copy-on-write page included."""
        _check_int("n", n)
        seq_exists = self._new_or_live(seq)
        if not seq_exists or n == 0:
            return _pages_for(n, self.page_size)
        length, table = self._lengths[seq], self._tables[seq]
        copy = 1 if length % self.page_size and self._refs[table[-1]] > 1 else 0  # a shared, partial last page
        return copy + _pages_for(length + n, self.page_size) - len(table)

    def slots(self, seq, start: int, n: int) -> list[int]:
        """The pool slots (page * page_size + offset) of positions start .. start+n-1 of `seq`."""
        _check_int("start", start)
        _check_int("n", n)
        length, table, P = self._lengths[self._live(seq)], self._tables[seq], self.page_size
        if start + n > length:
            raise CacheStateError(f"slots({seq!r}, {start}, {n}): positions {start}..{start + n - 1} but the "
                                  f"sequence holds {length} positions; reserve() them first")
        return [table[p // P] * P + p % P for p in range(start, start + n)]

    def check_writable(self, seq, slot: int):
        """Raise CacheStateError unless `seq` may write `slot`: its own, unshared page, a reserved position."""
        _check_int("slot", slot)
        if slot >= self.num_pages * self.page_size:
            raise CacheInputError(f"slot {slot} out of range: the pool has slots "
                                  f"0..{self.num_pages * self.page_size - 1}")
        table, page, offset = self._tables[self._live(seq)], slot // self.page_size, slot % self.page_size
        if page not in table:
            raise CacheStateError(f"slot {slot} is in page {page}, which sequence {seq!r} does not own "
                                  f"(its block table is {table})")
        if self._refs[page] > 1:
            raise CacheStateError(f"slot {slot} is in page {page}, shared by {self._refs[page]} sequences since a "
                                  f"fork: a shared page is read-only (reserve() gives {seq!r} a private copy)")
        position = table.index(page) * self.page_size + offset
        if position >= self._lengths[seq]:
            raise CacheStateError(f"slot {slot} holds position {position} of {seq!r}, which holds "
                                  f"{self._lengths[seq]} positions; reserve() it first")

    # ---- changing ----
    def reserve(self, seq, n: int) -> list[tuple[int, int]]:
        """Make room for n more positions of `seq` (a new id starts empty; reserve(new_id, 0) creates it).

        Returns the copy-on-write copies to perform on the pools before writing, as (src_page, dst_page)
        pairs (at most one: the shared, partially filled last page). Raises OutOfPagesError, changing
        nothing, when the free pages do not suffice.
        """
        need = self.pages_needed(seq, n)         # validates seq and n
        if need > len(self._free):
            raise OutOfPagesError(f"reserve({seq!r}, {n}) needs {need} free pages, the pool has {len(self._free)} "
                                  f"of {self.num_pages} free ({self.page_size} positions per page)")
        table = self._tables.setdefault(seq, [])
        length = self._lengths.setdefault(seq, 0)
        if n == 0:
            return []
        copies = []
        if length % self.page_size and self._refs[table[-1]] > 1:   # copy on write
            old, new = table[-1], self._allocate()
            self._refs[old] -= 1                 # still >= 1: another sequence keeps it
            table[-1] = new
            copies.append((old, new))
        while len(table) < _pages_for(length + n, self.page_size):
            table.append(self._allocate())
        self._lengths[seq] = length + n
        return copies

    def crop(self, seq, n: int) -> list[int]:
        """Keep the first n positions of `seq`; return the pages that went back to the free list."""
        _check_int("n", n, low=None)            # a negative n is a range error, below
        length = self._lengths[self._live(seq)]
        if not 0 <= n <= length:
            raise CacheStateError(f"crop({seq!r}, {n}): the sequence holds {length} positions; "
                                  f"n must be in 0..{length}")
        table = self._tables[seq]
        keep = _pages_for(n, self.page_size)
        freed = self._drop(table[keep:])
        del table[keep:]
        self._lengths[seq] = n
        return freed

    def release(self, seq) -> list[int]:
        """Give back every page of `seq` and retire its id; return the pages that went back to the free list."""
        self._live(seq)
        freed = self._drop(self._tables.pop(seq))
        del self._lengths[seq]
        self._released.add(seq)
        return freed

    def fork(self, src, dst):
        """Make `dst` a new sequence that shares all of `src`'s pages and has its length."""
        self._live(src)
        if self._new_or_live(dst):
            raise CacheStateError(f"fork({src!r}, {dst!r}): {dst!r} already exists; fork needs a new id")
        for page in self._tables[src]:
            self._refs[page] += 1
        self._tables[dst] = list(self._tables[src])
        self._lengths[dst] = self._lengths[src]

    # ---- checking ----
    def check(self):
        """Raise AssertionError naming the first broken invariant of the bookkeeping."""
        free = set(self._free)
        assert len(free) == len(self._free), f"the free list holds a page twice: {sorted(self._free)}"
        assert free <= set(range(self.num_pages)), f"the free list holds unknown pages: {sorted(free)}"
        counted = [0] * self.num_pages
        for seq, table in self._tables.items():
            length = self._lengths[seq]
            assert len(table) == _pages_for(length, self.page_size), (
                f"sequence {seq!r} holds {length} positions in {len(table)} pages, expected "
                f"{_pages_for(length, self.page_size)} pages of {self.page_size}")
            assert len(set(table)) == len(table), f"sequence {seq!r} lists a page twice: {table}"
            for page in table:
                counted[page] += 1
        for page in range(self.num_pages):
            assert self._refs[page] == counted[page], (
                f"page {page} has reference count {self._refs[page]} but {counted[page]} block tables hold it")
            assert (page in free) != (counted[page] > 0), (
                f"page {page} is {'both free and' if page in free else 'neither free nor'} owned "
                f"(reference count {counted[page]})")
        assert not self._released & self._tables.keys(), (
            f"released ids are live again: {self._released & self._tables.keys()}")

    def __repr__(self):
        return (f"BlockManager({self.num_free}/{self.num_pages} pages free, page_size={self.page_size}, "
                f"{len(self._tables)} sequences)")

    # ---- helpers ----
    def _allocate(self) -> int:
        page = self._free.popleft()
        self._refs[page] = 1
        return page

    def _drop(self, pages) -> list[int]:  # one reference less to each page; free those nobody holds
        freed = []
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0:
                self._free.append(page)
                freed.append(page)
        return freed

    def _check_id(self, seq):
        try:
            hash(seq)
        except TypeError:
            raise CacheInputError(f"a sequence id must be hashable, got {type(seq).__name__} {seq!r}") from None
        if seq in self._released:
            raise CacheStateError(f"sequence {seq!r} was released: use after release (ids are never reused)")

    def _live(self, seq):
        """`seq` if it is a live sequence, else a CacheStateError that says why not."""
        self._check_id(seq)
        if seq not in self._tables:
            raise CacheStateError(f"unknown sequence {seq!r}: reserve() or fork() creates one")
        return seq

    def _new_or_live(self, seq) -> bool:
        """True for a live sequence, False for an id never seen; a released id raises."""
        self._check_id(seq)
        return seq in self._tables
