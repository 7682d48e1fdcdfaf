"""Chapter 1 exercises: count the positions, size the cache, see what the causal mask buys, and time a step.

Each check runs the reader's function against an independent oracle and enforces the exercise's rule:
exercises 1 and 2 ask for arithmetic, so the reader's function runs while every torch function and the
library's own formula raise; exercise 3 asks for attention written by hand, so it runs while PyTorch's
`scaled_dot_product_attention` raises; exercise 4 asks for a measurement, so the time it reports must fit
inside the time the call took.
"""

import contextlib
import time
from unittest import mock

import torch
import torch.nn.functional as F

from ..cache import sizing
from ..engine import RecomputeBackend, generate, positions_uncached
from ..models import load
from . import compare_with_book
from .rules import NoTorch, WatchTorch, functions_raise


def _arith_only(fn, args, why, library):
    with functions_raise(*library), NoTorch(why):
        return fn(*args)


def check_positions_without_cache(fn):
    """fn(prompt_len, new_tokens) -> positions a cache-less greedy loop pushes through the model.

    Rule: count from the structure of the loop, with arithmetic. fn runs while every torch function
    (so any model, any backend) and the library's `positions_uncached` raise.
    Oracle: the RecomputeBackend's own count on a tiny model, for several prompt and output lengths.
    """
    model = load("tiny-mqa")
    for P, n in [(1, 1), (17, 32), (5, 9), (100, 3), (3, 40)]:
        backend = RecomputeBackend(model)
        generate(backend, [7] * P, n)
        got = _arith_only(fn, (P, n), "exercise 1 asks for arithmetic, not a model run",
                          [positions_uncached])
        assert got == backend.positions, (
            f"prompt {P}, {n} new tokens: you said {got}, the backend counted {backend.positions}. "
            "Hint: step s (from 0) runs the prompt plus the s tokens generated so far.")
    print("correct: the count grows with the square of the number of new tokens")
    return True


def check_bytes_per_position(fn):
    """fn(n_layers, n_kv_heads, head_dim, dtype) -> bytes one position occupies in the KV cache.

    Rule: arithmetic from the shapes (`dtype.itemsize` gives the bytes of one element). fn runs while
    every torch function (so allocating tensors) and `lab.cache.sizing` raise.
    Oracle: allocate the keys and values of one position for every layer and add up their bytes.
    """
    for L, H, D, dtype in [(12, 12, 64, torch.float16), (30, 3, 64, torch.bfloat16), (28, 8, 128, torch.float32),
                           (2, 1, 8, torch.int8)]:
        held = sum(t.nbytes for _ in range(L) for t in (torch.empty(1, H, 1, D, dtype=dtype),) * 2)
        got = _arith_only(fn, (L, H, D, dtype), "exercise 2 asks for arithmetic, not allocated tensors",
                          [sizing.bytes_per_position, sizing.cache_bytes])
        assert got == held, (f"{L} layers, {H} kv heads, head_dim {D}, {dtype}: you said {got}, the tensors "
                             f"hold {held} bytes. Hint: keys and values, every layer, every kv head.")
    print("correct: 2 x layers x kv_heads x head_dim x bytes per element")
    return True


def check_bidirectional_attention(attend):
    """attend(i, q, k, v) -> attention WITHOUT a causal mask, q, k, v `[B, H, T, D]`.

    Rule: write softmax(q k^T / sqrt(d)) v yourself. attend runs while
    `torch.nn.functional.scaled_dot_product_attention` raises (patched, and trapped however imported).
    Oracle: PyTorch's scaled_dot_product_attention with is_causal=False, run by the check itself.
    Then the check shows what the answer breaks: with it, changing the last token moves the logits of
    every earlier position, so no earlier position's keys and values could be reused.
    """
    from ..experiments.ch01_recompute import forward_with_attention

    def guarded(i, q, k, v):
        patches = [mock.patch.object(F, "scaled_dot_product_attention", side_effect=AssertionError(
            "scaled_dot_product_attention is switched off in this check: write softmax(q k^T / sqrt(d)) v"))]
        if hasattr(torch._C._nn, "scaled_dot_product_attention"):
            patches.append(mock.patch.object(torch._C._nn, "scaled_dot_product_attention",
                                             side_effect=AssertionError("scaled_dot_product_attention is "
                                                                        "switched off in this check")))
        with contextlib.ExitStack() as stack:
            for p in patches:
                stack.enter_context(p)
            stack.enter_context(WatchTorch("scaled_dot_product_attention", forbid=(
                "scaled_dot_product_attention is switched off in this check: write softmax(q k^T / sqrt(d)) v "
                "yourself")))
            return attend(i, q, k, v)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    got = guarded(0, q, k, v)
    assert got.shape == want.shape, f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=1e-5), "not softmax(q k^T / sqrt(d)) v over all positions"

    model = load("tiny-gpt2")
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=g)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % model.config.vocab_size

    with torch.inference_mode():
        a, b = (forward_with_attention(x, model, guarded)[0] for x in (ids, changed))  # [T, V] each
        moved = (a - b).abs().amax(-1)[:-1].max().item()
    assert moved > 1e-4, "without the mask the earlier positions should move"
    print(f"correct: without the causal mask, earlier logits move by up to {moved:.3g} when the last token changes")
    return True


def check_step_time(fn, name="smollm2", T=256):
    """fn(model, T) -> milliseconds of one uncached decode step at context T, measured on this machine.

    Open-ended: time it as you like (lab.bench.time_call excludes warm-up and reports the median).
    Rule: it is a measurement, so the time you report must fit inside the time your function took.
    Then your number is set beside the book's (`ch01.step_ms.<name>.T<T>` in results/results.json).
    """
    model = load(name)
    t0 = time.perf_counter()
    ms = fn(model, T)
    took_ms = (time.perf_counter() - t0) * 1e3
    assert isinstance(ms, (int, float)) and ms > 0, f"expected a positive number of milliseconds, got {ms!r}"
    assert ms <= took_ms, (f"you report {ms:.3g} ms for one step, but your function took only {took_ms:.3g} ms "
                           "in all: measure the step, do not type or look up a number")
    return compare_with_book(f"ch01.step_ms.{name}.T{T}", ms)
