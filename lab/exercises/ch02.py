"""Chapter 2 exercises: the mask offset, how many sequences fit, crop, and an open-ended timing.

Each check enforces its exercise's rule: the mask must be the reader's own (lab's
offset_causal_mask is replaced by a stub that raises while the check runs), the sequence count must be
worked out from the model's shape (lab's caches and sizing functions raise while it runs), and crop
must not call the cache's own crop (the check hands over a cache whose crop raises).
"""

import contextlib
import functools
import inspect
import sys

import torch
import torch.nn.functional as F

from .. import cache as lab_cache
from ..cache import ConcatCache, StaticCache, sizing
from ..cache import base as cache_base
from ..models import forward, forward_cached, load


@contextlib.contextmanager
def _forbidden(objects: dict, reader_fn=None):
    """While inside, every module attribute bound to one of `objects` ({name: object}), and every
    closure cell of `reader_fn` that holds one, is a stub that raises AssertionError: a reader's
    function that calls lab's own version fails, however it was imported."""
    by_id = {id(obj): name for name, obj in objects.items()}
    patched = []  # (get, set) pairs: modules' namespaces and the reader's closure cells
    for module in list(sys.modules.values()):
        namespace = getattr(module, "__dict__", None)
        if isinstance(namespace, dict):
            patched += [(namespace, attr, val) for attr, val in list(namespace.items()) if id(val) in by_id]
    cells = [c for c in (getattr(reader_fn, "__closure__", None) or ()) if _filled(c) and id(c.cell_contents) in by_id]

    def stub(name):
        def forbidden(*args, **kwargs):
            raise AssertionError(f"your function called lab's {name}: the exercise is to write it "
                                 "without it")
        return forbidden

    originals = [c.cell_contents for c in cells]
    try:
        for namespace, attr, val in patched:
            namespace[attr] = stub(by_id[id(val)])
        for c in cells:
            c.cell_contents = stub(by_id[id(c.cell_contents)])
        yield
    finally:
        for namespace, attr, val in patched:
            namespace[attr] = val
        for c, val in zip(cells, originals, strict=True):
            c.cell_contents = val


def _uses(fn, obj) -> bool:
    """Is fn the object itself, a wrapper or partial of it, or a closure/default that holds it?"""
    seen = []
    while fn is not None and not any(fn is s for s in seen):
        if fn is obj:
            return True
        seen.append(fn)
        held = [c.cell_contents for c in (getattr(fn, "__closure__", None) or ()) if _filled(c)]
        held += list(getattr(fn, "__defaults__", None) or ())
        if any(h is obj for h in held):
            return True
        fn = fn.func if isinstance(fn, functools.partial) else getattr(fn, "__wrapped__", None)
    return False


def _filled(cell) -> bool:
    try:
        _ = cell.cell_contents
    except ValueError:  # an empty cell
        return False
    return True


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


@torch.no_grad()
def check_mask_offset(offset_causal_mask):
    """offset_causal_mask(start, T) -> bool [T, start + T]. Oracle: a one-shot forward without a cache.

    Rule: write the mask yourself. lab's own offset_causal_mask is rejected, and it raises while the
    check runs your function.
    """
    lab_mask = cache_base.offset_causal_mask
    module = getattr(inspect.unwrap(offset_causal_mask), "__module__", "") or ""
    assert not _uses(offset_causal_mask, lab_mask) and not module.startswith(("lab.models", "lab.cache")), (
        "that is lab's own offset_causal_mask (or a wrapper of it): the exercise is to write the mask yourself")
    model = load("tiny-llama")
    ids = torch.randint(0, model.config.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    want = forward(ids, model.weights, model.config)
    with _forbidden({"offset_causal_mask": lab_mask}, offset_causal_mask):
        m = offset_causal_mask(3, 4)
        assert isinstance(m, torch.Tensor) and tuple(m.shape) == (4, 7) and m.dtype == torch.bool, (
            f"offset_causal_mask(3, 4) gave {getattr(m, 'dtype', type(m))} {tuple(getattr(m, 'shape', ()))}; "
            "expected a bool [4, 7] (one row per new query, one column per key, cached ones included)")
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

    Oracle: the bytes of a real StaticCache for one sequence. Rule: work it out from the model's shape
    (layers, KV heads, head size); lab's caches, cache_bytes and bytes_per_position raise while it runs.
    """
    cases = []
    for name, dtype in (("tiny-llama", torch.float32), ("tiny-gpt2", torch.bfloat16), ("smollm2", torch.float16)):
        model = load(name)
        weights = sum(t.nbytes for t in model.weights.values())
        for tokens, memory in ((128, 2**24), (1000, 2**30), (4096, 80 * 2**30)):
            per_seq = StaticCache(model.config, tokens, dtype=dtype, device="meta").nbytes()
            cases.append((name, model.config, tokens, memory, weights, torch.empty((), dtype=dtype).element_size(),
                          max(0, (memory - weights) // per_seq)))
    forbidden = {"StaticCache": StaticCache, "ConcatCache": ConcatCache, "PagedCache": lab_cache.PagedCache,
                 "cache_bytes": sizing.cache_bytes, "bytes_per_position": sizing.bytes_per_position}
    with _forbidden(forbidden, fn):
        for name, config, tokens, memory, weights, dtype_bytes, want in cases:
            got = fn(memory, weights, config, tokens, dtype_bytes)
            assert got == want, (f"{name}, {tokens} tokens, {memory / 2**30:.2f} GiB: you said {got}, "
                                 f"the caches say {want}. Hint: whole sequences only.")
    print("correct")
    return True


class _NoCropConcatCache(ConcatCache):
    """A ConcatCache whose own crop (and the _truncate behind it, and reset) refuse to run."""

    def crop(self, n):
        raise AssertionError("your crop called cache.crop(): the exercise is to crop the cache's tensors "
                             "yourself, without its own crop")

    def _truncate(self, n):
        raise AssertionError("your crop called the cache's own truncation (through crop, reset or "
                             "_truncate): the exercise is to crop the tensors yourself")


@torch.no_grad()
def check_crop(crop):
    """crop(cache, n) on a ConcatCache, without its own crop. Oracle: a cache that never held the extra positions.

    Rule: do not call cache.crop (nor reset or _truncate): the cache handed to you raises if you do.
    """
    model = load("tiny-llama")
    cfg, w = model.config, model.weights
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, cfg.vocab_size, (1, 30), generator=g)
    more = torch.randint(0, cfg.vocab_size, (1, 4), generator=g)
    for n in (0, 1, 17, 30):
        cropped, clean = _NoCropConcatCache(cfg), ConcatCache(cfg)
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


def compare_decode_step(design: str, measured_ms: float, path=None) -> float:
    """Open-ended: the reader's median decode-step time (ms) of `design` ("concat" or "static") on SmolLM2
    at the book's context (`ch02.decode_ms.context`), beside the book's; returns yours / the book's."""
    from . import compare_with_book

    if design not in ("concat", "static"):
        raise ValueError(f"design must be 'concat' or 'static', got {design!r}")
    extra = {} if path is None else {"path": path}
    return compare_with_book(f"ch02.decode_ms.{design}", measured_ms, "ms", **extra)
