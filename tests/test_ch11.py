"""Chapter 11's measurements, on small settings and the tiny model (the notebook records the whole section in
quick mode on SmolLM2).

Oracles: a page store of unbounded size (no eviction: the most a tier can give back), the bookkeeping of each
cache against brute force (tests/test_radix.py, tests/test_tiers.py), real pages restored bit for bit, and the
recorded values against the measurements they came from.
"""

import math

import pytest
import torch

from lab.experiments import ch11_beyond as ch11
from lab.models import load
from lab.workloads import agent_branches, hit_rate, multi_turn_chats, shape

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def loads():
    return {"chats": multi_turn_chats(320, 0.05), "agent": [r[:2000] for r in agent_branches(320, 0.1)]}  # tiny: 2,048


def test_the_agent_workload_branches_and_keeps_each_task_in_order():
    reqs = agent_branches(320, 0.1, seed=3)
    assert len(reqs) >= 4 * 6                          # 4 tasks, 6 steps, some with 3 tries
    same_length = [len(r) for r in reqs]
    # a branch: two requests that share a history and differ after it (tries from one state)
    pairs = [(a, b) for i, a in enumerate(reqs) for b in reqs[i + 1:i + 20] if a[:500] == b[:500] and a != b]
    assert pairs and max(same_length) > 500


def test_tiers_never_lose_a_hit_and_reach_the_unbounded_store(tiny, loads):
    """Per workload and pool size: no tier <= host tier <= host + disk; with host + disk (no bound) the hit rate
    equals an unbounded pool's, since no page is then ever lost."""
    sweep = ch11.tier_sweep(tiny, loads, (0.1, 0.3), host_factor=2)
    for name, r in sweep.items():
        unbounded = hit_rate(tiny, loads[name], 10 * shape(loads[name])["distinct_pages"])["hit_rate"]
        for j in range(len(r["sizes"])):
            off, host, disk = (r[c][j]["hit_rate"] for c in ch11.TIER_CASES)
            assert off <= host <= disk
            assert disk == pytest.approx(unbounded)
        assert r["host tier"][0]["host_hits"] > 0


def test_restore_times_restore_real_pages(tiny):
    r = ch11.restore_times(tiny, tokens=64, rounds=1)
    assert set(r["per_page"]) >= {"host", "disk", "recompute"}
    assert all(r["per_page"][k] > 0 for k in ("host", "disk", "host_store", "disk_store"))   # durations
    # (recompute per page is a difference of two times: on the tiny model it can be within noise of 0)
    cfg = tiny.config
    assert r["page_bytes"] == 2 * cfg.kv_layout[0] * 16 * cfg.n_kv_heads * cfg.head_dim * 4
    b = ch11.breakeven(r, tiny)
    assert b["model_flops_per_byte"] == pytest.approx(r["flops_per_token"] * 16 / r["page_bytes"])
    for tier in ("host", "disk"):                      # the two ratios say the same thing
        assert b[tier]["ratio"] == pytest.approx(b["model_flops_per_byte"] / b[tier]["machine_flops_per_byte"])


def test_radix_sweep_compares_the_same_memory(tiny, loads):
    r = ch11.radix_sweep(tiny, {"chats": loads["chats"]}, (0.2, 1.0), (1, 16))["chats"]
    assert set(r) == {"positions", "hash 1", "hash 16", "radix"}
    assert all(0 <= x <= 1 for c in ("hash 1", "hash 16", "radix") for x in r[c])
    assert r["hash 1"][-1] >= r["hash 16"][-1]         # with room for everything: finer pages never lose


