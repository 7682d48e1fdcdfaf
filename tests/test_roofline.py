"""lab.roofline: a decode step's bytes and FLOPs, counted from the config, against the model's own weights and
PyTorch's FLOP counter; the bound is the larger of the two times; the experiment's values hold together. The
ceilings themselves are measurements (chapter 3's roofline section), never asserted here."""

import pytest

from lab import results, roofline
from lab.engine import ServingEngine
from lab.models import load
from lab.step_cost import counted_step, profile


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def matrices_read(model) -> int:
    """The oracle: bytes of every weight matrix a decode step multiplies by (the projections and the head; the
    embedding only where it is also the head, since a lookup reads one row a token)."""
    w = model.weights
    head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
    mats = [t for k, t in w.items() if k.endswith("proj.weight")] + [head]
    return sum(t.numel() * t.element_size() for t in mats)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_weight_bytes_are_the_matrices_of_the_model(dtype):
    model = load("tiny-llama", dtype)
    step = roofline.step_model(model.config, batch=3, context=40)
    assert step["weight_bytes"] == matrices_read(model)
    c = model.config
    size = 4 if dtype == "float32" else 2
    assert step["cache_bytes"] == 2 * c.n_layers * c.n_kv_heads * c.head_dim * 40 * 3 * size
    assert step["bytes"] == step["weight_bytes"] + step["cache_bytes"]


@pytest.mark.parametrize("context", [7, 64])
def test_flops_are_what_pytorch_counts_in_a_decode_step(tiny, context):
    total, _ = counted_step(tiny, context)
    assert roofline.step_model(tiny.config, batch=1, context=context)["flops"] == total


def test_the_bound_is_the_slower_of_reading_and_computing(tiny):
    step = {"bytes": 2e9, "flops": 1e9}
    ceilings = {"read_gb_s": 20.0, "flops": {"float32": 100.0}}
    b = roofline.bound(step, ceilings, "float32")
    assert b["memory_s"] == pytest.approx(0.1) and b["compute_s"] == pytest.approx(0.01)
    assert b["bound_s"] == b["memory_s"] and b["bound_by"] == "memory"
    b = roofline.bound({"bytes": 1e6, "flops": 1e12}, ceilings, "float32")
    assert b["bound_by"] == "compute" and b["bound_s"] == pytest.approx(10.0)


def test_machine_measures_positive_ceilings():
    c = roofline.machine(buffer_bytes=16 << 20, matmul=128, rounds=2)
    assert c["read_gb_s"] > 0 and c["copy_gb_s"] > 0 and set(c["flops"]) == {"float32", "bfloat16"}
    assert all(f > 0 for f in c["flops"].values())


def test_experiment_values_hold_together(tiny):
    from lab.experiments import roofline as exp

    ceilings = {"read_gb_s": 10.0, "copy_gb_s": 9.0, "flops": {"float32": 50.0}, "buffer_bytes": 1, "matmul": 1}
    products = roofline.products(tiny.weights, tiny.config, rounds=2)
    fast = ServingEngine(tiny, 8, 16, 16, fast_decode="measure").fast
    m = dict(machine=ceilings, steps={"float32": {2: {16: exp.decode_step(tiny, 2, 16, rounds=2, rows=fast.rows)}}},
             breakdown={"float32": {"products": products, "steps": {16: profile(tiny, 1, 16, steps=2, fast=False)},
                                    "fused": {16: profile(tiny, 1, 16, steps=2)}}},
             config={"float32": tiny.config}, fused_rows={"float32": fast.rows}, fused_tune={"float32": fast.timings})
    v = exp.values(m)
    results.validate({"schema_version": 1, "sections": {"roofline": {   # every leaf as the file's schema wants
        "provenance": results.provenance(mode="quick", manifest="sha256:test"), "values": v}}})
    leaf = v["steps"]["float32"]["b2"]["t16"]
    step = roofline.step_model(tiny.config, 2, 16)
    assert leaf["bound_ms"]["value"] == pytest.approx(step["bytes"] / 10e9 * 1e3)
    assert leaf["fraction"]["value"] == pytest.approx(100 * leaf["bound_ms"]["value"] / leaf["step_ms"]["value"])
    assert leaf["memory_bound"]["value"] is True
    # one sequence's step by part: the parts sum to the step, the products' rate is their bytes over their time
    parts = v["breakdown"]["float32"]["t16"]
    total = sum(parts[k]["value"] for k in ("engine_ms", "attention_ms", "products_ms", "other_ms"))
    assert total == pytest.approx(parts["step_ms"]["value"])
    rate = v["breakdown"]["float32"]["products_gb_s"]["value"]
    assert rate == pytest.approx(products["bytes"] / products["seconds"] / 1e9)
    assert v["breakdown"]["float32"]["products_fraction"]["value"] == pytest.approx(100 * rate / 10.0)
    # the fused step beside it: its one call reads the step's bytes at the rate recorded, the gain is the ratio
    fused = m["breakdown"]["float32"]["fused"][16]
    assert fused["parts"]["attention"] == 0.0                 # inside the one call, not through attend
    assert parts["fused_gb_s"]["value"] == pytest.approx(
        roofline.step_model(tiny.config, 1, 16)["bytes"] / fused["parts"]["forward"] / 1e9)
    assert parts["fused_gain"]["value"] == pytest.approx(parts["step_ms"]["value"] / parts["fused_step_ms"]["value"])
    # the fused step's sizes as measured: the most it takes is the largest size it was no slower at
    tune = v["fused_tune"]["float32"]
    won = [int(b[1:]) for b, t in tune.items() if t["fused_ms"]["value"] <= t["reference_ms"]["value"]]
    assert v["fused_rows"]["float32"]["value"] == max(won, default=0)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_products_read_every_matrix_of_a_step_once(dtype):
    """roofline.products times the projections and the head of one step: its bytes are the matrices a step
    reads (the oracle above), with the model's weights and with the engine's prepacked ones."""
    from lab.models.llama import Prepacked

    model = load("tiny-llama", dtype)
    for weights in (model.weights, Prepacked(model.weights)) if Prepacked.applies(model.weights) else (model.weights,):
        r = roofline.products(weights, model.config, rounds=2)
        assert r["bytes"] == matrices_read(model) and r["seconds"] > 0
