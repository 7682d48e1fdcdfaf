"""lab/kernels/step.py through lab/engine/fast.py: a decode step of a few sequences in one C++ call gives the
reference step's logits (forward_cached over the same pages) and stores the same keys and values.

The oracle is the engine's reference step on a second pool filled the same way. Both accumulate the products in
float32 in different orders, so logits agree to rounding, not bit for bit. float32: within 1e-3 (SmolLM2's logits
reach about 30, so a few hundred float32 ulps). bfloat16 rounds every product and residual add of 30 layers to 8
bits of mantissa, and a sum in another order can land on the next bfloat16 value, so two bfloat16 steps part by
several of its units: within 1.0, eight bfloat16 steps at logits of 16 to 32 (0.125 to 0.5 measured between the
kernel and the reference; the reference's oneDNN products differ by processor: AMX or AVX-512). A second oracle
says which of the two rounds better: the float32 reference step over float32 pages filled the same way. The
kernel's bfloat16 logits must lie no farther from it than the bfloat16 reference's do, give or take a quarter
(two bfloat16 steps at 16 to 32; measured: the kernel 0.42 to 0.57 from float32, the reference 0.46 to 0.90).
The greedy token must be the same wherever the reference's top two logits lie further apart than twice the
tolerance.
"""

import dataclasses

import pytest
import torch

from lab.cache import CacheInputError, CacheMismatchError
from lab.cache.pool import PagePool
from lab.engine import ServingEngine
from lab.engine.fast import ROWS, FusedStep, rows_for
from lab.kernels.cpu import cpu_kernel_available
from lab.models import forward_cached, load, owner
from lab.models.load import RANDOM, random_model

pytestmark = pytest.mark.skipif(not cpu_kernel_available(), reason="needs a C++ compiler for the CPU kernels")
TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 1.0}


