"""Contiguous keys and values written into pages (the inverse of `paged_attention_reference`'s
gather): chapter 5 and the GPU script time paged attention on them against the contiguous original.
"""

import math

import torch
import torch.nn.functional as F


def paged_copy(k, v, page_size: int, generator=None):
    """The same keys and values `[B, H_kv, L, D]` (CPU tensors) in pages scattered at random over a
    pool (`generator` seeds the order), the tail of each last page zero. Returns pools
    `[B * P, page_size, H_kv, D]` (k's and v's dtype), block tables int32 `[B, P]` and lengths int32
    `[B]` (all L), with P = ceil(L / page_size)."""
    B, H, L, D = k.shape
    P = math.ceil(L / page_size)
    tables = torch.randperm(B * P, generator=generator).view(B, P).to(torch.int32)      # [B, P]
    pools = []
    for x in (k, v):
        padded = F.pad(x.transpose(1, 2), (0, 0, 0, 0, 0, P * page_size - L))             # [B, P * page, H, D]
        pool = torch.zeros(B * P, page_size, H, D, dtype=x.dtype)
        pool[tables.long()] = padded.reshape(B, P, page_size, H, D)
        pools.append(pool)
    return pools[0], pools[1], tables, torch.full((B,), L, dtype=torch.int32)
