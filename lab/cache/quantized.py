"""QuantizedCache: keys and values kept in 8, 4 or 2 bits plus scales, attended without dequantizing.

Chapter 7 explains the schemes, key smoothing and the residual window. Each layer holds a quantized prefix of
`quantized` positions (packed codes and scales) followed by a float tail in the cache's dtype, where a step's new
positions are attended as computed; `advance` commits them, then quantizes every whole group that has left the
residual window (the tail keeps at least `residual` positions). The prefix ends at a multiple of the group, the
same in every layer.

- "per_token": one scale per token per head, absmax grid by default; `zero_point=True` uses [min, max] with a zero
  point; `smooth=True` quantizes k - mu, mu `[B, H_kv, 1, D]` the per-channel key mean of the prefill (q . mu is
  constant along a row, so the softmax is unchanged; `attend` adds it back because the tail holds raw keys).
- "kivi" (Liu et al., 2024): keys per channel over groups of `group_size` tokens, values per token (or per
  `value_group_size` channels), both with zero points.

Attention folds the scales in, q `[B, H_q, T, D]` viewed as `[B, H_kv, rep, T, D]`: per-token key scales multiply
the scores, per-channel ones the query once per group, value scales the probabilities; arithmetic in float32 at
least. While nothing is quantized, attention is SDPA over the tail, ConcatCache's call, so the logits are the same
bits.

Crop. A crop into the prefix keeps whole groups quantized and moves the kept positions of the cut group into the
tail as the dequantized values the cache was serving, so attention over them is unchanged, bit for bit; requantized
later, they carry two rounding errors (at most s_1/2 + s_2/2). Per-token schemes never cut a group.
"""

import torch
import torch.nn.functional as F

from . import checks
from .base import CacheInputError, KVCache, offset_causal_mask
from .concat import ConcatCache
from .quant import (
    dequantize_asymmetric,
    dequantize_symmetric,
    offset,
    pack,
    quantize_asymmetric,
    quantize_symmetric,
    unpack,
    work_dtype,
)

SCHEME_BITS = {"per_token": (8, 4), "kivi": (8, 4, 2)}
KIVI_RESIDUAL = 128  # KIVI's residual length R: positions kept in float at the end of the cache


