"""Chapter 2 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut."""

import pytest
import torch


def test_ch02_mask_offset_check():
    from lab.exercises import ch02
    from lab.exercises import ch02_solutions as sol2

    assert ch02.check_mask_offset(sol2.offset_causal_mask)
    with pytest.raises(AssertionError, match="one-shot"):  # the mask without the offset: aligned top-left
        ch02.check_mask_offset(lambda start, T: torch.ones(T, start + T, dtype=torch.bool).tril())
    with pytest.raises(AssertionError, match="expected a bool"):  # only the new keys
        ch02.check_mask_offset(lambda start, T: torch.ones(T, T, dtype=torch.bool).tril())


def test_ch02_sequences_check():
    from lab.exercises import ch02
    from lab.exercises import ch02_solutions as sol2

    assert ch02.check_sequences_that_fit(sol2.sequences_that_fit)
    with pytest.raises(AssertionError, match="caches say"):  # forgets the weights
        ch02.check_sequences_that_fit(lambda m, w, c, t, b: sol2.sequences_that_fit(m, 0, c, t, b))


def test_ch02_crop_check():
    from lab.exercises import ch02
    from lab.exercises import ch02_solutions as sol2

    assert ch02.check_crop(sol2.crop)

    def slicing_crop(cache, n):  # keeps the storage alive: the bytes check must catch it
        cache.keys = [k[:, :, :n] for k in cache.keys]
        cache.values = [v[:, :, :n] for v in cache.values]
        cache.length = n

    with pytest.raises(AssertionError, match="bytes"):
        ch02.check_crop(slicing_crop)
