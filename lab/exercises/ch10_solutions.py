"""Reference solutions for chapter 10: attention in latent space (the absorbed form); the pages of a local group."""

import torch
import torch.nn.functional as F


def latent_attention(q, c_k, c_v, U_k, U_v, group_size) -> torch.Tensor:
    """q `[H_q, T, D]` (positions L - T .. L - 1, L the cached positions, not layers), c_k, c_v `[L, r/2]`,
    U_k, U_v `[H_kv D, r/2]` -> `[H_q, T, D]`.

    q_h . k_t = q_h . U_k,g c_t = (U_k,g^T q_h) . c_t: each query head in latent coordinates, r/2 values instead of
    D, and every cached position read as it is stored. The output sum_t p_t U_v,g c_v,t = U_v,g (sum_t p_t c_v,t):
    one product with U_v per query, whatever L is. The scale stays the model's, 1 / sqrt(D)."""
    H_q, T, D = q.shape
    L, r = c_k.shape
    per_head = lambda U: U.view(-1, D, r).repeat_interleave(group_size, 0)     # noqa: E731  [H_q, D, r]
    q_latent = q @ per_head(U_k)                                                # [H_q, T, r]
    sees = torch.arange(L)[None, :] <= torch.arange(L - T, L)[:, None]          # [T, L]
    weights = F.softmax((q_latent @ c_k.T / D**0.5).masked_fill(~sees, float("-inf")), dim=-1)   # [H_q, T, L]
    return (weights @ c_v) @ per_head(U_v).transpose(1, 2)                      # [H_q, T, r] -> [H_q, T, D]


def local_pages(context, window, sinks, page_size, chunk) -> int:
    """The most pages a local group holds while one sequence grows to `context` in steps of `chunk`.

    Before the step that starts at length a reserves, the group gives back the pages before page
    (a + 1 - window) // page_size (every position of them lies before the window of the query at a), but not the
    S = ceil(sinks / page_size) sink pages. Then the step fills pages up to N = ceil(end / page_size), end =
    min(a + chunk, context). So right after the step the group holds the sink pages it has, min(S, N), and pages
    max(S, (a + 1 - window) // page_size) .. N - 1. The count is largest right after a step (a step only frees
    pages before it reserves); which step it is depends on where a falls within a page, so take the largest over
    the steps: context / chunk of them, each O(1)."""
    S = -(-sinks // page_size)
    most = 0
    for a in range(0, context, chunk):
        N = -(-min(a + chunk, context) // page_size)
        first = max(S, (a + 1 - window) // page_size)
        most = max(most, min(S, N) + max(0, N - first))
    return most
