"""What a check switches off while a reader's function runs, so that an answer taking the forbidden
shortcut fails instead of passing; and the fresh cases a check draws, so that no answer can be looked up.

    with functions_raise(positions_uncached), NoTorch("count with arithmetic"):
        got = reader_fn(P, n)       # calling the library's formula, or any torch function, raises
"""

import contextlib
import inspect
import os
import sys
import threading
import types

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

FORBIDDEN = "forbidden shortcut: this exercise asks you to work it out yourself, not to call the library's own function"


def _forbidden(*args, **kwargs):  # its code replaces a library function's while a reader's answer runs
    raise AssertionError("forbidden shortcut: this exercise asks you to work it out yourself, "
                         "not to call the library's own function")


def _functions(objects) -> list:
    """The plain Python functions in `objects`: a function (unwrapped from its decorators), or every method,
    static or class method and property accessor a class defines."""
    out = []
    for obj in objects:
        parts = vars(obj).values() if isinstance(obj, type) else [obj]
        for p in parts:
            p = getattr(p, "__func__", p)                                   # staticmethod, classmethod
            accessors = [p.fget, p.fset] if isinstance(p, property) else [p]
            out += [inspect.unwrap(f) for f in accessors if isinstance(inspect.unwrap(f), types.FunctionType)]
    return out


def _where(code) -> tuple:
    return code.co_filename, code.co_qualname


@contextlib.contextmanager
def functions_raise(*objects, why=FORBIDDEN):
    """While inside, each Python function in `objects` (a class: each of its methods) raises AssertionError(why),
    however the reader reaches it: by name or through a reference held from before, unbound or through super(),
    a functools.partial, a copy of the function, or its module loaded again (a call is recognised by where its
    code was written). A call whose error the reader caught still fails the check on the way out."""
    fns = _functions(objects)
    where = {_where(f.__code__) for f in fns} | {_where(_forbidden.__code__)}
    caught, outer = [], sys.getprofile()

    def watch(frame, event, arg):                  # sees every call in this thread and the threads it starts
        if outer is not None:
            try:
                outer(frame, event, arg)           # a functions_raise around this one still watches
            except AssertionError:
                caught.append(frame.f_code.co_qualname)
                raise
        if event == "call" and _where(frame.f_code) in where:
            caught.append(frame.f_code.co_qualname)
            raise AssertionError(why)

    swapped = [(f, f.__code__) for f in fns if not f.__code__.co_freevars]   # threads started before, too
    thread_profile = threading.getprofile()
    try:
        for f, _ in swapped:
            f.__code__ = _forbidden.__code__
        sys.setprofile(watch)
        threading.setprofile(watch)
        yield
        still = sys.getprofile() is watch
    finally:
        sys.setprofile(outer)
        threading.setprofile(thread_profile)
        for f, code in swapped:
            f.__code__ = code
    if caught:
        raise AssertionError(f"{why} (your function called {caught[0]} and caught the error)")
    if not still:
        raise AssertionError("the check's watch (sys.setprofile) was switched off while your function ran: "
                             "run it without a profiler or debugger")


def _op_name(func) -> str:
    return str(getattr(func, "__name__", func))


class _FunctionGate(TorchFunctionMode):
    def __init__(self, names, why):
        super().__init__()
        self.names, self.why = names, why

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if any(n in _op_name(func) for n in self.names):
            raise AssertionError(f"{self.why}: your function called torch ({_op_name(func)})")
        return func(*args, **(kwargs or {}))


class _OpGate(TorchDispatchMode):
    supports_higher_order_operators = True      # flex_attention reaches the gate as itself

    def __init__(self, names, why):
        super().__init__()
        self.names, self.why = names, why

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(n in str(func) for n in self.names):
            raise AssertionError(f"{self.why}: your function ran torch's {func}")
        return func(*args, **(kwargs or {}))


