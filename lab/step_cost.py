"""What one decode step costs, measured.

- `step_times`: a step's time uncached and through each cache design, per context; `cache_step_times`: a
  step's time through each of several caches (any factories) at one context;
- `attention_share`: the share of a cached step's time attention takes (timed, with and without it);
  `counted_step`: its FLOPs counted by PyTorch; `predicted_shares`: the share FLOPs and bytes read predict;
- `attention_case`: one decode attention over pages, read in place and gathered, against a contiguous cache;
- `profile`, `step_costs`: where a serving engine's decode step spends its time; `run_timed`: a serving
  engine's run with every step timed (`seconds_between` sums a stretch of it); `engine_steps`: the decode
  steps of several engines (plain, hybrid, radix) at the same batch and positions, side by side.

Every timing runs its variants in interleaved rounds (`lab.bench.time_rounds`): each round runs every
variant once, in turn, so that a slow spell of a shared machine hits all of them alike; ratios are taken
round by round (`lab.bench.ratio_summary`). Token ids are seeded random: a step's time does not depend on
the text. Chapters 3, 5, 7 and 8, the GPU script and the exercises measure with these.
"""

import threading
from time import perf_counter

import numpy as np
import torch
import torch.nn.functional as F
from torch.utils.flop_counter import FlopCounterMode
from tqdm.auto import tqdm

from .bench import flush_caches, ratio_summary, time_rounds
from .cache import cache_bytes, make_cache
from .cache.pool import StepBatch
from .engine import ServingEngine, drive, serving
from .kernels import paged_attention_cpu, paged_attention_gather
from .kernels.pages import paged_copy
from .loadgen import random_prompts
from .models import forward, forward_cached, llama
from .results import not_run, value


@torch.inference_mode()
def step_times(model, contexts, rounds=11, warmup=1, designs=("concat", "static"), progress=True) -> dict:
    """One decode step at context T: uncached (a forward over T + 1 positions) and through each cache
    holding T positions (one new position), timed in interleaved rounds; before every call each cache is
    cropped back to T positions, untimed. Returns {T: {"uncached": summary, design: summary}}, each summary
    with its per-round samples."""
    cfg, w, device = model.config, model.weights, model.device
    out = {}
    for T in tqdm(contexts, desc=f"step time {model.name}", disable=not progress):
        g = torch.Generator().manual_seed(T)
        ids = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=g).to(device)     # [1, T+1]
        caches = {d: make_cache(d, cfg, T + 1, device=device) for d in designs}
        for cache in caches.values():
            forward_cached(ids[:, :T], w, cfg, cache)                                  # prefill, untimed
        fns = {"uncached": lambda ids=ids: forward(ids, w, cfg, last_only=True)}
        fns |= {d: lambda c=c, ids=ids: forward_cached(ids[:, -1:], w, cfg, c, last_only=True)
                for d, c in caches.items()}

        def back_to_T(T=T, caches=caches):
            for c in caches.values():
                c.crop(T)                                  # drop the position the last call added

        out[T] = time_rounds(fns, warmup, rounds, setup=back_to_T, device=device, samples=True)
    return out


def cache_step_times(model, context: int, cases: dict, rounds=9, seed=0) -> dict:
    """Seconds per decode step after a prompt of `context` seeded random ids, one cache per design (`cases`:
    {name: make_cache(config, batch_size)}), timed in rounds
    (each design once per round) so a slow spell of a shared machine hits all alike. Each step appends a
    position: over 2 + rounds steps the caches grow by under 2% at context 1,024."""
    w, cfg = model.weights, model.config
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, cfg.vocab_size, (1, context), generator=g)
    token = prompt[:, -1:]
    caches = {name: make(cfg, 1) for name, make in cases.items()}
    with torch.inference_mode():
        for cache in caches.values():
            forward_cached(prompt, w, cfg, cache, last_only=True)
    fns = {name: (lambda c=cache: forward_cached(token, w, cfg, c)) for name, cache in caches.items()}
    return time_rounds(fns, warmup=2, rounds=rounds)


def skip_attention(cache):
    """An attend(i, q, k, v) that stores k, v like the real one but returns q (the attention output's shape,
    `[B, H_q, 1, D]`) instead of attending: the step without the attention computation."""
    def attend(i, q, k, v):
        cache.update(i, k, v)
        return q
    return attend


