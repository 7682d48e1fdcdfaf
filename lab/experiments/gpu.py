"""`LAB_FULL=1 python -m lab.experiments.gpu`: every CUDA measurement of the book, in one command (about two
minutes on one H200, never more than four). LAB_FULL=1 writes results/results.json, as `make results` does;
without it the run is in quick mode and writes a temporary results file.

On a machine with a GPU it measures three parts, each written to its section as soon as it is done:
- `ch03_gpu`: the decode step's time uncached and through each cache against the context
  (`lab.step_cost.step_times`), SmolLM2 and the GPT-2 shape in float32, and the memory a decode of 960
  tokens holds (`lab.memory.probe`: PyTorch's allocated and reserved CUDA memory);
- `ch05_gpu`: the paged kernels' achieved bandwidth (`lab.kernel_bench`: the float and INT8 Triton kernels,
  SDPA over the same keys and values laid end to end) at contexts of 4k to 32k positions and batches of 1
  to 64, float16, 32 query and 8 KV heads of 128 features, pages of 16;
- `ch08_gpu`: ShareGPT-shaped requests, all arriving at once, through `ServingEngine` in this process
  (`lab.serving_bench`), SmolLM2 in float32, at 256, 64, 16 and 1 requests at once and 8 one after another,
  the decode attention chapter 5's Triton kernel; vLLM beside it where an environment holds a CUDA build;
- `ch11_gpu`: the cache one tier below the GPU, through vLLM's CUDA build (lab/peers/ch11_offload.py): a
  multi-turn trace whose prefixes do not all fit the GPU's pool, with no tier below (the baseline), with vLLM's
  native CPU offloading (`--kv-offloading-backend native --kv-offloading-size GiB`) and with LMCache's
  connector (`--kv-transfer-config '{"kv_connector":"LMCacheConnectorV1","kv_role":"kv_both"}'`), each its
  prompt tokens found cached and its time to first token. It prints, and records as NOT_RUN, the commands of
  NVIDIA Dynamo's KV-aware router over two vLLM workers, which the script does not start (on the CPU,
  `python -m lab.peers.ch11_dynamo` runs it over vLLM's CPU build).

The keys. One function per section (`ch03_values`, `ch05_values`, `ch08_values`) builds its values from what
was measured, every case that was not measured NOT_RUN with the reason; a run without a GPU calls the same
functions with nothing measured. So a measured run and a NOT_RUN one write the same keys. The manuscript
cites the headline leaves, which name no shape: `ch03_gpu.step_ms` and `.speedup` (SmolLM2's static cache
at its longest context, 2,048), `ch03_gpu.concat_reserved_mib` and `.static_reserved_mib`;
`ch05_gpu.bandwidth` (at 32,768 positions, the batch that reads fastest), `.bandwidth_fraction` (that over
the GPU's peak), `.kernel_over_sdpa`, `.int8_bandwidth`, `.int8_over_float` (the same case), `.max_abs_error`;
`ch08_gpu.output_tok_s` and `.speedup` (256 requests at once), `.vllm.output_tok_s`; `ch11_gpu.native_over_baseline`
and `.lmcache_over_baseline` (the later turns' median time to first token, over the baseline's). The sweeps
sit under `ch03_gpu.sweep`, `.speedups`, `.memory`, `ch05_gpu.sweep`, `ch08_gpu.engine`, `.speedups`,
`ch11_gpu.tiers`.

A time limit bounds each part (BUDGET_S): a sweep stops there and records what it measured, the rest NOT_RUN
with the reason; vLLM, where a CUDA build is found, gets what is left of the four minutes. Chapter 11's part
has its own limit (BUDGET_S["tiers"]: three starts of vLLM), so the whole run takes at most about eight. Without a GPU,
the run records NOT_RUN with the reason, under the same keys, unless a section already holds
measurements, which a CPU-only run never overwrites. A part that fails records NOT_RUN with its error (the
other parts keep their measurements), and the command exits with an error. `--dry-run` runs the same code
on the CPU with tiny sizes (the kernels in Triton's interpreter), into sections `gpu_dryrun`,
`gpu_dryrun_ch05`, `gpu_dryrun_ch08` and `gpu_dryrun_ch11` (which starts no vLLM), so the tests can exercise
the script.
"""

