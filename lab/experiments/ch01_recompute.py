"""Chapter 1, "Prefill, decode and the cost of recomputing": every measurement of the chapter.

The notebook calls these functions one at a time and shows what they return; `measure()` calls them
all and `record()` writes the numbers to results.json (both: `python -m lab.experiments ch01`).
"""

import torch
from tqdm.auto import tqdm

from .. import data
from ..bench import time_call
from ..cache import StaticCache, bytes_per_position, make_cache
from ..engine import RecomputeBackend, generate, positions_cached, positions_uncached
from ..metrics import logit_diff, perplexity
from ..models import forward, forward_cached, load
from ..models.published import PUBLISHED
from ..results import figures_dir, provenance, quick, value, write_section
from . import plots
from .plots import finish

SECTION = "ch01"
MODEL_LABELS = {"smollm2": "SmolLM2-135M", "gpt2-random": "GPT-2 small shape (random weights)"}


def settings(quick_mode: bool) -> dict:
    """Sweep sizes: the full run for results.json, a short one for tests and the quick notebook."""
    if quick_mode:
        return dict(contexts={"gpt2-random": [16, 64, 256], "smollm2": [16, 64, 256]}, reps=3, warmup=1,
                    parity_tokens=64, new_tokens=32, decode_tokens=8, prefill_prompts=[17, 128], ppl_passages=2,
                    ppl_tokens=128)
    T = [16, 32, 64, 128, 256, 512, 960]
    return dict(contexts={"gpt2-random": T, "smollm2": T + [2048]}, reps=7, warmup=2,
                parity_tokens=256, new_tokens=32, decode_tokens=32, prefill_prompts=[17, 128, 512], ppl_passages=16,
                ppl_tokens=256)


def heldout_prompt(model, n_tokens: int, seed: int = 0) -> list:
    """A prompt of exactly n_tokens ids from held-out Shakespeare."""
    return data.passages(model.tokenizer, n_tokens=n_tokens, count=1, seed=seed)[0]


@torch.inference_mode()
def causal_mask(model, n_tokens: int = 64, seed: int = 0) -> dict:
    """Change the last token of a prompt; how far do the logits of every position move?

    Returns the per-position max |delta logit| (a list), and its maximum over the earlier positions and
    at the last one. The causal mask says the earlier positions cannot see the change.
    """
    ids = torch.tensor([heldout_prompt(model, n_tokens, seed)])        # [1, T]
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1000) % model.config.vocab_size    # any other token
    a = forward(ids, model.weights, model.config)[0]                    # [T, V]
    b = forward(changed, model.weights, model.config)[0]
    per_position = (a - b).abs().amax(-1)                               # [T]
    return dict(per_position=per_position.tolist(), earlier_max=per_position[:-1].max().item(),
                last=per_position[-1].item(), tokens=n_tokens)


def forward_with_attention(ids, model, attend):
    """The forward of ids `[B, T]` with another attention -> logits `[B, T, V]`: `attend(i, q, k, v)`
    (q `[B, H_q, T, D]`, k, v `[B, H_kv, T, D]`) replaces causal attention in every layer.

    It runs `forward_cached` through a fresh cache whose attend is `attend`. With `attend=causal` this is
    exactly `lab.models.forward` (a test checks it); with `bidirectional` every position sees every other
    one, as in an encoder.
    """
    cache = make_cache("concat", model.config, ids.shape[1], batch_size=ids.shape[0])
    cache.attend = lambda i, q, k, v: attend(i, q, *cache.update(i, k, v))  # forward_cached calls cache.attend
    return forward_cached(ids, model.weights, model.config, cache)


def causal(i, q, k, v):  # q [B, Hq, T, D], k, v [B, Hkv, T, D]: query t sees keys 0 .. t
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)


def bidirectional(i, q, k, v):  # no mask: query t sees every key, later ones included
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, enable_gqa=True)


