"""Paged decode attention over INT8 pages: `triton_paged.py`'s kernel with INT8 set, the scales folded in.

Each key and value vector (one token, one KV head) is int8 codes and one float scale, x ~ scale * code (symmetric
absmax, `quantize_pages`). A per-token scale leaves the dot product, so the kernel never dequantizes a page:

    q . (s_t * c_t) = s_t * (q . c_t)                    keys: one multiply per score
    sum_t p_t * (s_t * c_t) = sum_t (p_t * s_t) * c_t    values: the scale folded into the probability

The bytes read per position drop from 2 * D * 2 (float16 K and V) to 2 * (D + 4) (codes and float32 scales).
"""

import torch

from .checks import check_paged_inputs
from .triton_paged import launch, require_triton


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

    q [B, H_q, D] float; k_pool, v_pool int8 [num_pages, page_size, H_kv, D]; k_scale, v_scale float [num_pages,
    page_size, H_kv] (x ~ scale * code); block_tables int32 [B, max_pages]; lengths int32 [B]; scale defaults to
    1/sqrt(D). Launches the kernel as `paged_attention` does; the oracle is `paged_attention_int8_reference`."""
    check_int8_pages(q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths, check_values)
    require_triton("paged_attention_int8", q.device)
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)   # [B, H_q, D]
    return launch(q, k_pool, v_pool, (k_scale, v_scale), block_tables, lengths, out, scale)


def quantize_pages(k_pool, v_pool, scale_dtype=torch.float32):
    """Float pools [num_pages, page_size, H_kv, D] -> (k_codes, v_codes int8 [same shape], k_scale,
    v_scale [num_pages, page_size, H_kv] in scale_dtype): one symmetric absmax scale per token per
    kv head, codes in -127..127, |x - scale * code| <= scale / 2 per element. The grid is
    QuantizedCache's 8-bit symmetric one (lab/cache/quant.py) with signed codes, written out here
    because the kernels import nothing from the caches that call them."""
    codes, scales = [], []
    for pool in (k_pool, v_pool):
        x = pool.to(torch.promote_types(pool.dtype, torch.float32))
        exact = x.abs().amax(-1) / 127                                   # [P, T, H]
        s = exact.to(scale_dtype)
        up = torch.nextafter(s, torch.full_like(s, float("inf")))         # rounded up, so no code clips
        s = torch.where(s.to(x.dtype) < exact, up, s)
        div = s.to(x.dtype)[..., None]
        codes.append(torch.round(x / torch.where(div > 0, div, 1)).clamp_(-127, 127).to(torch.int8))
        scales.append(s)
    return (*codes, *scales)
