"""The GPU script (lab/experiments/gpu.py), with the measurements it runs from the library (lab.kernel_bench,
lab.serving_bench), without a GPU: its --dry-run runs every part's code on the CPU
(the kernels in Triton's interpreter, chapter 8's load on the tiny model); the book renders whether the GPU
sections hold that run's measurements or the NOT_RUN values of a machine without a GPU, which carry the
same keys; the timed kernel calls read nothing back to the host; a spent time limit or a failing part
records NOT_RUN; a CPU-only run never overwrites GPU measurements."""

import json
import math
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest

from lab import kernel_bench, kernels, loadgen, results, serving_bench, step_cost
from lab.book import render
from lab.experiments import gpu
from lab.models import load
from lab.peers import vllm_gpu

# the dry run's sections, and the sections of a GPU run they stand for
DRY = {"gpu_dryrun": "ch03_gpu", "gpu_dryrun_ch05": "ch05_gpu", "gpu_dryrun_ch08": "ch08_gpu",
       "gpu_dryrun_ch11": "ch11_gpu"}
GPU_CHAPTERS = ("ch03_savings", "ch05_paged", "ch07_compress", "ch08_serving")   # the chapters citing them
BOOK, NOTEBOOKS = results.REPO_ROOT / "book", results.REPO_ROOT / "notebooks"


