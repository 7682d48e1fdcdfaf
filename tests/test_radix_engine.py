"""The serving engine's radix tree (`prefix_caching="radix"`) beside chapter 6's hash chain, and cache-aware
scheduling (`schedule="lpm"`) beside first come first served.

Oracle: each request decoded alone through a ConcatCache (tests/test_serving.py `alone`), which shares no
pages, tree or scheduler with the engine; tokens must be equal, on prompts whose top-two logit gaps the
oracle checks (TINY_GAP, justified there). Bookkeeping is checked after every step (`manager.check()`, the
tree's invariants included), and after the run every page is free or cached in an unlocked node.
"""

import random

import pytest

from lab.cache import CacheInputError, CacheStateError, OutOfPagesError
from lab.cache.radix import RadixBlockManager
from lab.engine import PromptLookup, ServingEngine
from lab.models import load
from lab.models.retrofit import local_layers
from tests.test_serving import alone, expected

pytestmark = pytest.mark.usefixtures("one_thread")   # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def workload(seed, n=16, shared=3, new=6):
    """Requests that share a few system prompts of uneven lengths (so shared prefixes end mid-page), each
    with its own tail, arriving over a few dozen steps."""
    rng = random.Random(seed)
    heads = [[rng.randrange(1, 200) for _ in range(rng.randrange(5, 40))] for _ in range(shared)]
    prompts = [rng.choice(heads) + [rng.randrange(1, 200) for _ in range(rng.randrange(1, 12))] for _ in range(n)]
    return prompts, sorted(rng.randrange(0, 30) for _ in prompts), new


def run_checked(engine, prompts, new, arrivals):
    """generate, stepping by hand so the bookkeeping is checked after every step."""
    rids, k, start = [None] * len(prompts), 0, engine.stats["steps"]
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while k < len(prompts) or not all(engine.requests[r].done for r in rids):
        while k < len(prompts) and arrivals[order[k]] <= engine.stats["steps"] - start:
            rids[order[k]] = engine.add_request(prompts[order[k]], new)
            k += 1
        engine.step()
        engine.manager.check()
    return [engine.output(r) for r in rids]


@pytest.mark.parametrize("mode,page_size", [("hash", 4), ("radix", 1), ("radix", 4)])
@pytest.mark.parametrize("schedule", ["fcfs", "lpm"])
def test_radix_and_hash_chain_give_every_request_its_greedy_tokens(tiny, mode, page_size, schedule):
    prompts, arrivals, new = workload(1)
    want = expected(tiny, prompts, new)
    # 120 positions: preemptions and evictions happen (asserted), so both caches are under pressure
    engine = ServingEngine(tiny, num_pages=120 // page_size, page_size=page_size, max_batch_tokens=32,
                           prefix_caching=mode, schedule=schedule)
    assert run_checked(engine, prompts, new, arrivals) == want
    assert engine.stats["cached_tokens"] > 0 and engine.stats["evicted_pages"] > 0
    assert engine.manager.num_free == engine.manager.num_pages      # every page free or cached, unlocked


