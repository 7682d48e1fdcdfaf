"""Paged decode attention: the readable reference, the gather version, the C++ CPU kernel and the Triton
kernel, each against dense attention.

Not collected by pytest on its own (its name does not start with test_): tests/test_kernels.py runs this
file in a fresh Python process. Without a GPU the kernel runs in Triton's interpreter, which fails in a
process that has imported torch._dynamo (see tests/conftest.py), so these results must not depend on
what other tests ran before them in the same process. `pytest tests/kernel_cases.py` works too.

The INT8 kernel (lab/kernels/triton_paged_int8.py) is checked twice: against its reference (the pages
dequantized, then paged_attention_reference) to ATOL, and that reference against the float oracle within
the error quantization can cause, a bound worked out at the INT8 tests.

The oracle never sees a page: plain softmax(q k^T * scale) v, in float64, over each sequence's keys and
values as they were before being written into randomly permuted pages. Every slot of the pool that holds
none of a sequence's positions (page 0, which the zero padding of the block tables points at, and the
tail of each sequence's last page) is filled with HUGE, so reading one by mistake is loud.

Tolerance, float32: the outputs are convex combinations of standard-normal values (|out| < 5); float32
rounds each product and sum to about 6e-8 relative, and over the at most a few hundred positions here
the error stays near 1e-6. An absolute 1e-5 keeps a tenfold margin, while a wrong page, a missed mask or
an off-by-one position moves the output by 1e-2 or more. Half-precision tolerances are worked out where
they are used.
"""

import math
import subprocess

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.kernels import (
    KernelBuildError,
    cpu,
    decode_attention,
    paged_attention,
    paged_attention_cpu,
    paged_attention_gather,
    paged_attention_int8,
    paged_attention_int8_reference,
    paged_attention_reference,
    quantize_pages,
    triton_paged,
)

HUGE = 1e30   # finite, so 0 * HUGE = 0: a masked slot contributes nothing, an unmasked one swamps the output
ATOL = 1e-5   # float32, see the module docstring
# float16 has 11 significant bits: rounding a result to it moves it by at most 2**-11 = 4.9e-4 of its
# value (the unit roundoff). The kernel computes in float32 and rounds once, when it stores the output.
# Twice that, relative, plus ATOL for the float32 arithmetic before it; a wrong position moves the
# output by 1e-2 or more (or to a HUGE value).
FP16_RTOL = 2 * 2**-11
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() and not triton_paged.INTERPRETED else "cpu"
needs_triton = pytest.mark.skipif(triton_paged.triton is None, reason="triton is not installed")
# The versions that run on CPU tensors without Triton: the readable oracle (gather + SDPA per sequence),
# the batched gather, and the C++ kernel a PagedCache uses on the CPU (reads pages in place).
PYTORCH_VERSIONS = pytest.mark.parametrize("attend", [paged_attention_reference, paged_attention_gather,
                                                      paged_attention_cpu], ids=["reference", "gather", "cpu"])


def huge(dtype):
    """HUGE, or the largest finite value of a narrower dtype (float16: 65504), so it stays finite."""
    return min(HUGE, torch.finfo(dtype).max)


def make_paged(lengths, page_size, q_heads, kv_heads, head_dim, dtype=torch.float32, seed=0, extra_pages=2):
    """Random keys and values per sequence, written into randomly permuted pages of a HUGE-filled pool.

    Returns q [B, H_q, D], k_pool, v_pool [num_pages, page_size, H_kv, D], block_tables int32 [B, max_pages]
    zero-padded (page 0 holds only HUGE), lengths int32 [B], and the unpaged keys and values per sequence
    (lists of [length, H_kv, D]) for the oracle.
    """
    g = torch.Generator().manual_seed(seed)
    pages_per_seq = [math.ceil(n / page_size) for n in lengths]
    num_pages = 1 + sum(pages_per_seq) + 1                            # page 0 and one spare stay HUGE
    max_pages = max(pages_per_seq) + extra_pages                      # padding past the longest sequence too
    pool_shape = (num_pages, page_size, kv_heads, head_dim)
    k_pool = torch.full(pool_shape, huge(dtype), dtype=dtype)
    v_pool = torch.full(pool_shape, huge(dtype), dtype=dtype)
    free_pages = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()  # pages handed out in random order
    block_tables = torch.zeros(len(lengths), max_pages, dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(lengths):
        k = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)    # [n, H_kv, D]
        v = torch.randn(n, kv_heads, head_dim, generator=g).to(dtype)
        for j in range(pages_per_seq[b]):
            page = free_pages.pop()
            block_tables[b, j] = page
            start, end = j * page_size, min(n, (j + 1) * page_size)
            k_pool[page, : end - start] = k[start:end]
            v_pool[page, : end - start] = v[start:end]
        ks.append(k)
        vs.append(v)
    q = torch.randn(len(lengths), q_heads, head_dim, generator=g).to(dtype)
    return q, k_pool, v_pool, block_tables, torch.tensor(lengths, dtype=torch.int32), ks, vs


