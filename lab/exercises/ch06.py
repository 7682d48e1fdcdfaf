"""Chapter 6 exercises: an eviction rule that keeps what is used often (LFU) for the prefix cache's pages, and a
test of your own that catches a prefix cache serving pages computed before the weights changed."""

import dataclasses
import random

from ..cache import BlockManager
from ..engine import PrefixCachingBackend, identity_of
from ..engine.hashing import page_keys
from ..models import load
from .rules import functions_raise

# ---- exercise 1: least-frequently-used eviction ----------------------------------------------------------


class _LFUBlockManager(BlockManager):
    """The oracle: the lab's BlockManager with one change, which page a fresh allocation takes.

    The base class takes the page at the left of its free list, which is kept in the order pages were freed
    (LRU). Here the victim is moved there first: a free page without a name if there is one, else the named
    free page with the fewest uses, the least recently freed among equals (`min` returns the first minimum,
    and the free list runs from the least recently freed). The base class then forgets the victim's name.
    """

    def __init__(self, num_pages, page_size):
        super().__init__(num_pages, page_size)
        self.uses = [0] * num_pages                      # page -> uses since it was named

    def _allocate(self) -> int:
        unnamed = [p for p in self._free if p not in self._keys]
        victim = unnamed[0] if unnamed else min(self._free, key=lambda p: self.uses[p])
        self._free.remove(victim)
        self._free.appendleft(victim)                    # where the base class takes its page from
        return super()._allocate()

    def register(self, seq, index, digest, parent, tokens) -> bool:
        named = super().register(seq, index, digest, parent, tokens)
        if named:
            self.uses[self._tables[seq][index]] = 1      # written: the first use
        return named

    def reserve_prefix(self, seq, keys) -> int:
        n = super().reserve_prefix(seq, keys)
        for page in self._tables[seq]:
            self.uses[page] += 1                         # one more request served from it
        return n


def _served(manager, requests, model=None) -> list[int]:
    """Per request, how many prompt tokens came from cached pages when PrefixCachingBackend's own bookkeeping
    (dry_run: no model runs) serves `requests` from a pool managed by `manager`."""
    backend = PrefixCachingBackend(model or load("tiny-llama"), manager.num_pages, manager.page_size)
    backend.pool.manager = manager                      # before the first request: the pool's bookkeeping
    return [backend.dry_run(ids) for ids in requests]


def popular_prompts(n=150, num_prompts=3, share=0.5, page_size=4, seed=0) -> list[list[int]]:
    """A stream of requests (lists of token ids below 320): with probability `share` one of a few system
    prompts (2 to 4 pages, some more popular than others) and a short question, else a one-off document of
    4 to 8 pages never seen again. Under LRU every document pushes the system prompts out of a small pool."""
    rng = random.Random(seed)
    tokens = lambda k: [rng.randrange(320) for _ in range(k)]
    prompts = [tokens(rng.randint(2, 4) * page_size) for _ in range(num_prompts)]
    weights = [2 ** -i for i in range(num_prompts)]       # the first prompt is the most popular
    return [rng.choices(prompts, weights)[0] + tokens(rng.randint(0, 2 * page_size)) if rng.random() < share
            else tokens(rng.randint(4 * page_size, 8 * page_size + page_size - 1)) for _ in range(n)]


# (name, requests, num_pages, page_size): in each, LRU and LFU serve different tokens from the cache
LFU_CASES = (("three system prompts, 12 pages", popular_prompts(150, 3, 0.5, 4, seed=1), 12, 4),
             ("one system prompt, 10 pages", popular_prompts(100, 1, 0.4, 4, seed=2), 10, 4),
             ("five prompts, pages of 2, 30 pages", popular_prompts(150, 5, 0.6, 2, seed=3), 30, 2))


