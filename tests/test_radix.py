"""lab.engine.RadixCache: token-granular prefix matching, LRU eviction of unlocked leaves, typed refusals.

Oracles: hand-worked trees for small cases; chapter 6's page-granular hash chain (the real BlockManager fed
`page_keys`) for what whole pages buy against single tokens; and, for random runs, a brute-force model that
keeps a plain list of the (extra, ids, slots) sequences cached and finds a prefix by comparing with every
one. Eviction is checked against the model by the slots it frees: a freed slot cuts every cached sequence
holding it, and never one a live handle holds. "Unchanged" after a refusal compares what a caller can
observe: the free slots in the order allocate hands them out, every root-to-leaf path with its slots, and
the counts.
"""

import copy
import time
from collections import Counter

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule, run_state_machine_as_test

from lab.cache import BlockManager, CacheError, CacheInputError, CacheStateError, OutOfPagesError
from lab.engine import RadixCache
from lab.engine.hashing import page_keys

A, B, C, D, X = 1, 2, 3, 4, 9      # "abcd" and "x" as token ids


def paths(tree, above=()):
    """Every root-to-leaf path of a `tree()` dict, as one tuple of ids each."""
    out = []
    for run, sub in tree.items():
        out += paths(sub, above + run) if sub else [above + run]
    return out


def snapshot(rc, extras=((),)):
    """What a caller can observe of `rc`, read on copies (match touches and splits)."""
    probe = copy.deepcopy(rc)
    free = probe.allocate(probe.num_free)
    contents = {}
    for extra in extras:
        probe = copy.deepcopy(rc)
        contents[extra] = {p: probe.match(p, extra=extra)[1] for p in paths(rc.tree(extra))}
    return free, contents, rc.cached_tokens(), rc.evictable_tokens(), repr(rc)


def refused(rc, error, words, f, *args, extras=((),), **kwargs):
    before = snapshot(rc, extras)
    with pytest.raises(error, match=words):
        f(*args, **kwargs)
    assert snapshot(rc, extras) == before
    rc.check()


def cached(rc, ids, extra=()):
    """Insert `ids` computed on fresh slots, as a request would; return (slots, handle)."""
    slots = rc.allocate(len(ids))
    return slots, rc.insert(ids, slots, extra=extra)


# ---- hand-worked cases ----

def test_a_match_inside_a_run_splits_the_node():
    rc = RadixCache(8)
    slots, h = cached(rc, [A, B, C, D])
    assert rc.tree() == {(A, B, C, D): {}}
    n, got, h2 = rc.match([A, B, C, X])
    assert (n, got) == (3, slots[:3])
    assert rc.tree() == {(A, B, C): {(D,): {}}}                  # split at the divergence
    rc.check()
    assert rc.match([A, B, C, D, X])[:2] == (4, slots)           # longer than the cache: all of it
    assert rc.match([X, A])[:2] == (0, [])
    rc.check()


def test_a_second_insert_shares_the_prefix_slots():
    rc = RadixCache(10)
    first, h1 = cached(rc, [A, B, C, D])
    n, prefix, h = rc.match([A, B, X, X])
    new = rc.allocate(2)
    rc.insert([A, B, X, X], prefix + new)
    rc.release(h)
    assert rc.tree() == {(A, B): {(C, D): {}, (X, X): {}}}
    assert rc.cached_tokens() == 6 and rc.num_free == 4         # the prefix is stored once
    assert rc.match([A, B, X, X])[1] == first[:2] + new
    rc.check()
    # the same prefix computed twice (two requests at once): the tree keeps its slots, the copies go back
    again = rc.allocate(3)
    rc.insert([A, B, C], again)
    assert rc.cached_tokens() == 6 and rc.num_free == 4
    assert rc.match([A, B, C])[1] == first[:3]
    rc.check()


def test_token_granularity_against_the_page_hash_chain():
    """37 shared tokens: the tree matches 37; chapter 6's BlockManager, pages of 16, matches 2 pages = 32."""
    shared = list(range(100, 137))
    a, b = shared + [1] * 13, shared + [2] * 13
    bm = BlockManager(num_pages=8, page_size=16)
    bm.reserve("a", len(a))
    for i, key in enumerate(page_keys(a, 16)):
        assert bm.register("a", i, *key)
    bm.release("a")
    pages = bm.reserve_prefix("b", page_keys(b, 16))
    assert pages * 16 == 32

    rc = RadixCache(8 * 16)
    slots, h = cached(rc, a)
    rc.release(h)
    n, got, _ = rc.match(b)
    assert n == 37 and got == slots[:37]
    rc.check()


