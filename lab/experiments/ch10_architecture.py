"""Chapter 10, "A cache shaped by the architecture": what each retrofit of lab.models.retrofit costs in model
quality and what it saves in bytes, on the same axes as chapter 7's quantization and eviction.

SmolLM2 in float32, without training. Every case goes through `lab.metrics.quality` (chapter 7's protocol:
a prefill of the held-out passage, then one token per step through the cache) against the *original*
model's plain forward: KL, change in perplexity, top-1 agreement. A retrofit's bytes per position are
counted in bfloat16, as a 16-bit cache would hold them, and read on the x-axis as a share of the original
model's bf16 cache (23,040 bytes per position); a quantized cache's bytes are its codes, scales and zero
points as it holds them; a local layer holds at most its window and sinks (`config.kv_bytes`).

Measured besides: chapter 7's points again in the same run (INT8, KIVI-4, KIVI-2, sinks eviction), the
combinations (a latent in INT8, local layers in KIVI-4), the decode step of the latent's absorbed and
reconstructing forms beside the original model at two contexts, and the hybrid pool a Gemma-3-like
arrangement (5 local layers to 1 global, window 1,024) holds at 8k positions.
"""

import re

import matplotlib.patches
import matplotlib.ticker
import torch
from tqdm.auto import tqdm

from .. import data
from ..bench import time_rounds
from ..cache import ConcatCache, EvictingCache, QuantizedCache, StaticCache
from ..cache.block_manager import NULL, pages_for
from ..cache.hybrid import HybridBlockManager
from ..engine.hashing import page_keys
from ..metrics import quality, reference
from ..models import forward_cached, load
from ..models.retrofit import (
    calibration_moments,
    latent_from_moments,
    local_layers,
    pool_kv_heads,
    reconstructing_form,
    share_kv,
)
from ..results import figures_dir, provenance, quick, value, write_section
from . import plots
from .ch07_compress import QUANTIZED
from .plots import finish

SECTION = "ch10"
BF16 = torch.bfloat16


def settings(quick_mode: bool) -> dict:
    """Passages as chapter 7's (`tokens` ids, the last `decode` fed one per step); `calibration` passages of
    the training plays for the latent's basis; the retrofits swept; the step-time contexts."""
    if quick_mode:
        return dict(tokens=256, passages=1, decode=16, calibration=(2, 256), heads=(1,), ranks=(384, 96, 24),
                    locals=((64, 2, 0), (64, 6, 4)), shares=(2,), latent_int8=(96,), local_kivi4=((64, 6, 4),),
                    chapter7=("per_token_8", "kivi_4"), sinks_budgets=(64,), step_contexts=(512,), step_rank=96,
                    step_rounds=3, hybrid_context=8192)
    return dict(tokens=2048, passages=4, decode=128, calibration=(8, 1024), heads=(1,), ranks=(384, 192, 96, 48, 24),
                locals=((128, 2, 0), (128, 2, 4), (128, 6, 0), (128, 6, 4), (512, 2, 0), (512, 2, 4), (512, 3, 4),
                        (512, 6, 0), (512, 6, 4), (2048, 2, 0), (2048, 6, 0)),
                shares=(2, 3), latent_int8=(96, 48), local_kivi4=((512, 6, 4), (128, 6, 4)),
                chapter7=("per_token_8", "kivi_4", "kivi_2"), sinks_budgets=(256, 512), step_contexts=(512, 4096),
                step_rank=96, step_rounds=7, hybrid_context=8192)


# ---- the cases: a model, a cache for it, the bytes it holds per position ------------------------------------

def float_cache(config, batch_size=1):
    return ConcatCache(config, batch_size)


def quantized(name):
    return lambda config, batch_size=1: QuantizedCache(config, batch_size=batch_size, **QUANTIZED[name])


def window_share(config, positions: int) -> float:
    """The share of its positions a cache that frees what left a local layer's window keeps."""
    return config.kv_bytes(positions) / (positions * config.kv_bytes_per_position())


