"""Chapter 6 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut.

Oracles: for LFU, the lab's BlockManager with its victim choice changed, driven with the real digests (and, for
LRU, the real PrefixCachingBackend's counts); for the invalidation test, recomputation after the update.
"""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lab.cache import BlockManager
from lab.engine import PrefixCachingBackend, RecomputeBackend
from lab.exercises import ch06
from lab.exercises import ch06_solutions as sol6
from lab.models import load

TINY = load("tiny-llama")  # the oracle's bookkeeping runs no model; any model names the pages

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


# ---- exercise 1: LFU eviction ------------------------------------------------------------------------------

def backend_counts(requests, num_pages, page_size):
    """The tokens the real PrefixCachingBackend (LRU) serves from its cache, request by request."""
    backend, served = PrefixCachingBackend(load("tiny-llama"), num_pages, page_size), []
    for ids in requests:
        before = backend.stats["cached_tokens"]
        backend.next_logits(ids)
        served.append(backend.stats["cached_tokens"] - before)
    return served


@pytest.fixture(scope="module")
def lru_counts():
    return {name: backend_counts(requests, num_pages, page_size)
            for name, requests, num_pages, page_size in ch06.LFU_CASES}


def test_lfu_reference_passes():
    assert ch06.check_lfu_eviction(sol6.lfu_cached_tokens)


def test_the_oracles_driver_serves_what_the_backend_serves(lru_counts):
    # _served drives a BlockManager as next_logits does: with the LRU manager it must give the backend's counts
    for name, requests, num_pages, page_size in ch06.LFU_CASES:
        assert ch06._served(BlockManager(num_pages, page_size), requests) == lru_counts[name], name


def test_every_case_tells_lfu_from_lru(lru_counts):
    for name, requests, num_pages, page_size in ch06.LFU_CASES:
        assert ch06._served(ch06._LFUBlockManager(num_pages, page_size), requests) != lru_counts[name], name


def test_lru_counts_from_the_real_backend_fail(lru_counts):
    by_requests = {str(requests): lru_counts[name] for name, requests, _, _ in ch06.LFU_CASES}
    with pytest.raises(AssertionError, match="exactly what LRU serves"):
        ch06.check_lfu_eviction(lambda requests, num_pages, page_size: by_requests[str(requests)])


def test_calling_the_prefix_caching_backend_is_refused():
    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch06.check_lfu_eviction(backend_counts)


def test_the_block_manager_is_refused_even_with_an_lfu_victim():
    lfu_manager = lambda requests, num_pages, page_size: ch06._served(ch06._LFUBlockManager(num_pages, page_size),
                                                                      requests)
    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch06.check_lfu_eviction(lfu_manager)


@pytest.mark.parametrize("wrong, message", [
    (lambda requests, num_pages, page_size: [0] * len(requests), "you served 0"),
    (lambda requests, num_pages, page_size: [0], "expected a list of"),
    (lambda requests, num_pages, page_size: sol6.lfu_cached_tokens(requests, num_pages + 2, page_size), "under LFU"),
], ids=["never-cached", "wrong-length", "a-larger-pool"])
def test_lfu_wrong_answers_fail(wrong, message):
    with pytest.raises(AssertionError, match=message):
        ch06.check_lfu_eviction(wrong)


# Requests over an alphabet of three tokens share prefixes often: reuse, ties, copies of a page already named,
# pages whose parent was evicted. The docstring's rules (the reference) must agree with the oracle on all.
@given(page_size=st.integers(1, 4), spare=st.integers(0, 6),
       requests=st.lists(st.lists(st.integers(0, 2), min_size=1, max_size=14), min_size=1, max_size=25))
def test_the_rules_as_written_agree_with_the_oracle(page_size, spare, requests):
    num_pages = max(-(-len(r) // page_size) for r in requests) + spare
    manager = ch06._LFUBlockManager(num_pages, page_size)
    want = ch06._served(manager, requests, TINY)
    assert sol6.lfu_cached_tokens(requests, num_pages, page_size) == want
    roots = {keys[0][1] for r in requests if (keys := PrefixCachingBackend(TINY, 1, page_size).page_keys(r))}
    named = {digest for digest, _, _ in manager._keys.values()} | roots
    assert all(parent in named for _, parent, _ in manager._keys.values())  # as the docstring says: no orphan


def test_compare_lfu_lru_returns_both_fractions():
    shares = ch06.compare_lfu_lru(sol6.lfu_cached_tokens)
    assert 0 <= shares["lru"] < shares["lfu"] <= 1


# ---- exercise 2: a test that a weight update invalidates every page ---------------------------------------

def test_invalidation_reference_passes():
    assert ch06.check_invalidation_test(sol6.weight_update_test)


@pytest.mark.parametrize("cls", [ch06._FrozenIdentityBackend, ch06._FirstPageOnlyBackend])
def test_the_mutants_really_serve_stale_pages(cls):
    model = load("tiny-llama")
    backend = cls(model, *ch06.INVALIDATION_PAGES)
    ids = list(range(10, 10 + 4 * backend.page_size + 1))
    backend.next_logits(ids)
    model.weights["model.layers.0.self_attn.v_proj.weight"].mul_(1.5)
    got = [backend.next_logits(ids) for _ in range(2)][-1]     # the second call: page 0 computed again
    assert (got - RecomputeBackend(model).next_logits(ids)).abs().max() > 1e-3


def test_a_test_that_asserts_nothing_fails():
    with pytest.raises(AssertionError, match="your test passed a backend that serves stale pages"):
        ch06.check_invalidation_test(lambda make_backend: None)


def test_checking_only_the_first_call_after_the_update_misses_a_mutant():
    def first_call_only(make_backend):
        model = load("tiny-llama")
        backend = make_backend(model)
        ids = list(range(3, 3 + 4 * backend.page_size + 1))
        backend.next_logits(ids)
        with torch.no_grad():
            model.weights["model.layers.0.self_attn.v_proj.weight"].mul_(1.5)
        before = backend.stats["cached_tokens"]
        got = backend.next_logits(ids)
        assert backend.stats["cached_tokens"] == before
        assert (got - RecomputeBackend(model).next_logits(ids)).abs().max() <= 1e-5

    with pytest.raises(AssertionError, match="renames only the first page"):
        ch06.check_invalidation_test(first_call_only)


def test_a_test_that_fails_the_real_backend_fails():
    def always_fails(make_backend):
        assert make_backend(load("tiny-llama")).stats["cached_tokens"] > 0, "nothing cached yet"

    with pytest.raises(AssertionError, match="failed on the real PrefixCachingBackend"):
        ch06.check_invalidation_test(always_fails)