import argparse
import itertools
import math
import subprocess
import time
import traceback

import torch

from .. import kernel_bench, memory, results, serving_bench, step_cost
from ..bench import ratio_summary
from ..loadgen import workload
from ..models import load
from ..models.load import smollm2_folder
from ..peers import ch11_offload, vllm_gpu
from ..results import NOT_RUN, leaf_keys, lookup, not_run, provenance, read, results_path, value, write_section

NO_GPU = "no CUDA GPU on the machine that ran `make results`"
DESIGNS = ("concat", "static")

# Seconds each part may take before its sweep stops, and the whole run's, which vLLM's start-up and run must
# also fit in. Estimated on one H200 from the bytes moved and the kernel launches (each section records its
# `seconds`): start-up and Triton's compilations ~15 s; steps ~15 s (launch-bound: ~750 launches a SmolLM2
# step); memory ~25 s (two fresh processes, each stopped at the limit); kernels ~10 s (~1.5 TB moved in all:
# compilation and Python bind it); serving ~45 s (~85 engine steps of ~30 ms per `generate` at 256 requests).
# Each limit leaves a margin; the parts' limits, start-up and one serving level past its limit: about 200 s.
BUDGET_S = dict(steps=30, memory=45, kernel=30, serving=70, total=230, tiers=240)

# Chapter 8 on the GPU: the chapter's CPU load, larger. Prompts up to 256 and answers up to 64 tokens.
SERVE = dict(model="smollm2",
             levels=(256, 64, 16, 1),   # requests at once, the headline (the largest) first
             max_prompt=256,            # ShareGPT's long tail is clipped here (workload's max_prompt)
             max_output=64,             # every answer runs to its length: no eos stop on either side
             sequential=8,              # requests in the one-after-another loop (up to 64 decode steps each)
             reps=3,                    # timed runs per level, after one warm-up run
             page_size=16,              # vLLM's default block size too
             max_batch_tokens=2048)     # a step's token budget: 256 decodes and several prompt chunks fit
# The same code on the CPU for --dry-run: the tiny model, a small budget so that prompts are chunked.
SERVE_DRY = dict(model="tiny-llama", levels=(4, 1), max_prompt=16, max_output=4, sequential=2, reps=1,
                 page_size=16, max_batch_tokens=32)

# Chapter 11 on the GPU: 8 conversations of 4 turns, each a 512-token system prompt of its own and 64 new
# tokens a turn, turn by turn (every conversation's turn t before any turn t+1). The GPU's pool holds 128
# pages of 16 tokens, about three conversations, so a conversation's prefix has left the GPU by its next turn:
# the baseline computes it again, a tier below brings it back. SmolLM2 in float32 holds 46 KB a token
# (30 layers, keys and values, 3 KV heads of 64): the whole trace, about 6,100 tokens, 0.3 GB; 2 GiB below.
TIERS = dict(modes=("baseline", "native", "lmcache"), conversations=8, turns=4, system=512, turn_tokens=64,
             block_size=16, num_gpu_blocks=128, offload_gib=2.0, max_model_len=2048, vocab=49152, start_s=60)
