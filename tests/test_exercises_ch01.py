"""Chapter 1 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.functional import scaled_dot_product_attention as sdpa

from lab.cache import bytes_per_position
from lab.engine import RecomputeBackend, generate, positions_uncached
from lab.exercises import ch01
from lab.exercises import ch01_solutions as sol
from lab.models import gpt2, load


def test_ch01_positions_check():
    assert ch01.check_positions_without_cache(sol.positions_without_cache)
    with pytest.raises(AssertionError, match="backend counted"):
        ch01.check_positions_without_cache(lambda P, n: P * n)  # forgets the growing context


def test_ch01_positions_check_refuses_running_the_backend():
    def by_the_backend(P, n):  # run the library's loop and read its counter
        backend = RecomputeBackend(load("tiny-mqa"))
        generate(backend, [7] * P, n)
        return backend.positions

    with pytest.raises(AssertionError, match="asks for arithmetic, not a model run"):
        ch01.check_positions_without_cache(by_the_backend)


def test_ch01_positions_check_refuses_the_library_formula():
    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch01.check_positions_without_cache(lambda P, n: positions_uncached(P, n))
    assert positions_uncached(17, 32) == 1040  # the library's function is restored afterwards


def test_ch01_bytes_check():
    assert ch01.check_bytes_per_position(sol.bytes_per_position)
    with pytest.raises(AssertionError, match="tensors hold"):  # forgets the values
        ch01.check_bytes_per_position(lambda L, H, D, dt: L * H * D * dt.itemsize)


def test_ch01_bytes_check_refuses_allocating_tensors():
    def by_allocation(L, H, D, dt):
        return 2 * L * torch.empty(1, H, 1, D, dtype=dt).nbytes

    with pytest.raises(AssertionError, match="not allocated tensors"):
        ch01.check_bytes_per_position(by_allocation)


def test_ch01_bytes_check_refuses_lab_cache_sizing():
    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch01.check_bytes_per_position(lambda L, H, D, dt: bytes_per_position(L, H, D, dt.itemsize))
    assert bytes_per_position(1, 1, 1, 2) == 4  # restored


def test_ch01_bidirectional_check():
    assert ch01.check_bidirectional_attention(sol.bidirectional_attention)
    with pytest.raises(AssertionError):  # the causal attention is not the answer (and calls sdpa)
        ch01.check_bidirectional_attention(gpt2.causal_attention)


@pytest.mark.parametrize("shortcut", [
    lambda i, q, k, v: F.scaled_dot_product_attention(q, k, v),               # through the module
    lambda i, q, k, v: sdpa(q, k, v),                                         # imported by name before the check
    lambda i, q, k, v: torch._C._nn.scaled_dot_product_attention(q, k, v),    # the C binding itself
], ids=["F.sdpa", "bound-name", "torch._C._nn"])
def test_ch01_bidirectional_check_refuses_sdpa(shortcut):
    with pytest.raises(AssertionError, match="scaled_dot_product_attention is switched off"):
        ch01.check_bidirectional_attention(shortcut)
    q = torch.randn(1, 1, 3, 4)
    assert F.scaled_dot_product_attention(q, q, q).shape == q.shape  # restored after the check


def test_ch01_step_time_check(capsys):
    # T = 16 on SmolLM2 keeps the test short; the key exists in the committed results.json.
    ratio = ch01.check_step_time(sol.step_ms, T=16)
    assert ratio > 0 and "the book's" in capsys.readouterr().out


def test_ch01_step_time_check_refuses_a_typed_number():
    with pytest.raises(AssertionError, match="do not type or look up a number"):
        ch01.check_step_time(lambda model, T: 53.1, T=16)  # the book's number, not a measurement
