"""Paged decode attention as a Triton kernel: one query per sequence, keys and values read page by page.

The kernel walks the block table, loads one page of keys and values at a time from the pool and keeps an online
softmax (as in FlashAttention): nothing is gathered. `paged_attention` always launches it, compiled on a GPU or,
for CPU tensors, run by Triton's interpreter (slow, but the CPU tests check the very kernel a GPU runs). Triton
reads TRITON_INTERPRET when `@triton.jit` decorates the kernel, at import: set it before (the tests and chapter 5's
notebook do); importing `lab` never changes the environment.
"""

import math

import torch

from .checks import check_paged_inputs

# Known pitfall (torch 2.13, triton 3.9): once `torch._dynamo` is imported in a process (transformers'
# `generate` imports it), the interpreter can no longer run Triton's own @jit helpers (tl.zeros, tl.sum,
# ...) and the kernel fails with "Cannot call @triton.jit'd outside of the scope of a kernel". On a GPU
# the compiled kernel is unaffected; on the CPU, run the interpreter in a process that has not imported it.
try:
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the `gpu` and `dev` extras install it
    triton = None
INTERPRETED = triton is not None and bool(triton.knobs.runtime.interpret)  # TRITON_INTERPRET=1


def _next_power_of_2(n: int) -> int:
    # Triton blocks have power-of-two sizes, and tl.dot needs every dimension to be at least 16.
    return max(16, 1 << (n - 1).bit_length())


if triton is not None:
    # One program per (sequence, kv head), not per (sequence, query head): decode attention is bound
    # by memory traffic, and a program that owns a kv head loads the GROUP query heads that share it
    # as one [GROUP, D] block, so each page of K and V is read once per kv head (3x less traffic for
    # SmolLM2's 9 query / 3 kv heads). The price: at batch 1 a GPU is far from full; splitting long
    # sequences across programs (flash-decoding) would fix that, left out to keep the kernel short.
    @triton.jit
    def _paged_decode_kernel(
        q_ptr, k_pool_ptr, v_pool_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, lengths_ptr, out_ptr, lse_ptr,
        scale, window, sinks,                               # a local layer's rule; window 0: every position
        stride_qb, stride_qh, stride_qd,                    # q   [B, H_q, D]
        stride_kp, stride_kt, stride_kh, stride_kd,         # k_pool [num_pages, page_size, H_kv, D]
        stride_vp, stride_vt, stride_vh, stride_vd,         # v_pool, same layout
        stride_sp, stride_st, stride_sh,                    # k_scale, v_scale [num_pages, page_size, H_kv]
        stride_btb, stride_btp,                             # block_tables [B, max_pages]
        stride_ob, stride_oh, stride_od,                    # out [B, H_q, D]
        stride_lb, stride_lh,                               # lse [B, H_q], float32
        INT8: tl.constexpr,            # int8 codes with a scale per position (triton_paged_int8.py)
        LSE: tl.constexpr,             # also store the scores' log-sum-exp, for a merge (cascade.py)
        GROUP: tl.constexpr,           # query heads per kv head
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        GROUP_PAD: tl.constexpr,       # the three sizes above, padded to powers of two (at least 16)
        HEAD_DIM_PAD: tl.constexpr,
        PAGE_PAD: tl.constexpr,
    ):
        # region paged_decode_loop
        seq = tl.program_id(0)                              # one program per (sequence, kv head)
        kv_head = tl.program_id(1)
        offs_g = tl.arange(0, GROUP_PAD)                    # query heads of this kv head (padded)
        offs_d = tl.arange(0, HEAD_DIM_PAD)                 # features (padded)
        offs_t = tl.arange(0, PAGE_PAD)                     # positions within a page (padded)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM
        # The group's queries, pre-scaled: query head kv_head * GROUP + g reads this kv head.
        q_heads = kv_head * GROUP + offs_g
        q_ptrs = (q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh
                  + offs_d[None, :] * stride_qd)
        q_mask = g_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * scale   # [G, D]

        length = tl.load(lengths_ptr + seq)
        n_pages = tl.cdiv(length, PAGE_SIZE)               # table entries past this are padding
        # A local layer reads its sinks' pages, then the pages from its window's first position on; the
        # pages between are never loaded. Page j of the loop is page i of the table.
        lo = tl.where(window > 0, tl.maximum(length - window, 0), 0)
        first = lo // PAGE_SIZE
        n_sink = tl.minimum(tl.cdiv(sinks, PAGE_SIZE), first)
        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)  # running max of the scores
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)                # running sum of exp(s - max)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)  # running sum of exp(..) * v

        for j in range(0, n_sink + n_pages - first):
            i = tl.where(j < n_sink, j, first + j - n_sink)
            entry = block_tables_ptr + seq * stride_btb + i * stride_btp
            page = tl.load(entry).to(tl.int64)              # int64: offsets in a big pool
            pos = i * PAGE_SIZE + offs_t                    # positions of this page in the sequence
            t_mask = (offs_t < PAGE_SIZE) & (pos < length) & ((pos >= lo) | (pos < sinks))  # read ones
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k_ptrs = (k_pool_ptr + page * stride_kp + offs_t[:, None] * stride_kt
                      + kv_head * stride_kh + offs_d[None, :] * stride_kd)
            v_ptrs = (v_pool_ptr + page * stride_vp + offs_t[:, None] * stride_vt
                      + kv_head * stride_vh + offs_d[None, :] * stride_vd)
            k = tl.load(k_ptrs, mask=kv_mask, other=0).to(tl.float32)     # [PAGE, D]
            v = tl.load(v_ptrs, mask=kv_mask, other=0).to(tl.float32)     # [PAGE, D]
            # "ieee": full float32 products (the default on recent GPUs is TF32, ~1e-3 relative).
            s = tl.dot(q, tl.trans(k), input_precision="ieee")            # [G, PAGE]
            if INT8:                                        # int8 codes: a scale per position
                at = page * stride_sp + offs_t * stride_st + kv_head * stride_sh
                s = s * tl.load(k_scale_ptr + at, mask=t_mask, other=0.0)[None, :]   # on each score
            s = tl.where(t_mask[None, :], s, float("-inf"))
            # Online softmax: rescale what was summed so far to the new maximum. Every page loaded holds
            # a position read, so m_new is finite and exp(-inf - m_new) = 0 on the first page.
            m_new = tl.maximum(m_i, tl.max(s, axis=1))                    # [G]
            alpha = tl.exp(m_i - m_new)                                   # [G]
            p = tl.exp(s - m_new[:, None])                                # [G, PAGE], 0 if masked
            l_i = l_i * alpha + tl.sum(p, axis=1)
            if INT8:                                        # and on each probability, for the values
                p = p * tl.load(v_scale_ptr + at, mask=t_mask, other=0.0)[None, :]
            acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")  # [G, D]
            m_i = m_new

        out = acc / l_i[:, None]                                          # [G, D]
        out_ptrs = (out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh
                    + offs_d[None, :] * stride_od)
        tl.store(out_ptrs, out.to(out_ptr.dtype.element_ty), mask=q_mask)
        # endregion
        if LSE:                                             # log sum exp(s) = m + log sum exp(s - m)
            tl.store(lse_ptr + seq * stride_lb + q_heads * stride_lh, m_i + tl.log(l_i), mask=g_mask)


