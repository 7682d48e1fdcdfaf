"""RadixCache: token-granular prefix caching over a pool of KV slots (SGLang's RadixAttention idea, chapter 6).

A radix tree whose edges are runs of token ids; each node holds the slots (positions of the pool flattened to
`[num_slots, H_kv, D]`) of its run, and a sequence is the path from a root to a node. Where a new sequence leaves a
run part way, the node is split in two, which is why the unit is a slot, not a page; RadixBlockManager's pages of P
are tokens of the tree, one page's ids each.

A request holds its prefix with a handle (from `match` or `insert`) until `release`: a handle locks its node and
every ancestor, and a locked node is never evicted. Eviction takes unlocked leaves, least recently matched or
inserted first, as `allocate` needs room. `extra` (the state identity and the salt, as in `block_hashes`) picks the
root, so two models or two salts never share a node. Every operation checks its arguments first and changes nothing
when it fails, raising a typed CacheError.
"""

import heapq
import itertools
from collections import deque

from .block_manager import BlockManager, common_length
from .checks import int_arg
from .errors import CacheInputError, CacheStateError, OutOfPagesError

__all__ = ["RadixCache", "RadixBlockManager"]


class _Node:
    _uids = itertools.count()

    def __init__(self, key=(), slots=(), parent=None, extra=None):
        self.key, self.slots, self.parent = tuple(key), list(slots), parent  # the run, its slots
        self.children = {}                    # first token of the child's run -> child
        self.lock = 0                         # live handles at this node or below it
        self.last_used = 0                    # clock of the last match or insert through this node
        self.extra, self.uid = extra, next(self._uids)   # extra: a root's identity; uid breaks LRU ties


