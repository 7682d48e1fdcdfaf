"""Chapter 3 exercises: count the work of one cached decode step, how much of it is attention, and measure
how much of the step's time attention really takes.

Exercises 1 and 2 ask for arithmetic from the model's shape, so the reader's function runs while every
torch function raises (no running the model, no FLOP counter) and while the library's counter,
`lab.step_cost.counted_step`, raises. Exercise 3 asks for a measurement: the reader's function must run
real decode steps with attention (the check counts the attention calls) and may not call the book's own
measurement, `lab.step_cost.attention_share`; its answer is then set beside the book's.

Exercises 1 and 2 also run on model shapes drawn fresh at every run (`seed=` draws the same ones again), and
the counter runs only after the reader's function has answered: no count can be looked up beforehand.
"""
import random

from .. import results
from ..models import ModelConfig, load, random_model
from ..results import COMMITTED
from ..step_cost import attention_share, counted_step
from . import compare_with_book
from .rules import NoTorch, WatchTorch, drawn_with, fresh_seed, functions_raise, unchanged

# ---- what the checks switch off while a reader's function runs ---------------------------------------------

def _arithmetic_only(fn, config, T):
    with unchanged(__name__), functions_raise(counted_step), NoTorch("count from the config's shapes, do not run "
                                                                    "the model"):
        return fn(config, T)


# ---- exercise 1 and 2: count ------------------------------------------------------------------------------

CASES = [("tiny-llama", 16), ("tiny-gpt2", 100), ("tiny-mqa", 7), ("smollm2", 512)]


def random_shapes(rng, count=4) -> list:
    """`count` (config, T): small models of both families with shapes drawn from rng (grouped-query attention,
    untied heads, odd widths), each with a context T."""
    out = []
    for i in range(count):
        arch, head_dim, n_heads = rng.choice(("llama", "gpt2")), rng.choice((8, 16, 24)), rng.choice((2, 3, 4, 6))
        n_kv = n_heads if arch == "gpt2" else rng.choice([h for h in range(1, n_heads + 1) if n_heads % h == 0])
        d_model = n_heads * head_dim if arch == "gpt2" else rng.choice((32, 48, 80))   # GPT-2: heads fill the width
        config = ModelConfig(arch=arch, vocab_size=rng.randint(64, 1500), n_layers=rng.randint(1, 3), d_model=d_model,
                             n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim, d_ff=rng.randint(16, 300),
                             max_positions=4096, tie_embeddings=arch == "gpt2" or rng.random() < 0.5,
                             name=f"random-{i}")
        out.append((config, rng.randint(1, 3000)))
    return out


def _cases(seed):
    """(name, config, model or None, T): the book's models, then shapes drawn fresh from `seed`."""
    fixed = [(name, load(name).config, load(name), T) for name, T in CASES]
    drawn = [(f"a {c.arch} of {c.n_layers} layers, width {c.d_model}, {c.n_heads}/{c.n_kv_heads} heads of "
              f"{c.head_dim}, MLP {c.d_ff}, vocabulary {c.vocab_size}", c, None, T)
             for c, T in random_shapes(random.Random(seed))]
    return fixed + drawn


def _counted(model, config, T):
    return counted_step(model if model is not None else random_model(config), T)


def check_decode_flops(fn, seed=None):
    """fn(config, T) -> FLOPs (2 per multiply-add) of one cached decode step at context T, output head included.

    Rule: count from the shapes in `config`; the check runs fn while torch and `counted_step` raise. It asks
    about the book's models and about shapes drawn fresh, then counts with PyTorch.
    """
    seed = fresh_seed(seed)
    cases = _cases(seed)
    got = [_arithmetic_only(fn, config, T) for _, config, _, T in cases]
    with drawn_with(seed, "check_decode_flops"):
        for (name, config, model, T), g in zip(cases, got, strict=True):
            want, _ = _counted(model, config, T)
            assert g == want, (f"{name} at T={T}: you said {g:,}, PyTorch counted {want:,}. Hint: q and o "
                               "projections use all query heads, k and v only the kv heads; attention reads T+1 keys.")
    print(f"correct (shapes drawn with seed={seed})")
    return True


def check_attention_share(fn, seed=None):
    """fn(config, T) -> the fraction of a cached step's FLOPs spent in attention over the cache.

    Rule: as in exercise 1, from the shapes alone.
    """
    seed = fresh_seed(seed)
    cases = _cases(seed) + [("smollm2", load("smollm2").config, load("smollm2"), 4096)]
    got = [_arithmetic_only(fn, config, T) for _, config, _, T in cases]
    with drawn_with(seed, "check_attention_share"):
        for (name, config, model, T), g in zip(cases, got, strict=True):
            total, attention = _counted(model, config, T)
            assert isinstance(g, (int, float)) and abs(g - attention / total) < 1e-9, (
                f"{name} at T={T}: you said {g}, counted {attention / total:.4f}")
    print(f"correct: at T={T} attention is {attention / total:.0%} of SmolLM2's cached FLOPs (shapes drawn with "
          f"seed={seed})")
    return True


# ---- exercise 3: measure (open-ended) ----------------------------------------------------------------------

def check_measured_attention_share(fn, name="smollm2", T=1024, path=COMMITTED):
    """fn(model, T) -> the percentage of one cached decode step's time spent in attention, at context T,
    measured on this machine.

    Open-ended: fill a StaticCache with T positions, time the decode step with attention and without it
    (give the cache an `attend` that stores k, v and returns q), in interleaved rounds with
    lab.bench.time_rounds. Rules: it is a measurement, so your function must run real decode steps with
    attention over the T cached positions (the check counts them: at least three per layer, each attending
    to at least T keys); and it may not call the book's own `lab.step_cost.attention_share`, nor read the
    book's number (lab.results raises while it runs), nor return it. Then your number is set beside the
    book's (`ch03.attention_share.<name>.T<T>` in results/results.json); returns yours over the book's.
    """
    model = load(name)
    measured_elsewhere = (attention_share, results.read, results.lookup, compare_with_book)

    def over_context(args, kwargs):                            # the keys of an SDPA call: [..., S, D]
        keys = args[1] if len(args) > 1 else kwargs.get("key")
        return keys is not None and keys.shape[-2] >= T
    with (unchanged(__name__), functions_raise(*measured_elsewhere),
          WatchTorch("scaled_dot_product_attention", keep=over_context) as seen):
        share = fn(model, T)
    # A difference of two noisy medians: where attention is a small part of the step, noise can make
    # the measured share slightly negative, so the range allows it; anything outside is not a percentage.
    assert isinstance(share, (int, float)) and not isinstance(share, bool) and -100 <= share <= 100, (
        f"expected a percentage (at most 100 in size), got {share!r}")
    layers = model.config.n_layers
    assert seen.calls >= 3 * layers, (
        f"your function attended {seen.calls} times; three decode steps through {layers} layers attend "
        f"{3 * layers} times: measure the step with attention, do not type or look up a number")
    assert seen.kept >= 3 * layers, (
        f"only {seen.kept} of your {seen.calls} attention calls read at least T={T} keys: measure decode "
        f"steps over a cache of {T} positions, as the exercise asks")
    key = f"ch03.attention_share.{name}.T{T}"
    # A median of timed rounds does not land on the book's stored float by chance: equality is a copy.
    assert share != results.lookup(results.read(path), key, source=str(path))["value"], (
        f"your number is the book's {key} to the last digit: return what your rounds measured")
    return compare_with_book(key, share, "%", path=path)
