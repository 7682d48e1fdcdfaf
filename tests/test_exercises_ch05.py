"""Chapter 5 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut."""

import pytest

from lab.exercises import ch05
from lab.exercises import ch05_solutions as sol5


def test_rollback_reference_passes():
    assert ch05.check_speculative_rollback(sol5.speculative_step)


def test_rollback_through_the_caches_crop_is_refused():
    with pytest.raises(AssertionError, match="cache.crop is off limits"):
        ch05.check_speculative_rollback(lambda cache, accepted, drafted: cache.crop(cache.length - drafted + accepted))


def test_rollback_that_does_nothing_fails():
    with pytest.raises(AssertionError, match="expected"):
        ch05.check_speculative_rollback(lambda cache, accepted, drafted: None)


def test_block_size_reference_passes():
    assert ch05.check_best_block_size(sol5.best_block_size)


@pytest.mark.parametrize("wrong", [
    lambda lengths, candidates, page_cost, prefix: min(candidates),      # waste only: always the smallest
    lambda lengths, candidates, page_cost, prefix: max(candidates),      # overhead only: always the largest
    lambda lengths, candidates, page_cost, prefix: sol5.best_block_size(lengths, candidates, page_cost, 0),
], ids=["smallest", "largest", "ignores-the-shared-prefix"])
def test_block_size_shortcuts_fail(wrong):
    with pytest.raises(AssertionError, match="the cheapest is"):
        ch05.check_best_block_size(wrong)


def test_open_ended_measurement_returns_a_ratio():
    ratio = ch05.time_paged_against_contiguous(context=256, rounds=3)
    assert 0 < ratio < 1000
