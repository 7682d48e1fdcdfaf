"""`LAB_FULL=1 python -m lab.experiments.gpu`: every CUDA measurement of the book, in one command (a few
minutes). LAB_FULL=1 writes results/results.json, as `make results` does; without it the run is in quick
mode and writes a temporary results file.

On a machine with a GPU it runs chapter 3's step-time sweep and memory probe on CUDA (section `ch03_gpu`
of results.json) and chapter 5's paged-attention kernel: achieved bandwidth at contexts 4k-32k and batch
1-64, and the kernel against SDPA on a contiguous cache (section `ch05_gpu`), with the GPU's provenance;
beside it, at the same shapes, the INT8 kernel over the same pages quantized (int8 codes and a float32
scale per token per kv head) and its time against the float kernel's.
Then chapter 8's load (section `ch08_gpu`, sized for about 2 minutes on an H200): requests from
`lab.loadgen.workload` (ShareGPT-shaped lengths, all arriving at once) through `ServingEngine` in this
process, on SmolLM2 in float32, at 1, 16, 64 and 256 requests at once; output tokens per second of each
`generate` (after a warm-up run of the same requests), the sequential loop (the first 8 requests one after
another through the same engine) for comparison, and the ratio of the two. On CUDA the engine's decode
attention is chapter 5's Triton kernel (`lab.kernels.decode_attention` dispatches to it for CUDA tensors;
the section's provenance names the kernel that ran). vLLM runs beside it only if some environment here
holds a CUDA build of vLLM; otherwise its value is NOT_RUN with the reason.
Without a GPU, it records NOT_RUN with the reason — unless a section already holds measurements, which a
CPU-only run must never overwrite.

`--dry-run` runs the same code on the CPU with tiny sizes, into sections `gpu_dryrun`, `gpu_dryrun_ch05` and
`gpu_dryrun_ch08`, so the tests can exercise the script on machines without a GPU.
"""

import argparse
import math
import subprocess
import time

import torch

from .. import memory, step_cost
from ..models import load
from ..peers import vllm_gpu
from ..results import not_run, provenance, read, results_path, value, write_section
from . import ch03_savings as ch03

SECTION = "ch03_gpu"
SECTION5 = "ch05_gpu"
SECTION8 = "ch08_gpu"


# Chapter 8 on the GPU: the chapter's CPU load, larger. Prompts up to 256 and answers up to 64 tokens keep
# the whole part near 2 minutes on an H200.
SERVE = dict(model="smollm2",
             levels=(1, 16, 64, 256),   # requests at once: one alone, then batches only a GPU serves quickly
             max_prompt=256,            # ShareGPT's long tail is clipped here (workload's max_prompt)
             max_output=64,             # every answer runs to its length: no eos stop on either side
             sequential=8,              # requests in the one-after-another loop (up to 64 decode steps each)
             reps=3,                    # timed runs per level, after one warm-up run
             page_size=16,              # vLLM's default block size too
             max_batch_tokens=2048,     # a step's token budget: 256 decodes and several prompt chunks fit
             section=SECTION8)
# The same code on the CPU for --dry-run: the tiny model, a small budget so that prompts are chunked.
SERVE_DRY = dict(model="tiny-llama", levels=(1, 4), max_prompt=16, max_output=4, sequential=2, reps=1, page_size=16,
                 max_batch_tokens=32, section="gpu_dryrun_ch08")


def settings(dry_run: bool) -> dict:
    if dry_run:  # the kernel runs under Triton's interpreter here: tiny shapes
        return dict(device="cpu", models=("tiny-llama",), contexts=[16, 64], reps=2, warmup=1, memory_tokens=48,
                    batches=(1, 2), section="gpu_dryrun", kernel_contexts=[40], kernel_batches=[1, 2],
                    kernel_heads=(4, 2), kernel_head_dim=16, kernel_dtype=torch.float32, kernel_reps=1,
                    section5="gpu_dryrun_ch05", serve=SERVE_DRY)
    return dict(device="cuda", models=("gpt2-random", "smollm2"), contexts=[16, 32, 64, 128, 256, 512, 960],
                reps=10, warmup=3, memory_tokens=960, batches=(1, 8), section=SECTION,
                kernel_contexts=[4096, 8192, 16384, 32768], kernel_batches=[1, 4, 16, 64],
                kernel_heads=(32, 8), kernel_head_dim=128, kernel_dtype=torch.float16, kernel_reps=20,
                section5=SECTION5, serve=SERVE)


# Peak memory bandwidth by GPU name, from the vendor's product page (NVIDIA, "H200 Tensor Core GPU",
# specifications: GPU memory bandwidth 4.8 TB/s; research/ch03/sources.md); others: not known here.
PEAK_BYTES_PER_S = {"H200": 4.8e12}