def dense_oracle(q, ks, vs, scale=None):
    """Attention over each sequence's unpaged keys and values, in float64: [B, H_q, D].

    Written out (scores, softmax, weighted sum) rather than calling scaled_dot_product_attention, which
    paged_attention_reference itself calls: the oracle shares no code with what it checks.
    """
    outs = []
    for b, (k, v) in enumerate(zip(ks, vs, strict=True)):            # k, v [n, H_kv, D]: this sequence only
        qb = q[b].double()                                            # [H_q, D]
        group = qb.shape[0] // k.shape[1]                             # query head h reads kv head h // group
        kb = k.double().repeat_interleave(group, dim=1).transpose(0, 1)  # [H_q, n, D]
        vb = v.double().repeat_interleave(group, dim=1).transpose(0, 1)
        s = 1 / math.sqrt(qb.shape[-1]) if scale is None else scale
        scores = (kb @ qb[:, :, None])[..., 0] * s                    # [H_q, n]
        outs.append((scores.softmax(dim=-1)[:, None] @ vb)[:, 0])     # [H_q, D]
    return torch.stack(outs)                                          # [B, H_q, D]


def on(device, *tensors):
    return [t.to(device) for t in tensors]


# (page_size, lengths, q_heads, kv_heads, head_dim): page sizes 1, 3, 5, 16, 64; ragged batches of 1 to 5
# with lengths of 1, exactly a page and a page + 1; GQA groups of 1, 3 and 4; head_dim 16, 64 and 128.
KERNEL_CASES = [
    (1, [1, 2, 7], 4, 4, 16),
    (3, [1, 3, 4, 8, 11], 9, 3, 64),
    (5, [5, 6, 1, 13], 8, 2, 16),
    (16, [16, 17, 1], 9, 3, 64),
    (64, [64, 65, 3], 4, 1, 16),
    (16, [40], 9, 3, 16),
    (16, [700, 333], 9, 3, 64),      # many pages: the online softmax rescales 44 times
    (16, [1, 16, 33], 32, 8, 128),   # the heads, head_dim and page size lab/experiments/gpu.py measures
]
REFERENCE_CASES = KERNEL_CASES + [
    (page, lengths, q_heads, kv_heads, head_dim)
    for page in (1, 3, 5, 16, 64)
    for lengths in ([1], [page, page + 1, 1, 2 * page + 3, 70])
    for q_heads, kv_heads in ((3, 3), (9, 3), (8, 2))
    for head_dim in (16, 64)
]


@PYTORCH_VERSIONS
@pytest.mark.parametrize("page_size, lengths, q_heads, kv_heads, head_dim", REFERENCE_CASES)
def test_reference_matches_dense_attention(page_size, lengths, q_heads, kv_heads, head_dim, attend):
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged(lengths, page_size, q_heads, kv_heads, head_dim)
    out = attend(q, k_pool, v_pool, block_tables, lens)
    assert out.shape == q.shape and out.dtype == q.dtype
    torch.testing.assert_close(out.double(), dense_oracle(q, ks, vs), atol=ATOL, rtol=0)


@PYTORCH_VERSIONS
def test_reference_with_a_custom_scale(attend):
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged([9, 20], 4, 6, 2, 16, seed=1)
    out = attend(q, k_pool, v_pool, block_tables, lens, scale=0.3)
    torch.testing.assert_close(out.double(), dense_oracle(q, ks, vs, scale=0.3), atol=ATOL, rtol=0)


@PYTORCH_VERSIONS
def test_reference_bfloat16(attend):
    # The inputs are rounded to bfloat16 before the oracle sees them, so two roundings are left, each at
    # most 2**-8 relative (8 significant bits): the output's, under 2e-2 for |out| < 5, and (gather version
    # only) the probabilities' (its weighted sum of values runs in the pool's dtype), which moves it by at
    # most 2**-8 * max|v|, under 2e-2 for these standard-normal values (|v| < 5). 4e-2 is their sum; a
    # wrong page or position moves the output by far more (HUGE).
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged([1, 16, 17, 50], 16, 9, 3, 64, dtype=torch.bfloat16)
    out = attend(q, k_pool, v_pool, block_tables, lens)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.double(), dense_oracle(q, ks, vs), atol=4e-2, rtol=0)


@PYTORCH_VERSIONS
def test_reference_reads_pools_that_are_not_contiguous(attend):
    # Pools sliced out of wider storage (head_dim stride 1, but rows 2 * D apart) give the same answer.
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged([5, 19], 4, 6, 2, 16, seed=4)
    wide_k, wide_v = (torch.cat([p, torch.full_like(p, HUGE)], dim=-1) for p in (k_pool, v_pool))
    k_view, v_view = wide_k[..., :16], wide_v[..., :16]
    assert not k_view.is_contiguous() and not v_view.is_contiguous()
    torch.testing.assert_close(attend(q, k_view, v_view, block_tables, lens).double(),
                               dense_oracle(q, ks, vs), atol=ATOL, rtol=0)


@PYTORCH_VERSIONS
def test_padding_entries_of_block_tables_are_ignored(attend):
    # Zero padding points at page 0 (all HUGE); pointing the padding at real pages of other sequences
    # instead must not change a single bit, for the reference and for the kernel.
    q, k_pool, v_pool, block_tables, lens, _, _ = make_paged([3, 10, 1], 4, 6, 2, 16, seed=2)
    repointed = block_tables.clone()
    used = (lens.long() + 3) // 4
    for b in range(len(lens)):
        repointed[b, used[b]:] = block_tables[0, 0]                   # a real page of sequence 0
    args = (q, k_pool, v_pool)
    assert torch.equal(attend(*args, block_tables, lens),
                       attend(*args, repointed, lens))
    if triton_paged.triton is not None:
        args = on(KERNEL_DEVICE, q, k_pool, v_pool)
        assert torch.equal(paged_attention(*args, *on(KERNEL_DEVICE, block_tables, lens)),
                           paged_attention(*args, *on(KERNEL_DEVICE, repointed, lens)))


