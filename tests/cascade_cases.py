"""Cascade attention's Triton version against the oracle, and the inputs every cascade test builds.

Not collected by pytest on its own (its name does not start with test_): tests/test_cascade.py runs this file
in a fresh Python process, for the reason tests/kernel_cases.py gives (without a GPU the Triton kernel runs
in Triton's interpreter, which fails in a process that has imported torch._dynamo). `make_cascade` is
imported by tests/test_cascade.py too.

The oracle is `paged_attention_reference` over each branch's full block table, the shared pages then its
own, which never splits the positions: cascade attention must equal it within float32 rounding. Every slot
of the pool that holds no position (page 0, which the zero padding of the tables points at, a spare page,
the tail of each last page) is HUGE, so that reading one by mistake is loud. When the shared part ends
inside a page, no block table can say where a branch's positions continue, so the oracle is then attention
over each branch's unpaged keys and values in float64 (`dense_oracle`).
"""

import math
import sys

import pytest
import torch

from lab.kernels import cascade_attention_reference, cascade_attention_triton, paged_attention_reference, triton_paged

HUGE = 1e30
# float32: both sides sum the same float32 products in a different order, the cascade with one merge more;
# over the at most ~2,100 positions here that moves an output by under 1e-6 (measured: 7e-7 at most), and a
# wrong page or a lost merge weight moves it by 1e-2 or more. bfloat16: both round a float32 result once, so they
# agree or land one unit in the last place apart, at most 2**-7 of the value (8 significant bits).
ATOL = 1e-5
BF16_RTOL = 2**-7
DEVICE = "cuda" if torch.cuda.is_available() and not triton_paged.INTERPRETED else "cpu"
needs_triton = pytest.mark.skipif(triton_paged.triton is None, reason="triton is not installed")


