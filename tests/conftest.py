"""Fixtures shared by several test modules."""

import os
import sys

import pytest
import torch

# Without a GPU the Triton kernel runs in Triton's interpreter, which must be switched on before anything
# imports triton.language: its own @jit helpers (tl.zeros, tl.sum, ...) are decorated at that import, and a
# test module collected before test_kernels.py may import it (through torch) first.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


@pytest.fixture(scope="module")
def one_thread():
    """Run a module on one thread: the tiny models' ops are too small to split, and on a busy 2-core machine
    a second thread mostly waits for a timeslice (measured: the two cache test files took 9 min with two
    threads, 34 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Triton's interpreter also stops working in a process that has imported torch._dynamo, which
# transformers' `generate` and other tests do (see lab/kernels/triton_paged.py). So the kernel tests run
# first, and fail with that cause if it happened anyway.
KERNEL_TESTS = "test_kernels.py"


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name != KERNEL_TESTS)  # stable: the rest keep their order


def pytest_runtest_setup(item):
    if item.path.name == KERNEL_TESTS and "torch._dynamo" in sys.modules and not torch.cuda.is_available():
        pytest.fail("torch._dynamo was imported before this test, and Triton's interpreter cannot run after "
                    "that: run tests/test_kernels.py in a process of its own")
