"""lab.step_cost: what a decode step costs, on the tiny model.

Timings are not asserted (a busy machine moves them); what is asserted is what each measurement runs and
returns, and the numbers that have an oracle: attention over pages against SDPA over the same keys and
values (float32: 1e-5, a few ulps of sums over 40 positions), and the byte share recomputed from the
model's shape.
"""

import pytest
import torch

from lab import step_cost
from lab.cache import ConcatCache, StaticCache
from lab.models import load

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def test_step_times_times_every_design_at_every_context(tiny):
    times = step_cost.step_times(tiny, [4, 9], rounds=2, warmup=0, progress=False)
    assert list(times) == [4, 9]
    for row in times.values():
        assert list(row) == ["uncached", "concat", "static"]
        assert all(s["n"] == 2 and len(s["samples"]) == 2 and s["median"] > 0 for s in row.values())


def test_cache_step_times_takes_any_cache_factory(tiny):
    cases = {"concat": lambda config, b: ConcatCache(config, b), "static": lambda config, b: StaticCache(config, 64, b)}
    r = step_cost.cache_step_times(tiny, 12, cases, rounds=3)
    assert list(r) == ["concat", "static"] and all(s["n"] == 3 and s["median"] > 0 for s in r.values())


def test_predicted_shares_follow_the_counted_flops_and_the_bytes_read(tiny):
    cfg = tiny.config
    weights = sum(t.nbytes for t in tiny.weights.values())
    shares = step_cost.predicted_shares(tiny, [8, 64])
    for T, s in shares.items():
        total, attention = step_cost.counted_step(tiny, T)
        kv = 2 * cfg.n_layers * cfg.n_kv_heads * cfg.head_dim * (T + 1) * 4          # float32 K and V
        assert s["flops"] == attention / total and s["bytes"] == pytest.approx(kv / (kv + weights), rel=1e-12)
    assert shares[8]["flops"] < shares[64]["flops"] and shares[8]["bytes"] < shares[64]["bytes"]


def test_attention_case_reads_the_same_attention_over_pages():
    r = step_cost.attention_case(2, 40, reps=2, page_size=16, heads=(4, 2), head_dim=16)
    # float32 softmax-weighted sums of standard normals, |out| < 5: 1e-5 is a tenfold margin on rounding
    assert r["max_diff"] < 1e-5 and r["gather_max_diff"] < 1e-5
    assert r["ratio"] == r["paged"]["median"] / r["contiguous"]["median"] and r["paged"]["n"] == 2
    assert r["gather_ratio"] == r["gather"]["median"] / r["contiguous"]["median"] and r["gather"]["n"] == 2
    before = torch.get_num_threads()
    step_cost.attention_case(1, 20, reps=1, heads=(4, 2), head_dim=16, threads=1, cold=True)
    assert torch.get_num_threads() == before                                   # restored afterwards


def test_engine_steps_times_every_engine_at_the_same_batch_and_reads_less_with_a_window():
    """The plain, hybrid and radix engines side by side on tiny-llama: every timed step decodes all four
    prompts; a window of 8 reads fewer bytes than every position once prompts are longer than it, exactly
    (layers x heads x dim x 4 bytes x 2 for K and V, per position read)."""
    from lab.engine import ServingEngine
    from lab.models import load
    from lab.models.retrofit import local_layers
    from lab.step_cost import engine_steps

    tiny = load("tiny-llama")
    hybrid = local_layers(tiny, window=8, global_every=2)
    engines = dict(plain=ServingEngine(tiny, 128, 4, prefix_caching=False),
                   hybrid=ServingEngine(hybrid, 128, 4, prefix_caching=False),
                   radix=ServingEngine(tiny, 128, 4, prefix_caching="radix"))
    prompts = [[(7 * i + j) % 300 + 1 for j in range(24)] for i in range(4)]
    out = engine_steps(engines, prompts, rounds=3, warmup=1)
    cfg = tiny.config
    per = 2 * cfg.n_kv_heads * cfg.head_dim * 4
    held = [r.computed for r in engines["plain"].running]
    assert out["plain"]["kv_read_bytes"] == sum(held) * cfg.n_layers * per
    layers = [hybrid.config.window_of(j)[0] for j in range(cfg.n_layers)]
    assert out["hybrid"]["kv_read_bytes"] == sum(min(n, 8) if w else n for n in held for w in layers) * per
    assert out["hybrid"]["kv_read_bytes"] < out["plain"]["kv_read_bytes"]
    assert out["plain"]["over_base"]["median"] == 1.0 and out["radix"]["over_base"]["n"] == 3