TIERS_DRY = TIERS | dict(conversations=2, turns=2, system=32, turn_tokens=8)
# NVIDIA Dynamo's KV-aware router in front of two vLLM workers, one GPU each: the commands of its router guide
# (`python -m dynamo.frontend --router-mode kv`) and vLLM backend (`python -m dynamo.vllm`), with discovery
# through a folder instead of etcd (ai-dynamo 1.6: `--discovery-backend file`). The GPU script does not start it.
DYNAMO_COMMANDS = (
    "pip install 'ai-dynamo[vllm]==1.6.1'\n"
    "export DYN_DISCOVERY_BACKEND=file DYN_FILE_KV=/tmp/dynamo-store\n"
    "python -m dynamo.frontend --http-port 8000 --router-mode kv &\n"
    "CUDA_VISIBLE_DEVICES=0 DYN_SYSTEM_PORT=8081 python -m dynamo.vllm --model HuggingFaceTB/SmolLM2-135M-Instruct "
    "--enable-prefix-caching --kv-events-config "
    "'{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:20081\"}' &\n"
    "CUDA_VISIBLE_DEVICES=1 DYN_SYSTEM_PORT=8082 python -m dynamo.vllm --model HuggingFaceTB/SmolLM2-135M-Instruct "
    "--enable-prefix-caching --kv-events-config "
    "'{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:20082\"}' &\n"
    "# then send the trace of `python -m lab.peers.ch11_dynamo` to http://localhost:8000/v1/completions")


def settings(dry_run: bool) -> dict:
    """What the run measures. The headline of each part is its first model, its longest context and its
    largest batch or level; the manuscript cites only those."""
    if dry_run:  # the kernels run under Triton's interpreter here: tiny shapes, a limit it never reaches
        return dict(device="cpu", budget_s=dict.fromkeys(BUDGET_S, 600),
                    sections=dict(ch03="gpu_dryrun", ch05="gpu_dryrun_ch05", ch08="gpu_dryrun_ch08",
                                  ch11="gpu_dryrun_ch11"),
                    steps=dict(contexts={"tiny-llama": [16, 64]}, rounds=2, warmup=1),
                    memory=dict(models=("tiny-llama",), batches=(2,), tokens=48),
                    kernel=dict(contexts=[40], batches=[1, 2], heads=(4, 2), head_dim=16, dtype=torch.float32,
                                page_size=16, warmup=1, reps=2, check_batch=2),
                    serve=SERVE_DRY, tiers=TIERS_DRY)
    return dict(device="cuda", budget_s=BUDGET_S,
                sections=dict(ch03="ch03_gpu", ch05="ch05_gpu", ch08="ch08_gpu", ch11="ch11_gpu"),
                steps=dict(contexts={"smollm2": [16, 32, 64, 128, 256, 512, 960, 2048],
                                     "gpt2-random": [16, 32, 64, 128, 256, 512, 960]},  # 1,024 positions at most
                           rounds=10, warmup=3),
                memory=dict(models=("gpt2-random",), batches=(8,), tokens=960),   # chapter 3's batch-8 case
                kernel=dict(contexts=[32768, 16384, 8192, 4096], batches=[64, 16, 4, 1], heads=(32, 8),
                            head_dim=128, dtype=torch.float16, page_size=16, warmup=2, reps=10,
                            check_batch=2),    # sequences per case checked against the reference
                serve=SERVE, tiers=TIERS)


def leaf_of(why: str):
    """value(x, unit, **extra) for a measured x, not_run(why, unit) for x None: a section's builder writes
    every key through it, whether its case was measured or not."""
    return lambda x, unit, **extra: not_run(why, unit) if x is None else value(x, unit, **extra)


def summary_leaf(leaf, st, scale=1.0, unit="ms"):
    """A timing summary (lab.bench) as a leaf: its median x scale, with min, max and n."""
    if st is None:
        return leaf(None, unit)
    return leaf(st["median"] * scale, unit, min=st["min"] * scale, max=st["max"] * scale, n=st["n"])


def spent(budget) -> str:
    return f"not measured: the run's time limit for this part ({budget} s) was spent before this case"


# ---- chapter 3: step time against context, and the memory a decode holds ----

