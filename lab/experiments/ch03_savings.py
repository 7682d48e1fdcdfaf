"""Chapter 3, "What the cache saves": step time, where the step's time goes, end-to-end generation, the
library, memory. The measurements are library code: `lab.step_cost` (a decode step, attention's share of
it), `lab.memory` (peak memory), `lab.contention` (a busy machine), `lab.peers.hf_generate` (transformers).
They run on the CPU here; `python -m lab.experiments.gpu` runs the same sweeps on CUDA (section ch03_gpu).

Every timing comparison is made in interleaved rounds (`lab.bench.time_rounds`): each round runs every
variant once, in turn, so a slow spell of a shared machine hits all of them alike. A ratio is taken per
round (the i-th uncached step over the i-th cached step) and the median over rounds is reported, with the
lowest and highest round and the interquartile range.
"""

import torch

from .. import contention, data, memory
from ..bench import ratio_summary, time_rounds
from ..cache import StaticCache, make_cache
from ..engine import CachedBackend, RecomputeBackend, generate
from ..metrics import kl_divergence
from ..models import forward, forward_cached, load
from ..models.llama import Prepacked, block
from ..peers import hf_generate
from ..results import figures_dir, provenance, quick, value, write_section
from ..step_cost import attention_share, predicted_shares, step_times
from .plots import finish

SECTION = "ch03"


def settings(quick_mode: bool) -> dict:
    if quick_mode:  # few rounds; every context the chapter quotes but 2,048 (seconds a step): a thinner figure
        T = [1, 2, 4, 8, 32, 64, 512]
        return dict(contexts={"gpt2-random": T, "smollm2": T}, rounds=3, warmup=1,
                    share_contexts={"gpt2-random": [64, 960], "smollm2": [64, 512, 4096]},
                    share_rounds=9,  # at 512 positions attention is a tenth of the step: fewer rounds, noise decides
                    library_context=128, library_tokens=8, library_reps=1, memory_tokens=128, memory_batches=(1, 8),
                    memory_models=("gpt2-random",), e2e_tokens=32,
                    load_settings=("default", "lab"), load_rounds=1, load_reps=3, load_warmup=1,
                    bf16_context=512, bf16_rounds=3, kl_passages=2, kl_tokens=128)
    T = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 960]  # 960: GPT-2's 1,024 positions, less the generated ones
    return dict(contexts={"gpt2-random": T, "smollm2": T + [2048]}, rounds=11, warmup=1,
                share_contexts={"gpt2-random": [64, 256, 512, 960], "smollm2": [64, 256, 512, 1024, 2048, 4096]},
                share_rounds=15, library_context=512, library_tokens=32, library_reps=5, memory_tokens=960,
                memory_batches=(1, 8), memory_models=("gpt2-random", "smollm2"), e2e_tokens=32,
                load_settings=("default", "lab", "short_spin", "one_thread"), load_rounds=3, load_reps=15,
                load_warmup=3, bf16_context=512, bf16_rounds=11, kl_passages=16, kl_tokens=256)


# ---- one decode step, with and without a cache (lab.step_cost.step_times) ----------------------------------

def speedups(times: dict) -> dict:
    """Per context and design: the uncached step's time over the cached step's, round by round (summary)."""
    return {T: {d: ratio_summary(row["uncached"]["samples"], row[d]["samples"]) for d in row if d != "uncached"}
            for T, row in times.items()}


def pays_from(times: dict, design="static"):
    """The smallest measured context from which the cached step is faster than recomputation (median over
    rounds) at that context and at every longer one measured; "never" when it is not faster at the longest."""
    sp = speedups(times)
    start = None
    for T in sorted(sp, reverse=True):
        if sp[T][design]["median"] <= 1.0:
            break
        start = T
    return start if start is not None else "never"


def faster_design(times: dict) -> dict:
    """Per context: concat's step time over static's, round by round, and which design is faster:
    "static" when concat took longer in three rounds of four or more (the first quartile of the ratio is above
    1), "concat" when static did (the third quartile is below 1), "neither" when the rounds disagree."""
    out = {}
    for T, row in times.items():
        r = ratio_summary(row["concat"]["samples"], row["static"]["samples"])
        r["faster"] = "static" if r["q1"] > 1.0 else "concat" if r["q3"] < 1.0 else "neither"
        out[T] = r
    return out