def check_lfu_eviction(lfu_cached_tokens):
    """lfu_cached_tokens(requests, num_pages, page_size) -> list[int], one per request: how many of its prompt
    tokens were served from the cache.

    The requests (lists of token ids) are served one after another by a prefix cache of `num_pages` pages of
    `page_size` tokens, as PrefixCachingBackend serves them:
    - a page is named by all the tokens up to its end (a chained digest does that); only full pages are named;
    - a request takes the cached pages of its longest named prefix, page 0, 1, ... while each is cached, at
      most (len - 1) // page_size of them (its last token is always computed); it is served those tokens;
    - it then takes a fresh page for each of its remaining pages (a partial last page included), all of them
      before it names any; then it names its new full pages, except a name a cached page already holds (that
      page keeps it, the new copy stays unnamed); when it ends all its pages are freed, its last page first;
    - a fresh page is a free page without a name if there is one (never used, or holding only a partial page
      or a copy); else the named free page with the fewest uses is evicted (its name forgotten), the least
      recently freed among equals. A page's uses: 1 when it is named, plus 1 for every later request that
      takes it from the cache; a page named again after its eviction starts again at 1.
    - a page whose parent was evicted could no longer be reached through the chain. Under these rules it never
      happens: a parent is used at least as often as the pages that extend it and freed after them, so it is
      never the victim while one of them is cached.
    Rule: work it out yourself; the lab's BlockManager and PrefixCachingBackend (which evict the least
    recently freed page) raise while your function runs. The oracle is the lab's BlockManager with its victim
    choice changed to LFU, driven with the real page digests.
    """
    for name, requests, num_pages, page_size in LFU_CASES:
        want = _served(_LFUBlockManager(num_pages, page_size), requests)
        lru = _served(BlockManager(num_pages, page_size), requests)
        with functions_raise(BlockManager.__init__, BlockManager.reserve_prefix, BlockManager._allocate,
                             PrefixCachingBackend.next_logits):
            got = lfu_cached_tokens([list(r) for r in requests], num_pages, page_size)
        got = list(got) if isinstance(got, (list, tuple)) else got
        assert isinstance(got, list) and len(got) == len(requests), (
            f"{name}: expected a list of {len(requests)} counts, one per request, got {got!r:.80}")
        if got == want:
            continue
        i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
        what = (f"{name}: request {i} ({len(requests[i])} tokens) is served {want[i]} tokens from the cache under "
                f"LFU; you served {got[i]}")
        if got == lru:
            what += (". Your counts are exactly what LRU serves (the least recently freed page evicted): "
                     "evict the page used the fewest times instead")
        raise AssertionError(what)
    print("correct")
    return True


def compare_lfu_lru(lfu_cached_tokens, requests=None, num_pages=12, page_size=4) -> dict:
    """The share of prompt tokens served from the cache under your LFU and under the lab's LRU (the
    BlockManager's own bookkeeping, as PrefixCachingBackend drives it), on `requests` (default: a stream of
    popular system prompts and one-off documents). Returns {"lfu": fraction, "lru": fraction}."""
    requests = popular_prompts(page_size=page_size) if requests is None else requests
    total = sum(len(r) for r in requests)
    lfu = sum(lfu_cached_tokens([list(r) for r in requests], num_pages, page_size)) / total
    lru = sum(_served(BlockManager(num_pages, page_size), requests)) / total
    return {"lfu": lfu, "lru": lru}


# ---- exercise 2: a test that an in-place weight update invalidates every page ----------------------------


class _FrozenIdentityBackend(PrefixCachingBackend):
    """Wrong: names pages under the identity the model had when the backend was built, so pages computed
    with the old weights are still found after an in-place update."""

    def __init__(self, model, *args, **kwargs):
        super().__init__(model, *args, **kwargs)
        self._identity = identity_of(model, self.pool, self.salt)

    def page_keys(self, ids, salt=None) -> list:
        identity = dataclasses.replace(self._identity, salt=self.salt if salt is None else salt)
        return page_keys(ids, self.page_size, (identity,))


class _FirstPageOnlyBackend(PrefixCachingBackend):
    """Wrong: page 0 is named under the current identity, but the later pages are chained from a root
    without it. After an update page 0 misses; once it is computed again, the old later pages match."""

    def page_keys(self, ids, salt=None) -> list:
        first = super().page_keys(ids, salt)[:1]
        return first + page_keys(ids, self.page_size, (self.salt if salt is None else salt,))[1:]


INVALIDATION_PAGES = (64, 4)  # (num_pages, page_size) of the backends make_backend builds


def check_invalidation_test(reader_test):
    """reader_test(make_backend) -> None: your test, which raises AssertionError when a prefix cache serves a
    page computed before an in-place weight update (`w.mul_(1.5)`, an optimizer step).

    make_backend(model) returns a backend with PrefixCachingBackend's interface (next_logits(ids), stats,
    pool, page_size) over `model`, 64 pages of 4 tokens. Load your own model (`lab.models.load` builds a new
    one on every call), so the update changes nothing outside your test. The check runs your test on the
    real PrefixCachingBackend, where it must pass, then on backends that serve stale pages, where it must
    fail: one keeps naming pages under the identity the model had when the backend was built; one renames
    only the first page, keeping every later page reachable.
    """
    num_pages, page_size = INVALIDATION_PAGES
    maker = lambda cls: (lambda model: cls(model, num_pages, page_size))
    try:
        reader_test(maker(PrefixCachingBackend))
    except AssertionError as e:
        raise AssertionError(f"your test failed on the real PrefixCachingBackend, which renames every page when "
                             f"the weights change: {e}") from e
    for cls, how in ((_FrozenIdentityBackend, "its pages are named under the identity the model had when the "
                      "backend was built"),
                     (_FirstPageOnlyBackend, "a weight update renames only the first page; once that page is "
                      "computed again, the later pages computed with the old weights are found again")):
        try:
            reader_test(maker(cls))
        except AssertionError:
            continue
        raise AssertionError(f"your test passed a backend that serves stale pages after a weight update ({how})")
    print("correct")
    return True
