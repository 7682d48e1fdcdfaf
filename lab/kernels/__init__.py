"""Paged decode attention: a readable PyTorch reference, a C++ CPU kernel and a Triton kernel, one signature.

    out = paged_attention(q, k_pool, v_pool, block_tables, lengths)   # Triton: CUDA, or TRITON_INTERPRET=1
    out = paged_attention_reference(...)                              # gather + SDPA per sequence: the oracle
    out = paged_attention_gather(...)                                 # gather + one SDPA for the batch
    out = paged_attention_cpu(...)                                    # C++, reads the pages in place
    out = decode_attention(...)                                       # the right one for the device
    out = paged_attention_int8(q, k_codes, v_codes, k_scale, v_scale, block_tables, lengths)  # INT8 pages
    out = paged_attention_int8_reference(...)                         # dequantize, then the reference

q [batch, q_heads, head_dim]; k_pool, v_pool [num_pages, page_size, kv_heads, head_dim]; block_tables int32 [batch,
max_pages]; lengths int32 [batch]; out [batch, q_heads, head_dim] in q's dtype. With `check_values=True` (the
default) every version reads the lengths and page ids back to check their range; a PagedCache passes False, so a
decode step never waits for the device. `cascade_attention` reads a prompt's pages once for all its branches.
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
    """The version for q's device: the Triton kernel for CUDA tensors (Triton installed, not
    interpreted: in NumPy it is far slower), `paged_attention_cpu` for CPU tensors of its dtypes
    (when it builds), else `paged_attention_gather`. max_length (the longest of lengths, known on
    the host) spares the C++ kernel a reduction; window, sinks: a local layer's rule."""
    args = (q, k_pool, v_pool, block_tables, lengths, scale, check_values)
    if q.is_cuda and triton_paged.triton is not None and not triton_paged.INTERPRETED:
        return paged_attention(*args, window, sinks)
    if q.device.type == "cpu" and q.dtype in CPU_DTYPES and cpu_kernel_available():
        return paged_attention_cpu(*args, max_length, window, sinks)
    return paged_attention_gather(*args, window, sinks)


def cascade_attention(q, k_pool, v_pool, shared_table, shared_length: int, block_tables, lengths, scale=None,
                      check_values=True, max_length=None):
    """Decode attention for B branches of one prompt, the shared pages read once (arguments in cascade.py), by the
    kernel `decode_attention` would choose: Triton, C++ or the reference. Returns [B, H_q, D] in q's dtype."""
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
