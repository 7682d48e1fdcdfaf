"""Real traffic for chapters 6 and 11: Mooncake's conversation trace (lab.workloads.mooncake), measured
(section "mooncake": `python -m lab.experiments.mooncake`; LAB_FULL=1 writes results/results.json).

Chapter 6: the hit rate of one pool against its size, and of a pool that never evicts. Chapter 11: LRU against
LFU eviction in the pool (lab.cache.eviction), and a fleet behind each router at 2 to 64 workers, replayed in
arrival order (lab.fleet.simulate) and on the trace's clock (lab.fleet.replay). Chapter 11's tiers run on the
same trace through its own `tier_sweep`.

SCALE. Every 512-token block of the trace becomes one page of 16 token ids, so every length here is 1/32 of
the service's: a pool of N pages holds what N x 512 tokens of the service hold, and capacities are quoted in
tokens of the service. Every value and figure says so (REAL). Only page bookkeeping runs (`dry_run`, on
`bookkeeping_model()`), never a model: the hit rates are exact counts, and the replay's times come from the
cost model below, not from a clock.
"""

import functools

import numpy as np
from tqdm.auto import tqdm

from ..engine import PrefixCachingBackend
from ..fleet import POLICIES, replay, simulate
from ..results import figures_dir, provenance, quick, require_clean, value, write_section
from ..workloads import TRACE_BLOCK, bookkeeping_model, hit_rate, mooncake, shape
from . import plots
from .plots import finish

SECTION = "mooncake"
PAGE = 16
TOKENS_PER_BLOCK = 16                                 # one page per block of the trace
SCALE = TOKENS_PER_BLOCK / TRACE_BLOCK                # 1/32: ids here per token of the service
REAL = (f"Mooncake's conversation trace, real traffic (data/mooncake), at 1/{round(1 / SCALE)} scale: "
        f"a page of {PAGE} ids stands for {TRACE_BLOCK} tokens")

# The replay's cost model, per token of the service (the trace's own lengths). Prefill: the Mooncake paper's
# Equation 1, flops(n) = l (a n^2 d + b n d^2), with its Table 1 (LLaMA3-70B: l = 80, d = 8192, a = 4, b = 22;
# 8 x A800 at G = 8 x 312 TFLOP/s), per token at the trace's mean prompt of 12,035 tokens, at that peak rate.
PREFILL_S = 80 * (4 * 12035 * 8192 + 22 * 8192**2) / (8 * 312e12)   # 6.0e-5 s per prompt token computed
DECODE_S = 0.05                                     # s per output token: half the paper's tightest TBT bound (100 ms)
WORKER_TOKENS = 3_000_000                           # a worker's pool: the paper's local cache of one node (3M tokens)


def settings(quick_mode: bool) -> dict:
    """Chapter 6's pool sizes (tokens of the service) on the trace's first `pool_requests`; chapter 11's
    tiers and eviction on its first `trace_requests` (pool sizes as `trace_fractions` of its distinct pages,
    a host tier `host_factor` times the pool), and its fleets on the first `fleet_requests`."""
    if quick_mode:
        return dict(pool_requests=2000, capacities=(1e6, 3e6, 1e7), trace_requests=1000,
                    trace_fractions=(0.05, 0.4), host_factor=4, fleet_requests=400, fleet_workers=(2, 8))
    # all of the trace in one pool; its first 6,000 requests (half its hour) in the fleets
    return dict(pool_requests=None, capacities=(3e5, 1e6, 3e6, 1e7, 3e7, 5e7), trace_requests=None,
                trace_fractions=(0.02, 0.05, 0.1, 0.2, 0.5), host_factor=4, fleet_requests=6000,
                fleet_workers=(2, 4, 8, 16, 32, 64))


@functools.cache
def model():
    """The model that names the trace's pages (never run): one, so every pool names pages alike."""
    return bookkeeping_model()


def trace(limit=None) -> list:
    """The trace's first `limit` requests (None: all 12,031), at SCALE."""
    return mooncake(page_size=PAGE, tokens_per_block=TOKENS_PER_BLOCK, limit=limit)


def pages(service_tokens: float) -> int:
    """The pages of PAGE ids that hold `service_tokens` tokens of the service."""
    return round(service_tokens * SCALE / PAGE)


