"""Paged decode attention in plain PyTorch: the readable reference, and the gather-then-SDPA version.

One decode step: every sequence in the batch has one new query per head, and its keys and values live
in pages of a shared pool. The sequence's block table lists its pages in order, so position t sits in
page `block_table[t // page_size]` at offset `t % page_size`.

- `paged_attention_reference` is the oracle the kernels are tested against: gather the sequence's
  pages into a contiguous copy, then call `scaled_dot_product_attention`. A dozen lines.
- `paged_attention_gather` computes the same thing for the whole batch at once, with no Python loop
  over sequences: one copy of the pages per pool and one masked SDPA call. It runs on any device and
  dtype SDPA takes; on the CPU, `paged_attention_cpu` (cpu.py) reads the pages in place instead of
  copying them, and chapter 5 measures what the copy costs.
- `paged_attention_int8_reference` is the oracle of the INT8 kernel: dequantize the pools (code * scale,
  in float32), then `paged_attention_reference`.

The argument checks they share live in `checks.py`.
"""

import torch
import torch.nn.functional as F

from .checks import check_paged_inputs
from .triton_paged_int8 import check_int8_pages


def paged_attention_reference(q, k_pool, v_pool, block_tables, lengths, scale=None,
                              check_values=True, window: int = 0, sinks: int = 0):
    """Decode attention over paged keys and values: gather each sequence's pages, then attend.

    q [B, H_q, D]; pools [num_pages, page_size, H_kv, D]; block_tables int32 [B, max_pages];
    lengths int32 [B]. window, sinks: a local layer (chapter 10) reads only the last `window`
    positions and the first `sinks` (window 0: every position). Returns [B, H_q, D] in q's
    dtype, computed in float32.
    """
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
    """The same attention as `paged_attention_reference`, for the whole batch at once. Returns [B, H_q, D].

    Every sequence at once, with no Python loop over them: the tables are cut to the longest
    sequence's pages, one `index_select` per pool copies those pages (whole pages, each a contiguous
    block), and one `scaled_dot_product_attention` call attends over the batch, each sequence's
    positions past its length masked. SDPA reads the copies through strides, query groups included.
    """
    check_paged_inputs(q, k_pool, v_pool, block_tables, lengths, check_values, window, sinks)
    B, H_q, D = q.shape
    _, page_size, H_kv, _ = k_pool.shape
    n_pages = -(-int(lengths.max()) // page_size)                 # the longest sequence's pages
    L, lengths = n_pages * page_size, lengths.long()[:, None]     # [B, 1]
    arange = lambda n: torch.arange(n, device=q.device)
    own = arange(n_pages) * page_size < lengths                   # [B, n_pages]: pages it holds
    pages = torch.where(own, block_tables[:, :n_pages].long(), 0)  # the rest read page 0, masked
    # Pages laid end to end, so that row t of sequence b is its position t.
    pages = pages.view(-1)
    k = k_pool.index_select(0, pages).view(B, L, H_kv, D).transpose(1, 2)  # [B, H_kv, L, D]
    v = v_pool.index_select(0, pages).view(B, L, H_kv, D).transpose(1, 2)  # [B, H_kv, L, D]
    keep = ((arange(L) < lengths) & read(arange(L), lengths, window, sinks))[:, None, None]   # [B, 1, 1, L]
    out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=keep, scale=scale,
                                         enable_gqa=True)         # [B, H_q, 1, D]
    return out[:, :, 0]


def paged_attention_int8_reference(q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths, scale=None,
                                   check_values=True):
    """Decode attention over INT8 pages: dequantize every page, then `paged_attention_reference`.

    k_pool, v_pool int8 [num_pages, page_size, H_kv, D]; k_scale, v_scale [num_pages, page_size, H_kv];
    the rest as for `paged_attention_reference`. Returns float32 [B, H_q, D]. Dequantizes the whole pool:
    an oracle, not a way to run.
    """
    check_int8_pages(q, k_pool, v_pool, k_scale, v_scale, block_tables, lengths, check_values)
    k = k_pool.float() * k_scale.float()[..., None]                   # [num_pages, page_size, H_kv, D]
    v = v_pool.float() * v_scale.float()[..., None]
    return paged_attention_reference(q.float(), k, v, block_tables, lengths, scale, check_values=False)
