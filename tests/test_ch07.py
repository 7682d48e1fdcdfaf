"""Chapter 7's quality measurement (lab.metrics.quality): teacher-forced decoding through a cache against
the plain forward.

Oracles: the plain forward over the whole text (no cache); KL, loss and agreement recomputed by hand from
their definitions. Tolerance: float32 cached against uncached logits differ by ~1e-6 on the tiny model, so
the float cache's KL is below 1e-9 and its loss change below 1e-5.
"""

import math

import pytest
import torch

from lab import metrics
from lab.cache import cache_bytes
from lab.cache.quantized import PerTensorCache
from lab.experiments import ch07_compress as ch07
from lab.models import forward_cached, load
from lab.models.retrofit import with_outlier_channels
from lab.peers import kvpress_agreement

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def text(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 320, (n,), generator=g).tolist()


def test_the_float_cache_changes_nothing(tiny):
    r = metrics.quality(tiny, text(), ch07.float_cache, prefill=16)
    assert r["kl"] < 1e-9 and abs(r["delta_ppl"]) < 1e-5 and r["top1"] == 1.0 and r["positions"] == 80


def test_compare_follows_the_definitions():
    g = torch.Generator().manual_seed(1)
    a, b, targets = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g), torch.tensor([1, 2, 3, 4, 5])
    r = metrics.compare(torch.cat([a, a[:1]]), torch.cat([b, b[:1]]), targets)   # the last row has no target
    p, q = b.double().softmax(-1), a.double().softmax(-1)
    kl = sum(float((p[i] * (p[i] / q[i]).log()).sum()) for i in range(5)) / 5
    loss = -sum(float(a[i].double().log_softmax(-1)[t]) for i, t in enumerate(targets.tolist())) / 5
    ref = -sum(float(b[i].double().log_softmax(-1)[t]) for i, t in enumerate(targets.tolist())) / 5
    assert r["kl"] == pytest.approx(kl) and r["loss"] == pytest.approx(loss)
    assert r["delta_ppl"] == pytest.approx(math.exp(loss) - math.exp(ref))
    assert r["top1"] == pytest.approx(float((a.argmax(-1) == b.argmax(-1)).double().mean()))


def test_fewer_bits_and_fewer_positions_cost_more(tiny):
    ids = text(160)
    eight, four = (metrics.quality(tiny, ids, ch07.quantized(bits=b, scheme="per_token"), 16) for b in (8, 4))
    assert 0 < eight["kl"] < four["kl"] and eight["nbytes"] > four["nbytes"]
    small, large = (metrics.quality(tiny, ids, ch07.evicting(b, "window"), 16) for b in (32, 96))
    assert large["kl"] < small["kl"]
    whole = metrics.quality(tiny, ids, ch07.evicting(200, "sinks"), 16)       # the budget holds everything
    assert whole["kl"] < 1e-9


def test_the_heat_map_marks_exactly_the_kept_positions(tiny):
    ids = text(120)
    m = ch07.kept_positions(tiny, ids, "sinks", 40, prefill=16)
    want = set(range(4)) | set(range(120 - 36, 120))                     # 4 sinks and the recent window
    assert m.shape == (tiny.config.n_kv_heads, 120)
    assert all({i for i, k in enumerate(row.tolist()) if k} == want for row in m)


def test_the_figures_draw_legibly(tiny, tmp_path):
    ids = text(80)
    runs = {name: metrics.quality(tiny, ids, ch07.quantized(**s), 16)
            for name, s in (("per_token_8", dict(bits=8)), ("per_token_4", dict(bits=4)))}
    full = 80 * cache_bytes(tiny.config, 1)
    ch07.plot_kl_bytes({"lab": {n: (r["nbytes"] / full, r["kl"]) for n, r in runs.items()},
                        "other": {"x": (0.5, 0.1)}}, tmp_path / "kl.png")
    budgets = {f"{p}_{b}": metrics.quality(tiny, ids, ch07.evicting(b, p), 16) for p in ("window", "sinks")
               for b in (16, 32)}
    rerotated = {b: metrics.quality(tiny, ids, ch07.evicting(b, "sinks", rerotate=True), 16) for b in (16, 32)}
    ch07.plot_loss_budget(budgets, ("window", "sinks"), ref_loss=runs["per_token_8"]["ref_loss"],
                          rerotated=rerotated, path=tmp_path / "loss.png")
    ch07.plot_kept({p: ch07.kept_positions(tiny, ids, p, 24, prefill=16, **kw) for p, kw in
                    (("h2o", {}), ("snapkv", dict(observation=8)))},
                   tmp_path / "kept.png")
    ch07.plot_residual({r: metrics.quality(tiny, ids, ch07.quantized(bits=2, scheme="kivi", group_size=8, residual=r),
                                        16)["kl"] for r in (0, 16)}, tmp_path / "residual.png")
    assert all((tmp_path / f).stat().st_size > 0 for f in ("kl.png", "loss.png", "kept.png", "residual.png"))