class RadixCache:
    """A request's life, as a scheduler drives it:

        n, cached, h = cache.match(ids, extra)      # the longest cached prefix, locked by h
        new = cache.allocate(len(ids) - n)          # room for the rest, evicting LRU leaves if needed
        ...                                         # the model writes ids[n:] into slots `new`
        h2 = cache.insert(ids, cached + new, extra) # cached for the next requests, locked by h2
        cache.release(h)                            # and release(h2) when the request ends

    Every slot is in exactly one place: the free queue, one node of the tree, or "out" (taken by `allocate`, until
    `insert` or `free`). The other invariants are `check`'s."""

    def __init__(self, num_slots: int):
        int_arg("num_slots", num_slots, low=1)
        self.num_slots = num_slots
        self._unused = deque(range(num_slots))   # free slots, taken from the front, returned at the back
        self._out = set()                        # allocated, not yet inserted or freed
        self._roots = {}                         # extra -> root (a root holds no tokens)
        self._handles = {}                       # live handle -> the node it locks
        self._issued, self._clock = 0, 0         # handles are 1, 2, ...; the clock orders uses (LRU)
        self.evicted = 0                         # slots evicted so far
        self._cached, self._evictable = 0, 0     # slots in nodes, and in unlocked ones: kept as they change

    # ---- looking ----
    @property
    def num_free(self) -> int:
        return len(self._unused)

    def cached_tokens(self) -> int:
        """Slots held by the tree (locked or evictable)."""
        return self._cached

    def evictable_tokens(self) -> int:
        """Slots in unlocked nodes (an unlocked node's subtree is unlocked, so all can be evicted);
        a running count, so a scheduler may ask at every step."""
        return self._evictable

    def is_out(self, slot: int) -> bool:
        """True for a slot `allocate` gave out and no `insert` or `free` has taken back."""
        return slot in self._out

    def prefix_length(self, ids, extra=()) -> int:
        """How many leading tokens of `ids` are cached, changing nothing (no lock, no split, no LRU touch):
        what a scheduler ranks waiting requests by."""
        root = self._roots.get(_extra(extra))
        return 0 if root is None else len(_cached_slots(root, _ids(ids)))

    def tree(self, extra=()) -> dict:
        """The subtree of `extra` as nested dicts, run -> subtree: {(1, 2, 3): {(4,): {}, (5, 6): {}}}."""
        def show(node):
            return {child.key: show(child) for child in node.children.values()}
        return show(self._roots.get(_extra(extra), _Node()))

    # ---- serving a request ----
    def match(self, ids, extra=()) -> tuple[int, list[int], int]:
        """(n, slots, handle): the longest cached prefix of `ids`, n tokens in `slots`; the handle locks
        them until `release`. A match ending inside a run splits its node there."""
        ids, extra = _ids(ids), _extra(extra)
        root = self._roots.get(extra, _Node(extra=extra))   # an unknown extra: an empty tree, not stored
        node = self._descend(root, ids)
        slots = _path_slots(node)
        return len(slots), slots, self._lock(node)

    def insert(self, ids, slots, extra=()) -> int:
        """Add a computed sequence: `slots[i]` holds the keys and values of `ids[i]`. The cached prefix is
        reused: a slot given there that is not the tree's own (computed twice) goes back to the free queue.
        The other slots must be out (from `allocate`). Returns a handle that locks the whole sequence."""
        ids, extra = _ids(ids), _extra(extra)
        slots = list(slots)
        for s in slots:
            int_arg("slot", s)
        if len(slots) != len(ids):
            raise CacheInputError(f"insert: {len(ids)} ids but {len(slots)} slots; one slot per token")
        if len(set(slots)) != len(slots):
            raise CacheInputError(f"insert: a slot is listed twice in {slots}")
        root = self._roots.get(extra, _Node(extra=extra))
        cached = _cached_slots(root, ids)
        for i, s in enumerate(slots):
            if not (i < len(cached) and s == cached[i]) and s not in self._out:
                raise CacheStateError(f"insert: slot {s} (token {i}) was not allocated: it is free or "
                                      "holds other tokens of the tree; allocate() new slots")
        if ids:
            self._roots[extra] = root
        node, n = self._descend(root, ids), len(cached)   # descend splits where the prefix ends in a run
        if n < len(ids):
            node = self._add_child(node, ids[n:], slots[n:])
        duplicates = [s for s, c in zip(slots, cached, strict=False) if s != c]
        self._out -= set(duplicates) | set(slots[n:])
        self._unused.extend(duplicates)
        return self._lock(node)

    def extend(self, handle: int, ids, slots) -> int | None:
        """Add `ids`, computed into `slots` (from `allocate`), right after the sequence `handle` locks, without
        walking down from the root: the way a running request caches what each step computes. Returns the
        handle that now locks the longer sequence (`handle` is released), or None, changing nothing, when
        the tree already holds a continuation starting with ids[0] (then `insert` the whole sequence)."""
        node, ids, slots = self._node_of(handle), _ids(ids), list(slots)
        if len(slots) != len(ids) or not self._out.issuperset(slots) or len(set(slots)) != len(slots):
            raise CacheStateError(f"extend: {len(ids)} ids need as many distinct slots from allocate(), "
                                  f"got {slots}")
        if not ids:
            return handle
        if ids[0] in node.children or node.parent is None:
            return None
        self._clock += 1
        self._out.difference_update(slots)
        top = node
        if not node.children and node.lock == 1:          # a leaf only this request holds: the run grows
            node.key, node.slots = node.key + ids, node.slots + slots
            self._cached += len(ids)
        else:                                            # others share it, or go further: a new leaf
            handle, old = self._lock(self._add_child(node, ids, slots)), handle
            self.release(old)
        while top.parent is not None:                    # used now, and so is every node above it
            top.last_used = self._clock
            top = top.parent
        return handle

    def share(self, handle: int) -> int:
        """A second handle that locks what `handle` locks (a forked request's), released on its own."""
        return self._lock(self._node_of(handle))

    def release(self, handle: int):
        """Unlock what `handle` held; its nodes become evictable once no other handle holds them."""
        node = self._node_of(handle)
        del self._handles[handle]
        while node.parent is not None:
            node.lock -= 1
            if node.lock == 0:
                self._evictable += len(node.slots)
            node = node.parent

    # ---- slots ----
    def allocate(self, n: int) -> list[int]:
        """Take n free slots, evicting LRU leaves if needed. OutOfPagesError, changing nothing, when the
        free and evictable slots together are fewer than n."""
        int_arg("n", n)
        if n > self.num_free + self.evictable_tokens():
            raise OutOfPagesError(f"allocate({n}): {self.num_free} slots free and {self.evictable_tokens()} "
                                  f"evictable of {self.num_slots}; the rest are locked or allocated")
        if n > self.num_free:
            self.evict(n - self.num_free)
        slots = [self._unused.popleft() for _ in range(n)]
        self._out.update(slots)
        return slots

    def free(self, slots):
        """Give back allocated slots that were never inserted (an aborted request)."""
        slots = list(slots)
        for s in slots:
            int_arg("slot", s)
        if len(set(slots)) != len(slots) or not self._out.issuperset(slots):
            raise CacheStateError(f"free({slots}): each slot must be allocated, not inserted, and listed once")
        self._out -= set(slots)
        self._unused.extend(slots)

    def evict(self, n: int) -> list[int]:
        """Free at least n slots (fewer if the unlocked ones do not suffice) by removing unlocked leaves,
        least recently used first; a parent left childless and unlocked becomes a leaf in turn."""
        int_arg("n", n)
        leaves = [(x.last_used, x.uid, x) for x in self._nodes() if not x.children and x.lock == 0]
        heapq.heapify(leaves)
        freed = []
        while len(freed) < n and leaves:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            del parent.children[node.key[0]]
            freed += node.slots
            self._cached -= len(node.slots)
            self._evictable -= len(node.slots)
            if parent.parent is None and not parent.children:
                del self._roots[parent.extra]            # an empty subtree: forget its extra
            elif parent.parent is not None and not parent.children and parent.lock == 0:
                heapq.heappush(leaves, (parent.last_used, parent.uid, parent))
        self._unused.extend(freed)
        self.evicted += len(freed)
        return freed

    # ---- checking ----
    def check(self):
        """Raise AssertionError naming the first broken invariant."""
        where = [*self._unused, *self._out, *(s for x in self._nodes() for s in x.slots)]
        assert sorted(where) == list(range(self.num_slots)), "a slot is lost, or in two places (free, out, nodes)"
        held = {}                                        # node uid -> live handles at it or below it
        for node in self._handles.values():
            while node.parent is not None:
                held[node.uid] = held.get(node.uid, 0) + 1
                node = node.parent
        for extra, root in self._roots.items():
            assert root.parent is None and root.extra == extra and not root.key, f"bad root for {extra!r}"
            assert root.children, f"the root of {extra!r} is empty but kept"
        for node in self._nodes():
            assert node.key and len(node.key) == len(node.slots), f"node {node.key}: empty or slots != tokens"
            assert node.parent.children.get(node.key[0]) is node, f"node {node.key}: not its parent's child"
            assert node.lock == held.get(node.uid, 0) >= 0, (
                f"node {node.key}: lock {node.lock}, but {held.get(node.uid, 0)} handles at it or below it")
            assert node.last_used <= node.parent.last_used or node.parent.parent is None, (
                f"node {node.key} was used after its parent")
        nodes = list(self._nodes())
        assert self._cached == sum(len(x.slots) for x in nodes), "the running count of cached slots is off"
        assert self._evictable == sum(len(x.slots) for x in nodes if x.lock == 0), (
            "the running count of evictable slots is off")

    def __repr__(self):
        return (f"RadixCache({self.num_free}/{self.num_slots} slots free, {self.cached_tokens()} cached, "
                f"{len(self._out)} allocated, {len(self._handles)} handles)")

    # ---- the tree ----
    def _nodes(self):
        """Every node but the roots, each after its parent."""
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    # region radix_descend
    def _descend(self, root, ids):
        """The node whose path is the longest cached prefix of `ids`, touched for LRU all the way down;
        where the prefix ends inside a run, that node is split there first."""
        self._clock += 1
        node, i = root, 0
        while i < len(ids) and ids[i] in node.children:
            child = node.children[ids[i]]
            k = common_length(child.key, ids[i:])
            if k < len(child.key):
                child = self._split(child, k)
            node, i = child, i + k
            node.last_used = self._clock
        return node

    def _split(self, node, k):
        """Cut `node`'s run after k tokens: a new parent holds the first k, `node` keeps the rest."""
        top = _Node(node.key[:k], node.slots[:k], parent=node.parent)
        top.lock, top.last_used = node.lock, node.last_used   # the same handles are below it
        node.parent.children[top.key[0]] = top
        node.key, node.slots, node.parent = node.key[k:], node.slots[k:], top
        top.children[node.key[0]] = node
        return top
    # endregion

    def _add_child(self, node, ids, slots):
        """A new unlocked leaf below `node` holding ids in slots, used now."""
        node.children[ids[0]] = child = _Node(ids, slots, parent=node)
        child.last_used = self._clock
        self._cached += len(ids)
        self._evictable += len(ids)
        return child

    def _lock(self, node) -> int:
        self._issued += 1
        self._handles[self._issued] = node
        while node.parent is not None:
            if node.lock == 0:
                self._evictable -= len(node.slots)
            node.lock += 1
            node = node.parent
        return self._issued

    def _node_of(self, handle):
        int_arg("handle", handle, low=None)
        if 1 <= handle <= self._issued and handle not in self._handles:
            raise CacheStateError(f"handle {handle} was released already (release twice)")
        if handle not in self._handles:
            raise CacheStateError(f"unknown handle {handle}: match() and insert() return handles")
        return self._handles[handle]


