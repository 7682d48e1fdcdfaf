"""Chapter 1 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut.

The cases are drawn fresh at every run; a test passes `seed=` where it must know them.
"""

import functools
import importlib
import importlib.util
import time
import warnings

import pytest
import torch
import torch.nn.functional as F
from attacks import copy_of, loaded_again
from torch.nn.functional import scaled_dot_product_attention as sdpa

from lab.cache import bytes_per_position, sizing
from lab.engine import RecomputeBackend, generate, positions_uncached
from lab.exercises import ch01
from lab.exercises import ch01_solutions as sol
from lab.kernels import paged_attention_reference
from lab.models import gpt2, load

generate_module = importlib.import_module("lab.engine.generate")  # (lab.engine.generate is also a function)




# ---- exercise 1 -------------------------------------------------------------------------------------------

def test_ch01_positions_check():
    assert ch01.check_positions_without_cache(sol.positions_without_cache)            # a fresh seed
    assert ch01.check_positions_without_cache(sol.positions_without_cache, seed=3)
    with pytest.raises(AssertionError, match="backend counts"):
        ch01.check_positions_without_cache(lambda P, n: P * n, seed=0)  # forgets the growing context


def test_ch01_positions_failure_names_its_seed():
    with pytest.raises(AssertionError, match=r"seed=5: check_positions_without_cache\(\.\.\., seed=5\)"):
        ch01.check_positions_without_cache(lambda P, n: P * n, seed=5)


def test_ch01_positions_check_refuses_running_the_backend():
    def by_the_backend(P, n):  # run the library's loop and read its counter
        backend = RecomputeBackend(load("tiny-mqa"))
        generate(backend, [7] * P, n)
        return backend.positions

    with pytest.raises(AssertionError, match="asks for arithmetic, not a model run"):
        ch01.check_positions_without_cache(by_the_backend)


formula_again = loaded_again(generate_module).positions_uncached


@pytest.mark.parametrize("shortcut", [
    lambda P, n: positions_uncached(P, n),
    functools.partial(positions_uncached),
    copy_of(positions_uncached),                                  # a copy of the function, made beforehand
    lambda P, n: formula_again(P, n),                             # its module loaded again
    lambda P, n: sum(generate_module.positions_cached(P + s, 1) for s in range(n)),
], ids=["by-name", "partial", "copy", "module-loaded-again", "positions_cached"])
def test_ch01_positions_check_refuses_the_library_formula(shortcut):
    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch01.check_positions_without_cache(shortcut)
    assert positions_uncached(17, 32) == 1040  # the library's function is restored afterwards


def test_ch01_positions_check_fails_a_caught_and_retried_call():
    copy = copy_of(positions_uncached)

    def retries(P, n):
        try:
            return copy(P, n)
        except AssertionError:
            return copy(P, n)   # the watch raised once: a second call would go through unseen

    with pytest.raises(AssertionError, match="caught the error"):
        ch01.check_positions_without_cache(retries)


def test_ch01_positions_check_refuses_answers_looked_up_beforehand():
    table = {(P, n): positions_uncached(P, n) for P in range(1, 101) for n in range(1, 41)}  # before the check
    with pytest.raises(AssertionError, match="backend counts"):
        ch01.check_positions_without_cache(lambda P, n: table.get((P, n), 0))


def test_ch01_positions_check_refuses_the_old_fixed_cases_hard_coded():
    known = {(1, 1): 1, (17, 32): 1040, (5, 9): 81, (100, 3): 303, (3, 40): 900}
    with pytest.raises(AssertionError, match="backend counts"):
        ch01.check_positions_without_cache(lambda P, n: known.get((P, n), 0))


# ---- exercise 2 -------------------------------------------------------------------------------------------

def test_ch01_bytes_check():
    assert ch01.check_bytes_per_position(sol.bytes_per_position)
    with pytest.raises(AssertionError, match="tensors hold"):  # forgets the values
        ch01.check_bytes_per_position(lambda L, H, D, dt: L * H * D * dt.itemsize, seed=0)


@pytest.mark.parametrize("by_allocation", [
    lambda L, H, D, dt: 2 * L * torch.empty(1, H, 1, D, dtype=dt).nbytes,
    lambda L, H, D, dt: 2 * L * torch.ops.aten.empty.memory_format([1, H, 1, D], dtype=dt).nbytes,
], ids=["torch.empty", "torch.ops.aten.empty"])
def test_ch01_bytes_check_refuses_allocating_tensors(by_allocation):
    with pytest.raises(AssertionError, match="not allocated tensors"):
        ch01.check_bytes_per_position(by_allocation)


@pytest.mark.parametrize("shortcut", [
    lambda L, H, D, dt: bytes_per_position(L, H, D, dt.itemsize),
    lambda L, H, D, dt: copy_of(sizing.bytes_per_position)(L, H, D, dt.itemsize),
], ids=["by-name", "copy"])
def test_ch01_bytes_check_refuses_lab_cache_sizing(shortcut):
    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch01.check_bytes_per_position(shortcut)
    assert bytes_per_position(1, 1, 1, 2) == 4  # restored


def test_ch01_bytes_check_refuses_the_old_fixed_cases_hard_coded():
    known = {(12, 12, 64, torch.float16): 36864, (30, 3, 64, torch.bfloat16): 23040,
             (28, 8, 128, torch.float32): 229376, (2, 1, 8, torch.int8): 32}
    with pytest.raises(AssertionError, match="tensors hold"):
        ch01.check_bytes_per_position(lambda L, H, D, dt: known.get((L, H, D, dt), 0))