@PYTORCH_VERSIONS
def test_reference_reads_block_tables_that_are_views(attend):
    # A column slice of a wider table (strides (W, 1)) is what a caller gets from a preallocated table.
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged([5, 12], 3, 4, 2, 16, seed=3)
    wide = torch.zeros(2, 3 * block_tables.shape[1], dtype=torch.int32)
    wide[:, : block_tables.shape[1]] = block_tables
    view = wide[:, : block_tables.shape[1] + 1]
    torch.testing.assert_close(attend(q, k_pool, v_pool, view, lens).double(),
                               dense_oracle(q, ks, vs), atol=ATOL, rtol=0)


@needs_triton
@pytest.mark.parametrize("page_size, lengths, q_heads, kv_heads, head_dim", KERNEL_CASES)
def test_triton_kernel_matches_reference(page_size, lengths, q_heads, kv_heads, head_dim):
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged(lengths, page_size, q_heads, kv_heads, head_dim)
    expected = paged_attention_reference(q, k_pool, v_pool, block_tables, lens)
    out = paged_attention(*on(KERNEL_DEVICE, q, k_pool, v_pool, block_tables, lens))
    assert out.shape == q.shape and out.dtype == q.dtype and out.device.type == KERNEL_DEVICE
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=0)
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, ks, vs), atol=ATOL, rtol=0)


@needs_triton
def test_triton_kernel_custom_scale_odd_head_dim_and_strided_block_table():
    # head_dim 24 is padded to 32 inside the kernel; the block table is a column slice (stride W, 1).
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged([7, 2], 3, 4, 2, 24, seed=4)
    wide = torch.zeros(2, 2 * block_tables.shape[1], dtype=torch.int32)
    wide[:, : block_tables.shape[1]] = block_tables
    view = wide[:, : block_tables.shape[1]]
    out = paged_attention(*on(KERNEL_DEVICE, q, k_pool, v_pool, view, lens), scale=0.2)
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, ks, vs, scale=0.2), atol=ATOL, rtol=0)


@needs_triton
def test_triton_kernel_bfloat16():
    # bfloat16 in, float32 inside, bfloat16 out: the same 2e-2 bound as the reference (one bfloat16 step
    # at |out| near 2 is 2**-7 = 8e-3, and the kernel and the oracle may round to neighbouring values).
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged([1, 16, 17, 50], 16, 9, 3, 64, dtype=torch.bfloat16)
    out = paged_attention(*on(KERNEL_DEVICE, q, k_pool, v_pool, block_tables, lens))
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, ks, vs), atol=2e-2, rtol=0)


@needs_triton
def test_triton_kernel_float16_at_the_gpu_scripts_shape():
    # What lab/experiments/gpu.py times: float16, 32 query and 8 kv heads (groups of 4), head_dim 128,
    # pages of 16; lengths of 1, a page, a page + 1 and several pages. The oracle sees the same
    # float16-rounded inputs, in float64: FP16_RTOL for the kernel's one rounding of its output, ATOL for
    # its float32 arithmetic (see the top of this file).
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged([1, 16, 17, 150], 16, 32, 8, 128,
                                                               dtype=torch.float16, seed=5)
    out = paged_attention(*on(KERNEL_DEVICE, q, k_pool, v_pool, block_tables, lens))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, ks, vs), atol=ATOL, rtol=FP16_RTOL)


@needs_triton
def test_triton_kernel_addresses_pages_past_2_to_the_31_elements():
    # The kernel turns each page id into an offset, page * page_stride elements from the pool's start,
    # after casting the id to int64 (lab/kernels/triton_paged.py). In int32 that product wraps once it
    # reaches 2**31, which a large GPU pool does: 2**31 float16 elements are 4 GiB. So this pool is that
    # large, with the GPU script's shape (float16, 8 kv heads, head_dim 128, pages of 16), and the
    # sequence's pages sit on both sides of element 2**31.
    # Memory: 4 GiB of address space, but the operating system backs a large allocation with memory only
    # where it is written or read, and torch.empty writes nothing: the few pages filled here are all that
    # become resident on the CPU (measured: the process peaks near 300 MiB). Neither the bounds checks nor
    # Triton's interpreter copy the pool. K and V share one allocation, interleaved page by page, so the
    # address space needed is 4 GiB, not 8.
    page_size, q_heads, kv_heads, head_dim = 16, 32, 8, 128
    page_elements = 2 * page_size * kv_heads * head_dim                # one page of K, then one of V
    num_pages = 2**31 // page_elements + 3
    try:
        both = torch.empty(num_pages, 2, page_size, kv_heads, head_dim, dtype=torch.float16, device=KERNEL_DEVICE)
    except (RuntimeError, MemoryError) as e:                           # e.g. vm.overcommit_memory=2
        pytest.skip(f"cannot reserve 4 GiB of address space here: {e}")
    k_pool, v_pool = both[:, 0], both[:, 1]                           # [num_pages, page_size, H_kv, D] each
    pages = [3, num_pages - 1, num_pages // 2, num_pages - 2]          # in position order
    assert k_pool.stride(0) < 2**31 <= max(pages) * k_pool.stride(0)   # only the product overflows int32
    length = 3 * page_size + 5                                         # the last page is partly filled
    g = torch.Generator().manual_seed(6)
    k, v = (torch.randn(length, kv_heads, head_dim, generator=g).half() for _ in range(2))
    for j, page in enumerate(pages):
        rows = slice(j * page_size, min(length, (j + 1) * page_size))
        n = rows.stop - rows.start
        k_pool[page], v_pool[page] = huge(torch.float16), huge(torch.float16)  # the unused tail: loud if read
        k_pool[page, :n], v_pool[page, :n] = k[rows].to(KERNEL_DEVICE), v[rows].to(KERNEL_DEVICE)
    q = torch.randn(1, q_heads, head_dim, generator=g).half()
    block_tables = torch.tensor([pages], dtype=torch.int32)
    lengths = torch.tensor([length], dtype=torch.int32)
    out = paged_attention(*on(KERNEL_DEVICE, q), k_pool, v_pool, *on(KERNEL_DEVICE, block_tables, lengths))
    # Same tolerances as the float16 test above. Without the cast, the pages past 2**31 would be read
    # from a wrapped (negative) offset: another part of memory, or a crash of the test process.
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, [k], [v]), atol=ATOL, rtol=FP16_RTOL)