class QuantizedCache(KVCache):
    def __init__(self, config, bits: int = 8, scheme: str = "per_token", batch_size: int = 1,
                 dtype=None, device="cpu", smooth: bool = False, group_size: int = 32,
                 residual: int | None = None, value_group_size: int | None = None, zero_point: bool | None = None,
                 scale_dtype=None):
        super().__init__(config, batch_size, dtype, device)
        dtype = self.dtype                                             # the model's unless told otherwise
        scale_dtype = dtype if scale_dtype is None else scale_dtype   # 16-bit caches keep 16-bit scales
        residual = (KIVI_RESIDUAL if scheme == "kivi" else 0) if residual is None else residual
        zero_point = (scheme == "kivi") if zero_point is None else zero_point   # KIVI's grids have zero points
        check_settings(self.head_dim, bits, scheme, smooth, group_size, residual, value_group_size,
                       zero_point, scale_dtype)
        self.settings = dict(bits=bits, scheme=scheme, batch_size=batch_size, dtype=dtype, device=device,
                             smooth=smooth, group_size=group_size, residual=residual,
                             value_group_size=value_group_size, zero_point=zero_point, scale_dtype=scale_dtype)
        self.bits, self.scheme, self.smooth, self.residual = bits, scheme, smooth, residual
        self.group_size, self.zero_point, self.scale_dtype = group_size, zero_point, scale_dtype
        self.group = group_size if scheme == "kivi" else 1        # positions whose keys share scales
        self.value_group = value_group_size or self.head_dim      # channels sharing a value scale
        self.offset = 0 if zero_point else offset(bits)           # the code of zero on the symmetric grid
        self.work = work_dtype(dtype, scale_dtype)                # quantizing: float32, or float64 scales
        self.compute = work_dtype(dtype)                          # attention: float32 at least
        L = self.n_layers
        self.k_codes, self.v_codes = [None] * L, [None] * L      # packed [B, H_kv, Q, D * bits / 8] uint8
        self.k_scale, self.k_zero = [None] * L, [None] * L       # [B, H_kv, Q, 1], kivi [B, H_kv, Q / G, D]
        self.v_scale, self.v_zero = [None] * L, [None] * L       # [B, H_kv, Q, D / value_group]
        self.k_tail, self.v_tail = [None] * L, [None] * L        # float [B, H_kv, F, D], pending included
        self.k_mean = [None] * L                                 # smooth: [B, H_kv, 1, D] in scale_dtype
        self.quantized = 0                                       # Q: positions in the quantized prefix

    STATE = ("k_codes", "v_codes", "k_scale", "k_zero", "v_scale", "v_zero", "k_tail", "v_tail", "k_mean")

    # region design
    def _write(self, layer, k, v):
        check_finite(k, v)                                       # before anything changes
        check_range(k, v, self.largest(), self.scale_dtype)
        old_k, old_v = self.k_tail[layer], self.v_tail[layer]
        self.k_tail[layer] = k.clone() if old_k is None else torch.cat([old_k, k], dim=2)  # [B, H_kv, F, D]
        self.v_tail[layer] = v.clone() if old_v is None else torch.cat([old_v, v], dim=2)

    def _read(self, layer):
        """All keys and values `[B, H_kv, Q + F, D]`: the prefix dequantized, then the float tail."""
        k, v = self.k_tail[layer], self.v_tail[layer]
        if self.quantized:
            qk, qv = self._dequantized(layer)
            k, v = (qk, qv) if k is None else (torch.cat([qk, k], dim=2), torch.cat([qv, v], dim=2))
        return k, v

    def _commit(self, t):
        """Commit t positions, then quantize every whole group that left the residual window."""
        super()._commit(t)
        n, G = self._length, self.group
        target = max(self.quantized, (n - self.residual) // G * G)
        for i in range(self.n_layers):
            if self.smooth and self.k_mean[i] is None:           # the first step: its keys set mu
                self.k_mean[i] = self.k_tail[i].to(self.work).mean(dim=2, keepdim=True).to(self.scale_dtype)
        m = target - self.quantized
        if m <= 0:
            return
        for i in range(self.n_layers):
            k, v = self.k_tail[i], self.v_tail[i]                # [B, H_kv, F, D]
            codes, scale, zero = self._quantize_keys(i, k[:, :, :m])
            self.k_codes[i], self.k_scale[i], self.k_zero[i] = \
                cat(self.k_codes[i], codes), cat(self.k_scale[i], scale), cat(self.k_zero[i], zero)
            codes, scale, zero = self._quantize_values(v[:, :, :m])
            self.v_codes[i], self.v_scale[i], self.v_zero[i] = \
                cat(self.v_codes[i], codes), cat(self.v_scale[i], scale), cat(self.v_zero[i], zero)
            # clone: the quantized positions' float memory is released (a slice would keep it alive)
            self.k_tail[i] = k[:, :, m:].clone() if k.shape[2] > m else None
            self.v_tail[i] = v[:, :, m:].clone() if v.shape[2] > m else None
        self.quantized = target

    def _truncate(self, n):
        Q, G = self.quantized, self.group
        keep = n // G * G if n < Q else Q                        # quantized positions kept: whole groups
        for i in range(self.n_layers):
            if keep < n < Q:  # the cut group's kept positions move to the tail, as the values the cache served
                k, v = self._dequantized(i, first_group=keep // G)   # [B, H_kv, Q - keep, D]
                self.k_tail[i], self.v_tail[i] = k[:, :, :n - keep].clone(), v[:, :, :n - keep].clone()
            elif self.k_tail[i] is not None:                     # cut the float tail (drops pending too)
                self.k_tail[i] = self.k_tail[i][:, :, :n - Q].clone() if n > Q else None
                self.v_tail[i] = self.v_tail[i][:, :, :n - Q].clone() if n > Q else None
            if keep < Q:
                self.k_codes[i], self.v_codes[i] = cut(self.k_codes[i], keep), cut(self.v_codes[i], keep)
                self.k_scale[i], self.k_zero[i] = cut(self.k_scale[i], keep // G), cut(self.k_zero[i], keep // G)
                self.v_scale[i], self.v_zero[i] = cut(self.v_scale[i], keep), cut(self.v_zero[i], keep)
        self.quantized, self._length = keep, n
        if n == 0:
            self.k_mean = [None] * self.n_layers                 # the next first step sets mu again

    def fork(self):
        """An independent cache sharing the parent's tensors (neither ever writes into them)."""
        checks.between_steps(self, "fork")
        child = QuantizedCache(self.config, **self.settings)
        for name in self.STATE:
            setattr(child, name, list(getattr(self, name)))
        child.quantized = self.quantized
        return self._copy_state_to(child)

    def nbytes(self) -> int:
        """Bytes of the storage held: codes, scales, zero points, the float tail and the smoothing means."""
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for name in self.STATE for t in getattr(self, name) if t is not None}
        return sum(storages.values())
    # endregion

    def bytes_per_position(self) -> float:
        """Bytes one quantized position takes over all layers and rows, K and V: its codes and its share of
        the scales and zero points. nbytes() = quantized x this + the float tail's and the means' bytes."""
        D, size = self.head_dim, torch.empty((), dtype=self.scale_dtype).element_size()
        params = 2 if self.zero_point else 1                     # a scale, and a zero point beside it
        codes = 2 * D * self.bits / 8                            # K and V
        key_params = params * size * (D / self.group if self.scheme == "kivi" else 1)
        value_params = params * size * (D // self.value_group)
        return self.batch_size * self.n_layers * self.n_kv_heads * (codes + key_params + value_params)

    # region attention
    def attend(self, layer: int, q, k, v):
        """Store k, v and attend: q `[B, H_q, T, D]` over every position -> `[B, H_q, T, D]`, the quantized
        prefix read through its codes with the scales folded in (module docstring)."""
        if not self.config.as_trained:            # a retrofit's layer (ch. 10): the prefix dequantized
            return self._attend_shaped(layer, q, k, v)
        checks.equal_rows(self, "attend")
        checks.kv(self, layer, k, v)
        check_query(self, q, k)
        self._put(layer, k, v)
        B, Hq, T, D = q.shape
        H, Q = self.n_kv_heads, self.quantized
        mask = None if T == 1 else offset_causal_mask(Q + self.k_tail[layer].shape[2] - T, T, q.device)
        if not Q:                                                      # nothing quantized yet: as ConcatCache
            return F.scaled_dot_product_attention(q, self.k_tail[layer], self.v_tail[layer], attn_mask=mask,
                                                  enable_gqa=True)
        qw = q.to(self.compute).reshape(B, H, Hq // H, T, D) * D ** -0.5   # [B, H_kv, rep, T, D], 1/sqrt(D) in
        kt, vt = self.k_tail[layer].to(self.compute), self.v_tail[layer].to(self.compute)  # [B, H_kv, F, D]
        scores = torch.cat([self._prefix_scores(layer, qw),                        # [B, H_kv, rep, T, Q]
                            qw @ kt[:, :, None].transpose(-1, -2)], dim=-1)       # [B, H_kv, rep, T, F]
        if mask is not None:                                           # the new queries see keys up to their own
            scores = scores.masked_fill(~mask, float("-inf"))
        p = scores.softmax(dim=-1)                                     # [B, H_kv, rep, T, Q + F]
        out = self._prefix_values(layer, p[..., :Q]) + p[..., Q:] @ vt[:, :, None]   # [B, H_kv, rep, T, D]
        return out.reshape(B, Hq, T, D).to(q.dtype)

    def _prefix_scores(self, layer, qw):
        """q . k for every quantized key, from its codes:
        qw `[B, H_kv, rep, T, D]` -> `[B, H_kv, rep, T, Q]`."""
        B, H, _, _, D = qw.shape
        k_int = unpack(self.k_codes[layer], self.bits).to(self.compute) - self.offset  # [B,H_kv,Q,D]
        s, z = self.k_scale[layer].to(self.compute), self.k_zero[layer]
        if self.scheme == "per_token":                       # s, z [B, H_kv, Q, 1]: one per key
            scores = (qw @ k_int[:, :, None].transpose(-1, -2)) * s[:, :, None].transpose(-1, -2)
            if z is not None:                                          # + sum(q) * z
                z = z.to(self.compute)[:, :, None].transpose(-1, -2)
                scores = scores + qw.sum(-1, keepdim=True) * z
            if self.smooth:                                            # + q . mu, one per query row
                mu = self.k_mean[layer].to(self.compute)[:, :, None].transpose(-1, -2)
                scores = scores + qw @ mu
            return scores                                              # [B, H_kv, rep, T, Q]
        G = self.group                                       # kivi: s, z [B, H_kv, Q / G, D]
        k_int = k_int.view(B, H, -1, G, D)                             # [B, H_kv, Q / G, G, D]
        q_s = qw[:, :, :, :, None, :] * s[:, :, None, None]            # [B, H_kv, rep, T, Q / G, D]
        scores = torch.einsum("bhrtgd,bhgkd->bhrtgk", q_s, k_int)      # [B, H_kv, rep, T, Q / G, G]
        if z is not None:                                              # + q . z, once per group
            scores = scores + (qw @ z.to(self.compute)[:, :, None].transpose(-1, -2))[..., None]
        return scores.flatten(-2)                                      # [B, H_kv, rep, T, Q]

    def _prefix_values(self, layer, p):
        """sum_t p_t v_t over the quantized values: p `[B, H_kv, rep, T, Q]` -> `[B, H_kv, rep, T, D]`."""
        B, H, _, _, Q = p.shape
        n = self.head_dim // self.value_group
        v_int = unpack(self.v_codes[layer], self.bits).to(self.compute) - self.offset
        v_int = v_int.view(B, H, Q, n, self.value_group)               # [B, H_kv, Q, n, D / n]
        s, z = self.v_scale[layer].to(self.compute), self.v_zero[layer]   # [B, H_kv, Q, n]
        out = torch.einsum("bhrtqn,bhqnc->bhrtnc", p[..., None] * s[:, :, None, None], v_int)  # [.., T, n, D / n]
        if z is not None:                                              # + sum_t p_t z_t
            out = out + (p @ z.to(self.compute)[:, :, None])[..., None]
        return out.flatten(-2)                                         # [B, H_kv, rep, T, D]
    # endregion

    # region quantize
    def largest(self) -> tuple:
        """(keys, values): the largest magnitude each can take and still get a finite scale, zero point
        and smoothing mean in `scale_dtype` (float16 tops out at 65,504). Symmetric grid: the scale is
        max|x| / qmax. Zero points: the zero point is min x, and the range max x - min x up to twice max|x|.
        Smoothing: the mean is at most max|x|, and k - mu up to twice it."""
        top = torch.finfo(self.scale_dtype).max
        values = top / 2 if self.zero_point else top * (offset(self.bits) - 1)
        keys = top / 2 / (2 if self.zero_point else 1) if self.smooth else values
        return keys, values

    def _quantize(self, x, dim):
        """codes, scale, zero (None on the symmetric grid) of x, one scale per set reduced over `dim`."""
        if self.zero_point:
            return quantize_asymmetric(x, self.bits, dim, self.scale_dtype)
        return (*quantize_symmetric(x, self.bits, dim, self.scale_dtype), None)

    def _dequantize(self, codes, scale, zero):  # in the working dtype
        if zero is None:
            return dequantize_symmetric(codes, scale, self.bits, self.work)
        return dequantize_asymmetric(codes, scale, zero, self.work)

    def _quantize_keys(self, layer, k):
        """Keys `[B, H_kv, m, D]` (m a multiple of the group) -> packed codes, scale, zero."""
        B, H, m, D = k.shape
        if self.scheme == "per_token":
            x = k.to(self.work)
            if self.smooth:
                x = x - self.k_mean[layer].to(self.work)               # [B, H_kv, m, D]
            codes, scale, zero = self._quantize(x, -1)                 # scale, zero [B, H_kv, m, 1]
            return pack(codes, self.bits), scale, zero
        groups = k.view(B, H, m // self.group, self.group, D)         # [B, H_kv, m / G, G, D]
        codes, scale, zero = self._quantize(groups, 3)                 # scale, zero [B, H_kv, m / G, 1, D]
        return pack(codes.view(B, H, m, D), self.bits), scale.squeeze(3), squeeze(zero, 3)

    def _quantize_values(self, v):
        """Values `[B, H_kv, m, D]` -> packed codes, scale and zero `[B, H_kv, m, D / value_group]`."""
        B, H, m, D = v.shape
        groups = v.reshape(B, H, m, D // self.value_group, self.value_group)   # [B, H_kv, m, n, D / n]
        codes, scale, zero = self._quantize(groups, -1)
        return pack(codes.view(B, H, m, D), self.bits), scale.squeeze(-1), squeeze(zero, -1)

    def _dequantized(self, layer, first_group=0):
        """The quantized prefix from position first_group x group on, in the cache's dtype: k, v
        `[B, H_kv, Q', D]` with Q' = Q - first_group x group."""
        start = first_group * self.group                         # key scales: one per group of positions
        keys = (self.k_codes[layer][:, :, start:], self.k_scale[layer][:, :, first_group:],
                at(self.k_zero[layer], first_group))
        values = (self.v_codes[layer][:, :, start:], self.v_scale[layer][:, :, start:], at(self.v_zero[layer], start))
        return self._decode(layer, keys, values)

    def _decode(self, layer, keys, values):
        """(codes, scale, zero) of keys and of values as `_quantize_keys` and `_quantize_values` make them, for
        Q' positions -> k, v `[B, H_kv, Q', D]` in the cache's dtype."""
        (k_codes, k_scale, k_zero), (v_codes, v_scale, v_zero) = keys, values
        B, H, G, D = k_codes.shape[0], k_codes.shape[1], self.group, self.head_dim
        k_codes, v_codes = unpack(k_codes, self.bits), unpack(v_codes, self.bits)   # [B, H_kv, Q', D]
        Qs, n = k_codes.shape[2], D // self.value_group
        if self.scheme == "per_token":
            k = self._dequantize(k_codes, k_scale, k_zero)
            if self.smooth:
                k = k + self.k_mean[layer].to(self.work)
        else:                                                    # scale, zero per group: [B, H_kv, Q' / G, 1, D]
            k = self._dequantize(k_codes.view(B, H, -1, G, D), k_scale[:, :, :, None],
                                 None if k_zero is None else k_zero[:, :, :, None])
        v = self._dequantize(v_codes.view(B, H, Qs, n, -1), v_scale[..., None],
                             None if v_zero is None else v_zero[..., None])
        return k.reshape(B, H, Qs, D).to(self.dtype), v.reshape(B, H, Qs, D).to(self.dtype)

    def round_trip(self, layer: int, k, v):
        """k, v `[B, H_kv, m, D]` as this cache would serve them once quantized: made into
        codes, scales and zero points as `advance` makes them, and read back in the cache's
        dtype. Nothing is stored; m must be a whole number of key groups. This cache attends
        a step's own keys in float; llama.cpp's cache quantizes them before its attention
        reads them, and chapter 7 reads the lab's schemes that way with this."""
        checks.kv(self, layer, k, v)
        if k.shape[2] % self.group:
            raise CacheInputError(f"round_trip quantizes whole key groups of {self.group} "
                                  f"positions, got {k.shape[2]}")
        if self.smooth and self.k_mean[layer] is None:
            raise CacheInputError("a smoothed cache subtracts the mean of its first committed "
                                  "step's keys, and none was committed yet")
        check_finite(k, v)
        check_range(k, v, self.largest(), self.scale_dtype)
        return self._decode(layer, self._quantize_keys(layer, k), self._quantize_values(v))
    # endregion


def cat(old, new):  # grow along the positions (or groups); None stays None (no zero points)
    return new if old is None else torch.cat([old, new], dim=2)


def cut(t, n):  # keep the first n positions (or groups), in memory of their own
    return None if t is None or n == 0 else t[:, :, :n].clone()


def at(t, start):  # positions (or groups) from start on; None stays None
    return None if t is None else t[:, :, start:]


def squeeze(t, dim):
    return None if t is None else t.squeeze(dim)


# ---- checks: before anything changes, a typed error naming what was wrong and what was expected

def check_settings(head_dim, bits, scheme, smooth, group_size, residual, value_group_size, zero_point,
                   scale_dtype):
    if scheme not in SCHEME_BITS:
        raise CacheInputError(f"scheme must be one of {', '.join(map(repr, SCHEME_BITS))}, got {scheme!r}")
    allowed = SCHEME_BITS[scheme]
    if isinstance(bits, bool) or not isinstance(bits, int) or bits not in allowed:
        raise CacheInputError(f"the {scheme} scheme stores {' or '.join(map(str, allowed))} bits, got {bits!r}")
    checks.int_arg("group_size", group_size, low=1)
    checks.int_arg("residual", residual, low=0)
    if value_group_size is not None:
        checks.int_arg("value_group_size", value_group_size, low=1)
        if head_dim % value_group_size:
            raise CacheInputError(f"value_group_size {value_group_size} does not divide head_dim {head_dim}: "
                                  "each value scale covers a whole group of a head's channels")
    if head_dim % (8 // bits):
        raise CacheInputError(f"{bits}-bit codes pack {8 // bits} to a byte along the head dimension, which "
                              f"head_dim {head_dim} does not divide")
    for name, flag in (("smooth", smooth), ("zero_point", zero_point)):
        if not isinstance(flag, bool):
            raise CacheInputError(f"{name} must be True or False, got {flag!r}")
    if smooth and scheme == "kivi":
        raise CacheInputError("smooth subtracts a per-channel key mean before per-token quantization; kivi's "
                              "per-channel scales and zero points already absorb each channel's offset")
    if not isinstance(scale_dtype, torch.dtype) or not scale_dtype.is_floating_point:
        raise CacheInputError(f"scale_dtype must be a floating-point torch dtype, got {scale_dtype!r}")


def check_finite(k, v):
    """NaN or infinity would make a scale NaN or infinite and every code of its set meaningless (and an
    EvictingCache's scores NaN, its ranking noise): refused before anything changes."""
    for name, x in (("k", k), ("v", v)):
        bad = ~torch.isfinite(x)
        if bad.any():
            raise CacheInputError(f"{name} holds {int(bad.sum())} NaN or infinite values; this cache stores "
                                  "finite keys and values only")


def check_range(k, v, largest, scale_dtype):
    """Finite keys and values can still overflow a 16-bit scale: refuse them rather than store inf."""
    for name, x, limit in (("k", k, largest[0]), ("v", v, largest[1])):
        top = x.abs().amax().item() if x.numel() else 0.0
        if top > limit:
            raise CacheInputError(f"{name} holds a value of magnitude {top:.4g}, above {limit:.4g}, the largest "
                                  f"whose scales and zero points stay finite in {scale_dtype}: use a wider "
                                  "scale_dtype (torch.float32)")


def check_query(cache, q, k):
    """q is `[batch, q_heads, tokens, head_dim]` of k's batch and tokens, q_heads a multiple of kv_heads."""
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise CacheInputError(f"q must be a rank-4 tensor [batch, q_heads, tokens, head_dim], got "
                              f"{tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    B, Hq, T, D = q.shape
    if (B, T, D) != (k.shape[0], k.shape[2], cache.head_dim) or Hq % cache.n_kv_heads:
        raise CacheInputError(f"q has shape {tuple(q.shape)}, expected [{k.shape[0]}, a multiple of "
                              f"{cache.n_kv_heads}, {k.shape[2]}, {cache.head_dim}]")


# a what-if beside the real thing: one frozen scale per tensor (chapter 7 shows why it fails)
class PerTensorCache(ConcatCache):
    """SIMULATED INT8 with one scale per layer for all keys (and one for all values), set by the first step
    (the prefill) and frozen, later values clipped to its range, as transformers' FP8 cache fixes its scale.
    It stores the rounded values in float: a what-if for accuracy, not a way to save memory."""

    def __init__(self, config, batch_size=1, bits=8):
        super().__init__(config, batch_size)
        self.qmax, self.scales = 2 ** (bits - 1) - 1, [None] * self.n_layers

    def _commit(self, t):
        super()._commit(t)
        for i in range(self.n_layers):
            k, v = self.keys[i][:, :, -t:], self.values[i][:, :, -t:]              # the new positions
            if self.scales[i] is None:
                self.scales[i] = [x.abs().amax() / self.qmax for x in (k, v)]
            for x, s in zip((k, v), self.scales[i], strict=True):
                x.copy_((x / s).round().clamp(-self.qmax, self.qmax) * s)           # in place: views
