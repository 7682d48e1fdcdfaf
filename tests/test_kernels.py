"""The paged-attention tests of tests/kernel_cases.py, each run in a fresh Python process.

Why a process of their own: without a GPU the Triton kernel runs in Triton's interpreter
(TRITON_INTERPRET=1), and with torch 2.13 and triton 3.9 the interpreter stops working in a process that
has imported torch._dynamo ("Cannot call @triton.jit'd outside of the scope of a kernel"), which building
a transformers model does. Whether this pytest process has done so depends on which tests ran before,
so run here the kernel's results would depend on collection order, `-k` and `--deselect`. In a fresh
process they depend on nothing but the kernel.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

CASES = Path(__file__).with_name("kernel_cases.py")
REPO_ROOT = CASES.parent.parent


def run_cases(*pytest_args, before=""):
    """pytest on tests/kernel_cases.py with `pytest_args`, in a new Python process that first runs the
    statements `before`, if any; returns the finished process. No test selected (exit code 5) fails too."""
    env = dict(os.environ)
    if not torch.cuda.is_available():
        env["TRITON_INTERPRET"] = "1"       # before Python starts, so before anything imports triton
    args = [str(CASES), "-p", "no:cacheprovider", *pytest_args]
    code = f"import sys, pytest\n{before}\nsys.exit(pytest.main({args!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO_ROOT,
                          timeout=900)


def assert_passed(done):
    # On failure, pytest's own report of the child (which case, which assertion), and the start of its stderr:
    # a crash (a kernel reading outside its pool) prints the stack of the test that was running there.
    assert done.returncode == 0, (f"tests/kernel_cases.py failed (exit code {done.returncode}):\n"
                                  f"{done.stdout[-12000:]}\n{done.stderr[:6000]}")


@pytest.mark.slow  # over 8 s: `make test-slow`
def test_kernel_cases_in_a_fresh_process():
    assert_passed(run_cases())


@pytest.mark.slow            # over 5 s: make test within 15 minutes (make test-slow runs it)
def test_kernel_cases_pass_after_this_process_imported_dynamo():
    # transformers' generate in this process first, so torch._dynamo is imported here; the kernel cases,
    # in their own process, must not notice. The Triton ones only: they are what the interpreter runs.
    from lab.models import load
    from lab.models.hf import to_transformers

    hf = to_transformers(load("tiny-llama"))
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=2, min_new_tokens=2,
                          do_sample=False, pad_token_id=0)
    assert out.shape == (1, 5)
    assert "torch._dynamo" in sys.modules
    assert_passed(run_cases("-k", "triton_kernel_float16 or triton_kernel_addresses_pages"))


@pytest.mark.slow            # over 5 s: make test within 15 minutes (make test-slow runs it)
def test_kernel_cases_after_dynamo_in_their_own_process_fail_with_the_cause():
    # The guard in tests/conftest.py: run in a process that imported torch._dynamo first, a kernel case
    # stops before it starts (an error in its setup), naming the cause, instead of failing with Triton's
    # puzzling message. With a GPU the compiled kernel is unaffected: nothing to guard.
    done = run_cases("-k", "test_triton_kernel_bfloat16", before="import torch._dynamo")
    if torch.cuda.is_available():
        assert_passed(done)
        return
    assert done.returncode == 1 and "1 error" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
    assert "torch._dynamo was imported in this process before this test" in done.stdout, done.stdout[-3000:]


def allocated_bytes(fn) -> int:
    """Bytes PyTorch's allocator hands out while fn() runs (torch.profiler with profile_memory: every
    operator's own allocations, frees not subtracted). Here, not in kernel_cases.py: the profiler imports
    torch._dynamo, after which Triton's interpreter cannot run in that process."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    return sum(max(e.self_cpu_memory_usage, 0) for e in prof.key_averages())


def test_cpu_version_reads_pages_without_copying_them():
    # Two sequences of 2,048 positions, pages scattered over the pool: 6 MiB of keys and values to read.
    # A version that copies them allocates at least that much (the reference does: the positive control).
    # The in-place kernel allocates its scaled query, its output and the partial results of its runs,
    # [B, runs, H_q, D + 2] floats: 28 KiB here, under 1% of what it reads. Its C++ scratch (not seen by
    # the profiler) is one page's scores per task, too small to hold a page's keys.
    from lab.kernels import paged_attention_cpu, paged_attention_reference
    from lab.kernels.pages import paged_copy
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(2, 3, 2048, 64, generator=g) for _ in range(2))               # [B, H_kv, L, D]
    k_pool, v_pool, tables, lengths = paged_copy(k, v, 16, g)
    q = torch.randn(2, 9, 64, generator=g)                                             # [B, H_q, D]
    args, read = (q, k_pool, v_pool, tables, lengths), k.nbytes + v.nbytes
    assert allocated_bytes(lambda: paged_attention_reference(*args)) >= read
    assert allocated_bytes(lambda: paged_attention_cpu(*args)) < read / 100
    torch.testing.assert_close(paged_attention_cpu(*args), paged_attention_reference(*args), atol=1e-5, rtol=0)