@needs_triton
@settings(max_examples=20)
@given(page_size=st.sampled_from([1, 2, 3, 5, 8, 16]),
       lengths=st.lists(st.integers(1, 40), min_size=1, max_size=4),
       kv_heads=st.integers(1, 3), group=st.sampled_from([1, 3, 4]),
       head_dim=st.sampled_from([16, 24, 64, 128]), seed=st.integers(0, 2**16))
def test_triton_kernel_matches_dense_attention_property(page_size, lengths, kv_heads, group, head_dim, seed):
    # Against the dense oracle, not against paged_attention_reference: the oracle reads each sequence's
    # own keys and values before they were paged, so a bug the two paged versions shared (a wrong page
    # order, say) could not hide. Examples are fixed by the Hypothesis profile in tests/conftest.py.
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged(lengths, page_size, kv_heads * group, kv_heads,
                                                               head_dim, seed=seed)
    out = paged_attention(*on(KERNEL_DEVICE, q, k_pool, v_pool, block_tables, lens))
    torch.testing.assert_close(out.cpu().double(), dense_oracle(q, ks, vs), atol=ATOL, rtol=0)


# INT8 pages. (page_size, lengths, q_heads, kv_heads, head_dim): pages of 1, 16 and 64; lengths of 1, a page
# and a page + 1; groups of 1, 3 and 4. Few and small: without a GPU the interpreter runs every one.
INT8_CASES = [
    (1, [1, 2, 7], 4, 4, 16),
    (16, [1, 16, 17], 9, 3, 64),
    (64, [64, 65, 1], 8, 2, 16),
]


def make_int8_paged(lengths, page_size, q_heads, kv_heads, head_dim, seed=0, q_dtype=torch.float32):
    """make_paged's float pools quantized to int8 pages (quantize_pages). The HUGE slots become codes 127
    with scale HUGE / 127: read by mistake, they are as loud as before. Returns q [B, H_q, D], k_codes,
    v_codes int8 [num_pages, page_size, H_kv, D], k_scale, v_scale [num_pages, page_size, H_kv], block_tables,
    lengths, and the unpaged float keys and values per sequence."""
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged(lengths, page_size, q_heads, kv_heads, head_dim,
                                                               seed=seed)
    return (q.to(q_dtype), *quantize_pages(k_pool, v_pool), block_tables, lens, ks, vs)


@needs_triton
@pytest.mark.parametrize("page_size, lengths, q_heads, kv_heads, head_dim", INT8_CASES)
def test_int8_kernel_matches_the_int8_reference(page_size, lengths, q_heads, kv_heads, head_dim):
    # ATOL, as for the float kernel: both compute in float32 from the same codes and scales. They differ in
    # where a scale multiplies (the reference dequantizes each element, the kernel scales each score and
    # probability once) and in the order of the sums: each a rounding of about 6e-8 relative, on values
    # as large as the standard-normal ones the float tests use (|code * scale| <= max |x|).
    *args, ks, vs = make_int8_paged(lengths, page_size, q_heads, kv_heads, head_dim)
    expected = paged_attention_int8_reference(*args)
    out = paged_attention_int8(*on(KERNEL_DEVICE, *args))
    assert out.shape == args[0].shape and out.dtype == torch.float32 and out.device.type == KERNEL_DEVICE
    torch.testing.assert_close(out.cpu(), expected, atol=ATOL, rtol=0)


@needs_triton
def test_int8_kernel_at_the_gpu_scripts_shape():
    # What lab/experiments/gpu.py times: a float16 query, 32 query and 8 kv heads, head_dim 128, pages of
    # 16, lengths of 1, a page + 1 and two pages + 1. Output float32: ATOL as above.
    *args, _, _ = make_int8_paged([1, 17, 33], 16, 32, 8, 128, seed=5, q_dtype=torch.float16)
    out = paged_attention_int8(*on(KERNEL_DEVICE, *args))
    torch.testing.assert_close(out.cpu(), paged_attention_int8_reference(*args), atol=ATOL, rtol=0)


