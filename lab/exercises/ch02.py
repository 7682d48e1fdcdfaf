"""Chapter 2 exercises: the mask offset, how many sequences fit, crop, and an open-ended timing.

Each check enforces its exercise's rule: while the reader's function runs, lab's offset_causal_mask (and
PyTorch's causal_lower_right, which builds the same mask) raises; lab's caches and sizing functions raise;
the cache's own crop, reset and truncation raise, however they are reached (rules.functions_raise). The
cases are drawn fresh at every run (`seed=` draws the same ones again), and the oracles run only after the
reader's function has answered.
"""

import random

import torch
import torch.nn.functional as F
from torch.nn.attention import bias as torch_bias

from ..cache import ConcatCache, EvictingCache, PagedCache, QuantizedCache, StaticCache, make_cache, sizing
from ..cache import base as cache_base
from ..cache.base import KVCache
from ..models import forward, forward_cached, load
from ..models.config import ModelConfig
from .rules import drawn_with, fresh_seed, functions_raise, unchanged


class _MaskedCache(ConcatCache):
    """A ConcatCache whose attention uses mask_fn(start, T) -> bool `[T, start + T]` (None: is_causal=True,
    PyTorch's triangle aligned to the top-left corner)."""

    def __init__(self, config, mask_fn):
        super().__init__(config)
        self.mask_fn = mask_fn

    def attend(self, layer, q, k, v):  # q [B, H_q, T, D]; k, v [B, H_kv, T, D] -> [B, H_q, T, D]
        keys, values = self.update(layer, k, v)                   # [B, H_kv, start + T, D]
        T = q.shape[2]
        mask = self.mask_fn(keys.shape[2] - T, T) if self.mask_fn else None
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=True)


def _chunked_logits(model, ids, chunk, mask_fn):
    """Logits `[1, T, V]` of ids `[1, T]` prefilled in chunks of `chunk` through a _MaskedCache."""
    cache = _MaskedCache(model.config, mask_fn)
    pieces = [forward_cached(ids[:, s:s + chunk], model.weights, model.config, cache)
              for s in range(0, ids.shape[1], chunk)]
    return torch.cat(pieces, dim=1)


# lab's mask, and PyTorch's own builder of the same mask (causal_lower_right(T, start + T) materialized)
MASKS = (cache_base.offset_causal_mask, torch_bias.causal_lower_right, torch_bias.causal_upper_left,
         torch_bias.CausalBias)
OWN_MASK = ("your function called lab's offset_causal_mask (or PyTorch's causal bias): the exercise is to write "
            "the mask yourself")