@pytest.fixture
def results_file(tmp_path, monkeypatch):
    path = tmp_path / "results.json"
    monkeypatch.setenv("LAB_RESULTS", str(path))
    return path


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """`python -m lab.experiments.gpu --dry-run`, once for the module, in a fresh process as a reader runs it
    (the kernels run in Triton's interpreter, which fails in a process where an earlier test imported
    torch._dynamo: see lab/kernels/triton_paged.py). Returns the results document it wrote."""
    path = tmp_path_factory.mktemp("dry-run") / "results.json"
    done = subprocess.run([sys.executable, "-m", "lab.experiments.gpu", "--dry-run"], capture_output=True, text=True,
                          cwd=results.REPO_ROOT, env=dict(os.environ, LAB_RESULTS=str(path)), timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return results.read(path)


@pytest.mark.slow  # over 8 s: `make test-slow`
def test_dry_run_measures_on_cpu(dry_run):
    sections = dry_run["sections"]
    assert set(sections) == set(DRY)                           # never a GPU section
    values = sections["gpu_dryrun"]["values"]
    step = values["sweep"]["tiny-llama"]["T64"]
    assert step["uncached"]["value"] > 0 and step["static"]["value"] > 0
    assert values["step_ms"]["value"] == step["static"]["value"]      # the headline: the longest context
    assert values["memory"]["tiny-llama"]["static"]["B2"]["cache_mib"]["value"] > 0
    ch05 = sections["gpu_dryrun_ch05"]["values"]
    case = ch05["sweep"]["B2"]["T40"]                          # the kernels, interpreted
    assert case["kernel_ms"]["value"] > 0 and case["bandwidth_gb_s"]["value"] > 0
    # The INT8 kernel beside it: codes (1 byte) and one float32 scale per token per kv head, batch 2, 40
    # positions, 2 kv heads, head_dim 16, keys and values.
    assert case["int8_kernel_ms"]["value"] > 0 and case["int8_over_float"]["value"] > 0
    assert case["int8_bandwidth_gb_s"]["bytes"] == 2 * 2 * 40 * 2 * (16 + 4)
    # each kernel matched its reference (the tolerance: lab/kernel_bench.py RTOL, ATOL)
    assert case["max_abs_error"]["within_tolerance"] and case["int8_max_abs_error"]["within_tolerance"]
    check_serving_dry_run(dry_run)
    check_tiers_dry_run(dry_run)


@pytest.mark.slow  # over 8 s: `make test-slow`
def test_measured_run_writes_every_value_the_book_cites(dry_run):
    # Regression: a measured run wrote `ch05_gpu.bandwidth` and `ch03_gpu.step_ms` as groups of shapes, which
    # the manuscript reads as values, and never wrote `ch05_gpu.int8_bandwidth`, which chapter 7 cites.
    filled = {"sections": {DRY[name]: section for name, section in dry_run["sections"].items()}}
    cited = {key for chapter in GPU_CHAPTERS for key, _ in render.references((BOOK / f"{chapter}.md").read_text())
             if key.split(".")[0] in DRY.values()}
    assert {"ch03_gpu.step_ms", "ch05_gpu.bandwidth", "ch05_gpu.int8_bandwidth"} <= cited
    on_the_cpu = ("a CPU run has no CUDA allocator", "no peak bandwidth is known for the CPU", "vLLM")
    for key in sorted(cited):
        leaf = results.lookup(filled, key)                    # a value, not a group
        assert leaf["value"] != results.NOT_RUN or any(why in leaf["reason"] for why in on_the_cpu), key


def check_serving_dry_run(doc):
    """Chapter 8's part of the dry run: the engine at every level, the sequential loop, their ratio, and vLLM
    NOT_RUN with its reason."""
    v = gpu.SERVE_DRY
    section = doc["sections"]["gpu_dryrun_ch08"]
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
        assert values["speedups"][f"C{C}"]["value"] > 0, C
    # four requests at once share their steps (the point of batching)
    assert values["engine"]["C4"]["mean_batch"]["value"] > 1
    assert values["output_tok_s"]["value"] == values["engine"]["C4"]["output_tok_s"]["value"]  # the headline
    sequential = values["sequential"]
    assert sequential["output_tok_s"]["value"] > 0 and sequential["output_tok_s"]["requests"] == v["sequential"]
    assert sequential["output_tokens"]["value"] == sum(r.max_tokens for r in requests[:v["sequential"]])
    assert values["preemptions"]["value"] == 0               # the pool holds every request at once
    vllm = values["vllm"]["output_tok_s"]
    assert vllm["value"] == "NOT_RUN" and vllm["reason"] == "a dry run on the CPU never starts vLLM"
    assert not prov["decode_attention"].startswith("Triton") and prov["engine"]["prefix_caching"] is False
    assert prov["run"].startswith("dry run")


def check_tiers_dry_run(doc):
    """Chapter 11's part of the dry run: no vLLM on the CPU, so every tier NOT_RUN with that reason, the trace
    and Dynamo's commands in the provenance."""
    section = doc["sections"]["gpu_dryrun_ch11"]
    values, prov = section["values"], section["provenance"]
    for mode in gpu.TIERS["modes"]:
        leaf = values["tiers"][mode]["later_turn_ttft_ms"]
        assert leaf["value"] == "NOT_RUN" and leaf["reason"] == "a dry run on the CPU never starts vLLM", mode
    assert values["seconds"]["value"] >= 0
    assert prov["trace"]["conversations"] == gpu.TIERS_DRY["conversations"]
    assert "--router-mode kv" in prov["dynamo_commands"] and prov["run"].startswith("dry run")


@pytest.mark.slow  # over 8 s: `make test-slow`
def test_not_run_writes_the_keys_a_measured_run_writes(dry_run, results_file, monkeypatch):
    # Regression: a run without a GPU wrote a handful of NOT_RUN values (`ch05_gpu.bandwidth`, ...) where a
    # measured run writes a tree of shapes; a page that read one of them broke on the other. Here a run
    # without CUDA, under the dry run's settings, must write exactly the keys the dry run measured.
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    dry = gpu.settings(True)
    monkeypatch.setattr(gpu, "settings", lambda dry_run=False: {**dry, "device": "cuda"})
    assert gpu.run() is None
    blank = results.read(results_file)["sections"]
    for name, real in DRY.items():
        section = blank.get(name) or blank[real]    # under the settings' section (or the GPU's, if ignored)
        keys = lambda sec: set(results.leaf_keys({"sections": {"x": sec}}))
        assert keys(section) == keys(dry_run["sections"][name]), name


@pytest.fixture(scope="module")
def committed_problems():
    """What `lab.book --check` finds with the committed results (tests/test_book.py requires none): the
    problems a GPU section's values would add are the others."""
    return render.check(BOOK, NOTEBOOKS, results.COMMITTED)


def added_problems(problems: list, path: Path, committed: list) -> list:
    """The problems of a check against the results at `path` that the committed results do not have. A missing
    value's message goes on with the file it read and the keys that file holds, so only what comes before
    the file's name is compared."""
    seen = {c.split(f" in {results.COMMITTED}")[0] for c in committed}
    return [p for p in problems if p.split(f" in {path}")[0] not in seen]


def with_gpu_sections(tmp_path, sections: dict) -> Path:
    """A copy of the committed results.json with `sections` in place of its own, in tmp_path, the committed
    figures beside it (the renderer takes figures from beside the results file)."""
    doc = json.loads(results.COMMITTED.read_text())
    doc["sections"].update(sections)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(doc))
    (tmp_path / "figures").symlink_to(results.FIGURES, target_is_directory=True)
    return path