@torch.inference_mode()
def bidirectional_shift(model, n_tokens: int = 64, seed: int = 0) -> dict:
    """The causal-mask experiment with the mask removed: how far do earlier positions' logits move?

    Same prompt and same changed last token as `causal_mask`. Returns the per-position max |delta logit|,
    its maximum and median over the earlier positions, the change at the last position, how many earlier
    positions' top token (argmax) changed, and the largest |logit| as a scale.
    """
    ids = torch.tensor([heldout_prompt(model, n_tokens, seed)])        # [1, T]
    changed = ids.clone()
    changed[0, -1] = (ids[0, -1] + 1000) % model.config.vocab_size
    a = forward_with_attention(ids, model, bidirectional)[0]           # [T, V]
    b = forward_with_attention(changed, model, bidirectional)[0]
    per_position = (a - b).abs().amax(-1)                               # [T]
    earlier = per_position[:-1]
    top_changed = (a[:-1].argmax(-1) != b[:-1].argmax(-1)).sum().item()
    return dict(per_position=per_position.tolist(), earlier_max=earlier.max().item(),
                earlier_median=earlier.median().item(), last=per_position[-1].item(),
                top_changed=int(top_changed), earlier=n_tokens - 1, scale=a.abs().max().item(), tokens=n_tokens)


def naive_loop(model, prompt_len: int = 17, new_tokens: int = 32, seed: int = 0) -> dict:
    """Greedy generation without a cache; counts the positions the model processes."""
    prompt = heldout_prompt(model, prompt_len, seed)
    backend = RecomputeBackend(model)
    out = generate(backend, prompt, new_tokens)
    return dict(prompt=prompt, tokens=out.tokens, text=model.tokenizer.decode(out.tokens),
                prompt_text=model.tokenizer.decode(prompt), calls=backend.calls, positions=backend.positions,
                formula_uncached=positions_uncached(prompt_len, new_tokens),
                formula_cached=positions_cached(prompt_len, new_tokens), ttft=out.ttft, tpot=out.tpot)


def step_times(model, contexts, reps=7, warmup=2, progress=True) -> dict:
    """Median wall time of one uncached decode step (a forward over T positions) for each context T."""
    out = {}
    for T in tqdm(contexts, desc=f"step time {model.name}", disable=not progress):
        ids = torch.randint(0, model.config.vocab_size, (1, T), generator=torch.Generator().manual_seed(T))
        out[T] = time_call(lambda ids=ids: forward(ids, model.weights, model.config, last_only=True), warmup, reps)
    return out


def prefill_decode(model, prompt_lens, new_tokens=32, progress=True) -> dict:
    """Time to first token and time per output token of the uncached loop, per prompt length."""
    out = {}
    for P in tqdm(prompt_lens, desc=f"prefill and decode {model.name}", disable=not progress):
        generate(RecomputeBackend(model), heldout_prompt(model, P), 2)  # warm-up
        r = naive_loop(model, P, new_tokens)
        out[P] = dict(ttft=r["ttft"], tpot=r["tpot"])
    return out


def bytes_table(dtype_bytes: int = 2, context: int = 4096) -> list:
    """Bytes per cached position for published model shapes, what grouped-query attention saves, and the
    cache of one sequence of `context` tokens."""
    rows = []
    for m in PUBLISHED:
        actual = bytes_per_position(m.n_layers, m.n_kv_heads, m.head_dim, dtype_bytes)
        mha = bytes_per_position(m.n_layers, m.n_heads, m.head_dim, dtype_bytes)  # one kv head per query head
        rows.append(dict(model=m.name, layers=m.n_layers, q_heads=m.n_heads, kv_heads=m.n_kv_heads,
                         head_dim=m.head_dim, bytes=actual, mha_bytes=mha, saving=mha / actual, source=m.source,
                         context=context, context_gib=actual * context / 2**30))
    return rows


def dtype_bytes(config, context: int = 4096) -> dict:
    """The cache of `config`'s model per position in float32 and in bfloat16, computed from its config
    (`kv_bytes_per_position`) and checked against what a StaticCache of that dtype allocates (on the meta
    device: shapes, no memory): {dtype: {"bytes", "context_gib"}}."""
    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        per = config.kv_bytes_per_position(dtype)
        held = StaticCache(config, context, dtype=dtype, device="meta").nbytes()
        if held != per * context:
            raise AssertionError(f"{dtype}: a StaticCache holds {held} bytes, the formula says {per * context}")
        out[str(dtype).removeprefix("torch.")] = dict(bytes=per, context=context, context_gib=held / 2**30)
    return out


