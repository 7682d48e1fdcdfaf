"""Every exercise's check passes on the reference solution and fails on a plausible wrong answer."""

import pytest
import torch

from lab.exercises import ch01
from lab.exercises import ch01_solutions as sol
from lab.models import gpt2


def test_ch01_positions_check():
    assert ch01.check_positions_without_cache(sol.positions_without_cache)
    with pytest.raises(AssertionError, match="backend counted"):
        ch01.check_positions_without_cache(lambda P, n: P * n)  # forgets the growing context


def test_ch01_bytes_check():
    assert ch01.check_bytes_per_position(sol.bytes_per_position)
    with pytest.raises(AssertionError, match="tensors hold"):  # forgets the values
        ch01.check_bytes_per_position(lambda L, H, D, dt: L * H * D * torch.empty((), dtype=dt).element_size())


def test_ch01_bidirectional_check():
    assert ch01.check_bidirectional_attention(sol.bidirectional_attention)
    with pytest.raises(AssertionError):  # the causal attention is not the answer
        ch01.check_bidirectional_attention(gpt2.causal_attention)


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


def test_ch03_flop_checks():
    from lab.exercises import ch03
    from lab.exercises import ch03_solutions as sol3

    assert ch03.check_decode_flops(sol3.decode_flops)
    assert ch03.check_attention_share(sol3.attention_share)
    with pytest.raises(AssertionError, match="PyTorch counted"):  # treats every head as a kv head
        ch03.check_decode_flops(lambda c, T: sol3.decode_flops(
            type(c)(**{**c.to_dict(), "n_kv_heads": c.n_heads}), T))


def test_ch04_prefix_store_check():
    from lab.exercises import ch04
    from lab.exercises import ch04_solutions as sol4

    assert ch04.check_prefix_store(sol4.LRUPrefixStore) > 0.25

    class IgnoresIdentity(sol4.LRUPrefixStore):  # serves another tenant's state: must be caught
        def lookup(self, identity, ids):
            for key, (_, stored, cache) in self.entries.items():
                self.entries[key] = (identity, stored, cache)
            return super().lookup(identity, ids)

    class NeverStores:
        def __init__(self, capacity):
            pass

        def lookup(self, identity, ids):
            return None, 0

        def insert(self, identity, ids, cache):
            pass

    with pytest.raises(AssertionError, match="only 0"):
        ch04.check_prefix_store(NeverStores)
    with pytest.raises(AssertionError, match="another tenant|differ from recomputation"):
        ch04.check_prefix_store(IgnoresIdentity)


def test_ch05_checks():
    from lab.exercises import ch05
    from lab.exercises import ch05_solutions as sol5

    assert ch05.check_speculative_rollback(sol5.speculative_step)
    assert ch05.check_best_block_size(sol5.best_block_size)
    with pytest.raises(AssertionError):  # forgets to roll back
        ch05.check_speculative_rollback(lambda cache, accepted, drafted: None)
    with pytest.raises(AssertionError):  # ignores the block-table bytes: always the smallest block
        ch05.check_best_block_size(lambda lengths, candidates, bpp: min(candidates))
