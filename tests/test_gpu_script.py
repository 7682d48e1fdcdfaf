"""The GPU script runs its code path on the CPU (--dry-run), and without a GPU records NOT_RUN without
ever overwriting GPU measurements already in the file."""

import os
import subprocess
import sys

import pytest

from lab import results
from lab.experiments import gpu


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


def test_without_cuda_records_not_run(results_file, monkeypatch):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    assert gpu.run() is None
    for key in ("ch03_gpu.step_ms", "ch05_gpu.bandwidth", "ch05_gpu.kernel_over_sdpa", "ch05_gpu.int8_bandwidth",
                "ch05_gpu.int8_over_float"):
        leaf = results.get(key)
        assert leaf["value"] == "NOT_RUN" and "CUDA" in leaf["reason"], key


def test_not_run_never_overwrites_gpu_measurements(results_file, monkeypatch):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    measured = {"step_ms": {"smollm2": {"T16": {"static": results.value(9.0, "ms")}}}}
    results.write_section("ch03_gpu", measured, results.provenance())
    gpu.run()
    assert results.get("ch03_gpu.step_ms.smollm2.T16.static")["value"] == 9.0
