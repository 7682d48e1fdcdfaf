# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 11 — Beyond one pool
#
# Chapter 6's prefix cache lives in one pool, on one machine, and forgets what it evicts. Production
# reuse goes further in four directions. Evicted pages move down to **tiers** (host memory, disk) and
# come back on a hit, as LMCache and SGLang's HiCache do. Prefixes are matched token by token in a
# **radix tree**, and the scheduler runs the requests whose prefixes are cached first (SGLang). Several
# engines sit behind a **router** that sends each request where its prefix already is (NVIDIA Dynamo,
# llm-d). And **prefill runs apart from decode**, the prompt's keys and values shipped from one worker to
# the other (DistServe, Splitwise, vLLM's disaggregated prefill).
#
# The notebook builds a radix tree by hand and checks it against `lab`, then a two-tier page store, then
# measures each idea on this machine, and simulates the router past it.

# %%
import lab  # first, before torch: it sets OpenMP's wait policy, which torch reads once, when it loads

import platform
import random

import pandas as pd
import torch
from IPython.display import display

from lab import results
from lab.engine import PrefixCachingBackend, RadixCache, ServingEngine
from lab.engine.disagg import DecodeEngine, HandoffError, PageSet, prefill
from lab.experiments import ch11_beyond as ch11
from lab.experiments.tables import show
from lab.models import load
from lab.book.verdicts import beside

