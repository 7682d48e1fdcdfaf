"""Chapter 10's measurements, on small settings (the notebook records the whole section in quick mode).

Oracles: HybridBlockManager's own bookkeeping re-counted from the window rule (positions, not pages), the
bytes of a cache as it holds them, and the recorded values against the measurements they came from.
"""

import dataclasses

import pytest
import torch

from lab import data
from lab.cache import ConcatCache, QuantizedCache
from lab.cache.block_manager import NULL
from lab.experiments import ch10_architecture as ch10
from lab.models import load, random_model
from lab.models.retrofit import calibration_moments, latent_kv, local_layers

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def smol_shape():
    """A model of SmolLM2's shape is not needed for page counts: its config is (the weights are never read)."""
    return load("smollm2")


def test_the_hybrid_pool_holds_every_global_page_and_only_the_window_of_the_local_ones(smol_shape):
    h = ch10.hybrid_pool(smol_shape, dict(hybrid_context=4096), window=1024, global_every=6)
    assert h["layers"] == {"full": 5, "local": 25}                      # every sixth layer of 30 is global
    assert h["held"]["full"] == 4097 // 16 + 1                         # every page of 4,097 positions
    window_pages = -(-(1024 - 1) // 16) + 1                            # the window, and the page being written
    assert h["held"]["local"] <= window_pages + 1 and h["held"]["local"] < h["held"]["full"] / 3
    per_page_layer = 16 * 2 * 3 * 64 * 2
    assert h["full_bytes"] == h["held"]["full"] * 30 * per_page_layer
    assert h["hybrid_bytes"] == (h["held"]["full"] * 5 + h["held"]["local"] * 25) * per_page_layer
    assert h["hit_pages"] == 4096 // 16                                 # the whole prompt's full pages
    assert h["taken"]["full"] == 256 and h["taken"]["local"] == 1024 // 16   # only the last window's


def test_the_tables_drawn_hold_null_exactly_where_the_window_gave_pages_back(smol_shape):
    t = ch10.hybrid_tables(smol_shape)
    P, w, s = t["page_size"], t["window"], t["sinks"]
    for length, full, local in zip(t["lengths"], t["tables"]["full"], t["tables"]["local"], strict=True):
        assert NULL not in full and len(full) == len(local) == -(-length // P)
        for i, page in enumerate(local):                               # position-level restatement of the rule
            read = any(p < s or p >= length + 1 - w for p in range(i * P, (i + 1) * P))
            assert (page != NULL) == read, (length, i)
    ch10.plot_tables(t)


def test_bytes_per_position_are_counted_as_served():
    cfg = dataclasses.replace(load("tiny-llama").config, n_layers=4, name="tiny4")
    m = random_model(cfg, seed=1)
    float_result = dict(nbytes=2 * 40 * cfg.kv_bytes_per_position(), batch=2, length=40)   # float32, 2 rows
    assert ch10.bf16_bytes(m, ch10.float_cache, float_result) == cfg.kv_bytes_per_position(torch.bfloat16)
    local = local_layers(m, 8, 2)                                      # 2 of 4 layers keep 8 of 40 positions
    assert ch10.bf16_bytes(local, ch10.float_cache, float_result) == pytest.approx(
        cfg.kv_bytes_per_position(torch.bfloat16) * (2 * 40 + 2 * 8) / (4 * 40))
    int8, settings = ch10.quantized("per_token_8"), ch10.QUANTIZED["per_token_8"]
    assert ch10.bf16_bytes(m, int8, float_result) == QuantizedCache(cfg, **settings).bytes_per_position()
    calib = [list(range(1, 30))]
    assert latent_kv(m, 8, calib).config.kv_bytes_per_position(torch.bfloat16) == 4 * 8 * 2


def test_values_pick_the_best_kl_within_each_budget():
    q = {"latent": {"rank 96": dict(kl=1.0, bytes=5760.0, delta_ppl=1.0, loss=2.0, ref_loss=1.0, top1=0.3,
                                    positions=10),
                    "rank 24": dict(kl=2.0, bytes=1440.0, delta_ppl=2.0, loss=3.0, ref_loss=1.0, top1=0.2,
                                    positions=10)},
         "combined": {"w512 g6 s4 kivi4": dict(kl=0.5, bytes=4000.0, delta_ppl=0.5, loss=1.5, ref_loss=1.0,
                                                top1=0.8, positions=10)}}
    m = dict(settings=dict(passages=1, tokens=64, decode=8), prefill=56, bf16_bytes=23040, quality=q,
             threads=1, steps={512: {"original": dict(median=0.04, iqr=0.001, n=3),
                                     "absorbed r96": dict(median=0.05, iqr=0.001, n=3)}},
             spectra={96: {"keys": 0.9, "values": 0.7}},
             hybrid=dict(prefill=8192, context=8193, window=1024, global_every=6, page_size=16,
                         layers={"full": 5, "local": 25}, held={"full": 513, "local": 65}, hybrid_bytes=1.0,
                         full_bytes=3.0, hit_pages=512, taken={"full": 512, "local": 64}))
    v = ch10.values(m)
    assert v["best"]["quarter"]["kl"]["value"] == 0.5                     # 4,000 bytes is under a quarter
    assert v["best"]["tenth"]["kl"]["value"] == 2.0                       # only rank 24 is under a tenth
    assert v["quality"]["combined"]["w512_g6_s4_kivi4"]["share"]["value"] == pytest.approx(100 * 4000 / 23040)
    assert v["steps"]["T512"]["absorbed_r96"]["over_original"]["value"] == pytest.approx(1.25)
    assert v["hybrid"]["saved"]["value"] == pytest.approx(100 * 2 / 3)
    assert v["spectra"]["rank_96"]["values"]["value"] == pytest.approx(70)
    fig = ch10.plot_kl_bytes(ch10.plot_points(m))
    assert fig.axes[0].get_xscale() == "log"
    labels = {t.get_text() for t in fig.axes[0].texts}                  # every point of the chapter's designs
    assert {"rank 96", "rank 24", "512, 1 in 6, KIVI-4"} <= labels


def test_values_hold_only_the_parts_measured_so_far():
    """A notebook sets a part's verdicts beside the book's before the later parts have run."""
    m = dict(settings=dict(passages=1, tokens=64, decode=8), bf16_bytes=23040, threads=1,
             hybrid=dict(prefill=8192, context=8193, window=1024, global_every=6, page_size=16,
                         layers={"full": 5, "local": 25}, held={"full": 513, "local": 65}, hybrid_bytes=1.0,
                         full_bytes=3.0, hit_pages=512, taken={"full": 512, "local": 64}))
    assert set(ch10.values(m)) == {"hybrid"}


def test_keys_before_rope_keep_more_energy_in_as_many_directions():
    """RoPE turns each key by its position's angles: the same directions hold less of the keys' energy after it
    (SmolLM2's shape, a few passages of the training plays)."""
    smol = load("smollm2")
    calibration = data.passages(smol.tokenizer, 128, 2, split="train")
    after = calibration_moments(smol, calibration)
    before = calibration_moments(smol, calibration, before_rope=True)
    s = ch10.spectra(after, (96,), before)[96]
    assert s["keys_before_rope"] > s["keys"]
    assert all(torch.equal(after[j][1], before[j][1]) for j in after)      # the values are left as they are
    # a rotation keeps every key's length, so the keys' total energy (the trace) is the same before and after;
    # float32 keys, summed in float64: agreement to 1e-5 relative
    for j in after:
        assert torch.trace(before[j][0]) == pytest.approx(float(torch.trace(after[j][0])), rel=1e-5)


def test_a_quality_map_case_runs_through_chapter_7s_protocol():
    cfg = dataclasses.replace(load("tiny-llama").config, n_layers=4, name="tiny4")
    m = random_model(cfg, seed=1)
    ids = torch.randint(0, cfg.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    ref = ch10.reference(m, ids, 16)
    q = ch10.quality_map(m, {"local layers": {"w4 g2": (local_layers(m, 4, 2), ch10.float_cache)},
                             "fewer KV heads": {"same": (m, lambda c, b=1: ConcatCache(c, b))}}, ids, 16, ref)
    assert q["fewer KV heads"]["same"]["kl"] < 1e-9                      # the model itself: no divergence
    assert q["local layers"]["w4 g2"]["kl"] > 1e-4                      # a window of 4 changes the answer
    assert q["local layers"]["w4 g2"]["bytes"] < q["fewer KV heads"]["same"]["bytes"]
