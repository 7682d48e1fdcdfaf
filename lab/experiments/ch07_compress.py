"""Chapter 7, "A smaller cache": what fewer bits per value, or fewer positions kept, cost in model quality.

The measurement every comparison of the chapter shares is `lab.metrics.quality`: held-out passages go
through a cache the way serving feeds them, a prompt in one prefill step and then one token per step, and
every next-token distribution from the prefill's last position on is compared with the plain forward's:
KL divergence, change in loss and perplexity, top-1 agreement.

The peers, each on the same model and text: transformers' QuantizedCache (quanto and FP8 backends, run
teacher-forced the same way, `lab.peers.hf_quantized`) and NVIDIA's kvpress (`against_kvpress`: kvpress's own
protocol, a context compressed once after its prefill and a continuation scored on it, which the lab
repeats with an EvictingCache of the same size), and llama.cpp's cache types (`llamacpp_comparison`, on
llama-perplexity's protocol: lab.peers.llamacpp_kl).
"""


import matplotlib.ticker
import torch
from tqdm.auto import tqdm

from .. import data
from ..cache import ConcatCache, EvictingCache, QuantizedCache, cache_bytes
from ..cache.quantized import PerTensorCache
from ..metrics import compare, key_spread, reference, sweep, teacher_forced
from ..models import load
from ..models.retrofit import OUTLIER_FACTOR, OUTLIER_PAIRS, with_outlier_channels
from ..peers import hf_quantized, kvpress_agreement, llamacpp, llamacpp_kl
from ..peers.kvpress_agreement import LAB_PRESS, against_kvpress
from ..results import figures_dir, not_run, provenance, quick, update_section, value, write_section
from ..step_cost import cache_step_times
from . import plots
from .plots import finish

SECTION = "ch07"
BF16 = torch.bfloat16
# name -> QuantizedCache settings: the schemes and bit widths the chapter compares. Scales and zero points
# are stored in bfloat16, as a 16-bit cache would store them; the model itself runs in float32.
QUANTIZED = {
    "per_token_8": dict(bits=8, scheme="per_token", scale_dtype=BF16),
    "per_token_8_smooth": dict(bits=8, scheme="per_token", smooth=True, scale_dtype=BF16),
    "per_token_4": dict(bits=4, scheme="per_token", scale_dtype=BF16),
    "per_token_4_smooth": dict(bits=4, scheme="per_token", smooth=True, scale_dtype=BF16),
    "kivi_4": dict(bits=4, scheme="kivi", group_size=32, residual=128, scale_dtype=BF16),
    "kivi_2": dict(bits=2, scheme="kivi", group_size=32, residual=128, scale_dtype=BF16),
}
POLICIES = ("window", "sinks", "h2o", "snapkv")
LLAMACPP_LAB = ("per_token_8", "kivi_4", "kivi_2")     # the lab's caches set beside llama.cpp's cache types


def settings(quick_mode: bool) -> dict:
    """Passages of `tokens` ids, `decode` of them fed one per step after a prefill of the rest; `groups`:
    2-bit KIVI's (key group, value group) sizes tried beside its default (32, 64); `llamacpp`: (tokens per
    chunk, chunks) of llama-perplexity's protocol."""
    if quick_mode:
        return dict(tokens=256, passages=2, decode=16, budgets=(48, 128), rerotate_budgets=(48,),
                    residuals=(0, 128), groups=((32, 16),), ratios=(0.5,), continuation=64, step_context=256,
                    step_rounds=5, peers=False, llamacpp=(256, 2))
    return dict(tokens=2048, passages=4, decode=128, budgets=(64, 128, 256, 512, 1024),
                rerotate_budgets=(64, 256, 1024), residuals=(0, 32, 128, 256),
                groups=((16, 16), (32, 16), (8, 8)),
                ratios=(0.5, 0.75), continuation=256, step_context=1024, step_rounds=15, peers=True,
                llamacpp=(512, 16))