@torch.inference_mode()
def parity(names, n_tokens=256, seed=0, progress=True) -> dict:
    """Max and median |our logits - transformers' logits| on the same weights and ids."""
    from ..models.hf import to_transformers

    out = {}
    for name in tqdm(names, desc="parity with transformers", disable=not progress):
        model = load(name)
        hf = to_transformers(model)
        if name == "smollm2":  # real text for the real model
            ids = torch.tensor(data.passages(model.tokenizer, n_tokens, count=2, seed=seed))
        else:
            g = torch.Generator().manual_seed(seed)
            ids = torch.randint(0, model.config.vocab_size, (2, n_tokens), generator=g)
        ours, theirs = forward(ids, model.weights, model.config), hf(ids).logits
        out[name] = dict(logit_diff(ours, theirs), scale=theirs.abs().max().item(), tokens=ids.numel())
        del hf
    return out


def perplexities(model, n_passages=16, n_tokens=256) -> dict:
    """Perplexity on held-out passages and on the same words shuffled (a sanity check of the model)."""
    passages = data.passages(model.tokenizer, n_tokens, count=n_passages, seed=1)
    shuffled = [model.tokenizer.encode(data.shuffle_words(model.tokenizer.decode(p), seed=i))[:n_tokens]
                for i, p in enumerate(passages)]
    return dict(heldout=perplexity(model, passages), shuffled=perplexity(model, shuffled),
                passages=n_passages, tokens=n_tokens)


# ---- figures -----------------------------------------------------------------------------------------

def recorded_step_times(v: dict) -> dict:
    """plot_step_times' input from recorded values `v` (section ch01 of a results file), to redraw the figure
    without measuring: {model: {T: {"median", "min", "max"} in seconds}}."""
    return {name: {int(k[1:]): {"median": x["value"] / 1e3, "min": x["min"] / 1e3, "max": x["max"] / 1e3}
                   for k, x in by_T.items() if k[:1] == "T" and k[1:].isdigit()}
            for name, by_T in v["step_ms"].items()}


