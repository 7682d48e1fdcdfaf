"""Chapter 1 exercises: count the positions, size the cache, and see what the causal mask buys."""

import torch
import torch.nn.functional as F

from ..engine import RecomputeBackend, generate
from ..models import load


def check_positions_without_cache(fn):
    """fn(prompt_len, new_tokens) -> positions a cache-less greedy loop pushes through the model.

    Oracle: the RecomputeBackend's own count on a tiny model, for several prompt and output lengths.
    """
    model = load("tiny-mqa")
    for P, n in [(1, 1), (17, 32), (5, 9), (100, 3), (3, 40)]:
        backend = RecomputeBackend(model)
        generate(backend, [7] * P, n)
        got = fn(P, n)
        assert got == backend.positions, (
            f"prompt {P}, {n} new tokens: you said {got}, the backend counted {backend.positions}. "
            "Hint: step s (from 0) runs the prompt plus the s tokens generated so far.")
    print("correct: the count grows with the square of the number of new tokens")
    return True


def check_bytes_per_position(fn):
    """fn(n_layers, n_kv_heads, head_dim, dtype) -> bytes one position occupies in the KV cache.

    Oracle: allocate the keys and values of one position for every layer and add up their bytes.
    """
    for L, H, D, dtype in [(12, 12, 64, torch.float16), (30, 3, 64, torch.bfloat16), (28, 8, 128, torch.float32),
                           (2, 1, 8, torch.int8)]:
        held = sum(t.nbytes for _ in range(L) for t in (torch.empty(1, H, 1, D, dtype=dtype),) * 2)
        got = fn(L, H, D, dtype)
        assert got == held, (f"{L} layers, {H} kv heads, head_dim {D}, {dtype}: you said {got}, the tensors "
                             f"hold {held} bytes. Hint: keys and values, every layer, every kv head.")
    print("correct: 2 x layers x kv_heads x head_dim x bytes per element")
    return True


def check_bidirectional_attention(attend):
    """attend(i, q, k, v) -> attention WITHOUT a causal mask, q, k, v `[B, H, T, D]`.

    Oracle: scaled_dot_product_attention with is_causal=False. Then the check shows what it breaks:
    with it, changing the last token moves the logits of every earlier position, so no earlier
    position's keys and values could be reused: a cache needs the causal mask.
    """
    from ..models import gpt2

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 16, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q, k, v)
    got = attend(0, q, k, v)
    assert got.shape == want.shape, f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    assert torch.allclose(got, want, atol=1e-5), "not softmax(q k^T / sqrt(d)) v over all positions"

    model = load("tiny-gpt2")
    ids = torch.randint(0, model.config.vocab_size, (1, 12), generator=g)
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1) % model.config.vocab_size

    def run(x):
        h = gpt2.embed(x, model.weights, torch.arange(x.shape[1]))
        for i in range(model.config.n_layers):
            h = gpt2.block(h, model.weights, i, model.config, attend)
        return gpt2.head(h, model.weights, model.config)[0]

    with torch.inference_mode():
        moved = (run(ids) - run(changed)).abs().amax(-1)[:-1].max().item()
    assert moved > 1e-4, "without the mask the earlier positions should move"
    print(f"correct: without the causal mask, earlier logits move by up to {moved:.3g} when the last token changes")
    return True
