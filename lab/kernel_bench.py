"""The paged decode kernels' achieved bandwidth, measured: bytes of K and V read / time per call.

`kernel_case(B, L, ...)` measures one case, B sequences of L positions each: the float Triton kernel
(`lab.kernels.paged_attention`), `scaled_dot_product_attention` over the same keys and values laid end to
end (what the kernel's page layout costs against a contiguous cache), and the INT8 kernel over the same
pages quantized (int8 codes, one float32 scale per token per kv head). `kernel_bandwidth` runs a grid of
cases, the longest context and the largest batch first, until a deadline.

How, so that the timing holds the kernel and nothing else:
- every input is drawn on the device the case runs on (`case_inputs`): nothing of size B * L passes
  through the host;
- each kernel is checked once per case against its PyTorch reference (`paged_attention_reference`,
  `paged_attention_int8_reference`) on the case's first sequences (`first_sequences`, `check`), outside
  the timing;
- the timed calls skip the kernels' host-side value checks (`check_values=False`, which would read the
  lengths and tables back) and are timed by `lab.bench.device_times`: on CUDA between CUDA events, the L2
  cache flushed before each call, so the host never waits between calls; on the CPU (the kernels under
  Triton's interpreter) with `lab.bench.time_call`.
"""

import math
import time

import torch
import torch.nn.functional as F

from .bench import device_times
from .kernels import (
    paged_attention,
    paged_attention_int8,
    paged_attention_int8_reference,
    paged_attention_reference,
    quantize_pages,
)

# Peak memory bandwidth by GPU name, from the vendor's product page (NVIDIA, "H200 Tensor Core GPU",
# specifications: GPU memory bandwidth 4.8 TB/s; research/ch03/sources.md, research/ch05/sources.md).
PEAK_BYTES_PER_S = {"H200": 4.8e12}


def peak_bandwidth(name: str):
    """The peak memory bandwidth in bytes/s of the GPU called `name`, or None when it is not known here."""
    return next((v for k, v in PEAK_BYTES_PER_S.items() if k in name), None)


