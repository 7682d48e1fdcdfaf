"""Chapter 5, "Paged attention": how much reserved memory holds real tokens, where the rest goes when a pool
serves requests over time, how many requests fit, what reading keys page by page costs on the CPU, and the
paged cache checked token for token.

Request lengths are SYNTHETIC: drawn from log-normal distributions whose means match the statistics the
vLLM paper published for ShareGPT and Alpaca. No real trace ships in any package; every figure that uses
these lengths says so.
"""

import statistics
from collections import deque

import numpy as np
import torch
from tqdm.auto import tqdm

from .. import data
from ..cache import BlockManager, cache_bytes, make_cache
from ..engine import CachedBackend, generate
from ..models import forward_cached, load
from ..results import figures_dir, provenance, quick, value, write_section
from ..step_cost import attention_case
from . import plots
from .plots import finish

SECTION = "ch05"
ANSWER_BUDGET = 512    # max_new_tokens of the "prompt plus answer budget" reservation
BLOCK_SIZES = (1, 8, 16, 32, 64, 128, 256)
LONG_CONTEXT = 4096   # the context where the speed comparison is repeated: caches flushed, one thread, in turns
SYNTHETIC = (f"synthetic lengths: log-normal, sigma {data.LENGTH_SIGMA}, means of the vLLM paper's ShareGPT / "
             "Alpaca statistics")  # lab.data.synthetic_lengths


def settings(quick_mode: bool) -> dict:
    if quick_mode:
        return dict(requests=2000, contexts=(256, 1024, 4096), batches=(1, 8), reps=3, repeats=2,
                    page_sizes=(1, 16, 64), new_tokens=8, manager_requests=200,
                    served={"ShareGPT": 1000, "Alpaca": 6000})   # Alpaca's are short: more pass through the pool
    return dict(requests=20000, contexts=(256, 1024, 4096), batches=(1, 8), reps=31, repeats=9,
                page_sizes=(1, 16, 64), new_tokens=24, manager_requests=2000,
                served={"ShareGPT": 20000, "Alpaca": 120000})


