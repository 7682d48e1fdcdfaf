"""Paged decode attention over INT8 pages: the Triton kernel of `triton_paged.py`, with the scales folded in.

Each key and value vector (one token, one KV head) is stored as int8 codes and one float scale, x ~ scale
* code (symmetric absmax, `quantize_pages`). The kernel never dequantizes a page. A per-token scale is
constant along the head dimension, so it leaves the dot product:

    q . (s_t * c_t) = s_t * (q . c_t)        keys: one multiply per score, after the dot product
    sum_t p_t * (s_t * c_t) = sum_t (p_t * s_t) * c_t    values: fold the scale into the probability

Everything else is the float kernel: one program per (sequence, KV head), the query group loaded once,
a walk over the block table, an online softmax. Only the loads and those two multiplies differ; the
bytes read per position drop from 2 * D * 2 (float16 K and V) to 2 * (D + 4) (codes and float32 scales).

`paged_attention_int8` always launches the kernel: CUDA tensors, or CPU tensors under TRITON_INTERPRET=1,
as for `paged_attention`.
"""

import math

import torch

from .checks import check_paged_inputs
from .triton_paged import _next_power_of_2, require_triton

try:  # decorated with the TRITON_INTERPRET the process started with, as in triton_paged.py
    import triton
    import triton.language as tl
except ImportError:  # Triton is optional: the `gpu` and `dev` extras install it
    triton = None


if triton is not None:
    @triton.jit
    def _paged_decode_int8_kernel(
        q_ptr, k_pool_ptr, v_pool_ptr, k_scale_ptr, v_scale_ptr, block_tables_ptr, lengths_ptr, out_ptr,
        scale,
        stride_qb, stride_qh, stride_qd,                    # q   [B, H_q, D]
        stride_kp, stride_kt, stride_kh, stride_kd,         # k_pool int8 [num_pages, page_size, H_kv, D]
        stride_vp, stride_vt, stride_vh, stride_vd,         # v_pool, same layout
        stride_ksp, stride_kst, stride_ksh,                 # k_scale [num_pages, page_size, H_kv]
        stride_vsp, stride_vst, stride_vsh,                 # v_scale, same layout
        stride_btb, stride_btp,                             # block_tables [B, max_pages]
        stride_ob, stride_oh, stride_od,                    # out float32 [B, H_q, D]
        GROUP: tl.constexpr,           # query heads per kv head
        HEAD_DIM: tl.constexpr,
        PAGE_SIZE: tl.constexpr,
        GROUP_PAD: tl.constexpr,       # the three sizes above, padded to powers of two (at least 16)
        HEAD_DIM_PAD: tl.constexpr,
        PAGE_PAD: tl.constexpr,
    ):
        # region paged_decode_int8_loop
        seq = tl.program_id(0)                              # one program per (sequence, kv head)
        kv_head = tl.program_id(1)
        offs_g = tl.arange(0, GROUP_PAD)
        offs_d = tl.arange(0, HEAD_DIM_PAD)
        offs_t = tl.arange(0, PAGE_PAD)
        g_mask = offs_g < GROUP
        d_mask = offs_d < HEAD_DIM

        q_heads = kv_head * GROUP + offs_g
        q_ptrs = (q_ptr + seq * stride_qb + q_heads[:, None] * stride_qh
                  + offs_d[None, :] * stride_qd)
        q_mask = g_mask[:, None] & d_mask[None, :]
        q = tl.load(q_ptrs, mask=q_mask, other=0.0).to(tl.float32) * scale   # [G, D]

        length = tl.load(lengths_ptr + seq)
        n_pages = tl.cdiv(length, PAGE_SIZE)
        m_i = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([GROUP_PAD], dtype=tl.float32)
        acc = tl.zeros([GROUP_PAD, HEAD_DIM_PAD], dtype=tl.float32)

        for i in range(0, n_pages):
            page = tl.load(block_tables_ptr + seq * stride_btb + i * stride_btp).to(tl.int64)
            pos = i * PAGE_SIZE + offs_t
            t_mask = (offs_t < PAGE_SIZE) & (pos < length)
            kv_mask = t_mask[:, None] & d_mask[None, :]
            k_ptrs = (k_pool_ptr + page * stride_kp + offs_t[:, None] * stride_kt
                      + kv_head * stride_kh + offs_d[None, :] * stride_kd)
            v_ptrs = (v_pool_ptr + page * stride_vp + offs_t[:, None] * stride_vt
                      + kv_head * stride_vh + offs_d[None, :] * stride_vd)
            k = tl.load(k_ptrs, mask=kv_mask, other=0).to(tl.float32)    # [PAGE, D] codes, exact in float32
            v = tl.load(v_ptrs, mask=kv_mask, other=0).to(tl.float32)    # [PAGE, D]
            k_s = tl.load(k_scale_ptr + page * stride_ksp + offs_t * stride_kst + kv_head * stride_ksh,
                          mask=t_mask, other=0.0).to(tl.float32)         # [PAGE]
            v_s = tl.load(v_scale_ptr + page * stride_vsp + offs_t * stride_vst + kv_head * stride_vsh,
                          mask=t_mask, other=0.0).to(tl.float32)         # [PAGE]

            # NEW: the key scale multiplies each score after the dot product over the codes.
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * k_s[None, :]   # [G, PAGE]
            s = tl.where(t_mask[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))                    # [G]
            alpha = tl.exp(m_i - m_new)                                   # [G]
            p = tl.exp(s - m_new[:, None])                                # [G, PAGE]
            l_i = l_i * alpha + tl.sum(p, axis=1)                         # the softmax sums p, unscaled
            # NEW: the value scale multiplies each probability; the codes are summed as they are.
            acc = acc * alpha[:, None] + tl.dot(p * v_s[None, :], v, input_precision="ieee")  # [G, D]
            m_i = m_new

        out = acc / l_i[:, None]                                          # [G, D]
        out_ptrs = (out_ptr + seq * stride_ob + q_heads[:, None] * stride_oh
                    + offs_d[None, :] * stride_od)
        tl.store(out_ptrs, out, mask=q_mask)
        # endregion