@torch.inference_mode()
def attention_share(model, contexts, rounds=15, warmup=1, progress=True) -> dict:
    """The fraction of one cached decode step's time spent in attention, per context T.

    A StaticCache is filled with T positions of random keys and values (the time does not depend on the
    values; a prefill of 4,096 positions would take minutes). Two variants of the same decode step run in
    interleaved rounds: the real one, and one whose attention returns its query unchanged, a tensor of the
    same shape (the cache is still written). Per round, share = 1 - without / with. Returns
    {T: {"with": summary, "without": summary, "share": ratio-style summary of the shares}}."""
    cfg, w, device = model.config, model.weights, model.device
    out = {}
    for T in tqdm(contexts, desc=f"attention share {model.name}", disable=not progress):
        g = torch.Generator().manual_seed(T)
        cache = make_cache("static", cfg, T + 1, device=device)
        shape = (1, cfg.n_kv_heads, T, cfg.head_dim)                                    # [1, H_kv, T, D]
        for i in range(cfg.n_layers):
            cache.update(i, torch.randn(shape, generator=g).to(device), torch.randn(shape, generator=g).to(device))
        cache.advance(T)
        ids = torch.randint(0, cfg.vocab_size, (1, 1), generator=g).to(device)          # [1, 1]
        skip = skip_attention(cache)

        def without(ids=ids, cache=cache, skip=skip):
            cache.attend = skip                                   # forward_cached uses a cache's own attend
            try:
                forward_cached(ids, w, cfg, cache, last_only=True)
            finally:
                del cache.attend

        fns = {"with": lambda ids=ids, cache=cache: forward_cached(ids, w, cfg, cache, last_only=True),
               "without": without}
        r = time_rounds(fns, warmup, rounds, setup=lambda T=T, cache=cache: cache.crop(T), device=device,
                        samples=True)
        share = ratio_summary([a - b for a, b in zip(r["with"]["samples"], r["without"]["samples"], strict=True)],
                              r["with"]["samples"])
        out[T] = dict(r, share=share)
        del cache
    return out


def counted_step(model, T):
    """FLOPs of one cached decode step at context T, counted by PyTorch while the step runs.

    The step is `forward_cached` through a StaticCache whose attend writes attention out as two matrix
    products (scores = q k^T, then weights v) so that the counter sees it; projections, MLP and output
    head are the model's own code. Returns (total, attention).
    """
    cfg, w = model.config, model.weights
    cache = make_cache("static", cfg, T + 1)
    ids = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=torch.Generator().manual_seed(T))
    attention_flops = 0

    def attend(i, q, k, v):
        nonlocal attention_flops
        keys, values = cache.update(i, k, v)                       # [1, H_kv, T+1, D]
        g = q.shape[1] // keys.shape[1]
        keys, values = keys.repeat_interleave(g, 1), values.repeat_interleave(g, 1)
        with FlopCounterMode(display=False) as inner:
            weights = torch.softmax(q @ keys.transpose(-2, -1) / q.shape[-1] ** 0.5, -1)  # [1, H, 1, T+1]
            out = weights @ values                                                          # [1, H, 1, D]
        attention_flops += inner.get_total_flops()
        return out

    with torch.inference_mode():
        cache.length = T  # the counts do not depend on the cached values: skip the prefill, keep the zeros
        cache.attend = attend                                      # forward_cached calls cache.attend
        with FlopCounterMode(display=False) as outer:
            forward_cached(ids[:, T:], w, cfg, cache)
    return outer.get_total_flops(), attention_flops


def predicted_shares(model, contexts) -> dict:
    """What attention's share would be if time followed FLOPs, or bytes read, per context T.

    FLOPs: counted by PyTorch's FLOP counter on a real step (lab.step_cost.counted_step). Bytes: the
    keys and values of T + 1 positions, against every weight read once (the output head reads the whole
    embedding; GPT-2's table of position embeddings, read one row at a time, is counted whole, about 1%)."""
    weight_bytes = sum(t.nbytes for t in model.weights.values())
    out = {}
    for T in contexts:
        total, attention = counted_step(model, T)
        kv = cache_bytes(model.config, T + 1, dtype=torch.float32)
        out[T] = dict(flops=attention / total, bytes=kv / (kv + weight_bytes))
    return out