def test_scheduling_and_routers_run_and_report(tiny):
    s = dict(ch11.settings(True), sched_requests=6, sched_head=40, sched_pool=8, sched_new=2, router_requests=6,
             router_head=40, router_pages=12, sim_workers=(2, 4), sim_requests=60, sim_apps=6, sim_pages=128)
    sched = ch11.scheduling(tiny, s)
    assert set(sched) == {"hash fcfs", "hash lpm", "radix fcfs", "radix lpm", "prompt_tokens"}
    assert all(0 <= x["hit_rate"] < 1 and x["ttft_steps"] >= 1 for k, x in sched.items() if k != "prompt_tokens")
    measured = ch11.routers_measured(tiny, s)
    assert all(sum(x["calls"]) == 6 for x in measured.values())
    # the simulator's bookkeeping is the backends': on the measured trace it finds exactly what they found
    assert all(x["simulated_hit_rate"] == pytest.approx(x["hit_rate"]) for x in measured.values())
    sim = ch11.routers_simulated(s)
    assert [x["workers"] for x in sim["kv_aware"]] == [2, 4]


def test_values_record_what_was_measured(tiny, loads, tmp_path, monkeypatch):
    s = dict(ch11.settings(True), sched_requests=4, sched_head=32, sched_pool=8, sched_new=2, router_requests=4,
             router_head=32, router_pages=12, sim_workers=(2,), sim_requests=20, sim_apps=4, sim_pages=128)
    chats = {"chats": loads["chats"]}
    restore = ch11.restore_times(tiny, 64, 1)
    line = dict(requests=2, ttft_mean_s=0.5, ttft_p50_s=0.5, ttft_p90_s=0.6, itl_mean_s=0.02, itl_gaps=40,
                itl_p50_s=0.02, itl_p90_s=0.03, itl_p99_s=0.05, tokens_per_s=10.0, bytes_per_request=2**20)
    m = dict(settings=s, manifest=tiny.manifest, threads=1, tiers=ch11.tier_sweep(tiny, chats, (0.2,), 2),
             tier_ttft=ch11.tier_ttft(tiny, loads["chats"][:3], (0.5,), 2), restore=restore,
             breakeven=ch11.breakeven(restore, tiny), radix=ch11.radix_sweep(tiny, chats, (0.2,), (1, 16, 32)),
             scheduling=ch11.scheduling(tiny, s), routers=ch11.routers_measured(tiny, s),
             simulated=ch11.routers_simulated(s),
             disagg=dict(colocated=line, disaggregated=dict(line, tokens_per_s=12.0), same_tokens=True),
             dynamo="not run in this test")
    v = ch11.values(m)
    r = m["radix"]["chats"]
    assert v["radix"]["chats"]["granularity"]["value"] == pytest.approx(100 * (r["hash 1"][0] - r["hash 16"][0]))
    assert v["restore"]["disk_ms_per_page"]["value"] == pytest.approx(1e3 * restore["per_page"]["disk"])
    assert v["disagg"]["throughput_ratio"]["value"] == pytest.approx(1.2)
    assert v["disagg"]["bytes_per_request"]["value"] == 1.0
    assert v["disagg"]["colocated"]["itl_p99_ms"]["value"] == pytest.approx(50)
    assert v["dynamo"]["kv"]["cached"]["value"] == "NOT_RUN"
    t = m["tier_ttft"]
    assert v["tier_ttft"]["ratio"]["value"] == pytest.approx(t["no tier"][0]["ttft_s"] / t["host tier"][0]["ttft_s"])
    assert math.isfinite(v["routers"]["measured"]["kv_aware"]["hit_rate"]["value"])


def test_figures_draw(tiny, loads):
    sweep = ch11.tier_sweep(tiny, {"chats": loads["chats"]}, (0.2, 0.5), 2)
    ch11.plot_tiers(sweep)
    ch11.plot_restore(dict(per_page=dict(host=1e-4, disk=2e-3, recompute=4e-2), page_bytes=737280))
    s = dict(sim_workers=(2, 4), sim_requests=20, sim_apps=4, sim_pages=128)
    sim = ch11.routers_simulated(s)
    ch11.plot_routers({p: dict(hit_rate=0.5) for p in sim}, sim)
    rows = [dict(arrival_s=0.1 * i, first_token_s=0.1 * i + 0.2, token_s=[0.1 * i + 0.2 + 0.05 * k for k in range(4)])
            for i in range(3)]
    ch11.plot_handoff(dict(timelines=dict(disaggregated=rows)))
    assert torch.get_num_threads() == 1