@pytest.mark.slow  # over 8 s: `make test-slow`
def test_a_measured_run_renders_the_book(dry_run, committed_problems, tmp_path):
    # Every GPU section of the committed results replaced by the dry run's measurements (labelled a dry
    # run in its provenance, written to a temporary file): the book renders with the same checks as
    # `lab.book --check`, and the GPU references read as well-formed prose (tests/test_book.py's checks).
    import test_book as prose  # tests/ is on the path, as for tests/servers.py

    sections = {}
    for name, real in DRY.items():
        section = json.loads(json.dumps(dry_run["sections"][name]))
        section["provenance"]["run"] = f"dry run of lab.experiments.gpu, standing for {real} in a test"
        sections[real] = section
    path = with_gpu_sections(tmp_path, sections)
    problems = render.check(BOOK, NOTEBOOKS, path)
    assert added_problems(problems, path, committed_problems) == []
    doc = results.read(path)
    for chapter in GPU_CHAPTERS:
        if any(p.startswith(f"book/{chapter}.md") for p in committed_problems):
            continue                                  # it does not render with any results: test_book says why
        prose.test_rendered_prose_has_no_unit_followed_by_a_noun(doc, chapter)
        prose.test_rendered_prose_does_not_repeat_a_unit(doc, chapter)
        prose.test_rendered_values_do_not_round_to_zero(doc, chapter)


def test_a_run_without_a_gpu_renders_the_book(committed_problems, tmp_path, monkeypatch):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    path = with_gpu_sections(tmp_path, {})
    doc = json.loads(path.read_text())
    for real in DRY.values():
        doc["sections"].pop(real, None)           # the script writes them afresh
    path.write_text(json.dumps(doc))
    monkeypatch.setenv("LAB_RESULTS", str(path))
    gpu.run()
    assert results.get("ch05_gpu.bandwidth")["value"] == results.NOT_RUN
    problems = render.check(BOOK, NOTEBOOKS, path)
    assert added_problems(problems, path, committed_problems) == []


def fake_kernels(monkeypatch, clock=None):
    """Both Triton kernels replaced by their PyTorch references (so no kernel runs in this process), each
    call recorded as (kernel, check_values); with a clock, every call advances it by one second."""
    calls = []

    def float_kernel(q, k_pool, v_pool, block_tables, lengths, scale=None, check_values=True):
        calls.append(("float", check_values))
        if clock:
            clock.advance(1)
        return kernels.paged_attention_reference(q, k_pool, v_pool, block_tables, lengths, scale, check_values=False)

    def int8_kernel(q, k_codes, v_codes, k_scale, v_scale, block_tables, lengths, scale=None, check_values=True):
        calls.append(("int8", check_values))
        return kernels.paged_attention_int8_reference(q, k_codes, v_codes, k_scale, v_scale, block_tables, lengths,
                                                      scale, check_values=False)

    for name, fake in (("paged_attention", float_kernel), ("paged_attention_int8", int8_kernel)):
        monkeypatch.setattr(kernels, name, fake)
        monkeypatch.setattr(kernel_bench, name, fake)
    return calls