def make_cascade(shared, own, page_size, q_heads=9, kv_heads=3, head_dim=64, dtype=torch.float32, seed=0):
    """Branches of one prompt in a HUGE-filled pool, pages handed out in random order.

    shared: the prompt's positions; own: each branch's own lengths (>= 1). Returns a dict: the cascade's
    arguments `args` (q [B, H_q, D], k_pool, v_pool, shared_table int32 [S], shared, block_tables int32
    [B, max_pages] zero-padded with a spare column, lengths int32 [B]); `full` (block tables [B, S + max_pages]
    and lengths [B] of each branch's whole sequence, for paged attention: only when shared fills its pages);
    and `ks`, `vs` each branch's unpaged keys and values [shared + own, H_kv, D].
    """
    g = torch.Generator().manual_seed(seed)
    S, own_pages = -(-shared // page_size), [-(-n // page_size) for n in own]
    num_pages = 1 + S + sum(own_pages) + 1                              # page 0 and a spare stay HUGE
    shape = (num_pages, page_size, kv_heads, head_dim)
    pools = [torch.full(shape, min(HUGE, torch.finfo(dtype).max), dtype=dtype) for _ in range(2)]
    free = (torch.randperm(num_pages - 1, generator=g) + 1).tolist()
    draw = lambda n: [torch.randn(n, kv_heads, head_dim, generator=g).to(dtype) for _ in range(2)]  # k, v

    def write(kv, n_pages):                                             # kv [n, H_kv, D] into new pages
        pages = [free.pop() for _ in range(n_pages)]
        for j, page in enumerate(pages):
            for pool, x in zip(pools, kv, strict=True):
                rows = x[j * page_size:(j + 1) * page_size]
                pool[page, :len(rows)] = rows
        return pages

    shared_kv = draw(shared)
    shared_table = torch.tensor(write(shared_kv, S), dtype=torch.int32)
    block_tables = torch.zeros(len(own), max(own_pages) + 1, dtype=torch.int32)
    ks, vs = [], []
    for b, n in enumerate(own):
        kv = draw(n)
        block_tables[b, :own_pages[b]] = torch.tensor(write(kv, own_pages[b]), dtype=torch.int32)
        ks.append(torch.cat([shared_kv[0], kv[0]])), vs.append(torch.cat([shared_kv[1], kv[1]]))
    q = torch.randn(len(own), q_heads, head_dim, generator=g).to(dtype)
    lengths = torch.tensor(own, dtype=torch.int32)
    full = (torch.cat([shared_table.expand(len(own), S), block_tables], dim=1), lengths + shared)
    return dict(args=(q, *pools, shared_table, shared, block_tables, lengths), full=full, ks=ks, vs=vs)


def dense_oracle(q, ks, vs):
    """softmax(q k^T / sqrt(D)) v in float64 over each branch's unpaged keys and values: [B, H_q, D]."""
    out = []
    for b, (k, v) in enumerate(zip(ks, vs, strict=True)):              # [n, H_kv, D]
        group = q.shape[1] // k.shape[1]
        k, v = (x.double().repeat_interleave(group, dim=1).transpose(0, 1) for x in (k, v))  # [H_q, n, D]
        scores = (k @ q[b].double()[:, :, None])[..., 0] / math.sqrt(q.shape[-1])          # [H_q, n]
        out.append((scores.softmax(-1)[:, None] @ v)[:, 0])                                # [H_q, D]
    return torch.stack(out)


def expected(case):
    """The oracle's output for a make_cascade case, in q's dtype: paged attention over the full tables, or,
    when the shared part ends inside a page, dense attention in float64."""
    q, k_pool, v_pool, shared_table, shared = case["args"][:5]
    if shared % k_pool.shape[1]:
        return dense_oracle(q, case["ks"], case["vs"]).to(q.dtype)
    return paged_attention_reference(q, k_pool, v_pool, *case["full"])


def own_lengths(B, page_size):
    """B branches of different own lengths: 1, a page, a page and one, then others up to 70 (one branch: 5)."""
    if B == 1:
        return [5]
    return [1, page_size, page_size + 1, *(1 + 13 * b % 70 for b in range(3, B))][:B]


def assert_matches(out, case):
    want = expected(case)
    rtol = BF16_RTOL if out.dtype == torch.bfloat16 else 0
    torch.testing.assert_close(out.cpu(), want, atol=ATOL, rtol=rtol)


@pytest.fixture(autouse=True)
def interpreter_still_works():
    """Fail with the cause, not Triton's puzzle, when torch._dynamo was imported first (tests/conftest.py)."""
    if triton_paged.INTERPRETED and "torch._dynamo" in sys.modules:
        pytest.fail("torch._dynamo was imported in this process before this test, and Triton's interpreter "
                    "cannot run after that: run tests/cascade_cases.py in a process of its own (as "
                    "tests/test_cascade.py does)", pytrace=False)


@needs_triton
@pytest.mark.parametrize("page_size, B, shared", [
    (16, 1, 16), (16, 4, 1008), (16, 4, 0), (1, 4, 16), (16, 2, 1040),
    *(pytest.param(*case, marks=pytest.mark.slow) for case in [(16, 16, 1000), (4, 4, 1000), (4, 16, 40)])])
def test_triton_cascade_matches_the_oracle(page_size, B, shared):
    # (16, 2, 1040): three splits of the shared part, the last one page; (16, 16, 1000): a partial last shared
    # page. Slow: over a second each in Triton's interpreter.
    case = make_cascade(shared, own_lengths(B, page_size), page_size)
    assert_matches(cascade_attention_triton(*(x.to(DEVICE) if torch.is_tensor(x) else x for x in case["args"])),
                   case)


@needs_triton
def test_triton_cascade_bfloat16():
    case = make_cascade(1008, own_lengths(4, 16), 16, dtype=torch.bfloat16)
    out = cascade_attention_triton(*(x.to(DEVICE) if torch.is_tensor(x) else x for x in case["args"]))
    assert out.dtype == torch.bfloat16
    assert_matches(out, case)


@needs_triton
def test_triton_cascade_agrees_with_the_reference_on_odd_shapes():
    # One query head per kv head and a head size that is no power of two: the kernel pads both.
    case = make_cascade(48, [3, 17], 16, q_heads=2, kv_heads=2, head_dim=40)
    args = [x.to(DEVICE) if torch.is_tensor(x) else x for x in case["args"]]
    torch.testing.assert_close(cascade_attention_triton(*args).cpu(), cascade_attention_reference(*case["args"]),
                               atol=ATOL, rtol=0)
    assert_matches(cascade_attention_triton(*args), case)


@needs_triton
def test_triton_cascade_names_a_bad_argument():
    q, k_pool, v_pool, shared_table, shared, tables, lengths = make_cascade(32, [2, 3], 16)["args"]
    with pytest.raises(TypeError, match="shared_table must be int32"):
        cascade_attention_triton(q, k_pool, v_pool, shared_table.long(), shared, tables, lengths)
    with pytest.raises(ValueError, match="shared_length 33"):
        cascade_attention_triton(q, k_pool, v_pool, shared_table, 33, tables, lengths)
