"""The load generator (lab/loadgen.py): Poisson workloads, streamed requests timed token by token, summaries.

Oracles: the exponential distribution's moments for the arrival gaps; percentiles worked out by hand and
numpy's percentile; the engine's own count of what it batched, and each request's max_tokens, for a run
against the lab's server (uvicorn in a thread on a free port, as tests/test_serve.py serves it). One test
starts `python -m lab.serve` as a process through `lab_server` and stops it; vLLM's server is tested by
`make test-peers` (marked peers and slow; it skips where .venv-vllm does not exist).
"""

import itertools
import math
import socket
import statistics
import time
import urllib.request

import numpy as np
import pytest
from servers import serving

from lab.data import synthetic_lengths
from lab.engine import ServingEngine
from lab.loadgen import (
    VLLM_BIN,
    VLLM_FIELDS,
    Record,
    Request,
    percentile,
    run_load,
    summarize,
    vllm_server,
    workload,
)
from lab.models import load
from lab.serve.process import lab_server

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


# ---- workloads ----
def test_workload_is_deterministic_and_within_its_bounds():
    a = workload(50, rate=3.0, seed=7, vocab=320, max_prompt=40, max_output=30)
    assert a == workload(50, 3.0, 7, vocab=320, max_prompt=40, max_output=30)
    assert a != workload(50, 3.0, 8, vocab=320, max_prompt=40, max_output=30)
    inputs, outputs = synthetic_lengths("ShareGPT", 50, 7)
    assert [len(r.prompt) for r in a] == [min(int(n), 40) for n in inputs]            # clipped, not redrawn
    assert [r.max_tokens for r in a] == [min(int(n), 30) for n in outputs]
    assert all(0 <= t < 320 for r in a for t in r.prompt)
    assert a[0].arrival == 0 and all(x.arrival <= y.arrival for x, y in itertools.pairwise(a))
    faster = workload(50, 30.0, 7, vocab=320, max_prompt=40, max_output=30)             # other arrivals, same prompts
    assert [r.prompt for r in faster] == [r.prompt for r in a] and faster[-1].arrival < a[-1].arrival
    assert {r.arrival for r in workload(5, math.inf, 0)} == {0.0}                       # all at once


@pytest.mark.parametrize("field", ["max_prompt", "max_output"])
def test_workload_refuses_zero_length_bound(field):
    """max_prompt=0 drew empty prompts and max_output=0 requests for no tokens, a load that measures nothing
    (clipping to [1, bound] cannot hold); the workload refuses them, with a ValueError subclass naming the field."""
    with pytest.raises(ValueError, match=field) as e:
        workload(4, rate=1.0, **{field: 0})
    from lab.loadgen import WorkloadError  # imported here: old main lacks the name, not the check

    assert isinstance(e.value, WorkloadError) and e.value.field == field
    with pytest.raises(WorkloadError, match="n must be"):
        workload(0, rate=1.0)
    with pytest.raises(WorkloadError, match="rate must be"):
        workload(4, rate=0.0)


def test_arrival_gaps_are_exponential_with_mean_one_over_rate():
    """1,999 gaps at 5 requests/s: the mean's standard error is 2.2 % of 0.2 s and the standard deviation's
    about 3.2 %, so 10 % and 15 % are more than four standard errors; an exponential has std == mean and
    half its mass below mean * ln 2."""
    arrivals = [r.arrival for r in workload(2000, rate=5.0, seed=0, dataset="Alpaca")]
    gaps = np.diff(arrivals)
    assert gaps.mean() == pytest.approx(1 / 5, rel=0.10)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.15)
    assert (gaps < 0.2 * math.log(2)).mean() == pytest.approx(0.5, abs=0.05)


# ---- summaries ----
def done(sent, times, end=None):
    return Record(0.0, len(times), sent=sent, token_times=times, status=200, done=True, end=end or times[-1])


def test_summarize_by_hand():
    records = [done(0.0, [0.5, 0.6, 0.8]),                           # TTFT 0.5, gaps 0.1 and 0.2
               done(0.2, [1.2, 1.3]),                                # TTFT 1.0, gap 0.1
               Record(0.4, 8, sent=0.4, status=500, error="boom", end=0.5)]
    s = summarize(records, slo_ttft=0.8, slo_itl=0.25)
    assert (s["requests"], s["completed"], s["failed"], s["good"], s["output_tokens"]) == (3, 2, 1, 1, 5)
    assert s["duration_s"] == pytest.approx(1.3)                     # first sent (0.0) to last end (1.3)
    assert s["throughput_tok_s"] == pytest.approx(5 / 1.3) and s["request_throughput"] == pytest.approx(2 / 1.3)
    assert s["goodput"] == pytest.approx(1 / 1.3)                    # the second misses the TTFT objective
    assert s["ttft_median_s"] == pytest.approx(0.75) and s["ttft_p99_s"] == pytest.approx(0.5 + 0.5 * 0.99)
    assert s["itl_median_s"] == pytest.approx(0.1) and s["itl_p99_s"] == pytest.approx(0.1 + 0.1 * 0.98)
    assert summarize(records, slo_ttft=0.8, slo_itl=0.15)["good"] == 0   # the first stalls 0.2 s once
    assert summarize(records[2:], 1, 1)["ttft_median_s"] is None      # nothing completed: no latency


