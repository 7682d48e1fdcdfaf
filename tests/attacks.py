"""What a hostile reader does to reach a forbidden function another way, for the exercise tests."""

import importlib.util
import types


def loaded_again(module):
    """The module's file executed again as a new module (what importlib.reload does, without touching the original)."""
    spec = importlib.util.spec_from_file_location(module.__name__ + "_again", module.__file__)
    again = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(again)
    return again


def copy_of(fn):
    """A new function object with fn's code, made before the check runs."""
    return types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