def test_evicts_least_recently_used_leaves_first():
    rc = RadixCache(6)
    one, h1 = cached(rc, [A, A])
    two, h2 = cached(rc, [B, B])
    three, h3 = cached(rc, [C, C])
    for h in (h1, h2, h3):
        rc.release(h)
    rc.release(rc.match([A, A])[2])                              # [A, A] is now the most recent
    assert rc.evict(1) == two                                    # a whole leaf goes, the least recent
    assert rc.evict(1) == three
    assert rc.tree() == {(A, A): {}}
    assert rc.allocate(5) == two + three + one[:1]               # allocate evicts [A, A] as needed
    rc.check()


def test_a_parent_left_childless_is_evicted_after_its_children():
    rc = RadixCache(6)
    for ids in ([A, B, C], [A, B, D]):
        rc.release(cached(rc, ids)[1])
    assert rc.tree() == {(A, B): {(C,): {}, (D,): {}}}
    assert len(rc.evict(6)) == 4 and rc.num_free == 6 and rc.tree() == {}
    rc.check()


def test_locked_nodes_are_never_evicted_and_allocate_refuses_changing_nothing():
    rc = RadixCache(6)
    slots, h = cached(rc, [A, B, C, D])
    rc.release(rc.insert([A, B, C, D], slots))                  # a second handle, released: h still holds
    assert rc.evict(6) == [] and rc.evictable_tokens() == 0
    held, _ = cached(rc, [X, X])                                 # takes the last two free slots
    refused(rc, OutOfPagesError, "locked", rc.allocate, 1)
    rc.release(h)
    n, got, h = rc.match([A, B])                                 # locks [A, B], splitting it off [C, D]
    assert rc.evictable_tokens() == 2
    refused(rc, OutOfPagesError, "evictable", rc.allocate, 3)
    assert sorted(rc.allocate(2)) == sorted(slots[2:])           # [C, D] goes, [A, B] and [X, X] stay
    assert rc.tree() == {(A, B): {}, (X, X): {}}
    rc.check()


def test_different_extras_never_share():
    rc = RadixCache(8)
    m1, h1 = cached(rc, [A, B, C], extra=("model-1",))
    assert rc.match([A, B, C], extra=("model-2",))[:2] == (0, [])
    assert rc.match([A, B, C])[:2] == (0, [])
    m2, h2 = cached(rc, [A, B, C], extra=("model-2",))
    assert not set(m1) & set(m2)
    assert rc.match([A, B, X], extra=("model-1",))[:2] == (2, m1[:2])
    assert rc.match([A, B, X], extra=("model-2",))[:2] == (2, m2[:2])
    assert rc.tree(("model-1",)) == rc.tree(("model-2",)) == {(A, B): {(C,): {}}} and rc.tree() == {}
    rc.check()


def test_bad_input_is_refused_with_a_typed_error_changing_nothing():
    for bad in (0, -1, 2.0, True):
        with pytest.raises(CacheInputError):
            RadixCache(bad)
    rc = RadixCache(8)
    slots, h = cached(rc, [A, B])
    spare = rc.allocate(2)
    refused(rc, CacheInputError, "ints", rc.match, [A, "b"])
    refused(rc, CacheInputError, "ints", rc.match, [A, True])
    refused(rc, CacheInputError, "ints", rc.insert, [A, -1], spare)
    refused(rc, CacheInputError, "sequence", rc.match, 5)
    refused(rc, CacheInputError, "one slot per token", rc.insert, [A, B, C], spare)
    refused(rc, CacheInputError, "twice", rc.insert, [C, D], [spare[0], spare[0]])
    refused(rc, CacheStateError, "not allocated", rc.insert, [C, D], [spare[0], slots[0]])   # held by [A, B]
    refused(rc, CacheStateError, "not allocated", rc.insert, [C, D], [spare[0], rc.allocate(0) or 7])
    refused(rc, CacheInputError, "hashable", rc.match, [A], extra=([1],))
    refused(rc, CacheInputError, "at least 0", rc.allocate, -1)
    refused(rc, CacheStateError, "allocated", rc.free, [slots[0]])
    refused(rc, CacheStateError, "unknown handle", rc.release, 999)
    refused(rc, CacheInputError, "int", rc.release, "h")
    rc.release(h)
    refused(rc, CacheStateError, "release twice", rc.release, h)
    rc.free(spare)
    assert rc.num_free == 6
    rc.check()


