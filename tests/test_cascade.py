"""Cascade attention (lab/kernels/cascade.py): branches of one prompt, the shared pages read once.

Oracle: `paged_attention_reference` over each branch's full block table (the shared pages, then its own),
which never splits the positions; where the shared part ends inside a page, attention in float64 over the
unpaged keys (tests/cascade_cases.py, which also builds the inputs and states the tolerances: float32 1e-5
absolute, bfloat16 one unit in the last place, 2**-7 relative). The reference and the C++ kernel are tested
here; the Triton version runs in a fresh process (tests/cascade_cases.py says why).
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from cascade_cases import ATOL, assert_matches, make_cascade, own_lengths

from lab.kernels import (
    cascade_attention,
    cascade_attention_cpu,
    cascade_attention_reference,
    cpu_kernel_available,
    merge_attention,
)
from lab.kernels.cascade import attention_lse

CASES = Path(__file__).with_name("cascade_cases.py")
needs_cpu_kernel = pytest.mark.skipif(not cpu_kernel_available(), reason="no C++ compiler built the CPU kernel")
VERSIONS = pytest.mark.parametrize("attend", [cascade_attention_reference,
                                              pytest.param(cascade_attention_cpu, marks=needs_cpu_kernel)],
                                   ids=["reference", "cpu"])


@VERSIONS
@pytest.mark.parametrize("page_size", [1, 4, 16])
@pytest.mark.parametrize("B", [1, 4, 16])
@pytest.mark.parametrize("shared", [0, 16, 1000])
def test_cascade_equals_paged_attention_over_the_full_tables(attend, page_size, B, shared):
    # SmolLM2's heads (9 query, 3 kv, size 64); branches of different own lengths. shared 1000 with pages of
    # 16 ends inside a page: the oracle is then dense attention (cascade_cases.expected).
    case = make_cascade(shared, own_lengths(B, page_size), page_size)
    assert_matches(attend(*case["args"]), case)


@VERSIONS
@pytest.mark.parametrize("heads, head_dim", [((4, 4), 128), ((6, 2), 40)])
def test_cascade_other_head_shapes(attend, heads, head_dim):
    # A head size the C++ kernel knows at compile time (128) and one it does not (40); groups of 1 and 3.
    case = make_cascade(64, [1, 17, 30], 16, *heads, head_dim)
    assert_matches(attend(*case["args"]), case)


@VERSIONS
def test_cascade_bfloat16(attend):
    case = make_cascade(1008, own_lengths(4, 16), 16, dtype=torch.bfloat16)
    out = attend(*case["args"])
    assert out.dtype == torch.bfloat16
    assert_matches(out, case)


@needs_cpu_kernel
@pytest.mark.parametrize("threads", [1, 2])
def test_cpu_kernel_splits_a_long_shared_part_into_runs(threads):
    # 2,000 shared positions: runs of at most 512 (and a thread's share), whose partials the merge combines.
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        case = make_cascade(2000, own_lengths(4, 16), 16)
        assert_matches(cascade_attention_cpu(*case["args"], max_length=17), case)
    finally:
        torch.set_num_threads(before)


@needs_cpu_kernel
def test_cascade_attention_chooses_the_kernel_for_the_device():
    case = make_cascade(48, [3, 20], 16)
    assert torch.equal(cascade_attention(*case["args"]), cascade_attention_cpu(*case["args"]))
    double = [x.double() if torch.is_tensor(x) and x.is_floating_point() else x for x in case["args"]]
    torch.testing.assert_close(cascade_attention(*double), cascade_attention_reference(*double))  # no C++ float64


def test_merge_of_two_parts_is_attention_over_both():
    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(2, 9, 64, generator=g), torch.randn(40, 3, 64, generator=g), torch.randn(40, 3, 64,
                                                                                                  generator=g)
    whole = attention_lse(q, k, v)
    merged = merge_attention(*attention_lse(q, k[:13], v[:13]), *attention_lse(q, k[13:], v[13:]))
    for got, want in zip(merged, whole, strict=True):
        torch.testing.assert_close(got, want, atol=ATOL, rtol=0)
    empty = attention_lse(q, k[:0], v[:0])                                # no positions: lse -inf, weight 0
    assert torch.isinf(empty[1]).all() and (empty[1] < 0).all()
    for got, want in zip(merge_attention(*empty, *whole), whole, strict=True):
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def bad(name):
    """make_cascade's arguments with `name` spoilt, and the error that must name it."""
    q, k_pool, v_pool, table, shared, tables, lengths = make_cascade(32, [2, 3], 16)["args"]
    spoilt = {"shared_table float": ((q, k_pool, v_pool, table.float(), shared, tables, lengths),
                                     TypeError, "shared_table must be int32"),
              "shared_table 2-D": ((q, k_pool, v_pool, table[None], shared, tables, lengths),
                                   ValueError, "shared_table must have rank 1"),
              "shared_table list": ((q, k_pool, v_pool, table.tolist(), shared, tables, lengths),
                                    TypeError, "shared_table must be a torch.Tensor"),
              "shared_length float": ((q, k_pool, v_pool, table, 32.0, tables, lengths),
                                      TypeError, "shared_length must be an int"),
              "shared_length too long": ((q, k_pool, v_pool, table, 33, tables, lengths),
                                         ValueError, "shared_length 33 must be >= 0 and fill the 2 pages"),
              "shared page id": ((q, k_pool, v_pool, table + 100, shared, tables, lengths),
                                 ValueError, "shared_table holds page ids"),
              "own length 0": ((q, k_pool, v_pool, table, shared, tables, lengths * 0),
                               ValueError, "every length must be at least 1"),
              "pool dtype": ((q, k_pool.double(), v_pool, table, shared, tables, lengths),
                             TypeError, "k_pool must have q's dtype"),
              "shared_table device": ((q, k_pool, v_pool, table.to("meta"), shared, tables, lengths),
                                      ValueError, "shared_table must be on q's device")}
    return spoilt[name]


