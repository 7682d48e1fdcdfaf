"""Attention through a cache: the one piece of the forward that a KV cache changes."""

import torch
import torch.nn.functional as F


def offset_causal_mask(start: int, T: int, device=None) -> torch.Tensor:
    """Which keys each of T new queries may see, when `start` positions are already cached.

    Query i sits at absolute position start + i and sees keys 0 .. start + i: a bool
    `[T, start + T]`, the causal triangle shifted right by `start`. With start = 0 this is the
    ordinary causal mask. `is_causal=True` instead aligns the triangle to the top-left corner:
    query i would see keys 0 .. i only, so every query of the chunk, the last one included, would
    miss cached keys (chapter 2).
    """
    q_pos = torch.arange(start, start + T, device=device)[:, None]  # [T, 1]
    k_pos = torch.arange(start + T, device=device)[None, :]          # [1, start+T]
    return k_pos <= q_pos


def cached_attention(cache, positions):
    """An `attend(i, q, k, v)` that stores the new k, v in the cache and attends over all keys.

    positions `[T]` are those of the new tokens. A cache with its own attention (the paged cache,
    which reads keys page by page and handles sequences of different lengths) provides `attend`.
    """
    if hasattr(cache, "attend"):
        return cache.attend
    T, start = positions.shape[-1], int(positions[0])
    # one query (decode) sees every key: no mask needed
    mask = None if T == 1 else offset_causal_mask(start, T, positions.device)

    def attend(i, q, k, v):
        keys, values = cache.update(i, k, v)                          # [B, H_kv, start+T, D]
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask,
                                              enable_gqa=True)        # [B, H_q, T, D]

    return attend