def peak_bandwidth(name: str):
    return next((v for k, v in PEAK_BYTES_PER_S.items() if k in name), None)


@torch.inference_mode()
def kernel_case(B, L, s, gpu) -> dict:
    """One (batch, context): the kernel's time and bandwidth, SDPA over a contiguous cache, and the INT8
    kernel's time and bandwidth over the same pages quantized."""
    import torch.nn.functional as F

    from ..bench import time_call
    from ..kernels import paged_attention, paged_attention_int8, quantize_pages
    from ..kernels.pages import paged_copy

    (Hq, Hkv), D, dtype, device = s["kernel_heads"], s["kernel_head_dim"], s["kernel_dtype"], s["device"]
    g = torch.Generator().manual_seed(L + B)
    q = torch.randn(B, Hq, D, generator=g).to(device, dtype)                          # [B, H_q, D]
    k, v = (torch.randn(B, Hkv, L, D, generator=g).to(dtype) for _ in range(2))         # [B, H_kv, L, D]
    pool_k, pool_v, tables, lengths = (t.to(device) for t in paged_copy(k, v, 16, g))
    k, v = k.to(device), v.to(device)
    kernel = time_call(lambda: paged_attention(q, pool_k, pool_v, tables, lengths), 2, s["kernel_reps"], device=device)
    sdpa = time_call(lambda: F.scaled_dot_product_attention(q[:, :, None], k, v, enable_gqa=True), 2,
                     s["kernel_reps"], device=device)
    bandwidth = 2 * B * L * Hkv * D * k.element_size() / kernel["median"]              # every key and value once
    codes_k, codes_v, scale_k, scale_v = quantize_pages(pool_k, pool_v)                 # int8 [pages, 16, H_kv, D]
    int8 = time_call(lambda: paged_attention_int8(q, codes_k, codes_v, scale_k, scale_v, tables, lengths), 2,
                     s["kernel_reps"], device=device)
    int8_bytes = 2 * B * L * Hkv * (D * codes_k.element_size() + scale_k.element_size())  # codes and scales once
    int8_bandwidth = int8_bytes / int8["median"]
    peak = peak_bandwidth(gpu)
    return {"kernel_ms": value(kernel["median"] * 1e3, "ms", n=kernel["n"]),
            "sdpa_contiguous_ms": value(sdpa["median"] * 1e3, "ms"),
            "kernel_over_sdpa": value(kernel["median"] / sdpa["median"], "x"),
            "bandwidth_gb_s": value(bandwidth / 1e9, "GB/s"),
            "fraction_of_peak": (value(bandwidth / peak * 100, "%") if peak
                                 else value("unknown", None, note=f"no peak bandwidth known for {gpu}")),
            "int8_kernel_ms": value(int8["median"] * 1e3, "ms", n=int8["n"]),
            "int8_bandwidth_gb_s": value(int8_bandwidth / 1e9, "GB/s", bytes=int8_bytes),
            "int8_over_float": value(int8["median"] / kernel["median"], "x")}


def kernel_bandwidth(s: dict) -> dict:
    """The Triton paged-attention kernel's achieved bandwidth (bytes of K and V read / time), and its time
    against scaled_dot_product_attention over a contiguous cache, per (batch, context); the INT8 kernel's
    bandwidth (bytes of codes and scales read / time) and its time against the float kernel's."""
    gpu = torch.cuda.get_device_name(0) if s["device"] == "cuda" else "cpu (interpreter)"
    return {f"B{B}": {f"T{L}": kernel_case(B, L, s, gpu) for L in s["kernel_contexts"]} for B in s["kernel_batches"]}


def level(C: int) -> str:
    return f"C{C}"