def test_check_catches_broken_invariants():
    """check() reads the private fields; here they are broken by hand to show that it notices."""
    rc = RadixCache(4)
    rc.release(cached(rc, [A, B])[1])
    rc._unused.append(rc._unused[0])                             # a slot free twice
    with pytest.raises(AssertionError, match="slot"):
        rc.check()
    rc = RadixCache(4)
    cached(rc, [A, B])
    next(iter(rc._roots[()].children.values())).lock = 0         # a live handle, its node unlocked
    with pytest.raises(AssertionError, match="handles"):
        rc.check()
    rc = RadixCache(4)
    rc.release(cached(rc, [A, B])[1])
    rc._evictable -= 1                                           # the running count off by one
    with pytest.raises(AssertionError, match="evictable"):
        rc.check()


# ---- random runs against a brute-force model ----

STEPS = Counter()  # what the random runs exercised


def lcp(a, b):
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class RadixMachine(RuleBasedStateMachine):
    """A scheduler's life: requests match, evict, allocate, insert and finish; aborts free their slots."""
    N = 24
    EXTRAS = [(), ("salt",)]

    def __init__(self):
        super().__init__()
        self.rc = RadixCache(self.N)
        self.seqs = []          # the model: (extra, ids, slots) of every sequence cached
        self.running = {}       # handle -> (extra, ids, slots) it holds

    def longest(self, extra, ids):
        """(n, slots) of the longest cached prefix of `ids`, by comparing with every cached sequence."""
        best = max(((lcp(ids, s), slots) for e, s, slots in self.seqs if e == extra), default=(0, []),
                   key=lambda x: x[0])
        return best[0], best[1][:best[0]]

    def held(self):
        return {s for _, _, slots in self.running.values() for s in slots}

    def cut(self, freed):
        """Evicted slots cut every cached sequence holding them; a running request's never."""
        assert not set(freed) & self.held(), "a locked slot was evicted"
        freed = set(freed)
        self.seqs = [(e, ids[:n], slots[:n]) for e, ids, slots in self.seqs
                     for n in [next((i for i, s in enumerate(slots) if s in freed), len(slots))] if n]

    @rule(extra=st.sampled_from(EXTRAS), ids=st.lists(st.integers(0, 2), max_size=8),
          recompute=st.booleans())
    def request(self, extra, ids, recompute):
        rc = self.rc
        n, slots, h = rc.match(ids, extra=extra)
        assert (n, slots) == self.longest(extra, ids)
        STEPS["requests"] += 1
        STEPS["partial hits"] += 0 < n < len(ids)
        need = len(ids) if recompute else len(ids) - n          # recompute: the prefix computed again
        if need > rc.num_free + rc.evictable_tokens():
            refused(rc, OutOfPagesError, "allocate", rc.allocate, need, extras=tuple(self.EXTRAS))
            STEPS["out of slots"] += 1
            rc.release(h)
            return
        self.running[h] = (extra, ids[:n], slots)
        freed = rc.evict(max(0, need - rc.num_free))
        STEPS["evicted"] += len(freed)
        self.cut(freed)
        rc.check()
        new = rc.allocate(need)
        given = new if recompute else slots + new
        splits = len(paths(rc.tree(extra)))
        h2 = rc.insert(ids, given, extra=extra)
        STEPS["duplicates freed"] += sum(a != b for a, b in zip(given, slots, strict=False))
        STEPS["branches"] += len(paths(rc.tree(extra))) > splits
        stored = slots + given[n:]
        self.seqs.append((extra, ids, stored))
        self.running[h2] = (extra, ids, stored)
        rc.release(h)
        del self.running[h]
        n, slots, h = rc.match(ids, extra=extra)
        assert slots == stored
        rc.release(h)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def finish(self, data):
        h = data.draw(st.sampled_from(sorted(self.running)))
        self.rc.release(h)
        del self.running[h]

    @precondition(lambda self: self.running)
    @rule(data=st.data(), more=st.lists(st.integers(0, 2), min_size=1, max_size=4))
    def grow(self, data, more):
        """A running request caches what its next step computed, from its own node (extend)."""
        rc, h = self.rc, data.draw(st.sampled_from(sorted(self.running)))
        extra, ids, slots = self.running[h]
        if len(more) > rc.num_free + rc.evictable_tokens():
            return
        self.cut(rc.evict(max(0, len(more) - rc.num_free)))
        node, new = rc._handles[h], rc.allocate(len(more))
        declined, in_place = not ids or more[0] in node.children, not node.children and node.lock == 1
        h2 = rc.extend(h, more, new)
        assert (h2 is None) == declined                  # declined: the tree holds that continuation already
        if h2 is None:
            rc.free(new)
            STEPS["extends declined"] += 1
            return
        STEPS["extended in place" if in_place else "extended by a leaf"] += 1
        grown = (extra, list(ids) + more, slots + new)
        del self.running[h]
        self.running[h2] = grown
        self.seqs.append(grown)
        n, got, hm = rc.match(grown[1], extra=extra)
        assert (n, got) == (len(grown[1]), grown[2])
        rc.release(hm)

    @rule(n=st.integers(0, 30))
    def evict(self, n):
        before = self.rc.num_free
        freed = self.rc.evict(n)
        self.cut(freed)
        assert len(freed) >= n or self.rc.evictable_tokens() == 0
        assert self.rc.num_free == before + len(freed)

    @rule(n=st.integers(0, 4))
    def abort(self, n):
        if n <= self.rc.num_free:
            self.rc.free(self.rc.allocate(n))

    @invariant()
    def agrees_with_the_model(self):
        rc = self.rc
        rc.check()
        cached = {s for _, _, slots in self.seqs for s in slots}
        assert rc.cached_tokens() == len(cached) and rc.num_free == self.N - len(cached)
        assert rc.evictable_tokens() == len(cached - self.held())

    def teardown(self):
        for h in list(self.running):
            self.rc.release(h)
        self.rc.evict(self.N)
        assert self.rc.num_free == self.N and self.rc.cached_tokens() == 0
        self.rc.check()