def test_radix_takes_a_prefix_to_the_token(tiny):
    """37 shared tokens: the tree gives all 37 (one is always computed: 36 of a 37-token prompt); pages of
    16 give 32."""
    rng = random.Random(2)
    head = [rng.randrange(1, 200) for _ in range(37)]
    a, b = head + [5, 6, 7], head + [9]
    taken = {}
    for mode, P in (("radix", 1), ("hash", 16), ("radix", 16)):
        engine = ServingEngine(tiny, num_pages=256 // P, page_size=P, prefix_caching=mode)
        engine.generate([a], 2)
        before = engine.stats["cached_tokens"]
        assert engine.generate([b], 2) == [alone(tiny, b, 2)[0]]
        taken[mode, P] = engine.stats["cached_tokens"] - before
    assert taken == {("radix", 1): 37, ("hash", 16): 32, ("radix", 16): 32}   # pages of 16: whole pages only


def test_the_same_prompt_computed_twice_at_once_is_kept_once(tiny):
    """Two identical prompts admitted in the same step both compute it; caching the second swaps its pages
    for the first's, which go back free: the tree holds the prompt once."""
    prompt = list(range(3, 30))
    engine = ServingEngine(tiny, num_pages=200, page_size=1, prefix_caching="radix")
    out = run_checked(engine, [prompt, prompt], 3, [0, 0])
    assert out == [alone(tiny, prompt, 3)[0]] * 2
    assert engine.manager.cached_pages() == len(prompt) + 2      # the prompt and the 2 fed tokens, once


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_with_speculation(tiny, page_size):
    prompts, arrivals, new = workload(4, n=8, new=8)
    want = expected(tiny, prompts, new)
    engine = ServingEngine(tiny, num_pages=152 // page_size, page_size=page_size, max_batch_tokens=48,
                           prefix_caching="radix", draft=PromptLookup(2), k=4)
    assert run_checked(engine, prompts, new, arrivals) == want
    assert engine.stats["proposed"] > 0


@pytest.mark.parametrize("page_size", [1, 4])
def test_radix_survives_cancellation_and_a_random_stress(tiny, page_size):
    rng = random.Random(4)
    engine = ServingEngine(tiny, num_pages={1: 60, 4: 13}[page_size], page_size=page_size, max_batch_tokens=24,
                           prefix_caching="radix", schedule="lpm")
    prompts, _, _ = workload(4, n=30)
    live = []
    for _ in range(120):
        if prompts and rng.random() < 0.5:
            live.append(engine.add_request(prompts.pop(), rng.randrange(1, 8)))
        if live and rng.random() < 0.1:
            engine.cancel(live.pop(rng.randrange(len(live))))
        engine.step()
        engine.manager.check()
    while engine.running or engine.waiting:
        engine.step()
        engine.manager.check()
    assert engine.manager.num_free == engine.manager.num_pages
    assert engine.stats["preemptions"] > 0 and engine.stats["evicted_pages"] > 0


def test_lpm_admits_the_longest_cached_prefix_first(tiny):
    """Three waiting requests; the tree holds 20 tokens of b's prompt and 10 of c's: lpm tries b, then c,
    then a; fcfs tries a."""
    base = list(range(10, 40))
    for schedule, first in (("fcfs", "a"), ("lpm", "b")):
        engine = ServingEngine(tiny, num_pages=200, page_size=1, prefix_caching="radix", schedule=schedule)
        engine.generate([base[:21]], 1)                                 # caches base[:21]
        ids = dict(a=engine.add_request([1, 2, 3], 1), b=engine.add_request(base[:20] + [7], 1),
                   c=engine.add_request(base[:10] + [7, 7], 1))
        name = {v: k for k, v in ids.items()}
        assert name[engine.next_to_admit().id] == first
        assert [engine.cached_prefix(engine.requests[ids[x]]) for x in "abc"] == [0, 20, 10]


def test_bad_settings_raise(tiny):
    with pytest.raises(CacheInputError, match="prefix_caching"):
        ServingEngine(tiny, num_pages=10, prefix_caching="tree")
    with pytest.raises(CacheInputError, match="lpm"):
        ServingEngine(tiny, num_pages=10, prefix_caching=False, schedule="lpm")
    with pytest.raises(CacheInputError, match="schedule"):
        ServingEngine(tiny, num_pages=10, schedule="sjf")
    with pytest.raises(CacheInputError, match="local layers"):
        ServingEngine(local_layers(tiny, window=8, global_every=2), num_pages=64, page_size=1,
                      prefix_caching="radix")


def test_radix_block_manager_refuses_what_it_does_not_do():
    m = RadixBlockManager(8)
    m.match(0, [1, 2, 3])
    m.reserve(0, 3)
    for call in (lambda: m.register(0, 0, b"", b"", [1]), lambda: m.reserve_prefix(9, []),
                 lambda: m.drop_pages(0, [0])):
        with pytest.raises(CacheStateError):
            call()
    with pytest.raises(CacheInputError):
        m.cache(0, [1, 2, 3, 4])                                        # more ids than positions held
    m.cache(0, [1, 2, 3])
    assert m.match(1, [1, 2, 9]) == 2 and m.block_table(1) == m.block_table(0)[:2]
    m.release(0)
    m.release(1)
    m.check()
    assert m.num_free == 8 and m.cached_pages() == 3


def test_a_fork_locks_the_tree_pages_it_shares():
    """A fork shares every page, copies a shared partial page on write, and holds the tree's pages with a
    lock of its own: once the parent is released they are still not evictable, so no reservation takes a
    page the child reads (without the child's lock, num_free counts page 0 as evictable)."""
    m = RadixBlockManager(8, page_size=4)
    ids = [1, 2, 3, 4, 5, 6]
    m.match(0, ids)
    m.reserve(0, 6)                                                    # a whole page and 2 positions
    m.cache(0, ids[:4])
    m.fork(0, 1)
    assert m.block_table(1) == m.block_table(0) and m.refs(m.block_table(0)[1]) == 2
    (src, dst), = m.reserve(0, 1)                                      # the shared partial page, copied
    assert src == m.block_table(1)[1] and dst == m.block_table(0)[1] != src
    m.release(0)
    m.check()
    assert m.num_free == 6                                             # the child holds its 2 pages
    m.reserve(2, 24)                                                   # every other page, evicting nothing
    with pytest.raises(OutOfPagesError):
        m.reserve(3, 1)
    m.check()
    m.cache(1, ids[:4])                                                # the same tokens: the tree's page
    m.release(1)
    m.release(2)
    m.check()
    assert m.num_free == 8 and m.cached_pages() == 1


def test_a_tree_of_pages_matches_whole_pages_and_keeps_tables_narrow():
    """Pages of 4: the tree's tokens are whole pages, a match stops at the last whole page shared, a partly
    filled last page is never cached, and the block table holds a page per 4 positions."""
    m = RadixBlockManager(8, page_size=4)
    ids = list(range(1, 11))                                           # 2 whole pages and 2 positions
    assert m.match(0, ids) == 0
    m.reserve(0, 10)
    assert len(m.block_table(0)) == 3
    with pytest.raises(CacheInputError, match="whole pages"):
        m.cache(0, ids)                                                # 10 is not a multiple of 4
    m.cache(0, ids[:8])
    assert m.tree.tree() == {((1, 2, 3, 4), (5, 6, 7, 8)): {}}
    assert m.cached_prefix(ids[:7] + [99]) == 4 and m.cached_prefix(ids) == 8
    assert m.match(1, ids[:7] + [99, 5]) == 1 and m.block_table(1) == m.block_table(0)[:1]   # 1 page: 4 of 7
    m.reserve(1, 5)
    m.cache(1, ids[:7] + [99])                                        # splits the run at the page boundary
    assert m.tree.tree() == {((1, 2, 3, 4),): {((5, 6, 7, 8),): {}, ((5, 6, 7, 99),): {}}}
    for seq in (0, 1):
        m.release(seq)
    m.check()
    assert m.num_free == 8 and m.cached_pages() == 3