# ---- the engine, end to end ----------------------------------------------------------------------------------

def end_to_end(model, prompt_len=17, new_tokens=32) -> dict:
    """The engine generating greedily through three backends: positions counted, time per token."""
    prompt = data.passages(model.tokenizer, prompt_len, 1)[0]
    n = prompt_len + new_tokens
    backends = {"recompute": RecomputeBackend(model)}
    backends |= {d: CachedBackend(model, lambda d=d: make_cache(d, model.config, n)) for d in ("concat", "static")}
    out = {}
    for name, backend in backends.items():
        generate(backend, prompt, 2)                          # warm-up
        backend.positions = backend.calls = 0
        g = generate(backend, prompt, new_tokens)
        out[name] = dict(tokens=g.tokens, positions=backend.positions, ttft=g.ttft, tpot=g.tpot,
                         total=sum(g.step_seconds))
    out["tokens_identical"] = out["concat"]["tokens"] == out["recompute"]["tokens"] == out["static"]["tokens"]
    return out


# ---- figures ---------------------------------------------------------------------------------------------------

STYLE = {"uncached": "-o", "concat": "--s", "static": ":^"}
COLOR = {"gpt2-random": "tab:blue", "smollm2": "tab:orange"}
LABEL = {"gpt2-random": "GPT-2 shape", "smollm2": "SmolLM2"}


def _plain_ticks(ax, xticks=None):
    """Log axes labelled 1, 10, 100 (not 10^1), without minor labels; x ticks at the contexts measured."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    if xticks is not None:
        ax.set_xticks(xticks)
    for axis in (ax.xaxis, ax.yaxis):
        axis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        axis.set_minor_formatter(NullFormatter())


def _bars(summaries, scale=1.0):
    """Medians and matplotlib's yerr (distances down to the min and up to the max) of ratio summaries."""
    med = [r["median"] * scale for r in summaries]
    return med, [[(r["median"] - r["min"]) * scale for r in summaries],
                 [(r["max"] - r["median"]) * scale for r in summaries]]


