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


def test_kernel_cases_in_a_fresh_process():
    assert_passed(run_cases())


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