# ---- the caches compared (lab.metrics.quality feeds each a prefill, then one token per step) ---------------

def quantized(**settings):
    return lambda config, batch_size=1: QuantizedCache(config, batch_size=batch_size, **settings)


def evicting(budget, policy, **settings):
    return lambda config, batch_size=1: EvictingCache(config, budget, policy, batch_size=batch_size, **settings)


def float_cache(config, batch_size=1):
    return ConcatCache(config, batch_size)


@torch.inference_mode()
def kept_positions(model, ids: list, policy: str, budget: int, layer: int = 0, prefill: int = 64, **settings):
    """`EvictingCache.kept_map` after one passage `ids` went through the cache as `quality` feeds it (the
    heat map of what H2O and SnapKV keep)."""
    cache = EvictingCache(model.config, budget, policy, **settings)
    teacher_forced(model, ids, cache, prefill)
    return cache.kept_map(layer, len(ids))


# ---- figures ----------------------------------------------------------------------------------------------

def plot_kl_bytes(points: dict, path=None):
    """KL against bytes held (a share of the float32 cache's), one marker per family of points:
    points {family: {name: (share, kl)}}. Each point is labelled where its label overlaps no other
    (plots.label_points), so that families whose points coincide (the lab's evicting cache and kvpress's)
    stay readable."""
    fig, ax = plots.figure(height=4.0)
    styles = [dict(marker="o"), dict(marker="s"), dict(marker="^", markersize=12, markerfacecolor="none"),
              dict(marker="x", markersize=8)]
    labels = []
    for (family, named), style in zip(points.items(), styles[:len(points)], strict=True):
        xs, ys = zip(*[(share, max(kl, 1e-6)) for share, kl in named.values()], strict=True)
        ax.plot(xs, ys, ls="none", label=family, alpha=0.85, **style)
        labels += [(x, y, name.replace("_", " ")) for name, x, y in zip(named, xs, ys, strict=True)]
    ax.set(xscale="log", yscale="log", xlabel="bytes held / the float32 cache's",
           ylabel="KL to the uncompressed model (nats)", title="Quality against memory")
    ax.set_xlim(0.06, 0.8)                                                    # room for the labels
    ax.set_xticks([0.1, 0.2, 0.3, 0.5], ["0.1", "0.2", "0.3", "0.5"])
    ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
    ax.margins(y=0.1)                                                         # room for labels below
    ax.legend(loc="lower left")
    fig.tight_layout()
    plots.label_points(ax, sorted(labels, key=lambda t: -t[1]))
    return finish(fig, path)


def plot_loss_budget(results: dict, policies=POLICIES, ref_loss=None, rerotated=None, path=None):
    """Held-out loss against the budget, a line per eviction policy; `results` keyed "{policy}_{budget}",
    `rerotated` {budget: quality} for sinks with keys re-rotated."""
    fig, ax = plots.figure(height=3.6)
    for p in policies:
        budgets = sorted(int(k.rsplit("_", 1)[1]) for k in results if k.rsplit("_", 1)[0] == p)
        ax.plot(budgets, [results[f"{p}_{b}"]["loss"] for b in budgets], "o-", label=p)
    if rerotated:
        budgets = sorted(rerotated)
        ax.plot(budgets, [rerotated[b]["loss"] for b in budgets], "x--", label="sinks, re-rotated")
    if ref_loss is not None:
        ax.axhline(ref_loss, ls=":", color="gray", label="every position kept")
    ax.set(xscale="log", xlabel="budget (positions kept per head)", ylabel="next-token loss (nats)",
           title="Fewer positions: loss against budget")
    ax.legend()
    return finish(fig, path)


