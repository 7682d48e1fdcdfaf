"""Chapter 3, "What the cache saves": step time, end-to-end generation, the library, memory.

CPU measurements run here; `python -m lab.experiments.gpu` runs the same sweeps on CUDA when a GPU is
available (section ch03_gpu of results.json).
"""

import torch
from tqdm.auto import tqdm

from .. import data
from ..bench import time_call, time_steps
from ..cache import make_cache
from ..engine import CachedBackend, RecomputeBackend, generate
from ..models import forward, forward_cached, load
from ..results import figures_dir, provenance, quick, value, write_section
from .plots import finish

SECTION = "ch03"


def settings(quick_mode: bool) -> dict:
    if quick_mode:
        return dict(contexts={"gpt2-random": [16, 128, 512], "smollm2": [16, 128, 512]}, reps=3, warmup=1,
                    library_context=128, library_tokens=8, library_reps=1, memory_tokens=128, memory_batches=(1, 8),
                    memory_models=("gpt2-random",), e2e_tokens=32)
    T = [16, 32, 64, 128, 256, 512, 960]
    return dict(contexts={"gpt2-random": T, "smollm2": T + [2048]}, reps=7, warmup=2,
                library_context=512, library_tokens=32, library_reps=5, memory_tokens=960, memory_batches=(1, 8),
                memory_models=("gpt2-random", "smollm2"), e2e_tokens=32)


@torch.inference_mode()
def step_times(model, contexts, reps=7, warmup=2, designs=("concat", "static"), progress=True) -> dict:
    """One decode step at context T: uncached (a forward over T + 1 positions) and through each cache
    holding T positions (one new position). Returns {T: {"uncached": stats, design: stats}}."""
    cfg, w, device = model.config, model.weights, model.device
    out = {}
    for T in tqdm(contexts, desc=f"step time {model.name}", disable=not progress):
        g = torch.Generator().manual_seed(T)
        ids = torch.randint(0, cfg.vocab_size, (1, T + 1), generator=g).to(device)
        row = {"uncached": time_call(lambda ids=ids: forward(ids, w, cfg, last_only=True), warmup, reps,
                                     device=device)}
        for design in designs:
            cache = make_cache(design, cfg, T + 1, device=device)
            forward_cached(ids[:, :T], w, cfg, cache)                          # prefill, untimed
            row[design] = time_steps(lambda cache=cache, T=T: cache.crop(T),    # back to T positions, untimed
                                     lambda cache=cache, ids=ids: forward_cached(ids[:, -1:], w, cfg, cache),
                                     warmup, reps, device=device)
        out[T] = row
    return out


def speedups(times: dict) -> dict:
    """Uncached median over cached median, per context and design."""
    return {T: {d: row["uncached"]["median"] / row[d]["median"] for d in row if d != "uncached"}
            for T, row in times.items()}


def pays_from(times: dict, design="static"):
    """The shortest measured context at which the cached step is faster than recomputation (None: never)."""
    faster = [T for T, s in sorted(speedups(times).items()) if s[design] > 1.0]
    return faster[0] if faster else None


def end_to_end(model, prompt_len=17, new_tokens=32) -> dict:
    """The engine generating greedily through three backends: positions counted, time per token."""
    prompt = data.passages(model.tokenizer, prompt_len, 1)[0]
    n = prompt_len + new_tokens
    backends = {"recompute": RecomputeBackend(model),
                "concat": CachedBackend(model, lambda: make_cache("concat", model.config, n)),
                "static": CachedBackend(model, lambda: make_cache("static", model.config, n))}
    out = {}
    for name, backend in backends.items():
        generate(backend, prompt, 2)                          # warm-up
        backend.positions = backend.calls = 0
        g = generate(backend, prompt, new_tokens)
        out[name] = dict(tokens=g.tokens, positions=backend.positions, ttft=g.ttft, tpot=g.tpot,
                         total=sum(g.step_seconds))
    out["tokens_identical"] = out["concat"]["tokens"] == out["recompute"]["tokens"] == out["static"]["tokens"]
    return out


def plot_step_times(times_by_model: dict, path=None):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for name, times in times_by_model.items():
        Ts = sorted(times)
        for design, style in (("uncached", "-o"), ("concat", "--s"), ("static", ":^")):
            axes[0].plot(Ts, [times[T][design]["median"] * 1e3 for T in Ts], style, label=f"{name} {design}")
        for design, style in (("concat", "--s"), ("static", ":^")):
            axes[1].plot(Ts, [speedups(times)[T][design] for T in Ts], style, label=f"{name} {design}")
    axes[0].set(xscale="log", yscale="log", xlabel="context T", ylabel="one decode step, ms (median)",
                title="Step time with and without a cache")
    axes[1].axhline(1.0, color="gray", lw=0.8)
    axes[1].set(xscale="log", yscale="log", xlabel="context T", ylabel="uncached / cached",
                title="Speedup of the cached step")
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    return finish(fig, path)


