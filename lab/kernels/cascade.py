"""Decode attention for branches of one prompt (cascade attention): the shared pages read once for all.

Parallel sampling and beam search decode B branches whose block tables start with the prompt's pages. Attention
over two disjoint sets of positions merges exactly from each set's output and log-sum-exp (`merge_attention`), so
the shared part is attended once for every branch's query and merged with each branch's own part (FlashInfer's
cascade attention, Hydragen). The reference, Triton (triton_paged.py) and C++ (cpu.py) versions take:

q [B, H_q, D], one query per branch; pools [num_pages, page_size, H_kv, D]; shared_table int32 [S] the prompt's
pages, positions 0 .. shared_length - 1 (the last page may be partial); block_tables int32 [B, max_pages] and
lengths int32 [B] (each >= 1) each branch's own pages, positions shared_length .. shared_length + lengths[b] - 1.
The result is paged attention over shared_table + block_tables[b] when shared_length fills its pages.
"""

import math

import torch
import torch.nn.functional as F

from . import triton_paged
from .checks import check_cascade_inputs

SPLIT = 512   # shared positions per Triton program (whole pages): the shared part spread over the GPU


def attention_lse(q, k, v, scale=None):
    """Attention of queries over one set of positions, and the log-sum-exp of their scores, in
    float32. q [N, H_q, D]; k, v [T, H_kv, D] (query head h reads kv head h // (H_q / H_kv); T may
    be 0). Returns out [N, H_q, D] and lse [N, H_q]; over no positions, out 0 and lse -inf."""
    N, H_q, D = q.shape
    H_kv = k.shape[1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    qg = q.float().reshape(N, H_kv, H_q // H_kv, D)                     # [N, H_kv, G, D]
    s = torch.einsum("nhgd,thd->nhgt", qg, k.float()) * scale          # [N, H_kv, G, T]
    lse = torch.logsumexp(s, dim=-1)                                   # [N, H_kv, G]
    out = torch.einsum("nhgt,thd->nhgd", torch.exp(s - lse[..., None]), v.float())  # [N, H_kv, G, D]
    return out.reshape(N, H_q, D), lse.reshape(N, H_q)


def merge_attention(out_1, lse_1, out_2, lse_2):
    """Attention over two disjoint sets of positions, from each set's out [..., D] and lse [...]
    (float32). Each output is weighted by its share of the softmax's denominator, exp(lse - m), m
    the larger lse (so that no exp overflows); a set of no positions (lse -inf, out 0) weighs 0.
    Returns (out, lse)."""
    m = torch.maximum(lse_1, lse_2)                                    # [...]
    w_1, w_2 = torch.exp(lse_1 - m), torch.exp(lse_2 - m)              # [...]
    total = w_1 + w_2
    out = (w_1[..., None] * out_1 + w_2[..., None] * out_2) / total[..., None]   # [..., D]
    return out, m + torch.log(total)


def cascade_attention_reference(q, k_pool, v_pool, shared_table, shared_length: int, block_tables, lengths,
                                scale=None, check_values=True):
    """Cascade attention written plainly: the shared part for all branches, each own part, merged.
    Arguments as in the module docstring. Returns [B, H_q, D] in q's dtype, computed in float32."""
    check_cascade_inputs(q, k_pool, v_pool, shared_table, shared_length, block_tables, lengths, check_values)
    page_size = k_pool.shape[1]
    k_rows, v_rows = k_pool.flatten(0, 1), v_pool.flatten(0, 1)        # [num_pages * page_size, H_kv, D]

    def rows(table, n):                                                # positions 0 .. n - 1 of a table: rows
        t = torch.arange(n, device=q.device)
        return table.long()[t // page_size] * page_size + t % page_size

    shared = rows(shared_table, shared_length)
    out_s, lse_s = attention_lse(q, k_rows[shared], v_rows[shared], scale)      # [B, H_q, D], [B, H_q]
    own = []
    for b, n in enumerate(lengths.tolist()):                           # branch b's own positions
        r = rows(block_tables[b], n)
        own.append(attention_lse(q[b:b + 1], k_rows[r], v_rows[r], scale))      # [1, H_q, D], [1, H_q]
    out_o, lse_o = (torch.cat(x) for x in zip(*own, strict=True))               # [B, H_q, D], [B, H_q]
    return merge_attention(out_s, lse_s, out_o, lse_o)[0].to(q.dtype)


def cascade_attention_triton(q, k_pool, v_pool, shared_table, shared_length: int, block_tables, lengths,
                             scale=None, check_values=True):
    """Cascade attention with the Triton kernel of triton_paged.py, run twice: [B, H_q, D] in q's
    dtype. Over the shared pages, every branch's query heads of a kv head form the group the kernel
    loads as one block ([B * G, D]), so each shared page is read once per kv head; the pages are cut
    into splits of SPLIT positions, one program each, merged by log-sum-exp. Then over the branches'
    own pages, as paged_attention; the two are merged."""
    check_cascade_inputs(q, k_pool, v_pool, shared_table, shared_length, block_tables, lengths, check_values)
    triton_paged.require_triton("cascade_attention", q.device)
    B, H_q, D = q.shape
    _, page_size, H_kv, _ = k_pool.shape
    G, f32 = H_q // H_kv, dict(dtype=torch.float32, device=q.device)
    out_o, lse_o = torch.empty(B, H_q, D, **f32), torch.empty(B, H_q, **f32)
    triton_paged.launch(q, k_pool, v_pool, None, block_tables, lengths, out_o, scale, lse=lse_o)
    if shared_length == 0:
        return out_o.to(q.dtype)
    # One "sequence" per split, all with the same queries: kv head h's group is every branch's heads h * G + g.
    queries = q.reshape(B, H_kv, G, D).transpose(0, 1).reshape(1, H_kv * B * G, D)   # [1, H_kv * B * G, D]
    pages = max(SPLIT // page_size, 1)                                 # shared pages per split
    splits = -(-len(shared_table) // pages)
    tables = F.pad(shared_table, (0, splits * pages - len(shared_table))).view(splits, pages)  # [splits, pages]
    ends = torch.arange(1, splits + 1, device=q.device) * pages * page_size
    split_lengths = (ends.clamp(max=shared_length) - ends + pages * page_size).to(torch.int32)  # [splits]
    out_s, lse_s = torch.empty(splits, H_kv * B * G, D, **f32), torch.empty(splits, H_kv * B * G, **f32)
    triton_paged.launch(queries.expand(splits, -1, -1), k_pool, v_pool, None, tables, split_lengths, out_s, scale,
                        lse=lse_s)
    weights = torch.softmax(lse_s, dim=0)                              # [splits, H_kv * B * G]: a merge of all
    out_s = (weights[..., None] * out_s).sum(0).view(H_kv, B, G, D).transpose(0, 1).reshape(B, H_q, D)
    lse_s = torch.logsumexp(lse_s, dim=0).view(H_kv, B, G).transpose(0, 1).reshape(B, H_q)
    return merge_attention(out_s, lse_s, out_o, lse_o)[0].to(q.dtype)