def plot_step_times(times: dict, path=None):
    """Step time against context length, one line per model, log-log."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    fig, ax = plt.subplots(figsize=(6.4, 4))
    for name, by_T in times.items():
        Ts = sorted(by_T)
        ax.errorbar(Ts, [by_T[T]["median"] * 1e3 for T in Ts], marker="o", capsize=3,
                    label=MODEL_LABELS.get(name, name),
                    yerr=[[(by_T[T]["median"] - by_T[T]["min"]) * 1e3 for T in Ts],
                          [(by_T[T]["max"] - by_T[T]["median"]) * 1e3 for T in Ts]])
    ax.set(xscale="log", yscale="log", xlabel="context length T (positions recomputed)",
           ylabel="one uncached step, ms (median, min-max)",
           title="Time of one decode step without a cache, against context length")
    ax.set_xticks(sorted(set().union(*times.values())))      # plain numbers (16, 256, 2,048), not powers of ten
    ax.xaxis.set_major_formatter(FuncFormatter(plots.plain))
    ax.xaxis.set_minor_formatter(NullFormatter())
    plots.log_ticks(ax.yaxis)                                # 100, 200, 500 ms ...: two labels at least
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return finish(fig, path)


def plot_causal(result: dict, without_mask: dict | None = None, path=None):
    """Per-position logit change when the last token changes: with the causal mask, and without it."""
    import matplotlib.pyplot as plt

    panels = [("with the causal mask", result)] + ([("without the mask", without_mask)] if without_mask else [])
    fig, axes = plt.subplots(1, len(panels), figsize=(6.4 * len(panels) / 1.4, 3), squeeze=False)
    for ax, (label, r) in zip(axes[0], panels, strict=True):
        y = r["per_position"]
        ax.bar(range(len(y)), y, color=["tab:blue"] * (len(y) - 1) + ["tab:red"])
        moved = max(y[:-1])
        ax.set(xlabel="position (red: the changed last token)", ylabel="max |Δ logit| at that position",
               title=f"{label}: earlier positions\n" + (f"move by up to {moved:.3g}" if moved else "do not move"))
    return finish(fig, path)


def plot_bytes(rows: list, path=None):
    """KiB per cached position, as published and if every query head had its own K/V; values labelled."""
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    names = [r["model"] for r in rows]
    x = range(len(rows))
    mha = ax.bar([i - 0.2 for i in x], [r["mha_bytes"] / 1024 for r in rows], 0.4,
                 label="if every query head had its own K/V", color="tab:gray")
    pub = ax.bar([i + 0.2 for i in x], [r["bytes"] / 1024 for r in rows], 0.4,
                 label="as published (GQA where used)", color="tab:blue")
    for bars in (mha, pub):
        ax.bar_label(bars, fmt="%.4g", fontsize=8, padding=2)
    ax.set_xticks(list(x), names, rotation=15)
    ax.set(ylabel="KiB per cached position (16-bit)",
           title="KV cache bytes per position, by model (linear axis)")
    ax.margins(y=0.12)
    ax.legend(fontsize=8, loc="upper left")
    return finish(fig, path)


# ---- the whole chapter -----------------------------------------------------------------------------------

def load_seconds(name="smollm2", reps=3) -> dict:
    """Wall time of `load(name)` once the converted folder exists (the first call converts, untimed)."""
    return time_call(lambda: load(name).manifest, warmup=1, reps=reps)


def measure(quick_mode=None) -> dict:
    """Every measurement of chapter 1, as plain Python values (nothing written)."""
    s = settings(quick() if quick_mode is None else quick_mode)
    smol, gpt2 = load("smollm2"), load("gpt2-random")
    torch.manual_seed(0)
    return dict(
        settings=s,
        manifests={"smollm2": smol.manifest, "gpt2-random": gpt2.manifest},
        load=load_seconds("smollm2"),
        parity=parity(["tiny-gpt2", "tiny-llama", "gpt2-random", "smollm2"], s["parity_tokens"]),
        causal=causal_mask(smol),
        bidirectional=bidirectional_shift(smol),
        loop=naive_loop(smol, 17, s["new_tokens"]),
        times={m.name: step_times(m, s["contexts"][m.name], s["reps"], s["warmup"]) for m in (gpt2, smol)},
        prefill_decode={m.name: prefill_decode(m, s["prefill_prompts"], s["decode_tokens"]) for m in (gpt2, smol)},
        bytes=bytes_table(),
        dtype_bytes=dtype_bytes(smol.config),
        perplexity=perplexities(smol, s["ppl_passages"], s["ppl_tokens"]),
    )


def values(m: dict) -> dict:
    """The section's values, from every part of the measurements that m holds: a notebook sets each part's
    verdicts beside the book's as soon as it has measured that part (lab.book.verdicts); record() writes them all."""
    v = {}
    if "load" in m:
        v["load_seconds"] = value(m["load"]["median"], "s", max=m["load"]["max"], n=m["load"]["n"],
                                  note="load('smollm2') from the converted folder, manifest included")
    if "parity" in m:
        v["parity"] = {n: {"max_abs": value(r["max"], "logit"), "median_abs": value(r["median"], "logit"),
                           "identical": value(r["max"] == 0, None, note="every logit bit-identical"),
                           "logit_scale": value(r["scale"], "logit", note="largest |logit| of the reference")}
                       for n, r in m["parity"].items()}
    if "causal" in m:
        causal = m["causal"]
        v["causal"] = {"earlier_max": value(causal["earlier_max"], "logit"), "last": value(causal["last"], "logit"),
                       "earlier_identical": value(causal["earlier_max"] == 0, None,
                                                  note="every earlier position's logits bit-identical"),
                       "tokens": value(causal["tokens"], "tokens")}
    if "loop" in m:
        loop = m["loop"]
        v["loop"] = {"prompt_tokens": value(len(loop["prompt"]), "tokens"),
                     "new_tokens": value(len(loop["tokens"]), "tokens"),
                     "calls": value(loop["calls"], "calls"),
                     "positions_uncached": value(loop["positions"], "positions", note="counted by the backend"),
                     "formula_uncached": value(loop["formula_uncached"], "positions"),
                     "formula_cached": value(loop["formula_cached"], "positions"),
                     "ratio": value(loop["positions"] / loop["formula_cached"], "x"),
                     "count_matches_formula": value(loop["positions"] == loop["formula_uncached"], None)}
    if "times" in m:
        v["step_ms"] = {name: {f"T{T}": value(t["median"] * 1e3, "ms", min=t["min"] * 1e3, max=t["max"] * 1e3,
                                              iqr=t["iqr"] * 1e3, n=t["n"], threads=t["threads"])
                               for T, t in by_T.items()} for name, by_T in m["times"].items()}
    if "prefill_decode" in m:
        v["prefill_decode"] = {name: {f"P{P}": {"ttft_ms": value(r["ttft"] * 1e3, "ms"),
                                                "tpot_ms": value(r["tpot"] * 1e3, "ms"),
                                                "tpot_over_ttft": value(r["tpot"] / r["ttft"], "x")}
                                      for P, r in by_P.items()} for name, by_P in m["prefill_decode"].items()}
    if "bytes" in m:
        v["bytes_per_position"] = {r["model"].replace(" ", "_").replace(".", "_"): {
            "bytes": value(r["bytes"], "bytes"), "kib": value(r["bytes"] / 1024, "KiB"),
            "mha_kib": value(r["mha_bytes"] / 1024, "KiB"), "gqa_saving": value(r["saving"], "x"),
            "gib_at_4096": value(r["context_gib"], "GiB", note=f"one sequence of {r['context']} tokens, 16-bit")}
            for r in m["bytes"]}
    if "perplexity" in m:
        ppl = m["perplexity"]
        v["perplexity"] = {"heldout": value(ppl["heldout"], "perplexity"),
                           "shuffled": value(ppl["shuffled"], "perplexity"),
                           "passages": value(ppl["passages"], "passages"), "tokens": value(ppl["tokens"], "tokens")}
    if "dtype_bytes" in m:  # the book's model's cache in float32 and in bfloat16
        v["dtype_bytes"] = {dt: {
            "bytes": value(r["bytes"], "bytes"), "kib": value(r["bytes"] / 1024, "KiB"),
            "gib_at_4096": value(r["context_gib"], "GiB", note=f"one sequence of {r['context']} tokens of SmolLM2")}
            for dt, r in m["dtype_bytes"].items()}
    if "bidirectional" in m:  # the same experiment with the mask removed
        b = m["bidirectional"]
        v["bidirectional"] = {
            "earlier_max": value(b["earlier_max"], "logit", note="max over earlier positions of max |Δ logit|"),
            "earlier_median": value(b["earlier_median"], "logit"),
            "last": value(b["last"], "logit"), "logit_scale": value(b["scale"], "logit"),
            "top_changed": value(b["top_changed"], "positions", note="earlier positions whose argmax changed"),
            "earlier_positions": value(b["earlier"], "positions")}
    if "prefill_decode" in m:
        ratios = [r["tpot"] / r["ttft"] for by_P in m["prefill_decode"].values() for r in by_P.values()]
        v["prefill_decode"]["min_tpot_over_ttft"] = value(min(ratios), "x", note="over every model and prompt")
    for name, by_T in m.get("times", {}).items():  # how the cost grows: the longest context over the shortest
        Ts = sorted(by_T)
        v["step_ms"][name]["longest_T"] = value(Ts[-1], "tokens", note="the longest context timed")
        v["step_ms"][name]["longest_s"] = value(by_T[Ts[-1]]["median"], "s",
                                                note=f"one uncached step at T={Ts[-1]}, in seconds")
        v["step_ms"][name]["growth"] = value(by_T[Ts[-1]]["median"] / by_T[Ts[0]]["median"], "x",
                                             note=f"T={Ts[-1]} over T={Ts[0]}")
    return v