class ForbidTorch:
    """While inside, every torch function and every aten op whose name contains one of `names` raises
    AssertionError(why), however it is called: by name, as a Tensor method, through torch.ops, or deep inside
    another function that uses it (torch.nn.MultiheadAttention calls scaled_dot_product_attention)."""

    def __init__(self, names, why):
        self.gates = (_FunctionGate(names, why), _OpGate(names, why))

    def __enter__(self):
        for gate in self.gates:
            gate.__enter__()
        return self

    def __exit__(self, *exc):
        for gate in reversed(self.gates):
            gate.__exit__(*exc)


class NoTorch(ForbidTorch):
    """Every torch function and aten op raises (creating a tensor, running a model, any operation on a tensor)."""

    def __init__(self, why):
        super().__init__(("",), why)


# fused attention, under every name PyTorch gives it (CPU, CUDA, the math fallback's own softmax, the modules)
ATTENTION_OPS = ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention",
                 "_safe_softmax", "multi_head_attention", "transformer_encoder_layer", "flex_attention")


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


# ---- the check itself, left as it was ------------------------------------------------------------------------

def _namespaces(module) -> list:
    """What a check's verdict rests on: its own module, these rules, torch's functional module and Tensor class,
    and every lab module and class the check's module names (one level: the oracle's own code)."""
    out = [module, sys.modules[__name__], F, torch.Tensor]
    for value in list(vars(module).values()):
        where = getattr(value, "__module__", None) or ""
        owner = value if isinstance(value, (type, types.ModuleType)) else sys.modules.get(where)
        name = getattr(owner, "__module__", None) if isinstance(owner, type) else getattr(owner, "__name__", "")
        if owner is not None and (name or "").startswith("lab") and not any(owner is o for o in out):
            out.append(owner)
    return out


TORCH_COMPARISONS = ("allclose", "equal", "isclose")    # of torch's own names, only these: torch rebinds others lazily


def _snapshot(ns) -> dict:
    space = vars(ns)
    return {k: (space[k], getattr(space[k], "__code__", None)) for k in (TORCH_COMPARISONS if ns is torch else space)
            if k in space}


@contextlib.contextmanager
def unchanged(module_name: str):
    """While inside, the reader's code may not rebind a name of the check's module, of the lab modules and classes
    it uses, or torch's comparisons and Tensor methods (nor swap a function's code, nor add a method to a class):
    the oracle that runs afterwards must be the check's own. A change is undone, and fails the check."""
    spaces = _namespaces(sys.modules[module_name]) + [torch]
    before = [_snapshot(ns) for ns in spaces]
    changed = []
    try:
        yield
    finally:
        for ns, saved in zip(spaces, before, strict=True):
            now = vars(ns)
            for k, (v, code) in saved.items():
                if now.get(k, saved) is not v or getattr(v, "__code__", None) is not code:
                    changed.append(f"{getattr(ns, '__name__', ns)}.{k}")
                    if code is not None:
                        v.__code__ = code
                    setattr(ns, k, v)
            for k in [k for k in now if isinstance(ns, type) and k not in saved]:   # a method added to a class
                changed.append(f"{ns.__name__}.{k}")
                delattr(ns, k)
    if changed:
        raise AssertionError(f"your function changed {', '.join(changed[:3])} while the check ran: a check's oracle "
                             "and its rules are not yours to change (they are put back)")


# ---- fresh cases ---------------------------------------------------------------------------------------------

def fresh_seed(seed=None) -> int:
    """`seed`, or a new one from the operating system: cases drawn from it cannot be known before the check runs."""
    return int.from_bytes(os.urandom(4), "little") if seed is None else seed


@contextlib.contextmanager
def drawn_with(seed, check):
    """A failure inside names the seed of the cases, so that `check(answer, seed=...)` draws them again."""
    try:
        yield
    except AssertionError as e:
        raise AssertionError(f"{e}\n(cases drawn with seed={seed}: {check}(..., seed={seed}) draws them "
                             "again)") from None
