"""Chapter 6 exercises: an eviction rule that keeps what is used often (LFU) for the prefix cache's pages, and a
test of your own that catches a prefix cache serving pages computed before the weights changed.

The LFU workloads are drawn fresh at every run (`seed=` draws the same ones again) and the oracle serves them
only after the reader's function has answered. The reader's test is judged by what it does on backends: it
must pass the real PrefixCachingBackend and fail backends that serve stale pages, and every backend it is
handed is a PrefixCachingBackend (the broken ones are broken in the library's naming functions, for the run).
"""

import contextlib
import dataclasses
import random
import weakref

from ..cache import BlockManager
from ..engine import PrefixCachingBackend
from ..engine import prefix as prefix_module
from ..engine.hashing import page_keys
from ..models import load
from .rules import drawn_with, fresh_seed, functions_raise, unchanged

# ---- exercise 1: least-frequently-used eviction ----------------------------------------------------------


class _LFUBlockManager(BlockManager):
    """The oracle: the lab's BlockManager with one change, which page a fresh allocation takes.

    The base class takes its `victim()`, the least recently freed page (LRU). Here the victim is a free page
    without a name if there is one, else the named free page with the fewest uses, the least recently freed
    among equals (`min` returns the first minimum, and `free_pages()` runs from the least recently freed).
    The base class then forgets the victim's name.
    """

    def __init__(self, num_pages, page_size):
        super().__init__(num_pages, page_size)
        self.uses = [0] * num_pages                      # page -> uses since it was named

    def victim(self) -> int:
        free, named = self.free_pages(), self.named_tokens()
        unnamed = [p for p in free if p not in named]
        return unnamed[0] if unnamed else min(free, key=lambda p: self.uses[p])

    def register(self, seq, index, digest, parent, tokens) -> bool:
        named = super().register(seq, index, digest, parent, tokens)
        if named:
            self.uses[self.block_table(seq)[index]] = 1  # written: the first use
        return named

    def reserve_prefix(self, seq, keys) -> int:
        n = super().reserve_prefix(seq, keys)
        for page in self.block_table(seq):               # the n pages it took, all it holds
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


def lfu_cases(seed) -> list:
    """(name, requests, num_pages, page_size) of three workloads drawn from `seed`: popular system prompts among
    one-off documents, in pools small enough that LRU and LFU serve different tokens from the cache (they did in
    every one of 45 draws; tests/test_exercises_ch06.py checks a few)."""
    rng = random.Random(seed)
    draw = lambda: rng.randrange(2**31)
    return [("three system prompts, 12 pages", popular_prompts(150, 3, 0.5, 4, seed=draw()), 12, 4),
            ("one system prompt, 10 pages", popular_prompts(100, 1, 0.4, 4, seed=draw()), 10, 4),
            ("five prompts, pages of 2, 30 pages", popular_prompts(150, 5, 0.6, 2, seed=draw()), 30, 2)]


def check_lfu_eviction(lfu_cached_tokens, seed=None):
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
    recently freed page), and the check's own oracle, raise while your function runs. The oracle is the lab's
    BlockManager with its victim choice changed to LFU, driven with the real page digests, on workloads drawn
    fresh (`lfu_cases`), after your function has answered.
    """
    seed = fresh_seed(seed)
    cases = lfu_cases(seed)
    with unchanged(__name__), functions_raise(BlockManager, PrefixCachingBackend, _LFUBlockManager, _served):
        answers = [lfu_cached_tokens([list(r) for r in requests], num_pages, page_size)
                   for _, requests, num_pages, page_size in cases]
    with drawn_with(seed, "check_lfu_eviction"):
        for (name, requests, num_pages, page_size), got in zip(cases, answers, strict=True):
            _check_lfu_case(name, requests, num_pages, page_size, got)
    print(f"correct (workloads drawn with seed={seed})")
    return True


def _check_lfu_case(name, requests, num_pages, page_size, got):
    want = _served(_LFUBlockManager(num_pages, page_size), requests)
    got = list(got) if isinstance(got, (list, tuple)) else got
    assert isinstance(got, list) and len(got) == len(requests), (
        f"{name}: expected a list of {len(requests)} counts, one per request, got {got!r:.80}")
    if got == want:
        return
    i = next(i for i, (a, b) in enumerate(zip(got, want, strict=True)) if a != b)
    what = (f"{name}: request {i} ({len(requests[i])} tokens) is served {want[i]} tokens from the cache under "
            f"LFU; you served {got[i]}")
    if got == _served(BlockManager(num_pages, page_size), requests):
        what += (". Your counts are exactly what LRU serves (the least recently freed page evicted): "
                 "evict the page used the fewest times instead")
    raise AssertionError(what)


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
#
# The broken backends are PrefixCachingBackend itself, run while one of the names it uses in lab.engine.prefix
# (identity_of, page_keys) is replaced by a broken one. The real backend runs with both names replaced too, by
# functions that do what the originals do, under the same names: a test cannot tell them apart by type,
# attributes or which functions the module holds, only by what the backend names and serves.


def _as(fn, original):
    """A function that calls fn, under the name, qualified name, docstring and module of `original`."""
    def patch(*args, **kwargs):
        return fn(*args, **kwargs)
    for attr in ("__name__", "__qualname__", "__doc__", "__module__"):
        setattr(patch, attr, getattr(original, attr))
    return patch


def _faithful():
    """identity_of and page_keys that call the originals: the patches of the real backend's runs."""
    return {name: _as(getattr(prefix_module, name), getattr(prefix_module, name))
            for name in ("identity_of", "page_keys")}, None


