"""transformers' own QuantizedCache on the lab's model, teacher-forced, for chapter 7's comparison.

The model is `lab.models.hf.to_transformers(model)`: a LlamaForCausalLM holding the lab's weights. The text
goes through it the way `lab.metrics.teacher_forced` feeds the lab's caches: the first `prefill` tokens in
one forward, then one token per step, each step handing the library its own cache object. Any cache the
library accepts as `past_key_values` can be fed; `make_cache` builds the three the chapter compares.

What transformers' QuantizedCache (5.23, `cache_utils.py`) does, per layer:

- The quanto backend (`QuantoQuantizedLayer`, optimum-quanto's `quantize_weight` with `MaxOptimizer`) keeps
  two stores: a quantized tensor for the older positions and a float residual `keys`, `values`
  `[B, H_kv, r, D]` for the newest. The first update (the prefill) quantizes the whole prompt at once and
  leaves the residual empty; that step's attention still sees the prompt's float keys. Every later update
  dequantizes the WHOLE quantized store and attends over [dequantized, residual, new step] (the new step in
  float). When r + new >= `residual_length`, that whole concatenation is quantized again from scratch and
  the residual emptied; otherwise the new step joins the residual. The residual therefore holds at most
  `residual_length - 1` positions, and `residual_length=0` (or 1) re-quantizes everything at every step.
- The grid (MaxOptimizer): asymmetric over each group's [min, max], scale = (max - min) / (2^bits - 1),
  shift = -min, code = round((x + shift) / scale) clamped to [0, 2^bits - 1], x ~ scale * code - shift.
  Codes are uint8 packed 2 (4-bit) or 4 (2-bit) to a byte; scale and shift are float32 (the states'
  dtype), one of each per group. Groups come from `optimum.quanto.tensor.grouped.group`:
  - axis=0 (the default for keys and values) on a contiguous `[B, H_kv, T, D]` tensor reshapes it to
    `[B * H_kv * T * D / g, g]`: a group is g CONSECUTIVE elements in memory order, and each gets its own
    scale and shift. With g dividing D (SmolLM2: D = 64, g = 64 or 32) that is one token of one head split
    into D / g runs of channels: per-token quantization, grouped along the head dimension, for keys as well
    as values. (Not KIVI's per-channel keys, whatever the docstring's "per-channel" suggests.) With g > D a
    group spans g / D consecutive tokens of one head. It needs g to divide H_kv * T * D.
  - axis=-1 reshapes to `[g, D * B * H_kv * T / g]`: one scale and shift per channel over g consecutive
    rows of the flattened (B, H_kv, T), KIVI's key grouping (a group crosses into the next head when g
    does not divide T). It needs g to divide B * H_kv * T at every quantization: on SmolLM2 (H_kv = 3)
    with g = 64, B * T must be a multiple of 64 at the prefill and at every flush, or quanto raises.
  Re-quantizing a dequantized group finds the same grid (its min and max are grid points already): 50
  round trips moved values by 2e-6 of a step on random data, so the repeated flushes add no error of
  their own; what a smaller residual costs is the newer positions being quantized at all.
- The fp8 backend (`Fp8QuantizedLayer`) stores float8_e4m3fn states with ONE float32 scale per layer for
  keys and one for values (the whole `[B, H_kv, T, D]` tensor: all rows, heads, positions), amax / 448 of
  the prefill's states, frozen after that first update. Later steps are cast with the frozen scale and
  appended; no residual, no re-quantization. Values past the prefill's range saturate at +-448 x scale
  (torch's cast to float8_e4m3fn saturates). The prefill attends over its float states, as quanto's does;
  every later step attends over the dequantized states, its own included.

Bytes (`held`, `stored_bytes`, `bytes_per_position`): the storage of every tensor the cache's layers hold,
each storage counted once. Quanto: the packed uint8 codes (`qtensor._data._data`), the float32 scales
(`._scale`) and shifts (`._shift`, the zero points), and the float residual keys and values. FP8: the
float8 states and the two scalar float32 scales. DynamicCache: its float keys and values. Python objects
and the sizes and strides the wrappers carry are not counted.
"""

