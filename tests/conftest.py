"""Fixtures and settings shared by every test module: one SmolLM2 per run, repeatable Hypothesis, Triton."""

import hashlib
import os
import sys
import time

import pytest
import torch
from hypothesis import HealthCheck, settings

# Without a GPU the Triton kernel runs in Triton's interpreter, which must be switched on before anything
# imports triton.language: its own @jit helpers (tl.zeros, tl.sum, ...) are decorated at that import, and
# `lab` leaves the environment alone. With a GPU it stays unset, so the kernel is compiled.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Hypothesis, repeatable: the same examples on every run and every machine (derandomize seeds the
# generator from each test's own code), no database of earlier failures replayed first (database=None:
# what one run tries never depends on what an earlier run found), and no deadline (a wall-clock limit
# per example fails on a busy machine, not on a bug). Tests that assert how much ground their random
# operations covered (tests/test_block_manager.py) depend on this. HYPOTHESIS_PROFILE=explore draws new
# examples on every run, for hunting bugs by hand; a failure prints the seed that reproduces it.
settings.register_profile("repeatable", derandomize=True, database=None, deadline=None, print_blob=True,
                          suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("explore", parent=settings.get_profile("repeatable"), derandomize=False)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "repeatable"))


def _weights_digest(model) -> str:
    """sha256 over every weight's name, shape, dtype and bytes (0.5 s for SmolLM2's 135M float32 values)."""
    h = hashlib.sha256()
    for name, t in model.weights.items():
        h.update(f"{name} {tuple(t.shape)} {t.dtype}".encode())
        h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M, loaded once per run and shared by every test that needs it.

    Shared, so read-only: a test that changes weights in place would change every later test's model,
    and their results would depend on the order they run in. The digest taken here is checked again at
    the end of the run, and a change fails loudly. A test that must change weights takes its own copy,
    e.g. `{k: v.clone() for k, v in smollm2.weights.items()}`.
    """
    from lab.models import load

    model = load("smollm2")
    digest = _weights_digest(model)
    yield model
    assert _weights_digest(model) == digest, (
        "a test changed the shared SmolLM2 weights in place (tests/conftest.py `smollm2`): give it its own copy")


class FakeClock:
    """Stands in for the `time` module of code under test (monkeypatch.setattr(module, "time", clock)):
    perf_counter() is a number of seconds that only advance(seconds) moves, so every duration the code
    measures is known exactly and no assertion depends on how busy the machine is. Integer seconds keep
    every difference exact. Anything else is the real `time` module's."""

    def __init__(self):
        self.now = 0

    def perf_counter(self):
        return self.now

    def advance(self, seconds):
        self.now += seconds

    def __getattr__(self, name):
        return getattr(time, name)


@pytest.fixture
def fake_clock():
    return FakeClock()


@pytest.fixture(scope="module")
def one_thread():
    """Run a module on one thread: the tiny models' ops are too small to split, and on a busy 2-core machine
    a second thread mostly waits for a timeslice (measured: the two cache test files took 9 min with two
    threads, 34 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Triton's interpreter stops working in a process that has imported torch._dynamo, which building a
# transformers model does (see lab/kernels/triton_paged.py). tests/kernel_cases.py, which runs the kernel,
# is therefore not collected: tests/test_kernels.py runs it in a fresh process. Run here after dynamo
# was imported (`pytest tests/kernel_cases.py tests/test_models.py`, say), it fails with the cause.
KERNEL_CASES = "kernel_cases.py"


def pytest_runtest_setup(item):
    if item.path.name != KERNEL_CASES or "torch._dynamo" not in sys.modules:
        return
    from lab.kernels import triton_paged  # imported already, by the module under test

    if triton_paged.INTERPRETED:            # a compiled kernel (on a GPU) is unaffected
        pytest.fail("torch._dynamo was imported in this process before this test, and Triton's interpreter "
                    "cannot run after that: run tests/kernel_cases.py in a process of its own (as "
                    "tests/test_kernels.py does), or run tests/test_kernels.py", pytrace=False)
