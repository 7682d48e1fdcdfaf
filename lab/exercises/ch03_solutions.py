"""Reference solutions for chapter 3 (the tests run the checks on these)."""

import torch

from ..bench import time_rounds
from ..cache import StaticCache
from ..models import forward_cached


def _parts(c, T):
    D, hd, Hq, Hkv = c.d_model, c.head_dim, c.n_heads, c.n_kv_heads
    projections = 2 * (D * Hq * hd + 2 * D * Hkv * hd + Hq * hd * D)  # q, k, v, o
    mlp = 2 * (3 if c.arch == "llama" else 2) * D * c.d_ff             # gate, up, down (GPT-2: fc, proj)
    attention = 2 * 2 * Hq * hd * (T + 1)                              # q k^T and weights v over T+1 keys
    return projections + mlp, attention


def decode_flops(config, T):
    dense, attention = _parts(config, T)
    return config.n_layers * (dense + attention) + 2 * config.d_model * config.vocab_size


def attention_share(config, T):
    return config.n_layers * _parts(config, T)[1] / decode_flops(config, T)


@torch.inference_mode()
def measured_attention_share(model, T, rounds=7):
    """Percent of a cached decode step's time spent in attention at context T, on this machine."""
    cfg, w = model.config, model.weights
    cache = StaticCache(cfg, T + 1)
    for i in range(cfg.n_layers):                                  # T positions of random keys and values
        k, v = (torch.randn(1, cfg.n_kv_heads, T, cfg.head_dim) for _ in range(2))  # [1, H_kv, T, D]
        cache.update(i, k, v)
    cache.advance(T)
    ids = torch.zeros(1, 1, dtype=torch.long)                      # [1, 1]: which token does not matter

    def skip(i, q, k, v):                                          # store k, v; return q's shape, no attention
        cache.update(i, k, v)
        return q

    def without():
        cache.attend = skip                                        # forward_cached uses a cache's own attend
        try:
            forward_cached(ids, w, cfg, cache)
        finally:
            del cache.attend

    r = time_rounds({"with": lambda: forward_cached(ids, w, cfg, cache), "without": without},
                    warmup=1, rounds=rounds, setup=lambda: cache.crop(T))
    return 100 * (1 - r["without"]["median"] / r["with"]["median"])
