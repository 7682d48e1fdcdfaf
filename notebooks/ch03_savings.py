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
# # Chapter 3 — What the cache saves
#
# Chapter 2 showed that a cached forward computes the same function as recomputation. This chapter
# measures what the cache buys and what it costs:
#
# - the time of one decode step against the context length $T$, with and without a cache;
# - where the time of a cached step goes: how much of it is attention over the cache;
# - the engine end to end, generating tokens;
# - the lab's cached decode against the transformers library's own;
# - the memory each cache design really takes.
#
# Everything runs on this machine's CPU. In quick mode (the default when you open the notebook) the
# sweeps are short and the numbers go to a temporary results file; `make results` runs the full sweeps.

# %%
import lab  # first, before torch: it sets OpenMP's wait policy, which torch reads once, when it loads

import platform
import time

import pandas as pd
import torch
import transformers

from lab import memory, results, roofline, step_cost
from lab.cache import StaticCache
from lab.experiments import ch03_savings as ch03
from lab.experiments import roofline as roofline_exp
from lab.experiments.tables import show
from lab.models import forward, forward_cached, load
from lab.peers import hf_generate
from lab.book.verdicts import beside

print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"pandas {pd.__version__}, threads {torch.get_num_threads()}, CUDA available: {torch.cuda.is_available()}")
print(lab.threads.describe())
QUICK = results.quick()
S, FULL = ch03.settings(QUICK), ch03.settings(False)      # FULL: the book's settings, to say what quick mode skips
S["roofline"], FULL_ROOFLINE = roofline_exp.settings(QUICK), roofline_exp.settings(False)
FIGS = results.figures_dir()
print("quick mode (short sweeps; a temporary results file)" if QUICK else "full mode",
      "-> results in", results.results_path())

# %% [markdown]
# ## Timing one step by hand
#
# What is measured: one **decode step**, the work of producing the next token when $T$ tokens came before.
#
# - *Without a cache* the model runs over all $T + 1$ positions again (only the last position's logits
#   are needed).
# - *With a cache* holding the $T$ earlier positions' keys and values, it runs over the one new position.
#
# A timing needs three precautions. The first call of anything is slow (memory is allocated, kernels are
# picked), so it is a warm-up and not counted. One call is noisy, so we repeat it and take the median.
# And the cached step adds one position to the cache, so before each call the cache is cropped back to
# $T$ positions; cropping only sets a length, so it costs nothing worth timing.
#
# Here it is by hand, with `time.perf_counter`, for SmolLM2 at two contexts.

# %%
smol, gpt2 = load("smollm2"), load("gpt2-random")
cfg, w = smol.config, smol.weights