def check_int8_pages(q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths, check_values=True) -> None:
    """The float kernel's checks (`check_paged_inputs`), plus: int8 pools, and float scales shaped
    [num_pages, page_size, kv_heads], all on q's device. Raises TypeError or ValueError naming the argument."""
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor, got {type(q).__name__}")
    named = {"k_pool": k_pool, "v_pool": v_pool, "k_scale": k_scale, "v_scale": v_scale}
    for name, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.device != q.device:
            raise ValueError(f"all inputs must be on one device, got q on {q.device}, {name} on {t.device}")
    for name, pool in (("k_pool", k_pool), ("v_pool", v_pool)):
        if pool.dtype != torch.int8:
            raise TypeError(f"{name} must hold int8 codes, got {pool.dtype}")
    if v_pool.shape != k_pool.shape:
        raise ValueError(f"v_pool must have k_pool's shape {tuple(k_pool.shape)}, got {tuple(v_pool.shape)}")
    # The rest as for float pools, with a stand-in of the pools' shape in q's dtype (zero strides, no copy).
    like = q.new_zeros(()).expand(k_pool.shape)
    check_paged_inputs(q, like, like, block_tables, lengths, check_values)
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if not s.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {s.dtype}")
        if s.shape != k_pool.shape[:3]:
            raise ValueError(f"{name} must be [num_pages, page_size, kv_heads] = {tuple(k_pool.shape[:3])} "
                             f"(one scale per token per kv head), got shape {tuple(s.shape)}")


def paged_attention_int8(q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths, scale=None,
                         check_values=True):
    """Decode attention over INT8 pages with the Triton kernel. Returns float32 [B, H_q, D].

    q [B, H_q, D] float; k_pool, v_pool int8 [num_pages, page_size, H_kv, D]; k_scale, v_scale float
    [num_pages, page_size, H_kv] (x ~ scale * code); block_tables int32 [B, max_pages]; lengths int32 [B];
    scale defaults to 1/sqrt(D). The oracle is `paged_attention_int8_reference`.
    """
    check_int8_pages(q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths, check_values)
    require_triton("paged_attention_int8", q.device)
    B, H_q, D = q.shape
    _, page_size, H_kv, _ = k_pool.shape
    group = H_q // H_kv
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    out = torch.empty(B, H_q, D, dtype=torch.float32, device=q.device)  # [B, H_q, D]
    _paged_decode_int8_kernel[(B, H_kv)](                                # one program per (sequence, kv head)
        q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths.contiguous(), out,
        scale,
        *q.stride(), *k_pool.stride(), *v_pool.stride(), *k_scale.stride(), *v_scale.stride(),
        *block_tables.stride(), *out.stride(),
        GROUP=group, HEAD_DIM=D, PAGE_SIZE=page_size,
        GROUP_PAD=_next_power_of_2(group), HEAD_DIM_PAD=_next_power_of_2(D), PAGE_PAD=_next_power_of_2(page_size),
    )
    return out


def quantize_pages(k_pool, v_pool, scale_dtype=torch.float32):
    """Float pools [num_pages, page_size, H_kv, D] -> (k_codes, v_codes int8 [same shape],
    k_scale, v_scale [num_pages, page_size, H_kv] in scale_dtype): one symmetric absmax scale per token
    per kv head, codes in -127..127, |x - scale * code| <= scale / 2 per element.

    The grid is QuantizedCache's 8-bit symmetric one (lab/cache/quant.py) with signed codes; written out
    here because the kernels import nothing from the caches that call them."""
    out = []
    for pool in (k_pool, v_pool):
        x = pool.to(torch.promote_types(pool.dtype, torch.float32))
        exact = x.abs().amax(-1) / 127                                   # [P, T, H]
        s = exact.to(scale_dtype)
        up = torch.nextafter(s, torch.full_like(s, float("inf")))         # rounded up, so no code clips
        s = torch.where(s.to(x.dtype) < exact, up, s)
        div = s.to(x.dtype)[..., None]
        codes = torch.round(x / torch.where(div > 0, div, 1)).clamp_(-127, 127).to(torch.int8)
        out.append((codes, s))
    (k_codes, k_scale), (v_codes, v_scale) = out
    return k_codes, v_codes, k_scale, v_scale