def measure_ch03(s, gpu) -> dict:
    """Step times per (model, context), longest context first, and one memory probe per (model, design,
    batch), each sweep stopping at its time limit."""
    st, mem, budget, device = s["steps"], s["memory"], s["budget_s"], s["device"]
    t0 = time.perf_counter()
    steps, manifests = step_cost.step_sweep(st["contexts"], lambda name: load(name).to(device), st["rounds"],
                                            st["warmup"], deadline=t0 + budget["steps"])
    probes, deadline = {}, time.perf_counter() + budget["memory"]
    for name, B, design in itertools.product(mem["models"], sorted(mem["batches"], reverse=True), DESIGNS):
        if time.perf_counter() > deadline:
            break
        try:   # a probe is a process of its own: it too must end within the part's limit
            probes[name, design, B] = memory.probe(name, design, B, mem["tokens"], device=device,
                                                   timeout=deadline - time.perf_counter())
        except subprocess.TimeoutExpired:
            break
    why = spent(f"{budget['steps']} s for the steps, {budget['memory']} s for memory")
    return dict(steps=steps, probes=probes, seconds=time.perf_counter() - t0, why=why,
                extra=dict(manifest=manifests, dtype="float32"))


def probe_values(leaf, r) -> dict:
    """One memory probe (lab.memory.measure's dict, None when not run) in MiB: the process's resident memory
    above its baseline, the cache's size by the formula, and on CUDA the allocator's peaks above baseline."""
    mib = lambda k: leaf(r[k] / 2**20 if r else None, "MiB")
    cuda = lambda k: not_run("a CPU run has no CUDA allocator", "MiB") if r and k not in r else mib(k)
    return {"rss_extra_mib": mib("peak_extra_bytes"), "cache_mib": mib("cache_bytes"),
            "allocated_extra_mib": cuda("cuda_peak_allocated_extra"),
            "reserved_extra_mib": cuda("cuda_peak_reserved_extra")}


def ch03_values(s, m: dict, why: str) -> dict:
    """Section ch03_gpu from a measure_ch03 result m ({} when nothing was measured), the rest NOT_RUN."""
    leaf = leaf_of(m.get("why", why))
    steps, probes = m.get("steps", {}), m.get("probes", {})
    v = {"sweep": {}, "speedups": {}, "memory": {}}
    for name, contexts in s["steps"]["contexts"].items():
        for T in contexts:
            row = steps.get((name, T))
            v["sweep"].setdefault(name, {})[f"T{T}"] = {d: summary_leaf(leaf, row and row[d], 1e3)
                                                        for d in ("uncached",) + DESIGNS}
            v["speedups"].setdefault(name, {})[f"T{T}"] = {  # uncached over cached, round by round
                d: summary_leaf(leaf, row and ratio_summary(row["uncached"]["samples"], row[d]["samples"]),
                                unit="x") for d in DESIGNS}
    mem = s["memory"]
    v["memory"] = {name: {d: {f"B{B}": probe_values(leaf, probes.get((name, d, B))) for B in mem["batches"]}
                          for d in DESIGNS} for name in mem["models"]}
    name, contexts = next(iter(s["steps"]["contexts"].items()))
    T = f"T{max(contexts)}"
    headline = v["sweep"][name][T]["static"], v["speedups"][name][T]["static"]
    v["step_ms"], v["speedup"] = ({**x, "note": f"{name}, static cache, context {T[1:]}"} for x in headline)
    largest = v["memory"][mem["models"][0]]
    for design in DESIGNS:
        v[f"{design}_reserved_mib"] = largest[design][f"B{max(mem['batches'])}"]["reserved_extra_mib"]
    v["seconds"] = leaf(m.get("seconds"), "s")
    return v


# ---- chapter 5: the kernels' bandwidth ----

def measure_ch05(s, gpu) -> dict:
    """lab.kernel_bench.kernel_bandwidth over the grid of s["kernel"], until its time limit."""
    k, t0 = s["kernel"], time.perf_counter()
    cases = kernel_bench.kernel_bandwidth(**k, device=s["device"], deadline=t0 + s["budget_s"]["kernel"])
    timing = "CUDA events, the L2 cache flushed before each call" if s["device"] == "cuda" else "perf_counter"
    extra = dict(dtype=str(k["dtype"]).removeprefix("torch."), heads=list(k["heads"]), head_dim=k["head_dim"],
                 page_size=k["page_size"], check_batch=k["check_batch"], timing=timing)
    return dict(cases=cases, gpu=gpu, seconds=time.perf_counter() - t0, why=spent(s["budget_s"]["kernel"]), extra=extra)


