"""Reference solutions for chapter 7: key smoothing before per-token INT8; the smallest eviction budget within
1% of the full cache's loss."""

import torch

from ..cache import ConcatCache, EvictingCache
from .ch07 import TOLERANCE, decoding_loss


def smooth_and_quantize(keys):
    # keys [B, H, T, D]: the outlier channels' offset is shared by every token, so the mean over the positions
    # takes it out; what is left is small in every channel, and one scale per token fits it well
    mean = keys.float().mean(dim=2, keepdim=True)                       # [B, H, 1, D], kept in float
    x = keys.float() - mean                                             # [B, H, T, D]
    scales = x.abs().amax(dim=-1, keepdim=True) / 127                   # [B, H, T, 1]
    codes = torch.round(x / torch.where(scales > 0, scales, 1)).clamp(-127, 127).to(torch.int8)
    return codes, scales, mean


def dequantize(codes, scales, mean):
    return codes.float() * scales + mean                                # [B, H, T, D]


def smallest_budget(model, ids, policy, budgets):
    full = decoding_loss(model, ids, ConcatCache(model.config))
    for budget in sorted(budgets):           # every candidate: the loss need not fall as the budget grows
        if decoding_loss(model, ids, EvictingCache(model.config, budget, policy)) <= (1 + TOLERANCE) * full:
            return budget
    raise ValueError(f"no budget in {budgets} keeps the loss within {TOLERANCE:.0%} of the full cache's")