def test_a_batch_measures_what_its_passages_measure_one_at_a_time(tiny):
    a, b = text(64, 1), text(64, 2)
    both = metrics.quality(tiny, [a, b], ch07.quantized(bits=4, scheme="per_token"), 16)
    one = [metrics.quality(tiny, x, ch07.quantized(bits=4, scheme="per_token"), 16) for x in (a, b)]
    # float32 batched against one-row matmuls: logits differ by ~1e-6, losses by far less than 1e-4
    assert both["passage_loss"] == pytest.approx([r["loss"] for r in one], abs=1e-4)
    assert both["kl"] == pytest.approx((one[0]["kl"] + one[1]["kl"]) / 2, rel=1e-3)
    assert both["positions"] == 96 and both["batch"] == 2


def test_one_frozen_scale_per_tensor_rounds_to_its_grid_and_clips(tiny):
    cache = PerTensorCache(tiny.config)
    x = torch.tensor([text(24)])
    forward_cached(x[:, :16], tiny.weights, tiny.config, cache)
    s = cache.scales[0][0]
    k = cache.keys[0]
    assert torch.allclose(k / s, (k / s).round(), atol=1e-3)                  # on the grid of the prefill's scale
    assert (k / s).abs().max() <= 127 + 1e-3
    before = cache.scales[0][0].clone()
    forward_cached(x[:, 16:17] , tiny.weights, tiny.config, cache)
    assert torch.equal(cache.scales[0][0], before)                            # frozen after the first step
    r = metrics.quality(tiny, text(96), lambda c, b: PerTensorCache(c, b), 16)
    tok = metrics.quality(tiny, text(96), ch07.quantized(bits=8, scheme="per_token"), 16)
    assert r["kl"] > tok["kl"] > 0


def test_key_spread_follows_its_definition(tiny):
    ids = text(40)
    r = metrics.key_spread(tiny, ids)
    cache = ch07.ConcatCache(tiny.config)
    forward_cached(torch.tensor([ids]), tiny.weights, tiny.config, cache)
    k = cache.keys[0][0, 0]                                                   # [T, D], layer 0, head 0
    ratio = float(k.abs().amax(0).max() / k.abs().amax(0).median())
    assert r["channel_max"] >= ratio - 1e-6 and r["channel_max"] >= r["channel_median"] >= 1
    assert r["tensor_over_token"] >= 1


def test_pressed_with_a_budget_that_holds_the_context_is_the_plain_forward(tiny):
    context, continuation = text(48, 3), text(16, 4)
    got, kept = kvpress_agreement.pressed(tiny, context, continuation, ch07.EvictingCache(tiny.config, 64, "sinks"))
    ref = metrics.reference(tiny, [context + continuation[:-1]], 48)[0]
    assert torch.allclose(got, ref, atol=1e-5) and kept[0].shape == (1, tiny.config.n_kv_heads, 48)
    small, kept = kvpress_agreement.pressed(tiny, context, continuation, ch07.EvictingCache(tiny.config, 24, "sinks"))
    assert torch.allclose(small[0], ref[0], atol=1e-5)          # the context's last logits come before eviction
    assert not torch.allclose(small[1:], ref[1:], atol=1e-3)
    assert kept[0][0, 0].tolist() == list(range(4)) + list(range(28, 48))


def test_overlap_is_the_mean_jaccard_share():
    lab = [torch.tensor([[[0, 1, 2], [0, 1, 3]]])]                          # 1 layer, 2 heads
    peer = [[[0, 1, 2], [0, 2, 3]]]
    assert kvpress_agreement.kept_overlap(lab, peer) == pytest.approx((1 + 2 / 4) / 2)


def test_outlier_channels_keep_the_function_and_widen_the_keys(tiny):
    ids = text(48)
    odd = with_outlier_channels(tiny, factor=16.0, pairs=(1,))
    ref, got = (metrics.reference(m, [ids], 16) for m in (tiny, odd))
    assert torch.allclose(ref, got, atol=1e-5)                 # q . k unchanged: a power of two scales exactly
    assert metrics.key_spread(odd, ids)["channel_max"] > 4 * metrics.key_spread(tiny, ids)["channel_max"]
    assert all(odd.weights[n] is tiny.weights[n] for n in tiny.weights if "k_proj" not in n and "q_proj" not in n)