import torch
from tqdm.auto import tqdm

from ..metrics import as_batch, compare

BACKENDS = ("dynamic", "quanto", "fp8")
# the settings chapter 7 compares: quanto at 4 and 2 bits (2 bits with keys grouped per channel too), FP8
CASES = {"quanto_4": dict(backend="quanto", nbits=4, q_group_size=32, residual_length=128),
         "quanto_2": dict(backend="quanto", nbits=2, q_group_size=32, residual_length=128),
         "quanto_2_channel_keys": dict(backend="quanto", nbits=2, q_group_size=32, residual_length=128,
                                       axis_key=-1),
         "fp8": dict(backend="fp8")}


def make_cache(hf, backend: str = "dynamic", **settings):
    """A new, empty cache for `hf` (a transformers causal LM):

    - "dynamic": DynamicCache, float, the oracle (no settings);
    - "quanto": QuantizedCache(backend="quanto") with `nbits` (2 or 4), `q_group_size`, `residual_length`,
      `axis_key`, `axis_value` (0 or -1); unset ones take the library's defaults (4, 64, 128, 0, 0);
    - "fp8": QuantizedCache(backend="fp8"), per-tensor, no settings (the library refuses any).
    """
    from transformers import DynamicCache, QuantizedCache

    if backend == "dynamic":
        if settings:
            raise ValueError(f"DynamicCache takes no settings, got {sorted(settings)}")
        return DynamicCache(config=hf.config)
    if backend in ("quanto", "fp8"):
        return QuantizedCache(backend=backend, config=hf.config, **settings)
    raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


@torch.inference_mode()
def teacher_forced(hf, ids: torch.Tensor, prefill: int, cache) -> torch.Tensor:
    """Next-token logits at positions `prefill - 1 .. T - 1`, `[B, T - prefill + 1, V]` float32.

    ids `[B, T]` (unpadded: every row a whole passage of T tokens). The first `prefill` tokens go in one
    forward, then one token per step, all through `cache` (which must be empty). No attention mask: with no
    padding the causal mask is all the model needs. Positions are passed as `generate` computes them
    without padding, `arange(past, past + n)` `[1, n]` (what LlamaModel would derive from the cache's
    length anyway).
    """
    ids = torch.as_tensor(ids)
    if ids.dim() != 2:
        raise ValueError(f"ids must be [B, T], got shape {tuple(ids.shape)}")
    T = ids.shape[1]
    if not 1 <= prefill <= T:
        raise ValueError(f"prefill must be in 1..{T}, got {prefill}")
    if cache.get_seq_length() != 0:
        raise ValueError(f"the cache already holds {cache.get_seq_length()} positions: pass a new one")

    def step(start, end, keep=0):
        positions = torch.arange(start, end, device=ids.device)[None]           # [1, n]
        out = hf(input_ids=ids[:, start:end], position_ids=positions, past_key_values=cache, use_cache=True,
                 logits_to_keep=keep)
        return out.logits[:, -1].float()                                          # [B, V]

    rows = [step(0, prefill, keep=1)]                                             # prefill
    rows += [step(t, t + 1) for t in range(prefill, T)]                           # decode_one_token
    return torch.stack(rows, dim=1)                                               # [B, T - prefill + 1, V]