@torch.inference_mode()
def serving(s: dict) -> tuple[dict, dict]:
    """Chapter 8's load through ServingEngine on s["device"]: (values, provenance extras).

    One workload of max(levels) requests, all arriving at once; level C sends its first C, so every level
    and the sequential loop share their prompts. The pool holds every request of the largest level at once
    (no preemption), and prefix caching is off: the warm-up run sends the same prompts, and its pages must
    not shorten the timed runs' prefills. Output tokens per second = output tokens / wall time of one
    `generate`, median of `reps` runs after one warm-up run."""
    from ..bench import time_call
    from ..engine import ServingEngine
    from ..kernels import triton_paged
    from ..loadgen import workload

    v, device = s["serve"], s["device"]
    model = load(v["model"]).to(device)
    requests = workload(max(v["levels"]), rate=math.inf, seed=0, vocab=model.config.vocab_size,
                        max_prompt=v["max_prompt"], max_output=v["max_output"])
    prompts, news = [r.prompt for r in requests], [r.max_tokens for r in requests]
    P = v["page_size"]
    num_pages = sum(-(-(len(p) + n - 1) // P) for p, n in zip(prompts, news, strict=True))  # all at once
    engine = ServingEngine(model, num_pages, P, v["max_batch_tokens"], prefix_caching=False)
    values = {"engine": {}, "speedup": {}}
    for C in v["levels"]:
        batch = lambda C=C: engine.generate(prompts[:C], news[:C])
        tokens = sum(map(len, batch()))                                 # the warm-up run
        steps, sizes = engine.stats["steps"], len(engine.stats["batch_sizes"])
        t = time_call(batch, warmup=0, reps=v["reps"], device=device)
        per_step = engine.stats["batch_sizes"][sizes:]                  # sequences in each timed step
        values["engine"][level(C)] = {
            "output_tok_s": value(tokens / t["median"], "tok/s", min=tokens / t["max"], max=tokens / t["min"],
                                  n=t["n"]),
            "wall_s": value(t["median"], "s", min=t["min"], max=t["max"], n=t["n"]),
            "output_tokens": value(tokens, "tokens"),
            "prompt_tokens": value(sum(len(p) for p in prompts[:C]), "tokens"),
            "steps": value((engine.stats["steps"] - steps) / t["n"], "steps"),
            "mean_batch": value(sum(per_step) / len(per_step), "requests", note="sequences per step"),
        }
    K = min(v["sequential"], len(prompts))

    def one_after_another():
        for p, n in zip(prompts[:K], news[:K], strict=True):
            engine.generate([p], n)

    t = time_call(one_after_another, warmup=0, reps=1, device=device)  # warm: the levels ran first
    tokens = sum(news[:K])
    sequential = tokens / t["median"]
    values["sequential"] = {"output_tok_s": value(sequential, "tok/s", requests=K),
                            "wall_s": value(t["median"], "s", requests=K),
                            "output_tokens": value(tokens, "tokens")}
    for C in v["levels"]:
        rate = values["engine"][level(C)]["output_tok_s"]["value"]
        values["speedup"][level(C)] = value(rate / sequential, "x", note=f"over the sequential loop ({K} requests)")
    values["preemptions"] = value(engine.stats["preemptions"], "preemptions")
    largest = max(v["levels"])
    values["vllm"] = vllm_values(s, prompts[:largest], news[:largest], values["engine"][level(largest)])
    kernel = ("Triton paged decode kernel (lab.kernels.triton_paged)"
              if device == "cuda" and triton_paged.triton is not None and not triton_paged.INTERPRETED
              else "paged_attention_cpu (PyTorch gather + SDPA)")
    extra = dict(manifest={v["model"]: model.manifest}, dtype=str(model.dtype).removeprefix("torch."),
                 decode_attention=kernel,
                 engine=dict(num_pages=num_pages, page_size=P, max_batch_tokens=v["max_batch_tokens"],
                             prefix_caching=False),
                 workload=dict(dataset="ShareGPT (synthetic lengths)", seed=0, arrivals="all at 0 s",
                               max_prompt=v["max_prompt"], max_output=v["max_output"], levels=list(v["levels"]),
                               sequential_requests=K))
    return values, extra


# ---- vLLM on the GPU, only where an environment holds a CUDA build of it (lab.peers.vllm_gpu) ----

def vllm_values(s, prompts, news, engine) -> dict:
    """vLLM's output tokens per second at the largest level, beside the engine's; NOT_RUN and why where no
    CUDA build of vLLM is at hand (or on a dry run, which never runs it)."""
    python, found = vllm_gpu.find_vllm_cuda()
    if python is None:
        return {"output_tok_s": not_run(found, "tok/s")}
    if s["device"] != "cuda":
        return {"output_tok_s": not_run(f"a dry run on the CPU never starts vLLM ({found} is at hand)", "tok/s")}
    from ..models.load import smollm2_folder
    try:
        # half the GPU's memory: the lab's model and pool still hold theirs in this process
        r = vllm_gpu.vllm_throughput(python, smollm2_folder(), prompts, news,
                                     engine_args=dict(gpu_memory_utilization=0.5))
    except (RuntimeError, subprocess.TimeoutExpired) as e:
        return {"output_tok_s": not_run(f"{found} failed to run: {e}"[:2000], "tok/s")}
    rate = r["output_tokens"] / r["seconds"]
    return {"output_tok_s": value(rate, "tok/s", requests=len(prompts), output_tokens=r["output_tokens"],
                                  version=r["vllm"], note="offline LLM.generate, float32, after one warm-up run"),
            "over_engine": value(rate / engine["output_tok_s"]["value"], "x")}


def not_run_serving(reason: str, levels=SERVE["levels"]) -> dict:
    """Chapter 8's NOT_RUN values under the very keys a GPU run writes, so that the manuscript's references
    (e.g. ch08_gpu.engine.C256.output_tok_s) resolve before and after."""
    return {"engine": {level(C): {"output_tok_s": not_run(reason, "tok/s")} for C in levels},
            "sequential": {"output_tok_s": not_run(reason, "tok/s")},
            "speedup": {level(C): not_run(reason, "x") for C in levels},
            "vllm": {"output_tok_s": not_run(reason, "tok/s")}}


def has_measurements(section: str) -> bool:
    """True when results.json already holds real (not NOT_RUN) values in this section."""
    sec = read().get("sections", {}).get(section)
    if not sec:
        return False
    leaves, stack = [], [sec["values"]]
    while stack:
        node = stack.pop()
        if "value" in node:
            leaves.append(node["value"])
        else:
            stack.extend(v for v in node.values() if isinstance(v, dict))
    return any(v != "NOT_RUN" for v in leaves)


def record_not_run(reason: str):
    blanks = {SECTION: {"step_ms": not_run(reason, "ms"), "speedup": not_run(reason, "x"),
                        "memory": {"allocated_extra_mib": not_run(reason, "MiB"),
                                   "reserved_extra_mib": not_run(reason, "MiB")}},
              SECTION5: {"bandwidth": not_run(reason, "GB/s"), "kernel_over_sdpa": not_run(reason, "x"),
                         "int8_bandwidth": not_run(reason, "GB/s"), "int8_over_float": not_run(reason, "x")},
              SECTION8: not_run_serving(reason)}
    for section, values in blanks.items():
        if has_measurements(section):
            print(f"{section}: keeping the GPU measurements already in {results_path()} ({reason})")
            continue
        write_section(section, values, provenance())
        print(f"{section}: NOT_RUN ({reason})")


def run(dry_run=False):
    s = settings(dry_run)
    if s["device"] == "cuda" and not torch.cuda.is_available():
        record_not_run("no CUDA device on the machine that ran `make results`; run "
                       "`LAB_FULL=1 python -m lab.experiments.gpu` on a machine with a GPU")
        return None
    t0 = time.perf_counter()  # the whole script's wall time, read once (every measurement times through lab.bench)
    values = {"step_ms": {}, "speedup": {}, "memory": {}}
    manifests = {}
    for name in s["models"]:
        model = load(name).to(s["device"])
        manifests[name] = model.manifest
        contexts = s["contexts"] + ([2048] if name == "smollm2" else [])
        times = step_cost.step_times(model, contexts, s["reps"], s["warmup"])
        values["step_ms"][name] = {f"T{T}": {d: value(st["median"] * 1e3, "ms", min=st["min"] * 1e3,
                                                      max=st["max"] * 1e3, n=st["n"])
                                             for d, st in row.items()} for T, row in times.items()}
        values["speedup"][name] = {f"T{T}": {d: value(r["median"], "x", min=r["min"], max=r["max"], n=r["n"])
                                             for d, r in sp.items()} for T, sp in ch03.speedups(times).items()}
        del model
    rows = memory.sweep(s["models"], ("concat", "static"), s["batches"], s["memory_tokens"], device=s["device"])
    for r in rows:
        entry = {"rss_extra_mib": value(r["peak_extra_bytes"] / 2**20, "MiB"),
                 "cache_mib": value(r["cache_bytes"] / 2**20, "MiB")}
        if "cuda_peak_allocated_extra" in r:
            entry["allocated_extra_mib"] = value(r["cuda_peak_allocated_extra"] / 2**20, "MiB")
            entry["reserved_extra_mib"] = value(r["cuda_peak_reserved_extra"] / 2**20, "MiB")
        values["memory"].setdefault(r["model"], {}).setdefault(r["design"], {})[f"B{r['batch_size']}"] = entry
    values["seconds"] = value(time.perf_counter() - t0, "s")
    write_section(s["section"], values, provenance(manifest=manifests, dtype="float32"))
    bandwidth = kernel_bandwidth(s)
    write_section(s["section5"], {"bandwidth": bandwidth}, provenance(dtype=str(s["kernel_dtype"]),
                                                                        heads=list(s["kernel_heads"])))
    t8 = time.perf_counter()
    served, extra = serving(s)
    served["seconds"] = value(time.perf_counter() - t8, "s")
    write_section(s["serve"]["section"], served, provenance(**extra))
    print(f"{s['section']}, {s['section5']}, {s['serve']['section']}: measured in {time.perf_counter() - t0:.0f} s "
          f"on {s['device']}")
    return values


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lab.experiments.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU with tiny sizes (for tests)")
    run(parser.parse_args().dry_run)