def test_random_operations_against_a_brute_force_model():
    """Fixed draws (derandomize, no database) so the run is the same on every machine, and the asserts on
    what was exercised hold."""
    STEPS.clear()
    t0 = time.perf_counter()
    run_state_machine_as_test(RadixMachine, settings=settings(max_examples=100, stateful_step_count=50,
                                                              derandomize=True, database=None, deadline=None))
    print(f"{dict(STEPS)} in {time.perf_counter() - t0:.1f} s")
    assert STEPS["requests"] >= 1_000
    for what in ("partial hits", "out of slots", "evicted", "duplicates freed", "branches", "extended in place",
                 "extended by a leaf", "extends declined"):
        assert STEPS[what] > 0, f"the random runs never exercised {what}"


def test_errors_are_cache_errors():
    assert issubclass(OutOfPagesError, CacheError) and issubclass(CacheInputError, CacheError)


def test_radix_hit_rate_counts_every_longest_earlier_prefix_and_beats_whole_pages():
    """lab.workloads.radix_hit_rate with room for everything: each request's cached tokens are its longest
    common prefix with any earlier request (brute force), at most all but its last token; the page-granular
    hash chain of chapter 6, with the same room, finds no more, and here finds fewer."""
    from lab import workloads
    from lab.models import load

    requests = workloads.multi_turn_chats(320, scale=0.1)
    total = sum(len(r) for r in requests)
    got = workloads.radix_hit_rate(requests, num_slots=total)

    def common(a, b):
        n = 0
        while n < min(len(a), len(b)) and a[n] == b[n]:
            n += 1
        return n

    want = sum(min(max((common(r, e) for e in requests[:i]), default=0), len(r) - 1)
               for i, r in enumerate(requests))
    assert got["cached_tokens"] == want and got["computed_tokens"] == total - want
    pages = workloads.hit_rate(load("tiny-llama"), requests, num_pages=-(-total // 16), page_size=16)
    assert pages["cached_tokens"] < got["cached_tokens"]