print(f"python {platform.python_version()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
print(lab.threads.describe())
QUICK = results.quick()
S = ch11.settings(QUICK)
print("quick mode" if QUICK else "full mode", "-> results in", results.results_path())
smol = load("smollm2")
V = smol.config.vocab_size

# %% [markdown]
# ## 1. A radix tree, by hand
#
# A hash chain names whole pages, so two prompts that share 37 tokens share 32 of them in pages of 16. A
# radix tree matches token by token. Each edge holds a run of tokens; where a new sequence leaves a run
# part way, the node is split in two. About twenty lines:

# %%
class Node:
    def __init__(self, run=()):
        self.run, self.children = tuple(run), {}            # children: first token of the child's run -> child


def common(a, b):                                           # how many leading tokens a and b share
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def walk(root, ids, split=False):
    """Follow `ids` down: (the node reached, tokens matched); with split, cut a run where `ids` leave it."""
    node, i = root, 0
    while i < len(ids) and ids[i] in node.children:
        child = node.children[ids[i]]
        k = common(child.run, ids[i:])
        if k < len(child.run):
            if not split:
                return node, i + k                          # the match ends inside this run
            top, child.run = Node(child.run[:k]), child.run[k:]
            top.children[child.run[0]] = child
            node.children[ids[i]] = child = top
        node, i = child, i + k
    return node, i


def match(root, ids):                                       # the longest prefix of ids in the tree
    return walk(root, ids)[1]


def insert(root, ids):
    node, i = walk(root, ids, split=True)
    if i < len(ids):
        node.children[ids[i]] = Node(ids[i:])


# %% [markdown]
# Checked against `lab.engine.RadixCache` (which also owns the slots of the pool, locks what running
# requests hold and evicts least recently used leaves) on prompts that share system prompts of uneven
# lengths:

# %%
rng = random.Random(0)
heads = [[rng.randrange(50) for _ in range(rng.randrange(3, 30))] for _ in range(4)]
trace = [rng.choice(heads)[:rng.randrange(1, 30)] + [rng.randrange(50) for _ in range(rng.randrange(0, 8))]
         for _ in range(200)]
root, cache = Node(), RadixCache(num_slots=10_000)
for ids in trace:
    n, slots, held = cache.match(ids)
    assert match(root, ids) == n, ids
    insert(root, ids)
    cache.release(held)
    cache.release(cache.insert(ids, slots + cache.allocate(len(ids) - n)))
cache.check()
print(f"{len(trace)} prompts: the hand-made tree and RadixCache find the same prefixes; "
      f"the tree holds {cache.cached_tokens():,} tokens of the {sum(map(len, trace)):,} sent")

# %% [markdown]
# The serving engine runs on either cache: `prefix_caching="radix"` (the tree keeps the free and cached
# pages; with pages of one position it finds a prefix to the token) or the hash chain of chapter 6. Both
# give the same tokens as each request decoded alone, and the tree takes a shared prefix to the token:

# %%
prompt = [rng.randrange(V) for _ in range(37)]
a, b = prompt + [11, 12, 13], prompt + [14]
taken = {}
for mode, page in (("hash", 16), ("radix", 1)):
    engine = ServingEngine(smol, num_pages=256 // page, page_size=page, prefix_caching=mode)
    first = engine.generate([a], 4)
    before = engine.stats["cached_tokens"]
    taken[mode] = (engine.generate([b], 4), engine.stats["cached_tokens"] - before)
assert taken["hash"][0] == taken["radix"][0]
print(f"the same tokens; b's {len(b)} prompt tokens taken from the cache: {taken['hash'][1]} by the hash chain "
      f"(pages of 16), {taken['radix'][1]} by the radix tree")

# %% [markdown]
# With larger pages each token of the tree is a whole page's ids, and the engine's step costs what the hash
# chain's costs.
# One decode step of the radix engine beside the hash engine's, at the same batch and positions (SmolLM2's
# heads and widths over 6 layers; quick mode: 4 sequences at 128 positions, the book's: 16 at 1,000):

# %%
from lab.experiments import steps  # noqa: E402

st = steps.radix()
r = st["radix"]
print(f"pages of 16: {r['radix']['over_base']['median']:.2f}x the hash engine's step; pages of one position: "
      f"{r['radix_1']['over_base']['median']:.2f}x")
beside("ch11", "steps.radix", values=steps.values(st), section="steps",
       why="4 sequences at 128 positions take a few milliseconds a step, where a few rounds on a busy machine "
       "are noisy; the book times 16 at 1,000")

# %% [markdown]
# ## 2. Tiers below the pool, by hand
#
# When the pool must reuse a named page, the page need not be lost: it can move to a **host tier**, a
# second, larger store, and come back when a later request needs it, by its name (chapter 6's chained
# digest, which covers the model, the salt and every token before it). A pool of named pages with LRU
# eviction and a host tier below it, counting what a sequence of prompts would find:

# %%
def two_tiers(requests, pool_pages, host_pages, page=16):
    """Pages found in the pool and restored from the host tier. A page's name is its whole prefix."""
    pool, host, found, restored = {}, {}, 0, 0           # name -> None, least recently used first

    def make_room(held):                                 # the pool's least recent page moves down a tier
        while len(pool) + held >= pool_pages:
            old = next(iter(pool))
            del pool[old]
            host[old] = None
            if len(host) > host_pages:
                del host[next(iter(host))]               # no room below either: dropped

    for ids in requests:
        names = [tuple(ids[:(i + 1) * page]) for i in range(len(ids) // page)]
        mine = []                                        # the pages this request holds
        for name in names[:(len(ids) - 1) // page]:      # its longest cached prefix (one token is always run)
            if name in pool:
                found += 1
                del pool[name]
            elif name in host:
                restored += 1
                del host[name]
                make_room(len(mine))                     # a fresh pool page to copy it into
            else:
                break
            mine.append(name)
        for name in names[len(mine):]:                   # the rest computed, a fresh page each
            make_room(len(mine))
            mine.append(name)
        for name in reversed(mine):                      # released: the prefix's head the most recent
            pool[name] = None
    return found, restored


# %% [markdown]
# `PrefixCachingBackend(..., host_pages=...)` runs the same bookkeeping on real pages (a restored page is
# copied back into a fresh pool page) and agrees, here on prompts of whole pages (a partial last page takes a
# pool page too, which this sketch leaves out):

# %%
heads = [[rng.randrange(V) for _ in range(16 * rng.randrange(1, 5))] for _ in range(5)]
requests = [rng.choice(heads) + [rng.randrange(V) for _ in range(16 * rng.randrange(1, 3))] for _ in range(60)]
for pool_pages, host_pages in ((8, 0), (8, 16), (12, 40)):
    backend = PrefixCachingBackend(smol, pool_pages, host_pages=host_pages)
    for ids in requests:
        backend.dry_run(ids)
    st = backend.stats
    assert two_tiers(requests, pool_pages, host_pages) == (st["cached_tokens"] // 16 - st["host_hits"], st["host_hits"])
    print(f"pool {pool_pages} pages, host tier {host_pages}: {st['cached_tokens'] // 16 - st['host_hits']} pages "
          f"found in the pool, {st['host_hits']} restored, {st['computed_tokens'] // 16} computed")

# %% [markdown]
# ## 3. What tiers buy
#
# Chapter 6's workloads and an agent that branches (it tries several tool calls from the same history
# and keeps one), served by the bookkeeping alone, with no tier, a host tier four times the pool, and a
# disk tier below that:

# %%
loads = ch11.workloads(V, S["scale"])
tiers = ch11.tier_sweep(smol, loads, S["fractions"], S["host_factor"])
fig_tiers = ch11.plot_tiers(tiers)
display(show(pd.DataFrame({(name, n): {case: r[case][j]["hit_rate"] for case in ch11.TIER_CASES}
                           for name, r in tiers.items() for j, n in enumerate(r["sizes"])}).T
             .rename_axis(["workload", "pool pages"]), percent=list(ch11.TIER_CASES)))
m = dict(settings=S, manifest=smol.manifest, threads=torch.get_num_threads(), tiers=tiers)
beside("ch11", "ch11.tiers", values=ch11.values(m))

# %% [markdown]
# And in time, with the model running: each chat request's time to first token, with and without the
# host tier.

# %%
ttft = ch11.tier_ttft(smol, ch11.WORKLOADS["multi-turn chats"](V, S["ttft_scale"])[:S["ttft_requests"]],
                      S["ttft_fractions"], S["host_factor"])
rows = {(case, n): {"time to first token (ms)": 1e3 * r["ttft_s"], "hit rate": r["hit_rate"]}
        for case in ("no tier", "host tier") for n, r in zip(ttft["sizes"], ttft[case], strict=True)}
display(show(pd.DataFrame(rows).T.rename_axis(["tiers", "pool pages"]), percent=["hit rate"]))
m["tier_ttft"] = ttft
beside("ch11", "ch11.tier_ttft", values=ch11.values(m),
       why=f"your run times {S['ttft_requests']} chat requests once each, the book every one of a larger workload.")

# %% [markdown]
# ## 4. Restore or recompute?
#
# A restore is worth it when moving a page costs less than computing it. One prompt's time to first token
# with its pages in the pool, in the host tier, on disk, or nowhere; and the time per page of each:

# %%
restore = ch11.restore_times(smol, S["restore_tokens"], S["restore_rounds"])
even = ch11.breakeven(restore, smol)
fig_restore = ch11.plot_restore(restore)
display(show(pd.DataFrame({c: {"per page (ms)": 1e3 * restore["per_page"][c]}
                           for c in ("host", "disk", "recompute")}).T.rename_axis("a page")))
print(f"a page of SmolLM2 in float32: {restore['page_bytes'] / 2**10:.0f} KiB; recomputing it: "
      f"{even['model_flops_per_byte']:,.0f} FLOPs per byte")

# %% [markdown]
# The break-even in one ratio: restoring wins while the machine's compute rate over the tier's bandwidth
# (FLOPs it could do in the time one byte arrives) stays below the model's FLOPs per byte of cache,
# $\frac{\text{FLOP/s}}{\text{bytes/s}} < \frac{2N}{b}$, with $N$ the parameters of the model's matrices
# and $b$ the bytes it caches per token.

# %%
display(show(pd.DataFrame({t: {"achieved bandwidth (GB/s)": even[t]["bandwidth"] / 1e9,
                               "machine FLOPs per byte": even[t]["machine_flops_per_byte"],
                               "recompute / restore": even[t]["ratio"]} for t in ("host", "disk")}).T
             .rename_axis("tier")))
m |= dict(restore=restore, breakeven=even)
beside("ch11", "ch11.restore", values=ch11.values(m))

# %% [markdown]
# ## 5. The radix tree against the hash chain
#
# The same memory (positions of a pool) as pages of 32, 16 and 1 named by the hash chain, or as a radix
# tree. Pages of 1 are token-granular too; they differ from the tree in what they evict: a page at a time,
# a prefix's tail first, where the tree (as SGLang's) evicts whole leaves.

# %%
radix = ch11.radix_sweep(smol, loads, S["fractions"], S["radix_pages"])
display(show(pd.DataFrame({(name, n): {c: r[c][j] for c in r if c != "positions"}
                           for name, r in radix.items() for j, n in enumerate(r["positions"])}).T
             .rename_axis(["workload", "positions"]), percent=["hash 1", "hash 16", "hash 32", "radix"]))
m["radix"] = radix
beside("ch11", "ch11.radix", values=ch11.values(m))

# %% [markdown]
# Cache-aware scheduling: the engine admits the waiting request with the longest cached prefix first
# (`schedule="lpm"`) instead of the oldest, so requests that share a system prompt run while it is in
# the pool. Under pressure, all requests at once:

# %%
sched = ch11.scheduling(smol, S)
display(show(pd.DataFrame({c: {"hit rate": x["hit_rate"], "mean TTFT (s)": x["ttft_s"],
                               "mean TTFT (steps)": x["ttft_steps"], "preemptions": x["preemptions"]}
                           for c, x in sched.items() if c != "prompt_tokens"}).T.rename_axis("cache, schedule"),
             percent=["hit rate"]))
m["scheduling"] = sched
beside("ch11", "ch11.scheduling", values=ch11.values(m),
       why=f"your run serves {S['sched_requests']} requests on {S['sched_pool']} pages, the book "
           f"{ch11.settings(False)['sched_requests']} on {ch11.settings(False)['sched_pool']}: with few requests "
           "the order of a handful decides the mean, and the seconds move with whatever else the machine runs.")

# %% [markdown]
# ## 6. Many workers behind a router
#
# Two workers on this machine, every policy on the same trace (each worker a PrefixCachingBackend of
# SmolLM2, requests one at a time), then 2 to 64 workers in simulation: the routers' own logic and every
# worker's page bookkeeping, without the model.

# %%
measured = ch11.routers_measured(smol, S)
simulated = ch11.routers_simulated(S)
fig_routers = ch11.plot_routers(measured, simulated)
display(show(pd.DataFrame({ch11.ROUTER_NAMES[p]: {"hit rate": x["hit_rate"], "mean TTFT (ms)": 1e3 * x["ttft_s"],
                                                 "imbalance": x["imbalance"]} for p, x in measured.items()}).T
             .rename_axis("2 workers, measured"), percent=["hit rate"]))
m |= dict(routers=measured, simulated=simulated)
beside("ch11", "ch11.routers", "ch11.dynamo", values=ch11.values(m),
       why=f"your run simulates up to {max(S['sim_workers'])} workers, the book up to "
           f"{max(ch11.settings(False)['sim_workers'])}; Dynamo runs only in `make results`.")

# %% [markdown]
# The same router runs in front of the OpenAI server: `python -m lab.serve --workers 2 --router kv_aware`
# starts two engine processes, and each step's message from a worker carries the names of the pages it
# cached and evicted (Dynamo calls them KV events), so the router's count of cached pages is exact.
#
# ## 7. Prefill apart from decode
#
# A prefill worker computes the prompt and hands its pages to a decode worker as a `PageSet`: raw bytes,
# the page names, and everything the receiver checks first (the state identity of chapter 4, the layout,
# the page size, a sha256). By hand, in one process:

# %%
ids = [rng.randrange(V) for _ in range(40)]
ps = prefill(smol, ids)
decoder = DecodeEngine(smol, num_pages=16)
rid = decoder.add_prefilled(PageSet.from_bytes(ps.to_bytes()), max_new_tokens=6)
while decoder.running:
    decoder.step()
alone = ServingEngine(smol, num_pages=16).generate([ids], 6)[0]
assert decoder.output(rid) == alone
print(ps, "-> the decode worker continues with the same tokens:", alone)
other = DecodeEngine(smol, num_pages=16, page_size=8)
try:
    other.add_prefilled(ps, 6)
except HandoffError as e:
    print("refused:", e)

# %% [markdown]
# Then in two processes, one thread each, against one engine with two threads and the same memory, on the
# same prompts arriving at the same times:

# %%
disagg = ch11.disaggregation(smol, S)
fig_handoff = ch11.plot_handoff(disagg)
display(show(pd.DataFrame({mode: {"mean TTFT (s)": d["ttft_mean_s"], "mean ITL (ms)": 1e3 * d["itl_mean_s"],
                                  "p90 ITL (ms)": 1e3 * d["itl_p90_s"], "p99 ITL (ms)": 1e3 * d["itl_p99_s"],
                                  "tokens/s": d["tokens_per_s"],
                                  "MiB moved per request": d["bytes_per_request"] / 2**20}
                           for mode, d in disagg.items() if mode in ("colocated", "disaggregated")}).T
             .rename_axis("mode")))
m["disagg"] = disagg
beside("ch11", "ch11.disagg", values=ch11.values(m),
       why=f"your run sends {S['disagg_requests']} prompts of {S['disagg_tokens']} tokens, the book "
           f"{ch11.settings(False)['disagg_requests']} of {ch11.settings(False)['disagg_tokens']}: with few, short "
           "prompts the decode worker rarely waits for room, and a hand-off costs little.")

# %% [markdown]
# ## 8. Real traffic: Mooncake's conversation trace
#
# Chapter 6 loaded an hour of a chat service's requests, Mooncake's published trace, at 1/32 scale (a page of
# 16 ids stands for a block of 512 tokens). The trace has arrival times, so a fleet can be replayed on its
# clock: each request stays on its worker from its arrival until its last token, and a worker's load is the
# pages of its requests still in flight. Time comes from a cost model, not from this CPU: one prefill at a
# time per worker, at the Mooncake paper's own estimate for LLaMA3-70B on eight A800s (Equation 1 and
# Table 1, at peak), and 50 ms per output token. By hand, round robin over 8 workers whose pools never evict:

# %%
from lab.experiments import mooncake as mc  # noqa: E402
from lab.fleet import replay  # noqa: E402

MS = mc.settings(QUICK)                                          # the trace's sizes in this run
trace = mc.trace(MS["fleet_requests"])
N, prefill_s, decode_s = 8, mc.PREFILL_S / mc.SCALE, mc.DECODE_S / mc.SCALE   # per id here: 32 tokens there
seen, free_at, leaves = [set() for _ in range(N)], [0.0] * N, [[] for _ in range(N)]
in_flight, ttft = [], []
for k, r in enumerate(trace):
    w, now = k % N, r.arrival_ms / 1000                        # round robin, at the request's arrival
    leaves[w] = [t for t in leaves[w] if t > now]              # its requests still in flight
    in_flight.append(len(leaves[w]))
    pages = max((j for j in range(1, (len(r) - 1) // 16 + 1) if tuple(r[:16 * j]) in seen[w]), default=0)
    seen[w].update(tuple(r[:16 * j]) for j in range(1, len(r) // 16 + 1))
    free_at[w] = max(now, free_at[w]) + (len(r) - 16 * pages) * prefill_s   # its prefill ends: first token
    ttft.append(free_at[w] - now)
    leaves[w].append(free_at[w] + r.output_tokens * decode_s)  # its decode ends
got = replay(trace, N, "round_robin", sum(-(-len(r) // 16) for r in trace), prefill_s, decode_s, model=mc.model())
assert abs(got["in_flight"] - sum(in_flight) / len(in_flight)) < 1e-9
assert abs(got["ttft_s"] - sum(ttft) / len(ttft)) < 1e-9                 # the same sums, in the same order
print(f"{len(trace)} requests over {N} workers: {got['in_flight']:.1f} in flight on a worker when one arrives, "
      f"mean time to first token {got['ttft_s']:.2f} s, by hand and by lab.fleet.replay")

# %% [markdown]
# Then the chapter's measurements on the trace: the tiers of section 3, LRU against LFU eviction
# (`lab.cache.eviction`: the page used least goes first), and every router at each worker count, in
# arrival order (`simulate`) and on the clock (`replay`), every worker with the paper's local cache of 3M
# tokens of the service.

# %%
real = mc.real_trace(MS)
fig_trace_pool = mc.plot_pool(real["tiers"], real["eviction"])
display(show(pd.DataFrame({n: {**{c: real["tiers"][c][j]["hit_rate"] for c in ch11.TIER_CASES},
                               "LFU, no tier": real["eviction"]["lfu"][j]["hit_rate"]}
                           for j, n in enumerate(real["tiers"]["sizes"])}).T.rename_axis("pool pages (1/32 scale)"),
             percent=[*ch11.TIER_CASES, "LFU, no tier"], caption=f"the trace's first {real['requests']:,} requests"))

# %%
fig_trace_fleet = mc.plot_fleet(real["fleet"])
display(show(pd.DataFrame({(ch11.ROUTER_NAMES[p], n): {"hit rate": x["hit_rate"], "mean TTFT (s)": x["ttft_s"],
                                                      "in flight": x["in_flight"]}
                           for p, runs in real["fleet"]["in time"].items()
                           for n, x in zip(real["fleet"]["workers"], runs, strict=True)}).T
             .rename_axis(["router", "workers"]), percent=["hit rate"],
             caption=f"on the clock, the trace's first {real['fleet_requests']:,} requests"))
beside("ch11", "mooncake.trace", values=mc.values({"trace": real}), section="mooncake",
       why=f"your run serves the trace's first {real['requests']:,} requests in one pool and "
           f"{real['fleet_requests']:,} in the fleets, the book all 12,031 and 6,000: the first minutes of the hour "
           "hold few second turns, and the book's fleets run up to 64 workers.")

# %% [markdown]
# ## Record

# %%
ch11.record(m, drawn={"tiers": fig_tiers, "restore": fig_restore, "routers": fig_routers, "handoff": fig_handoff})
print("wrote section ch11 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# 1. **A radix tree of your own.** Write a class with `insert(ids)`, `match(ids) -> int` (the longest prefix
#    shared with any sequence inserted, changing nothing) and `tree() -> dict` (nested `{run: subtree}`, as
#    `RadixCache.tree()` returns). `ex.check_radix_tree(YourClass)` runs it on traces you have not seen
#    against a brute-force oracle and the library's tree, and counts the Python steps of every call: a trie
#    of one token per node, or a list of every sequence scanned at each match, fails.
# 2. **A router that beats round robin.** Write `policy(ids, workers) -> worker index`; each worker is a
#    `lab.fleet.WorkerState` (`cached`: the request's tokens that worker holds, `load`, `calls`,
#    `computed`, `page_size`, `tokens`: the request's length). `ex.check_routing_policy(policy)` replays
#    hidden traces through `lab.fleet.simulate` with 4 and 8 workers: your policy must win back most of
#    what round robin loses against one pool of the whole fleet's memory, with requests spread evenly.
#    Sending everything to one worker fails, and so, on these traces, does Dynamo's cost at its default
#    weight (`"kv_aware"`). The policy must be your own: `lab.fleet.choose` and `kv_cost` raise inside.
# 3. **Open-ended: restore or recompute on your machine.** `ex.measure_restore()` times a page restored from
#    host memory and from disk against the same page computed again, and sets your numbers beside the
#    book's. At what model size would your disk lose?

# %%
from lab.exercises import ch11 as ex  # noqa: E402


class MyRadixTree:
    def insert(self, ids):
        raise NotImplementedError("your answer")

    def match(self, ids) -> int:
        raise NotImplementedError("your answer")

    def tree(self) -> dict:
        raise NotImplementedError("your answer")


def my_policy(ids, workers) -> int:
    raise NotImplementedError("your answer")


for check, answer in ((ex.check_radix_tree, MyRadixTree), (ex.check_routing_policy, my_policy)):
    try:
        check(answer)
    except NotImplementedError:
        print(f"{check.__name__}: not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch11_solutions.py`; the test suite runs every check on them.
