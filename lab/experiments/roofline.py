"""Chapter 3's roofline (section "roofline": `python -m lab.experiments.roofline`; LAB_FULL=1 writes
results/results.json): this machine's read bandwidth and peak FLOP rate, measured in the same run as the
decode steps they bound.

For SmolLM2 in float32 and bfloat16, the serving engine's decode step of B sequences at T cached positions
each (random ids: a step's time does not depend on the text), timed in rounds after the prefill
(`lab.step_cost.engine_steps`); beside it what the step must read and compute (`lab.roofline.step_model`)
and the time that allows at the measured rates (`bound`). `fraction` is that time over the measured one: 100%
would be a step that does nothing but read its bytes at the rate the sum read; over 100%, a step that read faster.

`breakdown`: where one sequence's step goes, at each context (`lab.step_cost.profile`), through the reference
step (`forward_cached`, fast_decode=False): the engine's own work (the identity check, scheduling, the step's
batch), attention, and the forward's matrix products timed alone (`lab.roofline.products`, with the rate at which
they read the weights) against the rest of the forward (norms, RoPE, activations, residual adds, sampling, and the
Python between them). Beside it the same step as the engine runs it, in one C++ call (`lab/engine/fast.py`):
its time, and the rate at which it reads the step's bytes. The steps above are the fused ones where the fused step
takes that many decodes (`fused_rows`, per dtype, measured on this machine as the server measures it at start:
`FusedStep.tune`, whose timings are `fused_tune`), the reference ones beyond. Quick mode:
batches 1 and 4, 128 and 512 positions, float32, a quarter-GiB buffer.
"""

import random
import time

import torch
from tqdm.auto import tqdm

from .. import roofline
from ..engine import ServingEngine
from ..models import load
from ..results import figures_dir, provenance, quick, require_clean, start_clock, value, write_section
from ..step_cost import engine_steps, profile
from . import plots
from .plots import finish

SECTION = "roofline"
PAGE = 16
FULL = dict(batches=(1, 4, 16), contexts=(512, 2048, 4096), dtypes=("float32", "bfloat16"), rounds=9,
            buffer=roofline.GiB, matmul=4096)
QUICK = dict(batches=(1, 4), contexts=(128, 512), dtypes=("float32",), rounds=3, buffer=roofline.GiB // 4,
             matmul=1024)


def settings(quick_mode=None) -> dict:
    return QUICK if (quick() if quick_mode is None else quick_mode) else FULL


