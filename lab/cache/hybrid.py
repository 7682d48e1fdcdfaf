"""HybridBlockManager: page bookkeeping for a model whose layers keep different positions (host-side only).

Chapter 10 explains hybrid models. Layers are grouped by their rule ("full" reads every position, "local" the last
`window` and the first `sinks`), as in vLLM's hybrid KV cache manager; each group has its own pool and BlockManager
(page 3 of "full" is not page 3 of "local").

The query at position p reads keys p - window + 1 .. p and the sinks 0 .. sinks - 1, so once a sequence has length
L, a page whose positions are all below L + 1 - window and hold no sink is read by no query to come. Before a
sequence grows, a local group gives such pages back (a page shared since a fork stays with the other sequence) and
their entries become NULL: at most `most_pages` per sequence. A second reservation in one step (a draft's
lookahead) passes `first_query`, the first query still to run, and the window is judged from there.

What the window gave back is gone: crop may go back only to a length whose next query finds its window still held,
and a prefix hit takes, in a local group, only the pages the first query after the prefix reads (vLLM's rule).

Every operation applies to every group or to none: the groups hold the same sequences at the same lengths, and
every group's page counts are checked before any changes.
"""

from .block_manager import NULL, BlockManager, _sequence_crop, pages_for
from .checks import int_arg
from .errors import CacheInputError, CacheStateError, OutOfPagesError
from .hashing import page_keys
from .radix import RadixBlockManager

__all__ = ["HybridBlockManager", "NULL"]


