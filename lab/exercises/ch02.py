"""Chapter 2 exercises: the mask offset, how many sequences fit, and crop."""

import torch
import torch.nn.functional as F

from ..cache import ConcatCache, StaticCache
from ..models import forward, forward_cached, llama, load


def _chunked_logits(model, ids, chunk, mask_fn):
    """A chunked prefill through a ConcatCache whose attention uses mask_fn(start, T) (None: is_causal)."""
    cfg, w = model.config, model.weights
    cache, out = ConcatCache(cfg), []
    for s in range(0, ids.shape[1], chunk):
        piece = ids[:, s:s + chunk]
        T, positions = piece.shape[1], torch.arange(s, s + piece.shape[1])
        mask = mask_fn(s, T) if mask_fn else None

        def attend(i, q, k, v, mask=mask):
            keys, values = cache.update(i, k, v)
            return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                                  enable_gqa=True)

        x = llama.embed(piece, w)
        rope_cs = llama.rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
        for i in range(cfg.n_layers):
            x = llama.block(x, w, i, cfg, attend, rope_cs)
        cache.advance(T)
        out.append(llama.head(x, w, cfg))
    return torch.cat(out, dim=1)


@torch.no_grad()
def check_mask_offset(offset_causal_mask):
    """offset_causal_mask(start, T) -> bool [T, start + T]. Oracle: a one-shot forward without a cache."""
    m = offset_causal_mask(3, 4)
    assert tuple(m.shape) == (4, 7) and m.dtype == torch.bool, (
        f"offset_causal_mask(3, 4) gave {m.dtype} {tuple(m.shape)}; expected a bool [4, 7] (one row per new "
        "query, one column per key, cached ones included)")
    model = load("tiny-llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    want = forward(ids, model.weights, model.config)
    for chunk in (1, 7, 16):
        got = _chunked_logits(model, ids, chunk, offset_causal_mask)
        assert torch.allclose(got, want, atol=1e-5), (
            f"chunks of {chunk}: logits differ from the one-shot forward by {(got - want).abs().max():.3g}. "
            "Hint: query i of the chunk sits at position start + i.")
    wrong = _chunked_logits(model, ids, 7, None)  # is_causal=True: the triangle aligned top-left
    p = int(((wrong - want).abs().amax(-1)[0] > 1e-5).nonzero()[0])
    print(f"correct. Without the offset (is_causal=True), chunks of 7 first go wrong at position {p}, in chunk "
          f"{p // 7}: the triangle is aligned to the top-left corner, so that query sees key 0 alone")
    return True


def check_sequences_that_fit(fn):
    """fn(memory_bytes, weight_bytes, config, tokens, dtype_bytes) -> sequences whose caches fit beside the weights.

    Oracle: the bytes of a real StaticCache for one sequence.
    """
    for name, dtype in (("tiny-llama", torch.float32), ("tiny-gpt2", torch.bfloat16), ("smollm2", torch.float16)):
        model = load(name)
        for tokens, memory in ((128, 2**24), (1000, 2**30), (4096, 80 * 2**30)):
            weights = sum(t.nbytes for t in model.weights.values())
            per_seq = StaticCache(model.config, tokens, dtype=dtype, device="meta").nbytes()
            want = max(0, (memory - weights) // per_seq)
            got = fn(memory, weights, model.config, tokens, torch.empty((), dtype=dtype).element_size())
            assert got == want, (f"{name}, {tokens} tokens, {memory / 2**30:.2f} GiB: you said {got}, "
                                 f"the caches say {want}. Hint: whole sequences only.")
    print("correct")
    return True


@torch.no_grad()
def check_crop(crop):
    """crop(cache, n) on a ConcatCache, without its own crop. Oracle: a cache that never held the extra positions."""
    model = load("tiny-llama")
    cfg, w = model.config, model.weights
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 30), generator=g)
    more = torch.randint(0, cfg.vocab_size, (1, 4), generator=g)
    for n in (0, 1, 17, 30):
        cropped, clean = ConcatCache(cfg), ConcatCache(cfg)
        forward_cached(ids, w, cfg, cropped)
        crop(cropped, n)
        assert cropped.length == n, f"after crop to {n} the length is {cropped.length}"
        if n:
            forward_cached(ids[:, :n], w, cfg, clean)
        assert cropped.nbytes() == clean.nbytes(), (f"crop to {n}: the cache still holds {cropped.nbytes()} bytes, "
                                                    f"{clean.nbytes()} expected. Hint: a slice keeps its storage.")
        a, b = forward_cached(more, w, cfg, cropped), forward_cached(more, w, cfg, clean)
        assert torch.allclose(a, b, atol=1e-6), f"crop to {n}, then continue: logits differ by {(a - b).abs().max()}"
    print("correct")
    return True
