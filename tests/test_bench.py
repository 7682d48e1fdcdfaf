"""lab.bench: what the timers count and in what order they call, checked with a call log and a fake clock.

No test here reads the real clock: lab.bench's `time` is replaced by a clock that moves only when a
timed function (or a setup) says so, so every duration is known exactly and no assertion depends on
how busy the machine is.
"""

import pytest

from lab import bench
from lab.bench import summarize, time_call, time_rounds, time_steps


@pytest.fixture
def clock(monkeypatch, fake_clock):
    monkeypatch.setattr(bench, "time", fake_clock)       # see FakeClock in tests/conftest.py
    return fake_clock


def test_time_rounds_alternates_and_counts(clock):
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    r = time_rounds(fns, warmup=2, rounds=5)
    assert list(r) == ["a", "b"]                               # the order given
    assert calls == ["a", "b"] * 7                             # 2 warm-up rounds, then 5 timed, each in turn
    assert all(s["n"] == 5 for s in r.values())


def test_time_rounds_times_each_function_separately(clock):
    r = time_rounds({"fast": lambda: clock.advance(1), "slow": lambda: clock.advance(10)}, warmup=1, rounds=3)
    assert (r["fast"]["min"], r["fast"]["max"]) == (1, 1)     # the neighbour's 10 s are not charged to it
    assert (r["slow"]["min"], r["slow"]["max"]) == (10, 10)


def test_time_steps_runs_setup_untimed(clock):
    log = []
    r = time_steps(lambda: log.append("setup"), lambda: log.append("step"), warmup=1, reps=3)
    assert log == ["setup", "step"] * 4 and r["n"] == 3
    slow_setup = time_steps(lambda: clock.advance(100), lambda: clock.advance(1), warmup=0, reps=3)
    assert slow_setup["max"] == 1 and slow_setup["n"] == 3    # the setup's 100 s are outside the clock


def test_time_call_honours_min_seconds_and_summarize_reports_quantiles(clock):
    calls = []
    r = time_call(lambda: calls.append(clock.advance(2)), warmup=1, reps=1, min_seconds=7)
    assert r["n"] == 4 and len(calls) == 5                     # 2 s a call: 4 timed calls reach 7 s; 1 warm-up
    assert time_call(lambda: clock.advance(2), warmup=0, reps=3)["n"] == 3  # no minimum: exactly reps
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 100.0 and s["n"] == 5
    assert s["iqr"] == 52.0 - 1.5                              # quartiles 1.5 and 52 (statistics.quantiles, n=4)


def test_time_rounds_runs_setup_before_warmup_too_and_keeps_samples_in_round_order(clock):
    log = []

    def b():                                                   # the k-th call of b takes 10 * k seconds
        log.append("b")
        clock.advance(10 * log.count("b"))

    fns = {"a": lambda: log.append("a") or clock.advance(1), "b": b}
    r = time_rounds(fns, warmup=1, rounds=3, setup=lambda: log.append("setup") or clock.advance(1000), samples=True)
    assert log == ["setup", "a", "setup", "b"] * 4               # a cache cropped before every call, warm-up too
    assert r["a"]["samples"] == [1, 1, 1]
    assert r["b"]["samples"] == [20, 30, 40]                     # rounds 1-3 in order; the warm-up (10 s) left out
    assert "samples" not in time_rounds(fns, warmup=0, rounds=1)["a"]  # only when asked


def test_device_times_on_the_cpu_is_time_call(clock):
    # Off CUDA there are no events to record: device_times times each call on the host clock, warm-up
    # excluded, as time_call does.
    from lab.bench import device_times

    calls = []
    r = device_times(lambda: calls.append(clock.advance(3)), warmup=2, reps=4, device="cpu")
    assert len(calls) == 6 and r["n"] == 4                      # 2 warm-up calls, then 4 timed
    assert (r["median"], r["min"], r["max"]) == (3, 3, 3)     # 3 s of the fake clock per call


def _rounds(**medians):  # a fake step_times row: each variant's samples, three rounds
    return {name: {"samples": list(s), "median": sorted(s)[1]} for name, s in medians.items()}


def test_chapter3_speedup_is_per_round_and_pays_from_finds_the_crossover():
    from lab.experiments.ch03_savings import faster_design, pays_from, speedups

    times = {1: _rounds(uncached=[1.0, 1.0, 1.0], concat=[1.1, 1.2, 1.1], static=[1.2, 1.1, 1.3]),  # slower
             2: _rounds(uncached=[1.0, 1.0, 1.0], concat=[0.9, 0.8, 0.9], static=[0.5, 0.5, 0.5]),
             4: _rounds(uncached=[2.0, 4.0, 2.0], concat=[1.0, 2.0, 1.0], static=[1.0, 1.0, 1.0])}
    sp = speedups(times)
    assert sp[4]["concat"]["median"] == 2.0 and sp[4]["static"]["max"] == 4.0   # paired round by round
    assert pays_from(times, "static") == 2 and pays_from(times, "concat") == 2
    times[4]["static"]["samples"] = [3.0, 3.0, 3.0]                                # slower again at the end
    assert pays_from(times, "static") == "never"
    verdict = {T: r["faster"] for T, r in faster_design(times).items()}
    assert verdict == {1: "neither", 2: "static", 4: "concat"}


def test_chapter3_step_without_attention_keeps_shapes_and_cache():
    import torch

    from lab.cache import StaticCache
    from lab.models import forward_cached, load
    from lab.step_cost import skip_attention

    model = load("tiny-llama")
    cache = StaticCache(model.config, 8)
    ids = torch.tensor([[1, 2, 3]])
    with torch.inference_mode():
        forward_cached(ids, model.weights, model.config, cache)
        cache.attend = skip_attention(cache)
        logits = forward_cached(ids[:, :1], model.weights, model.config, cache)
        del cache.attend
    assert logits.shape == (1, 1, model.config.vocab_size) and cache.length == 4  # the new position is stored
