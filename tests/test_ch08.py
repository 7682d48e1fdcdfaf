"""Chapter 8's measurements, on the tiny model: the step-timed runs against the engine's own generate, the
parts of a profiled step against the whole step, and section ch08 written with its figures.

Oracles: `ServingEngine.generate` (itself tested against per-request greedy decoding in test_serving.py)
for the tokens; the step's own wall time for the profile's parts (they are measured inside it, so they sum
to it exactly, up to the float rounding of a sum: 1e-9 s).
"""

import pytest

from lab import results, step_cost
from lab.cache.paged import StepBatch
from lab.engine import ServingEngine, serving
from lab.experiments import ch08_serving as ch08
from lab.kernels import cpu_kernel_available
from lab.loadgen import random_prompts
from lab.models import checks, llama, load

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


SMALL = dict(prompt=24, output=20, levels=(1, 3), sequential=2, pools=(5, 40), pool_requests=4, long=96,
             chunk=32, decoders=2, shared_system=48, shared_requests=3, profile_batch=3)


def test_run_timed_is_generate_with_a_clock(tiny):
    ps = random_prompts(3, 20, 0, tiny.config.vocab_size)
    want = ServingEngine(tiny, 40, 16, 16).generate(ps, 5, arrivals=[0, 1, 4])
    eng = ServingEngine(tiny, 40, 16, 16)
    r = step_cost.run_timed(eng, ps, 5, arrivals=[0, 1, 4])
    assert r["outputs"] == want
    assert len(r["step_s"]) == eng.stats["steps"] and all(t > 0 for t in r["step_s"])
    first = r["timeline"][2]
    assert first["arrived"] == 4 and first["admitted"][0] >= 4
    assert step_cost.seconds_between(r, 0, eng.stats["steps"] - 1) == pytest.approx(r["seconds"])


def test_the_parts_of_the_experiment_measure_what_they_say(tiny):
    b = ch08.batching(tiny, SMALL)
    assert set(b["batched"]) == {1, 3} and b["batched"][3]["mean_batch"] > 1 and b["sequential"]["tok_s"] > 0
    c = ch08.chunked_prefill(tiny, SMALL)
    assert c["chunked"]["long_chunks"] > 1 and c["whole"]["long_chunks"] == 1
    p = ch08.preemption(tiny, SMALL)
    assert all(r["identical"] for r in p["runs"].values())            # preemption never changes a token
    assert p["runs"][40]["preemptions"] == 0 and p["runs"][40]["computed"] == p["runs"][40]["ideal"]
    small = p["runs"][min(p["runs"])]
    assert small["preemptions"] > 0 and small["computed"] > small["ideal"]   # recomputed what it threw away
    x = ch08.prefix_sharing(tiny, SMALL)
    assert x["identical"] and x["uncached"]["cached"] == 0 and x["cached"]["cached"] > 0
    assert x["cached"]["computed"] + x["cached"]["cached"] == x["uncached"]["computed"]


def test_the_profiled_parts_add_up_to_the_step(tiny):
    r = step_cost.profile(tiny, 3, 20, steps=3, fast=False)       # the reference step: attention timed apart
    assert set(r["parts"]) == {"identity", "schedule", "batch", "attention", "forward"}
    assert all(t >= 0 for t in r["parts"].values()) and r["parts"]["attention"] > 0 and r["parts"]["identity"] > 0
    assert r["step_s"] == pytest.approx(sum(r["parts"].values()), abs=1e-9)
    assert "timed" not in StepBatch.attend.__qualname__    # the class is restored afterwards
    assert serving.owner is checks.owner                  # and the module


def test_the_timeline_run_preempts_and_record_writes_the_section(tiny, tmp_path, monkeypatch):
    monkeypatch.setenv("LAB_RESULTS", str(tmp_path / "results.json"))
    t = ch08.timeline_run(tiny)
    assert t["preemptions"] > 0 and all(r["state"] == "finished" for r in t["timeline"])
    m = dict(settings=ch08.settings(True) | SMALL, manifest=tiny.manifest, threads=1,
             batching=ch08.batching(tiny, SMALL), chunked=ch08.chunked_prefill(tiny, SMALL),
             preemption=ch08.preemption(tiny, SMALL), prefix=ch08.prefix_sharing(tiny, SMALL),
             profile=step_cost.profile(tiny, 3, 20, steps=2), timeline=t, http=None)
    v = ch08.record(m)
    doc = results.read(results.results_path())
    assert doc["sections"]["ch08"]["values"]["timeline"]["preemptions"]["value"] == t["preemptions"]
    assert v["http"]["lab"]["value"] == results.NOT_RUN
    for name in ("timeline", "throughput"):
        assert (results.figures_dir() / f"ch08_{name}.png").stat().st_size > 0


def test_step_costs_runs_the_same_step_four_ways(tiny):
    r = step_cost.step_costs(tiny, 3, 20)
    assert set(r) == {"engine", "unfused", "unpacked", "thread"} and all(x["step_s"] > 0 for x in r.values())
    eng = ServingEngine(tiny, 8, 16, 16)
    assert hasattr(eng.weights, "packed") and eng.weights.packed   # the engine packs float32 Llama weights
    assert eng.weights.block is (llama.fused_block if cpu_kernel_available() else llama.block)
