"""Reference solutions for chapter 9: the rejection rule of speculative sampling; rolling a ListCache back."""

import torch


def accept(p, q, guess, generator=None) -> list[int]:
    """p [k + 1, V] the target's probabilities, q [k, V] the draft's, guess k ids drawn from q."""
    out = []
    for i, x in enumerate(guess):
        if torch.rand((), generator=generator) < p[i, x] / q[i, x]:   # kept with probability min(1, p/q)
            out.append(x)
            continue
        residual = (p[i] - q[i]).clamp(min=0)                          # [V] what p has beyond q
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
    return out + [int(torch.multinomial(p[len(guess)], 1, generator=generator))]   # all kept: a bonus from p_k


def rollback(cache, n):
    """Keep positions 0 .. n - 1 of a ListCache: whole chunks while they fit, then the first part of the next."""
    for chunks in cache.keys + cache.values:       # per layer, chunks [B, H_kv, T_i, D] in order
        kept, held = [], 0
        for c in chunks:
            if held >= n:
                break
            kept.append(c if held + c.shape[2] <= n else c[:, :, :n - held].clone())   # clone: free the rest
            held += c.shape[2]
        chunks[:] = kept
    cache.length = n