def require_triton(name: str, device) -> None:
    """Raise RuntimeError unless the kernel `name` can launch on `device`: Triton installed, and a GPU or
    Triton's interpreter (TRITON_INTERPRET=1). Its oracle, `name`_reference, runs anywhere."""
    if triton is None:
        raise RuntimeError(f"{name} needs Triton, which is not installed: pip install triton==3.9.0 "
                           f"(the `gpu` extra), or use {name}_reference")
    if torch.device(device).type != "cuda" and not INTERPRETED:
        raise RuntimeError(f"{name} compiles a Triton kernel for a GPU, but the inputs are on {device}: "
                           "set TRITON_INTERPRET=1 before Python starts to run it in Triton's interpreter, "
                           f"or use {name}_reference")


def paged_attention(q, k_pool, v_pool, block_tables, lengths, scale=None, check_values=True,
                    window: int = 0, sinks: int = 0):
    """Decode attention over paged keys and values with the Triton kernel, always launched: CUDA
    tensors, or any under TRITON_INTERPRET=1. The arguments of `paged_attention_reference`: q
    [B, H_q, D]; k_pool, v_pool [num_pages, page_size, H_kv, D]; block_tables int32 [B, max_pages];
    lengths int32 [B]; scale defaults to 1/sqrt(D). Returns [B, H_q, D] in q's dtype."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, lengths, check_values, window, sinks)
    require_triton("paged_attention", q.device)
    out = torch.empty_like(q, memory_format=torch.contiguous_format)  # [B, H_q, D]
    return launch(q, k_pool, v_pool, None, block_tables, lengths, out, scale, window, sinks)


def launch(q, k_pool, v_pool, scales, block_tables, lengths, out, scale=None, window=0, sinks=0, lse=None):
    """Run the kernel into `out`: one program per (sequence, kv head). scales: (k_scale, v_scale) for INT8
    pools, or None. lse: a float32 [B, H_q] for the log-sum-exp of each query head's scores, or None."""
    B, H_q, D = q.shape
    _, page_size, H_kv, _ = k_pool.shape
    group = H_q // H_kv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    k_scale, v_scale = (s.contiguous() for s in scales) if scales else (k_pool, k_pool)  # one layout
    _paged_decode_kernel[(B, H_kv)](
        q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths.contiguous(), out,   # lengths at stride 1
        out if lse is None else lse, scale, window, sinks,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *k_scale.stride()[:3],
        *block_tables.stride(), *out.stride(), *(out if lse is None else lse).stride()[:2],
        INT8=scales is not None, LSE=lse is not None,
        GROUP=group, HEAD_DIM=D, PAGE_SIZE=page_size,
        GROUP_PAD=_next_power_of_2(group), HEAD_DIM_PAD=_next_power_of_2(D), PAGE_PAD=_next_power_of_2(page_size),
    )
    return out
