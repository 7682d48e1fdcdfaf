"""Chapter 5 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut.

The block size workloads are drawn fresh at every run; a test passes `seed=` where it must know them.
"""

import types

import pytest
import torch

from lab.cache import KVCache, PagedCache
from lab.data import synthetic_lengths
from lab.exercises import ch05
from lab.exercises import ch05_solutions as sol5


def test_rollback_reference_passes():
    assert ch05.check_speculative_rollback(sol5.speculative_step)


def keep(cache, accepted, drafted):
    return cache.length - drafted + accepted


@pytest.mark.parametrize("shortcut", [
    lambda cache, a, d: cache.crop(keep(cache, a, d)),
    lambda cache, a, d: PagedCache.crop(cache, keep(cache, a, d)),                 # unbound
    lambda cache, a, d: KVCache.crop(cache, keep(cache, a, d)),
    lambda cache, a, d: super(type(cache), cache).crop(keep(cache, a, d)),        # the base class's crop
    lambda cache, a, d: PagedCache._truncate(cache, keep(cache, a, d)),           # the truncation behind crop
    lambda cache, a, d: types.FunctionType(KVCache.crop.__code__, KVCache.crop.__globals__)(cache, keep(cache, a, d)),
], ids=["crop", "unbound", "base-class", "super", "truncate", "copied-crop"])
def test_rollback_through_the_caches_crop_is_refused(shortcut):
    with pytest.raises(AssertionError, match="cache.crop is off limits"):
        ch05.check_speculative_rollback(shortcut)


def test_rollback_that_does_nothing_fails():
    with pytest.raises(AssertionError, match="expected"):
        ch05.check_speculative_rollback(lambda cache, accepted, drafted: None)


def test_block_size_reference_passes():
    assert ch05.check_best_block_size(sol5.best_block_size)
    assert ch05.check_best_block_size(sol5.best_block_size, seed=2)


def test_the_drawn_workloads_need_different_block_sizes():
    answers = {sol5.best_block_size(lengths, list(ch05.CANDIDATES), cost, prefix)
               for seed in range(3) for _, lengths, cost, prefix in ch05.block_size_cases(seed)}
    assert len(answers) >= 3


def test_calling_the_checks_own_simulation_is_refused():
    def simulated(lengths, candidates, page_cost, prefix):
        return min(candidates, key=lambda b: (ch05._cost_by_simulation(lengths, b, page_cost, prefix), b))

    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch05.check_best_block_size(simulated)
    assert ch05._cost_by_simulation([5], 4, 1.0, 0) == 3 + 2     # restored: 3 unused positions, 2 entries


def test_answers_looked_up_beforehand_fail():
    # the old check's five fixed cases, answered with the check's own simulation before the check runs
    old = (("ShareGPT", 0.25, 0), ("ShareGPT", 0.25, 200), ("ShareGPT", 1.0, 600), ("Alpaca", 0.25, 100),
           ("Alpaca", 2.0, 200))
    table = {}
    for dataset, cost, prefix in old:
        i, o = synthetic_lengths(dataset, 300, seed=3)
        table[(cost, prefix)] = min(ch05.CANDIDATES, key=lambda b: (
            ch05._cost_by_simulation((i + o).tolist(), b, cost, prefix), b))
    with pytest.raises(AssertionError, match="the cheapest is"):
        ch05.check_best_block_size(lambda lengths, candidates, cost, prefix: table.get((cost, prefix), 16), seed=0)


@pytest.mark.parametrize("wrong", [
    lambda lengths, candidates, page_cost, prefix: min(candidates),      # waste only: always the smallest
    lambda lengths, candidates, page_cost, prefix: max(candidates),      # overhead only: always the largest
    lambda lengths, candidates, page_cost, prefix: sol5.best_block_size(lengths, candidates, page_cost, 0),
], ids=["smallest", "largest", "ignores-the-shared-prefix"])
def test_block_size_shortcuts_fail(wrong):
    with pytest.raises(AssertionError, match="the cheapest is"):
        ch05.check_best_block_size(wrong, seed=0)


def test_open_ended_measurement_returns_a_ratio():
    ratio = ch05.time_paged_against_contiguous(context=256, rounds=3)
    assert 0 < ratio < 1000


def test_patching_the_checks_simulation_fails():
    def patches(lengths, candidates, page_cost, prefix):
        ch05._cost_by_simulation = lambda lengths, b, page_cost, prefix: 0 if b == 16 else 1
        return 16

    with pytest.raises(AssertionError, match="changed lab.exercises.ch05._cost_by_simulation"):
        ch05.check_best_block_size(patches)
    assert ch05._cost_by_simulation.__name__ == "_cost_by_simulation"


def test_patching_the_checks_comparison_fails():
    def patches(cache, accepted, drafted):
        torch.allclose = lambda *a, **k: True
        sol5.speculative_step(cache, accepted, drafted)

    with pytest.raises(AssertionError, match="changed torch.allclose"):
        ch05.check_speculative_rollback(patches)
