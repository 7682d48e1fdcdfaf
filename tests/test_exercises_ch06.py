"""Chapter 6 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut.

Oracles: for LFU, the lab's BlockManager with its victim choice changed, driven with the real digests (and, for
LRU, the real PrefixCachingBackend's counts), on workloads drawn fresh at every run (a test passes `seed=`
where it must know them); for the invalidation test, recomputation after the update.
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


SEED = 11                 # the workloads of check_lfu_eviction(..., seed=SEED)


@pytest.fixture(scope="module")
def lru_counts():
    return {name: backend_counts(requests, num_pages, page_size)
            for name, requests, num_pages, page_size in ch06.lfu_cases(SEED)}


def test_lfu_reference_passes():
    assert ch06.check_lfu_eviction(sol6.lfu_cached_tokens)
    assert ch06.check_lfu_eviction(sol6.lfu_cached_tokens, seed=SEED)


def test_the_oracles_driver_serves_what_the_backend_serves(lru_counts):
    # _served drives a BlockManager as next_logits does: with the LRU manager it must give the backend's counts
    for name, requests, num_pages, page_size in ch06.lfu_cases(SEED):
        assert ch06._served(BlockManager(num_pages, page_size), requests) == lru_counts[name], name


@pytest.mark.parametrize("seed", [SEED, 0, 1])
def test_every_drawn_case_tells_lfu_from_lru(seed):
    for name, requests, num_pages, page_size in ch06.lfu_cases(seed):
        lfu = ch06._served(ch06._LFUBlockManager(num_pages, page_size), requests)
        assert lfu != ch06._served(BlockManager(num_pages, page_size), requests), name


def test_lru_counts_from_the_real_backend_fail(lru_counts):
    by_requests = {str(requests): lru_counts[name] for name, requests, _, _ in ch06.lfu_cases(SEED)}
    with pytest.raises(AssertionError, match="exactly what LRU serves"):
        ch06.check_lfu_eviction(lambda requests, num_pages, page_size: by_requests[str(requests)], seed=SEED)


def old_public_cases():
    """The fixed workloads the check used to publish as LFU_CASES."""
    return (("three system prompts, 12 pages", ch06.popular_prompts(150, 3, 0.5, 4, seed=1), 12, 4),
            ("one system prompt, 10 pages", ch06.popular_prompts(100, 1, 0.4, 4, seed=2), 10, 4),
            ("five prompts, pages of 2, 30 pages", ch06.popular_prompts(150, 5, 0.6, 2, seed=3), 30, 2))


def test_answers_precomputed_from_public_cases_fail():
    # the oracle run before the check, on every workload a reader could know in advance: none is asked
    table = {str(requests): ch06._served(ch06._LFUBlockManager(num_pages, page_size), requests)
             for _, requests, num_pages, page_size in old_public_cases()}
    with pytest.raises(AssertionError, match="under LFU"):
        ch06.check_lfu_eviction(lambda requests, num_pages, page_size: table.get(str(requests), [0] * len(requests)))


def test_calling_the_prefix_caching_backend_is_refused():
    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch06.check_lfu_eviction(backend_counts)


class MyManager(BlockManager):   # the reader's own subclass still runs BlockManager's code
    pass


@pytest.mark.parametrize("shortcut", [
    lambda requests, num_pages, page_size: ch06._served(ch06._LFUBlockManager(num_pages, page_size), requests),
    lambda requests, num_pages, page_size: ch06._served(MyManager(num_pages, page_size), requests),
], ids=["the-checks-lfu-oracle", "a-subclass"])
def test_the_block_manager_is_refused_even_with_an_lfu_victim(shortcut):
    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch06.check_lfu_eviction(shortcut)
    assert BlockManager(2, 2).num_free == 2     # restored

@pytest.mark.parametrize("wrong, message", [
    (lambda requests, num_pages, page_size: [0] * len(requests), "you served 0"),
    (lambda requests, num_pages, page_size: [0], "expected a list of"),
    (lambda requests, num_pages, page_size: sol6.lfu_cached_tokens(requests, num_pages + 2, page_size), "under LFU"),
], ids=["never-cached", "wrong-length", "a-larger-pool"])
def test_lfu_wrong_answers_fail(wrong, message):
    with pytest.raises(AssertionError, match=message):
        ch06.check_lfu_eviction(wrong, seed=SEED)


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
    assert ch06.check_invalidation_test(sol6.weight_update_test, seed=0)


@pytest.mark.parametrize("how", list(ch06.STALE_BACKENDS))
def test_the_stale_backends_really_serve_stale_pages(how):
    model = load("tiny-llama")
    with ch06.stale_backend(how) as make_backend:
        backend = make_backend(model)
        assert type(backend) is PrefixCachingBackend
        ids = list(range(10, 10 + 4 * backend.page_size + 1))
        backend.next_logits(ids)
        with torch.no_grad():
            model.weights["model.layers.0.self_attn.v_proj.weight"].mul_(1.5)
        got = [backend.next_logits(ids) for _ in range(2)][-1]     # the second call: page 0 computed again
    assert (got - RecomputeBackend(model).next_logits(ids)).abs().max() > 1e-3


def test_the_stale_backends_are_undone_after_the_run():
    from lab.engine import hashing, identity
    from lab.engine import prefix as prefix_module
    for how in ch06.STALE_BACKENDS:
        with ch06.stale_backend(how):
            pass
    assert prefix_module.identity_of is identity.identity_of and prefix_module.page_keys is hashing.page_keys


def test_a_test_that_asserts_nothing_fails():
    with pytest.raises(AssertionError, match="your test passed a backend that serves stale pages"):
        ch06.check_invalidation_test(lambda make_backend: None)


def test_a_test_that_checks_only_the_type_fails():
    def only_the_type(make_backend):
        backend = make_backend(load("tiny-llama"))
        assert type(backend) is PrefixCachingBackend, "not the real backend"
        assert type(backend).page_keys is PrefixCachingBackend.page_keys and "page_keys" not in vars(backend)

    with pytest.raises(AssertionError, match="your test passed a backend that serves stale pages"):
        ch06.check_invalidation_test(only_the_type)


def test_a_test_that_checks_which_functions_the_module_holds_fails():
    """The shortcut a reader's pass found: the broken backends replace names in lab.engine.prefix, so a test that
    checks those names are the originals, and serves nothing, passed every run. The real runs replace them too."""
    from lab.engine import hashing, identity
    from lab.engine import prefix as prefix_module

    def the_originals(make_backend):
        assert prefix_module.identity_of is identity.identity_of and prefix_module.page_keys is hashing.page_keys

    def the_names(make_backend):
        for name in ("identity_of", "page_keys"):
            fn = getattr(prefix_module, name)
            assert (fn.__name__, fn.__qualname__) == (name, name) and "<locals>" not in fn.__qualname__

    for shortcut in (the_originals, the_names):
        with pytest.raises(AssertionError, match="failed on the real PrefixCachingBackend|passed a backend"):
            ch06.check_invalidation_test(shortcut, seed=0)


def test_a_test_that_counts_its_runs_fails():
    runs = []

    def passes_only_the_first_run(make_backend):    # the old check always ran the real backend first
        runs.append(1)
        assert len(runs) == 1, "not the first run"

    with pytest.raises(AssertionError):
        ch06.check_invalidation_test(passes_only_the_first_run, seed=0)


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


def test_patching_the_oracle_fails():
    def patches(requests, num_pages, page_size):
        ch06._served = lambda manager, requests, model=None: [0] * len(requests)    # the oracle, run afterwards
        return [0] * len(requests)

    with pytest.raises(AssertionError, match="changed lab.exercises.ch06._served"):
        ch06.check_lfu_eviction(patches)
    assert ch06._served.__name__ == "_served"                                       # put back


def test_a_test_that_patches_the_library_back_fails():
    from lab.engine import hashing, identity
    from lab.engine import prefix as prefix_module

    def undoes_the_breakage(make_backend):          # puts the library's own functions back, then tests
        prefix_module.identity_of, prefix_module.page_keys = identity.identity_of, hashing.page_keys
        sol6.weight_update_test(make_backend)

    with pytest.raises(AssertionError, match="changed lab.engine.prefix"):
        ch06.check_invalidation_test(undoes_the_breakage)