@pytest.mark.parametrize("page_size, lengths, q_heads, kv_heads, head_dim", INT8_CASES)
def test_int8_reference_is_within_the_quantization_error_of_float_attention(page_size, lengths, q_heads,
                                                                            kv_heads, head_dim):
    # Rounding to the nearest code errs by at most s/2 per element, s the vector's scale. For query head h
    # (kv head j) of sequence b, a score q . k_t * c (c = 1/sqrt(D)) then moves by at most
    #     eps = c * ||q||_1 * max_t s_k[t, j] / 2.
    # Scores that each move by at most eps change each probability by a factor within exp(+-2 eps), so the
    # probabilities move by at most exp(2 eps) - 1 in total (L1), and the output by at most that times
    # max |v|; the values' own rounding adds at most max_t s_v[t, j] / 2 (a convex combination of errors
    # each within it). Plus ATOL for float32. A bound, not an estimate: in these cases the errors are near
    # 1e-2 and the bounds 0.06 to 0.6, while a HUGE slot read by mistake moves the output by 1e27 or more.
    q, k_codes, v_codes, k_scale, v_scale, block_tables, lens, ks, vs = make_int8_paged(
        lengths, page_size, q_heads, kv_heads, head_dim)
    assert k_codes.dtype == torch.int8 and int(k_codes.abs().max()) <= 127 and k_scale.shape == k_codes.shape[:3]
    error = (paged_attention_int8_reference(q, k_codes, v_codes, k_scale, v_scale, block_tables, lens).double()
             - dense_oracle(q, ks, vs)).abs()                                       # [B, H_q, D]
    group = q_heads // kv_heads
    c = 1 / math.sqrt(head_dim)
    for b, (k, v) in enumerate(zip(ks, vs, strict=True)):            # k, v [n, H_kv, D]
        *_, s_k, s_v = quantize_pages(k[None], v[None])               # [1, n, H_kv]: the scales in the pool
        s_k, s_v = (s.double()[0].amax(dim=0).repeat_interleave(group) for s in (s_k, s_v))   # [H_q]
        v_max = v.double().abs().amax(dim=(0, 2)).repeat_interleave(group)                  # [H_q]
        eps = c * q[b].double().abs().sum(dim=-1) * s_k / 2                                  # [H_q]
        bound = torch.expm1(2 * eps) * v_max + s_v / 2 + ATOL                               # [H_q]
        assert (error[b] <= bound[:, None]).all(), (error[b].amax(dim=-1), bound)


INT8_BAD_INPUTS = [
    ("float pools", lambda a: a.update(k_pool=a["k_pool"].float()), TypeError, r"k_pool must hold int8 codes"),
    ("scale shape", lambda a: a.update(v_scale=a["v_scale"][..., None]), ValueError,
     r"v_scale must be \[num_pages, page_size, kv_heads\]"),
    ("scale dtype", lambda a: a.update(k_scale=a["k_scale"].to(torch.int32)), TypeError,
     r"k_scale must be a floating-point"),
    ("a float check", lambda a: a.update(lengths=a["lengths"].long()), TypeError, r"lengths must be int32"),
]


@pytest.mark.parametrize("kernel", [paged_attention_int8_reference,
                                    pytest.param(paged_attention_int8, marks=needs_triton)])
@pytest.mark.parametrize("mutate, error, message", [b[1:] for b in INT8_BAD_INPUTS],
                         ids=[b[0] for b in INT8_BAD_INPUTS])
def test_int8_bad_inputs_raise_typed_errors(kernel, mutate, error, message):
    names = ("q", "k_pool", "v_pool", "k_scale", "v_scale", "block_tables", "lengths")
    args = dict(zip(names, make_int8_paged([5, 9], 4, 4, 2, 16)[:7], strict=True))
    mutate(args)
    with pytest.raises(error, match=message):
        kernel(**args)


def test_a_length_that_fills_the_block_table_is_accepted():
    # The boundary of the capacity check: max_pages * page_size positions fit exactly.
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged([12, 5], 4, 4, 2, 16, extra_pages=0)
    assert block_tables.shape[1] * 4 == 12
    out = paged_attention_reference(q, k_pool, v_pool, block_tables, lens)
    torch.testing.assert_close(out.double(), dense_oracle(q, ks, vs), atol=ATOL, rtol=0)
    if triton_paged.triton is not None:
        out = paged_attention(*on(KERNEL_DEVICE, q, k_pool, v_pool, block_tables, lens))
        torch.testing.assert_close(out.cpu().double(), dense_oracle(q, ks, vs), atol=ATOL, rtol=0)


def test_decode_attention_uses_the_cpu_kernel_off_the_gpu():
    q, k_pool, v_pool, block_tables, lens, _, _ = make_paged([4, 9], 4, 6, 2, 16)
    assert torch.equal(decode_attention(q, k_pool, v_pool, block_tables, lens),
                       paged_attention_cpu(q, k_pool, v_pool, block_tables, lens))


def test_decode_attention_gathers_what_the_cpu_kernel_does_not_take(monkeypatch):
    # float64 is no dtype of the C++ kernel, and a machine without a C++ compiler has no kernel at all:
    # both times the gather version serves.
    q, k_pool, v_pool, block_tables, lens, _, _ = make_paged([4, 9], 4, 6, 2, 16)
    args = (q.double(), k_pool.double(), v_pool.double(), block_tables, lens)
    assert torch.equal(decode_attention(*args), paged_attention_gather(*args))
    import lab.kernels
    monkeypatch.setattr(lab.kernels, "cpu_kernel_available", lambda: False)
    args = (q, k_pool, v_pool, block_tables, lens)
    assert torch.equal(decode_attention(*args), paged_attention_gather(*args))


