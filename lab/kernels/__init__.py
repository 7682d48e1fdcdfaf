"""Paged decode attention: a readable PyTorch reference, a C++ CPU kernel and a Triton kernel, one signature.

    out = paged_attention(q, k_pool, v_pool, block_tables, lengths)   # Triton: CUDA, or TRITON_INTERPRET=1
    out = paged_attention_reference(...)                              # gather + SDPA per sequence: the oracle
    out = paged_attention_gather(...)                                 # gather + one SDPA for the batch
    out = paged_attention_cpu(...)                                    # C++, reads the pages in place
    out = decode_attention(...)                                       # the right one for the device
    out = paged_attention_int8(q, k_codes, v_codes, k_scale, v_scale, block_tables, lengths)  # INT8 pages
    out = paged_attention_int8_reference(...)                         # dequantize, then the reference

q [batch, q_heads, head_dim]; k_pool, v_pool [num_pages, page_size, kv_heads, head_dim]; block_tables
int32 [batch, max_pages]; lengths int32 [batch]; out [batch, q_heads, head_dim] in q's dtype.
Every version checks shapes, dtypes and devices; with `check_values=True` (the default) also that the
lengths and page ids are in range, which reads them back to the host. A PagedCache, whose block manager
built the tables, passes check_values=False so that a decode step never waits for the device.
The INT8 versions take int8 pools and one float scale per token per kv head, k_scale and v_scale
[num_pages, page_size, kv_heads] (x ~ scale * code; `quantize_pages` builds them), and return float32.

Branches of one prompt (parallel sampling, beam search) share its pages; cascade attention reads them once
for all branches and merges by log-sum-exp (cascade.py):

    out = cascade_attention(q, k_pool, v_pool, shared_table, shared_length, block_tables, lengths)  # by device
    out = cascade_attention_reference(...), cascade_attention_cpu(...), cascade_attention_triton(...)
    out, lse = merge_attention(out_1, lse_1, out_2, lse_2)
"""

from . import triton_paged
from .cascade import cascade_attention_reference, cascade_attention_triton, merge_attention
from .checks import check_cascade_inputs, check_paged_inputs
from .cpu import DTYPES as CPU_DTYPES
from .cpu import KernelBuildError, cascade_attention_cpu, cpu_kernel_available, paged_attention_cpu
from .reference import paged_attention_gather, paged_attention_int8_reference, paged_attention_reference
from .triton_paged import paged_attention
from .triton_paged_int8 import paged_attention_int8, quantize_pages


def decode_attention(q, k_pool, v_pool, block_tables, lengths, scale=None, check_values=True, max_length=None,
                     window: int = 0, sinks: int = 0):
    """The Triton kernel for CUDA tensors (when Triton is installed and compiling); the C++ kernel
    `paged_attention_cpu` for CPU tensors of its dtypes (when a C++ compiler built it); else
    `paged_attention_gather`.

    Under TRITON_INTERPRET=1 the Triton kernel would run in NumPy, far slower than the PyTorch versions,
    so they serve then too; call `paged_attention` directly to run the kernel in the interpreter.
    max_length (the longest of lengths, known on the host) spares the C++ kernel a reduction. window,
    sinks: a local layer's rule, in every kernel (the C++ and Triton kernels never load a page wholly outside
    it; the gather loads and masks).
    """
    if q.is_cuda and triton_paged.triton is not None and not triton_paged.INTERPRETED:
        return paged_attention(q, k_pool, v_pool, block_tables, lengths, scale, check_values, window, sinks)
    if q.device.type == "cpu" and q.dtype in CPU_DTYPES and cpu_kernel_available():
        return paged_attention_cpu(q, k_pool, v_pool, block_tables, lengths, scale, check_values, max_length,
                                   window, sinks)
    return paged_attention_gather(q, k_pool, v_pool, block_tables, lengths, scale, check_values, window, sinks)


def cascade_attention(q, k_pool, v_pool, shared_table, shared_length: int, block_tables, lengths, scale=None,
                      check_values=True, max_length=None):
    """Decode attention for B branches of one prompt, the shared pages read once (cascade.py): the Triton
    version for CUDA tensors, the C++ `cascade_attention_cpu` for CPU tensors of its dtypes, else the
    reference, chosen as `decode_attention` chooses. q [B, H_q, D]; shared_table int32 [S] holding positions
    0 .. shared_length - 1; block_tables int32 [B, max_pages], lengths int32 [B] (each >= 1): each branch's
    own pages and positions after those. max_length: the longest of lengths, if known on the host (C++ only).
    Returns [B, H_q, D] in q's dtype.
    """
    args = (q, k_pool, v_pool, shared_table, shared_length, block_tables, lengths, scale, check_values)
    if q.is_cuda and triton_paged.triton is not None and not triton_paged.INTERPRETED:
        return cascade_attention_triton(*args)
    if q.device.type == "cpu" and q.dtype in CPU_DTYPES and cpu_kernel_available():
        return cascade_attention_cpu(*args, max_length)
    return cascade_attention_reference(*args)


__all__ = ["paged_attention", "paged_attention_reference", "paged_attention_gather", "paged_attention_cpu",
           "decode_attention", "cpu_kernel_available", "KernelBuildError", "check_paged_inputs",
           "paged_attention_int8", "paged_attention_int8_reference", "quantize_pages", "cascade_attention",
           "cascade_attention_reference", "cascade_attention_cpu", "cascade_attention_triton", "merge_attention",
           "check_cascade_inputs"]
