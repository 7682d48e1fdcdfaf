"""lab.bench: what the timers count and in what order they call, checked with a call log and sleeps."""

import time

from lab.bench import summarize, time_call, time_rounds, time_steps


def test_time_rounds_alternates_and_counts():
    calls = []
    fns = {"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}
    r = time_rounds(fns, warmup=2, rounds=5)
    assert list(r) == ["a", "b"]                               # the order given
    assert calls == ["a", "b"] * 7                             # 2 warm-up rounds, then 5 timed, each in turn
    assert all(s["n"] == 5 for s in r.values())


def test_time_rounds_times_each_function_separately():
    r = time_rounds({"fast": lambda: None, "slow": lambda: time.sleep(0.01)}, warmup=0, rounds=3)
    assert r["slow"]["min"] >= 0.01                            # sleep never returns early
    assert r["fast"]["median"] < r["slow"]["min"]              # the sleep is not charged to its neighbour


def test_time_steps_runs_setup_untimed():
    log = []
    r = time_steps(lambda: log.append("setup"), lambda: log.append("step"), warmup=1, reps=3)
    assert log == ["setup", "step"] * 4 and r["n"] == 3
    slow_setup = time_steps(lambda: time.sleep(0.01), lambda: None, warmup=0, reps=3)
    assert slow_setup["max"] < 0.01                            # the setup's sleep is outside the clock


def test_time_call_honours_min_seconds_and_summarize_reports_quantiles():
    r = time_call(lambda: time.sleep(0.002), warmup=0, reps=1, min_seconds=0.02)
    assert r["n"] >= 2                                         # reps=1 alone would stop after one 2 ms call
    s = summarize([1.0, 2.0, 3.0, 4.0, 100.0])
    assert s["median"] == 3.0 and s["min"] == 1.0 and s["max"] == 100.0 and s["n"] == 5