def ch05_values(s, m: dict, why: str) -> dict:
    """Section ch05_gpu from a measure_ch05 result m ({} when nothing was measured), the rest NOT_RUN."""
    leaf = leaf_of(m.get("why", why))
    cases, gpu, k = m.get("cases", {}), m.get("gpu"), s["kernel"]
    peak = kernel_bench.peak_bandwidth(gpu) if gpu else None

    def fraction(gb_s):  # of the GPU's peak
        if gb_s is None or peak is not None:
            return leaf(gb_s and gb_s * 1e9 / peak * 100, "%", peak_gb_s=peak and peak / 1e9)
        return not_run(f"no peak bandwidth is known for {gpu}: add it to lab.kernel_bench.PEAK_BYTES_PER_S", "%")

    sweep = {}
    for B in k["batches"]:
        for L in k["contexts"]:
            c = cases.get((B, L))
            med = lambda part, c=c: c and c[part]["median"]
            gb_s = c and c["bytes"] / med("kernel") / 1e9
            sweep.setdefault(f"B{B}", {})[f"T{L}"] = {
                "kernel_ms": summary_leaf(leaf, c and c["kernel"], 1e3),
                "bandwidth_gb_s": leaf(gb_s, "GB/s", bytes=c and c["bytes"]),
                "fraction_of_peak": fraction(gb_s),
                "sdpa_contiguous_ms": summary_leaf(leaf, c and c["sdpa"], 1e3),
                "kernel_over_sdpa": leaf(c and med("kernel") / med("sdpa"), "x"),
                "int8_kernel_ms": summary_leaf(leaf, c and c["int8"], 1e3),
                "int8_bandwidth_gb_s": leaf(c and c["int8_bytes"] / med("int8") / 1e9, "GB/s",
                                            bytes=c and c["int8_bytes"]),
                "int8_over_float": leaf(c and med("int8") / med("kernel"), "x"),
                "max_abs_error": leaf(c and c["check"]["error"], None, within_tolerance=c and c["check"]["within"]),
                "int8_max_abs_error": leaf(c and c["int8_check"]["error"], None,
                                           within_tolerance=c and c["int8_check"]["within"])}
    # The headline: at the longest context, the batch that reads fastest (NOT_RUN if none was measured there).
    L = max(k["contexts"])
    measured = [B for B in k["batches"] if (B, L) in cases]
    B = max(measured, key=lambda B: cases[B, L]["bytes"] / cases[B, L]["kernel"]["median"]) if measured else None
    best = sweep[f"B{B if B is not None else max(k['batches'])}"][f"T{L}"]
    where = {"note": f"batch {B}, context {L}"} if B is not None else {}
    v = {"bandwidth": {**best["bandwidth_gb_s"], **where}, "bandwidth_fraction": best["fraction_of_peak"],
         "kernel_over_sdpa": best["kernel_over_sdpa"], "int8_bandwidth": best["int8_bandwidth_gb_s"],
         "int8_over_float": best["int8_over_float"]}
    errors = [c[part]["error"] for c in cases.values() for part in ("check", "int8_check")]
    v["max_abs_error"] = leaf(max(errors) if errors else None, None, cases=len(cases),
                              note="both kernels against their references, every case measured")
    return v | {"sweep": sweep, "seconds": leaf(m.get("seconds"), "s")}


# ---- chapter 8: the engine under load ----

