"""The GPU script runs its code path on the CPU (--dry-run, chapter 8's serving load included), and without a
GPU records NOT_RUN without ever overwriting GPU measurements already in the file."""

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lab import loadgen, results
from lab.experiments import gpu
from lab.models import load
from lab.peers import vllm_gpu


@pytest.fixture
def results_file(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    monkeypatch.setenv("LAB_RESULTS", str(path))
    return path


def test_dry_run_measures_on_cpu(results_file):
    # A fresh process, as a reader runs it: the kernel runs under Triton's interpreter, which fails in a
    # process where an earlier test imported torch._dynamo (see lab/kernels/triton_paged.py).
    done = subprocess.run([sys.executable, "-m", "lab.experiments.gpu", "--dry-run"], capture_output=True, text=True,
                          cwd=results.REPO_ROOT, env=dict(os.environ), timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    doc = results.read(results_file)
    values = doc["sections"]["gpu_dryrun"]["values"]
    assert "gpu_dryrun" in doc["sections"] and "ch03_gpu" not in doc["sections"]
    step = values["step_ms"]["tiny-llama"]["T64"]
    assert step["uncached"]["value"] > 0 and step["static"]["value"] > 0
    assert values["memory"]["tiny-llama"]["static"]["B2"]["cache_mib"]["value"] > 0
    kernel = doc["sections"]["gpu_dryrun_ch05"]["values"]["bandwidth"]["B2"]["T40"]  # the kernel, interpreted
    assert kernel["kernel_ms"]["value"] > 0 and kernel["bandwidth_gb_s"]["value"] > 0
    # The INT8 kernel beside it: codes (1 byte) and one float32 scale per token per kv head, batch 2, 40
    # positions, 2 kv heads, head_dim 16, keys and values.
    assert kernel["int8_kernel_ms"]["value"] > 0 and kernel["int8_over_float"]["value"] > 0
    assert kernel["int8_bandwidth_gb_s"]["bytes"] == 2 * 2 * 40 * 2 * (16 + 4)
    check_serving_dry_run(doc)


def check_serving_dry_run(doc):
    """Chapter 8's part of the dry run: the engine at every level, the sequential loop, their ratio, and vLLM
    NOT_RUN with its reason (no CUDA build of vLLM runs on this CPU)."""
    v = gpu.SERVE_DRY
    assert "ch08_gpu" not in doc["sections"]
    section = doc["sections"][v["section"]]
    values, prov = section["values"], section["provenance"]
    # the same requests, drawn again: every answer runs to its length (no eos stop)
    requests = loadgen.workload(max(v["levels"]), rate=math.inf, seed=0, vocab=load(v["model"]).config.vocab_size,
                                max_prompt=v["max_prompt"], max_output=v["max_output"])
    for C in v["levels"]:
        row = values["engine"][f"C{C}"]
        assert row["output_tok_s"]["value"] > 0 and row["wall_s"]["value"] > 0, C
        assert row["output_tokens"]["value"] == sum(r.max_tokens for r in requests[:C]), C
        assert row["prompt_tokens"]["value"] == sum(len(r.prompt) for r in requests[:C]), C
        assert 1 <= row["mean_batch"]["value"] <= C, C
        assert row["steps"]["value"] >= max(r.max_tokens for r in requests[:C]), C  # one new token a step at most
        assert values["speedup"][f"C{C}"]["value"] > 0, C
    # four requests at once share their steps (the point of batching)
    assert values["engine"]["C4"]["mean_batch"]["value"] > 1
    sequential = values["sequential"]
    assert sequential["output_tok_s"]["value"] > 0 and sequential["output_tok_s"]["requests"] == v["sequential"]
    assert sequential["output_tokens"]["value"] == sum(r.max_tokens for r in requests[:v["sequential"]])
    assert values["preemptions"]["value"] == 0               # the pool holds every request at once
    vllm = values["vllm"]["output_tok_s"]
    assert vllm["value"] == "NOT_RUN" and "vLLM" in vllm["reason"] and "CUDA" in vllm["reason"]
    assert prov["decode_attention"].startswith("paged_attention_cpu") and prov["engine"]["prefix_caching"] is False
    # a GPU-less run writes its NOT_RUN values under the very keys a measured run writes
    blank = {"sections": {"x": {"values": gpu.not_run_serving("r", v["levels"])}}}
    measured = {"sections": {"x": section}}
    assert set(results.leaf_keys(blank)) <= set(results.leaf_keys(measured))


def test_find_vllm_cuda_says_why_not():
    # this environment has no vllm module; a missing environment is named as missing
    python, why = vllm_gpu.find_vllm_cuda([Path(sys.executable), Path("/nonexistent/bin/python")])
    assert python is None
    assert "no vllm module" in why and "/nonexistent/bin/python: missing" in why and "CUDA" in why


def test_without_cuda_records_not_run(results_file, monkeypatch):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    assert gpu.run() is None
    for key in ("ch03_gpu.step_ms", "ch05_gpu.bandwidth", "ch05_gpu.kernel_over_sdpa", "ch05_gpu.int8_bandwidth",
                "ch05_gpu.int8_over_float", "ch08_gpu.engine.C1.output_tok_s", "ch08_gpu.engine.C256.output_tok_s",
                "ch08_gpu.sequential.output_tok_s", "ch08_gpu.speedup.C256", "ch08_gpu.vllm.output_tok_s"):
        leaf = results.get(key)
        assert leaf["value"] == "NOT_RUN" and "CUDA" in leaf["reason"], key


def test_not_run_never_overwrites_gpu_measurements(results_file, monkeypatch):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    measured = {"step_ms": {"smollm2": {"T16": {"static": results.value(9.0, "ms")}}}}
    results.write_section("ch03_gpu", measured, results.provenance())
    served = {"engine": {"C256": {"output_tok_s": results.value(5000.0, "tok/s")}},
              "vllm": {"output_tok_s": results.not_run("no CUDA build of vLLM", "tok/s")}}
    results.write_section("ch08_gpu", served, results.provenance())
    gpu.run()
    assert results.get("ch03_gpu.step_ms.smollm2.T16.static")["value"] == 9.0
    assert results.get("ch08_gpu.engine.C256.output_tok_s")["value"] == 5000.0
    assert results.get("ch08_gpu.vllm.output_tok_s")["reason"] == "no CUDA build of vLLM"
