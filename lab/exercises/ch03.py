"""Chapter 3 exercises: count the work of one cached decode step, and how much of it is attention."""

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..cache import StaticCache
from ..models import gpt2, llama, load


def counted_step(model, T):
    """FLOPs of one cached decode step at context T, counted by PyTorch while the step runs.

    Attention is written out as two matrix products (scores = q k^T, then weights v) so that the counter
    sees it; projections, MLP and output head are the model's own code. Returns (total, attention).
    """
    cfg, w = model.config, model.weights
    cache = StaticCache(cfg, T + 1)
    ids = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(T))
    attention_flops = 0

    def attend(i, q, k, v):
        nonlocal attention_flops
        keys, values = cache.update(i, k, v)                       # [1, H_kv, T+1, D]
        g = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
        with FlopCounterMode(display=False) as inner:
            weights = torch.softmax(q @ keys.transpose(-2, -1) / q.shape[-1] ** 0.5, -1)  # [1, H, 1, T+1]
            out = weights @ values                                                          # [1, H, 1, D]
        attention_flops += inner.get_total_flops()
        return out

    with torch.inference_mode():
        cache.length = T  # the counts do not depend on the cached values: skip the prefill, keep the zeros
        x_ids, pos = ids[:, T:], torch.arange(T, T + 1)
        with FlopCounterMode(display=False) as outer:
            if cfg.arch == "gpt2":
                x = gpt2.embed(x_ids, w, pos)
                for i in range(cfg.n_layers):
                    x = gpt2.block(x, w, i, cfg, attend)
                gpt2.head(x, w, cfg)
            else:
                x = llama.embed(x_ids, w)
                rope_cs = llama.rope_tables(pos, cfg.head_dim, cfg.rope_theta, x.dtype)
                for i in range(cfg.n_layers):
                    x = llama.block(x, w, i, cfg, attend, rope_cs)
                llama.head(x, w, cfg)
        cache.advance(1)
    return outer.get_total_flops(), attention_flops


CASES = [("tiny-llama", 16), ("tiny-gpt2", 100), ("tiny-mqa", 7), ("smollm2", 512)]


def check_decode_flops(fn):
    """fn(config, T) -> FLOPs (2 per multiply-add) of one cached decode step at context T, output head included."""
    for name, T in CASES:
        model = load(name)
        want, _ = counted_step(model, T)
        got = fn(model.config, T)
        assert got == want, (f"{name} at T={T}: you said {got:,}, PyTorch counted {want:,}. Hint: q and o "
                             "projections use all query heads, k and v only the kv heads; attention reads T+1 keys.")
    print("correct")
    return True


def check_attention_share(fn):
    """fn(config, T) -> the fraction of a cached step's FLOPs spent in attention over the cache."""
    for name, T in CASES + [("smollm2", 4096)]:
        model = load(name)
        total, attention = counted_step(model, T)
        got = fn(model.config, T)
        assert abs(got - attention / total) < 1e-9, (f"{name} at T={T}: you said {got:.4f}, "
                                                     f"counted {attention / total:.4f}")
    print(f"correct: at T={T} attention is {attention / total:.0%} of SmolLM2's cached step")
    return True