def label(tokens: float) -> str:
    """3e6 -> "3M", 3e5 -> "300k": a capacity as a key and a tick label."""
    return f"{tokens / 1e6:g}M" if tokens >= 1e6 else f"{tokens / 1e3:g}k"


# ---- chapter 6: one pool against its size ------------------------------------------------------------------

def capacity_sweep(requests, capacities) -> dict:
    """One pool (LRU) at each capacity of `capacities` (tokens of the service), never below what the longest
    request needs, and a pool that never evicts, where each request's share of its prompt found cached is kept
    too. That pool has a page for every page any request takes (LRU would evict a named page before an unnamed
    one further down its queue, so the distinct pages alone are not enough)."""
    sh = shape(requests, PAGE)
    floor = -(-sh["max_tokens"] // PAGE)
    runs = [hit_rate(model(), requests, max(floor, pages(c)), PAGE) | dict(capacity=c)
            for c in tqdm(capacities, desc="Mooncake trace: pool sizes")]
    never = sum(-(-len(r) // PAGE) for r in requests)
    backend = PrefixCachingBackend(model(), never, PAGE)
    shares = [backend.dry_run(r) / len(r) for r in tqdm(requests, desc="Mooncake trace: a pool that never evicts")]
    s = backend.stats
    assert s["evicted_pages"] == 0, s                      # it never evicts, by its size
    unbounded = dict(s, hit_rate=s["cached_tokens"] / (s["cached_tokens"] + s["computed_tokens"]),
                     num_pages=never, request_mean=float(np.mean(shares)))
    return dict(shape=sh, runs=runs, unbounded=unbounded)


def capacity_values(r: dict) -> dict:
    u = r["unbounded"]
    v = {"requests": value(r["shape"]["requests"], "requests", note=REAL),
         "tokens_per_block": value(TOKENS_PER_BLOCK, "ids", note=f"per {TRACE_BLOCK}-token block: scale 1/32"),
         "mean_tokens": value(r["shape"]["mean_tokens"], "ids", note="at 1/32 scale"),
         "distinct_pages": value(r["shape"]["distinct_pages"], "pages", service_tokens=r["shape"]["distinct_pages"]
                                 * PAGE / SCALE),
         "by_capacity": {f"t{label(x['capacity'])}": value(100 * x["hit_rate"], "%", pages=x["num_pages"],
                                                           service_tokens=x["capacity"], evicted=x["evicted_pages"])
                         for x in r["runs"]},
         "unbounded": value(100 * u["hit_rate"], "%", pages=u["num_pages"], note="a pool that never evicts"),
         "unbounded_request_mean": value(100 * u["request_mean"], "%",
                                         note="mean over requests of the share of each prompt found cached")}
    at = {x["capacity"]: x["hit_rate"] for x in r["runs"]}
    if 3e6 in at:
        v["at_3M_of_unbounded"] = value(100 * at[3e6] / u["hit_rate"], "%", note="a pool of 3M service tokens")
    return v


def plot_capacity(r: dict, path=None):
    """Hit rate against capacity in tokens of the service, with the pool that never evicts and the paper's
    two marks: its local cache of 3M tokens per node, and the trace's prefix cache ratio of about 40%."""
    fig, ax = plots.figure(height=3.6)
    x = [p["capacity"] for p in r["runs"]]
    ax.plot(x, [100 * p["hit_rate"] for p in r["runs"]], "o-", color="k", label="one pool, LRU (measured)")
    ax.axhline(100 * r["unbounded"]["hit_rate"], ls=":", color="k", label="a pool that never evicts")
    ax.axhline(40, ls="--", color="C3", label="paper: cache ratio about 40%")
    ax.axvline(3e6, ls="--", color="C0", label="paper: one node's local cache, 3M tokens")
    ax.set(xscale="log", ylim=(0, 60), xlabel="pool size (tokens of the service; pages here hold 1/32)",
           ylabel="prompt tokens from cache (%)", title="Mooncake's conversation trace (real traffic, 1/32 scale)")
    ax.set_xticks(x, [label(c) for c in x])
    ax.minorticks_off()
    ax.legend(loc="upper left")
    return finish(fig, path)


# ---- chapter 11: eviction, and a fleet ------------------------------------------------------------------------

def eviction_sweep(requests, fractions) -> dict:
    """LRU against LFU (lab.cache.eviction) in one pool, at pool sizes that are `fractions` of the trace's
    distinct pages, never below what its longest request needs."""
    sh = shape(requests, PAGE)
    floor = -(-sh["max_tokens"] // PAGE)
    sizes = sorted({max(floor, round(f * sh["distinct_pages"])) for f in fractions})
    runs = {e: [hit_rate(model(), requests, n, PAGE, eviction=e)
                for n in tqdm(sizes, desc=f"{e}: pool sizes", leave=False)]
            for e in tqdm(("lru", "lfu"), desc="Mooncake trace: eviction")}
    return dict(shape=sh, sizes=sizes, **runs)


def fleet(requests, workers, pages_per_worker: int) -> dict:
    """Every router policy at each worker count, on the trace: "arrival order" (simulate: a request's load
    lasts while the next N arrive) and "in time" (replay on the trace's clock with PREFILL_S and DECODE_S per
    token of the service, so a trace token costs 32 times as much)."""
    out = {"arrival order": {}, "in time": {}, "workers": list(workers), "pages_per_worker": pages_per_worker}
    for policy in tqdm(POLICIES, desc="Mooncake trace, routers: policies"):
        out["arrival order"][policy] = [simulate(requests, n, policy, pages_per_worker, PAGE, model=model())
                                        for n in tqdm(workers, desc=f"{policy}, arrival order: workers",
                                                      leave=False)]
        out["in time"][policy] = [replay(requests, n, policy, pages_per_worker, PREFILL_S / SCALE, DECODE_S / SCALE,
                                         PAGE, model=model())
                                  for n in tqdm(workers, desc=f"{policy}, in time: workers", leave=False)]
    return out


def real_trace(s: dict) -> dict:
    """Chapter 11 on the trace: tiers (chapter 11's `tier_sweep`) and eviction in one pool, on its first
    `trace_requests` requests; each router at each of `fleet_workers`, on its first `fleet_requests`, every
    worker holding the paper's local cache of 3M tokens of the service."""
    from .ch11_beyond import tier_sweep

    requests = trace(s["trace_requests"])
    tiers = tier_sweep(model(), {"Mooncake conversation": requests}, s["trace_fractions"], s["host_factor"])
    return dict(requests=len(requests), fleet_requests=min(len(requests), s["fleet_requests"]),
                tiers=tiers["Mooncake conversation"], eviction=eviction_sweep(requests, s["trace_fractions"]),
                fleet=fleet(requests[:s["fleet_requests"]], s["fleet_workers"], pages(WORKER_TOKENS)))


def trace_values(t: dict) -> dict:
    """Chapter 11's values of the trace: `t` holds "requests", and "eviction" and "fleet" as measured."""
    ev, fl = t["eviction"], t["fleet"]
    v = {"requests": value(t["requests"], "requests", note=REAL),
         "fleet_requests": value(t["fleet_requests"], "requests", note="the trace's first, in the fleet's runs"),
         "eviction": {"pool_pages": value(ev["sizes"][0], "pages", of=ev["shape"]["distinct_pages"],
                                          service_tokens=ev["sizes"][0] * PAGE / SCALE, note="the smallest pool"),
                      **{e: value(100 * ev[e][0]["hit_rate"], "%") for e in ("lru", "lfu")},
                      "by_pool": {f"p{n}": {e: value(100 * ev[e][j]["hit_rate"], "%") for e in ("lru", "lfu")}
                                  for j, n in enumerate(ev["sizes"])}},
         "fleet": {"pages_per_worker": value(fl["pages_per_worker"], "pages",
                                             service_tokens=fl["pages_per_worker"] * PAGE / SCALE),
                   "prefill_ms_per_token": value(1e3 * PREFILL_S, "ms", note="cost model, per service token"),
                   "decode_ms_per_token": value(1e3 * DECODE_S, "ms", note="cost model, per service token")}}
    for order, key in (("arrival order", "arrival"), ("in time", "timed")):
        v["fleet"][key] = {p: {f"w{x['workers']}": {
            "hit_rate": value(100 * x["hit_rate"], "%"), "imbalance": value(x["imbalance"], "x"),
            **({"ttft_s": value(x["ttft_s"], "s", p50=x["ttft_p50_s"], p90=x["ttft_p90_s"], note="cost model"),
                "in_flight": value(x["in_flight"], "requests"), "busy": value(100 * x["busy"], "%")}
               if key == "timed" else {})} for x in runs} for p, runs in fl[order].items()}
    return v


ROUTER_NAMES = {"round_robin": "round robin", "least_loaded": "least loaded", "kv_aware": "KV-aware"}


def plot_pool(tiers: dict, ev: dict, path=None):
    """Hit rate against pool size on the trace: no tier, tiers below the pool, and LFU in place of LRU."""
    fig, ax = plots.figure(height=3.6)
    distinct = ev["shape"]["distinct_pages"]
    x = [100 * n / distinct for n in tiers["sizes"]]
    for case, style in (("no tier", "s-"), ("host tier", "o--"), ("host + disk", "^:")):
        ax.plot(x, [100 * q["hit_rate"] for q in tiers[case]], style, label=f"LRU, {case}")
    ax.plot([100 * n / distinct for n in ev["sizes"]], [100 * q["hit_rate"] for q in ev["lfu"]], "D-", color="C3",
            label="LFU, no tier")
    ax.set(xlabel="pool (% of the trace's distinct pages)", ylabel="prompt tokens from cache (%)", ylim=(0, None),
           title="Mooncake's conversation trace (1/32 scale): one pool")
    ax.legend(loc="lower right")
    return finish(fig, path)


def plot_fleet(fl: dict, path=None):
    """Per policy against workers: the fleet's hit rate (in time, solid; arrival order, dashed) and the mean
    time to first token of the replay's cost model."""
    fig, (ax, ax_t) = plots.figure(ncols=2, height=3.8)
    w = fl["workers"]
    for i, policy in enumerate(POLICIES):
        timed, arrival = fl["in time"][policy], fl["arrival order"][policy]
        ax.plot(w, [100 * x["hit_rate"] for x in timed], "o-", color=f"C{i}", label=ROUTER_NAMES[policy])
        ax.plot(w, [100 * x["hit_rate"] for x in arrival], "x--", color=f"C{i}")
        ax_t.plot(w, [x["ttft_s"] for x in timed], "o-", color=f"C{i}", label=ROUTER_NAMES[policy])
    ax.set(ylabel="prompt tokens from cache (%)", ylim=(0, None), title="Hit rate (dashed: arrival order)")
    ax_t.set(ylabel="mean time to first token (s)", yscale="log", title="In time: cost model")
    plots.log_ticks(ax_t.yaxis)
    for a in (ax, ax_t):
        a.set_xscale("log")
        a.set_xticks(w, [str(n) for n in w])
        a.minorticks_off()
        a.set_xlabel("workers")
    ax_t.legend(loc="upper right")
    return finish(fig, path)


# ---- measure and record -------------------------------------------------------------------------------------

def measure(quick_mode=None) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    return dict(settings=s, pool=capacity_sweep(trace(s["pool_requests"]), s["capacities"]), trace=real_trace(s))


def values(m: dict) -> dict:
    """The section's values from what m holds: "pool" (chapter 6) and "trace" (chapter 11)."""
    from .ch11_beyond import tier_values

    v = {}
    if "pool" in m:
        v["pool"] = capacity_values(m["pool"])
    if "trace" in m:
        v["trace"] = trace_values(m["trace"]) | {"tiers": tier_values(m["trace"]["tiers"])}
    return v


def record(m: dict, drawn: dict | None = None) -> dict:
    """Write section mooncake and its figures (drawn: a notebook's, saved as they are)."""
    figs, drawn = figures_dir(), drawn or {}
    draw = {"ch06_mooncake": lambda p: plot_capacity(m["pool"], p),
            "ch11_trace_pool": lambda p: plot_pool(m["trace"]["tiers"], m["trace"]["eviction"], p),
            "ch11_trace_fleet": lambda p: plot_fleet(m["trace"]["fleet"], p)}
    for name, plot in draw.items():
        path = figs / f"{name}.png"
        finish(drawn[name], path) if name in drawn else plot(path)
    captions = {"ch06_mooncake": "Mooncake's conversation trace (1/32 scale): hit rate against pool size in tokens "
                                 "of the service",
                "ch11_trace_pool": "Mooncake's trace: one pool with tiers, and LFU against LRU",
                "ch11_trace_fleet": "Mooncake's trace: routers over 2 to 64 workers, in arrival order and in time"}
    v = values(m)
    write_section(SECTION, v, provenance(note=REAL),
                  figures={k: {"path": figs / f"{k}.png", "caption": c} for k, c in captions.items()})
    return v


if __name__ == "__main__":
    require_clean()
    record(measure())
