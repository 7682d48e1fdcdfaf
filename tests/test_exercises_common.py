"""compare_with_book reads the committed results and reports the ratio of the reader's figure to the book's."""

import pytest

from lab import results
from lab.exercises import compare_with_book


def test_compare_with_book_reads_committed_value(tmp_path, capsys):
    path = tmp_path / "r.json"
    results.write_section("chx", {"speedup": results.value(4.0, "x")}, results.provenance(mode="full"), path=path)
    assert compare_with_book("chx.speedup", 2.0, path=path) == pytest.approx(0.5)
    out = capsys.readouterr().out
    assert "yours: 2×" in out and "the book's: 4×" in out


def test_compare_with_book_refuses_non_numbers(tmp_path):
    path = tmp_path / "r.json"
    results.write_section("chx", {"same": results.value(True, None)}, results.provenance(mode="full"), path=path)
    with pytest.raises(ValueError, match="not a number"):
        compare_with_book("chx.same", 1.0, path=path)


# ---- the rules the checks enforce (lab/exercises/rules.py) ----------------------------------------------------

import ctypes  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402
from attacks import recompiled  # noqa: E402

from lab.exercises import rules  # noqa: E402


def library_function(x):
    return x + 1


class Base:
    def size(self):
        return 1


class Child(Base):
    def size(self):                    # super() gives this function a __class__ cell: its code cannot be swapped
        return super().size() + 1


def test_functions_raise_however_the_function_is_reached():
    copy = types.FunctionType(library_function.__code__, globals())
    for call in (lambda: library_function(1), lambda: copy(1), lambda: Child().size(), lambda: Child.size(Child())):
        with pytest.raises(AssertionError, match="forbidden shortcut"), rules.functions_raise(library_function, Child):
            call()
    assert library_function(1) == copy(1) == 2 and Child().size() == 2      # all of it restored


def test_functions_raise_refuses_a_thread_started_inside():
    """A thread escapes the watch (it sees this thread only): starting one raises, however it is started, and a
    thread started through a reference held from before, whose error was caught, still fails on the way out."""
    import _thread

    held = _thread.start_new_thread
    for start in (lambda: threading.Thread(target=library_function, args=(1,)).start(),
                  lambda: _thread.start_new_thread(library_function, (1,)),
                  lambda: held(library_function, (1,))):
        with pytest.raises(AssertionError, match="started a thread"), rules.functions_raise(library_function):
            start()
    assert _thread.start_new_thread is held and threading._start_new_thread is held         # put back

    def swallows():
        try:
            held(library_function, (1,))
        except AssertionError:
            pass

    with pytest.raises(AssertionError, match="started a thread.*caught the error"), \
            rules.functions_raise(library_function):
        swallows()


def _sets_a_trace():
    sys.settrace(None)


def _reads_a_frame():
    return sys._getframe(1).f_locals


def _walks_the_gc():
    return len(gc.get_objects())


def _uses_ctypes():
    return ctypes.CDLL(None).getpid()


def _changes_library_code():
    rules.fresh_seed.__code__ = library_function.__code__


def _forks():
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)


def _runs_a_process():
    subprocess.run([sys.executable, "-c", "pass"], check=True)


ESCAPES = {"settrace": (_sets_a_trace, "set a trace or profile function"),
           "getframe": (_reads_a_frame, "read the interpreter's frames"),
           "gc": (_walks_the_gc, "looked objects up"),
           "ctypes": (_uses_ctypes, "looked objects up"),
           "code": (_changes_library_code, "changed the code or defaults"),
           "fork": (_forks, "started a process"),
           "subprocess": (_runs_a_process, "started a process")}


def _frame_of_a_traceback():
    try:
        raise ValueError
    except ValueError as e:
        return e.__traceback__.tb_frame


ESCAPES["traceback-frame"] = (_frame_of_a_traceback, "read the interpreter's frames")
ESCAPES["audit-hook"] = (lambda: sys.addaudithook(lambda *args: None), "looked objects up")


@pytest.mark.parametrize("escape, message", ESCAPES.values(), ids=ESCAPES)
def test_no_escape_refuses_what_leaves_the_checks_sight(escape, message):
    """Each raises inside no_escape (and so inside functions_raise); caught, it still fails on the way out;
    outside, each works again."""
    with pytest.raises(AssertionError, match=message), rules.no_escape():
        escape()

    def swallowed():
        try:
            escape()
        except AssertionError:
            pass

    with pytest.raises(AssertionError, match="caught the error"), rules.functions_raise(library_function):
        swallowed()
    assert rules.fresh_seed(3) == 3                                          # its code put back
    with rules.no_escape():
        [].append(1)                                                          # plain code runs