def case_inputs(B, L, heads, head_dim, dtype, page_size, device, seed=0) -> dict:
    """One case's inputs, drawn on `device`: a query [B, H_q, D], pools of random pages
    [B * P, page_size, H_kv, D] (P = ceil(L / page_size)) handed out in random order by block tables
    int32 [B, P], lengths int32 [B] (all L), and the same keys and values laid end to end, k and v
    [B, H_kv, L, D], for SDPA. Nothing of size B * L passes through the host."""
    (Hq, Hkv), D, page = heads, head_dim, page_size
    P = -(-L // page)
    g = torch.Generator(device=device).manual_seed(seed * 1_000_003 + B * 100_003 + L)
    draw = lambda *shape: torch.randn(*shape, generator=g, device=device, dtype=dtype)
    q = draw(B, Hq, D)                                                                    # [B, H_q, D]
    k_pool, v_pool = draw(B * P, page, Hkv, D), draw(B * P, page, Hkv, D)               # [B * P, page, H_kv, D]
    tables = torch.randperm(B * P, generator=g, device=device).view(B, P).to(torch.int32)  # [B, P]
    lengths = torch.full((B,), L, dtype=torch.int32, device=device)                      # [B]
    # each sequence's pages in table order, positions end to end: [B, P, page, H_kv, D] -> [B, H_kv, L, D]
    k, v = (pool[tables.long()].flatten(1, 2)[:, :L].transpose(1, 2).contiguous() for pool in (k_pool, v_pool))
    return dict(q=q, k_pool=k_pool, v_pool=v_pool, tables=tables, lengths=lengths, k=k, v=v)


def first_sequences(b, tables, *pools):
    """The pages of the first b sequences as pools of their own, and their tables renumbered: a reference
    checks b sequences without dequantizing (or copying) the whole pool."""
    pages = tables[:b].long().flatten()                                                 # [b * P]
    renumbered = torch.arange(len(pages), device=tables.device, dtype=torch.int32).view(b, -1)
    return (renumbered, *(pool[pages] for pool in pools))


# Tolerance of the check against the reference: both compute in float32 from the same inputs, and round
# the result to the output's dtype once. float16 output: twice its unit roundoff (2**-11) relative, as
# tests/kernel_cases.py; float32: 1e-4 relative for sums over up to 32k positions in a different order.
# Plus 1e-5 absolute for float32 arithmetic near zero.
RTOL = {torch.float16: 2 * 2**-11, torch.float32: 1e-4}
ATOL = 1e-5


def check(out, expected) -> dict:
    """The largest |out - expected| and whether every element is within ATOL + RTOL * |expected|."""
    err = (out.float() - expected.float()).abs()
    bound = ATOL + RTOL[out.dtype] * expected.float().abs()
    return dict(error=err.max().item(), within=bool((err <= bound).all()))


@torch.inference_mode()
def kernel_case(B, L, heads=(32, 8), head_dim=128, dtype=torch.float16, page_size=16, warmup=2, reps=10,
                check_batch=2, device="cuda") -> dict:
    """One (batch, context): the float kernel's, SDPA's and the INT8 kernel's seconds per call (lab.bench
    summaries), the bytes each kernel must read, and each kernel's check against its reference on the first
    `check_batch` sequences. heads = (query heads, kv heads); the defaults are the book's GPU case."""
    x = case_inputs(B, L, heads, head_dim, dtype, page_size, device)
    q, tables, lengths = x["q"], x["tables"], x["lengths"]
    b = min(B, check_batch)
    sub_tables, sub_k, sub_v = first_sequences(b, tables, x["k_pool"], x["v_pool"])
    float_check = check(paged_attention(q[:b], sub_k, sub_v, sub_tables, lengths[:b]),
                        paged_attention_reference(q[:b], sub_k, sub_v, sub_tables, lengths[:b]))
    kernel = device_times(lambda: paged_attention(q, x["k_pool"], x["v_pool"], tables, lengths, check_values=False),
                          warmup, reps, device)
    Hkv = heads[1]
    q_groups = q.view(B, Hkv, -1, q.shape[-1])   # [B, H_kv, G, D]: query head h reads kv head h // G
    sdpa = device_times(lambda: F.scaled_dot_product_attention(q_groups, x["k"], x["v"]), warmup, reps, device)
    del x["k"], x["v"]
    codes_k, codes_v, scale_k, scale_v = quantize_pages(x["k_pool"], x["v_pool"])      # int8 [pages, page, H_kv, D]
    sub = first_sequences(b, tables, codes_k, codes_v, scale_k, scale_v)
    int8_check = check(paged_attention_int8(q[:b], *sub[1:], sub[0], lengths[:b]),
                       paged_attention_int8_reference(q[:b], *sub[1:], sub[0], lengths[:b]))
    int8 = device_times(lambda: paged_attention_int8(q, codes_k, codes_v, scale_k, scale_v, tables, lengths,
                                                     check_values=False), warmup, reps, device)
    element = x["k_pool"].element_size()
    return dict(kernel=kernel, sdpa=sdpa, int8=int8,
                bytes=2 * B * L * Hkv * head_dim * element,                                 # every key and value once
                int8_bytes=2 * B * L * Hkv * (head_dim * codes_k.element_size() + scale_k.element_size()),
                check=float_check, int8_check=int8_check)


def kernel_bandwidth(contexts, batches, deadline=math.inf, **case) -> dict:
    """kernel_case(B, L, **case) for every batch B and context L, the longest context and the largest batch
    first, until the deadline (time.perf_counter()) has passed: {(B, L): case}."""
    cases = {}
    for L in sorted(contexts, reverse=True):
        for B in sorted(batches, reverse=True):
            if time.perf_counter() <= deadline:
                cases[B, L] = kernel_case(B, L, **case)
    return cases