def _cached_slots(root, ids) -> list[int]:
    """The slots of the longest cached prefix of `ids` below `root`, changing nothing."""
    node, slots = root, []
    while len(slots) < len(ids) and ids[len(slots)] in node.children:
        node = node.children[ids[len(slots)]]
        k = common_length(node.key, ids[len(slots):])
        slots += node.slots[:k]
        if k < len(node.key):
            break
    return slots


def _path_slots(node) -> list[int]:
    """The slots of the path from the root to `node`."""
    runs = []
    while node is not None:
        runs.append(node.slots)
        node = node.parent
    return [s for run in reversed(runs) for s in run]


def _ids(ids) -> tuple:
    """Token ids: a list, tuple or tensor of ints >= 0; in a tree of pages, tuples of them (a page's ids)."""
    ids = ids.tolist() if hasattr(ids, "tolist") else ids
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise CacheInputError(f"ids must be a sequence of ints, got {type(ids).__name__}")
    ids = tuple(ids)
    bad = [t for t in ids if not (_token(t) or isinstance(t, tuple) and t and all(map(_token, t)))]
    if bad:
        raise CacheInputError(f"token ids must be ints >= 0, got {bad[0]!r}")
    return ids


def _token(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0


def _extra(extra) -> tuple:
    """The identity a subtree is keyed by: a tuple of hashable values (a StateIdentity, a salt)."""
    extra = tuple(extra)
    try:
        hash(extra)
    except TypeError:
        raise CacheInputError(f"extra must hold hashable values, got {extra!r}") from None
    return extra


class RadixBlockManager(BlockManager):
    """The serving engine's radix prefix cache (`ServingEngine(..., prefix_caching="radix")`): a BlockManager whose
    free pages and cached prefixes a RadixCache (`tree`) keeps, each slot of the tree a page. With pages of P > 1
    each token of the tree is a whole page's ids (as in SGLang): splits fall on page boundaries, and a partly
    filled last page is never cached.

    Every page is free (the tree's free queue), cached (in a node) or out (allocated, not cached yet). A sequence
    starts with `match`, grows with `reserve` and puts its full pages in the tree with `cache`; where the tree
    already held them, the sequence's pages are swapped for the tree's, so no prefix is held twice. Tree pages are
    full and never written again, so sharing them needs no copy on write. Not here: chapter 6's page names
    (`register`, `reserve_prefix`, `adopt`) and `drop_pages`."""

    def __init__(self, num_pages: int, page_size: int = 1):
        super().__init__(num_pages, page_size)
        self.tree = RadixCache(num_pages)
        self._free.clear()                       # the tree's free queue is the free list
        self._handles = {}                       # seq -> the handle that locks its tree pages
        self._in_tree = {}                       # seq -> (extra, ids) its handle locks, for cache() to extend

    @property
    def num_free(self) -> int:                   # free, or cached in unlocked nodes (evicted on demand)
        return self.tree.num_free + self.tree.evictable_tokens()

    def cached_pages(self) -> int:
        return self.tree.cached_tokens()

    def cached_prefix(self, ids, extra=()) -> int:
        """Positions of `ids` a new sequence would take from the tree now, changing nothing."""
        return self.tree.prefix_length(self._pages(ids), extra) * self.page_size

    def match(self, seq, ids, extra=()) -> int:
        """Start the new sequence `seq` with the tree's pages of the longest cached prefix of `ids` (under
        `extra`, the state identity), in whole pages; returns how many pages it took."""
        if self._new_or_live(seq):
            raise CacheStateError(f"match({seq!r}): the sequence exists; a prefix starts a new one")
        ids = _ids(ids)
        n, pages, handle = self.tree.match(self._pages(ids), extra)
        for page in pages:
            self._refs[page] += 1
        self._tables[seq], self._lengths[seq], self._handles[seq] = pages, n * self.page_size, handle
        self._in_tree[seq] = (_extra(extra), ids[:n * self.page_size])
        return n

    def reserve(self, seq, n: int) -> list:
        """BlockManager.reserve, the tree first evicting what the step needs, at once."""
        need = self.pages_needed(seq, n)             # validates seq and n
        if need <= self.num_free:                    # else BlockManager.reserve refuses, changing nothing
            self.tree.evict(max(0, need - self.tree.num_free))
            self.evicted = self.tree.evicted
        return super().reserve(seq, n)

    def _allocate(self) -> int:
        page, = self.tree.allocate(1)
        self._refs[page] = 1
        return page

    def cache(self, seq, ids, extra=()):
        """Put the first len(ids) positions of `seq` (whole pages), which hold the keys and values of `ids`,
        in the tree; the sequence keeps them locked until `release`."""
        table, extra, P = self._tables[self._live(seq)], _extra(extra), self.page_size
        ids = tuple(ids.tolist() if hasattr(ids, "tolist") else ids)   # checked where new: extend, insert
        if len(ids) > self._lengths[seq] or len(ids) % P:
            raise CacheInputError(f"cache({seq!r}): {len(ids)} ids, but the sequence holds {self._lengths[seq]} "
                                  f"and the tree takes whole pages of {P}")
        was, done = self._in_tree.get(seq, (None, ()))
        new = table[len(done) // P:len(ids) // P]     # its pages past what it cached (a fork's may be cached)
        if was == extra and ids[:len(done)] == done and len(done) <= len(ids) and all(map(self.tree.is_out, new)):
            handle = self.tree.extend(self._handles[seq], self._pages(ids[len(done):]), new)
            if handle is not None:                   # grown from its own node, not from the root
                self._handles[seq], self._in_tree[seq] = handle, (extra, ids)
                return
        pages = self._pages(ids)
        handle = self.tree.insert(pages, table[:len(pages)], extra)
        _, held, locked = self.tree.match(pages, extra)     # the tree's pages, ours or earlier ones
        self.tree.release(handle)
        for i, (mine, tree) in enumerate(zip(table, held, strict=False)):
            if mine != tree:                         # computed twice: insert took ours back, use the tree's,
                for other in self._tables.values():  # in every table that holds ours (its forks, same index)
                    if i < len(other) and other[i] == mine:
                        self._refs[mine] -= 1
                        self._refs[tree] += 1
                        other[i] = tree
        if seq in self._handles:
            self.tree.release(self._handles[seq])
        self._handles[seq], self._in_tree[seq] = locked, (extra, ids)

    def _pages(self, ids) -> tuple:
        """The tree's tokens for `ids`: the ids themselves for pages of one position, else one tuple per
        whole page (a partly filled last page is left out)."""
        P = self.page_size
        return tuple(ids) if P == 1 else tuple(tuple(ids[i:i + P]) for i in range(0, len(ids) - len(ids) % P, P))

    def release(self, seq) -> list[int]:
        freed = super().release(seq)
        if seq in self._handles:
            self.tree.release(self._handles.pop(seq))
            del self._in_tree[seq]
        return freed

    def _drop(self, pages) -> list[int]:             # a page nobody holds goes back free unless the tree keeps it
        freed = []
        for page in reversed(pages):
            self._refs[page] -= 1
            if self._refs[page] == 0 and self.tree.is_out(page):
                self.tree.free([page])
                freed.append(page)
        return freed

    def fork(self, src, dst):
        """BlockManager.fork; the tree's pages `src` holds are locked for `dst` as well (a handle of its own),
        so that neither releasing first lets the tree evict what the other still reads."""
        super().fork(src, dst)
        if src in self._handles:
            self._handles[dst], self._in_tree[dst] = self.tree.share(self._handles[src]), self._in_tree[src]

    def _refuse(self, *args, **kwargs):
        raise CacheStateError("a RadixBlockManager shares pages through its tree (match, cache), not by "
                              "page names or dropped pages")

    register = reserve_prefix = adopt = drop_pages = _refuse

    def free_pages(self) -> list[int]:
        return list(self.tree._unused)

    def _kept(self, page) -> bool:               # in a node of the tree: neither free nor out
        return not self.tree.is_out(page) and page not in self.tree._unused

    def check(self):
        """Raise AssertionError naming the first broken invariant, the tree's included."""
        self.tree.check()
        super().check()
        for seq, handle in self._handles.items():
            assert seq in self._tables, f"released sequence {seq!r} still holds handle {handle}"

    def __repr__(self):
        return (f"RadixBlockManager({self.tree.num_free}/{self.num_pages} pages free, "
                f"{self.tree.cached_tokens()} cached, {len(self._tables)} sequences)")
