"""Chapter 2, "Building the cache": the cache computes the same function as recomputation.

Every measurement compares the cached forward with an independent oracle: `forward` on the whole
prefix (recomputation), and the transformers model running with its own cache.
"""

import torch
from tqdm.auto import tqdm

from .. import data
from ..bench import time_rounds
from ..cache import ConcatCache, cache_bytes, make_cache
from ..models import forward, forward_cached, load
from ..results import figures_dir, provenance, quick, value, write_section
from .plots import finish

SECTION = "ch02"
DESIGNS = ("concat", "static")  # lab.cache.make_cache's names of the two contiguous caches


def settings(quick_mode: bool) -> dict:
    fixed = dict(crop_keep=40, crop_drop=9, bytes_tokens=100, bytes_batch=2)
    if quick_mode:
        return dict(steps={"smollm2": 10, "gpt2-random": 8}, prompt=17, chunk_tokens=64, fork_prefix=128,
                    decode_context=256, decode_rounds=5, **fixed)
    return dict(steps={"smollm2": 48, "gpt2-random": 32}, prompt=17, chunk_tokens=150, fork_prefix=512,
                decode_context=512, decode_rounds=15, **fixed)


@torch.inference_mode()
def step_agreement(model, design: str, prompt_len=17, steps=48) -> dict:
    """Greedy decode through a cache; at every step compare its logits with recomputation and with
    the transformers model stepping with its own cache. Returns per-step max |Δ| lists and the tokens."""
    from ..models.hf import to_transformers

    cfg, w = model.config, model.weights
    ids = torch.tensor([data.passages(model.tokenizer, prompt_len, 1)[0]]) if model.tokenizer.vocab_size > 256 \
        else torch.randint(0, cfg.vocab_size, (1, prompt_len), generator=torch.Generator().manual_seed(0))
    cache = make_cache(design, cfg, prompt_len + steps)
    hf = to_transformers(model)
    seq, out = ids, forward_cached(ids, w, cfg, cache)[:, -1]       # prefill: [1, V]
    hf_out = hf(ids, use_cache=True)
    past, hf_logits = hf_out.past_key_values, hf_out.logits[:, -1]
    vs_recompute, vs_library, tokens, ref_tokens = [], [], [], []
    for _ in range(steps):
        ref = forward(seq, w, cfg)[:, -1]                             # recomputation of the whole prefix
        vs_recompute.append((out - ref).abs().max().item())
        vs_library.append((out - hf_logits).abs().max().item())
        token = out.argmax(-1, keepdim=True)                          # [1, 1]
        tokens.append(int(token)), ref_tokens.append(int(ref.argmax()))
        seq = torch.cat([seq, token], dim=1)
        out = forward_cached(token, w, cfg, cache)[:, -1]
        hf_out = hf(token, past_key_values=past, use_cache=True)
        past, hf_logits = hf_out.past_key_values, hf_out.logits[:, -1]
    return dict(vs_recompute=vs_recompute, vs_library=vs_library, tokens=tokens, tokens_identical=tokens == ref_tokens,
                scale=ref.abs().max().item())


@torch.inference_mode()
def chunked_prefill(model, design: str, n_tokens=150, chunks=(1, 7, 64)) -> dict:
    """Prefill in chunks of c tokens against a one-shot prefill: max |Δ| over all positions' logits."""
    cfg, w = model.config, model.weights
    ids = torch.tensor([data.passages(model.tokenizer, n_tokens, 1, seed=3)[0]])
    one_shot = forward_cached(ids, w, cfg, make_cache(design, cfg, n_tokens))
    out = {}
    for c in chunks:
        cache = make_cache(design, cfg, n_tokens)
        pieces = [forward_cached(ids[:, s:s + c], w, cfg, cache) for s in range(0, n_tokens, c)]
        out[c] = (torch.cat(pieces, dim=1) - one_shot).abs().max().item()
    return out


@torch.inference_mode()
def fork_check(model, design: str, prefix=512) -> dict:
    """Fork a cache after a long prefix and continue parent and child with different tokens."""
    cfg, w = model.config, model.weights
    ids = torch.tensor([data.passages(model.tokenizer, prefix, 1, seed=4)[0]])
    parent = make_cache(design, cfg, prefix + 1)
    forward_cached(ids, w, cfg, parent)
    snapshot = [t.clone() for t in _tensors(parent)]
    child = parent.fork()
    shared = _shared_bytes(parent, child)  # right after the fork, before either writes
    a, b = torch.tensor([[11]]), torch.tensor([[4000]])
    child_out = forward_cached(b, w, cfg, child)[:, -1]
    after = _tensors(parent)
    untouched = parent.length == prefix and all(torch.equal(x, y) for x, y in zip(after, snapshot, strict=True))
    parent_out = forward_cached(a, w, cfg, parent)[:, -1]
    ref_a, ref_b = forward(torch.cat([ids, a], 1), w, cfg)[:, -1], forward(torch.cat([ids, b], 1), w, cfg)[:, -1]
    return dict(parent_vs_recompute=(parent_out - ref_a).abs().max().item(),
                child_vs_recompute=(child_out - ref_b).abs().max().item(), parent_untouched=untouched,
                shared_bytes=shared, parent_bytes=parent.nbytes())