@torch.no_grad()
def check_mask_offset(offset_causal_mask, seed=None):
    """offset_causal_mask(start, T) -> bool [T, start + T]. Oracle: a one-shot forward without a cache, and
    for starts too large to tabulate beforehand, a triangle shifted right by start.

    Rule: write the mask yourself. lab's own offset_causal_mask (and PyTorch's causal_lower_right) raise while
    the check runs your function.
    """
    seed = fresh_seed(seed)
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    model = load("tiny-llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=g)
    far = [(rng.randint(100, 5000), rng.randint(1, 64)) for _ in range(3)]   # (start, T) no table holds
    with unchanged(__name__), functions_raise(*MASKS, why=OWN_MASK):
        m = offset_causal_mask(3, 4)
        assert isinstance(m, torch.Tensor) and tuple(m.shape) == (4, 7) and m.dtype == torch.bool, (
            f"offset_causal_mask(3, 4) gave {getattr(m, 'dtype', type(m))} {tuple(getattr(m, 'shape', ()))}; "
            "expected a bool [4, 7] (one row per new query, one column per key, cached ones included)")
        chunked = {chunk: _chunked_logits(model, ids, chunk, offset_causal_mask) for chunk in (1, 7, 16)}
        masks = [offset_causal_mask(start, T) for start, T in far]
    want = forward(ids, model.weights, model.config)
    with drawn_with(seed, "check_mask_offset"):
        for chunk, got in chunked.items():
            assert torch.allclose(got, want, atol=1e-5), (
                f"chunks of {chunk}: logits differ from the one-shot forward by {(got - want).abs().max():.3g}. "
                "Hint: query i of the chunk sits at position start + i.")
        for (start, T), m in zip(far, masks, strict=True):
            shifted = torch.ones(T, start + T, dtype=torch.bool).tril(start)   # row i sees keys 0 .. start + i
            assert isinstance(m, torch.Tensor) and m.shape == shifted.shape and torch.equal(m, shifted), (
                f"offset_causal_mask({start}, {T}) is not the causal triangle shifted right by {start}")
    wrong = _chunked_logits(model, ids, 7, None)  # is_causal=True: the triangle aligned top-left
    p = int(((wrong - want).abs().amax(-1)[0] > 1e-5).nonzero()[0])
    print(f"correct. Without the offset (is_causal=True), chunks of 7 first go wrong at position {p}, in chunk "
          f"{p // 7}: the triangle is aligned to the top-left corner, so that query sees key 0 alone")
    return True


CACHES = (StaticCache, ConcatCache, PagedCache, QuantizedCache, EvictingCache, make_cache, sizing.cache_bytes,
          sizing.bytes_per_position, ModelConfig.kv_bytes_per_position)
OWN_SIZING = ("your function called lab's caches or sizing functions: the exercise is to work it out from the "
              "model's shape")


def check_sequences_that_fit(fn, seed=None):
    """fn(memory_bytes, weight_bytes, config, tokens, dtype_bytes) -> sequences whose caches fit beside the weights.

    Oracle: the bytes of a real StaticCache for one sequence, for memories and lengths drawn fresh. Rule: work
    it out from the model's shape (layers, KV heads, head size); lab's caches, cache_bytes,
    bytes_per_position and the config's kv_bytes_per_position raise while it runs.
    """
    seed = fresh_seed(seed)
    rng = random.Random(seed)
    cases = []
    for name in ("tiny-llama", "tiny-gpt2", "smollm2"):
        model = load(name)
        weights = sum(t.nbytes for t in model.weights.values())
        for _ in range(3):
            dtype = rng.choice((torch.float8_e4m3fn, torch.bfloat16, torch.float16, torch.float32))
            cases.append((name, model.config, rng.randint(1, 32768), rng.randint(weights // 2, 2**37), weights,
                          dtype))
    got = []
    with unchanged(__name__), functions_raise(*CACHES, why=OWN_SIZING):
        for _, config, tokens, memory, weights, dtype in cases:
            got.append(fn(memory, weights, config, tokens, dtype.itemsize))
    with drawn_with(seed, "check_sequences_that_fit"):
        for (name, config, tokens, memory, weights, dtype), g in zip(cases, got, strict=True):
            per_seq = StaticCache(config, tokens, dtype=dtype, device="meta").nbytes()
            want = max(0, (memory - weights) // per_seq)
            assert g == want, (f"{name}, {tokens} tokens of {dtype.itemsize} bytes, {memory / 2**30:.2f} GiB: you "
                               f"said {g}, the caches say {want}. Hint: whole sequences only.")
    print(f"correct (cases drawn with seed={seed})")
    return True


OWN_CROP = ("your crop called the cache's own crop (cache.crop(), reset or _truncate, however reached): the "
            "exercise is to crop the cache's tensors yourself")


@torch.no_grad()
def check_crop(crop, seed=None):
    """crop(cache, n) on a ConcatCache, without its own crop. Oracle: a cache that never held the extra positions.

    Rule: do not call cache.crop (nor reset or _truncate): they raise while your crop runs, however they are
    reached (unbound, through super(), ...).
    """
    model = load("tiny-llama")
    cfg, w = model.config, model.weights
    seed = fresh_seed(seed)
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, cfg.vocab_size, (1, 30), generator=g)
    more = torch.randint(0, cfg.vocab_size, (1, 4), generator=g)
    for n in (0, 1, 17, 30):
        cropped, clean = ConcatCache(cfg), ConcatCache(cfg)
        forward_cached(ids, w, cfg, cropped)
        with unchanged(__name__), functions_raise(KVCache.crop, KVCache.reset, ConcatCache._truncate, why=OWN_CROP):
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


def compare_decode_step(design: str, measured_ms: float, path=None) -> float:
    """Open-ended: the reader's median decode-step time (ms) of `design` ("concat" or "static") on SmolLM2
    at the book's context (`ch02.decode_ms.context`), beside the book's; returns yours / the book's."""
    from . import compare_with_book

    if design not in ("concat", "static"):
        raise ValueError(f"design must be 'concat' or 'static', got {design!r}")
    extra = {} if path is None else {"path": path}
    return compare_with_book(f"ch02.decode_ms.{design}", measured_ms, "ms", **extra)