@torch.inference_mode()
def measure_ch08(s, gpu) -> dict:
    """Chapter 8's load through ServingEngine (lab.serving_bench.engine_throughput), the largest level first,
    until its time limit; then vLLM over the largest level's requests, in what is left of the run's. One
    workload of max(levels) requests: level C sends its first C, the sequential loop its first few."""
    v, device, t0 = s["serve"], s["device"], time.perf_counter()
    model = load(v["model"]).to(device)
    requests = workload(max(v["levels"]), rate=math.inf, seed=0, vocab=model.config.vocab_size,
                        max_prompt=v["max_prompt"], max_output=v["max_output"])
    K = min(v["sequential"], len(requests))
    m = serving_bench.engine_throughput(model, requests, v["levels"], v["reps"], K, v["page_size"],
                                        v["max_batch_tokens"], device, deadline=t0 + s["budget_s"]["serving"])
    largest, vllm = max(v["levels"]), None
    if largest in m["levels"]:
        left = s["budget_s"]["total"] - (time.perf_counter() - STARTED)
        vllm = (serving_bench.vllm_run(requests[:largest], left) if device == "cuda"
                else {"why": "a dry run on the CPU never starts vLLM"})
    extra = dict(manifest={v["model"]: model.manifest}, dtype=str(model.dtype).removeprefix("torch."),
                 decode_attention=m["decode_attention"], engine=m["engine"],
                 workload=dict(dataset="ShareGPT (synthetic lengths)", seed=0, arrivals="all at 0 s",
                               max_prompt=v["max_prompt"], max_output=v["max_output"], levels=list(v["levels"]),
                               sequential_requests=K))
    return m | dict(vllm=vllm, seconds=time.perf_counter() - t0, extra=extra, why=spent(s["budget_s"]["serving"]))


def ch08_values(s, m: dict, why: str) -> dict:
    """Section ch08_gpu from a measure_ch08 result m ({} when nothing was measured), the rest NOT_RUN."""
    why = m.get("why", why)
    leaf = leaf_of(why)
    levels, seq = m.get("levels", {}), m.get("sequential")
    seq_rate = seq and seq["tokens"] / seq["time"]["median"]
    v = {"engine": {}, "speedups": {}}
    for C in s["serve"]["levels"]:
        r = levels.get(C)
        t = r and r["time"]
        rate = r and r["tokens"] / t["median"]
        v["engine"][f"C{C}"] = {
            "output_tok_s": leaf(rate, "tok/s", **(r and dict(min=r["tokens"] / t["max"], max=r["tokens"] / t["min"],
                                                              n=t["n"]) or {})),
            "wall_s": summary_leaf(leaf, t, unit="s"),
            "output_tokens": leaf(r and r["tokens"], "tokens"),
            "prompt_tokens": leaf(r and r["prompt_tokens"], "tokens"),
            "steps": leaf(r and r["steps"], "steps"),
            "mean_batch": leaf(r and r["mean_batch"], "requests", note="sequences per step")}
        v["speedups"][f"C{C}"] = leaf(rate and seq_rate and rate / seq_rate, "x", note="over the sequential loop")
    v["sequential"] = {"output_tok_s": leaf(seq_rate, "tok/s", **(seq and {"requests": seq["requests"]} or {})),
                       "wall_s": summary_leaf(leaf, seq and seq["time"], unit="s"),
                       "output_tokens": leaf(seq and seq["tokens"], "tokens")}
    largest = f"C{max(s['serve']['levels'])}"
    v["output_tok_s"] = {**v["engine"][largest]["output_tok_s"], "note": f"{largest[1:]} requests at once"}
    v["speedup"] = v["speedups"][largest]
    v["preemptions"] = leaf(m.get("preemptions"), "preemptions")
    v["vllm"] = serving_bench.vllm_values(m.get("vllm") or {"why": why}, v["output_tok_s"])
    v["seconds"] = leaf(m.get("seconds"), "s")
    return v


# ---- chapter 11: a tier below the GPU ----

def tier_trace(t) -> list:
    """(conversation, turn, token ids) in the order sent: every conversation's turn r before any turn r + 1; a
    turn's prompt is its conversation's system prompt and the new tokens of every turn up to it."""
    g = torch.Generator().manual_seed(0)
    draw = lambda n: torch.randint(100, t["vocab"], (n,), generator=g).tolist()
    system = [draw(t["system"]) for _ in range(t["conversations"])]
    turns = [[draw(t["turn_tokens"]) for _ in range(t["turns"])] for _ in range(t["conversations"])]
    return [(c, r, system[c] + sum(turns[c][:r + 1], [])) for r in range(t["turns"]) for c in range(t["conversations"])]