def plot_step_times(times_by_model: dict, path=None):
    """Left: the median step time against context, per model and design. Right: the speedup of each cache
    over recomputation, median over rounds, the bars spanning the lowest and highest round."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    lo, hi = min(min(t) for t in times_by_model.values()), max(max(t) for t in times_by_model.values())
    for name, times in times_by_model.items():
        Ts, sp = sorted(times), speedups(times)
        for design, style in STYLE.items():
            axes[0].plot(Ts, [times[T][design]["median"] * 1e3 for T in Ts], style, color=COLOR.get(name),
                         label=f"{LABEL.get(name, name)}, {design}", ms=4)
        for design in ("concat", "static"):
            med, err = _bars([sp[T][design] for T in Ts])
            axes[1].errorbar(Ts, med, yerr=err, fmt=STYLE[design], color=COLOR.get(name), ms=4, capsize=2,
                             label=f"{LABEL.get(name, name)}, {design} cache")
    axes[0].set(xscale="log", yscale="log", xlabel="context T (positions cached)", ylabel="one decode step, ms")
    axes[0].set_title("Time of one decode step (median)", fontsize=10)
    axes[1].hlines(1.0, lo, hi, color="gray", lw=1, label="1×: no gain")   # over the contexts measured
    axes[1].set(xscale="log", yscale="log", xlabel="context T (positions cached)", ylabel="uncached / cached")
    axes[1].set_title("Speedup over recomputation", fontsize=10)
    for ax in axes:
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
        _plain_ticks(ax)
    return finish(fig, path)


def plot_attention_share(shares: dict, predicted: dict, path=None):
    """One panel per model: attention's measured share of a cached decode step against context (median
    over rounds, bars from the lowest to the highest round), beside the shares FLOPs and bytes predict."""
    import matplotlib.pyplot as plt

    names = sorted(shares, key=lambda n: n != "smollm2")  # SmolLM2, the chapters' model, on the left
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 4), squeeze=False)
    for ax, name in zip(axes[0], names, strict=True):
        Ts = sorted(shares[name])
        med, err = _bars([shares[name][T]["share"] for T in Ts], 100)
        ax.errorbar(Ts, med, yerr=err, fmt="-o", color="black", capsize=3, label="measured (time)")
        ax.plot(Ts, [predicted[name][T]["flops"] * 100 for T in Ts], "--", color="tab:red", label="FLOPs count")
        ax.plot(Ts, [predicted[name][T]["bytes"] * 100 for T in Ts], ":", color="tab:green", label="bytes read")
        low = min(0.0, min(m - e for m, e in zip(med, err[0], strict=True)) - 2)  # noise can push a share below 0
        ax.set(xscale="log", xlabel="context T (positions cached)", ylabel="attention, % of the step", ylim=(low, 100))
        ax.set_title(f"{LABEL.get(name, name)}: attention's share of a step", fontsize=10)
        _plain_ticks(ax, Ts)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8, loc="upper left")
    return finish(fig, path)


def plot_memory(rows, path=None):
    """lab.memory.sweep's rows as grouped bars: peak extra RSS (MiB) per (model, batch), one bar per design;
    the formula as a marker."""
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["model"], r["batch_size"]) for r in rows))
    designs = list(dict.fromkeys(r["design"] for r in rows))
    by_key = {(r["model"], r["batch_size"], r["design"]): r for r in rows}
    width = 0.8 / len(designs)
    fig, ax = plt.subplots(figsize=(max(6.4, 1.6 * len(groups)), 4))
    for j, design in enumerate(designs):
        xs = [i - 0.4 + width * (j + 0.5) for i in range(len(groups))]
        ys = [by_key[(m, b, design)]["peak_extra_bytes"] / memory.MiB if (m, b, design) in by_key else 0
              for m, b in groups]
        ax.bar(xs, ys, width, label=f"{design}: peak RSS - baseline")
    formula = [next(r["cache_bytes"] for r in rows if (r["model"], r["batch_size"]) == g) / memory.MiB for g in groups]
    ax.hlines(formula, [i - 0.45 for i in range(len(groups))], [i + 0.45 for i in range(len(groups))],
              colors="black", linestyles="--", label="cache_bytes (formula)")
    ax.set_xticks(range(len(groups)), [f"{m}\nbatch {b}" for m, b in groups])
    ax.set(ylabel="MiB", title=f"Peak extra RSS while decoding to {rows[0]['tokens']} positions")
    ax.legend(fontsize=8)
    return finish(fig, path)


# ---- the run ---------------------------------------------------------------------------------------------------

# ---- what bfloat16 changes: step time, memory, the next-token distribution ------------------------------------

@torch.inference_mode()
def bf16_step(model, context=512, rounds=11, warmup=2, seed=0) -> dict:
    """A cached decode step of `model` (a float32 Llama-family model) and of its bfloat16 copy after
    `context` seeded random ids, each through a StaticCache of its own dtype, two ways: the projections
    through F.linear (the chapter's forward) and through oneDNN's prepacked, merged weights (`Prepacked`,
    what the serving engine runs; with the chapter's layers, not the engine's fused ones). All four timed
    in interleaved rounds (cropped back to `context` before every call, untimed). {"float32", "bfloat16",
    "float32_packed", "bfloat16_packed": summary, "ratio" and "ratio_packed": float32 / bfloat16 per
    round, "bytes": {dtype: {"weights", "cache"}}} with the cache's bytes at `context` positions."""
    ids = torch.randint(0, model.config.vocab_size, (1, context + 1), generator=torch.Generator().manual_seed(seed))
    models = {"float32": model, "bfloat16": model.to(dtype=torch.bfloat16)}
    fns, caches = {}, []
    for way in ("", "_packed"):
        for dt, m in models.items():
            w = Prepacked(m.weights, rows=1) if way else m.weights
            if way:
                w.block = block                          # the products alone: the chapter's layers
            cache = StaticCache(m.config, context + 1)                               # the model's dtype
            forward_cached(ids[:, :context], w, m.config, cache)                     # prefill, untimed
            fns[dt + way] = lambda m=m, w=w, c=cache: forward_cached(ids[:, -1:], w, m.config, c, last_only=True)
            caches.append(cache)
    times = time_rounds(fns, warmup, rounds, setup=lambda: [c.crop(context) for c in caches], samples=True)
    ratio = {"ratio" + way: ratio_summary(times["float32" + way]["samples"], times["bfloat16" + way]["samples"])
             for way in ("", "_packed")}
    nbytes = {dt: dict(weights=sum(t.nbytes for t in m.weights.values()),
                       cache=m.config.kv_bytes_per_position() * context) for dt, m in models.items()}
    return times | ratio | dict(bytes=nbytes, context=context)


@torch.inference_mode()
def bf16_divergence(model, passages=16, tokens=256, seed=11) -> dict:
    """KL(float32 || bfloat16) of the next-token distribution at every position of `passages` held-out
    passages of `tokens` tokens (nats): mean and largest, and the share of positions whose greedy token is
    the same."""
    half = model.to(dtype=torch.bfloat16)
    ids = torch.tensor(data.passages(model.tokenizer, tokens, count=passages, seed=seed))   # [N, T]
    p, q = forward(ids, model.weights, model.config), forward(ids, half.weights, half.config)
    kl = kl_divergence(p, q.float())                                                            # [N, T]
    return dict(kl_mean=kl.mean().item(), kl_max=kl.max().item(), positions=kl.numel(),
                top1_same=(p.argmax(-1) == q.argmax(-1)).float().mean().item())


def under_load(s: dict) -> dict:
    """A SmolLM2 decode step after 256 positions, idle and beside other torch programs, for each OpenMP setting
    of s["load_settings"] (lab.contention; a fresh process per case)."""
    loads = contention.loads_for() if s["load_rounds"] > 1 else (0, contention.loads_for()[-1])  # quick: idle, busiest
    return contention.compare({k: contention.SETTINGS[k] for k in s["load_settings"]}, loads,
                              rounds=s["load_rounds"], reps=s["load_reps"], warmup=s["load_warmup"])


def measure(quick_mode=None) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    smol, gpt2 = load("smollm2"), load("gpt2-random")
    torch.manual_seed(0)
    models = (gpt2, smol)
    times = {m.name: step_times(m, s["contexts"][m.name], s["rounds"], s["warmup"]) for m in models}
    shares = {m.name: attention_share(m, s["share_contexts"][m.name], s["share_rounds"]) for m in models}
    predicted = {m.name: predicted_shares(m, s["share_contexts"][m.name]) for m in models}
    return dict(
        settings=s, manifests={"smollm2": smol.manifest, "gpt2-random": gpt2.manifest}, times=times,
        shares=shares, predicted=predicted,
        end_to_end={m.name: end_to_end(m, 17, s["e2e_tokens"]) for m in models},
        library=hf_generate.compare(("gpt2-random", "smollm2"), s["library_context"], s["library_tokens"],
                                    s["library_reps"]),
        memory=memory.sweep(s["memory_models"], ("concat", "static"), s["memory_batches"], s["memory_tokens"]),
        under_load=under_load(s),
        bf16=dict(step=bf16_step(smol, s["bf16_context"], s["bf16_rounds"]),
                  divergence=bf16_divergence(smol, s["kl_passages"], s["kl_tokens"])),
    )


def _sig3(x: float) -> float:
    """x rounded to 3 significant figures (14,698 -> 14,700): a timing's spread is a few percent, so the
    prose never quotes more."""
    return float(f"{x:.3g}")


def _ms(st) -> dict:
    return value(_sig3(st["median"] * 1e3), "ms", min=st["min"] * 1e3, max=st["max"] * 1e3, iqr=st["iqr"] * 1e3,
                 n=st["n"], threads=st["threads"])


def _ratio(r, unit="x", scale=1.0, **kw) -> dict:
    return value(r["median"] * scale, unit, min=r["min"] * scale, max=r["max"] * scale, iqr=r["iqr"] * scale,
                 n=r["n"], **kw)


def _range(r, unit="x", scale=1.0) -> dict:
    return {"min": value(r["min"] * scale, unit), "max": value(r["max"] * scale, unit)}


# the entries of section ch03 each part of the measurements fills, in the order the section records them
PARTS = {"times": ("contexts", "step_ms", "speedup", "speedup_range", "pays_from", "faster", "concat_over_static"),
         "shares": ("attention_share", "attention_share_range", "attention_flop_share", "attention_byte_share",
                    "attention_step_ms", "attention_share_follows"),
         "end_to_end": ("end_to_end",), "library": ("library",), "memory": ("memory",)}


def values(m: dict) -> dict:
    """The section's values, from every part of the measurements that m holds: a notebook sets each part's
    verdicts beside the book's as soon as it has measured that part (lab.book.verdicts); record() writes them all."""
    values = {k: {} for part, keys in PARTS.items() if part in m for k in keys}
    if "times" in m:
        values["rounds"] = value(m["settings"]["rounds"], None, note="interleaved rounds per context, after warm-up")
    if "shares" in m:
        values["share_rounds"] = value(m["settings"]["share_rounds"], None, note="rounds of the attention share")
    for name, times in m.get("times", {}).items():
        sp, fd = speedups(times), faster_design(times)
        values["contexts"][name] = value(sorted(times), "tokens")
        values["step_ms"][name] = {f"T{T}": {d: _ms(st) for d, st in row.items()} for T, row in times.items()}
        values["speedup"][name] = {f"T{T}": {d: _ratio(r, note="median over rounds of uncached / cached")
                                             for d, r in row.items()} for T, row in sp.items()}
        values["speedup_range"][name] = {f"T{T}": {d: _range(r) for d, r in row.items()} for T, row in sp.items()}
        values["pays_from"][name] = {d: value(pays_from(times, d), "tokens") for d in ("concat", "static")}
        values["faster"][name] = {f"T{T}": value(r["faster"], None, concat_over_static=r["median"])
                                  for T, r in fd.items()}
        values["concat_over_static"][name] = {f"T{T}": _ratio(r, note="concat step / static step, median over rounds")
                                              for T, r in fd.items()}
        for design in ("concat", "static"):
            at = [T for T, r in sorted(fd.items()) if r["faster"] == design]
            values["faster"][name][f"{design}_at"] = value(at or "none", "tokens" if at else None)
    for name, shares in m.get("shares", {}).items():
        pred = m["predicted"][name]
        values["attention_share"][name] = {f"T{T}": _ratio(r["share"], "%", 100, note="median over rounds of "
                                                           "1 - (step without attention) / (step with it)")
                                           for T, r in shares.items()}
        values["attention_share_range"][name] = {f"T{T}": _range(r["share"], "%", 100) for T, r in shares.items()}
        values["attention_flop_share"][name] = {f"T{T}": value(p["flops"] * 100, "%") for T, p in pred.items()}
        values["attention_byte_share"][name] = {f"T{T}": value(p["bytes"] * 100, "%") for T, p in pred.items()}
        values["attention_step_ms"][name] = {f"T{T}": {"with": _ms(r["with"]), "without": _ms(r["without"])}
                                             for T, r in shares.items()}
        values["attention_share_follows"][name] = {
            f"T{T}": value("bytes" if abs(r["share"]["median"] - pred[T]["bytes"])
                           < abs(r["share"]["median"] - pred[T]["flops"]) else "FLOPs", None,
                           note="which prediction the measured share is closer to")
            for T, r in shares.items()}
    for name, e in m.get("end_to_end", {}).items():
        values["end_to_end"][name] = {
            b: {"positions": value(e[b]["positions"], "positions"), "tpot_ms": value(_sig3(e[b]["tpot"] * 1e3), "ms"),
                "ttft_ms": value(_sig3(e[b]["ttft"] * 1e3), "ms"), "total_s": value(_sig3(e[b]["total"]), "s")}
            for b in ("recompute", "concat", "static")}
        values["end_to_end"][name]["tokens_identical"] = value(e["tokens_identical"], None)
        values["end_to_end"][name]["speedup_static"] = value(e["recompute"]["total"] / e["static"]["total"], "x")
    if "library" in m:
        values["library"] = library_values(m["library"])
    for row in m.get("memory", ()):
        values["memory"].setdefault(row["model"], {}).setdefault(row["design"], {})[f"B{row['batch_size']}"] = {
            "peak_extra_mib": value(row["peak_extra_bytes"] / 2**20, "MiB", note="peak RSS over the baseline"),
            "cache_mib": value(row["cache_bytes"] / 2**20, "MiB", note="the formula, for the final length"),
            "ratio": value(row["peak_extra_bytes"] / row["cache_bytes"], "x")}
    if "memory" in m:
        values["memory"]["tokens"] = value(m["settings"]["memory_tokens"], "tokens")
    if "under_load" in m:
        values["under_load"] = load_values(m["under_load"])
    if "bf16" in m:
        values["bf16"] = bf16_values(m["bf16"])
    return values


def record(m: dict, draw: bool = True) -> dict:
    """Write section ch03. draw=False when the figures were already drawn and saved (the notebook)."""
    figs = figures_dir()
    if draw:
        plot_step_times(m["times"], figs / "ch03_step_time.png")
        plot_attention_share(m["shares"], m["predicted"], figs / "ch03_attention_share.png")
        plot_memory(m["memory"], figs / "ch03_memory.png")
    v = values(m)
    figures = {"step_time": {"path": figs / "ch03_step_time.png",
                             "caption": "Step time against context, and the speedup of each cache"},
               "attention_share": {"path": figs / "ch03_attention_share.png",
                                   "caption": "Attention's share of a cached decode step against context"},
               "memory": {"path": figs / "ch03_memory.png", "caption": "Peak extra memory while decoding"}}
    write_section(SECTION, v, provenance(manifest=m["manifests"]), figures=figures)
    return v


def bf16_values(r: dict) -> dict:
    """bf16_step and bf16_divergence as results values."""
    st, dv, mib = r["step"], r["divergence"], lambda b: value(b / 2**20, "MiB")
    return {"context": value(st["context"], "tokens"),
            "step_ms": {dt: _ms(st[dt]) for dt in ("float32", "bfloat16")},
            "step_ms_packed": {dt: _ms(st[dt + "_packed"]) for dt in ("float32", "bfloat16")},
            "speedup": _ratio(st["ratio"], note="float32 step / bfloat16 step, F.linear, median over rounds"),
            "speedup_packed": _ratio(st["ratio_packed"], note="the same with oneDNN's prepacked weights"),
            "weights_mib": {dt: mib(b["weights"]) for dt, b in st["bytes"].items()},
            "cache_mib": {dt: mib(b["cache"]) for dt, b in st["bytes"].items()},
            "kl_mean": value(dv["kl_mean"], "nats", note="KL(float32 || bfloat16), next token, held-out text"),
            "kl_max": value(dv["kl_max"], "nats"), "positions": value(dv["positions"], "positions"),
            "top1_same": value(100 * dv["top1_same"], "%", note="positions whose greedy token is the same")}


def load_values(r: dict) -> dict:
    """results.json entries for lab.contention.compare()'s output: per setting, the step idle ("idle"),
    beside one other torch program ("one", when measured) and beside the most ("busy"), and how many times
    slower each load makes it."""
    from .. import contention as busy

    out = {}
    loads = sorted(next(iter(r.values())))
    named = {"idle": 0, "busy": loads[-1]} | ({"one": 1} if 1 in loads[1:-1] else {})
    for name, by_load in r.items():
        idle = by_load[0]["median"]
        out[name] = {f"{k}_ms": value(_sig3(by_load[n]["median"] * 1e3), "ms", rounds=by_load[n]["rounds"],
                                      programs=n) for k, n in named.items()}
        out[name] |= {f"{k}_slowdown": value(by_load[n]["median"] / idle, "x", note=f"{n} programs over idle")
                      for k, n in named.items() if n}
        out[name]["threads"] = value(by_load[0]["threads"], "threads")
        out[name]["setting"] = value(" ".join(f"{k}={v}" for k, v in busy.SETTINGS[name].items())
                                     or "OpenMP's defaults", None)
    out["busy_programs"] = value(loads[-1], "programs", note="other torch programs at the heaviest load")
    if "default" in r and "lab" in r:
        out["idle_cost"] = value(r["lab"][0]["median"] / r["default"][0]["median"], "x",
                                 note="the lab's setting over the defaults, idle")
        out["busy_gain"] = value(r["default"][loads[-1]]["median"] / r["lab"][loads[-1]]["median"], "x",
                                 note="the defaults over the lab's setting, at the heaviest load")
    return out


def library_values(lib: dict) -> dict:
    """results.json entries for lab.peers.hf_generate.compare()'s output."""
    out = {}
    for name, r in lib.items():
        out[name] = {k: value(_sig3(r[k] * 1e3), "ms", note="per decode token, median")
                     for k in ("lab_concat", "lab_static", "library_dynamic", "library_static")}
        out[name]["ratio_static"] = value(r["ratio_static"], "x", note="lab static / library static; < 1: lab faster")
        out[name]["ratio_concat"] = value(r["ratio_concat"], "x", note="lab concat / library dynamic")
        out[name]["tokens_match"] = value(r["tokens_match"], None)
        out[name]["context"] = value(r["context"], "tokens")
    return out
