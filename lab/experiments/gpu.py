"""`LAB_FULL=1 python -m lab.experiments.gpu`: every CUDA measurement of the book, in one command (under 5
minutes). LAB_FULL=1 writes results/results.json, as `make results` does; without it the run is in quick
mode and writes a temporary results file.

On a machine with a GPU it runs chapter 3's step-time sweep and memory probe on CUDA (section `ch03_gpu`
of results.json) and chapter 5's paged-attention kernel: achieved bandwidth at contexts 4k-32k and batch
1-64, and the kernel against SDPA on a contiguous cache (section `ch05_gpu`), with the GPU's provenance;
beside it, at the same shapes, the INT8 kernel over the same pages quantized (int8 codes and a float32
scale per token per kv head) and its time against the float kernel's.
Without one, it records NOT_RUN with the reason — unless a section already holds measurements, which a
CPU-only run must never overwrite.

`--dry-run` runs the same code on the CPU with tiny sizes, into section `gpu_dryrun`, so the tests can
exercise the script on machines without a GPU.
"""

import argparse
import time

import torch

from ..models import load
from ..results import not_run, provenance, read, results_path, value, write_section
from . import ch03_savings as ch03
from . import memory

SECTION = "ch03_gpu"
SECTION5 = "ch05_gpu"


def settings(dry_run: bool) -> dict:
    if dry_run:  # the kernel runs under Triton's interpreter here: tiny shapes
        return dict(device="cpu", models=("tiny-llama",), contexts=[16, 64], reps=2, warmup=1, memory_tokens=48,
                    batches=(1, 2), section="gpu_dryrun", kernel_contexts=[40], kernel_batches=[1, 2],
                    kernel_heads=(4, 2), kernel_head_dim=16, kernel_dtype=torch.float32, kernel_reps=1,
                    section5="gpu_dryrun_ch05")
    return dict(device="cuda", models=("gpt2-random", "smollm2"), contexts=[16, 32, 64, 128, 256, 512, 960],
                reps=10, warmup=3, memory_tokens=960, batches=(1, 8), section=SECTION,
                kernel_contexts=[4096, 8192, 16384, 32768], kernel_batches=[1, 4, 16, 64],
                kernel_heads=(32, 8), kernel_head_dim=128, kernel_dtype=torch.float16, kernel_reps=20,
                section5=SECTION5)


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
                         "int8_bandwidth": not_run(reason, "GB/s"), "int8_over_float": not_run(reason, "x")}}
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
        times = ch03.step_times(model, contexts, s["reps"], s["warmup"])
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
    print(f"{s['section']}: measured in {time.perf_counter() - t0:.0f} s on {s['device']}")
    return values


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lab.experiments.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU with tiny sizes (for tests)")
    run(parser.parse_args().dry_run)