def decode_step(model, batch: int, context: int, rounds: int, rows: int, seed: int = 0) -> dict:
    """The engine's decode step of `batch` sequences at `context` positions, fused up to `rows` decodes:
    {"step_s", "kv_read_bytes"}."""
    rng = random.Random(seed)
    prompts = [[rng.randrange(model.config.vocab_size) for _ in range(context)] for _ in range(batch)]
    # every request decodes through the others' prefill chunks (decodes go first), then the timed steps
    warmup = 2
    new = warmup + rounds + batch * context // 2048 + 4
    engine = ServingEngine(model, num_pages=batch * ((context + new) // PAGE + 2), page_size=PAGE,
                           max_batch_tokens=2048, prefix_caching=False, fast_decode=rows)
    r = engine_steps({"plain": engine}, prompts, rounds=rounds, warmup=warmup, new_tokens=new)["plain"]
    return {"step_s": r["step_s"], "kv_read_bytes": r["kv_read_bytes"]}


def measure(quick_mode=None) -> dict:
    s = settings(quick_mode)
    ceilings = roofline.machine(s["buffer"], s["matmul"])
    steps, manifest = {}, {}
    cases = [(d, b, t) for d in s["dtypes"] for b in s["batches"] for t in s["contexts"]]
    models = {d: load("smollm2", d) for d in s["dtypes"]}
    tuned = {d: ServingEngine(models[d], 2, PAGE, PAGE, fast_decode="measure").fast
             for d in tqdm(s["dtypes"], desc="the fused step's sizes")}   # as the server measures them at start
    rows = {d: fast.rows if fast else 0 for d, fast in tuned.items()}
    for d, b, t in tqdm(cases, desc="decode steps"):
        steps.setdefault(d, {}).setdefault(b, {})[t] = decode_step(models[d], b, t, s["rounds"], rows[d])
        manifest[d] = models[d].manifest
    breakdown = {}
    for d in tqdm(s["dtypes"], desc="one sequence's step, by part"):
        weights = ServingEngine(models[d], num_pages=2, page_size=PAGE, max_batch_tokens=PAGE).weights  # as it runs
        breakdown[d] = {"products": roofline.products(weights, models[d].config, s["rounds"]),
                        "steps": {t: profile(models[d], 1, t, steps=s["rounds"], fast=False) for t in s["contexts"]},
                        "fused": {t: profile(models[d], 1, t, steps=s["rounds"]) for t in s["contexts"]}}
    return dict(settings=s, machine=ceilings, steps=steps, breakdown=breakdown, manifest=manifest,
                threads=torch.get_num_threads(), config={d: m.config for d, m in models.items()},
                fused_rows=rows, fused_tune={d: fast.timings for d, fast in tuned.items() if fast})


def cases(m: dict):
    """(dtype, batch, context, measured, model, bound) for every step measured."""
    for d, by_batch in m["steps"].items():
        for b, by_context in by_batch.items():
            for t, measured in by_context.items():
                step = roofline.step_model(m["config"][d], b, t)
                yield d, b, t, measured, step, roofline.bound(step, m["machine"], d)


def values(m: dict) -> dict:
    c = m["machine"]
    v = {"machine": {"read_bandwidth": value(c["read_gb_s"], "GB/s", note=f"x.sum() over {c['buffer_bytes']:,} "
                                             "bytes of float32, the fastest of its runs"),
                     "copy_bandwidth": value(c["copy_gb_s"], "GB/s", note="y.copy_(x), two bytes moved per byte"),
                     "peak": {d: value(f, "GFLOP/s", note=f"a @ a, {c['matmul']} x {c['matmul']}")
                              for d, f in c["flops"].items()}},
         "steps": {}}
    if "fused_rows" in m:
        v["fused_rows"] = {d: value(n, "decodes", note="the most a step may hold to run in one C++ call, as measured")
                           for d, n in m["fused_rows"].items()}
    for d, timings in m.get("fused_tune", {}).items():
        v.setdefault("fused_tune", {})[d] = {f"b{b}": {
            "fused_ms": value(t["fused"] * 1e3, "ms", note="the fused step's, the fastest of its rounds"),
            "reference_ms": value(t["reference"] * 1e3, "ms", note="forward_cached's, the fastest of its rounds")}
            for b, t in timings.items()}
    for d, b, t, measured, step, bound in cases(m):
        v["steps"].setdefault(d, {}).setdefault(f"b{b}", {})[f"t{t}"] = {
            "step_ms": value(measured["step_s"] * 1e3, "ms", note="median of the rounds"),
            "bound_ms": value(bound["bound_s"] * 1e3, "ms", note="bytes over read bandwidth, or FLOPs over peak"),
            "fraction": value(100 * bound["bound_s"] / measured["step_s"], "%", note="the bound over the step"),
            "weight_mb": value(step["weight_bytes"] / 1e6, "MB"), "cache_mb": value(step["cache_bytes"] / 1e6, "MB"),
            "gflop": value(step["flops"] / 1e9, "GFLOP"),
            "memory_bound": value(bound["bound_by"] == "memory", None),
            "achieved": value(step["bytes"] / measured["step_s"] / 1e9, "GB/s", note="bytes over the step's time")}
    ms = lambda t, note: value(t * 1e3, "ms", note=note)
    for d, b in m["breakdown"].items():
        products, read = b["products"], b["products"]["bytes"] / b["products"]["seconds"] / 1e9
        v.setdefault("breakdown", {})[d] = {
            "products_gb_s": value(read, "GB/s", note="the weights' bytes over the products' time, alone"),
            "products_fraction": value(100 * read / c["read_gb_s"], "%", note="of the sum's read bandwidth")}
        for t, pr in b["steps"].items():
            parts = pr["parts"]
            v["breakdown"][d][f"t{t}"] = {
                "step_ms": ms(pr["step_s"], "the parts' medians, summed"),
                "engine_ms": ms(parts["identity"] + parts["schedule"] + parts["batch"],
                                "the identity check, scheduling and the step's batch"),
                "attention_ms": ms(parts["attention"], "attention over the cached positions"),
                "products_ms": ms(products["seconds"], "the matrix products timed alone"),
                "other_ms": ms(parts["forward"] - products["seconds"], "the forward but its products: norms, RoPE, "
                               "activations, residual adds, sampling and the Python between"),
                "products_share": value(100 * products["seconds"] / pr["step_s"], "%")}
            fused, step = b["fused"][t], roofline.step_model(m["config"][d], 1, t)
            v["breakdown"][d][f"t{t}"] |= {
                "fused_step_ms": ms(fused["step_s"], "the same step as the engine runs it: one C++ call "
                                    "(lab/engine/fast.py), the parts' medians summed"),
                "fused_call_ms": ms(fused["parts"]["forward"], "the one call: every layer, attention and the head"),
                "fused_gb_s": value(step["bytes"] / fused["parts"]["forward"] / 1e9, "GB/s",
                                    note="the step's weights and cache bytes over the one call's time"),
                "fused_gain": value(pr["step_s"] / fused["step_s"], "x", note="the reference step over the fused")}
    return v


def plot(m: dict, path=None):
    """Measured step time (solid) and the roofline's time at the measured rates (dashed) against context, per batch."""
    dtypes = list(m["steps"])
    fig, axes = plots.figure(ncols=len(dtypes), height=3.4, squeeze=False)
    for ax, d in zip(axes[0], dtypes, strict=True):
        for i, b in enumerate(m["steps"][d]):
            rows = sorted((t, x, bd) for dd, bb, t, x, _, bd in cases(m) if dd == d and bb == b)
            ts = [r[0] for r in rows]
            color = f"C{i}"
            ax.plot(ts, [r[1]["step_s"] * 1e3 for r in rows], "o-", color=color, label=f"{b} seq.")
            ax.plot(ts, [r[2]["bound_s"] * 1e3 for r in rows], "--", color=color)
        ax.set(xlabel="cached positions per sequence", ylabel="decode step (ms)",
               title=f"SmolLM2, {d} (dashed: roofline)", ylim=(0, None))
    axes[0][-1].legend()
    return finish(fig, path)


def record(m: dict) -> dict:
    v = values(m)
    path = figures_dir() / "roofline.png"
    plot(m, path)
    write_section(SECTION, v, provenance(manifest=m["manifest"], threads=m["threads"]),
                  figures={"roofline": {"path": path, "caption": "A decode step against the time the "
                                        "measured bandwidth and FLOP rate allow"}})
    return v


if __name__ == "__main__":
    require_clean()
    start_clock()
    t0 = time.perf_counter()
    record(measure())
    print(f"roofline: done in {time.perf_counter() - t0:.0f} s")