@torch.inference_mode()
def attention_case(B, L, reps=9, page_size=16, heads=(9, 3), head_dim=64, seed=0, cold=False,
                   threads=None) -> dict:
    """One decode attention at context L, batch B, three ways: over pages read in place
    (`paged_attention_cpu`, what a PagedCache uses on the CPU), over pages gathered into a copy first
    (`paged_attention_gather`), and over a contiguous cache (SDPA); timed in interleaved rounds. The pages
    are scattered at random over the pool. ratio = median paged time / median contiguous time;
    gather_ratio the same for the gather. cold: flush the CPU's caches before every call, as the other
    layers of a real decode step would, so all read main memory. threads: run on this many CPU threads
    (default: torch's current setting, restored afterwards)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(B, heads[0], head_dim, generator=g)                         # [B, H_q, D]
    k, v = (torch.randn(B, heads[1], L, head_dim, generator=g) for _ in range(2))  # [B, H_kv, L, D]
    pool_k, pool_v, tables, lengths = paged_copy(k, v, page_size, g)
    fns = {"paged": lambda: paged_attention_cpu(q, pool_k, pool_v, tables, lengths),           # [B, H_q, D]
           "gather": lambda: paged_attention_gather(q, pool_k, pool_v, tables, lengths),
           "contiguous": lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True)[:, :, 0]}
    before = torch.get_num_threads()
    torch.set_num_threads(threads or before)
    try:
        r = time_rounds(fns, warmup=2, rounds=reps, setup=flush_caches if cold else None)
    finally:
        torch.set_num_threads(before)
    want = fns["contiguous"]()
    return dict(r, ratio=r["paged"]["median"] / r["contiguous"]["median"],
                gather_ratio=r["gather"]["median"] / r["contiguous"]["median"],
                max_diff=float((fns["paged"]() - want).abs().max()),
                gather_max_diff=float((fns["gather"]() - want).abs().max()))


# ---- a serving engine's decode step, by part -----------------------------------------------------------------

def profile(model, batch, context, steps=8, packed=True, fused=True, page_size=16, fast=True) -> dict:
    """Where one decode step's time goes with `batch` sequences at `context` positions: the check that the
    weights are those the pages were computed with (`identity`: chapter 4's owner), scheduling (Python),
    building the step's batch (block tables, slots), attention (`attend`, every layer), the rest of the
    forward (matrix products, norms, sampling). Seconds per step, medians over `steps` steps. packed=False
    runs the projections through F.linear instead of the engine's prepacked weights, and the reference
    layers; fused=False keeps the prepacked products with the reference layers (`llama.block`) instead of
    the fused ones; fast=False keeps a step the fused step would take in forward_cached too (else it is one C++ call,
    lab/engine/fast.py, and its attention is inside the forward). The engine holds pages of `page_size`
    positions and takes 256 tokens a step; the prompts are seeded random ids."""

    if not 0 < batch < 256:
        raise ValueError(f"profile takes 1 to 255 sequences (a step holds 256 tokens, one per decoder), got {batch}")
    parts = {"identity": [], "schedule": [], "batch": [], "attention": [], "forward": []}
    # enough new tokens that the first prefilled still decode when the last starts: a step of 256 tokens
    # prefills what the decoders (up to `batch`) leave of it; and a page to spare per request: admission
    # keeps a free page for every running one
    new = steps + 3 + -(-batch * context // (256 - batch))
    eng = ServingEngine(model, batch * (-(-(context + new) // page_size) + 1), page_size, 256, prefix_caching=False,
                        fast_decode=fast and packed and fused)
    if not packed:
        eng.weights = model.weights
    elif not fused:
        eng.weights.block = llama.block
    orig_schedule, orig_init, orig_attend = eng._schedule, StepBatch.__init__, StepBatch.attend
    orig_owner = serving.owner
    acc, ready = {}, [False]                   # ready: every prompt prefilled, the steps are decodes

    def timed(name, fn):
        def wrapper(*a, **k):
            t = perf_counter()
            try:
                return fn(*a, **k)
            finally:
                acc[name] = acc.get(name, 0.0) + perf_counter() - t
        return wrapper

    def record(engine, new):                   # each decode step: its parts, the rest is the forward
        t0, t1 = engine.stats["step_times"][-1]            # (the identity check runs before t0)
        if ready[0] and engine.stats["batch_sizes"][-1] != batch:
            raise RuntimeError(f"a profiled step ran {engine.stats['batch_sizes'][-1]} sequences, not {batch}")
        for k in ("identity", "schedule", "batch", "attention") if ready[0] else ():
            parts[k].append(acc.get(k, 0.0))
        if ready[0]:
            parts["forward"].append(t1 - t0 - sum(v for k, v in acc.items() if k != "identity"))
        ready[0] = ready[0] or prefilled(engine)
        acc.clear()

    eng._schedule = timed("schedule", orig_schedule)
    StepBatch.__init__ = timed("batch", orig_init)
    StepBatch.attend = timed("attention", orig_attend)
    serving.owner = timed("identity", orig_owner)
    try:
        drive(eng, random_prompts(batch, context, 50, model.config.vocab_size), new, on_step=record,
              until=lambda engine: len(parts["forward"]) == steps)
    finally:
        StepBatch.__init__, StepBatch.attend, serving.owner = orig_init, orig_attend, orig_owner
    med = {k: float(np.median(v)) for k, v in parts.items()}
    return dict(batch=batch, context=context, parts=med, step_s=sum(med.values()))


def step_costs(model, batch, context) -> dict:
    """The reference decode step's time (profile, fast=False: forced even on a batch the fused step takes) four ways: as
    the engine runs it; with the reference layers instead of the fused ones (`unfused`); with F.linear instead of
    prepacked weights as well (`unpacked`); and run from a second thread, as a server that steps its engine off the
    main thread would."""

    out = {"engine": profile(model, batch, context, fast=False),
           "unfused": profile(model, batch, context, fused=False),
           "unpacked": profile(model, batch, context, packed=False)}
    worker = threading.Thread(target=lambda: out.update(thread=profile(model, batch, context, fast=False)))
    worker.start()
    worker.join()
    return out


def profile_values(pr: dict) -> dict:
    """A `profile` as results values: each part's share of the step (%, with its ms), the step's ms."""
    out = {k: value(100 * t / pr["step_s"], "%", ms=t * 1e3) for k, t in pr["parts"].items()}
    return out | {"step_ms": value(pr["step_s"] * 1e3, "ms"), "sequences": value(pr["batch"], "sequences"),
                  "positions": value(pr["context"], "positions", note="each sequence's, at the start")}


def step_costs_values(sc: dict) -> dict:
    """`step_costs` as results values: each way's step, attention and forward ms; the fused layers' gain,
    prepacking's gain (both with the reference layers) and the cost of stepping from a second thread, as
    ratios of step times."""
    ms = lambda t: value(t * 1e3, "ms")
    out = {k: {"step_ms": ms(r["step_s"]), "attention_ms": ms(r["parts"]["attention"]),
               "forward_ms": ms(r["parts"]["forward"])} for k, r in sc.items()}
    return out | {"fusing_gain": value(sc["unfused"]["step_s"] / sc["engine"]["step_s"], "x"),
                  "packing_gain": value(sc["unpacked"]["step_s"] / sc["unfused"]["step_s"], "x"),
                  "thread_cost": value(sc["thread"]["step_s"] / sc["engine"]["step_s"], "x")}


def run_timed(engine, prompts_, max_new_tokens, arrivals=None) -> dict:
    """`drive` the prompts through the engine (each added at its arrival step) and time every step. Returns
    outputs, per-step seconds, and the timeline of these requests."""
    start = engine.stats["steps"]
    rids = drive(engine, prompts_, max_new_tokens, arrivals)
    times = [end - began for began, end in engine.stats["step_times"][start:]]
    line = {r["id"]: r for r in engine.timeline()}
    return dict(outputs=[engine.output(r) for r in rids], step_s=times, start=start,
                timeline=[line[r] for r in rids], seconds=sum(times))


def seconds_between(r, first, last):
    """Wall seconds of steps first .. last inclusive (engine step numbers) of a run_timed result."""
    return sum(r["step_s"][first - r["start"]:last - r["start"] + 1])


def timeline_values(timeline: list) -> dict:
    """What happened to each request of a run_timed timeline, as results values: the engine step it arrived at, was
    first and last admitted at, got its first token at (the end of its prefill) and finished at, how often it
    was preempted and first when. Chapter 8 describes its timeline figure from these."""
    step = lambda s: value(s, "step") if s is not None else not_run("did not happen in this run", "step")
    first = lambda xs: xs[0] if xs else None
    return {f"r{r['id']}": {"prompt": value(r["prompt_tokens"], "tokens"),
                            "output": value(r["output_tokens"], "tokens"), "arrived": step(r["arrived"]),
                            "admitted": step(first(r["admitted"])),
                            "last_admitted": step(r["admitted"][-1] if r["admitted"] else None),
                            "first_token": step(r["first_token"]), "finished": step(r["finished"]),
                            "preempted": value(len(r["preempted"]), "times"),
                            "preempted_at": step(first(r["preempted"]))} for r in timeline}


def decoding_spans(r: dict, end: int) -> list:
    """The (first step, steps) spans in which request r of a timeline decoded: after its first token, in no
    prefill chunk, and not between a preemption and its next admission. end: the run's last step."""
    chunks, spans, start = {s for s, _ in r["chunks"]}, [], None
    done = r["finished"] if r["finished"] is not None else end
    first = r["first_token"] if r["first_token"] is not None else end
    out_of_pool = lambda step: any(p <= step < next((a for a in r["admitted"] if a > p), end + 1)
                                   for p in r["preempted"])
    for step in range(r["arrived"], done + 2):
        decoding = first < step <= done and step not in chunks and not out_of_pool(step)
        if decoding and start is None:
            start = step
        if not decoding and start is not None:
            spans.append((start, step - start))
            start = None
    return spans


# ---- step_times over several models, within a time limit --------------------------------------------------------

def step_sweep(contexts: dict, load, rounds=11, warmup=1, deadline=float("inf")) -> tuple:
    """step_times over several models, until the deadline (time.perf_counter()) has passed: contexts is
    {name: [T, ...]}; each model is made by load(name) in turn and dropped after its contexts, the longest
    first. Returns ({(name, T): step_times' row for T}, {name: the model's manifest})."""
    steps, manifests = {}, {}
    for name, Ts in contexts.items():
        if perf_counter() > deadline:
            break
        model = load(name)
        manifests[name] = model.manifest
        for T in sorted(Ts, reverse=True):
            if perf_counter() > deadline:
                break
            steps[name, T] = step_times(model, [T], rounds, warmup, progress=False)[T]
        del model
    return steps, manifests


def prefilled(engine) -> bool:
    """Every request admitted and past its prompt: the next step decodes them all."""
    return not engine.waiting and all(r.num_tokens - r.computed == 1 for r in engine.running)


def engine_steps(engines: dict, prompts, rounds=9, warmup=2, base="plain", new_tokens=64) -> dict:
    """A decode step of several serving engines at the same batch and positions (name -> ServingEngine):
    each takes `prompts` (up to `new_tokens` each: enough to outlast the prefill and the rounds), prefills
    them, then steps in interleaved rounds, every step a decode of all of them. Returns, per engine, its
    step's median seconds, the KV bytes that step reads (every layer's keys and values it attends to: a
    local layer's window and sinks only) and, beside `base`, the ratio of their step times round by round."""
    for engine in engines.values():
        drive(engine, prompts, new_tokens, until=prefilled)
    t = time_rounds({name: e.step for name, e in engines.items()}, warmup=warmup, rounds=rounds, samples=True)
    if any(e.stats["batch_sizes"][-1] != len(prompts) for e in engines.values()):
        raise RuntimeError("a timed step did not decode every prompt")
    out = {}
    for name, e in engines.items():
        cfg = e.model.config
        rules = [cfg.window_of(j) for j in range(cfg.kv_layout[0])]              # (window, sinks) per layer
        read = sum(min(r.computed, w + s) if w else r.computed for r in e.running for w, s in rules)
        per_layer = cfg.kv_bytes_per_position(e.pool.dtype) // cfg.kv_layout[0]  # one position of one layer
        out[name] = dict(step_s=t[name]["median"], kv_read_bytes=read * per_layer,
                         over_base=ratio_summary(t[name]["samples"], t[base]["samples"]))
    return out
