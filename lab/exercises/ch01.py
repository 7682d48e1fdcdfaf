"""Chapter 1 exercises: count the positions, size the cache, see what the causal mask buys, and time a step.

Each check runs the reader's function against an independent oracle and enforces the exercise's rule:
exercises 1 and 2 ask for arithmetic, so the reader's function runs while every torch function and the
library's own formula raise; exercise 3 asks for attention written by hand, so it runs while PyTorch's
fused attention (scaled_dot_product_attention, under any of its names) and the lab's attention functions
raise; exercise 4 asks for a measurement, so the time it reports must agree with the check's own timing.

The cases are drawn fresh at every run (the seed is printed, and `seed=` draws the same ones again), and
the oracle runs only after the reader's function has answered: no answer can be looked up beforehand.
"""

import random
import time

import torch
import torch.nn.functional as F

from ..bench import time_call
from ..cache import sizing
from ..engine import RecomputeBackend, generate, positions_cached, positions_uncached
from ..experiments import ch01_recompute
from ..kernels import (
    decode_attention,
    paged_attention,
    paged_attention_cpu,
    paged_attention_gather,
    paged_attention_int8,
    paged_attention_int8_reference,
    paged_attention_reference,
)
from ..models import forward, gpt2, llama, load
from . import compare_with_book
from .rules import ATTENTION_OPS, ForbidTorch, NoTorch, drawn_with, fresh_seed, functions_raise, unchanged


def _arith_only(fn, args, why, library):
    with unchanged(__name__), functions_raise(*library), NoTorch(why):
        return fn(*args)


def check_positions_without_cache(fn, seed=None):
    """fn(prompt_len, new_tokens) -> positions a cache-less greedy loop pushes through the model.

    Rule: count from the structure of the loop, with arithmetic. fn runs while every torch function
    (so any model, any backend) and the library's `positions_uncached` and `positions_cached` raise.
    Oracle: the RecomputeBackend's own count on a tiny model, for small lengths drawn fresh; for lengths too
    large to run (or to tabulate beforehand), the backend's count summed step by step by hand.
    """
    seed = fresh_seed(seed)
    rng = random.Random(seed)
    small = [(rng.randint(1, 100), rng.randint(1, 40)) for _ in range(4)]
    large = [(rng.randint(10**3, 10**6), rng.randint(10**3, 10**5)) for _ in range(2)]
    got = [_arith_only(fn, case, "exercise 1 asks for arithmetic, not a model run",
                       [positions_uncached, positions_cached])
           for case in small + large]
    model, want = load("tiny-mqa"), []
    for P, n in small:
        backend = RecomputeBackend(model)
        generate(backend, [7] * P, n)
        want.append(backend.positions)
    want += [sum(range(P, P + n)) for P, n in large]       # step s (from 0) runs the prompt and s tokens
    with drawn_with(seed, "check_positions_without_cache"):
        for (P, n), g, w in zip(small + large, got, want, strict=True):
            assert g == w, (f"prompt {P}, {n} new tokens: you said {g}, the backend counts {w}. "
                            "Hint: step s (from 0) runs the prompt plus the s tokens generated so far.")
    print(f"correct: the count grows with the square of the number of new tokens (cases drawn with seed={seed})")
    return True


def check_bytes_per_position(fn, seed=None):
    """fn(n_layers, n_kv_heads, head_dim, dtype) -> bytes one position occupies in the KV cache.

    Rule: arithmetic from the shapes (`dtype.itemsize` gives the bytes of one element). fn runs while
    every torch function (so allocating tensors) and `lab.cache.sizing` raise.
    Oracle: allocate the keys and values of one position for every layer and add up their bytes, for shapes
    drawn fresh (too many to tabulate beforehand).
    """
    seed = fresh_seed(seed)
    rng = random.Random(seed)
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.float8_e4m3fn)
    cases = [(rng.randint(1, 200), rng.randint(1, 64), rng.randint(1, 512), rng.choice(dtypes)) for _ in range(5)]
    library = [sizing.bytes_per_position, sizing.cache_bytes]
    got = [_arith_only(fn, case, "exercise 2 asks for arithmetic, not allocated tensors", library) for case in cases]
    with drawn_with(seed, "check_bytes_per_position"):
        for (L, H, D, dtype), g in zip(cases, got, strict=True):
            held = sum(t.nbytes for _ in range(L) for t in (torch.empty(1, H, 1, D, dtype=dtype),) * 2)
            assert g == held, (f"{L} layers, {H} kv heads, head_dim {D}, {dtype}: you said {g}, the tensors "
                               f"hold {held} bytes. Hint: keys and values, every layer, every kv head.")
    print(f"correct: 2 x layers x kv_heads x head_dim x bytes per element (cases drawn with seed={seed})")
    return True