def dry_grid(s, deadline=math.inf) -> dict:
    """lab.kernel_bench.kernel_bandwidth over the grid of settings s, as measure_ch05 runs it."""
    return kernel_bench.kernel_bandwidth(**s["kernel"], device=s["device"], deadline=deadline)


def test_timed_kernel_calls_read_nothing_back(monkeypatch):
    # Regression: every timed call ran the kernels' value checks (check_values=True), which read the lengths
    # and block tables back to the host: one synchronisation per call inside the timing. Only the check
    # against the reference, once per case and kernel, may read them.
    calls = fake_kernels(monkeypatch)
    dry_grid(gpu.settings(True))
    checked = [c for c in calls if c[1]]
    # the dry run's grid: batches 1 and 2 at 40 positions, two kernels, so at most 4 checked calls
    assert len(checked) <= 4 and len(calls) - len(checked) >= 4, calls


def test_kernel_inputs_are_drawn_on_the_device(monkeypatch):
    # Regression: every case drew its keys and values with torch.randn on the host and copied them to the
    # GPU, 21 GB of host memory for the largest case. Every draw must name the device the case runs on.
    fake_kernels(monkeypatch)
    draws, randn = [], kernel_bench.torch.randn

    def spy(*shape, **kwargs):
        draws.append(kwargs.get("device"))
        return randn(*shape, **kwargs)

    monkeypatch.setattr(kernel_bench.torch, "randn", spy)
    s = gpu.settings(True)
    dry_grid(s)
    device = kernel_bench.torch.device(s["device"])
    assert draws and all(d is not None and kernel_bench.torch.device(d) == device for d in draws), draws