# ---- exercise 3 -------------------------------------------------------------------------------------------

def test_ch01_bidirectional_check():
    assert ch01.check_bidirectional_attention(sol.bidirectional_attention)
    with pytest.raises(AssertionError):  # the causal attention is not the answer (and calls sdpa)
        ch01.check_bidirectional_attention(gpt2.causal_attention)


def mha(i, q, k, v):  # PyTorch's multi-head attention with identity projections: attention all the same
    B, H, T, D = q.shape
    eye, zero = torch.eye(H * D).repeat(3, 1), torch.zeros(3 * H * D)
    flat = lambda x: x.transpose(1, 2).reshape(B, T, H * D).transpose(0, 1)       # [T, B, H*D]
    out, _ = F.multi_head_attention_forward(flat(q), flat(k), flat(v), H * D, H, eye, zero, None, None, False,
                                            0.0, torch.eye(H * D), torch.zeros(H * D), need_weights=True)
    return out.transpose(0, 1).reshape(B, T, H, D).transpose(1, 2)


def reference_kernel(i, q, k, v):  # the lab's paged reference kernel, one query at a time, every key a page
    B, H, T, D = q.shape
    out = torch.empty_like(q)
    for b in range(B):
        pool_k, pool_v = k[b].transpose(0, 1)[:, None], v[b].transpose(0, 1)[:, None]  # [T, 1, H, D]: a page a key
        table = torch.arange(T, dtype=torch.int32)[None]
        for t in range(T):
            out[b, :, t] = paged_attention_reference(q[b:b + 1, :, t], pool_k, pool_v, table,
                                                     torch.tensor([T], dtype=torch.int32))[0]
    return out


def flex(i, q, k, v):
    from torch.nn.attention.flex_attention import flex_attention
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")                  # "flex_attention called without torch.compile()"
        return flex_attention(q, k, v)


@pytest.mark.parametrize("shortcut", [
    lambda i, q, k, v: F.scaled_dot_product_attention(q, k, v),               # through the module
    lambda i, q, k, v: sdpa(q, k, v),                                         # imported by name before the check
    lambda i, q, k, v: torch._C._nn.scaled_dot_product_attention(q, k, v),    # the C binding itself
    lambda i, q, k, v: torch.ops.aten.scaled_dot_product_attention(q, k, v),
    lambda i, q, k, v: torch.ops.aten._scaled_dot_product_attention_math(q, k, v)[0],
    lambda i, q, k, v: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)[0],
    mha,
    reference_kernel,
    flex,
], ids=["F.sdpa", "bound-name", "torch._C._nn", "aten.sdpa", "aten-math", "aten-flash-for-cpu", "multi-head",
        "lab-reference-kernel", "flex-attention"])
def test_ch01_bidirectional_check_refuses_sdpa(shortcut):
    with pytest.raises(AssertionError, match="scaled_dot_product_attention is switched off"):
        ch01.check_bidirectional_attention(shortcut)
    q = torch.randn(1, 1, 3, 4)
    assert F.scaled_dot_product_attention(q, q, q).shape == q.shape  # restored after the check


def test_ch01_bidirectional_check_refuses_outputs_computed_beforehand():
    """Every input the old check (seed 0) gave, answered by SDPA before the check runs, looked up inside it."""
    from lab.experiments.ch01_recompute import bidirectional, forward_with_attention

    known = {}

    def record(i, q, k, v):
        out = bidirectional(i, q, k, v)
        known[q.sum().item()] = out
        return out

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g) for _ in range(3))
    record(0, q, k, v)
    model = load("tiny-gpt2")
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=g)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % model.config.vocab_size
    with torch.inference_mode():
        for x in (ids, changed):
            forward_with_attention(x, model, record)

    with pytest.raises(AssertionError, match="not softmax"):
        ch01.check_bidirectional_attention(lambda i, q, k, v: known.get(q.sum().item(), v))


# ---- exercise 4 -------------------------------------------------------------------------------------------

@pytest.mark.slow  # over 8 s: `make test-slow`
def test_ch01_step_time_check(capsys):
    # T = 16 on SmolLM2 keeps the test short; the key exists in the committed results.json.
    ratio = ch01.check_step_time(sol.step_ms, T=16)
    assert ratio > 0 and "the book's" in capsys.readouterr().out


def test_ch01_step_time_check_refuses_a_typed_number():
    with pytest.raises(AssertionError, match="do not type or look up a number"):
        ch01.check_step_time(lambda model, T: 53.1, T=16)  # the book's number, not a measurement


@pytest.mark.slow  # over 8 s: `make test-slow`
def test_ch01_step_time_check_refuses_a_typed_number_after_a_wait():
    def waits(model, T):
        time.sleep(2.0)          # long enough for any number to "fit inside" the call
        return 1500.0            # far from what a step of 16 positions takes
    with pytest.raises(AssertionError, match="the check timed the same step"):
        ch01.check_step_time(waits, T=16)


def test_ch01_bidirectional_check_refuses_patching_its_oracle():
    real = F.scaled_dot_product_attention

    def patches(i, q, k, v):              # the oracle, run after the answer, would return the answer itself
        F.scaled_dot_product_attention = lambda q, k, v, **kwargs: v
        return v

    with pytest.raises(AssertionError, match="changed torch.nn.functional.scaled_dot_product_attention"):
        ch01.check_bidirectional_attention(patches)
    assert F.scaled_dot_product_attention is real                                  # put back
