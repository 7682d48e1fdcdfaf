"""Chapter 1 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut."""

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
