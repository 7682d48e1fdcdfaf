"""What a check switches off while a reader's function runs, so that an answer taking the forbidden shortcut fails
instead of passing; and the fresh cases a check draws, so that no answer can be looked up.

    with functions_raise(positions_uncached), NoTorch("count with arithmetic"):
        got = reader_fn(P, n)       # calling the library's formula, or any torch function, raises

A check runs the reader's function in its own process and thread, where it can see what the function does. So
while a forbidden function raises, the function may not leave that sight either (`no_escape`): start a thread
or a process, set a trace or profile function, read the interpreter's frames, look objects up through the
garbage collector, use ctypes, or change a library function's code. These rules guard against shortcuts, not
against code written to take a check apart: Python lets a function that sets out to do that reach anything.
"""

import _thread
import bisect
import contextlib
import dis
import gc
import inspect
import itertools
import os
import sys
import sysconfig
import threading
import types

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

try:
    import _posixsubprocess  # how multiprocessing's spawn starts a process, without an audit event
except ImportError:                             # not on Windows
    _posixsubprocess = types.ModuleType("_posixsubprocess")

FORBIDDEN = "forbidden shortcut: this exercise asks you to work it out yourself, not to call the library's own function"


# ---- no escape: the work stays in this process, this thread, under the check's watch --------------------------

PROCESS = ("forbidden while a check runs: your function started a process ({what}). The check's rules hold in "
           "this process only, so work done in another one is not an answer")
THREAD = ("forbidden while a check runs: your function started a thread ({what}). The check sees, counts and "
          "restricts the work of this thread only: do the work in it")
TRACE = ("forbidden while a check runs: your function set a trace or profile function ({what}), as a debugger's "
         "breakpoint does. The check watches and counts with them: debug your function outside the check")
FRAMES = ("forbidden while a check runs: your function read the interpreter's frames ({what}; inspect.stack or a "
          "traceback's frames do this too). The check's own variables are not for an answer to read: work from your "
          "arguments")
OBJECTS = ("forbidden while a check runs: your function looked objects up behind the interpreter's back ({what}: "
           "the garbage collector, ctypes or an audit hook of its own). Work from your arguments")
CODE = ("forbidden while a check runs: your function changed the code or defaults of a library function ({what}). "
        "The library and the check's rules stay as they are")
WAIT = ("forbidden while a check runs: your function waited for a lock that is held ({what}), which only another "
        "thread can release. The check sees, counts and restricts the work of this thread only: do the work in it")