def bf16_bytes(model, make, r: dict) -> float:
    """Bytes per position of the cache `make` builds for `model`, counted as served, from `quality`'s result
    r: a float cache's bytes held at the end (an evicting cache holds its budget) in bfloat16; a quantized
    cache's codes, scales and zero points per position (chapter 7's count, its float residual window left
    out); and a local layer keeps at most its window and sinks."""
    cfg, positions = model.config, r["length"]
    cache = make(cfg, 1)
    if isinstance(cache, QuantizedCache):
        per_position = cache.bytes_per_position()
    else:
        per_position = r["nbytes"] / (r["batch"] * positions) * 2 / cache.dtype.itemsize
    return per_position * window_share(cfg, positions)


def retrofits(smol, moments, s) -> dict:
    """{family: {name: (model, make_cache)}} of every case the chapter measures."""
    ranks = sorted({*s["ranks"], *s["latent_int8"], s["step_rank"]})
    latent = {r: latent_from_moments(smol, r, moments) for r in ranks}     # one calibration for every rank
    local = {(w, g, k): local_layers(smol, w, g, k) for w, g, k in {*s["locals"], *s["local_kivi4"]}}
    name = lambda w, g, k: f"w{w} g{g}" + (f" s{k}" if k else "")                       # noqa: E731
    out = {"chapter 7, quantized": {n.replace("per_token_", "int").replace("_", ""): (smol, quantized(n))
                                    for n in s["chapter7"]},
           "chapter 7, sinks eviction": {f"sinks {b}": (smol, lambda c, bs=1, b=b: EvictingCache(c, b, "sinks",
                                                                                               batch_size=bs))
                                         for b in s["sinks_budgets"]},
           "fewer KV heads": {f"{h} KV head" + ("s" if h > 1 else ""): (pool_kv_heads(smol, h), float_cache)
                              for h in s["heads"]},
           "latent": {f"rank {r}": (latent[r], float_cache) for r in s["ranks"]},
           "local layers": {name(*x): (local[x], float_cache) for x in s["locals"]},
           "shared layers": {f"every {e}": (share_kv(smol, e), float_cache) for e in s["shares"]},
           "combined": {f"rank {r} int8": (latent[r], quantized("per_token_8")) for r in s["latent_int8"]}
           | {f"{name(*x)} kivi4": (local[x], quantized("kivi_4")) for x in s["local_kivi4"]}}
    return out, latent


# ---- measure -------------------------------------------------------------------------------------------------

def held_out(model, s):
    ids = torch.tensor(data.passages(model.tokenizer, s["tokens"], s["passages"]))       # [B, T]
    prefill = s["tokens"] - s["decode"]
    return ids, prefill, reference(model, ids, prefill)


def quality_map(smol, cases, ids, prefill, ref) -> dict:
    """{family: {name: quality + bytes per position}} for every case, against the original model."""
    out = {}
    flat = [(f, n, mc) for f, named in cases.items() for n, mc in named.items()]
    for family, name, (model, make) in tqdm(flat, desc="quality"):
        r = quality(model, ids, make, prefill, ref)
        out.setdefault(family, {})[name] = r | dict(bytes=bf16_bytes(model, make, r), model=model.config.name)
    return out


def step(model, cache, token, T):
    """One decode step of `token` `[1, 1]` through `cache`, which then goes back to T positions."""
    def fn():
        forward_cached(token, model.weights, model.config, cache)
        cache.crop(T)                                         # every step at the same context
    return fn