def plot_kept(maps: dict, path=None):
    """maps {title: [H_kv, T] bool}: which positions each head keeps, one panel per map."""
    fig, axes = plots.figure(nrows=len(maps), height=1.4 * len(maps) + 0.8)
    axes = [axes] if len(maps) == 1 else list(axes)
    for ax, (name, m) in zip(axes, maps.items(), strict=True):
        ax.imshow(m.float().numpy(), aspect="auto", interpolation="nearest", cmap="Greys")
        ax.set(ylabel="KV head", title=f"{name}: positions kept (black)")
        ax.set_yticks(range(m.shape[0]))
    axes[-1].set_xlabel("position in the passage")
    return finish(fig, path)


def plot_residual(kl: dict, path=None):
    """KL against the residual window (positions kept in float) for 2-bit KIVI: kl {window: KL}."""
    fig, ax = plots.figure(height=3.2)
    windows = sorted(kl)
    ax.plot(windows, [kl[w] for w in windows], "o-")
    ax.set(xlabel="residual window (positions kept in float)", ylabel="KL (nats)",
           title="2-bit KIVI: what the float window buys", ylim=(0, None))
    return finish(fig, path)


# ---- measure and record -----------------------------------------------------------------------------------

def held_out(model, s: dict):
    """The passages `[B, T]`, the prefill length and the oracle's logits for settings `s`."""
    ids = torch.tensor(data.passages(model.tokenizer, s["tokens"], s["passages"]))          # [B, T]
    prefill = s["tokens"] - s["decode"]
    return ids, prefill, reference(model, ids, prefill)


def measure_bits(model, ids, prefill, ref, s: dict) -> dict:
    """Every quantized scheme, the per-tensor what-if, 2-bit KIVI's residual window and group sizes, and
    the smoothing question on keys with outlier channels."""
    cfg = model.config
    cases = {"float": float_cache} | {n: quantized(**q) for n, q in QUANTIZED.items()}
    cases["per_tensor_8"] = lambda config, b: PerTensorCache(config, b)
    m = dict(key_spread=key_spread(model, ids), quantized=sweep(model, ids, prefill, cases, ref, "quantized"),
             bytes_per_position={n: QuantizedCache(cfg, **q).bytes_per_position() for n, q in QUANTIZED.items()})
    kivi_2 = QUANTIZED["kivi_2"]
    m["residual"] = sweep(model, ids, prefill, {r: quantized(**kivi_2 | dict(residual=r)) for r in s["residuals"]},
                          ref, "residual window")
    groups = {(g, vg): kivi_2 | dict(group_size=g, value_group_size=vg) for g, vg in s["groups"]}
    m["groups"] = sweep(model, ids, prefill, {k: quantized(**q) for k, q in groups.items()}, ref, "group sizes")
    m["groups_bytes"] = {k: QuantizedCache(cfg, **q).bytes_per_position() for k, q in groups.items()}
    outlying = with_outlier_channels(model)
    ref_outlying = reference(outlying, ids, prefill)
    m["outliers"] = dict(key_spread=key_spread(outlying, ids), factor=OUTLIER_FACTOR, pairs=list(OUTLIER_PAIRS),
                         same_function=float((ref_outlying - ref).abs().max()))
    smoothing = {n: cases[n] for n in ("per_token_8", "per_token_8_smooth", "per_tensor_8")}
    m["outliers"] |= sweep(outlying, ids, prefill, smoothing, ref_outlying, "outlier keys")
    return m


def measure_positions(model, ids, prefill, ref, s: dict) -> dict:
    """Every eviction policy at every budget (and which positions each kept, in the middle layer), and
    sinks with keys re-rotated."""
    cfg, layer = model.config, model.config.n_layers // 2
    m = dict(kept_layer=layer, kept={}, eviction={})
    cases = [(p, b) for p in POLICIES for b in s["budgets"]]
    for p, b in tqdm(cases, desc="eviction"):
        cache = evicting(b, p)(cfg, len(ids))
        got = teacher_forced(model, ids, cache, prefill)
        m["eviction"][f"{p}_{b}"] = compare(got, ref, ids[:, prefill:]) | dict(nbytes=cache.nbytes())
        m["kept"][f"{p}_{b}"] = cache.kept_map(layer, ids.shape[1])
    m["rerotate"] = sweep(model, ids, prefill, {b: evicting(b, "sinks", rerotate=True) for b in s["rerotate_budgets"]},
                          ref, "sinks, re-rotated")
    return m