def reserved(inputs, outputs, scheme: str, block: int = 16, max_len=data.MAX_REQUEST_LEN, answer=ANSWER_BUDGET):
    """Positions reserved per request, at completion, under each scheme."""
    real = inputs + outputs
    if scheme == "contiguous_max":
        return np.full_like(real, max_len)
    if scheme == "contiguous_budget":
        return inputs + answer
    if scheme == "paged":
        return -(-real // block) * block
    raise ValueError(f"unknown scheme {scheme!r}")


def utilization(inputs, outputs) -> dict:
    """Fraction of reserved positions that hold real tokens, per scheme and block size."""
    real = (inputs + outputs).sum()
    out = {"contiguous_max": real / reserved(inputs, outputs, "contiguous_max").sum(),
           "contiguous_budget": real / np.maximum(reserved(inputs, outputs, "contiguous_budget"),
                                                  inputs + outputs).sum()}
    for b in BLOCK_SIZES:
        out[f"paged_{b}"] = real / reserved(inputs, outputs, "paged", b).sum()
    return {k: float(v) for k, v in out.items()}


def utilization_by_manager(inputs, outputs, page_size=16) -> float:
    """The same measurement through the real BlockManager: reserve the prompt, then one position per token."""
    total_pages = int(sum(-(-(i + o) // page_size) for i, o in zip(inputs, outputs, strict=True)))
    bm = BlockManager(total_pages, page_size)
    for r, (i, o) in enumerate(zip(inputs, outputs, strict=True)):
        bm.reserve(r, int(i))
        for _ in range(int(o)):
            bm.reserve(r, 1)
    used = total_pages - bm.num_free
    return float((inputs + outputs).sum() / (used * page_size))


def concurrency(inputs, outputs, budget_positions: int) -> dict:
    """How many requests, taken in arrival order, fit at once in a budget of cache positions."""
    out = {}
    for scheme, block in [("contiguous_max", 0), ("contiguous_budget", 0)] + [("paged", b) for b in (16,)]:
        need = np.maximum(reserved(inputs, outputs, scheme, block or 16), inputs + outputs)
        out[scheme if scheme != "paged" else "paged_16"] = int(np.searchsorted(np.cumsum(need), budget_positions,
                                                                               side="right"))
    return out


PARTS = ("tokens", "future", "internal", "external", "free")   # what a position of the pool is doing, per step
SERVED = ("contiguous_max", "contiguous_budget", "buddy", "paged")  # the allocators serve() simulates


def bound(inputs, outputs, scheme: str, **lengths):
    """Positions a contiguous allocator sets aside per request: its reservation, or its length if longer."""
    return np.maximum(reserved(inputs, outputs, scheme, **lengths), inputs + outputs)


def first_fit(holes, n, align=1):
    """The lowest start of n free positions, aligned to `align`, in holes (sorted [lo, hi) runs), or None."""
    return next((at for lo, hi in holes if (at := -(-lo // align) * align) + n <= hi), None)


def take(holes, at, n):                       # [at, at + n) leaves the hole that holds it
    i = next(i for i, (lo, hi) in enumerate(holes) if lo <= at and at + n <= hi)
    lo, hi = holes.pop(i)
    holes[i:i] = [(a, b) for a, b in ((lo, at), (at + n, hi)) if a < b]


def give(holes, at, n):                       # [at, at + n) comes back, merged with its neighbours
    merged = []
    for lo, hi in sorted(holes + [(at, at + n)]):
        if merged and merged[-1][1] == lo:
            merged[-1] = (merged[-1][0], hi)
        else:
            merged.append((lo, hi))
    holes[:] = merged


def serve(inputs, outputs, scheme: str, pool: int, page: int = 16, **lengths) -> dict:
    """Serve requests from a pool of `pool` positions, one decode step at a time, and count what every
    position holds at every step while a request waits (the steady state of a busy server).

    All requests wait from the start and are admitted first come, first served; admission stops at the
    first request that does not fit. A request admitted with c positions holds c + 1 after its step and
    leaves after the step that brings it to inputs + outputs. Contiguous schemes ("contiguous_max",
    "contiguous_budget") take bound() positions in one run, first fit; "buddy" rounds the budget's run up
    to a power of two and places it at a start aligned to its size (where a buddy allocator has a free
    block of that order). "paged" takes a page whenever a request's last page is full; when too few are
    free, the newest request is preempted (its pages freed, it waits at the head and recomputes later).
    `lengths` (max_len, answer) replace the reservations' lengths, for small cases.

    Each counted step, each position is one of PARTS: a token held; reserved for a token its request
    will write later; internal fragmentation (held, never written); external fragmentation (free, as many
    free in all as the waiting request needs, but no run of them long enough for it); free (fewer free in
    all than the waiting request needs). Returns position-steps per part, steps counted, live
    request-steps, preemptions, and the positions contiguous_max and contiguous_budget would set aside
    for the live requests (their bound()s summed), each summed over the counted steps.
    """
    final, c = (inputs + outputs).tolist(), inputs.tolist()     # c: positions held before the next step
    if scheme == "paged":
        if pool % page:
            raise ValueError(f"a pool of {pool} positions is not a whole number of pages of {page}")
        need = lambda r: -(-(c[r] + 1) // page) * page          # whole pages for its next step
    else:
        size = bound(inputs, outputs, "contiguous_budget" if scheme == "buddy" else scheme, **lengths).tolist()
        need = ([1 << (n - 1).bit_length() for n in size] if scheme == "buddy" else size).__getitem__
    bounds = {s: bound(inputs, outputs, s, **lengths).tolist() for s in ("contiguous_max", "contiguous_budget")}
    queue, live, held, start = deque(range(len(c))), [], [0] * len(c), [0] * len(c)
    holes, free = [(0, pool)], pool
    now = dict.fromkeys(("tokens", "filled") + tuple(bounds), 0)          # sums over the live requests
    out = dict.fromkeys(PARTS + ("steps", "live", "preemptions") + tuple(bounds), 0)

    def count(r, sign):                       # request r joins (+1) or leaves (-1) the live sums
        now["tokens"] += sign * c[r]
        now["filled"] += sign * min(held[r], final[r])   # held positions that hold or will hold a token
        for s, b in bounds.items():
            now[s] += sign * b[r]

    def leave(r):                             # request r hands its positions back
        nonlocal free
        count(r, -1)
        if scheme != "paged":
            give(holes, start[r], held[r])
        free, held[r] = free + held[r], 0

    # region serve_step
    while queue or live:
        if scheme == "paged":                 # a full last page: the next position needs a new page
            grow = [r for r in live if c[r] == held[r]]
            while len(grow) * page > free:    # too few free pages: preempt the newest request
                r = live.pop()
                leave(r)
                queue.appendleft(r)
                out["preemptions"] += 1
                grow = [x for x in grow if x != r]
            for r in grow:
                count(r, -1)
                held[r] += page
                count(r, 1)
            free -= len(grow) * page
        while queue:                          # admit in arrival order while the head fits
            r, n = queue[0], need(queue[0])
            if scheme == "paged":
                at = 0 if n <= free else None
            else:
                at = first_fit(holes, n, align=n if scheme == "buddy" else 1)
            if at is None:
                break
            if scheme != "paged":
                take(holes, at, n)
            queue.popleft()
            live.append(r)
            held[r], start[r], free = n, at, free - n
            count(r, 1)
        if queue and not live:
            raise ValueError(f"request {queue[0]} needs {need(queue[0])} positions; "
                             f"the pool has {pool}")
        for r in live:
            c[r] += 1                         # this step's token
        now["tokens"] += len(live)
        if queue:                             # a request waits, the pool limits: the step counts
            out["tokens"] += now["tokens"]
            out["future"] += now["filled"] - now["tokens"]
            out["internal"] += pool - free - now["filled"]
            out["external" if need(queue[0]) <= free else "free"] += free
            out["steps"], out["live"] = out["steps"] + 1, out["live"] + len(live)
            for s in bounds:
                out[s] += now[s]
        for r in [r for r in live if c[r] == final[r]]:
            leave(r)
        live = [r for r in live if c[r] < final[r]]
    # endregion
    return out


def breakdown(inputs, outputs, pool: int, page: int = 16) -> dict:
    """serve() for each allocator: every part as a share of the pool's position-steps, the mean number of
    live requests, preemptions, steps counted, and the contiguous reservations of the live requests in
    pools (bound_max, bound_budget: the pool's positions = 1)."""
    out = {}
    for scheme in SERVED:
        r = serve(inputs, outputs, scheme, pool, page)
        total = pool * r["steps"]
        out[scheme] = {p: r[p] / total for p in PARTS} | dict(
            live=r["live"] / r["steps"], preemptions=r["preemptions"], steps=r["steps"],
            bound_max=r["contiguous_max"] / total, bound_budget=r["contiguous_budget"] / total)
    return out


# The cases run at LONG_CONTEXT, beside the default (warm, on torch's threads): attention_case arguments.
LONG_CASES = {"cold": dict(cold=True), "one_thread": dict(threads=1)}


def decode_attention_times(contexts, batches, reps=9, repeats=3) -> dict:
    """Decode attention over pages against SDPA over a contiguous cache, CPU, SmolLM2's head shape.

    {(B, L): attention_case result}, with warm caches (calls back to back) on torch's threads. At
    LONG_CONTEXT every batch also runs the LONG_CASES: cold (caches flushed before every call) and on
    one thread. There each case runs `repeats` times on fresh data, the repeats taken in turns across the
    cases so each case's runs spread over the whole measurement: the load that other tenants put on a
    shared machine drifts over seconds, and back-to-back repeats would hide that. Each case keeps the run
    with the median ratio and the lowest and highest ratio beside it; the extra cases sit under their
    names, e.g. out[(1, 4096)]["cold"].
    """
    def summary(runs):
        runs = sorted(runs, key=lambda r: r["ratio"])
        return dict(runs[len(runs) // 2], ratio_range=(runs[0]["ratio"], runs[-1]["ratio"]), repeats=len(runs))

    out = {}
    for B in batches:
        for L in tqdm([L for L in contexts if L != LONG_CONTEXT], desc=f"attention, batch {B}", leave=False):
            out[(B, L)] = summary([attention_case(B, L, reps)])
    if LONG_CONTEXT in contexts:
        L, cases = LONG_CONTEXT, {"warm": {}} | LONG_CASES
        runs = {(B, name): [] for B in batches for name in cases}
        for i in tqdm(range(repeats), desc=f"attention at {L:,}, {', '.join(cases)}, in turns"):
            for B, name in runs:
                runs[(B, name)].append(attention_case(B, L, reps, seed=i, **cases[name]))
        for B in batches:
            out[(B, L)] = summary(runs[(B, "warm")]) | {name: summary(runs[(B, name)]) for name in LONG_CASES}
    return dict(sorted(out.items()))                                  # by batch, then context


@torch.inference_mode()
def token_agreement(model, page_sizes=(1, 16, 64), prompt=37, new_tokens=24) -> dict:
    """Greedy decoding through a PagedCache against a ConcatCache, per page size: are the tokens identical,
    and the max and median over steps of the largest |Δ logit| (both caches fed the same tokens)."""
    w, cfg, n = model.weights, model.config, prompt + new_tokens
    ids = data.passages(model.tokenizer, prompt, count=1, seed=21)[0]  # 37: crosses page boundaries
    want = generate(CachedBackend(model, lambda: make_cache("concat", cfg, n)), ids, new_tokens).tokens
    out = {}
    for ps in page_sizes:
        paged = lambda ps=ps: make_cache("paged", cfg, n + ps, page_size=ps)
        got = generate(CachedBackend(model, paged), ids, new_tokens).tokens
        caches, diffs = (paged(), make_cache("concat", cfg, n)), []
        for x in [torch.tensor([ids])] + [torch.tensor([[t]]) for t in want[:-1]]:  # prefill, then each step
            a, b = (forward_cached(x, w, cfg, c)[:, -1] for c in caches)                # [1, V] each
            diffs.append((a - b).abs().max().item())
        out[ps] = dict(identical=got == want, max_diff=max(diffs), median_diff=statistics.median(diffs))
    return out


@torch.inference_mode()
def ragged_batch(model, lengths=(5, 16, 17, 40), new_tokens=12, page_size=16) -> dict:
    """Sequences of different lengths prefilled one by one, then decoded together in one batch of a
    PagedCache; the tokens against each sequence generated alone."""
    w, cfg = model.weights, model.config
    prompts = [data.passages(model.tokenizer, n, count=1, seed=30 + n)[0] for n in lengths]
    cache = make_cache("paged", cfg, max(lengths) + new_tokens, batch_size=len(lengths), page_size=page_size)
    last = [forward_cached(torch.tensor([p]), w, cfg, cache.select([row]))[0, -1]  # prefill each row on its own
            for row, p in enumerate(prompts)]
    tokens = [[int(x.argmax())] for x in last]
    for _ in range(new_tokens - 1):                                     # then decode all rows at once
        logits = forward_cached(torch.tensor([[t[-1]] for t in tokens]), w, cfg, cache)   # [B, 1, V]
        for row, t in enumerate(tokens):
            t.append(int(logits[row, -1].argmax()))
    alone = [generate(CachedBackend(model, lambda p=p: make_cache("concat", cfg, len(p) + new_tokens)), p,
                      new_tokens).tokens for p in prompts]              # each sequence on its own, for reference
    return dict(identical=tokens == alone, lengths=list(lengths), tokens=tokens)


def plot_utilization(util: dict, path=None):
    fig, ax = plots.figure(height=4.6)
    for name, u in util.items():
        ax.plot(BLOCK_SIZES, [u[f"paged_{b}"] for b in BLOCK_SIZES], "o-", label=f"{name}: pages")
        color = ax.lines[-1].get_color()
        ax.axhline(u["contiguous_max"], ls=":", color=color, label=f"{name}: contiguous, {data.MAX_REQUEST_LEN:,}")
        ax.axhline(u["contiguous_budget"], ls="--", color=color,
                   label=f"{name}: contiguous, prompt + {ANSWER_BUDGET}")
    ax.set(xscale="log", ylim=(0, 1.02), xlabel="page size (positions per page)",
           ylabel="reserved memory holding tokens",
           title="KV memory utilization against page size (synthetic lengths)")
    ax.set_xticks(BLOCK_SIZES, [str(b) for b in BLOCK_SIZES])
    ax.minorticks_off()
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)
    return finish(fig, path)


PART_STYLE = {"tokens": ("token states", "#2b8a3e"), "future": ("reserved for future tokens", "#74c0fc"),
              "internal": ("internal fragmentation", "#f59f00"), "external": ("external fragmentation", "#e03131"),
              "free": ("free, too few for the next request", "#dee2e6")}
SCHEME_LABEL = {"contiguous_max": f"contiguous, {data.MAX_REQUEST_LEN:,}",
                "contiguous_budget": f"contiguous, prompt + {ANSWER_BUDGET}",
                "buddy": f"buddy, prompt + {ANSWER_BUDGET}", "paged": "pages of 16"}


def plot_breakdown(bd: dict, path=None):
    """One horizontal bar per allocator, one panel per data set: where the pool's positions go, over time."""
    fig, axes = plots.figure(nrows=len(bd), height=2.0 * len(bd) + 1.2, sharex=True)
    for ax, (name, schemes) in zip(np.atleast_1d(axes), bd.items(), strict=True):
        y = np.arange(len(schemes))[::-1]
        left = np.zeros(len(schemes))
        for part, (label, color) in PART_STYLE.items():
            share = np.array([r[part] * 100 for r in schemes.values()])
            ax.barh(y, share, left=left, color=color, edgecolor="white", lw=0.5, label=label)
            left += share
        for yi, r in zip(y, schemes.values(), strict=True):     # the token share, inside its segment if it fits
            inside = r["tokens"] > 0.1
            ax.text(1.5 if inside else r["tokens"] * 100 + 1, yi, f"{r['tokens']:.0%}", va="center",
                    color="white" if inside else "black", fontsize=9, weight="bold")
        ax.set_yticks(y, [SCHEME_LABEL[k] for k in schemes])
        ax.set(xlim=(0, 100), title=f"{name} (synthetic lengths)")
    ax.set_xlabel("share of the pool, averaged over the steps a request waits (%)")
    ax.legend(loc="upper center", bbox_to_anchor=(0.4, -0.3), ncol=2, frameon=False)
    return finish(fig, path)


def plot_block_tables(path=None):
    """The pages of a live PagedCache: three sequences of different lengths and a fork, drawn from its state."""
    import matplotlib.pyplot as plt

    model = load("tiny-llama")
    cache = make_cache("paged", model.config, 32, batch_size=3, page_size=4)  # a pool of 24 pages
    g = torch.Generator().manual_seed(0)
    for row, n in enumerate((9, 4, 14)):
        forward_cached(torch.randint(0, 320, (1, n), generator=g), model.weights, model.config, cache.select([row]))
    child = cache.select([0]).fork()                                    # shares sequence 0's pages
    forward_cached(torch.randint(0, 320, (1, 2), generator=g), model.weights, model.config, child)
    seqs = cache.seqs + child.seqs
    owners = {}
    for s in seqs:
        for p in cache.manager.block_table(s):
            owners.setdefault(p, []).append(s)
    fig, ax = plots.figure(height=3.3)
    colors, per_row = plt.get_cmap("tab10"), 12
    for p in range(cache.num_pages):
        who = owners.get(p, [])
        color = "white" if not who else ("lightgray" if len(who) > 1 else colors(seqs.index(who[0])))
        x, y = p % per_row, -(p // per_row)
        ax.add_patch(plt.Rectangle((x, y), 0.92, 0.92, facecolor=color, edgecolor="black", lw=0.8))
        ax.text(x + 0.46, y + 0.46, str(p), ha="center", va="center", fontsize=9, weight="bold")
    handles = []
    for s in seqs:
        shared = [p for p in cache.manager.block_table(s) if len(owners[p]) > 1]
        color = colors(seqs.index(s))
        label = f"sequence {s}, {cache.manager.length(s)} positions: block table {cache.manager.block_table(s)}"
        if shared:
            label += f" (pages {shared} shared)"
        handles.append(plt.Rectangle((0, 0), 1, 1, facecolor=color, edgecolor="black", label=label))
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="lightgray", edgecolor="black",
                                 label=f"shared by sequence {seqs[0]} and its fork {child.seqs[0]}"))
    handles.append(plt.Rectangle((0, 0), 1, 1, facecolor="white", edgecolor="black", label="free page"))
    rows = -(-cache.num_pages // per_row)
    ax.set(xlim=(-0.1, per_row), ylim=(-rows + 0.9, 1.0), aspect="equal",
           title=f"A pool of {cache.num_pages} pages of {cache.page_size} positions (cell: page id)")
    ax.axis("off")
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, 0.0), frameon=False)
    return finish(fig, path)


def plot_speed(times: dict, path=None):
    fig, (ax, ax_ratio) = plots.figure(ncols=2, height=3.9)
    contexts = sorted({L for _, L in times})
    for B in sorted({b for b, _ in times}):
        Ls = sorted(L for b, L in times if b == B)
        line, = ax.plot(Ls, [times[(B, L)]["paged"]["median"] * 1e3 for L in Ls], "o-", label=f"in place, B={B}")
        ax.plot(Ls, [times[(B, L)]["contiguous"]["median"] * 1e3 for L in Ls], "s--", color=line.get_color(),
                label=f"contiguous, B={B}")
        ax.plot(Ls, [times[(B, L)]["gather"]["median"] * 1e3 for L in Ls], "^:", color=line.get_color(),
                label=f"gathered, B={B}")
        ax_ratio.plot(Ls, [times[(B, L)]["ratio"] for L in Ls], "o-", color=line.get_color(),
                      label=f"in place, warm, B={B}")
        ax_ratio.plot(Ls, [times[(B, L)]["gather_ratio"] for L in Ls], "^:", color=line.get_color(),
                      label=f"gathered, warm, B={B}")
        for name, marker, label in (("cold", "x", "flushed"), ("one_thread", "+", "1 thread")):
            at = [L for L in Ls if name in times[(B, L)]]
            if at:
                ax_ratio.plot(at, [times[(B, L)][name]["ratio"] for L in at], marker, markersize=9,
                              color=line.get_color(), label=f"{label}, B={B}")
    ax.set(yscale="log", ylabel="median time (ms)", title="Decode attention, warm")
    ax_ratio.set(ylim=(0, None), ylabel="over pages / contiguous", title="Time ratio")
    for a in (ax, ax_ratio):
        a.set_xscale("log")
        a.set_xticks(contexts, [f"{L:,}" for L in contexts])
        a.minorticks_off()
        a.set_xlabel("context (positions)")
    for a in (ax, ax_ratio):                  # below the axes: inside, they covered the highest points
        a.legend(loc="upper center", bbox_to_anchor=(0.5, -0.22), ncol=2, frameon=False)
    return finish(fig, path)


def measure(quick_mode=None) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    smol = load("smollm2")
    lengths = {d: data.synthetic_lengths(d, s["requests"], seed=i) for i, d in enumerate(data.REQUEST_DATASETS)}
    budget = 2**30 // cache_bytes(smol.config, 1, 1, torch.float16)    # positions in 1 GiB of 16-bit SmolLM2 cache
    pool = budget - budget % 16                                         # the same, in whole pages of 16
    served = {d: data.synthetic_lengths(d, s["served"][d], seed=i) for i, d in enumerate(data.REQUEST_DATASETS)}
    return dict(
        settings=s, manifest=smol.manifest,
        means={d: (float(i.mean()), float(o.mean())) for d, (i, o) in lengths.items()},
        utilization={d: utilization(i, o) for d, (i, o) in lengths.items()},
        by_manager={d: utilization_by_manager(i[:s["manager_requests"]], o[:s["manager_requests"]])
                    for d, (i, o) in lengths.items()},
        concurrency={d: concurrency(i, o, budget) for d, (i, o) in lengths.items()}, budget_positions=budget,
        breakdown={d: breakdown(i, o, pool) for d, (i, o) in tqdm(served.items(), desc="serving")},
        pool_positions=pool,
        speed=decode_attention_times(s["contexts"], s["batches"], s["reps"], s["repeats"]),
        agreement=token_agreement(smol, s["page_sizes"], 37, s["new_tokens"]),
        ragged=ragged_batch(smol, new_tokens=s["new_tokens"] // 2),
    )


def values(m: dict) -> dict:
    """The section's values, from every part of the measurements that m holds: a notebook sets each part's
    verdicts beside the book's as soon as it has measured that part (lab.book.verdicts); record() writes them all."""
    values = {k: {} for k in ("utilization", "concurrency", "breakdown", "speed", "agreement") if k in m}
    for d, u in m.get("utilization", {}).items():
        values["utilization"][d] = {k: value(x * 100, "%") for k, x in u.items()}
        values["utilization"][d]["paged_16_by_manager"] = value(m["by_manager"][d] * 100, "%",
                                                                note="through the real BlockManager")
        values["utilization"][d]["mean_input"] = value(m["means"][d][0], "tokens", note=SYNTHETIC)
        values["utilization"][d]["mean_output"] = value(m["means"][d][1], "tokens", note=SYNTHETIC)
    for d, c in m.get("concurrency", {}).items():
        values["concurrency"][d] = {k: value(x, "requests") for k, x in c.items()}
    if "concurrency" in m:
        values["concurrency"]["budget_positions"] = value(m["budget_positions"], "positions",
                                                          note="1 GiB of 16-bit SmolLM2 cache")
    for d, bd in m.get("breakdown", {}).items():
        values["breakdown"][d] = {"requests": value(m["settings"]["served"][d], "requests", note=SYNTHETIC)}
        for scheme, r in bd.items():
            v = values["breakdown"][d][scheme] = {p: value(r[p] * 100, "%", note=f"{PART_STYLE[p][0]}, share of "
                                                           "the pool averaged over the steps a request waits")
                                                  for p in PARTS}
            v |= {"live": value(r["live"], "requests", note="live at once, averaged over those steps"),
                  "preemptions": value(r["preemptions"], "preemptions"), "steps": value(r["steps"], "steps")}
            if scheme == "paged":
                v |= {k: value(r[k], "pools", note=f"what {s} would set aside for the requests pages hold")
                      for k, s in (("bound_max", "contiguous_max"), ("bound_budget", "contiguous_budget"))}
    if "breakdown" in m:
        values["breakdown"]["pool_positions"] = value(m["pool_positions"], "positions",
                                                      note="1 GiB of 16-bit SmolLM2 cache, whole pages of 16")

    def timing(r):
        return {"paged_ms": value(r["paged"]["median"] * 1e3, "ms", min=r["paged"]["min"] * 1e3, n=r["paged"]["n"]),
                "gather_ms": value(r["gather"]["median"] * 1e3, "ms", min=r["gather"]["min"] * 1e3),
                "contiguous_ms": value(r["contiguous"]["median"] * 1e3, "ms", min=r["contiguous"]["min"] * 1e3),
                "ratio": value(r["ratio"], "x", note="pages read in place (paged_attention_cpu) / contiguous"),
                "gather_ratio": value(r["gather_ratio"], "x", note="pages gathered (paged_attention_gather) / "
                                                                   "contiguous"),
                "max_diff": value(r["max_diff"], "logit"),
                "threads": value(r["paged"]["threads"], "threads")}

    def spread(r):
        return {"repeats": value(r["repeats"], "runs", note="on fresh data, in turns with the other cases"),
                "ratio_lowest": value(r["ratio_range"][0], "x", n=r["repeats"]),
                "ratio_highest": value(r["ratio_range"][1], "x", n=r["repeats"])}

    for (B, L), r in m.get("speed", {}).items():
        entry = values["speed"].setdefault(f"B{B}", {})[f"T{L}"] = timing(r)
        if "cold" in r:
            entry |= spread(r)
            for name in LONG_CASES:
                entry[name] = timing(r[name]) | spread(r[name])
    for ps, r in m.get("agreement", {}).items():
        values["agreement"][f"page{ps}"] = {"identical": value(r["identical"], None),
                                            "max_abs": value(r["max_diff"], "logit"),
                                            "median_abs": value(r["median_diff"], "logit")}
    if "agreement" in m:
        values["agreement"]["ragged_batch_identical"] = value(m["ragged"]["identical"], None,
                                                              note=f"lengths {m['ragged']['lengths']}")
    return values


def record(m: dict, drawn: dict | None = None) -> dict:
    """Write section ch05 and its figures. drawn: figures already drawn (a notebook's), saved, not redrawn:
    {"utilization": fig, "breakdown": fig, "block_tables": fig, "speed": fig}."""
    figs, drawn = figures_dir(), drawn or {}
    plots = {"utilization": lambda path: plot_utilization(m["utilization"], path),
             "breakdown": lambda path: plot_breakdown(m["breakdown"], path),
             "block_tables": plot_block_tables, "speed": lambda path: plot_speed(m["speed"], path)}
    for name, plot in plots.items():
        path = figs / f"ch05_{name}.png"
        if name in drawn:
            finish(drawn[name], path)
        else:
            plot(path)
    v = values(m)
    figures = {"utilization": {"path": figs / "ch05_utilization.png",
                               "caption": "Share of reserved KV memory holding real tokens against page size"},
               "breakdown": {"path": figs / "ch05_breakdown.png",
                             "caption": "Where a pool's KV memory goes over time, per allocator (synthetic lengths)"},
               "block_tables": {"path": figs / "ch05_block_tables.png",
                                "caption": "A live cache's pages: page ids, owners and block tables"},
               "speed": {"path": figs / "ch05_speed.png",
                         "caption": "Decode attention over pages against a contiguous cache, CPU"}}
    write_section(SECTION, v, provenance(manifest=m["manifest"]), figures=figures)
    return v