@VERSIONS
@pytest.mark.parametrize("name", ["shared_table float", "shared_table 2-D", "shared_table list",
                                  "shared_length float", "shared_length too long", "shared page id",
                                  "own length 0", "pool dtype", "shared_table device"])
def test_errors_name_the_argument(attend, name):
    args, error, message = bad(name)
    with pytest.raises(error, match=message):
        attend(*args)


@needs_cpu_kernel
def test_cpu_kernel_refuses_what_it_cannot_run():
    case = make_cascade(32, [2, 3], 16)
    double = [x.double() if torch.is_tensor(x) and x.is_floating_point() else x for x in case["args"]]
    with pytest.raises(TypeError, match=r"cascade_attention_cpu takes torch.float32, .* got torch.float64"):
        cascade_attention_cpu(*double)
    meta = [x.to("meta") if torch.is_tensor(x) else x for x in case["args"]]
    with pytest.raises(ValueError, match="runs on CPU tensors, got meta"):
        cascade_attention_cpu(*meta, check_values=False)


def run_cases(*pytest_args):
    """pytest on tests/cascade_cases.py in a new Python process, Triton's interpreter on without a GPU."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"       # before Python starts, so before anything imports triton
    args = [str(CASES), "-p", "no:cacheprovider", *pytest_args]
    done = subprocess.run([sys.executable, "-c", f"import sys, pytest; sys.exit(pytest.main({args!r}))"],
                          capture_output=True, text=True, env=env, cwd=CASES.parent.parent, timeout=900)
    assert done.returncode == 0, f"tests/cascade_cases.py failed:\n{done.stdout[-12000:]}\n{done.stderr[:6000]}"


@pytest.mark.slow            # over 5 s: make test within 15 minutes (make test-slow runs it)
def test_triton_cascade_quick_cases_in_a_fresh_process():
    run_cases("-m", "not slow")


@pytest.mark.slow  # over 8 s: `make test-slow`
def test_triton_cascade_all_cases_in_a_fresh_process():
    run_cases()


@needs_cpu_kernel
def test_cascade_bench_counts_the_shared_pages_once():
    from lab.cascade_bench import cascade_case, table
    row = cascade_case(3, 64, warmup=0, rounds=1)
    kv_bytes = 2 * 3 * 64 * 4                                          # a position's keys and values, float32
    assert row["cascade_MB"] * 1e6 == pytest.approx((64 + row["own"]) * kv_bytes)
    assert row["paged_MB"] * 1e6 == pytest.approx((3 * 64 + row["own"]) * kv_bytes)
    assert 3 * 64 <= row["own"] <= 3 * 256 and row["max_abs_diff"] < ATOL
    assert table([row]).count("\n") == 2
