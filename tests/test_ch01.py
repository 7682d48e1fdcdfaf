"""Chapter 1's measurements, run small: the causal-mask claim, the byte formula, and the record."""

import json

import pytest
import torch

from lab import results
from lab.experiments import ch01_recompute as ch01
from lab.models import forward, load


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-mqa"])
def test_causal_mask_earlier_positions_do_not_move(name):
    r = ch01.causal_mask(load(name), n_tokens=24)
    # Earlier rows run the same arithmetic on the same inputs; 1e-6 leaves room only for a change in
    # kernel blocking, far below the effect on the last position (checked to be > 1e-3).
    assert r["earlier_max"] <= 1e-6
    assert r["last"] > 1e-3
    assert len(r["per_position"]) == 24


def test_causal_mask_on_smollm2_is_exact(smollm2):
    r = ch01.causal_mask(smollm2, n_tokens=32)
    assert r["earlier_max"] <= 1e-6 and r["last"] > 1.0


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama", "tiny-mqa"])
def test_forward_with_causal_attention_is_the_library_forward(name):
    # The same operations in the same order as lab.models.forward: bit-identical, tolerance zero.
    model = load(name)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ours = ch01.forward_with_attention(ids, model, ch01.causal)
        assert torch.equal(ours, forward(ids, model.weights, model.config))


@pytest.mark.parametrize("name", ["tiny-gpt2", "tiny-llama"])
def test_without_the_mask_earlier_positions_move(name):
    r = ch01.bidirectional_shift(load(name), n_tokens=24)
    # With the mask they move by at most 1e-6 (test above); without it every earlier position sees the
    # changed token, so even the smallest change is far above float32 rounding.
    assert min(r["per_position"][:-1]) > 1e-5
    assert r["earlier_max"] >= r["earlier_median"] > 1e-5 and r["earlier"] == 23


def test_bytes_table_matches_published_per_position_sizes():
    # Independent oracle: 2 x layers x kv_heads x head_dim x 2 bytes worked out by hand from each model's
    # config.json (research/ch01/sources.md): 36, 22.5, 112, 144 and 800 KiB per position.
    kib = {r["model"]: r["bytes"] / 1024 for r in ch01.bytes_table()}
    assert kib == {"GPT-2 small": 36, "SmolLM2-135M": 22.5, "Qwen3-0.6B": 112, "Qwen3-4B": 144, "Llama-2-13B": 800}
    saving = {r["model"]: r["saving"] for r in ch01.bytes_table()}
    assert saving["SmolLM2-135M"] == 3 and saving["Qwen3-4B"] == 4 and saving["Llama-2-13B"] == 1


def test_published_smollm2_shape_matches_the_loaded_model(smollm2):
    cfg = smollm2.config
    pub = next(p for p in ch01.PUBLISHED if p.name == "SmolLM2-135M")
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim) == (
        pub.n_layers, pub.n_heads, pub.n_kv_heads, pub.head_dim)


def test_naive_loop_counts_1040_positions():
    r = ch01.naive_loop(load("tiny-llama"), 17, 32)
    assert r["positions"] == r["formula_uncached"] == 1040 and r["formula_cached"] == 48


def test_record_writes_a_valid_section(tmp_path, monkeypatch):
    """The whole pipeline on tiny models: measure, record, read back, resolve every key the book uses."""
    monkeypatch.setenv("LAB_RESULTS", str(tmp_path / "results.json"))
    tiny = load("tiny-llama")
    m = dict(settings={}, manifests={"tiny-llama": tiny.manifest}, load=ch01.load_seconds("tiny-mqa", reps=1),
             parity=ch01.parity(["tiny-gpt2"], n_tokens=16), causal=ch01.causal_mask(tiny, 16),
             bidirectional=ch01.bidirectional_shift(tiny, 16),
             loop=ch01.naive_loop(tiny, 17, 4), times={"tiny-llama": ch01.step_times(tiny, [8, 16], 2, 0, False)},
             prefill_decode={"tiny-llama": ch01.prefill_decode(tiny, [5], 3)}, bytes=ch01.bytes_table(),
             perplexity=ch01.perplexities(tiny, 1, 32))
    ch01.record(m)
    doc = results.read(tmp_path / "results.json")
    assert doc["sections"]["ch01"]["values"]["loop"]["positions_uncached"]["value"] == 17 * 4 + 6
    assert results.get("ch01.step_ms.tiny-llama.T16")["unit"] == "ms"
    assert results.get("ch01.causal.earlier_identical")["value"] is True
    assert results.get("ch01.bidirectional.earlier_median")["value"] > 0
    for fig in doc["sections"]["ch01"]["figures"].values():
        assert (tmp_path / "figures").exists() and fig["path"].endswith(".png")
    assert json.loads((tmp_path / "results.json").read_text()) == doc
    assert torch.get_num_threads() == doc["sections"]["ch01"]["provenance"]["machine"]["torch_threads"]
