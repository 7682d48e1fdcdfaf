"""Chapter 7's quality measurement: teacher-forced decoding through a cache against the plain forward.

Oracles: the plain forward over the whole text (no cache); KL, loss and agreement recomputed by hand from
their definitions. Tolerance: float32 cached against uncached logits differ by ~1e-6 on the tiny model, so
the float cache's KL is below 1e-9 and its loss change below 1e-5.
"""

import math

import pytest
import torch

from lab.experiments import ch07_compress as ch07
from lab.models import load

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def text(n=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 320, (n,), generator=g).tolist()


def test_the_float_cache_changes_nothing(tiny):
    r = ch07.quality(tiny, text(), lambda config: ch07.ConcatCache(config), prefill=16)
    assert r["kl"] < 1e-9 and abs(r["delta_ppl"]) < 1e-5 and r["top1"] == 1.0 and r["positions"] == 80


def test_compare_follows_the_definitions():
    g = torch.Generator().manual_seed(1)
    a, b, targets = torch.randn(5, 7, generator=g), torch.randn(5, 7, generator=g), torch.tensor([1, 2, 3, 4, 5])
    r = ch07.compare(torch.cat([a, a[:1]]), torch.cat([b, b[:1]]), targets)   # the last row has no target
    p, q = b.double().softmax(-1), a.double().softmax(-1)
    kl = sum(float((p[i] * (p[i] / q[i]).log()).sum()) for i in range(5)) / 5
    loss = -sum(float(a[i].double().log_softmax(-1)[t]) for i, t in enumerate(targets.tolist())) / 5
    ref = -sum(float(b[i].double().log_softmax(-1)[t]) for i, t in enumerate(targets.tolist())) / 5
    assert r["kl"] == pytest.approx(kl) and r["loss"] == pytest.approx(loss)
    assert r["delta_ppl"] == pytest.approx(math.exp(loss) - math.exp(ref))
    assert r["top1"] == pytest.approx(float((a.argmax(-1) == b.argmax(-1)).double().mean()))


def test_fewer_bits_and_fewer_positions_cost_more(tiny):
    ids = text(160)
    eight, four = (ch07.quality(tiny, ids, ch07.quantized(bits=b, scheme="per_token"), 16) for b in (8, 4))
    assert 0 < eight["kl"] < four["kl"] and eight["nbytes"] > four["nbytes"]
    small, large = (ch07.quality(tiny, ids, ch07.evicting(b, "window"), 16) for b in (32, 96))
    assert large["kl"] < small["kl"]
    whole = ch07.quality(tiny, ids, ch07.evicting(200, "sinks"), 16)       # the budget holds everything
    assert whole["kl"] < 1e-9


def test_the_heat_map_marks_exactly_the_kept_positions(tiny):
    ids = text(120)
    m = ch07.kept_positions(tiny, ids, "sinks", 40, prefill=16)
    want = set(range(4)) | set(range(120 - 36, 120))                     # 4 sinks and the recent window
    assert m.shape == (tiny.config.n_kv_heads, 120)
    assert all({i for i, k in enumerate(row.tolist()) if k} == want for row in m)


def test_the_figures_draw_legibly(tiny, tmp_path):
    ids = text(80)
    runs = {name: ch07.quality(tiny, ids, ch07.quantized(**s), 16)
            for name, s in (("per_token_8", dict(bits=8)), ("per_token_4", dict(bits=4)))}
    ch07.plot_kl_bytes(runs, ch07.quality(tiny, ids, lambda c: ch07.ConcatCache(c), 16)["nbytes"],
                       tmp_path / "kl.png")
    budgets = {f"{p}_{b}": ch07.quality(tiny, ids, ch07.evicting(b, p), 16) for p in ("window", "sinks")
               for b in (16, 32)}
    ch07.plot_loss_budget(budgets, ("window", "sinks"), ref_loss=runs["per_token_8"]["ref_loss"],
                          path=tmp_path / "loss.png")
    ch07.plot_kept({p: ch07.kept_positions(tiny, ids, p, 24, prefill=16, **kw) for p, kw in
                    (("h2o", {}), ("snapkv", dict(observation=8)))},
                   tmp_path / "kept.png")
    assert all((tmp_path / f).stat().st_size > 0 for f in ("kl.png", "loss.png", "kept.png"))