def measure_ch11(s, gpu) -> dict:
    """The trace through vLLM's CUDA build once per mode (baseline, native offloading, LMCache), each a fresh
    vLLM, until the part's time limit; a mode that cannot start or fails is NOT_RUN with why."""
    t, t0 = s["tiers"], time.perf_counter()
    trace = tier_trace(t)
    extra = dict(trace=dict(conversations=t["conversations"], turns=t["turns"], system_tokens=t["system"],
                            turn_tokens=t["turn_tokens"], order="turn by turn", seed=0),
                 engine=dict(block_size=t["block_size"], num_gpu_blocks=t["num_gpu_blocks"],
                             offload_gib=t["offload_gib"], dtype="float32", enforce_eager=True),
                 dynamo_commands=DYNAMO_COMMANDS)
    done = lambda **m: dict(runs={}, whys={}, seconds=time.perf_counter() - t0, extra=extra) | m
    if s["device"] != "cuda":
        return done(why="a dry run on the CPU never starts vLLM")
    python, found = vllm_gpu.find_vllm_cuda()
    if python is None:
        return done(why=found)
    runs, whys, deadline = {}, {}, t0 + s["budget_s"]["tiers"]
    request = dict(model=str(smollm2_folder()), offload_gib=t["offload_gib"], num_gpu_blocks=t["num_gpu_blocks"],
                   block_size=t["block_size"], max_model_len=t["max_model_len"], prompts=[ids for _, _, ids in trace])
    for mode in t["modes"]:
        left = deadline - time.perf_counter()
        if left < t["start_s"]:
            whys[mode] = f"{found} is at hand, but the part's time limit left {left:.0f} s, too few to start it"
            continue
        try:
            runs[mode] = ch11_offload.run(python, request | dict(mode=mode), timeout=left)
        except (RuntimeError, subprocess.TimeoutExpired) as e:
            whys[mode] = f"{found} with {mode} failed to run: {e}"[:2000]
    return done(runs=runs, whys=whys, why=f"{found}: not run", found=found)