def kvpress_comparison(model, ids, s: dict):
    """against_kvpress at every ratio, and StreamingLLM re-rotated at the first; the passages cut into a
    context and the last `continuation` tokens. A string saying why, where it does not run."""
    from ..peers import compare_kvpress

    if not s["peers"]:
        return "quick mode: kvpress loads its own model per press; `make results` runs the comparison"
    if not compare_kvpress.available():
        return "kvpress's environment is not built here (make peers)"
    T, n = s["tokens"], s["continuation"]
    contexts, continuations = ids[:, :T - n].tolist(), ids[:, T - n:].tolist()
    out = {r: against_kvpress(model, contexts, continuations, r) for r in s["ratios"]}
    out["rerotate"] = against_kvpress(model, contexts, continuations, s["ratios"][0], rerotate=True,
                                      presses=("streaming_llm",))
    return out


def llamacpp_comparison(model, s: dict):
    """llama.cpp's cache types and the lab's LLAMACPP_LAB caches, each read back from the quantized cache at
    every position, on `s["llamacpp"]` = (tokens, count) chunks of held-out text (llamacpp_kl.compare). A
    string saying why, where llama.cpp is not built."""
    if not llamacpp.available():
        return "llama.cpp is not built here (make llamacpp)"
    ctx, chunks = s["llamacpp"]
    return llamacpp_kl.compare(model, ctx, chunks, {n: QUANTIZED[n] for n in LLAMACPP_LAB})


