"""Reference solutions for chapter 2 (the tests run the checks on these)."""

import torch

from ..bench import time_steps
from ..models import forward_cached


def offset_causal_mask(start, T):
    q_pos = torch.arange(start, start + T)[:, None]   # [T, 1] absolute positions of the queries
    return torch.arange(start + T)[None, :] <= q_pos    # [T, start + T]


def sequences_that_fit(memory_bytes, weight_bytes, config, tokens, dtype_bytes):
    per_sequence = 2 * config.n_layers * config.n_kv_heads * config.head_dim * dtype_bytes * tokens
    return max(0, (memory_bytes - weight_bytes) // per_sequence)


def crop(cache, n):
    for i in range(cache.n_layers):
        if cache.keys[i] is not None:
            cache.keys[i] = cache.keys[i][:, :, :n].clone() if n else None     # clone: release the rest
            cache.values[i] = cache.values[i][:, :, :n].clone() if n else None
    cache.length = n


def decode_step_ms(model, cache, context, reps=9):
    """Open-ended exercise: median ms of one decode step after `context` cached positions."""
    cfg, w = model.config, model.weights
    ids = torch.randint(0, cfg.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        forward_cached(ids[:, :context], w, cfg, cache)            # prefill, untimed
    token = ids[:, context:]                                       # [1, 1]
    return 1e3 * time_steps(lambda: cache.crop(context),           # back to `context` before each step
                            lambda: forward_cached(token, w, cfg, cache), reps=reps)["median"]