@torch.inference_mode()
def step_times(smol, latent, s) -> dict:
    """Seconds per decode step at each context: the original model, the latent of rank step_rank in its
    absorbed and its reconstructing form, and the full-rank latent absorbed; one StaticCache each, filled
    with a prompt of seeded random ids, timed in interleaved rounds."""
    r = s["step_rank"]
    models = {"original": smol, f"absorbed r{r}": latent[r], f"reconstructing r{r}": reconstructing_form(latent[r])}
    if 384 in latent:
        models["absorbed r384"] = latent[384]
    out = {}
    for T in s["step_contexts"]:
        prompt = torch.randint(0, smol.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
        caches = {}
        for name, m in models.items():
            caches[name] = StaticCache(m.config, T + 4 + s["step_rounds"])
            forward_cached(prompt, m.weights, m.config, caches[name], last_only=True)

        out[T] = time_rounds({n: step(models[n], caches[n], prompt[:, -1:], T) for n in models}, warmup=1,
                             rounds=s["step_rounds"])
    return out


@torch.inference_mode()
def spectra(moments, ranks, before_rope=None) -> dict:
    """How much of the keys' (after RoPE) and of the values' energy the top rank / 2 directions of each hold,
    on the calibration text, the mean over layers: {rank: {"keys": share, "values": share}}; with
    `before_rope` (calibration_moments(..., before_rope=True)), also "keys_before_rope". The latent keeps
    exactly those directions, so this is what it keeps of each before any quality is measured."""
    parts = {"keys": [k for k, _ in moments.values()], "values": [v for _, v in moments.values()]}
    if before_rope is not None:
        parts["keys_before_rope"] = [k for k, _ in before_rope.values()]
    eigen = {part: [torch.linalg.eigvalsh(m).flip(0) for m in ms] for part, ms in parts.items()}   # per layer
    return {r: {part: sum(float(e[: r // 2].sum() / e.sum()) for e in es) / len(es) for part, es in eigen.items()}
            for r in ranks}


# ---- the pages a hybrid model holds ----------------------------------------------------------------------

def grow(manager, seq, ids, chunk: int) -> None:
    """Run sequence `seq` through `manager` as an engine would: `ids` in steps of `chunk` positions, each
    page named (chapter 6's chained digests) once it is full, in every group that still holds it."""
    P, named = manager.page_size, 0
    keys = page_keys(ids, P)
    for start in range(0, len(ids), chunk):
        manager.reserve(seq, min(chunk, len(ids) - start))
        full = manager.length(seq) // P
        for i in range(named, full):
            manager.register(seq, i, *keys[i])
        named = full


def hybrid_pool(smol, s, window=1024, global_every=6, page_size=16, chunk=512) -> dict:
    """What a hybrid layout holds for one sequence of `hybrid_context` positions, SmolLM2 made Gemma-3-like
    (every layer local with a window of 1,024 but every 6th: 25 local, 5 global): pages held per group
    after the sequence grew in chunks of 512 and took one decode step, their bytes in bf16 against every
    layer keeping every page, and, after the sequence is released, what a second request with the same
    prompt gets back from prefix caching in each group. The page bookkeeping is the real
    HybridBlockManager's; no tensor is allocated."""
    cfg, T = local_layers(smol, window, global_every).config, s["hybrid_context"]
    per_page_layer = page_size * 2 * cfg.n_kv_heads * cfg.head_dim * 2              # bf16 bytes, K and V
    pages = pages_for(T + 1, page_size)
    manager = HybridBlockManager.for_model(cfg, num_pages=pages + 1, page_size=page_size)
    ids = torch.randint(0, cfg.vocab_size, (T,), generator=torch.Generator().manual_seed(0)).tolist()
    grow(manager, "first", ids, chunk)
    manager.reserve("first", 1)                       # one decode step: the window gives back the chunk's past
    held = {g: manager.held_pages(g, "first") for g in manager.groups}
    layers = {g: len(manager.layers(g)) for g in manager.groups}
    hybrid = sum(held[g] * layers[g] * per_page_layer for g in manager.groups)
    everything = held["full"] * cfg.n_layers * per_page_layer      # every layer keeping every page
    manager.release("first")
    hit = manager.reserve_prefix("second", page_keys(ids, page_size))
    taken = {g: manager.held_pages(g, "second") for g in manager.groups}
    manager.release("second")
    manager.check()
    return dict(prefill=T, context=T + 1, window=window, global_every=global_every, page_size=page_size, layers=layers,
                held=held, hybrid_bytes=hybrid, full_bytes=everything, hit_pages=hit, taken=taken)


def hybrid_tables(smol, lengths=(260, 200, 130), window=64, sinks=16, page_size=16) -> dict:
    """Block tables of a few sequences in a small hybrid pool (window 64 with 16 sinks, pages of 16), as
    HybridBlockManager leaves them after each sequence grew to its length: what the diagram draws."""
    cfg = local_layers(smol, window, 6, sinks).config
    manager = HybridBlockManager.for_model(cfg, num_pages=64, page_size=page_size)
    for n, length in enumerate(lengths):
        grow(manager, n, list(range(length)), 16)
    return dict(window=window, sinks=sinks, page_size=page_size, lengths=list(lengths),
                tables={g: [manager.block_table(n, g) for n in range(len(lengths))] for g in manager.groups})


def measure(quick_mode=None) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    smol = load("smollm2")
    count, n = s["calibration"]
    calibration = data.passages(smol.tokenizer, n, count, split="train")
    moments = calibration_moments(smol, calibration)                   # the latents' and the spectra's
    cases, latent = retrofits(smol, moments, s)
    ids, prefill, ref = held_out(smol, s)
    m = dict(settings=s, manifest=smol.manifest, threads=torch.get_num_threads(), prefill=prefill,
             bf16_bytes=smol.config.kv_bytes_per_position(BF16))
    m["quality"] = quality_map(smol, cases, ids, prefill, ref)
    m["spectra"] = spectra(moments, s["ranks"], calibration_moments(smol, calibration, before_rope=True))
    m["steps"] = step_times(smol, latent, s)
    m["hybrid"] = hybrid_pool(smol, s)
    m["tables"] = hybrid_tables(smol)
    return m


# ---- record ----------------------------------------------------------------------------------------------

FAMILY_KEYS = {"chapter 7, quantized": "quantized", "chapter 7, sinks eviction": "eviction", "fewer KV heads": "heads",
               "latent": "latent", "local layers": "local", "shared layers": "shared", "combined": "combined"}


def key(name: str) -> str:
    """A results key for a case's or a family's display name: "w128 g6 s4 kivi4" -> "w128_g6_s4_kivi4"."""
    return FAMILY_KEYS.get(name) or name.lower().replace(" ", "_")


def values(m: dict) -> dict:
    """The section's values, from every part of the measurements that m holds: a notebook sets each part's
    verdicts beside the book's as soon as it has measured that part (lab.book.verdicts); record() writes them all."""
    s, bf16, v = m["settings"], m["bf16_bytes"], {}
    if "quality" in m:
        ref_loss = next(iter(next(iter(m["quality"].values())).values()))["ref_loss"]
        v |= {"passages": value(s["passages"], "passages", tokens=s["tokens"], prefill=m["prefill"],
                                decoded=s["decode"], note="held-out Shakespeare, SmolLM2 in float32, no training"),
              "bf16_bytes": value(bf16, "bytes", note="per position, the original model's keys and values in bfloat16"),
              "ref_loss": value(ref_loss, "nats"), "quality": {}}
        points = []
        for family, named in m["quality"].items():
            fam = v["quality"][key(family)] = {}
            for name, r in named.items():
                fam[key(name)] = {"kl": value(r["kl"], "nats", positions=r["positions"]),
                                  "delta_ppl": value(r["delta_ppl"], None, loss=r["loss"], ref_loss=r["ref_loss"]),
                                  "top1": value(100 * r["top1"], "%"),
                                  "bytes": value(r["bytes"], "bytes", note="per position, as served (bf16 or codes)"),
                                  "share": value(100 * r["bytes"] / bf16, "%", note="of the original bf16 cache")}
                points.append((r["bytes"] / bf16, r["kl"], family, name))
        v["best"] = {}
        for label, limit in (("quarter", 0.25), ("tenth", 0.10)):
            inside = [p for p in points if p[0] <= limit + 1e-9]
            share, kl, family, name = min(inside, key=lambda p: p[1])
            v["best"][label] = {"kl": value(kl, "nats", design=f"{family}: {name}", limit=f"{limit:.0%} of bf16"),
                                "share": value(100 * share, "%", design=f"{family}: {name}")}
    if "steps" in m:
        v["steps"] = {}
        for T, times in m["steps"].items():
            base = times["original"]["median"]
            v["steps"][f"T{T}"] = {key(n): {"ms": value(t["median"] * 1e3, "ms", iqr=t["iqr"] * 1e3, n=t["n"]),
                                            "over_original": value(t["median"] / base, "x")}
                                   for n, t in times.items()}
        v["steps"]["threads"] = value(m["threads"], "threads")
    if "spectra" in m:
        v["spectra"] = {f"rank_{r}": {part: value(100 * x, "%", note=f"of the {part.replace('_', ' ')}' energy the "
                                                                  "latent's directions keep, mean over layers, "
                                                                  "calibration text")
                                      for part, x in kv.items()} for r, kv in m["spectra"].items()}
    if "hybrid" in m:
        h = m["hybrid"]
        v["hybrid"] = {"context": value(h["context"], "positions", window=h["window"], global_every=h["global_every"],
                                        page_size=h["page_size"], note="SmolLM2's shape, every 6th layer global: "
                                        "the prefill and one decoded token"),
                       "prefill": value(h["prefill"], "positions", note="grown in chunks of 512"),
                       "held_pages": {g: value(n, "pages", layers=h["layers"][g]) for g, n in h["held"].items()},
                       "hybrid_mib": value(h["hybrid_bytes"] / 2**20, "MiB", note="bf16, one sequence"),
                       "full_mib": value(h["full_bytes"] / 2**20, "MiB", note="every layer keeps every page"),
                       "saved": value(100 * (1 - h["hybrid_bytes"] / h["full_bytes"]), "%"),
                       "hit_pages": value(h["hit_pages"], "pages", note="a second request with the same prompt"),
                       "taken_pages": {g: value(n, "pages") for g, n in h["taken"].items()}}
    return v


FAMILY_STYLE = {"chapter 7, quantized": dict(marker="s", color="tab:gray"),
                "chapter 7, sinks eviction": dict(marker="x", color="tab:gray"),
                "fewer KV heads": dict(marker="D", color="tab:purple"),
                "latent": dict(marker="o", color="tab:blue"),
                "local layers, 4 sinks": dict(marker="^", color="tab:orange"),
                "local layers, no sinks": dict(marker="^", color="tab:orange", markerfacecolor="none"),
                "shared layers": dict(marker="v", color="tab:red"),
                "combined": dict(marker="*", color="tab:green", markersize=11)}
LABELLED = ("fewer KV heads", "latent", "local layers, 4 sinks", "local layers, no sinks", "shared layers", "combined")


def in_words(name: str) -> str:
    """A case's name as a figure's label says it: "w512 g6 s4 kivi4" -> "512, 1 in 6, KIVI-4" (the window, one
    global layer in g; whether it has sinks, the legend says), "rank 96 int8" -> "rank 96, INT8", "every 2" ->
    "share by 2"."""
    text = re.sub(r"w(\d+) g(\d+)(?: s\d+)?", lambda m: f"{int(m[1]):,}, 1 in {m[2]}", name)
    return text.replace(" int8", ", INT8").replace(" kivi4", ", KIVI-4").replace("every ", "share by ")


def plot_kl_bytes(q: dict, path=None, floor=1e-6):
    """KL to the original model against bytes per position (a share of its bf16 cache's), every case;
    q: {family: {name: {"kl", "share"}}} (plot_points). Local layers with sinks and without are drawn apart.
    A KL under `floor` (the identity settings: float rounding) is drawn at the floor. Every point of this
    chapter's designs is labelled in words (plots.label_points), chapter 7's are the legend's."""
    fig, ax = plots.figure(height=6.0)
    families = {}
    for family, named in q.items():
        for name, r in named.items():
            sinks = "local layers, 4 sinks" if " s" in name else "local layers, no sinks"
            families.setdefault(sinks if family == "local layers" else family, {})[name] = r
    labels, identity = [], []
    for family, named in families.items():
        xs = [r["share"] for r in named.values()]
        ys = [max(r["kl"], floor) for r in named.values()]
        shown = {"local layers, 4 sinks": "local layers with 4 sinks (window, 1 global layer in g)",
                 "local layers, no sinks": "local layers without sinks"}.get(family, family)
        ax.plot(xs, ys, ls="none", label=shown, alpha=0.85, **FAMILY_STYLE.get(family, dict(marker="o")))
        for name, x, y in zip(named, xs, ys, strict=True):
            if y <= floor:
                identity.append((x, y))
            elif family in LABELLED:
                labels.append((x, y, in_words(name)))
    if identity:
        labels.append((*identity[0], "the model itself"))
    ax.set(xscale="log", yscale="log", xlabel="bytes per position / the original bf16 cache's",
           ylabel="KL to the original model (nats)", title="Quality against memory, chapters 7 and 10")
    ax.set_xticks([0.05, 0.1, 0.25, 0.5, 1], ["0.05", "0.1", "0.25", "0.5", "1"])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.margins(x=0.08, y=0.08)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncols=2, frameon=False)
    fig.tight_layout()
    plots.label_points(ax, sorted(labels, key=lambda t: -t[1]), fontsize=8.5)
    return finish(fig, path)


def plot_points(m: dict) -> dict:
    """m["quality"] with each case's bytes as a share of the original bf16 cache's (for plot_kl_bytes)."""
    bf16 = m["bf16_bytes"]
    return {f: {n: dict(kl=r["kl"], share=r["bytes"] / bf16) for n, r in named.items()}
            for f, named in m["quality"].items()}


def plot_tables(t: dict, path=None):
    """Each sequence's block table in each group, one cell per page: held, a sink page, or given back
    (NULL), from `hybrid_tables`."""
    groups, n = list(t["tables"]), len(t["lengths"])
    width = max(len(row) for rows in t["tables"].values() for row in rows)
    fig, ax = plots.figure(height=0.5 + 0.42 * n * len(groups))
    sink_pages = pages_for(t["sinks"], t["page_size"])
    colors = {"held": "tab:blue", "sink": "tab:orange", "free": "white"}
    y, labels = 0, []
    for g in groups:
        for seq, row in enumerate(t["tables"][g]):
            for i, page in enumerate(row):
                kind = "free" if page == NULL else "sink" if g == "local" and i < sink_pages else "held"
                ax.add_patch(matplotlib.patches.Rectangle((i, y), 0.9, 0.8, facecolor=colors[kind],
                                                          edgecolor="0.4", hatch="//" if kind == "free" else None))
            labels.append(f"{g}, {t['lengths'][seq]} positions")
            y -= 1
    ax.set(xlim=(-0.2, width + 0.2), ylim=(y + 0.9, 0.9), xlabel="block-table entry (pages of 16 positions)",
           title=f"Pages held by global layers and by local ones (window {t['window']})")
    ax.set_yticks([-k + 0.4 for k in range(len(labels))], labels)
    ax.legend(handles=[matplotlib.patches.Patch(facecolor=c, edgecolor="0.4", hatch="//" if k == "free" else None,
                                                label={"held": "page held", "sink": "sink page",
                                                       "free": "given back"}[k]) for k, c in colors.items()],
              loc="upper center", bbox_to_anchor=(0.5, -0.25), ncols=3, frameon=False)
    return finish(fig, path)


def record(m: dict, drawn: dict | None = None) -> dict:
    """Write section ch10 and its figures. drawn: figures already drawn (a notebook's), saved, not redrawn."""
    figs, drawn, v = figures_dir(), drawn or {}, values(m)
    draw = {"kl_bytes": lambda p: plot_kl_bytes(plot_points(m), p), "tables": lambda p: plot_tables(m["tables"], p)}
    for name, plot in draw.items():
        path = figs / f"ch10_{name}.png"
        finish(drawn[name], path) if name in drawn else plot(path)
    captions = {"kl_bytes": "KL against bytes per position: chapter 7's caches and chapter 10's retrofits",
                "tables": "The pages a hybrid model holds: block tables of the full and the local group"}
    figures = {n: {"path": figs / f"ch10_{n}.png", "caption": captions[n]} for n in draw}
    write_section(SECTION, v, provenance(manifest=m["manifest"]), figures=figures)
    return v