def _tensors(cache):
    """The stored keys and values: a ConcatCache's per layer, `[B, H_kv, length, D]` each, or views
    `[L, B, H_kv, length, D]` of a StaticCache's two buffers."""
    if isinstance(cache, ConcatCache):
        return [t[:, :, :cache.length] for t in cache.keys + cache.values]
    return [cache.k_buf[:, :, :, :cache.length], cache.v_buf[:, :, :, :cache.length]]


def _shared_bytes(a, b) -> int:
    """Bytes of storage the two caches share (a fork of a ConcatCache shares everything until it grows)."""
    ptrs = lambda c: {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(c)}
    pa, pb = ptrs(a), ptrs(b)
    return sum(n for p, n in pa.items() if p in pb)


@torch.inference_mode()
def crop_check(model, design: str, keep=40, extra=9, cont=5) -> float:
    """Crop after `extra` unwanted positions and continue; compare with a cache that never held them."""
    cfg, w = model.config, model.weights
    g = torch.Generator().manual_seed(5)
    ids = torch.randint(0, cfg.vocab_size, (1, keep + extra), generator=g)
    more = torch.randint(0, cfg.vocab_size, (1, cont), generator=g)
    cropped, clean = (make_cache(design, cfg, keep + extra + cont) for _ in range(2))
    forward_cached(ids, w, cfg, cropped)
    cropped.crop(keep)
    forward_cached(ids[:, :keep], w, cfg, clean)
    return (forward_cached(more, w, cfg, cropped) - forward_cached(more, w, cfg, clean)).abs().max().item()


def bytes_check(model, design: str, tokens=100, batch=2) -> dict:
    cfg = model.config
    cache = make_cache(design, cfg, tokens, batch)
    with torch.inference_mode():
        forward_cached(torch.zeros(batch, tokens, dtype=torch.long), model.weights, cfg, cache)
    held = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in _tensors(cache)}.values())
    return dict(nbytes=cache.nbytes(), formula=cache_bytes(cfg, tokens, batch), held=held)


def decode_step_times(model, context=512, rounds=15) -> dict:
    """Median and spread of one decode step after `context` cached positions, per design, timed in turns
    (each cache is cropped back to `context` before every step, untimed)."""
    cfg, w = model.config, model.weights
    ids = torch.tensor([data.passages(model.tokenizer, context + 1, 1, seed=6)[0]])
    caches = {d: make_cache(d, cfg, context + 1) for d in DESIGNS}
    with torch.inference_mode():
        for cache in caches.values():
            forward_cached(ids[:, :context], w, cfg, cache)
    token = ids[:, context:]                                                         # [1, 1]
    steps = {d: (lambda c=c: forward_cached(token, w, cfg, c)) for d, c in caches.items()}
    crop_all = lambda: [c.crop(context) for c in caches.values()]
    return time_rounds(steps, rounds=rounds, setup=crop_all)


def _series(runs: dict, oracle: str):
    """(model, label, values) per curve; two designs whose curves are identical share one curve."""
    out = []
    for model in dict.fromkeys(m for m, _ in runs):
        by_design = {d: r[oracle] for (m, d), r in runs.items() if m == model}
        values = list(by_design.values())
        if all(v == values[0] for v in values):
            out.append((model, " = ".join(by_design), values[0]))
        else:
            out += [(model, d, v) for d, v in by_design.items()]
    return out


def plot_agreement(runs: dict, path=None):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 3.8))
    for oracle, style, name in (("vs_recompute", "-", "vs recomputation"),
                                ("vs_library", "--", "vs transformers' cache")):
        for model, designs, values in _series(runs, oracle):
            ax.plot(values, style, marker="." if style == "-" else None, label=f"{model}, {designs}: {name}")
    ax.set_yscale("symlog", linthresh=1e-7)
    ax.yaxis.set_major_locator(plt.matplotlib.ticker.SymmetricalLogLocator(base=10, linthresh=1e-7))
    ax.set(ylim=(0, None), xlabel="decode step", ylabel="largest |difference| of a logit",
           title="Cached logits minus each oracle's, at every decode step")
    ax.legend(fontsize=8)
    return finish(fig, path)


def measure(quick_mode=None) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    smol, gpt2 = load("smollm2"), load("gpt2-random")
    runs = {(m.name, d): step_agreement(m, d, s["prompt"], s["steps"][m.name])
            for m in tqdm((smol, gpt2), desc="step agreement") for d in DESIGNS}
    return dict(settings=s, manifests={"smollm2": smol.manifest, "gpt2-random": gpt2.manifest}, runs=runs,
                chunked={d: chunked_prefill(smol, d, s["chunk_tokens"]) for d in DESIGNS},
                fork={d: fork_check(smol, d, s["fork_prefix"]) for d in DESIGNS},
                crop={d: crop_check(smol, d, s["crop_keep"], s["crop_drop"]) for d in DESIGNS},
                bytes={d: bytes_check(smol, d, s["bytes_tokens"], s["bytes_batch"]) for d in DESIGNS},
                decode=decode_step_times(smol, s["decode_context"], s["decode_rounds"]),
                bf16=step_agreement(smol.to(dtype=torch.bfloat16), "static", s["prompt"], s["steps"]["smollm2"]))