@pytest.mark.parametrize("attend", [paged_attention_gather, paged_attention_cpu], ids=["gather", "cpu"])
@pytest.mark.parametrize("page_size, lengths, q_heads, kv_heads, head_dim", KERNEL_CASES)
def test_cpu_versions_match_the_readable_reference(page_size, lengths, q_heads, kv_heads, head_dim, attend):
    # All compute in float32 from the same inputs, in different orders: ATOL as above.
    q, k_pool, v_pool, block_tables, lens, _, _ = make_paged(lengths, page_size, q_heads, kv_heads, head_dim)
    torch.testing.assert_close(attend(q, k_pool, v_pool, block_tables, lens),
                               paged_attention_reference(q, k_pool, v_pool, block_tables, lens), atol=ATOL, rtol=0)


def consecutive_pages(block_tables, lens, page_size, k_pool, v_pool):
    """The same sequences with their pages moved so that each sequence's pages lie in a run, in order
    (pool page 1 + j for the j-th page handed out). Returns k_pool, v_pool, block_tables."""
    k, v, tables = k_pool.clone(), v_pool.clone(), torch.zeros_like(block_tables)
    nxt = 1
    for b, n in enumerate(lens.tolist()):
        for j in range(-(-n // page_size)):
            k[nxt], v[nxt] = k_pool[block_tables[b, j]], v_pool[block_tables[b, j]]
            tables[b, j], nxt = nxt, nxt + 1
    return k, v, tables


# Tolerances of the C++ kernel against the reference. Both accumulate in float32 and round once to the
# output dtype. float32: the two differ only in summation order (the kernel sums page by page, rescaled by
# the online softmax, then merges runs of CHUNK positions); each order's error is a few float32 units
# (6e-8) times the number of terms' growth, about 1e-6 of the values' scale for a few thousand positions.
# 1e-5 of max|v| leaves a tenfold margin. 16-bit: the float32 results differ by that much, then each
# rounds to the nearest 16-bit value, so they agree or land one unit apart; a unit is at most 2**-7 of
# the value for bfloat16 (8 significant bits) and 2**-10 for float16 (11 bits): that is rtol, with the
# float32 atol beside it. A wrong page or position moves the output by far more (HUGE in unused slots).
CPU_TOLERANCES = {torch.float32: 0.0, torch.bfloat16: 2**-7, torch.float16: 2**-10}


@pytest.mark.parametrize("dtype", list(CPU_TOLERANCES), ids=str)
@pytest.mark.parametrize("layout", ["scattered", "consecutive"])
@pytest.mark.parametrize("lengths, q_heads, kv_heads", [
    ([1], 9, 3),                        # a single position
    ([16, 32, 1], 9, 3),                # lengths that fill their last page exactly
    ([1300, 17, 600, 1], 9, 3),         # ragged, two sequences longer than one run of CHUNK positions
    ([700, 5], 8, 1),                   # one kv head for all query heads
    ([40, 3], 4, 4),                    # no grouping
])
def test_cpu_kernel_matches_the_reference(lengths, q_heads, kv_heads, layout, dtype):
    page_size = 16
    q, k_pool, v_pool, block_tables, lens, _, _ = make_paged(lengths, page_size, q_heads, kv_heads, 64, dtype=dtype,
                                                             extra_pages=30)   # tables wider than needed
    if layout == "consecutive":
        k_pool, v_pool, block_tables = consecutive_pages(block_tables, lens, page_size, k_pool, v_pool)
    out = paged_attention_cpu(q, k_pool, v_pool, block_tables, lens)
    assert out.dtype == dtype and out.shape == q.shape
    want = paged_attention_reference(q, k_pool, v_pool, block_tables, lens)
    scale = max(float(v_pool[p].float().abs().max()) for p in block_tables[:, 0].tolist())  # the values'
    torch.testing.assert_close(out.float(), want.float(), atol=ATOL * scale, rtol=CPU_TOLERANCES[dtype])


def test_cpu_kernel_takes_a_scale_and_chunks_of_any_page_size():
    # A custom scale, and a page size (24) that does not divide the CHUNK of 512: runs are whole pages.
    q, k_pool, v_pool, block_tables, lens, ks, vs = make_paged([1000, 530, 7], 24, 6, 2, 32, seed=5)
    out = paged_attention_cpu(q, k_pool, v_pool, block_tables, lens, scale=0.05)
    torch.testing.assert_close(out.double(), dense_oracle(q, ks, vs, scale=0.05), atol=ATOL, rtol=0)


def test_cpu_kernel_refuses_what_it_cannot_run():
    q, k_pool, v_pool, block_tables, lens, _, _ = make_paged([4, 9], 4, 6, 2, 16)
    with pytest.raises(TypeError, match=r"paged_attention_cpu takes torch.float32, .* got torch.float64"):
        paged_attention_cpu(q.double(), k_pool.double(), v_pool.double(), block_tables, lens)
    meta = [t.to("meta") for t in (q, k_pool, v_pool, block_tables, lens)]
    with pytest.raises(ValueError, match=r"runs on CPU tensors, got meta"):
        paged_attention_cpu(*meta, check_values=False)


def test_loading_the_cpu_kernel_keeps_subnormal_floats():
    # The kernel is compiled with -ffast-math but linked without it: linked with it, GCC adds start-up code
    # that flushes subnormal floats to zero in the whole process, PyTorch's arithmetic included.
    cpu._library()
    tiny = torch.tensor([1e-39])                                      # below float32's smallest normal, 1.2e-38
    assert (tiny * torch.tensor([1.0])).item() == pytest.approx(1e-39, rel=1e-6)


def test_cpu_kernel_runs_its_tasks_on_openmp_threads():
    # at::parallel_for splits work over threads only when the kernel is compiled with OpenMP; built without
    # it, the loop runs on one thread whatever torch.set_num_threads says (two threads then took 1.75x
    # SDPA at 4,096 positions, batch 8). Compiled with it, the library calls into libgomp (GOMP_parallel),
    # the copy PyTorch loaded: nm, from the binutils the compiler needs, lists the undefined symbols.
    lib = cpu._library()
    undefined = subprocess.run(["nm", "-D", "--undefined-only", lib._name], capture_output=True, text=True,
                               check=True).stdout
    assert "GOMP_parallel" in undefined


def test_cpu_kernel_without_a_compiler_raises_a_build_error(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("LAB_KERNEL_CACHE", str(tmp_path))            # nothing built there yet
    cpu._library.cache_clear()
    try:
        with pytest.raises(KernelBuildError, match=r"cannot run the C\+\+ compiler .*no-such-compiler.*CXX"):
            cpu._library()
    finally:
        cpu._library.cache_clear()                                    # the next call loads the real build


@needs_triton
def test_kernel_refuses_cpu_tensors_without_the_interpreter(monkeypatch):
    monkeypatch.setattr(triton_paged, "INTERPRETED", False)
    q, k_pool, v_pool, block_tables, lens, _, _ = make_paged([4], 4, 2, 2, 16)
    with pytest.raises(RuntimeError, match=r"on cpu.*TRITON_INTERPRET=1.*paged_attention_reference"):
        paged_attention(q, k_pool, v_pool, block_tables, lens)


def test_kernel_without_triton_says_how_to_install_it(monkeypatch):
    monkeypatch.setattr(triton_paged, "triton", None)
    q, k_pool, v_pool, block_tables, lens, _, _ = make_paged([4], 4, 2, 2, 16)
    with pytest.raises(RuntimeError, match="pip install triton"):
        paged_attention(q, k_pool, v_pool, block_tables, lens)


# ---- a local layer's rule: the last `window` positions and the first `sinks` (chapter 10) ----
# (page_size, lengths, window, sinks): windows inside one page, across pages and longer than a sequence;
# sinks none, inside the first page, a whole page and more; sequences shorter than the window.
WINDOW_CASES = [(4, [37, 9, 4, 1], 8, 2), (16, [100, 50, 17, 1], 32, 4), (5, [23, 11], 7, 0),
                (3, [30, 2], 1, 1), (16, [40], 64, 0), (4, [41, 26], 6, 4), (16, [700, 333], 100, 20)]


def window_case(page_size, lengths, window, sinks, dtype=torch.float32):
    """make_paged's inputs, the dense oracle over the positions the rule keeps (chosen here, position by
    position, from the rule as the book states it), and the pages no query reads: wholly past the sinks
    and below the window."""
    q, k_pool, v_pool, tables, lens, ks, vs = make_paged(lengths, page_size, 9, 3, 16, dtype=dtype, seed=5)
    keep = [[j for j in range(n) if j >= n - window or j < sinks] for n in lengths]
    want = dense_oracle(q, [k[kp] for k, kp in zip(ks, keep, strict=True)],
                        [v[kp] for v, kp in zip(vs, keep, strict=True)])
    unread = [[i for i in range(math.ceil(n / page_size))
               if i * page_size >= sinks and (i + 1) * page_size <= n - window] for n in lengths]
    return q, k_pool, v_pool, tables, lens, want, unread


@pytest.mark.parametrize("attend", [paged_attention_reference, paged_attention_gather, paged_attention_cpu,
                                    pytest.param(paged_attention, marks=needs_triton)],
                         ids=["reference", "gather", "cpu", "triton"])
@pytest.mark.parametrize("page_size, lengths, window, sinks", WINDOW_CASES)
def test_a_window_reads_its_positions_and_sinks_only(page_size, lengths, window, sinks, attend):
    """A local layer's decode against the dense oracle over what it keeps; the pages no query reads point at
    page 0 (HUGE only), as a table whose entries the window gave back does (NULL is written as 0)."""
    q, k_pool, v_pool, tables, lens, want, unread = window_case(page_size, lengths, window, sinks)
    for b, pages in enumerate(unread):
        tables[b, pages] = 0
    device = KERNEL_DEVICE if attend is paged_attention else "cpu"
    out = attend(*on(device, q, k_pool, v_pool, tables, lens), window=window, sinks=sinks)
    torch.testing.assert_close(out.cpu().double(), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("attend", [paged_attention_cpu, pytest.param(paged_attention, marks=needs_triton)],
                         ids=["cpu", "triton"])
@pytest.mark.parametrize("page_size, lengths, window, sinks", WINDOW_CASES)
def test_the_kernels_never_load_a_page_outside_the_window(page_size, lengths, window, sinks, attend):
    """The pages no query reads are filled with NaN: a kernel that loaded one, even to mask it, would carry
    NaN into its output (0 * NaN). The reference and the gather load and mask, so they are not held to it."""
    q, k_pool, v_pool, tables, lens, want, unread = window_case(page_size, lengths, window, sinks)
    for b, pages in enumerate(unread):
        for i in pages:
            k_pool[tables[b, i]], v_pool[tables[b, i]] = math.nan, math.nan
    device = KERNEL_DEVICE if attend is paged_attention else "cpu"
    out = attend(*on(device, q, k_pool, v_pool, tables, lens), window=window, sinks=sinks)
    torch.testing.assert_close(out.cpu().double(), want, atol=ATOL, rtol=0)


@pytest.mark.parametrize("window, sinks, message", [(-1, 0, "window must be an int >= 0"),
                                                    (4, 1.5, "sinks must be an int >= 0"),
                                                    (0, 2, "sinks .* need a window")])
def test_a_bad_window_is_refused(window, sinks, message):
    q, k_pool, v_pool, tables, lens, _, _ = make_paged([5, 9], 4, 4, 2, 16)
    for attend in (paged_attention_reference, paged_attention_gather, paged_attention_cpu, decode_attention):
        with pytest.raises(ValueError, match=message):
            attend(q, k_pool, v_pool, tables, lens, window=window, sinks=sinks)


def _replace(name, value):
    """A mutation of the valid arguments: set one of them to value(args)."""
    def mutate(args):
        args[name] = value(args)
    return mutate


BAD_INPUTS = [
    ("q is not a tensor", _replace("q", lambda a: a["q"].tolist()), TypeError, "q must be a torch.Tensor"),
    ("q rank", _replace("q", lambda a: a["q"][:, None]), ValueError, r"q must have rank 3"),
    ("k_pool rank", _replace("k_pool", lambda a: a["k_pool"][0]), ValueError, r"k_pool must have rank 4"),
    ("lengths rank", _replace("lengths", lambda a: a["lengths"][:, None]), ValueError, r"lengths must have rank 1"),
    ("devices", _replace("lengths", lambda a: a["lengths"].to("meta")), ValueError, r"one device.*lengths on meta"),
    ("q dtype", _replace("q", lambda a: a["q"].to(torch.int64)), TypeError, r"q must be a floating-point"),
    ("pool dtype", _replace("v_pool", lambda a: a["v_pool"].double()), TypeError, r"v_pool must have q's dtype"),
    ("pool shapes", _replace("v_pool", lambda a: a["v_pool"][:, :2]), ValueError, r"v_pool must have k_pool's shape"),
    ("head_dim", _replace("q", lambda a: a["q"][..., :8]), ValueError, r"head_dim 16 .* q's head_dim 8"),
    ("GQA", _replace("q", lambda a: torch.cat([a["q"], a["q"][:, :1]], dim=1)), ValueError,
     r"q_heads 5 .* multiple of kv_heads 2"),
    ("table dtype", _replace("block_tables", lambda a: a["block_tables"].long()), TypeError,
     r"block_tables must be int32, got torch.int64"),
    ("table batch", _replace("block_tables", lambda a: a["block_tables"][:1]), ValueError,
     r"block_tables must be \[batch=2, max_pages\], got shape \(1, "),
    ("lengths dtype", _replace("lengths", lambda a: a["lengths"].long()), TypeError,
     r"lengths must be int32, got torch.int64"),
    ("lengths batch", _replace("lengths", lambda a: a["lengths"][:1]), ValueError,
     r"lengths must be \[batch=2\], got shape \(1,\)"),
    ("length too long", _replace("lengths", lambda a: torch.tensor([5, 21], dtype=torch.int32)), ValueError,
     r"length of 21 exceeds .* max_pages 5 \* page_size 4 = 20"),
    ("zero length", _replace("lengths", lambda a: torch.tensor([0, 9], dtype=torch.int32)), ValueError,
     r"at least 1 .* lengths \[0, 9\]"),
    ("page id", _replace("block_tables", lambda a: a["block_tables"] + 100), ValueError,
     r"page ids from 100 to \d+, but the pool has \d+ pages"),
    ("negative page id", _replace("block_tables", lambda a: a["block_tables"] - 1), ValueError,
     r"page ids from -1 to"),
    ("empty batch", lambda a: a.update(q=a["q"][:0], block_tables=a["block_tables"][:0], lengths=a["lengths"][:0]),
     ValueError, r"batch 0"),
]


@pytest.mark.parametrize("kernel", [
    paged_attention_reference,
    paged_attention_gather,
    paged_attention_cpu,
    pytest.param(paged_attention, marks=needs_triton),
])
@pytest.mark.parametrize("mutate, error, message", [b[1:] for b in BAD_INPUTS], ids=[b[0] for b in BAD_INPUTS])
def test_bad_inputs_raise_typed_errors(kernel, mutate, error, message):
    q, k_pool, v_pool, block_tables, lens, _, _ = make_paged([5, 9], 4, 4, 2, 16)  # 3 + 2 padding pages
    args = dict(q=q, k_pool=k_pool, v_pool=v_pool, block_tables=block_tables, lengths=lens)
    mutate(args)
    with pytest.raises(error, match=message):
        kernel(**args)
