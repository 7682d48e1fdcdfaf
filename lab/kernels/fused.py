"""A decoder layer's small operations fused, on the CPU: one call each where the reference makes several.

In a decode step every matrix has a few dozen rows, so each PyTorch operation costs more in dispatch than in
arithmetic; the reference layer (`llama.block`) makes about forty per layer besides its products. These do the same
in one C++ call each (cpu.py), as vLLM's CPU backend does:

    total, h = add_rms_norm(x, weight, eps, add)   # total = x + add; h = RMSNorm(total) * weight
    rope_(x, cos, sin, heads)                      # RoPE in place on x [B, T, heads * D]
    h = silu_mul(gate, up)                         # SiLU(gate) * up
    store_rows(pool, slots, x)                     # pool[slots] = x: a step's keys into their pages

Each rounds to the tensors' dtype where the reference rounds, so a bfloat16 result stays within a rounding step of
the reference's.
"""

import torch

from .cpu import DTYPES, _call, cpu_kernel_available


def _rows(t, name):
    """t `[B, T, W]` as N = B*T rows of W contiguous values, evenly spaced: (N, row stride)."""
    if t.dim() != 3 or t.device.type != "cpu" or t.dtype not in DTYPES or t.stride(-1) != 1:
        raise ValueError(f"{name} must be a CPU tensor [B, T, width] of {', '.join(map(str, DTYPES))} with a "
                         f"contiguous last dimension, got {tuple(t.shape)} {t.dtype} strides {t.stride()}")
    if t.shape[0] > 1 and t.stride(0) != t.shape[1] * t.stride(1):
        raise ValueError(f"{name}'s rows must be evenly spaced, got strides {t.stride()}")
    return t.shape[0] * t.shape[1], t.stride(1)


def add_rms_norm(x, weight, eps: float, add=None):
    """(total, h): total = x + add, new and contiguous (x itself when add is None), h = RMSNorm(total) * weight
    `[B, T, D]`, new and contiguous; the statistics in float32, as `llama.rms_norm`."""
    N, sx = _rows(x, "x")
    sa = 0
    if add is not None:
        if add.shape != x.shape or add.dtype != x.dtype:
            raise ValueError(f"add must match x {tuple(x.shape)} {x.dtype}, got {tuple(add.shape)} {add.dtype}")
        sa = _rows(add, "add")[1]
    if weight.shape != x.shape[-1:] or weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous [{x.shape[-1]}] {x.dtype}, "
                         f"got {tuple(weight.shape)} {weight.dtype}")
    total = None if add is None else torch.empty(x.shape, dtype=x.dtype)
    h = torch.empty(x.shape, dtype=x.dtype)
    _call("add_rms_norm", x, sx, add, sa, weight, total, h, N, x.shape[-1], eps)
    return x if add is None else total, h


def rope_(x, cos, sin, heads: int):
    """Rotate, in place, the pairs (j, j + D/2) of each of the `heads` heads of x `[B, T, heads * D]` by the
    angles of its position: cos, sin `[T, D]` (B = 1) or `[B, T, D]`, contiguous, of x's dtype. Returns x."""
    N, sx = _rows(x, "x")
    D = x.shape[-1] // heads
    if heads * D != x.shape[-1] or D % 2:
        raise ValueError(f"x's width {x.shape[-1]} is not {heads} heads of an even size")
    for name, t in (("cos", cos), ("sin", sin)):
        if t.numel() != N * D or t.shape[-1] != D or t.dtype != x.dtype or not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous [{x.shape[1]}, {D}] {x.dtype} (one row per position), "
                             f"got {tuple(t.shape)} {t.dtype}")
    _call("rope", x, sx, cos, sin, N, heads, D)
    return x


def silu_mul(gate, up):
    """SiLU(gate) * up, `[B, T, F]` new and contiguous (the SiLU rounded first, as the reference rounds)."""
    N, sg = _rows(gate, "gate")
    if up.shape != gate.shape or up.dtype != gate.dtype:
        raise ValueError(f"up must match gate {tuple(gate.shape)} {gate.dtype}, got {tuple(up.shape)} {up.dtype}")
    out = torch.empty(gate.shape, dtype=gate.dtype)
    _call("silu_mul", gate, sg, up, _rows(up, "up")[1], out, N, gate.shape[-1])
    return out


def store_rows(pool, slots, x, check_values=True):
    """pool[slots] = x in one call: rows x `[N, H, D]` (any strides, D contiguous) into pool
    `[S, H, D]` (contiguous) at slots int64 `[N]`, a step's keys or values into their pages.
    check_values reads the slots' range first (a block manager's slots need not). PyTorch's indexed
    write serves off the CPU, for other dtypes, or without the C++ library."""
    if (pool.device.type != "cpu" or pool.dtype not in DTYPES or x.dtype != pool.dtype or not pool.is_contiguous()
            or x.stride(-1) != 1 or slots.dtype != torch.int64 or not cpu_kernel_available()):
        pool[slots] = x
        return pool
    N, H, D = x.shape
    if pool.shape[1:] != (H, D) or slots.shape != (N,):
        raise ValueError(f"x {tuple(x.shape)} must be rows [N, H, D] of pool {tuple(pool.shape)} at slots [N], "
                         f"got slots {tuple(slots.shape)}")
    if check_values and N and not (0 <= int(slots.min()) and int(slots.max()) < pool.shape[0]):
        raise ValueError(f"slots must lie in 0..{pool.shape[0] - 1}")
    _call("store", x, x.stride(0), x.stride(1), pool, slots.contiguous(), N, H, D)
    return pool
