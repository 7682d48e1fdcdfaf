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
# # Chapter 8 — Serving
#
# So far one request has had the machine to itself. A server has many, of every length, arriving when
# they like, and one pool of pages to hold all their caches. Serving them one after another wastes the
# machine: a decode step reads every weight of the model to produce one token, and it could produce a
# token for sixteen requests in hardly more time. The engines people use (Orca's iteration-level
# scheduling, vLLM) therefore decide **at every step** who runs: new requests join the batch as soon as
# there is room, finished ones leave at once, long prompts are cut into chunks so they do not stall
# the others, and when the pool runs out, a request is **preempted** and recomputed later.
#
# This notebook first shows why batching pays, then builds a toy scheduler loop in a few cells and
# checks it, step for step, against `lab`'s `ServingEngine`. Then it adds the pool: the engine's
# timeline with a preemption, drawn from a real run. Then the server and a load generator, and only then
# the measurements: batching, chunked prefill, preemption, prefix caching, where a step's time goes, and
# the lab's server against vLLM's on the same two cores.

# %%
import lab  # first, before torch: it sets OpenMP's wait policy, which torch reads once, when it loads

import platform

import pandas as pd
import torch
from IPython.display import display

from lab import loadgen, results, step_cost
from lab.serve.process import lab_server
from lab.cache.pool import PagePool
from lab.engine import ServingEngine
from lab.experiments import ch08_serving as ch08
from lab.experiments.tables import show
from lab.models import load
from lab.book.verdicts import beside

