"""Chapter 3 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut.

Exercises 1 and 2 ask also about model shapes drawn fresh at every run; a test passes `seed=` where it must
know them.
"""

import types

import pytest

from lab import results, step_cost
from lab.exercises import ch03
from lab.exercises import ch03_solutions as sol3


def test_decode_flops_passes_the_reference_and_fails_a_wrong_count():
    assert ch03.check_decode_flops(sol3.decode_flops)
    assert ch03.check_decode_flops(sol3.decode_flops, seed=7)
    with pytest.raises(AssertionError, match="PyTorch counted"):  # treats every head as a kv head
        ch03.check_decode_flops(lambda c, T: sol3.decode_flops(
            type(c)(**{**c.to_dict(), "n_kv_heads": c.n_heads}), T), seed=0)


def test_the_drawn_shapes_vary():
    import random
    shapes = [c for seed in range(5) for c, _ in ch03.random_shapes(random.Random(seed))]
    assert {c.arch for c in shapes} == {"llama", "gpt2"}
    assert any(c.n_kv_heads < c.n_heads for c in shapes) and any(not c.tie_embeddings for c in shapes)


def counts_looked_up_beforehand():
    """Every case the old check asked, counted by the check's own counter before the check runs."""
    from lab.models import load
    return {(load(name).config, T): step_cost.counted_step(load(name), T)
            for name, T in ch03.CASES + [("smollm2", 4096)]}


@pytest.mark.slow  # over 8 s: `make test-slow`
def test_decode_flops_refuses_counts_looked_up_beforehand():
    table = counts_looked_up_beforehand()
    with pytest.raises(AssertionError, match="PyTorch counted"):
        ch03.check_decode_flops(lambda c, T: table.get((c, T), (0, 1))[0])
    with pytest.raises(AssertionError, match="counted"):
        ch03.check_attention_share(lambda c, T: (lambda t, a: a / t)(*table.get((c, T), (1, 0))))


def _run_the_counter(config, T):  # the shortcut: build a model of that shape and let PyTorch count
    from lab.models import random_model
    return step_cost.counted_step(random_model(config), T)[0]


def _call_the_counter(config, T):  # the shortcut without torch in sight: the check's own counter
    return step_cost.counted_step(None, T)[0]


_a_copy = types.FunctionType(step_cost.counted_step.__code__, step_cost.counted_step.__globals__)


def _call_a_copy_of_the_counter(config, T):
    return _a_copy(None, T)[0]


@pytest.mark.parametrize("shortcut", [_run_the_counter, _call_the_counter, _call_a_copy_of_the_counter])
def test_decode_flops_refuses_counting_by_running(shortcut):
    with pytest.raises(AssertionError, match="do not run the model|forbidden shortcut"):
        ch03.check_decode_flops(shortcut)


def _share_by_the_counter(config, T):  # the shortcut for exercise 2: let PyTorch count both parts
    from lab.models import random_model
    total, attention = step_cost.counted_step(random_model(config), T)
    return attention / total


def _share_by_the_checks_counter(config, T):
    total, attention = step_cost.counted_step(None, T)
    return attention / total


@pytest.mark.slow  # over 8 s: `make test-slow`
def test_attention_share_passes_the_reference_and_fails_a_wrong_count():
    assert ch03.check_attention_share(sol3.attention_share)
    assert ch03.check_attention_share(sol3.attention_share, seed=7)
    with pytest.raises(AssertionError, match="counted"):  # attention over T keys instead of T + 1
        ch03.check_attention_share(lambda c, T: sol3.attention_share(c, T - 1))


@pytest.mark.parametrize("shortcut", [_share_by_the_counter, _share_by_the_checks_counter])
def test_attention_share_refuses_counting_by_running(shortcut):
    with pytest.raises(AssertionError, match="do not run the model|forbidden shortcut"):
        ch03.check_attention_share(shortcut)


@pytest.fixture
def book(tmp_path):
    """A results file holding the book's value for the tiny model, as the committed file holds SmolLM2's."""
    path = tmp_path / "results.json"
    results.write_section("ch03", {"attention_share": {"tiny-llama": {"T64": results.value(20.0, "%")}}},
                          results.provenance(mode="full"), path=path)
    return path


def test_measured_attention_share_passes_a_real_measurement(book, capsys):
    # the sign of a share this small on a tiny model is noise (the check allows it): only that it passes,
    # and that the reader's number is set beside the book's, are checked
    ratio = ch03.check_measured_attention_share(sol3.measured_attention_share, "tiny-llama", 64, path=book)
    assert isinstance(ratio, float) and "the book's: 20%" in capsys.readouterr().out


def test_measured_attention_share_refuses_a_typed_number(book):
    with pytest.raises(AssertionError, match="do not type or look up a number"):
        ch03.check_measured_attention_share(lambda model, T: 20.0, "tiny-llama", 64, path=book)


def test_measured_attention_share_refuses_the_books_own_measurement(book):
    def borrowed(model, T):
        r = step_cost.attention_share(model, [T], rounds=3, progress=False)
        return 100 * r[T]["share"]["median"]

    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch03.check_measured_attention_share(borrowed, "tiny-llama", 64, path=book)


def test_measured_attention_share_refuses_reading_the_books_number(book):
    from lab import results

    def looked_up(model, T):
        sol3.measured_attention_share(model, T, rounds=3)     # run the steps, then report the book's number
        return results.lookup(results.read(book), f"ch03.attention_share.tiny-llama.T{T}")["value"]

    with pytest.raises(AssertionError, match="forbidden shortcut"):
        ch03.check_measured_attention_share(looked_up, "tiny-llama", 64, path=book)


def test_measured_attention_share_refuses_the_books_number_typed_after_measuring(book):
    def typed(model, T):
        sol3.measured_attention_share(model, T, rounds=3)     # real steps, then the book's 20% typed in
        return 20.0

    with pytest.raises(AssertionError, match="the book's .* to the last digit"):
        ch03.check_measured_attention_share(typed, "tiny-llama", 64, path=book)


def test_measured_attention_share_refuses_steps_over_a_shorter_context(book):
    def short(model, T):                                      # measures honestly, but at a quarter of T
        return sol3.measured_attention_share(model, T // 4, rounds=3)

    with pytest.raises(AssertionError, match="read at least T=64 keys"):
        ch03.check_measured_attention_share(short, "tiny-llama", 64, path=book)


def test_decode_flops_refuses_patching_its_counter():
    def patches(config, T):
        ch03.counted_step = lambda model, T: (0, 0)
        return 0

    with pytest.raises(AssertionError, match="changed lab.exercises.ch03.counted_step"):
        ch03.check_decode_flops(patches)
    assert ch03.counted_step.__name__ == "counted_step"
