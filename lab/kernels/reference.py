"""Paged decode attention in plain PyTorch: the readable reference, and the gather-then-SDPA version.

One new query per head and sequence; position t of a sequence sits in page `block_table[t // page_size]` at offset
`t % page_size` of a shared pool. The reference is the oracle the kernels are tested against; the gather's copy is
what `paged_attention_cpu` (cpu.py) avoids.
"""

import torch
import torch.nn.functional as F

from .checks import check_paged_inputs
from .triton_paged_int8 import check_int8_pages


def paged_attention_reference(q, k_pool, v_pool, block_tables, lengths, scale=None,
                              check_values=True, window: int = 0, sinks: int = 0):
    """Decode attention over paged keys and values: gather each sequence's pages, then attend.

    q [B, H_q, D]; pools [num_pages, page_size, H_kv, D]; block_tables int32 [B, max_pages]; lengths
    int32 [B]. window, sinks: a local layer (chapter 10) reads only the last `window` positions and
    the first `sinks` (window 0: all). Returns [B, H_q, D] in q's dtype, computed in float32."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, lengths, check_values, window, sinks)
    page_size = k_pool.shape[1]
    out = torch.empty_like(q)                                          # [B, H_q, D]
    for b, length in enumerate(lengths.tolist()):
        pages = block_tables[b, : -(-length // page_size)].long()    # ceil(length / page_size)
        k = k_pool[pages].flatten(0, 1)[:length].transpose(0, 1)      # [H_kv, length, D]
        v = v_pool[pages].flatten(0, 1)[:length].transpose(0, 1)      # [H_kv, length, D]
        query = q[b, :, None]                                         # [H_q, 1, D]
        mask = read(torch.arange(length), length, window, sinks)      # [length] positions read
        o = F.scaled_dot_product_attention(query.float(), k.float(), v.float(), attn_mask=mask,
                                           scale=scale, enable_gqa=True)  # [H_q, 1, D]
        out[b] = o[:, 0]
    return out


def read(positions, length, window: int, sinks: int):
    """Which of `positions` the query at position length - 1 reads: all of them, or with a
    window the last `window` and the first `sinks` (a bool tensor of their shape)."""
    if not window:
        return torch.ones_like(positions, dtype=torch.bool)
    return (positions >= length - window) | (positions < sinks)


def paged_attention_gather(q, k_pool, v_pool, block_tables, lengths, scale=None, check_values=True,
                           window: int = 0, sinks: int = 0):
    """The same attention as `paged_attention_reference` for the whole batch at once, [B, H_q, D]: the tables cut
    to the longest sequence's pages, one `index_select` per pool copies those pages (whole pages, each a contiguous
    block), and one SDPA call attends, positions past a length masked."""
    check_paged_inputs(q, k_pool, v_pool, block_tables, lengths, check_values, window, sinks)
    B, H_q, D = q.shape
    _, page_size, H_kv, _ = k_pool.shape
    n_pages = -(-int(lengths.max()) // page_size)                 # the longest sequence's pages
    L, lengths = n_pages * page_size, lengths.long()[:, None]     # [B, 1]
    arange = lambda n: torch.arange(n, device=q.device)
    own = arange(n_pages) * page_size < lengths                   # [B, n_pages]: pages it holds
    # Pages laid end to end: row t of sequence b is its position t (the rest read page 0, masked).
    pages = torch.where(own, block_tables[:, :n_pages].long(), 0).view(-1)   # [B * n_pages]
    k = k_pool.index_select(0, pages).view(B, L, H_kv, D).transpose(1, 2)  # [B, H_kv, L, D]
    v = v_pool.index_select(0, pages).view(B, L, H_kv, D).transpose(1, 2)  # [B, H_kv, L, D]
    keep = ((arange(L) < lengths) & read(arange(L), lengths, window, sinks))[:, None, None]   # [B, 1, 1, L]
    return F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=keep, scale=scale,
                                          enable_gqa=True)[:, :, 0]      # [B, H_q, D]


def paged_attention_int8_reference(q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths, scale=None,
                                   check_values=True):
    """Decode attention over INT8 pages: dequantize every page (an oracle, not a way to run), then
    `paged_attention_reference`. k_pool, v_pool int8 [num_pages, page_size, H_kv, D]; k_scale,
    v_scale [num_pages, page_size, H_kv]; the rest as there. Returns float32 [B, H_q, D]."""
    check_int8_pages(q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths, check_values)
    k = k_pool.float() * k_scale.float()[..., None]                   # [num_pages, page_size, H_kv, D]
    v = v_pool.float() * v_scale.float()[..., None]
    return paged_attention_reference(q.float(), k, v, block_tables, lengths, scale, check_values=False)