def _frozen_identity(at_build):
    """identity_of that gives each backend's pool the identity its model had when the backend was built
    (at_build), or when the backend first named a page; (its patches, what to do with a backend just built)."""
    real, frozen = prefix_module.identity_of, weakref.WeakKeyDictionary()

    def identity_of(model, cache, salt=None):
        if cache not in frozen:
            frozen[cache] = real(model, cache)
        return dataclasses.replace(frozen[cache], salt=salt)

    built = (lambda backend: identity_of(backend.model, backend.pool)) if at_build else None
    return {"identity_of": _as(identity_of, real)}, built


def _salt_only(ids, page_size, extra=()):
    """Pages named by the ids and the salt alone: the model, tokenizer and dtypes left out of the key."""
    return page_keys(ids, page_size, (extra[0].salt,))


def _first_page_only(ids, page_size, extra=()):
    """Page 0 named under the identity, the later pages chained from a root without it. After an update page 0
    misses; once it is computed again, the old later pages match."""
    return page_keys(ids, page_size, extra)[:1] + page_keys(ids, page_size, (extra[0].salt,))[1:]


STALE_BACKENDS = {  # what each broken backend does -> (patches of lab.engine.prefix, called on each backend built)
    "it names its pages under the identity the model had when the backend was built": lambda: _frozen_identity(True),
    "it remembers the identity the model had when it first named a page": lambda: _frozen_identity(False),
    "it names its pages by the ids and the salt alone, not by the model":
        lambda: ({"page_keys": _as(_salt_only, page_keys)}, None),
    "a weight update renames only the first page; once that page is computed again, the later pages computed "
    "with the old weights are found again": lambda: ({"page_keys": _as(_first_page_only, page_keys)}, None),
}
INVALIDATION_PAGES = (64, 4)  # (num_pages, page_size) of the backends make_backend builds


@contextlib.contextmanager
def stale_backend(how=None):
    """A make_backend(model) for the backend STALE_BACKENDS[how] describes (None: the real one, its names
    replaced by faithful copies), valid inside."""
    patches, built = STALE_BACKENDS[how]() if how else _faithful()
    saved = {name: getattr(prefix_module, name) for name in patches}

    def make_backend(model):
        backend = PrefixCachingBackend(model, *INVALIDATION_PAGES)
        if built is not None:
            built(backend)
        return backend

    try:
        for name, fn in patches.items():
            setattr(prefix_module, name, fn)
        yield make_backend
    finally:
        for name, fn in saved.items():
            setattr(prefix_module, name, fn)


def check_invalidation_test(reader_test, seed=None):
    """reader_test(make_backend) -> None: your test, which raises AssertionError when a prefix cache serves a
    page computed before an in-place weight update (`w.mul_(1.5)`, an optimizer step).

    make_backend(model) returns a PrefixCachingBackend over `model` (next_logits(ids), stats, pool, page_size),
    64 pages of 4 tokens. Load your own model (`lab.models.load` builds a new one on every call), so the update
    changes nothing outside your test. The check runs your test twice on the real backend, where it must pass,
    and once on each of four backends that serve stale pages, where it must fail, in an order drawn fresh: one
    names pages under the identity the model had when the backend was built; one remembers the identity of its
    first call; one names pages by the ids and the salt alone; one renames only the first page, keeping every
    later page reachable. Each is a PrefixCachingBackend, run with the names it calls in lab.engine.prefix
    replaced, and so is the real one (by copies that do what the originals do): only what a backend names and
    serves tells it apart.
    """
    seed = fresh_seed(seed)
    runs = [None, None, *STALE_BACKENDS]
    random.Random(seed).shuffle(runs)
    for how in runs:
        failed = None
        with stale_backend(how) as make_backend, unchanged(__name__):
            try:
                reader_test(make_backend)
            except AssertionError as e:
                failed = e
        if how is None and failed:
            raise AssertionError(f"your test failed on the real PrefixCachingBackend, which renames every page when "
                                 f"the weights change: {failed}") from failed
        if how is not None and not failed:
            raise AssertionError(f"your test passed a backend that serves stale pages after a weight update: {how}")
    print("correct")
    return True