@pytest.fixture(scope="module", params=[torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def model(request):
    return load("smollm2", request.param)


def filled_pool(model, lengths, page_size=16):
    """A pool holding one prefilled sequence per length (seeded random ids), by the reference forward."""
    cfg, state = model.config, owner(model.weights, model.config)
    pool = PagePool.for_model(cfg, num_pages=sum(-(-n // page_size) + 1 for n in lengths), page_size=page_size,
                              dtype=model.dtype)
    seqs = [pool.new_id() for _ in lengths]
    g = torch.Generator().manual_seed(0)
    for seq, n in zip(seqs, lengths, strict=True):
        pool.reserve([(seq, n)])
        step = pool.plan_step([(seq, n)])
        ids = torch.randint(0, cfg.vocab_size, (1, n), generator=g)
        forward_cached(ids, model.weights, cfg, step, positions=step.positions, state=state)
    pool.reserve([(seq, 1) for seq in seqs])
    return pool, pool.plan_step([(seq, 1) for seq in seqs])


def reference_step(model, lengths, ids):
    """(pool, step, logits [1, B, V]) of the engine's reference step over a pool filled as filled_pool fills it."""
    pool, step = filled_pool(model, lengths)
    logits = forward_cached(ids, model.weights, model.config, step, positions=step.positions,
                            state=owner(model.weights, model.config), logits_at=torch.arange(len(lengths)))
    return pool, step, logits


@pytest.fixture(scope="module")
def float32_model():
    return load("smollm2", torch.float32)


# one sequence; three (a tile of three); several runs of attention; 7 and 16 (tiles of four and what is left)
CASES = {"one": [37], "three": [200, 5, 129], "several-runs": [600], "seven": [30 + 11 * i for i in range(7)],
         "sixteen": [20 + 5 * i for i in range(16)]}


@pytest.mark.parametrize("threads", [2, 5], ids=["2-threads", "5-threads"])   # 5: shares of rows not whole tiles
@pytest.mark.parametrize("lengths", CASES.values(), ids=CASES.keys())
def test_step_matches_the_reference_step(model, float32_model, lengths, threads):
    state = owner(model.weights, model.config)
    ids = torch.tensor([[11 + 17 * i for i in range(len(lengths))]])
    pool, step = filled_pool(model, lengths)
    fast = FusedStep.build(model, pool)
    fast.rows = ROWS                  # the kernel takes ROWS anywhere; rows_for picks what the engine gives it
    assert fast is not None and fast.takes(step)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = fast(ids, step, state)                                        # [1, B, V]
    finally:
        torch.set_num_threads(before)
    ref_pool, ref_step, want = reference_step(model, lengths, ids)
    tol = TOLERANCE[model.dtype]
    assert got.shape == want.shape and got.dtype == want.dtype
    assert (got.float() - want.float()).abs().max().item() < tol
    if model.dtype == torch.bfloat16:                                       # which rounds closer to float32's
        truth = reference_step(float32_model, lengths, ids)[2]
        ours, theirs = ((x.float() - truth).abs().max().item() for x in (got, want))
        assert ours <= theirs + 0.25, (ours, theirs)
    top2 = want[0].float().topk(2, dim=-1).values                           # [B, 2]
    clear = (top2[:, 0] - top2[:, 1]) > 2 * tol
    assert torch.equal(got[0].argmax(-1)[clear], want[0].argmax(-1)[clear])
    # the new keys and values went into the same slots, to the same rounding as the reference's
    slots = step.slot_mapping["full"]
    for pools, ref in ((pool.k_pools, ref_pool.k_pools), (pool.v_pools, ref_pool.v_pools)):
        new, old = pools["full"].flatten(1, 2)[:, slots], ref["full"].flatten(1, 2)[:, slots]
        assert (new.float() - old.float()).abs().max().item() < tol
        assert new.abs().sum() > 0                                          # written, not left at zero
    assert step.done and pool.version == ref_pool.version


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_rows_not_a_whole_vector(dtype):
    """Widths that are no multiple of 16 or 32 (SmolLM2's all are): the tiles read each row's last vector masked."""
    cfg = dataclasses.replace(RANDOM["tiny-llama"], d_model=72, d_ff=100, name="tiny-odd")
    model = random_model(cfg, seed=1, dtype=dtype)
    lengths = [9, 23, 5, 17, 30, 12, 8]
    ids = torch.tensor([[3 + 11 * i for i in range(len(lengths))]])
    pool, step = filled_pool(model, lengths)
    fast = FusedStep.build(model, pool)
    assert fast is not None and fast.takes(step)
    got = fast(ids, step, owner(model.weights, model.config))
    want = reference_step(model, lengths, ids)[2]
    tol = 1e-5 if dtype == torch.float32 else 0.02     # logits of random weights lie within about +-1
    assert (got.float() - want.float()).abs().max().item() < tol


def test_engine_tokens_match_with_and_without_the_fast_step(model):
    prompts = [list(range(100 + 7 * i, 140 + 9 * i)) for i in range(10)]     # steps of 10 decodes and fewer
    runs = {}
    for fast in (True, False):
        engine = ServingEngine(model, num_pages=32, fast_decode=fast)
        assert (engine.fast is not None) == fast
        runs[fast] = engine.generate(prompts, 12)
    if model.dtype == torch.float32:          # bfloat16 may part where two logits lie within its rounding
        assert runs[True] == runs[False]
    else:
        assert [r[:4] for r in runs[True]] == [r[:4] for r in runs[False]]


def test_the_fast_step_declines_what_it_does_not_run(model):
    rows = rows_for(model.dtype)
    pool, step = filled_pool(model, [20] * (rows + 1))
    fast = FusedStep.build(model, pool)
    assert fast.rows == rows <= ROWS and not fast.takes(step)    # more sequences than it takes
    with pytest.raises(ValueError, match="at most"):
        fast(torch.zeros(1, rows + 1, dtype=torch.long), step, owner(model.weights, model.config))
    pool2 = PagePool.for_model(model.config, num_pages=4, dtype=model.dtype)
    seq = pool2.new_id()
    pool2.reserve([(seq, 3)])
    assert not fast.takes(pool2.plan_step([(seq, 3)]))            # a prefill chunk
    other = PagePool.for_model(model.config, num_pages=4, dtype=torch.float16)
    assert FusedStep.build(model, other) is None                  # pages of another dtype


def test_the_book_says_how_many_decodes_the_fused_step_takes():
    """Chapters 3 and 8 and the README say "at most sixteen decodes": they change with ROWS."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    texts = [(root / p).read_text() for p in ("book/ch03_savings.md", "book/ch08_serving.md", "lab/book/readme.py")]
    words = {1: "one", 2: "two", 3: "three", 4: "four", 8: "eight", 16: "sixteen"}
    assert all(f"up to {words[ROWS]} decodes" in t or f"at most {words[ROWS]} decodes" in t for t in texts)


def test_tune_keeps_the_fused_step_as_far_as_it_was_measured_no_slower(monkeypatch):
    """tune follows what it times: with the reference step slowed (a sleep in forward_cached) it takes every size,
    with the fused step slowed it takes none, and the engine's "measure" gives the same tokens as the reference."""
    import time

    import lab.engine.fast as fast_module

    model = load("tiny-llama")
    engine = ServingEngine(model, num_pages=64, fast_decode=1)
    fast = engine.fast
    assert fast.rows == 1 and fast.timings is None
    real_reference, real_call = fast_module.forward_cached, FusedStep.__call__

    def slow(fn):
        def wrapper(*a, **k):
            time.sleep(0.005)
            return fn(*a, **k)
        return wrapper

    monkeypatch.setattr(fast_module, "forward_cached", slow(real_reference))
    assert fast.tune(engine.weights, engine.owner, sizes=(1, 2, 4), rounds=2) == 4
    assert set(fast.timings) == {1, 2, 4} and all(t["fused"] < t["reference"] for t in fast.timings.values())
    monkeypatch.setattr(fast_module, "forward_cached", real_reference)
    monkeypatch.setattr(FusedStep, "__call__", slow(real_call))
    assert fast.tune(engine.weights, engine.owner, sizes=(1, 2, 4), rounds=2) == 0
    monkeypatch.setattr(FusedStep, "__call__", real_call)
    with pytest.raises(ValueError, match="sizes"):
        fast.tune(engine.weights, engine.owner, sizes=(4, 2))
    for sizes in ((1, ROWS + 1), 16, (True,), (1.0, 2.0), ()):
        with pytest.raises(ValueError, match="sizes"):
            fast.tune(engine.weights, engine.owner, sizes=sizes)
    rows, timings = fast.rows, fast.timings
    with pytest.raises(ValueError, match="rounds"):
        fast.tune(engine.weights, engine.owner, rounds=0)
    with pytest.raises(CacheMismatchError):                            # fails inside: nothing changes
        fast.tune(engine.weights, None, sizes=(1, 2))
    assert (fast.rows, fast.timings) == (rows, timings)
    prompts = [list(range(10 + 3 * i, 30 + 5 * i)) for i in range(6)]
    measured = ServingEngine(model, num_pages=64, fast_decode="measure")
    assert 0 <= measured.fast.rows <= ROWS and measured.fast.timings
    assert measured.generate(prompts, 8) == ServingEngine(model, num_pages=64, fast_decode=False).generate(prompts, 8)


def test_a_fast_decode_limit_sends_larger_steps_to_the_reference():
    model = load("tiny-llama")
    engine = ServingEngine(model, num_pages=64, fast_decode=2)
    calls = []
    real = engine.fast.__call__
    engine.fast = type("Counting", (), dict(takes=engine.fast.takes, __call__=lambda self, *a: calls.append(
        a[0].shape[1]) or real(*a)))()
    for i in range(3):                                     # 3 decodes, then 2, then 1
        engine.add_request(list(range(5, 15 + i)), 3 + 3 * i)
    while engine.running or engine.waiting:
        engine.step()
    assert calls and max(calls) == 2                       # three sequences decode through the reference
    for bad in ("fast", 1.5, ROWS + 1, -1, None):
        with pytest.raises(CacheInputError, match="fast_decode is True, False, a number of decodes"):
            ServingEngine(model, num_pages=64, fast_decode=bad)
    with pytest.raises(CacheInputError, match="fast_decode"):            # checked where no fused step applies too
        ServingEngine(load("tiny-gpt2"), num_pages=64, fast_decode=99)
