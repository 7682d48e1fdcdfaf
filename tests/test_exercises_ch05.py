"""Chapter 5 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut."""

import pytest


def test_ch05_checks():
    from lab.exercises import ch05
    from lab.exercises import ch05_solutions as sol5

    assert ch05.check_speculative_rollback(sol5.speculative_step)
    assert ch05.check_best_block_size(sol5.best_block_size)
    with pytest.raises(AssertionError):  # forgets to roll back
        ch05.check_speculative_rollback(lambda cache, accepted, drafted: None)
    with pytest.raises(AssertionError):  # ignores the block-table bytes: always the smallest block
        ch05.check_best_block_size(lambda lengths, candidates, bpp: min(candidates))