def values(m: dict) -> dict:
    """The section's values, from every part of the measurements that m holds: a notebook sets each part's
    verdicts beside the book's as soon as it has measured that part (lab.book.verdicts); record() writes them all."""
    import statistics

    s, v = m["settings"], {}
    if "runs" in m:
        v["agreement"] = {}
        for (model, design), r in m["runs"].items():
            v["agreement"].setdefault(model, {})[design] = {
                "vs_recompute_max": value(max(r["vs_recompute"]), "logit"),
                "vs_recompute_median": value(statistics.median(r["vs_recompute"]), "logit"),
                "vs_library_max": value(max(r["vs_library"]), "logit"),
                "vs_library_median": value(statistics.median(r["vs_library"]), "logit"),
                "logit_scale": value(r["scale"], "logit"),
                "steps": value(len(r["tokens"]), "steps"),
                "tokens_identical": value(r["tokens_identical"], None)}
    if "chunked" in m:
        v["chunked_prefill"] = {**{d: {f"chunk{c}": value(x, "logit") for c, x in by_c.items()}
                                   for d, by_c in m["chunked"].items()},
                                "tokens": value(s["chunk_tokens"], "tokens")}
    if "fork" in m:
        v["fork"] = {d: {"parent_vs_recompute": value(r["parent_vs_recompute"], "logit"),
                         "child_vs_recompute": value(r["child_vs_recompute"], "logit"),
                         "parent_untouched": value(r["parent_untouched"], None),
                         "shared_mib": value(r["shared_bytes"] / 2**20, "MiB", note="storage parent and child share"),
                         "parent_mib": value(r["parent_bytes"] / 2**20, "MiB"),
                         "prefix": value(s["fork_prefix"], "tokens")} for d, r in m["fork"].items()}
    if "crop" in m:
        v["crop"] = {d: value(x, "logit") for d, x in m["crop"].items()}
        v["crop_positions"] = {"kept": value(s["crop_keep"], "positions"),
                               "dropped": value(s["crop_drop"], "positions")}
    if "bytes" in m:
        v["bytes"] = {d: {k: value(x, "bytes") for k, x in r.items()} for d, r in m["bytes"].items()}
        v["bytes_positions"] = {"tokens": value(s["bytes_tokens"], "positions"),
                                "batch": value(s["bytes_batch"], "sequences")}
    if "decode" in m:
        t = m["decode"]
        v["decode_ms"] = {
            **{d: value(r["median"] * 1e3, "ms", iqr=r["iqr"] * 1e3, n=r["n"], threads=r["threads"],
                        note=f"median of {r['n']} decode steps in turns, SmolLM2") for d, r in t.items()},
            "context": value(s["decode_context"], "tokens"),
            "rounds": value(t["static"]["n"], "steps"),
            "static_over_concat": value(t["static"]["median"] / t["concat"]["median"], "x",
                                        note="median static step / median concat step")}
    if "bf16" in m:  # the same agreement, model and cache in bfloat16 (transformers' model too)
        r = m["bf16"]
        v["agreement_bf16"] = {
            "vs_recompute_max": value(max(r["vs_recompute"]), "logit"),
            "vs_library_max": value(max(r["vs_library"]), "logit"),
            "logit_scale": value(r["scale"], "logit"), "steps": value(len(r["tokens"]), "steps"),
            "tokens_identical": value(r["tokens_identical"], None),
            "recompute_steps": value(max(r["vs_recompute"]) / (2 ** -8 * r["scale"]), "bfloat16 steps",
                                     note="largest difference in steps of 2^-8 of the largest logit")}
    if "runs" in m:
        v["all_tokens_identical"] = value(all(r["tokens_identical"] for r in m["runs"].values()), None)
    return v


def record(m: dict, drawn: dict | None = None) -> dict:
    """Write section ch02. `drawn` holds figures a notebook already drew ({"agreement": fig}): they are
    saved as they are, not drawn a second time."""
    figs = figures_dir()
    if drawn and "agreement" in drawn:
        drawn["agreement"].savefig(figs / "ch02_agreement.png", dpi=120)
    else:
        plot_agreement(m["runs"], figs / "ch02_agreement.png")
    v = values(m)
    figures = {"agreement": {"path": figs / "ch02_agreement.png",
                             "caption": "Largest logit difference of the cached forward from each oracle, "
                                        "per decode step"}}
    write_section(SECTION, v, provenance(manifest=m["manifests"]), figures=figures)
    return v