class HybridBlockManager:
    def __init__(self, page_size: int, groups: dict, layers: dict | None = None, index: str | None = None,
                 extra=()):
        """groups: name -> (num_pages, window, sinks), window 0 for a full-attention group; layers: name -> the
        cache layers that keep their keys in that group's pool (for_model fills it in). index: the prefix index,
        None, "hash" (chapter 6's page names) or "radix" (chapter 11: one full group only); pages are named under
        `extra` (the state identity, set by whoever computes them)."""
        int_arg("page_size", page_size, low=1)
        if not isinstance(groups, dict) or not groups:
            raise CacheInputError(f"groups must be a non-empty dict name -> (num_pages, window, sinks), got {groups!r}")
        if index not in (None, "hash", "radix"):
            raise CacheInputError(f'index is None, "hash" or "radix", got {index!r}')
        self.page_size, self.index, self.extra = page_size, index, tuple(extra)
        self._rules = {name: _rule(name, spec) for name, spec in groups.items()}   # name -> (window, sinks)
        if index == "radix" and (len(groups) > 1 or any(w for w, _ in self._rules.values())):
            raise CacheInputError("a radix tree keeps every position of a prefix: one full group only (local "
                                  "layers give pages back)")
        kind = RadixBlockManager if index == "radix" else BlockManager
        self._bms = {name: kind(groups[name][0], page_size) for name in groups}
        unknown = set(layers or {}) - set(groups)
        if unknown:
            raise CacheInputError(f"layers names unknown groups {sorted(map(repr, unknown))}")
        self._layers = {name: list((layers or {}).get(name, ())) for name in groups}

    @classmethod
    def for_model(cls, config, num_pages: int, page_size: int, local_pages: int | None = None,
                  index: str | None = None):
        """A "full" group for the model's global cache layers (num_pages pages) and a "local" group for its
        sliding-window ones (local_pages, num_pages by default), each only if the model has such layers."""
        layers = {}
        for i in range(config.kv_layout[0]):
            layers.setdefault("local" if config.window_of(i)[0] else "full", []).append(i)
        rules = {config.window_of(i) for i in layers.get("local", ())}
        if len(rules) > 1:
            raise CacheInputError(f"the local layers have different (window, sinks): {sorted(rules)}")
        if local_pages is not None and not rules:
            raise CacheInputError(f"local_pages sizes the pages of local layers; {config.name or config.arch} has none")
        groups = {"full": (num_pages, 0, 0)} if "full" in layers else {}
        if rules:
            groups["local"] = (num_pages if local_pages is None else local_pages, *rules.pop())
        return cls(page_size, groups, layers, index)

    # ---- looking ----
    @property
    def groups(self) -> list[str]:
        return list(self._bms)

    def rule(self, group) -> tuple[int, int]:
        """(window, sinks) of `group`; (0, 0) for a full group."""
        return self._rules[self._name(group)]

    def layers(self, group) -> list[int]:
        """The cache layers whose keys and values live in `group`'s pool."""
        return list(self._layers[self._name(group)])

    def manager(self, group) -> BlockManager:
        """The group's BlockManager, to read (slots, owners, named_tokens); change it only through this class."""
        return self._bms[self._name(group)]

    def block_table(self, seq, group=None) -> list[int]:
        """A copy of the sequence's page ids in `group` (the first by default), NULL: given back."""
        return self.manager(group or self.groups[0]).block_table(seq)

    def slots(self, seq, start: int, n: int, group=None) -> list[int]:
        """The pool slots of positions start .. start + n - 1 of `seq` in `group` (the first by default)."""
        return self.manager(group or self.groups[0]).slots(seq, start, n)

    @property
    def num_free(self) -> dict:
        """group -> its free pages (with a radix index, the evictable cached ones too)."""
        return {group: bm.num_free for group, bm in self._bms.items()}

    @property
    def num_pages(self) -> dict:
        """group -> the pages of its pool."""
        return {group: bm.num_pages for group, bm in self._bms.items()}

    def cached_pages(self) -> int:
        """Pages that hold a cached prefix, every group's."""
        return sum(bm.cached_pages() for bm in self._bms.values())

    def held_pages(self, group, seq=None) -> int:
        """Pages of `group` that some sequence holds, or that `seq` holds (its non-NULL entries)."""
        bm = self.manager(group)
        if seq is None:
            return bm.num_pages - bm.num_free
        return sum(page != NULL for page in bm.block_table(seq))

    def __contains__(self, seq) -> bool:
        return seq in self._first

    def sequences(self) -> list:
        return self._first.sequences()

    def length(self, seq) -> int:
        return self._first.length(seq)

    def outside_window(self, group, length: int) -> range:
        """Block-table indices that no query at position `length` or later reads in `group`: every
        position of the page is below length + 1 - window, and it is no sink page (none in a full
        group)."""
        window, sinks = self.rule(group)
        if not window:
            return range(0)
        return range(pages_for(sinks, self.page_size), (length + 1 - window) // self.page_size)

    def pages_needed(self, seq, n: int, first_query: int | None = None) -> dict:
        """group -> free pages reserve(seq, n) takes from it, less those the window gives back first
        (negative when the window gives back more than the step takes)."""
        need = {}
        for group, bm in self._bms.items():
            take = bm.pages_needed(seq, n)              # validates seq and n
            table = bm.block_table(seq) if seq in bm else []
            need[group] = take - sum(bm.refs(table[i]) == 1 for i in self._past(group, seq, first_query))
        return need

    def room(self, seq, first_query: int | None = None, spare: int = 0) -> int:
        """The most L that reserve(seq, L - length) finds pages for in every group now, `spare`
        pages of each kept back (a copy-on-write page aside); `seq` live, or new (length 0)."""
        return min(self._rooms(seq, first_query, spare).values())

    def fit(self, seq, n: int, first_query: int | None = None, spare: int = 0) -> int:
        """How many of n more positions `seq` may reserve now, `spare` pages of each group kept back: all n or 0 in
        a full group (the prompt needs those pages anyway: better to wait than to start and be preempted), as many
        as a window's group holds (it may hold less than a chunk, never less than a step of one position)."""
        length, rooms = self.length(seq) if seq in self else 0, self._rooms(seq, first_query, spare)
        if any(rooms[g] < length + n for g in self._bms if not self.rule(g)[0]):
            return 0
        return max(0, min([n] + [rooms[g] - length for g in self._bms if self.rule(g)[0]]))

    def _rooms(self, seq, first_query, spare) -> dict:
        int_arg("spare", spare)
        need = self.pages_needed(seq, 0, first_query)           # minus the pages the window gives back
        return {group: ((len(bm.block_table(seq)) if seq in bm else 0) + bm.num_free - spare - need[group])
                * self.page_size for group, bm in self._bms.items()}

    def most_pages(self, group, n: int = 1) -> int | None:
        """The most pages of a local `group` one sequence holds right after reserve(seq, n), however long
        it is: ceil((window - 1 + n) / page_size) + 1 + the sink pages. None for a full group (every page)."""
        int_arg("n", n)
        window, sinks = self.rule(group)
        if not window:
            return None
        return pages_for(window - 1 + n, self.page_size) + 1 + pages_for(sinks, self.page_size)

    @property
    def evicted(self) -> int:
        """Named pages reused for other positions, every group's (BlockManager.evicted)."""
        return sum(bm.evicted for bm in self._bms.values())

    # ---- changing: every group or none ----
    def reserve(self, seq, n: int, first_query: int | None = None) -> dict:
        """Make room for n more positions of `seq` (a new id starts empty) in every group, once the
        window has given back what no query from `first_query` (the length by default) on reads.
        Returns group -> the copy-on-write pairs (src, dst); OutOfPagesError changes nothing."""
        need = self.pages_needed(seq, n, first_query)
        for group, k in need.items():
            bm = self._bms[group]
            if k > bm.num_free:
                raise OutOfPagesError(f"reserve({seq!r}, {n}) needs {k} free pages of group {group!r}, which has "
                                      f"{bm.num_free} of {bm.num_pages} free ({self.page_size} positions per page)")
        copies = {}
        for group, bm in self._bms.items():
            if past := self._past(group, seq, first_query):
                bm.drop_pages(seq, past)
            copies[group] = bm.reserve(seq, n)
        return copies

    def crop(self, seq, n: int) -> dict:
        """Keep the first n positions of `seq`; group -> the pages freed. Refused (CacheStateError, nothing
        changed) when a local group already gave back a page that the query at position n reads."""
        _sequence_crop(seq, n, self.length(seq))
        for group, bm in self._bms.items():
            table, past = bm.block_table(seq), self.outside_window(group, n)
            lost = [i for i in range(pages_for(n, self.page_size)) if table[i] == NULL and i not in past]
            if lost:
                P = self.page_size
                raise CacheStateError(f"crop({seq!r}, {n}): the window of group {group!r} (window, sinks) = "
                                      f"{self.rule(group)} already freed page {lost[0]} (positions "
                                      f"{lost[0] * P}..{lost[0] * P + P - 1}), which the query at position {n} reads")
        return {group: bm.crop(seq, n) for group, bm in self._bms.items()}

    def release(self, seq) -> dict:
        """Give back every page of `seq` in every group and retire its id; group -> the pages freed."""
        return {group: bm.release(seq) for group, bm in self._bms.items()}

    def fork(self, src, dst):
        """Make `dst` a new sequence that shares all of `src`'s pages (and NULL entries) in every group."""
        for bm in self._bms.values():
            bm.fork(src, dst)

    # ---- the prefix index: a strategy behind keys, lookup, publish and cached_prefix ----
    def keys(self, tokens, known=()) -> list:
        """The index's keys for the full pages of `tokens` (a list): the hash chain's (digest,
        parent, tokens) per page (extending `known`), the tree's token ids, or none."""
        if self.index == "hash":
            return page_keys(tokens, self.page_size, self.extra, known[:len(tokens) // self.page_size])
        return tuple(tokens[:len(tokens) // self.page_size * self.page_size]) if self.index else []

    def lookup(self, seq, keys) -> int:
        """Start the new sequence `seq` with the cached pages of the longest prefix of `keys`; their number."""
        if self.index == "radix":
            return self._first.match(seq, keys, self.extra)
        return self.reserve_prefix(seq, keys)

    def publish(self, seq, keys, start: int = 0):
        """Cache the full pages of `seq` that `keys` name, from page `start` on, for the sequences to come
        (a name taken already, or a page the window gave back, stays unnamed: fine)."""
        if self.index == "radix":
            self._first.cache(seq, keys, self.extra)
            return
        for i, key in enumerate(keys[start:], start=start):
            self.register(seq, i, *key)

    def cached_prefix(self, keys) -> int:
        """BlockManager.cached_prefix for the index's `keys` (lookup's), every group considered."""
        if self.index == "radix":
            return self._first.cached_prefix(keys, self.extra)
        return self._hit(keys)[0] * self.page_size

    def register(self, seq, index: int, digest: bytes, parent: bytes, tokens) -> dict:
        """Name page `index` of `seq` by `digest` in every group that still holds it; group -> whether it
        was named (False where the window gave it back, or as BlockManager.register says)."""
        return {group: bm.register(seq, index, digest, parent, tokens) for group, bm in self._bms.items()}

    def reserve_prefix(self, seq, keys) -> int:
        """Start the new sequence `seq` with the longest cached prefix of `keys` (BlockManager's):
        h pages such that every group holds what the query at position h * page_size reads, a local
        group only its window's and sinks' pages (NULL before the window). Returns h."""
        h, found = self._hit(keys)
        for group, bm in self._bms.items():         # the first adopt refuses a bad id, changing nothing
            reads = set(self._reads(group, h))
            bm.adopt(seq, [found[group][i] if i in reads else NULL for i in range(h)])
        return h

    def _hit(self, keys) -> tuple[int, dict]:
        """(h, group -> the page named by each key or None): h as reserve_prefix takes it."""
        keys = list(keys)
        found = {group: [bm.cached(key) for key in keys] for group, bm in self._bms.items()}  # page or None
        local = [group for group in found if self.rule(group)[0]]
        h = min([(found[group] + [None]).index(None) for group in found if group not in local], default=len(keys))
        while any(found[group][i] is None for group in local for i in self._reads(group, h)):
            h -= 1                                  # a local group evicted part of that window: try shorter
        return h, found

    # ---- checking ----
    def check(self):
        """Raise AssertionError naming the first broken invariant: a group's own (BlockManager.check), the same
        sequences at the same lengths in every group, and NULL entries only where the window allows."""
        for group, bm in self._bms.items():
            bm.check()
            assert bm.sequences() == self.sequences(), f"group {group!r} holds other sequences"
            for seq in bm.sequences():
                length, table = bm.length(seq), bm.block_table(seq)
                assert length == self.length(seq), f"{seq!r} has other lengths in group {group!r}"
                past = self.outside_window(group, length)
                bad = [i for i, page in enumerate(table) if page == NULL and i not in past]
                assert not bad, (f"{seq!r} at length {length} lacks page {bad[0]} in group {group!r}, which the "
                                 f"next query reads (window, sinks) = {self.rule(group)}: {table}")

    def __repr__(self):
        groups = ", ".join(f"{g}: {bm.num_free}/{bm.num_pages} free, (window, sinks) = {self._rules[g]}"
                           for g, bm in self._bms.items())
        return f"HybridBlockManager(page_size={self.page_size}, {groups}; {len(self.sequences())} sequences)"

    @property
    def _first(self) -> BlockManager:
        return next(iter(self._bms.values()))

    def _name(self, group):
        if group not in self._bms:
            raise CacheInputError(f"unknown group {group!r}: the groups are {', '.join(map(repr, self._bms))}")
        return group

    def _past(self, group, seq, first_query=None) -> list[int]:
        """Indices of `seq`'s pages in `group` that no query from `first_query` (default: the length) reads."""
        bm = self._bms[group]
        length = bm.length(seq) if seq in bm else 0
        if first_query is not None:
            int_arg("first_query", first_query)
            if first_query > length:
                raise CacheStateError(f"first_query {first_query} for {seq!r}, which holds {length} positions")
        if seq not in bm:
            return []
        table = bm.block_table(seq)
        return [i for i in self.outside_window(group, length if first_query is None else first_query)
                if table[i] != NULL]

    def _reads(self, group, h) -> list[int]:
        """The pages among 0..h-1 that the query at position h * page_size reads in `group`: the sink
        pages, then those from its window's first position on."""
        past = self.outside_window(group, h * self.page_size)
        return [*range(min(h, past.start)), *range(max(past.start, past.stop), h)]


def _rule(name, spec) -> tuple[int, int]:
    """(window, sinks) of a group spec (num_pages, window, sinks), checked."""
    if not isinstance(name, str):
        raise CacheInputError(f"a group name must be a str, got {name!r}")
    if not isinstance(spec, tuple) or len(spec) != 3:
        raise CacheInputError(f"group {name!r}: expected (num_pages, window, sinks), got {spec!r}")
    for what, value, low in zip(("num_pages", "window", "sinks"), spec, (1, 0, 0), strict=True):
        int_arg(f"group {name!r}: {what}", value, low=low)
    if spec[2] and not spec[1]:
        raise CacheInputError(f"group {name!r}: sinks ({spec[2]}) need a window; a full group keeps every position")
    return spec[1], spec[2]
