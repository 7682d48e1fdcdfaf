"""`python -m lab.experiments.gpu`: every CUDA measurement of the book, in one command (under 5 minutes).

On a machine with a GPU it runs chapter 3's step-time sweep and memory probe on CUDA and writes section
`ch03_gpu` of results.json with the GPU's provenance. Without one, it records NOT_RUN with the reason —
unless the section already holds measurements, which a CPU-only run must never overwrite.

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


def settings(dry_run: bool) -> dict:
    if dry_run:
        return dict(device="cpu", models=("tiny-llama",), contexts=[16, 64], reps=2, warmup=1, memory_tokens=48,
                    batches=(1, 2), section="gpu_dryrun")
    return dict(device="cuda", models=("gpt2-random", "smollm2"), contexts=[16, 32, 64, 128, 256, 512, 960],
                reps=10, warmup=3, memory_tokens=960, batches=(1, 8), section=SECTION)


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
    if has_measurements(SECTION):
        print(f"{SECTION}: keeping the GPU measurements already in {results_path()} ({reason})")
        return
    values = {"step_ms": not_run(reason, "ms"), "speedup": not_run(reason, "x"),
              "memory": {"allocated_extra_mib": not_run(reason, "MiB"), "reserved_extra_mib": not_run(reason, "MiB")}}
    write_section(SECTION, values, provenance())
    print(f"{SECTION}: NOT_RUN ({reason})")


def run(dry_run=False):
    s = settings(dry_run)
    if s["device"] == "cuda" and not torch.cuda.is_available():
        record_not_run("no CUDA device on the machine that ran `make results`; run `python -m lab.experiments.gpu` "
                       "on a machine with a GPU")
        return None
    t0 = time.perf_counter()
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
        values["speedup"][name] = {f"T{T}": {d: value(x, "x") for d, x in sp.items()}
                                   for T, sp in ch03.speedups(times).items()}
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
    print(f"{s['section']}: measured in {time.perf_counter() - t0:.0f} s on {s['device']}")
    return values


if __name__ == "__main__":
    parser = argparse.ArgumentParser(prog="python -m lab.experiments.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="run on the CPU with tiny sizes (for tests)")
    run(parser.parse_args().dry_run)