def _parts(layer) -> dict:
    """{part: [tensors]} one layer holds: codes, scales, zero_points (quantized stores), float."""
    from transformers.cache_utils import BaseQuantizedLayer, DynamicLayer, Fp8QuantizedLayer, QuantoQuantizedLayer

    floats = [t for t in (layer.keys, layer.values) if isinstance(t, torch.Tensor)]   # [B, H_kv, r, D]
    parts = dict(codes=[], scales=[], zero_points=[], float=floats)
    if isinstance(layer, QuantoQuantizedLayer):
        from optimum.quanto.tensor.packed import PackedTensor

        for q in (layer._quantized_keys, layer._quantized_values):
            if q is None:
                continue
            if not isinstance(q._data, PackedTensor):
                raise TypeError(f"expected quanto's packed codes, got {type(q).__name__} holding "
                                f"{type(q._data).__name__}: a device-specific layout this count does not know")
            parts["codes"].append(q._data._data)                                  # uint8 [ceil(N / (8 / bits)), g]
            parts["scales"].append(q._scale)                                      # float32 [N, 1] (axis 0)
            parts["zero_points"].append(q._shift)                                 # float32 [N, 1]
    elif isinstance(layer, Fp8QuantizedLayer):
        for q in (layer._quantized_keys, layer._quantized_values):
            if q is not None:
                parts["codes"].append(q[0])                                       # float8 [B, H_kv, T, D]
                parts["scales"].append(q[1])                                      # float32 []
    elif isinstance(layer, BaseQuantizedLayer) or not isinstance(layer, DynamicLayer):
        raise TypeError(f"no byte count for {type(layer).__name__}")
    return parts


def held(cache) -> dict:
    """Bytes the cache holds, by part, over all layers: codes, scales, zero_points, float (the residual of
    a quantized cache, everything of a DynamicCache). Each storage is counted once, at its full size."""
    out, seen = dict(codes=0, scales=0, zero_points=0, float=0), set()
    for layer in cache.layers:
        for part, tensors in _parts(layer).items():
            for t in tensors:
                storage = t.untyped_storage()
                if storage.nbytes() and storage.data_ptr() not in seen:
                    seen.add(storage.data_ptr())
                    out[part] += storage.nbytes()
    return out


def stored_bytes(cache) -> int:
    """Every byte of state the cache holds after the run (the sum of `held`)."""
    return sum(held(cache).values())


def compressed_positions(cache) -> int:
    """Positions each layer holds in its compressed store: quantized (quanto: the length less the float
    residual; fp8: all of them), or, for a DynamicCache, its float store (all of them)."""
    from transformers.cache_utils import QuantizedLayer

    layer = cache.layers[0]
    residual = layer.keys.shape[-2] if isinstance(layer, QuantizedLayer) and layer.keys.dim() == 4 else 0
    return cache.get_seq_length() - residual


def bytes_per_position(cache) -> float:
    """Bytes one position of the compressed store takes over all layers and batch rows, keys and values:
    codes, scales and zero points of a quantized cache (its float residual left out), the float states of
    a DynamicCache. The measure the lab's `QuantizedCache.bytes_per_position()` gives."""
    n = compressed_positions(cache)
    if n <= 0:
        raise ValueError("the cache holds no compressed positions")
    h = held(cache)
    quantized = h["codes"] + h["scales"] + h["zero_points"]
    return (quantized if quantized else h["float"]) / n


def quality(model, ids, prefill: int, ref, cases: dict) -> dict:
    """transformers' own model (`to_transformers(model)`) and each cache of `cases` ({name: make_cache
    settings}), fed passages ids `[B, T]` teacher-forced as `lab.metrics.quality` feeds the lab's caches, and
    compared (`lab.metrics.compare`) with the same oracle `ref` (`lab.metrics.reference`): {name: compare's
    dict with the bytes the cache stored, `length` T, `batch` B and its `settings`}."""
    from ..models.hf import to_transformers

    hf, x, out = to_transformers(model), as_batch(ids), {}
    for name, kw in tqdm(cases.items(), desc="transformers"):
        cache = make_cache(hf, **kw)
        got = teacher_forced(hf, x, prefill, cache)
        out[name] = compare(got, ref, x[:, prefill:]) | dict(nbytes=stored_bytes(cache), length=x.shape[1],
                                                             batch=x.shape[0], settings=kw)
    return out
