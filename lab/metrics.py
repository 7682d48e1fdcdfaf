"""Comparisons of score vectors and text likelihood."""

import math

import torch
import torch.nn.functional as F

from .models import forward


def logit_diff(a: torch.Tensor, b: torch.Tensor) -> dict:
    """Largest and median |a - b| over every element (logits of the same positions)."""
    d = (a.float() - b.float()).abs().flatten()
    return dict(max=d.max().item(), median=d.median().item())


def kl_divergence(p_logits: torch.Tensor, q_logits: torch.Tensor) -> torch.Tensor:
    """KL(p || q) in nats over the last dimension, from logits; p is the reference."""
    p_log, q_log = F.log_softmax(p_logits.double(), -1), F.log_softmax(q_logits.double(), -1)
    return (p_log.exp() * (p_log - q_log)).sum(-1)


@torch.inference_mode()
def perplexity(model, sequences) -> float:
    """exp(mean negative log-likelihood of each next token), over every predicted position of every sequence."""
    nll, count = 0.0, 0
    for ids in sequences:
        ids = torch.as_tensor(ids, dtype=torch.long)[None]                # [1, T]
        logits = forward(ids, model.weights, model.config)[0, :-1]         # [T-1, V]
        nll += F.cross_entropy(logits.float(), ids[0, 1:], reduction="sum").item()
        count += ids.shape[1] - 1
    return math.exp(nll / count)