def measure(quick_mode=None) -> dict:
    from . import library, memory

    s = settings(quick() if quick_mode is None else quick_mode)
    smol, gpt2 = load("smollm2"), load("gpt2-random")
    torch.manual_seed(0)
    times = {m.name: step_times(m, s["contexts"][m.name], s["reps"], s["warmup"]) for m in (gpt2, smol)}
    return dict(
        settings=s, manifests={"smollm2": smol.manifest, "gpt2-random": gpt2.manifest}, times=times,
        end_to_end={m.name: end_to_end(m, 17, s["e2e_tokens"]) for m in (gpt2, smol)},
        library=library.compare(("gpt2-random", "smollm2"), s["library_context"], s["library_tokens"],
                                 s["library_reps"]),
        memory=memory.sweep(s["memory_models"], ("concat", "static"), s["memory_batches"], s["memory_tokens"]),
    )


def record(m: dict) -> dict:
    from . import memory

    figs = figures_dir()
    plot_step_times(m["times"], figs / "ch03_step_time.png")
    memory.plot(m["memory"], figs / "ch03_memory.png")
    ms = lambda st, **kw: value(st["median"] * 1e3, "ms", min=st["min"] * 1e3, max=st["max"] * 1e3,
                                iqr=st["iqr"] * 1e3, n=st["n"], threads=st["threads"], **kw)
    values = {"step_ms": {}, "speedup": {}, "pays_from": {}, "end_to_end": {}, "library": {}, "memory": {}}
    for name, times in m["times"].items():
        values["step_ms"][name] = {f"T{T}": {d: ms(st) for d, st in row.items()} for T, row in times.items()}
        values["speedup"][name] = {f"T{T}": {d: value(x, "x") for d, x in sp.items()}
                                   for T, sp in speedups(times).items()}
        values["pays_from"][name] = {d: value(pays_from(times, d) or "never", "tokens") for d in ("concat", "static")}
    for name, e in m["end_to_end"].items():
        values["end_to_end"][name] = {
            b: {"positions": value(e[b]["positions"], "positions"), "tpot_ms": value(e[b]["tpot"] * 1e3, "ms"),
                "ttft_ms": value(e[b]["ttft"] * 1e3, "ms"), "total_s": value(e[b]["total"], "s")}
            for b in ("recompute", "concat", "static")}
        values["end_to_end"][name]["tokens_identical"] = value(e["tokens_identical"], None)
        values["end_to_end"][name]["speedup_static"] = value(e["recompute"]["total"] / e["static"]["total"], "x")
    values["library"] = library_values(m["library"])
    for row in m["memory"]:
        values["memory"].setdefault(row["model"], {}).setdefault(row["design"], {})[f"B{row['batch_size']}"] = {
            "peak_extra_mib": value(row["peak_extra_bytes"] / 2**20, "MiB", note="peak RSS over the baseline"),
            "cache_mib": value(row["cache_bytes"] / 2**20, "MiB", note="the formula, for the final length"),
            "ratio": value(row["peak_extra_bytes"] / row["cache_bytes"], "x")}
    values["memory"]["tokens"] = value(m["settings"]["memory_tokens"], "tokens")
    figures = {"step_time": {"path": figs / "ch03_step_time.png", "caption": "Step time and speedup"},
               "memory": {"path": figs / "ch03_memory.png", "caption": "Peak extra memory while decoding"}}
    write_section(SECTION, values, provenance(manifest=m["manifests"]), figures=figures)
    return values


def library_values(lib: dict) -> dict:
    """results.json entries for library.compare()'s output."""
    out = {}
    for name, r in lib.items():
        out[name] = {k: value(r[k] * 1e3, "ms", note="per decode token, median")
                     for k in ("lab_concat", "lab_static", "library_dynamic", "library_static")}
        out[name]["ratio_static"] = value(r["ratio_static"], "x", note="lab static / library static; < 1: lab faster")
        out[name]["ratio_concat"] = value(r["ratio_concat"], "x", note="lab concat / library dynamic")
        out[name]["tokens_match"] = value(r["tokens_match"], None)
        out[name]["context"] = value(r["context"], "tokens")
    return out


def run(quick_mode=None) -> dict:
    m = measure(quick_mode)
    record(m)
    return m