def test_inputs_hold_the_same_keys_paged_and_contiguous():
    # The contiguous copy SDPA reads is the paged one gathered through the block tables.
    k = gpu.settings(True)["kernel"]
    page = k["page_size"]
    x = kernel_bench.case_inputs(2, 40, k["heads"], k["head_dim"], k["dtype"], page, device="cpu")
    for pool, contiguous in ((x["k_pool"], x["k"]), (x["v_pool"], x["v"])):
        for b in range(2):
            for t in (0, 15, 16, 39):
                page_id = int(x["tables"][b, t // page])
                assert kernel_bench.torch.equal(contiguous[b, :, t], pool[page_id, t % page]), (b, t)
    assert sorted(x["tables"].flatten().tolist()) == list(range(2 * math.ceil(40 / page)))   # a permutation


def test_a_spent_time_limit_records_not_run_under_the_same_keys(monkeypatch, fake_clock):
    # The kernel sweep stops at its deadline: the case measured before it keeps its values, the rest are
    # NOT_RUN with the reason, and the keys are those of a run that measured everything.
    fake_kernels(monkeypatch, fake_clock)
    monkeypatch.setattr(kernel_bench, "time", fake_clock)
    s = gpu.settings(True)
    cases = dry_grid(s, deadline=0.5)                       # the first case's kernel calls pass it
    assert list(cases) == [(2, 40)]                         # the largest batch first
    values = gpu.ch05_values(s, dict(cases=cases, gpu="NVIDIA H200", seconds=3.0, why=gpu.spent(30)), "")
    assert values["sweep"]["B2"]["T40"]["kernel_ms"]["value"] > 0
    assert values["sweep"]["B1"]["T40"]["kernel_ms"]["reason"] == gpu.spent(30)
    assert values["bandwidth"]["note"] == "batch 2, context 40"
    assert values["bandwidth_fraction"]["value"] == pytest.approx(
        values["bandwidth"]["value"] * 1e9 / 4.8e12 * 100)   # the H200's peak, 4.8 TB/s
    blank = gpu.not_run_values(s, "no GPU")[s["sections"]["ch05"]]
    keys = lambda v: set(results.leaf_keys({"sections": {"x": {"values": v}}}))
    assert keys(values) == keys(blank)


def test_step_sweep_stops_at_its_deadline(monkeypatch, fake_clock):
    # Chapter 3's sweep on the GPU: the longest context first, each model loaded in turn, and nothing
    # started once the deadline has passed (the step under way finishes). Each step takes 1 s of the clock.
    calls, loaded = [], []

    def step_times(model, contexts, rounds, warmup, progress):
        calls.append((model.name, *contexts))
        fake_clock.advance(1)
        return {contexts[0]: f"row {model.name} {contexts[0]}"}

    monkeypatch.setattr(step_cost, "step_times", step_times)
    monkeypatch.setattr(step_cost, "perf_counter", fake_clock.perf_counter)
    load = lambda name: loaded.append(name) or types.SimpleNamespace(name=name, manifest=f"manifest {name}")
    steps, manifests = step_cost.step_sweep({"a": [16, 64], "b": [16]}, load, deadline=0.5)
    assert calls == [("a", 64)] and loaded == ["a"]
    assert steps == {("a", 64): "row a 64"} and manifests == {"a": "manifest a"}
    steps, _ = step_cost.step_sweep({"a": [16, 64], "b": [16]}, load)      # no deadline: every case
    assert list(steps) == [("a", 64), ("a", 16), ("b", 16)]


def test_a_failing_part_records_not_run_and_keeps_the_others(results_file, monkeypatch):
    def fails(s, gpu_name):
        raise MemoryError("out of memory in a test")

    measured = lambda s, gpu_name: dict(seconds=1.0, why="not measured in this test", extra={})
    parts = {"ch03": (measured, gpu.ch03_values), "ch05": (fails, gpu.ch05_values), "ch08": (measured, gpu.ch08_values)}
    monkeypatch.setattr(gpu, "PARTS", parts)
    with pytest.raises(RuntimeError, match="gpu_dryrun_ch05: MemoryError: out of memory in a test"):
        gpu.run(dry_run=True)
    assert results.get("gpu_dryrun.seconds")["value"] == 1.0
    assert results.get("gpu_dryrun_ch08.seconds")["value"] == 1.0
    failed = results.get("gpu_dryrun_ch05.bandwidth")
    assert failed["value"] == results.NOT_RUN and "MemoryError: out of memory in a test" in failed["reason"]


def test_tier_trace_outgrows_the_gpu_pool():
    # Chapter 11's trace: every conversation's turn r before any turn r + 1, each turn's prompt extending the
    # last one of its conversation, and more prefix tokens than the GPU's pool holds, so that a tier below
    # has something to bring back.
    t = gpu.TIERS
    trace = gpu.tier_trace(t)
    assert [r for _, r, _ in trace] == sorted(r for _, r, _ in trace)
    last = {}
    for c, r, ids in trace:
        assert len(ids) == t["system"] + (r + 1) * t["turn_tokens"]
        assert c not in last or ids[:len(last[c])] == last[c]
        last[c] = ids
    assert sum(len(ids) for ids in last.values()) > 2 * t["num_gpu_blocks"] * t["block_size"]
    assert trace == gpu.tier_trace(t)                                   # the same every run (seed 0)


def test_tier_values_have_the_same_keys_run_or_not():
    # Chapter 11's section, measured (a fake run of each mode, LMCache failing) or not: the same keys; the
    # ratios are the later turns' median times to first token over the baseline's.
    s = gpu.settings(False)
    turns = [r for _, r, _ in gpu.tier_trace(s["tiers"])]

    def run(ttft_later, cached):
        return dict(vllm="0.0-test", lmcache=None, results=[
            dict(ttft_s=0.5 if r == 0 else ttft_later, prompt_tokens=100, num_cached_tokens=0 if r == 0 else cached)
            for r in turns])

    m = dict(runs={"baseline": run(0.4, 0), "native": run(0.1, 90)}, whys={"lmcache": "lmcache failed in a test"},
             seconds=5.0, why="not measured in this test", extra={})
    ran = gpu.ch11_values(s, m, "")
    assert ran["native_over_baseline"]["value"] == pytest.approx(0.25)
    assert ran["tiers"]["native"]["later_turn_cached_percent"]["value"] == pytest.approx(90.0)
    assert ran["tiers"]["baseline"]["cached_percent"]["value"] == 0.0
    assert ran["lmcache_over_baseline"]["reason"] == "lmcache failed in a test"
    dynamo = ran["dynamo"]["kv_router"]
    assert dynamo["value"] == "NOT_RUN" and "--router-mode kv" in dynamo["reason"]
    blank = gpu.not_run_values(s, "no GPU")["ch11_gpu"]
    keys = lambda v: set(results.leaf_keys({"sections": {"x": {"values": v}}}))
    assert keys(ran) == keys(blank)


def test_vllm_values_have_the_same_keys_run_or_not():
    # vLLM runs only on a GPU with its CUDA build; its values and their ratio to the engine's keep one shape.
    run = {"rate": 300.0, "requests": 4, "run": {"output_tokens": 600, "seconds": 2.0, "vllm": "0.0-test"}}
    ran = serving_bench.vllm_values(run, results.value(100.0, "tok/s"))
    assert ran["output_tok_s"]["value"] == 300.0 and ran["over_engine"]["value"] == 3.0
    skipped = serving_bench.vllm_values({"why": "no CUDA build of vLLM here"}, results.value(100.0, "tok/s"))
    assert set(ran) == set(skipped) and skipped["over_engine"]["reason"] == "no CUDA build of vLLM here"


def test_vllm_run_says_why_it_did_not_run(monkeypatch):
    # vLLM starts only with a CUDA build at hand and a minute left of the run's time; a failure is a reason.
    requests = loadgen.workload(2, rate=math.inf, seed=0, max_prompt=8, max_output=4)
    monkeypatch.setattr(vllm_gpu, "find_vllm_cuda", lambda: (None, "no CUDA build of vLLM here"))
    assert serving_bench.vllm_run(requests, 600) == {"why": "no CUDA build of vLLM here"}
    monkeypatch.setattr(vllm_gpu, "find_vllm_cuda", lambda: ("/env/bin/python", "vLLM 0.0 in /env"))
    assert serving_bench.vllm_run(requests, 59)["why"].endswith("left 59 s, too few to start it")

    def fails(python, model_dir, prompts, news, **kwargs):
        assert prompts == [r.prompt for r in requests] and news == [r.max_tokens for r in requests]
        raise RuntimeError("CUDA out of memory in a test")

    monkeypatch.setattr(serving_bench, "smollm2_folder", lambda: Path("/models/smollm2"))
    monkeypatch.setattr(vllm_gpu, "vllm_throughput", fails)
    why = serving_bench.vllm_run(requests, 600)["why"]
    assert why == "vLLM 0.0 in /env failed to run: CUDA out of memory in a test"


def test_find_vllm_cuda_says_why_not():
    # this environment has no vllm module; a missing environment is named as missing
    python, why = vllm_gpu.find_vllm_cuda([Path(sys.executable), Path("/nonexistent/bin/python")])
    assert python is None
    assert "no vllm module" in why and "/nonexistent/bin/python: missing" in why and "CUDA" in why


def test_without_cuda_records_not_run(results_file, monkeypatch, capsys):
    monkeypatch.setattr(gpu.torch.cuda, "is_available", lambda: False)
    assert gpu.run() is None
    assert "python -m dynamo.frontend --http-port 8000 --router-mode kv" in capsys.readouterr().out
    assert "--router-mode kv" in results.get("ch11_gpu.dynamo.kv_router")["reason"]
    for key in ("ch03_gpu.step_ms", "ch03_gpu.sweep.smollm2.T2048.static", "ch05_gpu.bandwidth",
                "ch05_gpu.kernel_over_sdpa", "ch05_gpu.int8_bandwidth", "ch05_gpu.int8_over_float",
                "ch05_gpu.sweep.B64.T32768.kernel_ms", "ch08_gpu.output_tok_s", "ch08_gpu.engine.C256.output_tok_s",
                "ch08_gpu.sequential.output_tok_s", "ch08_gpu.speedup", "ch08_gpu.vllm.output_tok_s",
                "ch11_gpu.native_over_baseline", "ch11_gpu.lmcache_over_baseline",
                "ch11_gpu.tiers.native.later_turn_ttft_ms", "ch11_gpu.tiers.lmcache.cached_percent"):
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
