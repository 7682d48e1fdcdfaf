"""Reference solutions for chapter 1 (the tests run the checks on these)."""

import torch

from ..bench import time_call
from ..models import forward


def positions_without_cache(prompt_len, new_tokens):
    return sum(prompt_len + s for s in range(new_tokens))  # step s runs the prompt and s generated tokens


def bytes_per_position(n_layers, n_kv_heads, head_dim, dtype):
    return 2 * n_layers * n_kv_heads * head_dim * dtype.itemsize  # K and V, every layer, every kv head


def bidirectional_attention(i, q, k, v):  # q, k, v [B, H, T, D]
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5  # [B, H, T, T]: every query sees every key
    return torch.softmax(scores, dim=-1) @ v                # [B, H, T, D]


def step_ms(model, T):
    """One uncached decode step at context T: a forward over T positions, median of 5 after 1 warm-up."""
    ids = torch.randint(0, model.config.vocab_size, (1, T))  # [1, T]; timing does not depend on the ids
    t = time_call(lambda: forward(ids, model.weights, model.config, last_only=True), warmup=1, reps=5)
    return t["median"] * 1e3
