"""Fixtures shared by several test modules."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_thread():
    """Run a module on one thread: the tiny models' ops are too small to split, and on a busy 2-core machine
    a second thread mostly waits for a timeslice (measured: the two cache test files took 9 min with two
    threads, 34 s with one)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