def test_percentile_matches_numpy():
    xs = list(np.random.default_rng(0).exponential(size=37))
    for q in (0, 1, 50, 90, 99, 100):
        assert percentile(xs, q) == pytest.approx(np.percentile(xs, q))
    assert percentile([], 50) is None


# ---- sending ----
@pytest.mark.parametrize("url", ["http://example.com:8000", "https://127.0.0.1:8000", "http://10.0.0.1",
                                 "http://127.0.0.1.example.com"])
def test_a_host_not_on_this_machine_is_refused(url):
    with pytest.raises(ValueError, match="127.0.0.1 or http://localhost"):
        run_load(url, [Request(0.0, [1, 2], 2)], "tiny-llama", timeout_s=1)


def test_a_run_ends_at_its_timeout():
    """A server that accepts and never answers: the request in flight is aborted at the timeout, and one
    whose arrival falls after it is never sent."""
    with socket.socket() as quiet:
        quiet.bind(("127.0.0.1", 0))
        quiet.listen()
        t0 = time.perf_counter()
        first, late = run_load(f"http://127.0.0.1:{quiet.getsockname()[1]}",
                               [Request(0.0, [1], 4), Request(5.0, [1], 4)], None, timeout_s=0.5)
        assert time.perf_counter() - t0 < 5
    assert not first.ok and first.sent is not None and "aborted" in first.error
    assert late.sent is None and "not sent" in late.error
    assert summarize([first, late], 1, 1)["failed"] == 2


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def test_a_burst_against_the_lab_server_completes_batched(tiny):
    engine = ServingEngine(tiny, num_pages=128, page_size=16, max_batch_tokens=64)
    requests = workload(12, rate=200.0, seed=1, vocab=320, max_prompt=48, max_output=16)
    with serving(engine) as (port, _):
        url = f"http://127.0.0.1:{port}"
        records = run_load(url, requests, "tiny-llama", timeout_s=60)
        batched = max(engine.stats["batch_sizes"])
        start = len(engine.stats["batch_sizes"])
        one_at_a_time = run_load(url, requests[:3], "tiny-llama", timeout_s=60, max_concurrency=1)
        alone = max(engine.stats["batch_sizes"][start:])
    assert all(r.ok and r.finish_reason == "length" for r in records), [r.error for r in records]
    assert [r.tokens for r in records] == [r.max_tokens for r in requests]
    greedy = ServingEngine(tiny, 128, 16, 64).generate([r.prompt for r in requests[:4]], 16)  # a prefix of it
    assert [r.token_ids for r in records[:4]] == [t[:r.max_tokens] for t, r in zip(greedy, requests[:4], strict=True)]
    assert batched > 1                                          # the requests shared steps
    assert all(r.sent >= r.arrival for r in records)
    s = summarize(records, slo_ttft=60, slo_itl=60)
    assert s["completed"] == s["good"] == 12 and s["output_tokens"] == sum(r.max_tokens for r in requests)
    assert s["ttft_median_s"] > 0 and s["itl_median_s"] > 0 and min(g for r in records for g in r.itls) >= 0
    assert all(r.ok for r in one_at_a_time) and alone == 1      # max_concurrency=1: never two in a step


