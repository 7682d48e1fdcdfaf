"""Quantization of keys and values to a few bits, as pure functions: scales, codes, packing (chapter 7).

- symmetric (absmax): x ~ (code - 2^(b-1)) * s with s = max|x| / (2^(b-1) - 1); x/s in -127..127 at 8 bits.
- asymmetric (a zero point): x ~ code * s + z with z = min x and s = (max x - min x) / (2^b - 1).

One (s, z) is shared over `dim`: the head dimension for a scale per token, a group's tokens for a scale per channel
(KIVI's keys). Rounding errs by at most s/2 per element; the stored scale is rounded up and the zero point down to
the storage dtype, so no code clips and the bound holds for the stored scale.

Codes of 4 and 2 bits are packed two and four to a byte along the last dimension (`pack`, `unpack`): the element j
of each run of 8/b sits in bits j*b .. j*b + b - 1.
"""

import functools

import torch


def work_dtype(*dtypes):
    """The dtype the arithmetic runs in: float32 at least, float64 when any of `dtypes` is float64."""
    return functools.reduce(torch.promote_types, dtypes, torch.float32)


def offset(bits: int) -> int:
    """The code of zero on the symmetric grid (stored codes are unsigned: code = q + offset)."""
    return 2 ** (bits - 1)


def _round_up(x, dtype):
    """x cast to `dtype`, moved up one step wherever the cast went below x."""
    y = x.to(dtype)
    return torch.where(y.to(x.dtype) < x, torch.nextafter(y, torch.full_like(y, float("inf"))), y)


def _round_down(x, dtype):  # rounding to nearest is symmetric about zero
    return -_round_up(-x, dtype)


def quantize_symmetric(x, bits: int, dim, scale_dtype):
    """x -> (codes uint8 shaped like x, scale with `dim` reduced to 1, in scale_dtype), with
    x ~ (codes - offset(bits)) * scale and |error| <= scale / 2 per element (plus float rounding).
    A set of zeros gets scale 0 and is reproduced exactly."""
    work = work_dtype(x.dtype, scale_dtype)
    qmax = offset(bits) - 1                                       # 127, 7, 1
    xw = x.to(work)
    scale = _round_up(xw.abs().amax(dim, keepdim=True) / qmax, scale_dtype)
    s = scale.to(work)
    q = torch.round(xw / torch.where(s > 0, s, 1)).clamp_(-qmax, qmax)
    return (q + offset(bits)).to(torch.uint8), scale


def dequantize_symmetric(codes, scale, bits: int, dtype):
    work = work_dtype(dtype, scale.dtype)
    return ((codes.to(work) - offset(bits)) * scale.to(work)).to(dtype)


def quantize_asymmetric(x, bits: int, dim, scale_dtype):
    """x -> (codes uint8 shaped like x, scale, zero), scale and zero with `dim` reduced to 1, in scale_dtype, with
    x ~ codes * scale + zero: the zero point is the minimum (rounded down), so codes run 0 .. 2^bits - 1; |error|
    <= scale / 2 per element (plus float rounding). A constant set gets scale 0 and is exact."""
    work = work_dtype(x.dtype, scale_dtype)
    top = 2 ** bits - 1                                           # 255, 15, 3
    xw = x.to(work)
    zero = _round_down(xw.amin(dim, keepdim=True), scale_dtype)
    z = zero.to(work)
    scale = _round_up((xw.amax(dim, keepdim=True) - z) / top, scale_dtype)
    s = scale.to(work)
    q = torch.round((xw - z) / torch.where(s > 0, s, 1)).clamp_(0, top)
    return q.to(torch.uint8), scale, zero


def dequantize_asymmetric(codes, scale, zero, dtype):
    work = work_dtype(dtype, scale.dtype)
    return (codes.to(work) * scale.to(work) + zero.to(work)).to(dtype)


def pack(codes, bits: int):
    """uint8 codes `[..., n]` of `bits` bits each -> `[..., n * bits / 8]` bytes (n a multiple of 8 / bits)."""
    per = 8 // bits
    if per == 1:
        return codes.contiguous()
    runs = codes.reshape(*codes.shape[:-1], codes.shape[-1] // per, per)   # [..., n/per, per]
    out = runs[..., 0].clone()
    for j in range(1, per):
        out |= runs[..., j] << (bits * j)
    return out                                                            # [..., n/per]


def unpack(packed, bits: int):
    """The inverse of `pack`: bytes `[..., m]` -> uint8 codes `[..., m * 8 / bits]`."""
    per = 8 // bits
    if per == 1:
        return packed
    mask = 2 ** bits - 1
    runs = [(packed >> (bits * j)) & mask for j in range(per)]            # per x [..., m]
    return torch.stack(runs, dim=-1).flatten(-2)                          # [..., m * per]