def tier_values(leaf, run, turns: list) -> dict:
    """One mode's values from its run (ch11_offload's answer, None when not run); turns: each request's turn."""
    res = run and run["results"]
    median = lambda xs: sorted(xs)[len(xs) // 2] if xs else None
    every = res or []
    later = [q for q, r in zip(every, turns, strict=True) if r > 0] if res else []
    percent = lambda qs: qs and sum(q["num_cached_tokens"] for q in qs) / sum(q["prompt_tokens"] for q in qs) * 100
    ttft = lambda qs: median([q["ttft_s"] * 1e3 for q in qs])
    return {"cached_percent": leaf(percent(every) or (0.0 if res else None), "%",
                                   note="prompt tokens found cached, every request"),
            "later_turn_cached_percent": leaf(percent(later) or (0.0 if res else None), "%",
                                              note="prompt tokens found cached, turns after the first"),
            "ttft_ms": leaf(ttft(every), "ms", requests=len(turns), note="median time to first token, every request"),
            "later_turn_ttft_ms": leaf(ttft(later), "ms", note="median time to first token, turns after the first"),
            "prompt_tokens": leaf(res and sum(q["prompt_tokens"] for q in res), "tokens"),
            "cached_tokens": leaf(res and sum(q["num_cached_tokens"] for q in res), "tokens"),
            "version": leaf(run and run["vllm"], None, lmcache=run and run.get("lmcache"))}


def ch11_values(s, m: dict, why: str) -> dict:
    """Section ch11_gpu from a measure_ch11 result m ({} when nothing was measured), the rest NOT_RUN."""
    t, runs, whys = s["tiers"], m.get("runs", {}), m.get("whys", {})
    why = m.get("why", why)
    turns = [r for _, r, _ in tier_trace(t)]
    v = {"tiers": {mode: tier_values(leaf_of(whys.get(mode, why)), runs.get(mode), turns) for mode in t["modes"]}}
    base = v["tiers"]["baseline"]["later_turn_ttft_ms"]["value"]
    for mode in ("native", "lmcache"):
        ms = v["tiers"][mode]["later_turn_ttft_ms"]["value"]
        measured = NOT_RUN not in (ms, base)
        v[f"{mode}_over_baseline"] = leaf_of(whys.get(mode) or whys.get("baseline") or why)(
            ms / base if measured else None, "x", note=f"later turns' median time to first token, {mode} over none")
    v["dynamo"] = {"kv_router": not_run("the GPU script does not start NVIDIA Dynamo; on GPUs run: "
                                        + DYNAMO_COMMANDS.replace("\n", "; "), "ms")}
    v["seconds"] = leaf_of(why)(m.get("seconds"), "s")
    return v


# ---- the run ----

STARTED = time.perf_counter()   # reset by run(); vLLM gets what is left of BUDGET_S["total"]
PARTS = {"ch03": (measure_ch03, ch03_values), "ch05": (measure_ch05, ch05_values), "ch08": (measure_ch08, ch08_values),
         "ch11": (measure_ch11, ch11_values)}


def not_run_values(s, reason: str) -> dict:
    """{section: values} for a run that measured nothing: every key a measured run writes, NOT_RUN."""
    return {s["sections"][part]: build(s, {}, reason) for part, (_, build) in PARTS.items()}


def write_not_run(section: str, values: dict, reason: str):
    """Write a NOT_RUN section, unless the file already holds measurements (values other than NOT_RUN) there:
    a CPU-only run, or a failed one, never overwrites them."""
    doc = read()
    if any(lookup(doc, key)["value"] != NOT_RUN for key in leaf_keys(doc) if key.split(".")[0] == section):
        print(f"{section}: keeping the GPU measurements already in {results_path()} ({reason})")
        return
    write_section(section, values, provenance())
    print(f"{section}: NOT_RUN ({reason})")


def run(dry_run=False):
    """Measure every part on s's device and write each section when it is done; without CUDA, NOT_RUN.
    Returns {section: values} of a measured run, None without a GPU."""
    global STARTED
    STARTED = time.perf_counter()
    s = settings(dry_run)
    print("chapter 11: NVIDIA Dynamo's KV-aware router, on GPUs (this script does not start it):\n"
          + DYNAMO_COMMANDS, flush=True)
    if s["device"] == "cuda" and not torch.cuda.is_available():
        for section, values in not_run_values(s, NO_GPU).items():
            write_not_run(section, values, NO_GPU)
        return None
    gpu = torch.cuda.get_device_name(0) if s["device"] == "cuda" else "the CPU, in Triton's interpreter"
    label = dict(run="dry run: tiny sizes on the CPU, the kernels in Triton's interpreter") if dry_run else {}
    written, failures = {}, []
    for part, (measure, build) in PARTS.items():
        section = s["sections"][part]
        if s["device"] == "cuda":
            torch.cuda.empty_cache()   # what the last part's tensors held, back to this part's processes
        results.start_clock()
        try:
            m = measure(s, gpu)
        except Exception as e:  # a part that fails must not lose the others' measurements: record it, go on
            traceback.print_exc()
            reason = f"the run on {gpu} failed: {type(e).__name__}: {e}"[:500]
            failures.append(f"{section}: {type(e).__name__}: {e}")
            write_not_run(section, build(s, {}, reason), reason)
            continue
        written[section] = build(s, m, "")
        write_section(section, written[section], provenance(**m["extra"], **label))
        print(f"{section}: measured in {m['seconds']:.0f} s on {gpu}", flush=True)
    print(f"all parts in {time.perf_counter() - STARTED:.0f} s")
    if failures:
        raise RuntimeError("parts of the GPU run failed (NOT_RUN recorded with the error):\n  " + "\n  ".join(failures))
    return written


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lab.experiments.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU with tiny sizes (for tests)")
    args = parser.parse_args()
    if not args.dry_run:
        results.require_clean()
    run(args.dry_run)