def test_compare_servers_sends_every_server_the_same_loads_in_turns(tiny, monkeypatch):
    """Two lab servers over the same tiny model, and a third run only at the compared level: every run
    completes; each level and rate is sent to every server it names; the answers are the same on both and
    equal the engine's own greedy generate (the oracle) for the same prompts."""
    from contextlib import contextmanager

    from lab import loadgen

    monkeypatch.setattr(loadgen, "SETTLE_S", 0.0)              # no other server's threads to wait out here

    @contextmanager
    def in_thread():                                           # lab_server's (process, base_url), in a thread
        with serving(ServingEngine(tiny, num_pages=128, page_size=16, max_batch_tokens=64)) as (port, _):
            yield None, f"http://127.0.0.1:{port}"

    servers = {name: (in_thread(), loadgen.LAB_FIELDS) for name in ("a", "b", "c")}
    monkeypatch.setattr(loadgen, "WARM_OUTPUT", 2)
    sent, run_load = [], loadgen.run_load                      # (base_url, [(prompt, max_tokens)]) of every run

    def counted(url, reqs, *args):
        sent.append((url, [(r.prompt, r.max_tokens) for r in reqs]))
        return run_load(url, reqs, *args)

    monkeypatch.setattr(loadgen, "run_load", counted)
    out = loadgen.compare_servers(servers, levels=(1, 3), prompt=8, output=4, rates=(50.0,), rate_requests=3,
                                  max_prompt=8, max_output=4, sequential=2, rounds=2, compare_at=(3,),
                                  compare_only=("c",), timeout_s=60, model_name="tiny-llama", vocab=320)
    assert sorted(out["a"]["concurrency"]) == sorted(out["b"]["concurrency"]) == [1, 3]
    assert list(out["c"]["concurrency"]) == [3] and out["c"]["rates"] == {}
    assert "sequential" in out["a"] and "sequential" not in out["b"]
    assert out["a"]["sequential"]["completed"] == 2 and sorted(out["a"]["rates"]) == sorted(out["b"]["rates"]) == [50.0]
    assert len(out["a"]["concurrency"][3]["rounds"]) == 2 and len(out["a"]["concurrency"][1]["rounds"]) == 1
    for name, c in (("a", 1), ("a", 3), ("b", 3), ("c", 3)):
        r = out[name]["concurrency"][c]
        assert r["completed"] == c and r["failed"] == 0
        prompts = [q.prompt for q in loadgen.fixed_requests(c, 8, 4, seed=100 + c, vocab=320)]   # round 0's
        assert r["tokens"] == ServingEngine(tiny, 128, 16, 64).generate(prompts, 4)
    assert all(out[n]["rates"][50.0]["completed"] == 3 for n in ("a", "b"))
    # the compared level (3, two rounds) was first run once untimed on every server, with WARM_OUTPUT tokens;
    # the level of one round (1) was not
    level = [(r.prompt, 2) for r in loadgen.fixed_requests(3, 8, 2, seed=993, vocab=320)]
    warm = [url for url, reqs in sent if reqs == level]
    assert len(warm) == len(set(warm)) == 3
    assert not any(len(reqs) == 1 and reqs[0][1] == 2 for _, reqs in sent)


# ---- servers as processes ----
@pytest.mark.parametrize("one_process", [False, True])
def test_lab_server_starts_serves_and_stops(one_process):
    with lab_server(model="tiny-llama", cores="0", threads=1, num_pages=64, page_size=16,
                    one_process=one_process) as (proc, url):
        records = run_load(url, workload(3, math.inf, 0, vocab=320, max_prompt=8, max_output=4), "tiny-llama", 60)
        assert all(r.ok for r in records) and proc.poll() is None
    assert proc.returncode == 0                                  # SIGTERM: drained, exited cleanly
    assert not proc.log_path.exists()
    with pytest.raises(OSError):
        urllib.request.urlopen(url + "/health", timeout=5)


def test_lab_server_that_dies_says_why():
    with pytest.raises(RuntimeError, match="no-such-model"):
        with lab_server(model="no-such-model", cores=None, threads=1):
            pass


def test_vllm_server_refuses_a_page_size_its_cpu_backend_cannot_use():
    with pytest.raises(ValueError, match="multiples of 32"):
        vllm_server(block_size=16)


@pytest.mark.slow
@pytest.mark.peers
@pytest.mark.skipif(not (VLLM_BIN / "python").exists(), reason="no .venv-vllm (make vllm)")
def test_vllm_server_answers_exactly_max_tokens():
    requests = workload(4, math.inf, 0, max_prompt=32, max_output=8)
    with vllm_server(cores="0-1") as (proc, url):
        records = run_load(url, requests, "smollm2", timeout_s=120, extra_body=VLLM_FIELDS)
    assert all(r.ok for r in records), [r.error for r in records]
    assert [r.tokens for r in records] == [r.max_tokens for r in requests]
    assert statistics.median(r.ttft for r in records) > 0


def test_ratio_pairs_each_round_of_two_servers():
    """ratio: each round's pair divided, and the median of those (not the median runs' throughputs divided,
    1.5 here: a slow round falls on both servers of its pair); a round's pair is the i-th entry of both
    servers' rounds, as compare_servers records them."""
    from lab.experiments import ch08_serving as ch08

    out = {"a": {"concurrency": {16: {"throughput_tok_s": 150.0, "rounds": [140.0, 150.0, 160.0]}}},
           "b": {"concurrency": {16: {"throughput_tok_s": 100.0, "rounds": [100.0, 120.0, 80.0]}}}}
    r = ch08.ratio(out, "a", "b", 16)
    assert r["value"] == pytest.approx(1.4) and r["unit"] == "x"
    assert r["rounds"] == pytest.approx([1.4, 1.25, 2.0]) and (r["low"], r["high"]) == pytest.approx((1.25, 2.0))
    g = ch08.ratios(out, {"f32": ("a", "b")}, (16,))["f32"]["c16"]
    assert (g["ratio"]["value"], g["low"]["value"], g["high"]["value"]) == pytest.approx((1.4, 1.25, 2.0))