_EVENTS = {  # audit events (sys.addaudithook) refused while a reader's function runs, with why
    **dict.fromkeys(("os.fork", "os.forkpty", "os.posix_spawn", "os.spawn", "os.system", "os.exec", "os.startfile",
                     "subprocess.Popen", "pty.spawn"), PROCESS),
    **dict.fromkeys(("sys.settrace", "sys.setprofile"), TRACE),
    **dict.fromkeys(("sys._getframe", "sys._current_frames", "sys._current_exceptions"), FRAMES),
    **dict.fromkeys(("gc.get_objects", "gc.get_referrers", "gc.get_referents", "sys.addaudithook"), OBJECTS),
}
FRAME_ATTRIBUTES = ("tb_frame", "gi_frame", "cr_frame", "ag_frame")    # reading these raises object.__getattr__
_INSTALLED = ("<frozen",) + tuple({sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")})
_FRAME_HELPERS = ("inspect.py", "traceback.py", "pdb.py", "bdb.py")      # they hand frames to their caller
CODE_ATTRIBUTES = ("__code__", "__defaults__", "__kwdefaults__")      # setting these raises object.__setattr__

# Threads start without an audit event, and so does a process started as multiprocessing's spawn starts one: while
# a reader's function runs, the functions that start them raise when called by name (they are swapped), and so do
# calls through a reference held from before (functions_raise's watch sees a call of a builtin); a thread still
# alive when the function returns fails the check too.
_STARTS = [(m, n, t) for m, n, t in ((_thread, "start_new_thread", THREAD), (_thread, "start_new", THREAD),
                                      (_thread, "start_joinable_thread", THREAD),
                                      (threading, "_start_new_thread", THREAD),
                                      (threading, "_start_joinable_thread", THREAD),
                                      (_posixsubprocess, "fork_exec", PROCESS)) if hasattr(m, n)]
ESCAPE_BUILTINS = {
    **{getattr(m, n): t.format(what=f"{m.__name__}.{n}") for m, n, t in _STARTS},
    **{getattr(os, n): PROCESS.format(what=f"os.{n}") for n in ("fork", "forkpty", "posix_spawn", "posix_spawnp",
                                                                "system") if hasattr(os, n)},
    sys.settrace: TRACE.format(what="sys.settrace"), sys.setprofile: TRACE.format(what="sys.setprofile"),
}
_LOCK = type(_thread.allocate_lock())


def _waits(fn) -> bool:
    """Whether calling the builtin `fn` waits for another thread: acquiring a lock that is held (a thread's join, an
    Event's or a Queue's wait do it too). Code that runs in one thread never does: it would wait forever. A thread
    started where the watch cannot see it (a start held from before, called from C) gives itself away by this."""
    lock = getattr(fn, "__self__", None)
    return isinstance(lock, _LOCK) and fn.__name__ in ("acquire", "acquire_lock", "__enter__") and lock.locked()


def _escape(event, args) -> tuple | None:
    """(the message's template, what was done) when the audit event `event` is refused while a reader's function
    runs, or None."""
    if event in _EVENTS:
        return _EVENTS[event], event
    if event.startswith("ctypes."):
        return OBJECTS, event
    if event == "object.__getattr__" and args[1] in FRAME_ATTRIBUTES:
        return FRAMES, f"reading {args[1]}"
    if event in ("object.__setattr__", "object.__delattr__") and args[1] in CODE_ATTRIBUTES:
        code = getattr(args[0], "__code__", None)
        library = (getattr(args[0], "__module__", None) or "").startswith("lab") or (
            code is not None and code.co_filename.startswith(_INSTALLED))
        if library:                                 # a function of the reader's own is theirs to change
            return CODE, f"{getattr(args[0], '__qualname__', args[0])}.{args[1]}"
    return None


class _Gate:
    """One audit hook for the process (an audit hook cannot be removed), which refuses escapes while armed: while a
    check runs a reader's function. Refusals are recorded, so that an answer which caught the error still fails."""

    def __init__(self):
        self.armed = 0              # how many checks are running a reader's function now (they nest)
        self.permits = 0            # the rules' own calls while armed: a watch put in place, a code swapped
        self.refused = []           # why, for each escape tried while armed
        self.saved = {}             # (module, name) -> the start put back when the last check is done
        self.unset = False          # a watch is raising: the interpreter is about to unset it (sys.setprofile)
        sys.addaudithook(self.hook)

    def hook(self, event, args):
        if self.armed and not self.permits:
            if event == "sys.setprofile" and self.unset:
                self.unset = False
                return
            refused = _escape(event, args)
            if refused and (refused[0] not in (FRAMES, CODE) or self._readers_doing()):
                self.refuse(refused[0].format(what=refused[1]))

    def _readers_doing(self) -> bool:
        """Whether the frame read or the code changed now is the reader's doing: their code did it, directly or
        through inspect or traceback (which hand frames to their caller). Python's own library and installed
        packages read frames and set defaults for their own ends (typing for its generics, torch.library for its
        registrations, a decorator for the function it makes, a module as it is imported)."""
        self.permits += 1                           # the frames read here are the gate's own
        try:
            frame = sys._getframe(2)                # the code that read a frame (0: here, 1: the hook)
            while frame is not None and frame.f_code.co_filename.endswith(_FRAME_HELPERS):
                frame = frame.f_back
            reader = frame is not None and not frame.f_code.co_filename.startswith(_INSTALLED)
            while frame is not None and reader:
                reader = not frame.f_code.co_filename.startswith("<frozen importlib")
                frame = frame.f_back
            return reader
        finally:
            self.permits -= 1

    def refuse(self, why):
        self.refused.append(why)
        raise AssertionError(why)

    @contextlib.contextmanager
    def permitted(self):
        """The rules' own setprofile, settrace and code swaps, inside a check that is already running."""
        self.permits += 1
        try:
            yield
        finally:
            self.permits -= 1

    def arm(self):
        self.unset = False
        if not self.armed:
            for module, name, template in _STARTS:
                self.saved[module, name] = getattr(module, name)
                setattr(module, name, self._refusing(template.format(what=f"{module.__name__}.{name}")))
        self.armed += 1

    def disarm(self):
        self.armed, self.unset = self.armed - 1, False
        if not self.armed:
            for (module, name), start in self.saved.items():
                setattr(module, name, start)

    def _refusing(self, why):
        def start(*args, **kwargs):
            self.refuse(why)
        return start


_GATE = _Gate()


@contextlib.contextmanager
def no_escape():
    """While inside, the code run may not start a thread or a process, set a trace or profile function, read the
    interpreter's frames, look objects up through the garbage collector or ctypes, or change a library function's
    code or defaults: each raises AssertionError saying what was refused and why. An error the code caught still fails
    the check on the way out, and so does a thread it left running."""
    seen, threads = len(_GATE.refused), _thread._count()
    _GATE.arm()
    try:
        yield
    except BaseException:
        _GATE.disarm()
        refused = _GATE.refused[seen:]
        del _GATE.refused[seen:]
        if refused:                                 # the reader's own error hides why: say it
            raise AssertionError(refused[0]) from None
        raise
    _GATE.disarm()
    refused = _GATE.refused[seen:]
    del _GATE.refused[seen:]
    if refused:
        raise AssertionError(f"{refused[0]} (your function caught the error)")
    if _thread._count() > threads:
        raise AssertionError(THREAD.format(what="one still running when your function returned"))


# ---- forbidden functions, however they are reached --------------------------------------------------------------

_STUBS = itertools.count()


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


# A copy of a library function, compiled again from its source under another file or name (exec, a module loaded
# again), is recognised by its instructions. Two keys: `_copy` keeps the local names and the docstring, so only a
# copy matches it (every function that has a docstring); `_shape` drops what a copy changes for free (the names of
# the function and its locals, the docstring, comments, `pass`, the layout of its lines), and is kept only for
# functions of SHAPE_MIN instructions or more that use SHAPE_NAMES global or attribute names or more: short helpers
# are written alike independently (a common-prefix loop is 52 instructions, but it uses `len` alone; the library's
# and tests/test_exercises_ch11.py's one-line versions are word for word the same but the names).
SHAPE_MIN = 32
SHAPE_NAMES = 3
_FILLER = {"NOP", "RESUME", "EXTENDED_ARG", "CACHE"}
_JUMPS = set(dis.hasjrel) | set(dis.hasjabs)
_SLOTS = set(dis.haslocal) | set(dis.hasfree)
_KEYS = {}                                      # code -> (its _copy key, its _shape key), computed once


def _instructions(code, names: bool) -> tuple:
    """code's instructions as (name, argument): a jump's target by its index, a nested function by its own
    instructions, a local variable by its name (`names`) or by its slot. A method call on a module is compiled as
    an attribute load where the compiler sees the module imported (in the library's file) and as a method load
    where it does not (the same function compiled alone): the two count as one."""
    ops = [i for i in dis.get_instructions(code) if i.opname not in _FILLER]
    offsets = [i.offset for i in ops]
    out = []
    for i in ops:
        name = "LOAD_ATTR" if i.opname == "LOAD_METHOD" else i.opname
        if i.opcode in _JUMPS:
            arg = bisect.bisect_left(offsets, i.argval)
        elif i.opcode in _SLOTS and not names:
            arg = i.arg
        elif isinstance(i.argval, types.CodeType):
            arg = _instructions(i.argval, names)
        else:
            arg = i.argval
        out.append((name, arg))
    return code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, tuple(out)


def _names(code) -> tuple | None:
    """What a copy of a function keeps whatever it is renamed: its arguments and the global and attribute names it
    uses, in order. None for code that is not a function's (a module's, a class body's) or is a comprehension's or
    a lambda's (they count as part of the function around them). A cheap first test before `_keys`."""
    if not code.co_flags & inspect.CO_OPTIMIZED or code.co_name.startswith("<"):
        return None
    return code.co_argcount, code.co_kwonlyargcount, code.co_names


def _keys(code) -> tuple:
    """(copy key or None, shape key or None) of a function's code."""
    if code not in _KEYS:
        copy = shape = None
        if _names(code) is not None:
            doc = code.co_consts[0] if code.co_consts and isinstance(code.co_consts[0], str) else None
            copy = (doc, _instructions(code, names=True)) if doc else None
            ops = _instructions(code, names=False)
            shape = ops if len(ops[-1]) >= SHAPE_MIN and len(set(code.co_names)) >= SHAPE_NAMES else None
        _KEYS[code] = copy, shape
    return _KEYS[code]


def _codes(fn) -> list:
    """fn's code and the code of every function defined inside it."""
    out = [fn.__code__]
    for code in out:
        out += [c for c in code.co_consts if isinstance(c, types.CodeType)]
    return out


@contextlib.contextmanager
def functions_raise(*objects, why=FORBIDDEN):
    """While inside, each function in `objects` (a class: each of its methods; a builtin: each call of it) raises
    AssertionError(why), however the reader reaches it: by name or through a reference held from before, unbound or
    through super(), a functools.partial, a copy of the function, its module loaded again, or its source compiled
    again under another name (a call is recognised by where its code was written, and by its instructions). A call
    whose error the reader caught still fails the check on the way out. Inside, no_escape() holds as well."""
    fns = _functions(objects)
    codes = [c for f in fns for c in _codes(f)]
    stub = _forbidden.__code__.replace(co_qualname=f"_forbidden.{next(_STUBS)}")    # its own: nested ones differ
    where = frozenset(_where(c) for c in codes) | {_where(stub)}
    copies = frozenset(k for c in codes for k in _keys(c) if k is not None)
    named = frozenset(_names(c) for c in codes if any(k is not None for k in _keys(c)))
    builtins = {**ESCAPE_BUILTINS, **{o: why for o in objects if isinstance(o, types.BuiltinFunctionType)}}
    verdicts, caught, outer = {}, [], sys.getprofile()
    chained = outer if callable(outer) else None    # a profiler written in C (cProfile) is set aside, not chained

    def library(code) -> bool:
        if code not in verdicts:
            verdicts[code] = _where(code) in where or (_names(code) in named and
                                                       any(k in copies for k in _keys(code) if k is not None))
        return verdicts[code]

    def refuse(name, message):
        caught.append((name, message))
        _GATE.unset = True                         # the interpreter unsets a profile function that raised
        raise AssertionError(message)

    def watch(frame, event, arg):                  # sees every call in this thread
        if chained is not None:
            try:
                chained(frame, event, arg)         # a functions_raise around this one still watches
            except AssertionError as e:
                refuse(frame.f_code.co_qualname, str(e))
        if event == "call" and library(frame.f_code):
            refuse(frame.f_code.co_qualname, why)
        if event == "c_call" and not _GATE.permits:                         # the rules' own calls pass
            if arg in builtins:
                refuse(getattr(arg, "__qualname__", arg), builtins[arg])
            if _waits(arg):
                refuse(arg.__qualname__, WAIT.format(what=f"{arg.__qualname__} of a held lock"))

    swapped = [(f, f.__code__) for f in fns if not f.__code__.co_freevars]   # threads started before, too
    try:
        with _GATE.permitted():
            for f, _ in swapped:
                f.__code__ = stub
            sys.setprofile(watch)
        with no_escape():
            yield
        still = sys.getprofile() is watch
    finally:
        with _GATE.permitted():
            sys.setprofile(outer)
            for f, code in swapped:
                f.__code__ = code
    if caught:
        name, message = caught[0]
        raise AssertionError(f"{message} (your function called {name} and caught the error)")
    if not still:
        raise AssertionError("the check's watch (sys.setprofile) was switched off while your function ran: "
                             "run it without a profiler or debugger")


@contextlib.contextmanager
def counting_steps():
    """While inside, counts the calls and lines Python runs in this thread (sys.settrace); yields steps(), the count
    so far. Within a check (functions_raise, no_escape) nothing can switch the count off or turn it back: setting a
    trace function is refused, and the count is an itertools.count (it only goes up) held in the trace function's
    defaults, which lab's functions may not have changed. The cycle collector is paused meanwhile: a collection
    runs the finalizers of other code's garbage, whose lines are not the reader's (after the whole test suite, one
    such step on a one-node tree was enough to move a count by 8%)."""
    count, before, collecting = itertools.count(), sys.gettrace(), gc.isenabled()
    gc.disable()

    def trace(frame, event, arg, tick=None, me=None):     # a call is counted, and then each of its lines
        if event == "call" or event == "line":
            tick()
        return me

    with _GATE.permitted():
        trace.__defaults__ = (count.__next__, trace)
        sys.settrace(trace)
    try:
        yield count.__next__
        still = sys.gettrace() is trace
    finally:
        with _GATE.permitted():
            sys.settrace(before)
        if collecting:
            gc.enable()
    if not still:
        raise AssertionError("the check's step counter (sys.settrace) was switched off while your function ran: "
                             "run it without a debugger or coverage")


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
    imported, and in `kept` those for which `keep(args, kwargs)` holds (all, without `keep`); with `forbid`,
    each call raises AssertionError(forbid) instead. Every other function runs."""

    def __init__(self, name, forbid=None, keep=None):
        super().__init__()
        self.name, self.forbid, self.keep, self.calls, self.kept = name, forbid, keep, 0, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") == self.name:
            if self.forbid:
                raise AssertionError(self.forbid)
            self.calls += 1
            self.kept += self.keep is None or bool(self.keep(args, kwargs or {}))
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
