"""What a check switches off while a reader's function runs, so that an answer taking the forbidden
shortcut fails instead of passing.

    with functions_raise(positions_uncached), NoTorch("count with arithmetic"):
        got = reader_fn(P, n)       # calling the library's formula, or any torch function, raises
"""

import contextlib

from torch.overrides import TorchFunctionMode


def _forbidden(*args, **kwargs):  # its code replaces a library function's while a reader's answer runs
    raise AssertionError("forbidden shortcut: this exercise asks you to work it out yourself, "
                         "not to call the library's own function")


@contextlib.contextmanager
def functions_raise(*fns):
    """While inside, each plain Python function in fns raises, however the reader imported it (a decorated
    function is switched off in the function it wraps)."""
    fns = [getattr(f, "__wrapped__", f) for f in fns]
    saved = [f.__code__ for f in fns]
    try:
        for f in fns:
            f.__code__ = _forbidden.__code__
        yield
    finally:
        for f, code in zip(fns, saved, strict=True):
            f.__code__ = code


class NoTorch(TorchFunctionMode):
    """Every torch function raises (creating a tensor, running a model, any operation on a tensor)."""

    def __init__(self, why):
        super().__init__()
        self.why = why

    def __torch_function__(self, func, types, args=(), kwargs=None):
        raise AssertionError(f"{self.why}: your function called torch ({getattr(func, '__name__', func)})")


class WatchTorch(TorchFunctionMode):
    """Counts the calls of the torch function `name` (e.g. scaled_dot_product_attention), however it was
    imported; with `forbid`, each call raises AssertionError(forbid) instead. Every other function runs."""

    def __init__(self, name, forbid=None):
        super().__init__()
        self.name, self.forbid, self.calls = name, forbid, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == self.name:
            if self.forbid:
                raise AssertionError(self.forbid)
            self.calls += 1
        return func(*args, **(kwargs or {}))
