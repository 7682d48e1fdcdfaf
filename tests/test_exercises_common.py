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

import threading  # noqa: E402
import types  # noqa: E402

import torch  # noqa: E402

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


def test_functions_raise_in_a_thread_started_inside():
    seen = []

    def worker():
        try:
            library_function(1)
        except AssertionError:
            seen.append("raised")

    with pytest.raises(AssertionError, match="caught the error"), rules.functions_raise(library_function):
        t = threading.Thread(target=worker)
        t.start()
        t.join()
    assert seen == ["raised"]


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
