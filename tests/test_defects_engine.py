"""Regression tests for defects of the serving engine (lab/engine/serving.py), one named test each.

Oracle: each request decoded greedily on its own through a ConcatCache (tests/test_serving.py's `expected`,
which also rejects prompts with a near tie); tokens equal, with no tolerance.
"""

import pytest
from test_serving import check_idle, expected, prompts

import lab.engine.serving as serving
from lab.cache import CacheInputError
from lab.engine import EarlyExit, EngineStateError, PromptLookup, ServingEngine, SpecInputError
from lab.engine.fast import FusedStep
from lab.models import load
from lab.models.retrofit import latent_kv, reconstructing_form

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


class BadOnce(PromptLookup):
    """Prompt lookup that, on its `when`-th proposal over all requests, guesses a token outside the vocabulary
    (after the engine's decodes have reserved their slots)."""

    calls = 0

    def __init__(self, when):
        super().__init__(1)
        self.when = when

    def propose(self, context, k):
        BadOnce.calls += 1
        return [10 ** 6] if BadOnce.calls == self.when else super().propose(context, k)


def test_a_step_that_raises_taints_its_requests_and_later_steps_refuse(tiny):
    """A draft's bad guess raises in the middle of a step. Stepping on would decode from slots reserved and never
    filled (2 of 4 requests came out wrong, silently); instead every later step refuses until the requests that
    were in flight are cancelled, and then the engine decodes new requests exactly as a fresh one."""
    ps = prompts((9, 14, 6, 11), seed=3)
    want = expected(tiny, ps, 10)
    BadOnce.calls = 0
    engine = ServingEngine(tiny, 64, page_size=4, draft=BadOnce(when=9), k=2)
    rids = [engine.add_request(p, 10) for p in ps]
    with pytest.raises(SpecInputError):
        for _ in range(40):
            engine.step()
    with pytest.raises(EngineStateError, match="Cancel them"):
        engine.step()
    with pytest.raises(EngineStateError):
        engine.generate(ps, 10)                         # refused before any of its steps
    for rid in rids:
        engine.cancel(rid)
    assert engine.generate(ps, 10) == want
    check_idle(engine)


@pytest.mark.parametrize("fast", [False, True], ids=["forward_cached", "fused-step"])
def test_an_exception_in_the_forward_taints_the_step(tiny, monkeypatch, fast):
    """The same for a forward that raises (an exception injected into the step's forward: the reference, or
    the decode step in one call)."""
    ps = prompts((7, 12, 5), seed=4)
    want = expected(tiny, ps, 8)
    engine = ServingEngine(tiny, 64, page_size=4, fast_decode=fast)
    assert (engine.fast is not None) == fast
    rids = [engine.add_request(p, 8) for p in ps]
    for _ in range(3):
        engine.step()
    owner, name = (FusedStep, "__call__") if fast else (serving, "forward_cached")
    real, calls = getattr(owner, name), []

    def failing(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("injected")
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, failing)
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    with pytest.raises(EngineStateError, match="injected"):
        engine.step()
    assert len(calls) == 1                              # the refusal ran nothing
    partial = [engine.output(r) for r in rids]
    assert all(out == w[:len(out)] for out, w in zip(partial, want, strict=True))   # the tokens so far are right
    for rid in rids:
        engine.cancel(rid)
    assert engine.generate(ps, 8) == want
    check_idle(engine)


def test_every_chapter_9_draft_works_in_the_engine(tiny):
    """EarlyExit's cache was made for the draft's original, unbound object (AttributeError), or for whatever model
    that original was bound to last (CacheMismatchError): the engine's copy now makes its own."""
    ps = [list(range(1, 9)), prompts((12,), seed=5)[0]]
    want = expected(tiny, ps, 8)
    assert ServingEngine(tiny, 16, page_size=4, draft=EarlyExit(1), k=4).generate(ps, 8) == want
    bound_elsewhere = EarlyExit(1)
    bound_elsewhere.bind(load("tiny-gpt2"), [1, 2])
    assert ServingEngine(tiny, 16, page_size=4, draft=bound_elsewhere, k=4).generate(ps, 8) == want


def test_the_reconstructing_form_is_refused_when_the_engine_is_built(tiny):
    """Its first step raised TypeError deep in the pool; the constructor now says why, and the absorbed form of
    the same latent model runs."""
    latent = latent_kv(tiny, 2 * tiny.config.n_kv_heads * tiny.config.head_dim, [prompts((64,), seed=6)[0]])
    with pytest.raises(CacheInputError, match="absorbed form"):
        ServingEngine(reconstructing_form(latent), 16, page_size=4)
    ps = prompts((9,), seed=7)
    assert ServingEngine(latent, 16, page_size=4).generate(ps, 6) == expected(latent, ps, 6)


@pytest.mark.parametrize("prefix_caching", [True, "radix"])
def test_a_fresh_engine_holds_no_sequence(tiny, prefix_caching):
    """The engine's pool was a PagedCache whose one default row reserved sequence 0 for nobody."""
    engine = ServingEngine(tiny, 16, page_size=4, prefix_caching=prefix_caching)
    assert engine.manager.sequences() == []
    engine.generate(prompts((6,), seed=8), 3)
    assert engine.manager.sequences() == []