def test_no_escape_lets_a_module_read_frames_as_it_loads(tmp_path, monkeypatch):
    """A module imported for the first time inside a check may read frames as it loads (typing does): allowed,
    while the same read in the reader's own code is not."""
    (tmp_path / "reads_frames_on_import.py").write_text("import sys\nFRAME = sys._getframe()\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with rules.no_escape():
        import reads_frames_on_import  # noqa: F401


def library_long(values, limit):
    """A library function long enough (SHAPE_MIN instructions or more, SHAPE_NAMES names used) to be recognised by
    its shape."""
    total, kept = 0, []
    for i, v in enumerate(values):
        if abs(v) > limit:
            continue
        total += v * i
        kept.append((i, v))
    return total, kept


def independent_long(values, limit):
    """The same result, written otherwise."""
    kept = [(i, v) for i, v in enumerate(values) if abs(v) <= limit]
    return sum(i * v for i, v in kept), kept


def short_helper(a, b):                # 52 instructions, one name (len): written alike by anyone
    k = 0
    while k < len(a) and k < len(b) and a[k] == b[k]:
        k += 1
    return k


def test_functions_raise_recognises_a_copy_by_its_instructions():
    """Compiled again from the same source elsewhere: a copy (names, docstring and all); renamed, without its
    docstring, with `pass` added: the same shape. An independent function giving the same result passes, and so
    does a helper written alike that has no docstring and uses one name only."""
    assert len(rules._instructions(library_long.__code__, names=False)[-1]) >= rules.SHAPE_MIN
    for rename in (False, True):
        copy = recompiled(library_long, rename=rename)
        assert copy.__code__.co_filename != library_long.__code__.co_filename
        with pytest.raises(AssertionError, match="forbidden shortcut"), rules.functions_raise(library_long):
            copy([1, 5, 2], 3)
    want, alike = library_long([1, 5, 2], 3), recompiled(short_helper, rename=True)
    with rules.functions_raise(library_long, short_helper):
        assert independent_long([1, 5, 2], 3) == want and alike("abc", "abd") == 2


def test_counting_steps_counts_and_cannot_be_turned_back():
    """The count goes up by a call and each line; inside a check, a trace set, or the counter's defaults changed,
    raise."""
    def two_lines():
        x = 1
        return x

    with rules.counting_steps() as steps:
        before = steps()
        two_lines()
        after = steps()
    assert after - before == 1 + 1 + 2          # the first read's own tick, the call, its two lines (this frame
                                                # began before the count: its lines are not traced)
    with pytest.raises(AssertionError, match="changed the code or defaults"), rules.counting_steps() as steps, \
            rules.no_escape():
        counter = sys.gettrace()
        counter.__defaults__ = (lambda: None, counter)


class _Finalized:
    def __del__(self):
        self.gone = True


def test_counting_steps_is_not_charged_for_other_codes_finalizers():
    """A collection of cycles runs the finalizers of whatever garbage is pending; they are not the counted code's
    steps. Allocating 5,000 lists (from C: no line of this frame is traced) would set one off."""
    garbage = _Finalized()
    garbage.cycle = garbage
    del garbage
    with rules.counting_steps() as steps:
        before = steps()
        list(map(list, itertools.repeat((), 5000)))
        after = steps()
    assert after - before == 1                  # the first read's own tick only
    assert gc.isenabled()


@pytest.mark.parametrize("call", [lambda: library_function(1), lambda: Base().size(),
                                  lambda: types.FunctionType(library_function.__code__, globals())(1)])
def test_nested_functions_raise_both_hold(call):
    with pytest.raises(AssertionError, match="forbidden shortcut"):
        with rules.functions_raise(library_function), rules.functions_raise(Base.size):
            call()
    assert library_function(1) == 2 and Base().size() == 1


def test_a_swallowed_forbidden_call_still_fails():
    copy = types.FunctionType(library_function.__code__, globals())

    def retries():
        try:
            return copy(1)
        except AssertionError:
            return copy(1)                           # the watch is gone after its first error: this would pass

    with pytest.raises(AssertionError, match="caught the error"), rules.functions_raise(library_function):
        assert retries() == 2


def test_forbid_torch_sees_every_entry_point():
    q = torch.randn(1, 2, 3, 4)
    for call in (lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q),
                 lambda: torch.ops.aten._scaled_dot_product_attention_math(q, q, q),
                 lambda: torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, q, q)):
        with pytest.raises(AssertionError, match="no fused attention"), rules.ForbidTorch(rules.ATTENTION_OPS,
                                                                                       "no fused attention"):
            call()
    with rules.ForbidTorch(rules.ATTENTION_OPS, "no fused attention"):
        torch.softmax(q @ q.transpose(-2, -1), -1) @ q                      # attention written out is fine


def test_unchanged_undoes_a_change_and_fails():
    import lab.exercises.ch05 as module

    real = module._cost_by_simulation
    with pytest.raises(AssertionError, match="changed lab.exercises.ch05._cost_by_simulation"):
        with rules.unchanged("lab.exercises.ch05"):
            module._cost_by_simulation = lambda *args: 0
    assert module._cost_by_simulation is real
    with pytest.raises(AssertionError, match=r"changed Tensor.__eq__|changed Tensor"):
        with rules.unchanged("lab.exercises.ch05"):
            torch.Tensor.__eq__ = lambda self, other: True                   # a method added to a class
    assert (torch.zeros(1) == torch.ones(1)).tolist() == [False]             # put back


def test_unchanged_lets_torch_load_its_own_modules():
    with rules.unchanged("lab.exercises.ch05"):
        import torch._dynamo  # noqa: F401  (rebinds torch.manual_seed as it loads)


def test_drawn_with_names_the_seed():
    with pytest.raises(AssertionError, match=r"wrong\n\(cases drawn with seed=7: check_x\(\.\.\., seed=7\)"):
        with rules.drawn_with(7, "check_x"):
            raise AssertionError("wrong")
    assert rules.fresh_seed(3) == 3 and rules.fresh_seed() != rules.fresh_seed()