print(f"python {platform.python_version()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
print(lab.threads.describe())
QUICK = results.quick()
S, FULL = ch08.settings(QUICK), ch08.settings(False)      # FULL: the book's settings, to say what quick mode skips
BOOK_THREADS = results.lookup(results.read(results.COMMITTED), "ch08.threads")["value"]   # torch's, in the book's run
print("quick mode" if QUICK else "full mode", "-> results in", results.results_path())
smol = load("smollm2")

# %% [markdown]
# ## 1. Why batch
#
# One decode step of a 135M-parameter model multiplies each token's activations by every weight matrix.
# With one sequence, that is a matrix-vector product: the step's time goes to reading the weights, and
# the arithmetic units mostly wait. With $B$ sequences the same weights are read once for $B$ tokens.
# `lab.step_cost.profile` runs real decode steps through the engine with $B$ sequences of 64 positions each:

# %%
steps = {B: step_cost.profile(smol, B, 64, steps=4) for B in (1, 4, 16)}
display(show(pd.DataFrame({B: {"step (ms)": r["step_s"] * 1e3, "throughput (tokens/s)": B / r["step_s"]}
                           for B, r in steps.items()}).T.rename_axis("sequences B"),
             caption="one decode step, 64 positions each"))

# %%
one, sixteen = steps[1]["step_s"], steps[16]["step_s"]
print(f"a step of 16 sequences takes {sixteen / one:.1f}x the time of a step of one, for 16x the tokens")

# %% [markdown]
# Sixteen sequences cost a few times one sequence's step, not sixteen times as much: every token of the
# batch shares the weight traffic. That is the whole case for a server that batches. The hard part is that
# requests do not arrive together, nor end together.
#
# ## 2. A scheduler loop, by hand
#
# A request is a prompt to prefill and a number of tokens to generate. Each **step** runs one forward
# over a set of tokens, at most `budget` of them, and the loop decides which:
#
# 1. every running request with one token to compute (**decoding**) gets that token, first;
# 2. every running request still prefilling gets its next **chunk** of the prompt, as much as the budget
#    leaves;
# 3. waiting requests are **admitted** in order of arrival while budget is left.
#
# When a request's last known token has been computed, the step samples its next token; when it has all
# its tokens, it leaves. No page limit yet: the toy tracks only counts.

# %%
def toy_scheduler(requests, budget):
    """requests: (arrival step, prompt length, tokens to generate) -> per request its admission step,
    first-token step and finishing step."""
    todo = lambda i: requests[i][1] + out[i] - done[i]           # tokens known but not yet computed
    out, done = [0] * len(requests), [0] * len(requests)
    log = [dict(admitted=None, first_token=None, finished=None) for _ in requests]
    waiting, running, step = [], [], 0
    while any(x["finished"] is None for x in log):
        waiting += [i for i, r in enumerate(requests) if r[0] == step]
        left, batch = budget, []
        for i in sorted(running, key=lambda i: todo(i) > 1):    # decodes first, then prefill chunks
            if left and todo(i):
                batch.append((i, min(todo(i), left)))
                left -= batch[-1][1]
        while waiting and left:                                  # admit, first come first served
            i = waiting.pop(0)
            running.append(i)
            log[i]["admitted"] = step
            batch.append((i, min(todo(i), left)))
            left -= batch[-1][1]
        for i, n in batch:                                       # the forward, then sampling
            done[i] += n
            if todo(i) == 0:
                out[i] += 1
                if log[i]["first_token"] is None:
                    log[i]["first_token"] = step
                if out[i] == requests[i][2]:
                    running.remove(i)
                    log[i]["finished"] = step
        step += 1
    return log


reqs = [(0, 90, 6), (0, 20, 12), (2, 50, 8), (3, 10, 10), (5, 70, 4)]
toy = toy_scheduler(reqs, budget=48)
show(pd.DataFrame(toy, index=[f"{p}+{n} tokens, arrives at {a}" for a, p, n in reqs]).rename(columns={
    "admitted": "admitted (step)", "first_token": "first token (step)", "finished": "finished (step)"}))

# %% [markdown]
# The 90-token prompt is prefilled in two chunks, 48 then 42; the 20-token prompt joins in the second
# step, with the rest of the budget. From then on, every step carries the decodes first and fills the
# rest with prompts, so a long prompt never holds a decoding request up for more than one step's budget.
#
# ### The same with `lab`
#
# `ServingEngine` runs this policy over a real pool of pages and the real model. With a pool large
# enough for everyone, its timeline must be the toy's, step for step, and its tokens each request's
# own greedy decoding.

# %%
ids = loadgen.random_prompts(len(reqs), 90, seed=7)
prompts = [ids[i][:p] for i, (_, p, _) in enumerate(reqs)]
engine = ServingEngine(smol, num_pages=64, page_size=16, max_batch_tokens=48, prefix_caching=False)
tokens = engine.generate(prompts, [n for *_, n in reqs], arrivals=[a for a, *_ in reqs])
lab_log = [dict(admitted=r["admitted"][0], first_token=r["first_token"], finished=r["finished"])
           for r in engine.timeline()]
assert lab_log == toy, (lab_log, toy)
alone = [ServingEngine(smol, 64, 16, 48).generate([p], n)[0] for p, (*_, n) in zip(prompts, reqs, strict=True)]
assert tokens == alone
print(f"timeline identical to the toy's for {len(reqs)} requests; tokens identical to one at a time; "
      f"batch sizes, step by step: {', '.join(map(str, engine.stats['batch_sizes']))}")

# %% [markdown]
# ### One step, one forward
#
# A step's scheduled tokens are laid end to end as one row, `[1, N]`: the weight matrices see N tokens,
# whatever request each belongs to, and only attention is per sequence. What attention needs to find each
# token's sequence is the same in every layer, so the pool plans it once per step, before the forward
# (vLLM's attention metadata): `plan_step` takes the positions the scheduler reserved and returns the
# cache the forward runs through. Here a plan alone, with no forward, over two sequences of a small pool:
# one decoding its sixth token, one prefilling a chunk of four.

# %%
pool = PagePool.for_model(smol.config, num_pages=16, page_size=4)   # the engine's pool: one group, every layer
a, b = pool.new_id(), pool.new_id()
pool.reserve([(a, 6), (b, 4)])     # a: 6 positions (in a server 5 computed already, 1 for this decode); b: 4
plan = pool.plan_step([(a, 1), (b, 4)])              # a decode, then a chunk: one row of 5 tokens
print("block tables:", "; ".join(f"sequence {s} → pages {', '.join(map(str, pool.manager.block_table(s)))}"
                                 for s in (a, b)))
display(show(pd.DataFrame({"sequence": [a] + [b] * 4,
                           "position (for RoPE)": plan.positions.tolist(),      # each token's own
                           "slot: page × 4 + offset": plan.slot_mapping["full"].tolist()},  # where k, v go
                          index=pd.RangeIndex(5, name="token of the row")).T))
for row, (at, length) in enumerate(zip(plan.decode_at.tolist(), plan.lengths.tolist(), strict=True)):
    print(f"a decode: token {at} of the row, its sequence {length} positions long with it, "
          f"block table {plan.block_tables['full'][row].tolist()}")
for at, n, read, start, _ in plan.chunks["full"]:
    print(f"a chunk: tokens {at} to {at + n - 1} of the row, reading slots {read.tolist()}, "
          f"its sequence {start + n} positions long with them")

# %% [markdown]
# ## 3. When the pages run out
#
# The toy never runs out of memory; a server does. Every token computed needs a slot in a page, and a
# decoding request takes a new page every 16 tokens. The engine reserves the pages each step needs
# before the forward. When a request cannot grow, the engine **preempts** the youngest running request:
# its pages go back to the pool, and it waits at the head of the queue, to be **recomputed** (its
# prompt and the tokens it has produced so far) when there is room. It also keeps one free page per
# running request when it admits a new one, so a request is not admitted only to be preempted by the
# next step's decodes.
#
# Five requests on a pool of 13 pages (208 positions), 64 tokens a step:

# %%
tl = ch08.timeline_run(smol)
fig_timeline = ch08.plot_timeline(tl)
print(f"{tl['steps']} steps, {tl['preemptions']} preemption{'s' if tl['preemptions'] != 1 else ''}")
for r in tl["timeline"]:
    print(f"req {r['id']} ({r['prompt_tokens']}+{r['output_tokens']}): arrived at step {r['arrived']}, admitted at "
          f"{' and '.join(map(str, r['admitted']))}, first token at {r['first_token']}, finished at {r['finished']}"
          + (f"; preempted at {', '.join(map(str, r['preempted']))}" if r["preempted"] else ""))
m = dict(settings=S, manifest=smol.manifest, threads=torch.get_num_threads(), timeline=tl)
beside("ch08", "ch08.timeline", values=ch08.values(m),
       why="your run serves the same five requests on the same pool as the book's; the steps are counted, not "
           "timed, so a differing verdict here is a real disagreement.")

# %% [markdown]
# Read the figure with the steps above. Requests 0 and 1 decode side by side (blue); request 2 waits
# until request 0 finishes, then decodes beside request 1. The 120-token request is admitted at the same
# step and prefills what the free pages hold (orange); then it waits, and when the two decoding requests
# need its pages to grow, it is preempted (×): its prefill is thrown away and computed again once they
# finish. The last request waits behind it, first come, first served. Recomputation costs compute;
# exercise 2 keeps the pages in host memory instead.
#
# ## 4. A server, and a load
#
# `python -m lab.serve` puts the engine behind an OpenAI-compatible HTTP API (`/v1/completions` and
# `/v1/chat/completions`, streamed as server-sent events). The engine runs in a process of its own, as
# vLLM's engine core does, and steps while requests are waiting or running; the server's process parses,
# detokenizes and streams. Requests that arrive together are batched together.
# `lab.loadgen` sends requests at their arrival times and times every streamed token: the **time to
# first token** (TTFT) and the **inter-token latency** (ITL). Here four requests are sent at once to a
# server started on this machine's cores:

# %%
with lab_server(cores=None, threads=torch.get_num_threads()) as (_, url):
    recs = loadgen.run_load(url, loadgen.fixed_requests(4, 32, 16, seed=5), "smollm2", timeout_s=120)
summary = loadgen.summarize(recs, slo_ttft=2.0, slo_itl=0.5)
display(show(pd.DataFrame({"completed": summary["completed"], "output tokens": summary["output_tokens"],
                           "throughput (tokens/s)": summary["throughput_tok_s"],
                           "median TTFT (ms)": summary["ttft_median_s"] * 1e3,
                           "median ITL (ms)": summary["itl_median_s"] * 1e3,
                           "p99 ITL (ms)": summary["itl_p99_s"] * 1e3},
                          index=["4 at once"])))

# %% [markdown]
# ## 5. Measuring
#
# ### Batching: throughput against requests in flight
#
# $c$ requests of the same length arrive at once; the engine batches them. The same engine serving one
# request after another gives the baseline.

# %%
batching = ch08.batching(smol, S)
display(show(pd.DataFrame({"output (tokens/s)": {**{f"{c} at once": r["tok_s"] for c, r in batching["batched"].items()},
                                                 "one at a time": batching["sequential"]["tok_s"]}}
                          ).rename_axis("requests")))
m["batching"] = batching
beside("ch08", "ch08.batching", values=ch08.values(m),
       why=f"your run sends {', '.join(map(str, S['levels']))} requests at once, of {S['prompt']} prompt tokens and "
           f"{S['output']} out, the book {', '.join(map(str, FULL['levels']))} of {FULL['prompt']} and "
           f"{FULL['output']}: the levels the book quotes are not all in your run.")

# %% [markdown]
# ### Chunked prefill: a long prompt among decoding requests
#
# A few requests are decoding when a long prompt arrives. Prefilled whole, it makes one step as long as
# its whole prefill, and every decoding request waits that long for its next token. In chunks of 256
# tokens, each step stays short. Whether the long prompt's own first token comes earlier or later, the
# line below the table says.

# %%
chunked = ch08.chunked_prefill(smol, S)
display(show(pd.DataFrame({k: {"worst inter-token gap (ms)": r["itl_max_s"] * 1e3,
                               "median gap (ms)": r["itl_median_s"] * 1e3,
                               "long prompt's TTFT (ms)": r["ttft_long_s"] * 1e3, "chunks": r["long_chunks"]}
                           for k, r in chunked.items()}).T))
c, w = chunked["chunked"], chunked["whole"]
print(f"in chunks the worst gap is {w['itl_max_s'] / c['itl_max_s']:.1f}x shorter; the long prompt's first token "
      f"comes {'earlier' if c['ttft_long_s'] < w['ttft_long_s'] else 'later'} "
      f"({c['ttft_long_s'] * 1e3:,.0f} ms in chunks, {w['ttft_long_s'] * 1e3:,.0f} ms whole)")
m["chunked"] = chunked
beside("ch08", "ch08.chunked", values=ch08.values(m),
       why=f"your run's long prompt has {S['long']} tokens among {S['decoders']} decoding requests, the book's "
           f"{FULL['long']} among {FULL['decoders']}: a shorter prompt takes fewer chunks of {S['chunk']}, so "
           "chunking shortens the worst gap less. The long prompt's first token comes within a few percent either "
           "way, in the book's run too: timed once, beside other programs, it can land on either side.")

# %% [markdown]
# ### Preemption against pool size
#
# The same requests on smaller and smaller pools: how often the engine preempts, how many positions it
# computes twice, and what that costs. The tokens never change.

# %%
pre = ch08.preemption(smol, S)
display(show(pd.DataFrame({k: {"preemptions": r["preemptions"], "positions recomputed": r["computed"] - r["ideal"],
                               "steps": r["steps"], "time (s)": r["seconds"], "tokens": r["identical"]}
                           for k, r in pre["runs"].items()}).T.rename_axis("pool (pages)"),
             words={"tokens": ("identical", "different")}))
print(f"each request needs {pre['need']} pages at its longest; all {pre['requests']} at once: {pre['all_pages']}")

# %% [markdown]
# ### Prefix caching on a shared system prompt
#
# Requests that share a system prompt take its pages from the pool (chapter 6) instead of computing them.

# %%
prefix = ch08.prefix_sharing(smol, S)
display(show(pd.DataFrame({k: {"positions computed": prefix[k]["computed"], "from cache": prefix[k]["cached"],
                               "time (s)": prefix[k]["seconds"], "median TTFT (ms)": prefix[k]["ttft_median_s"] * 1e3}
                           for k in ("cached", "uncached")}).T.rename_axis("prefix caching")))
m |= dict(preemption=pre, prefix=prefix)
beside("ch08", "ch08.prefix", values=ch08.values(m),
       why=f"your run sends {S['shared_requests']} requests sharing a {S['shared_system']}-token system prompt, the "
           f"book {FULL['shared_requests']} sharing {FULL['shared_system']} tokens.")

# %% [markdown]
# ### Where a step's time goes
#
# A decode step with a full batch, timed in parts: the check that the weights are still the pages' owner
# (chapter 4), the scheduler (Python), building the step's batch (block tables and slots), attention over
# the pages, and the rest of the forward (the weight matrices). This is the reference step (`fast=False`),
# which the engine runs for a step with a prefill chunk or more decodes than its fused step takes
# (chapter 3): the fused step does all of it in one C++ call, with no parts to time from Python.

# %%
prof = step_cost.profile(smol, S["profile_batch"], S["prompt"], fast=False)
display(show(pd.DataFrame({k: {"time (ms)": t * 1e3, "share of the step": t / prof["step_s"]}
                           for k, t in prof["parts"].items()}).T.rename_axis("part"), percent=["share of the step"],
             caption=f"one decode step of {S['profile_batch']} sequences"))

# %%
share = {k: t / prof["step_s"] for k, t in prof["parts"].items()}
print(f"scheduler and batch building {share['schedule'] + share['batch']:.1%} of the step; attention "
      f"{share['attention']:.0%}, the rest of the forward {share['forward']:.0%}")
m["profile"] = prof
beside("ch08", "ch08.profile", values=ch08.values(m),
       why=f"your run profiles a batch of {S['profile_batch']} sequences after {S['prompt']} prompt tokens, the "
           f"book {FULL['profile_batch']} after {FULL['prompt']}.")

# %% [markdown]
# The scheduler costs almost nothing; the weight matrices take most of the step, and attention over
# the pages the rest (the line above). Profiling the engine against vLLM found more costs. `F.linear`
# has the CPU's matrix library repack every weight on every call, which with 16 rows costs about as much
# as the product, so the engine holds the weights prepacked once, as vLLM's CPU backend does. A layer
# makes about forty small PyTorch calls besides its products, each costing more in dispatch than in
# arithmetic, so the prepacked weights bring a fused layer (`llama.fused_block`: RMSNorm with the
# residual add, RoPE in place, SiLU with the gate product, one C++ call each). On the machine the book was
# measured on, torch ran the same step slower from a second thread than from the main one. And a server
# that steps its engine in the process that serves HTTP makes the two take turns on one interpreter lock.
# So `python -m lab.serve` steps its engine in the main thread of a process of its own. The same step four
# ways:

# %%
costs = step_cost.step_costs(smol, S["profile_batch"], S["prompt"])
display(show(pd.DataFrame({k: {"step (ms)": r["step_s"] * 1e3, "attention (ms)": r["parts"]["attention"] * 1e3}
                           for k, r in costs.items()}).T.rename(index={"engine": "prepacked, fused layers, main thread",
                           "unfused": "prepacked, unfused layers", "unpacked": "F.linear, unfused layers",
                           "thread": "prepacked, fused layers, second thread"})))
base = costs["engine"]["step_s"]
print(f"unfused layers (llama.block): {costs['unfused']['step_s'] / base:.2f}x the fused ones; F.linear: "
      f"{costs['unpacked']['step_s'] / costs['unfused']['step_s']:.2f}x the prepacked one; a second thread: "
      f"{costs['thread']['step_s'] / base:.2f}x the main thread's, on this machine in this run")
m["step_costs"] = costs
beside("ch08", "ch08.step_costs", values=ch08.values(m),
       why=f"your run times the step with a batch of {S['profile_batch']}, the book with "
           f"{FULL['profile_batch']}, and these verdicts describe a processor and a thread count: your kernel runs "
           f"torch on {torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}, the book's run "
           f"on {BOOK_THREADS}. What fusing and prepacking save depends on this processor's matrix library and on "
           "a step's few percent of noise, and what a second Python thread costs comes from handing work to "
           "OpenMP's team of threads.")

# %% [markdown]
# ### The lab's server against vLLM's
#
# The load generator sends the same requests to the lab's server and to vLLM's, one after the other,
# both pinned to the same two cores. Quick mode runs only the lab's; vLLM takes about a minute to start,
# so `make results` runs the comparison and the notebook shows the book's figures.

# %%
http = ch08.http(S)
book = results.read(results.COMMITTED)["sections"].get("ch08", {}).get("values", {}).get("http", {})
ratio = book.get("ratio", {"value": results.NOT_RUN, "reason": "not measured yet: run `make results`"})
if ratio["value"] == results.NOT_RUN:
    print("the book's results have no vLLM comparison:", ratio["reason"])
else:
    cs = sorted(book["lab"]["concurrency"], key=lambda c: int(c[1:]))
    display(show(pd.DataFrame({side: {f"{c[1:]} in flight": book[side]["concurrency"][c]["throughput"]["value"]
                                      for c in cs} for side in ("lab", "vllm")}).T.rename_axis("server"),
                 caption="output tokens per second, the book's run"))
    print(f"lab / vLLM at 16 in flight: {ratio['value']:.2f}; greedy tokens identical for "
          f"{book['agreement']['identical']} of {book['agreement']['requests']} requests")
    if "process_gain" in book:
        print(f"the engine in its own process against in the server's: {book['process_gain']['value']:.2f}x")
    if "wait_policy_gain" in book:
        print("the server's default wait policy over --wait-policy passive: "
              + ", ".join(f"{g['value']:.2f}x at {c[1:]} in flight" for c, g in book["wait_policy_gain"].items()))
fig_throughput = ch08.plot_throughput(batching, http)
fig_latency = ch08.plot_latency(http)

# %%
m["http"] = http
beside("ch08", "ch08.http", values=ch08.values(m),
       why=f"your run sends the lab's server {', '.join(map(str, S['http_levels']))} requests in flight and "
           f"{', '.join(f'{r:g}' for r in S['rates'])} requests a second, the book "
           f"{', '.join(map(str, FULL['http_levels']))} in flight and {len(FULL['rates'])} rates from "
           f"{min(FULL['rates']):g} to {max(FULL['rates']):g}; vLLM runs only in `make results`. The one "
           f"comparison your run judges, the engine in its own process against in the server's, is "
           f"{S['rounds']} round{'s' if S['rounds'] > 1 else ''} at {ch08.compared(S)[0]} in flight, the book's "
           f"{FULL['rounds']} at {ch08.compared(FULL)[0]}: two servers on cores that other programs share.")

# %% [markdown]
# ### A third server: llama.cpp
#
# llama.cpp is what most people run on a laptop CPU. `make llamacpp` builds it from the source that the
# `llama-cpp-python` package ships (about ten minutes on two cores, once), and `make results` sends its server
# the same loads as the lab's and vLLM's, on the same two cores, on the Q4_1 file the lab's weights come from
# and on the lab's own weights written as float32 and bfloat16 GGUF files. With llama.cpp built, this cell
# also times one sequence decoding on both sides, a few tokens after a short context.

# %%
from lab.experiments import llamacpp as llamacpp_exp
from lab.peers import llamacpp

book_l = results.read(results.COMMITTED)["sections"].get("llamacpp", {}).get("values", {})
if "serving" in book_l:
    sv = book_l["serving"]
    sides = [k for k in sv if k != "ratios" and "concurrency" in sv[k]]
    display(show(pd.DataFrame({k: {f"{c[1:]} in flight": sv[k]["concurrency"][c]["throughput"]["value"]
                                   for c in sv[k]["concurrency"]} for k in sides}).T.rename_axis("server"),
                 caption="output tokens per second, the book's run"))
mine_l = {}
if llamacpp.available():
    SL = llamacpp_exp.settings(True)
    files = {k: llamacpp.model_files()[k] for k in ("float32",)}
    mine_l = llamacpp_exp.decode({"float32": smol}, files, SL)
    print({side: f"{x['tok_s']:.1f} tok/s" for side, x in mine_l[SL["depths"][0]].items()},
          f"one sequence after {SL['depths'][0]} positions")
else:
    print("llama.cpp is not built here: `make llamacpp` builds it; the table above is the book's run")
beside("ch08", "llamacpp.serving", "llamacpp.decode", "llamacpp.weights", "llamacpp.agreement",
       why="the book's run times one sequence after 512 and 4,096 positions and serves 16 and 64 requests in "
           "flight; this cell times one sequence after a short context, in float32 only, or nothing where "
           "llama.cpp is not built.")

# %% [markdown]
# ## Record
#
# The figures drawn above are saved as they are.

# %%
ch08.record(m, drawn={"timeline": fig_timeline, "throughput": fig_throughput, "latency": fig_latency})
print("wrote section ch08 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# 1. **Shortest remaining job first.** First come, first served makes a short request wait behind every
#    long one that arrived before it. Write a `ServingEngine` subclass whose `next_to_admit()` returns the
#    waiting request with the least work left, the first of equals: its tokens in all (prompt plus
#    `max_new_tokens`) less the positions it would take from cached pages if admitted now,
#    `ex.cached_prefix(self, req)`. The engine runs with prefix caching, so a request that starts with a
#    system prompt another request has run, or one preempted after computing some pages, has less left
#    than its size. The check, `ex.check_shortest_first(YourEngine)`, runs a burst of long and short jobs
#    on a small pool, compares every request's tokens with the same prompt decoded alone, counts the work
#    left of every waiting request at each admission, and fails a policy that chooses a request while one
#    with less work left waits (ranking by size alone fails), and one that drops, cancels or shortens long
#    jobs to look fast. It serves the same prompts again with answer lengths and arrivals drawn fresh, so a list
#    of choices that suits the first workload fails; then it prints median and p99 time to first token
#    against first come, first served. What happens to the longest job, and how would you bound its wait?
# 2. **Preempt by swapping, not recomputing.** Recomputation throws away work the pool could not keep.
#    Write a subclass that, when it preempts a request, copies its pages' keys and values to host memory
#    (CPU tensors) before releasing them, and on readmission writes them into fresh pages instead of
#    recomputing: `self.pool.page(p)` returns a copy of page p's keys and values in every layer, and
#    `self.pool.set_page(p, kv)` writes one back (`help(ex.check_swapping)` says the rest). The check,
#    `ex.check_swapping(YourEngine)`, forces preemptions on a small pool and counts the positions the
#    model runs: exactly what a run without preemption computes. It also checks, after every step, that a
#    swapped request holds no pages, that its copy is a copy (not a view of the pool), and that a request
#    swapped back finds its keys and values bit for bit. Comparing tokens alone would not catch pages
#    restored in the wrong order: each stored key already carries its position, so attention does not
#    care where it is stored.
# 3. **Open-ended: the watermark.** The engine keeps one free page per running request when it admits.
#    Replace it with a fixed share of the pool, say 1% or 10%, and rerun
#    `ch08.preemption(smol, S)`. Where do preemptions appear, and what does each policy cost in throughput?

# %%
from lab.exercises import ch08 as ex


class ShortestFirstEngine(ServingEngine):
    def next_to_admit(self):
        raise NotImplementedError("your answer")


class SwappingEngine(ServingEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.swapped = {}                  # request id -> what you copied to host memory

    def _preempt(self, req, now):
        raise NotImplementedError("your answer")


for check, answer in ((ex.check_shortest_first, ShortestFirstEngine), (ex.check_swapping, SwappingEngine)):
    try:
        check(answer)
    except NotImplementedError:
        print(f"{check.__name__}: not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch08_solutions.py`; the test suite runs every check on them.