def measure_steps(model, s: dict) -> dict:
    """Decode step times: the float cache, three quantized schemes, each policy at the middle budget."""
    b = sorted(s["budgets"])[len(s["budgets"]) // 2]
    timed = {"float": float_cache} | {n: quantized(**QUANTIZED[n]) for n in ("per_token_8", "kivi_4", "kivi_2")}
    timed |= {f"{p}_{b}": evicting(b, p) for p in POLICIES}
    return cache_step_times(model, s["step_context"], timed, s["step_rounds"])


def measure(quick_mode=None) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    smol = load("smollm2")
    ids, prefill, ref = held_out(smol, s)
    m = dict(settings=s, manifest=smol.manifest, threads=torch.get_num_threads(), prefill=prefill,
             float_bytes=cache_bytes(smol.config, 1), bf16_bytes=cache_bytes(smol.config, 1, dtype=BF16))
    m |= measure_bits(smol, ids, prefill, ref, s)
    m |= measure_positions(smol, ids, prefill, ref, s)
    m["transformers"] = hf_quantized.quality(smol, ids, prefill, ref, hf_quantized.CASES)
    m["kvpress"] = kvpress_comparison(smol, ids, s)
    m["llamacpp"] = llamacpp_comparison(smol, s)
    m["steps"] = measure_steps(smol, s)
    return m


def kl_bytes_points(v: dict) -> dict:
    """The KL-against-bytes figure's points, from the recorded values `v` (`values(m)`, or section ch07 of a
    results file): {family: {name: (share of the float32 cache held, KL)}}. The simulated per-tensor cache
    stores floats, so it has no place on the bytes axis."""
    kl = lambda x: x["kl"]["value"]                                          # noqa: E731
    share = lambda x: x["held_share"]["value"] / 100                         # noqa: E731
    points = {"lab, quantized": {n: (share(x), kl(x)) for n, x in v["quantized"].items()
                                 if n not in ("float", "per_tensor_8")},
              "transformers": {n: (share(x), kl(x)) for n, x in v["transformers"].items()}}
    ratios = sorted(k for k in v["kvpress"] if k.startswith("ratio_"))
    if ratios:
        r, kept = v["kvpress"][ratios[0]], 1 - int(ratios[0].split("_")[1]) / 100
        label = "half the context" if kept == 0.5 else f"{kept:.0%} of the context"
        points[f"lab, evicting ({label} kept)"] = {LAB_PRESS[p][0]: (kept, r[p]["lab_kl"]["value"]) for p in LAB_PRESS}
        points["kvpress (the same)"] = {p.replace("_", "-"): (kept, r[p]["peer_kl"]["value"]) for p in LAB_PRESS}
    return points


def _quality_values(r: dict, **extra) -> dict:
    return {"kl": value(r["kl"], "nats", positions=r["positions"], **extra),
            "delta_ppl": value(r["delta_ppl"], None, loss=r["loss"], ref_loss=r["ref_loss"]),
            "top1": value(100 * r["top1"], "%")}


def values(m: dict) -> dict:
    """The measurements `m` as section ch07 records them (results.value leaves), from every part that m holds: a
    notebook sets each part's verdicts beside the book's as soon as it has measured that part (lab.book.verdicts)."""
    s, v = m["settings"], {}
    if "prefill" in m:
        v["passages"] = value(s["passages"], "passages", tokens=s["tokens"], prefill=m["prefill"],
                              decoded=s["decode"], note="held-out Shakespeare, SmolLM2, float32")
    if "float_bytes" in m:
        v["float_bytes"] = value(m["float_bytes"], "bytes", note="per position, K and V, every layer")
        v["bf16_bytes"] = value(m["bf16_bytes"], "bytes")
    if "quantized" in m:
        passage = dict(passages=s["passages"], tokens=s["tokens"], decoded=s["decode"])
        v["ref_loss"] = value(m["quantized"]["float"]["ref_loss"], "nats",
                              note="the uncompressed model's mean loss on the decoded positions")
        v["key_spread"] = {k: value(x, "x") for k, x in m["key_spread"].items()}
        v["quantized"] = {}
        for name, r in m["quantized"].items():
            v["quantized"][name] = _quality_values(r, **passage)
            v["quantized"][name]["held_share"] = value(
                100 * r["nbytes"] / (r["batch"] * r["length"] * m["float_bytes"]), "%",
                note="bytes held at the end / the float32 cache's")
            if name in m["bytes_per_position"]:
                bpp = m["bytes_per_position"][name]
                v["quantized"][name]["bytes_per_position"] = value(bpp, "bytes", note="codes, scales, zero points")
                v["quantized"][name]["over_bf16"] = value(bpp / m["bf16_bytes"], "x")
    if "residual" in m:
        v["residual"] = {f"r{w}": _quality_values(r) for w, r in m["residual"].items()}
    if "groups" in m:
        v["groups"] = {f"g{g}_v{vg}": _quality_values(r) | {"over_bf16": value(
            m["groups_bytes"][g, vg] / m["bf16_bytes"], "x")} for (g, vg), r in m["groups"].items()}
    if "outliers" in m:
        o = m["outliers"]
        v["outliers"] = {n: _quality_values(o[n]) for n in ("per_token_8", "per_token_8_smooth", "per_tensor_8")}
        v["outliers"]["factor"] = value(o["factor"], "x", pairs=", ".join(map(str, o["pairs"])),
                                        note="key channels scaled up, the matching query channels down")
        v["outliers"]["same_function"] = value(o["same_function"], None, note="max |logit difference| to SmolLM2")
        v["outliers"]["key_spread"] = {k: value(x, "x") for k, x in o["key_spread"].items()}
    if "eviction" in m:
        v["eviction"] = {name: {"loss": value(r["loss"], "nats", ref_loss=r["ref_loss"]),
                                "kl": value(r["kl"], "nats"), "top1": value(100 * r["top1"], "%")}
                         for name, r in m["eviction"].items()}
    if "rerotate" in m:
        v["rerotate"] = {f"sinks_{b}": {"loss": value(r["loss"], "nats"), "kl": value(r["kl"], "nats"),
                                        "kept_positions_loss": value(m["eviction"][f"sinks_{b}"]["loss"], "nats")}
                         for b, r in m["rerotate"].items()}
    if "transformers" in m:
        v["transformers"] = {name: _quality_values(r) | {"held_share": value(
            100 * r["nbytes"] / (r["batch"] * r["length"] * m["float_bytes"]), "%",
            settings=", ".join(f"{k}={x}" for k, x in r["settings"].items()))} for name, r in m["transformers"].items()}
    if "kvpress" in m:
        v["kvpress"] = kvpress_agreement.values(m["kvpress"])
    if "llamacpp" in m:
        v["llamacpp"] = llamacpp_kl.values(m["llamacpp"], LLAMACPP_LAB)
    if "steps" in m:
        st = m["steps"]
        v["steps"] = {name: {"ms": value(t["median"] * 1e3, "ms", iqr=t["iqr"] * 1e3, n=t["n"]),
                             "over_float": value(t["median"] / st["float"]["median"], "x")} for name, t in st.items()}
        v["steps"]["context"] = value(s["step_context"], "tokens", threads=m["threads"])
        v["steps"]["int8_kernel_gpu"] = not_run("the INT8 Triton kernel's bandwidth is measured by the GPU script "
                                                "(section ch05_gpu)")
    return v


def record(m: dict, drawn: dict | None = None) -> dict:
    """Write section ch07 and its figures. drawn: figures already drawn (a notebook's), saved, not redrawn:
    {"kl_bytes", "loss_budget", "kept", "residual"}."""
    figs, drawn, v = figures_dir(), drawn or {}, values(m)
    budgets = m["settings"]["budgets"]
    mid = sorted(budgets)[len(budgets) // 2]
    draw = {"kl_bytes": lambda p: plot_kl_bytes(kl_bytes_points(v), p),
            "loss_budget": lambda p: plot_loss_budget(m["eviction"], ref_loss=v["ref_loss"]["value"],
                                                      rerotated=m["rerotate"], path=p),
            "kept": lambda p: plot_kept({f"{x}, budget {mid}": m["kept"][f"{x}_{mid}"] for x in ("h2o", "snapkv")},
                                        p),
            "residual": lambda p: plot_residual({w: r["kl"] for w, r in m["residual"].items()}, p)}
    for name, plot in draw.items():
        path = figs / f"ch07_{name}.png"
        finish(drawn[name], path) if name in drawn else plot(path)
    figures = {"kl_bytes": {"path": figs / "ch07_kl_bytes.png",
                            "caption": "KL to the uncompressed model against the bytes held"},
               "loss_budget": {"path": figs / "ch07_loss_budget.png",
                               "caption": "Held-out loss against budget, per eviction policy"},
               "kept": {"path": figs / "ch07_kept.png", "caption": "Positions H2O and SnapKV keep, per KV head"},
               "residual": {"path": figs / "ch07_residual.png", "caption": "2-bit KIVI: KL against residual window"}}
    write_section(SECTION, v, provenance(manifest=m["manifest"], **llamacpp_kl.build_provenance(m.get("llamacpp"))),
                  figures=figures)
    return v


def record_llamacpp(quick_mode=None) -> dict:
    """Measure llama.cpp's part alone (`llamacpp_comparison`) and set it into section ch07 as the results file
    already holds it (results.update_section); llama.cpp's provenance says when it ran."""
    smol = load("smollm2")
    r = llamacpp_comparison(smol, settings(quick() if quick_mode is None else quick_mode))
    when = {k: x for k, x in provenance(manifest=smol.manifest).items() if k in ("date", "git", "mode")}
    extra = {name: part | when for name, part in llamacpp_kl.build_provenance(r).items()}
    update_section(SECTION, "llamacpp", v := llamacpp_kl.values(r, LLAMACPP_LAB), extra)
    return v