def record(m: dict, drawn: dict | None = None):
    """Write the measurements and figures of `measure()` to results.json (a temporary file in quick mode).

    drawn: figures a notebook already drew ({"step_time": fig, ...}); they are saved, not drawn again.
    """
    import matplotlib.pyplot as plt

    figs, drawn = figures_dir(), drawn or {}
    plotters = {"step_time": lambda: plot_step_times(m["times"]),
                "causal_mask": lambda: plot_causal(m["causal"], m.get("bidirectional")),
                "bytes_per_position": lambda: plot_bytes(m["bytes"])}
    for name, draw in plotters.items():
        fig = drawn.get(name) or draw()
        finish(fig, figs / f"ch01_{name}.png")
        if name not in drawn:
            plt.close(fig)  # drawn only to be saved: do not show it again in a notebook
    v = values(m)
    figures = {"step_time": {"path": figs / "ch01_step_time.png",
                             "caption": "Time of one uncached decode step against context length"},
               "causal_mask": {"path": figs / "ch01_causal_mask.png",
                               "caption": "Logit change per position when the last token changes, "
                                          "with and without the causal mask"},
               "bytes_per_position": {"path": figs / "ch01_bytes_per_position.png",
                                      "caption": "KV cache bytes per position for published model shapes"}}
    write_section(SECTION, v, provenance(manifest=m["manifests"]), figures=figures)
    return v