def median_ms(fn, reps=5):
    fn()                                                            # warm-up, not counted
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[reps // 2] * 1e3


@torch.inference_mode()
def one_step_ms(T):
    """(uncached, cached) milliseconds of one SmolLM2 decode step after T tokens."""
    ids = torch.randint(0, cfg.vocab_size, (1, T + 1))                # [1, T+1]
    cache = StaticCache(cfg, T + 1)
    forward_cached(ids[:, :T], w, cfg, cache)                          # prefill the T earlier positions
    uncached = median_ms(lambda: forward(ids, w, cfg, last_only=True))
    cached = median_ms(lambda: (cache.crop(T), forward_cached(ids[:, T:], w, cfg, cache)))
    return uncached, cached


by_hand = {T: one_step_ms(T) for T in (16, 256)}
for T, (uncached, cached) in by_hand.items():
    print(f"T={T:>4}: uncached {uncached:6.3g} ms, cached {cached:6.3g} ms, speedup {uncached / cached:5.3g}x")
(u16, c16), (u256, c256) = by_hand.values()
print(f"16x the context: the uncached step takes {u256 / u16:.1f}x as long, the cached one {c256 / c16:.2f}x")


# %% [markdown]
# The uncached step grows with $T$; the cached one, far less. That is the chapter in two lines. The
# rest makes the measurement trustworthy and asks where the remaining time goes.
#
# ## Why interleaved rounds
#
# The timings above run one variant's repetitions back to back, then the other's. On a shared machine a
# slow spell (another process, a change of clock frequency) can land on one block and not the other,
# and the ratio of two medians then measures the spell. `lab.bench.time_rounds` interleaves instead:
# each **round** runs every variant once, in turn, so a slow spell hits all of them alike. A speedup is
# taken per round (the uncached time over the cached time *of the same round*), and we report the median
# over rounds with the lowest and highest round beside it, so a single lucky sample cannot make the
# headline.
#
# `lab.step_cost.step_times` does this for three variants per context (uncached, a concatenating cache, a static
# cache). The sweep starts at $T = 1$, a single cached position, so that the point where the cache starts
# to pay is found rather than assumed.

# %%
times = {m.name: step_cost.step_times(m, S["contexts"][m.name], S["rounds"], S["warmup"]) for m in (gpt2, smol)}
rows = []
for name, by_T in times.items():
    sp = ch03.speedups(by_T)
    for T, row in by_T.items():
        ms = {f"{d} (ms)": row[d]["median"] * 1e3 for d in ("uncached", "concat", "static")}
        rows.append({"model": name, "T": T, **ms,
                     "speedup, static (×)": sp[T]["static"]["median"],
                     "lowest round (×)": sp[T]["static"]["min"], "highest round (×)": sp[T]["static"]["max"],
                     "speedup, concat (×)": sp[T]["concat"]["median"]})
    print(f"{name}: the static cache is faster than recomputation from T = {ch03.pays_from(by_T)} on")
ch03.plot_step_times(times, FIGS / "ch03_step_time.png")
show(pd.DataFrame(rows).set_index(["model", "T"]))

# %%
for name, by_T in times.items():
    sp = ch03.speedups(by_T)
    Ts = list(sp)
    print(f"{name}: speedup {sp[Ts[0]]['static']['median']:.3g}x at T = {Ts[0]}, "
          f"{sp[Ts[-1]]['static']['median']:.3g}x at T = {Ts[-1]}: "
          + ("it grows with T" if sp[Ts[-1]]["static"]["median"] > sp[Ts[0]]["static"]["median"] else "no growth"))

# %%
m = dict(settings=S, manifests={"smollm2": smol.manifest, "gpt2-random": gpt2.manifest}, times=times)
beside("ch03", "ch03.speedup", "ch03.pays_from", values=ch03.values(m),
       why=f"your run times {S['rounds']} rounds at each context, the book {FULL['rounds']}: with few rounds one "
           "slow spell of the machine moves a median, most of all at the shortest contexts, where the cache "
           "saves least.")

# %% [markdown]
# What to read in the table: the speedup should grow about in proportion to $T$, because the uncached
# step's work grows with $T$ and the cached step's does not (apart from attention, below). At $T = 1$ recomputation
# processes two positions and the cached step one, and both read every weight once: the first rows say
# whether a cache already pays for a single cached position. A speedup whose rounds fall on both sides
# of 1 means "the same speed".
#
# ## Which cache design is faster?
#
# The concatenating cache copies every layer's keys and values into a new tensor at each step; the static
# cache writes one position in place and hands attention a view of a larger buffer. Neither cost is
# obviously larger, so we measure: the ratio concat / static per round, and a verdict only when three
# rounds of four or more agree (the interquartile range of the ratio lies on one side of 1).

# %%
show(pd.DataFrame([{"model": name, "T": T, "concat / static, median": r["median"], "first quartile": r["q1"],
                    "third quartile": r["q3"], "faster": r["faster"]}
                   for name, by_T in times.items() for T, r in ch03.faster_design(by_T).items()]
                  ).set_index(["model", "T"]), caption="step time ratio per round")

# %% [markdown]
# ## Where the time of a cached step goes
#
# Counting FLOPs (exercise 2 below) gives attention a large part of a SmolLM2 cached step at 4,096
# positions. The clock may disagree, so we measure it: fill a static cache with $T$ positions of random
# keys and values (the time does not depend on the values, and it spares a long prefill), then time the
# same decode step twice per round — as it is, and with attention replaced by a no-op that returns the
# query (a tensor of the same shape; the new key and value are still written). The share of attention is
# $1 - \text{without} / \text{with}$, per round.
#
# Beside it, two predictions: the share of the step's **FLOPs** (counted by PyTorch's FLOP counter) and
# the share of the **bytes** it reads (the cached keys and values against every weight read once). A
# decode step multiplies matrices by a single vector, which reads each weight once for one multiply-add;
# if memory, not arithmetic, sets the pace, the time follows the bytes.

# %%
shares = {m.name: step_cost.attention_share(m, S["share_contexts"][m.name], S["share_rounds"])
          for m in (gpt2, smol)}
predicted = {m.name: step_cost.predicted_shares(m, S["share_contexts"][m.name]) for m in (gpt2, smol)}
ch03.plot_attention_share(shares, predicted, FIGS / "ch03_attention_share.png")
shown = {"measured": lambda r, p: r["share"]["median"], "lowest round": lambda r, p: r["share"]["min"],
         "highest round": lambda r, p: r["share"]["max"], "FLOPs predict": lambda r, p: p["flops"],
         "bytes predict": lambda r, p: p["bytes"]}
show(pd.DataFrame([{"model": name, "T": T} | {k: f(r, predicted[name][T]) for k, f in shown.items()}
                   for name, by_T in shares.items() for T, r in by_T.items()]).set_index(["model", "T"]),
     caption="attention's share of a cached decode step", percent=list(shown))

# %%
m |= dict(shares=shares, predicted=predicted)
beside("ch03", "ch03.attention_share", "ch03.attention_flop_share", "ch03.attention_byte_share",
       values=ch03.values(m),
       why=f"your run measures the share in {S['share_rounds']} rounds, the book in {FULL['share_rounds']}; the "
           "FLOPs and bytes predicted are counted, not timed, and agree with the book's wherever a context was run.")

# %% [markdown]
# A lowest round below zero is no negative cost: in that round the step without attention happened to take
# longer than the step with it, because something else ran on the machine. At short contexts attention is
# a few percent of the step, smaller than such noise; the median over rounds is the measurement.
#
# SmolLM2's 9 query heads share 3 key-value heads, so each cached key serves three queries: attention does
# three multiply-adds per 4 bytes read where a weight matrix does one. Its FLOP share therefore overstates
# its byte share; GPT-2's shape has one key-value head per query head, and the two predictions nearly
# coincide. Which prediction the measurement follows is recorded in results.json
# (`ch03.attention_share_follows`).
#
# ## The roofline: the time a step's bytes and FLOPs allow
#
# A decode step multiplies every weight matrix by one vector per sequence, so it must at least *read* every
# weight once, plus each sequence's cached keys and values. However clever the code, a step cannot take less
# than those bytes over the fastest rate at which this machine reads memory, nor less than its FLOPs over the
# fastest rate at which it computes: the **roofline**. A benchmark only estimates those rates (a plain sum
# below), so a step can beat the estimate, never the machine. First by hand, for SmolLM2 in float32 at 512
# cached positions:

# %%
c = smol.config
w = smol.weights
matrices = [t for k, t in w.items() if k.endswith("proj.weight")] + [w["model.embed_tokens.weight"]]
weight_bytes = sum(t.numel() * t.element_size() for t in matrices)   # the output head is the embedding (tied)
cache_bytes = 2 * c.n_layers * c.n_kv_heads * c.head_dim * 512 * 4    # keys and values, every layer, float32
x = torch.ones(S["roofline"]["buffer"] // 4)                          # far larger than the processor's caches
x.sum()
t0 = time.perf_counter()
x.sum()
read_gb_s = x.numel() * 4 / (time.perf_counter() - t0) / 1e9
del x
print(f"weights {weight_bytes / 1e6:,.0f} MB + cache {cache_bytes / 1e6:,.1f} MB, read at {read_gb_s:.1f} GB/s: "
      f"{(weight_bytes + cache_bytes) / read_gb_s / 1e6:.1f} ms a step at that rate")
assert weight_bytes == roofline.step_model(c, batch=1, context=512)["weight_bytes"]

# %% [markdown]
# `lab.roofline` counts the same bytes (and the FLOPs) for any batch and context. The experiment estimates
# the ceilings more carefully (the fastest of several reads, a copy, and a large matrix product for the peak
# FLOP rate), then times the serving engine's decode step of 1 to 16 sequences and sets each beside its bound.
# `fraction` is the bound over the measured step: 100% would be a step that only reads its bytes at the
# sum's rate, and over 100% one that reads them faster than the sum did. Then
# one sequence's step by part, through the reference step (`forward_cached`): the engine's own work (the
# identity check, scheduling, the step's batch), attention, the matrix products timed alone (every weight
# read once), and the rest of the forward; beside it the same step in one C++ call (`lab/engine/fast.py`),
# as the engine runs a step of a few decodes.

# %%
rl = roofline_exp.measure(QUICK)
roofline_exp.plot(rl, FIGS / "roofline.png")
print(f"read {rl['machine']['read_gb_s']:.1f} GB/s, copy {rl['machine']['copy_gb_s']:.1f} GB/s, peak "
      + ", ".join(f"{d} {f:,.0f} GFLOP/s" for d, f in rl["machine"]["flops"].items()))
show(pd.DataFrame([{"dtype": d, "sequences": b, "T": t, "step (ms)": x["step_s"] * 1e3,
                    "roofline (ms)": bd["bound_s"] * 1e3, "bound by": bd["bound_by"],
                    "fraction": bd["bound_s"] / x["step_s"]}
                   for d, b, t, x, _, bd in roofline_exp.cases(rl)]).set_index(["dtype", "sequences", "T"]),
     caption="a decode step against its roofline", percent=["fraction"])
rl_values = roofline_exp.values(rl)
# where one sequence's reference step goes, and the fused step beside it
show(pd.DataFrame([{"dtype": d, "T": int(t[1:]), **{k.removesuffix("_ms"): part[k]["value"] for k in
                    ("step_ms", "engine_ms", "attention_ms", "products_ms", "other_ms", "fused_step_ms")}}
                   for d, by_t in rl_values["breakdown"].items() for t, part in by_t.items() if t.startswith("t")])
     .set_index(["dtype", "T"]), caption="one sequence's reference decode step by part, and the fused step (ms)")
print(", ".join(f"{d}: the products alone read {b['products_gb_s']['value']:.1f} GB/s, "
                f"{b['products_fraction']['value']:.0f}% of the sum's" for d, b in rl_values["breakdown"].items()))
beside("ch03", "roofline", values=rl_values, section="roofline",
       why=f"your run times {S['roofline']['rounds']} rounds of each step at {S['roofline']['contexts']} positions, "
           f"the book {FULL_ROOFLINE['rounds']} at {FULL_ROOFLINE['contexts']}, and reads a smaller buffer; and the "
           "notebooks run OpenMP's threads passive (`import lab`), the book its defaults: waiting threads sleep, so "
           "the fused step's seven barriers a layer cost more here.")

# %% [markdown]
# ## End to end: the engine, 32 greedy tokens from a 17-token prompt
#
# Three backends generate the same tokens: recomputation, and the two caches. The backends count the
# positions they push through the model.

# %%
e2e = {m.name: ch03.end_to_end(m, 17, S["e2e_tokens"]) for m in (gpt2, smol)}
for name, e in e2e.items():
    print(f"{name}: the three backends generate {'the same' if e['tokens_identical'] else 'DIFFERENT'} tokens")
show(pd.DataFrame([{"model": name, "backend": b, "positions": e[b]["positions"], "TTFT (ms)": e[b]["ttft"] * 1e3,
                    "TPOT (ms)": e[b]["tpot"] * 1e3, "total (s)": e[b]["total"]}
                   for name, e in e2e.items() for b in ("recompute", "concat", "static")]
                  ).set_index(["model", "backend"]))

# %%
for name, e in e2e.items():
    gain = e["recompute"]["total"] / e["static"]["total"]
    longest = max(times[name])
    step = ch03.speedups(times[name])[longest]["static"]["median"]
    print(f"{name}: the whole generation {gain:.3g}x faster with the static cache, one step at T = {longest} "
          f"{step:.3g}x" + (": far less" if gain < step / 3 else ""))
m["end_to_end"] = e2e
beside("ch03", "ch03.end_to_end", values=ch03.values(m),
       why=f"your run times each backend once over {S['e2e_tokens']} tokens, and its one-step speedup in "
           f"{S['rounds']} rounds (the book: {FULL['rounds']}).")

# %% [markdown]
# The whole generation gains much less than a step at a long context: these contexts are short (17 to 48
# positions), where one step's speedup is small (the first table), and the prefill is the same.
#
# ## Against the library
#
# The lab's cached decode against `transformers`' own `generate` with its dynamic and its static cache,
# on the same weights, the same context and the same threads, timed in interleaved rounds. The first
# check is that both produce the same greedy tokens. A ratio below 1 means the lab is faster; within a
# few percent of 1 it means the same speed.

# %%
lib = hf_generate.compare(("gpt2-random", "smollm2"), S["library_context"], S["library_tokens"], S["library_reps"])
timed = ["lab concat (ms)", "library dynamic (ms)", "lab / library, dynamic", "lab static (ms)",
         "library static (ms)", "lab / library, static"]
show(pd.DataFrame([{"model": name, "context (tokens)": r["context"], "tokens": r["tokens_match"],
                    **dict(zip(timed, (r["lab_concat"] * 1e3, r["library_dynamic"] * 1e3, r["ratio_concat"],
                                       r["lab_static"] * 1e3, r["library_static"] * 1e3, r["ratio_static"]),
                               strict=True))}
                   for name, r in lib.items()]).set_index("model"), words={"tokens": ("identical", "different")},
     caption="one decode step, median")

# %% [markdown]
# ## Memory, measured in a fresh process
#
# Each measurement runs in its own process: load, warm up, take the resident set size as the baseline,
# then decode to the target length and record the peak. A fresh process matters because memory a previous
# run freed is often not returned to the operating system. The formula's bytes are the dashed line.

# %%
mem = memory.sweep(S["memory_models"], ("concat", "static"), S["memory_batches"], S["memory_tokens"])
ch03.plot_memory(mem, FIGS / "ch03_memory.png")
show(pd.DataFrame([{"model": r["model"], "design": r["design"], "batch": r["batch_size"],
                    "peak extra (MiB)": r["peak_extra_bytes"] / 2**20, "formula (MiB)": r["cache_bytes"] / 2**20}
                   for r in mem]).set_index(["model", "design", "batch"]))

# %%
m |= dict(library=lib, memory=mem)
beside("ch03", "ch03.memory", values=ch03.values(m),
       why=f"your run decodes to {S['memory_tokens']} positions, the book to {FULL['memory_tokens']}: the step's "
           "activations and the allocator's rounding take about the same memory at any length, and beside a cache "
           f"{FULL['memory_tokens'] // S['memory_tokens']} times smaller they are a larger part of the peak, for the "
           "static cache too.")

# %% [markdown]
# ## A busy machine
#
# A reader's laptop is never idle. torch runs each operator on a team of OpenMP threads, one per core,
# and between two operators OpenMP lets its threads *spin* for a while rather than sleep, to save the
# time of waking them. When another program wants the same cores, a spinning thread takes a core from
# the thread it is waiting for, and a decode step of a few hundred small operators can take several
# times as long. `lab` sets `OMP_WAIT_POLICY=PASSIVE` (threads sleep while they wait) when it is
# imported, which is why every notebook imports `lab` before `torch`: OpenMP reads the setting once,
# when torch loads (`lab/threads.py`).
#
# `lab.contention` times the same decode step in fresh processes (a setting takes effect only in a
# process of its own), idle and with one spinning process per core beside it, with OpenMP's defaults and
# with the lab's setting:

# %%
busy = ch03.under_load(S)
show(pd.DataFrame({name: {f"{'idle' if n == 0 else f'{n} busy processes'} (ms)": r["median"] * 1e3
                          for n, r in by_load.items()} for name, by_load in busy.items()}).T.rename_axis("setting"))
for name, by_load in busy.items():
    idle, loaded = by_load[min(by_load)]["median"], by_load[max(by_load)]["median"]
    print(f"{name}: {loaded / idle:.3g}x slower with every core busy")

# %% [markdown]
# A slowdown of tens of times under OpenMP's defaults (the book's run) is no typo. Each of torch's threads
# spins after every operator, waiting for the next; beside programs that want the same cores, the thread a
# step waits for gets a core only now and then, hundreds of times a step. With the lab's setting the threads
# sleep while they wait, and the step slows by about the share of the cores the others take. If the
# defaults' *idle* step is itself several times the lab's, the machine was not idle: something else already
# held the cores that the spinning threads wait for.

# %%
m["under_load"] = busy
beside("ch03", "ch03.under_load", values=ch03.values(m),
       why=f"your run compares {' and '.join(S['load_settings'])} with no other program and with the cores all "
           f"busy, {S['load_rounds']} round{'s' if S['load_rounds'] > 1 else ''} of {S['load_reps']} steps, the "
           f"book {len(FULL['load_settings'])} settings at every load, {FULL['load_rounds']} rounds of "
           f"{FULL['load_reps']}, on an idle machine: these verdicts hold only where 'idle' is idle. If anything "
           "else runs beside the notebook, the defaults' spinning threads lose their cores even in the idle case, "
           "and the idle step under the defaults, not the lab's, is the slow one.")

# %% [markdown]
# ## In bfloat16
#
# The same model in bfloat16 (`load("smollm2", dtype=torch.bfloat16)`), whose caches then store bfloat16:
# a cached decode step in each dtype, timed in the same interleaved rounds; the bytes of the weights and of
# the cache; and how far bfloat16's next-token distribution moves from float32's on held-out text.

# %%
bf16 = dict(step=ch03.bf16_step(smol, S["bf16_context"], S["bf16_rounds"]),
            divergence=ch03.bf16_divergence(smol, S["kl_passages"], S["kl_tokens"]))
st, dv = bf16["step"], bf16["divergence"]
show(pd.DataFrame({dt: {"step, F.linear (ms)": st[dt]["median"] * 1e3,
                        "step, prepacked (ms)": st[dt + "_packed"]["median"] * 1e3,
                        "weights (MiB)": st["bytes"][dt]["weights"] / 2**20,
                        f"cache at {st['context']} positions (MiB)": st["bytes"][dt]["cache"] / 2**20}
                   for dt in ("float32", "bfloat16")}).T)
print(f"float32 step / bfloat16 step (median over rounds): {st['ratio']['median']:.2f} through F.linear, "
      f"{st['ratio_packed']['median']:.2f} prepacked; KL(float32 || bfloat16) "
      f"{dv['kl_mean']:.2g} nats on average, {dv['kl_max']:.2g} at worst; greedy token the same at "
      f"{100 * dv['top1_same']:.1f}% of {dv['positions']} positions")

# %% [markdown]
# ## Record
#
# The measurements above go into results.json (section `ch03`); the figures were saved when they were
# drawn, so this cell does not draw them again.

# %%
m["bf16"] = bf16
ch03.record(m, draw=False)
print("wrote section ch03 to", results.results_path())

# %% [markdown]
# ## What these numbers do and do not show
#
# They are this CPU's, on two threads, float32, batch 1 for the timings. In quick mode they come from few
# rounds on short sweeps and can be noisy; the book's come from a full run on a quiet machine. On a GPU a
# short step is bound by kernel launches, so the speedup at short contexts can be much smaller there. The
# attention share is that of PyTorch's `scaled_dot_product_attention` on the CPU at batch 1; a fused GPU
# kernel, a larger batch (which shares the weight reads among sequences but not the cache reads) or 16-bit
# weights would each move it. Resident set size includes the activations of the step in flight and memory
# the allocator keeps for reuse, and it is sampled between steps.
#
# ## Exercises
#
# 1. **Where does the work go?** Write `decode_flops(config, T)`: the FLOPs (2 per multiply-add) of one
#    cached decode step at context $T$ (projections, attention over $T + 1$ keys, MLP, output head). The check
#    compares with PyTorch's FLOP counter on a real step, for the book's models and for model shapes drawn
#    fresh at every run. Count from the shapes in `config`: your function runs while every torch function
#    and the check's own counter raise.
# 2. **When does attention dominate the FLOPs?** Write `attention_share(config, T)`: the fraction of those
#    FLOPs spent in attention over the cache, by the same rule.
# 3. **Open-ended: does the clock agree on your machine?** Write `measured_attention_share(model, T)`: the
#    percentage of one cached SmolLM2 step's *time* spent in attention at $T = 1024$. Fill a `StaticCache`
#    with $T$ positions of random keys and values (`cache.update(i, k, v)` for every layer, then
#    `cache.advance(T)`); time the step as it is and with `cache.attend` set to a function that stores k, v
#    and returns q (delete the attribute afterwards); use `lab.bench.time_rounds(..., setup=lambda:
#    cache.crop(T))`. The check counts your attention calls, refuses the book's own measuring function and
#    reading the book's number, and sets your number beside the book's.

# %%
from lab.exercises import ch03 as ex


def decode_flops(config, T):
    raise NotImplementedError("your answer")


def attention_share(config, T):
    raise NotImplementedError("your answer")


def measured_attention_share(model, T):
    raise NotImplementedError("your measurement")


for check, answer in ((ex.check_decode_flops, decode_flops), (ex.check_attention_share, attention_share),
                      (ex.check_measured_attention_share, measured_attention_share)):
    try:
        check(answer)
    except NotImplementedError:
        print(f"{check.__name__}: not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch03_solutions.py`; the test suite runs every check on them,
# and on the shortcuts each check must refuse.