# the lab's own attention, every function that computes it (most call SDPA; the Triton kernel does not)
LAB_ATTENTION = (paged_attention, paged_attention_cpu, paged_attention_gather, paged_attention_reference,
                 paged_attention_int8, paged_attention_int8_reference, decode_attention, gpt2.causal_attention,
                 llama.causal_attention, ch01_recompute.causal, ch01_recompute.bidirectional)
NO_SDPA = "scaled_dot_product_attention is switched off in this check: write softmax(q k^T / sqrt(d)) v yourself"


def check_bidirectional_attention(attend, seed=None):
    """attend(i, q, k, v) -> attention WITHOUT a causal mask, q, k, v `[B, H, T, D]`.

    Rule: write softmax(q k^T / sqrt(d)) v yourself. attend runs while PyTorch's fused attention raises,
    however it is called (`F.scaled_dot_product_attention`, `torch.ops.aten._scaled_dot_product_*`,
    `nn.MultiheadAttention`, flex_attention), and so do the lab's own attention functions.
    Oracle: PyTorch's scaled_dot_product_attention with is_causal=False, run by the check itself on q, k, v
    drawn fresh. Then the check shows what the answer breaks: with it, changing the last token moves the
    logits of every earlier position, so no earlier position's keys and values could be reused.
    """
    def guarded(i, q, k, v):
        with unchanged(__name__), functions_raise(*LAB_ATTENTION, why=NO_SDPA), ForbidTorch(ATTENTION_OPS, NO_SDPA):
            return attend(i, q, k, v)

    seed = fresh_seed(seed)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g) for _ in range(3))
    got = guarded(0, q.clone(), k.clone(), v.clone())
    want = F.scaled_dot_product_attention(q, k, v)
    with drawn_with(seed, "check_bidirectional_attention"):
        assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
            f"shape {tuple(getattr(got, 'shape', ()))}, expected {tuple(want.shape)}")
        assert torch.allclose(got, want, atol=1e-5), "not softmax(q k^T / sqrt(d)) v over all positions"

    model = load("tiny-gpt2")
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=g)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % model.config.vocab_size
    with torch.inference_mode():
        a, b = (ch01_recompute.forward_with_attention(x, model, guarded)[0] for x in (ids, changed))  # [T, V]
        moved = (a - b).abs().amax(-1)[:-1].max().item()
    assert moved > 1e-4, "without the mask the earlier positions should move"
    print(f"correct: without the causal mask, earlier logits move by up to {moved:.3g} when the last token changes")
    return True


AGREE = 3.0   # the reader's time and the check's own may differ by this factor (another moment, another method)


def check_step_time(fn, name="smollm2", T=256):
    """fn(model, T) -> milliseconds of one uncached decode step at context T, measured on this machine.

    Open-ended: time it as you like (lab.bench.time_call excludes warm-up and reports the median).
    Rule: it is a measurement, so the time you report must fit inside the time your function took, and agree
    within a factor of 3 with the check's own timing of the same step, taken right after yours.
    Then your number is set beside the book's (`ch01.step_ms.<name>.T<T>` in results/results.json).
    """
    model = load(name)
    with unchanged(__name__):
        t0 = time.perf_counter()
        ms = fn(model, T)
        took_ms = (time.perf_counter() - t0) * 1e3
    assert isinstance(ms, (int, float)) and not isinstance(ms, bool) and ms > 0, (
        f"expected a positive number of milliseconds, got {ms!r}")
    assert ms <= took_ms, (f"you report {ms:.3g} ms for one step, but your function took only {took_ms:.3g} ms "
                           "in all: measure the step, do not type or look up a number")
    ids = torch.randint(0, model.config.vocab_size, (1, T))          # [1, T]
    mine = time_call(lambda: forward(ids, model.weights, model.config, last_only=True), warmup=1, reps=3)
    mine = mine["median"] * 1e3
    assert mine / AGREE <= ms <= mine * AGREE, (
        f"you report {ms:.3g} ms for one step; the check timed the same step at {mine:.3g} ms just now, a factor "
        f"of {max(ms / mine, mine / ms):.1f} apart: measure the step on this machine, do not type or look up a "
        "number")
    return compare_with_book(f"ch01.step_ms.{name}.T{T}", ms)
