"""The lab's EvictingCache against NVIDIA's kvpress on kvpress's own protocol (chapter 7): a context goes
into the cache in one prefill step and is compressed once, at its end, to `ratio` of its positions
removed; a continuation is then scored on that cache. kvpress runs in its own environment
(`compare_kvpress`); the lab repeats each press with the EvictingCache policy and settings that match it.
"""

import torch

from ..cache import EvictingCache
from ..metrics import compare, reference
from ..models import forward_cached
from ..models.load import smollm2_folder
from ..results import not_run, value
from . import compare_kvpress


@torch.inference_mode()
def pressed(model, context, continuation, cache):
    """Logits for every token of `continuation` `[n, V]` on `cache` after it took `context` in one prefill
    step (an EvictingCache evicts at its end), and the positions the cache kept then (or None)."""
    w, cfg = model.weights, model.config
    first = forward_cached(torch.tensor([context]), w, cfg, cache, last_only=True)[0, -1:]
    kept = [k.clone() for k in cache.kept_positions] if hasattr(cache, "kept_positions") else None
    rest = forward_cached(torch.tensor([continuation[:-1]]), w, cfg, cache)[0]
    return torch.cat([first, rest]), kept


def kept_overlap(lab_kept, peer_kept) -> float:
    """Mean over layers and KV heads of |lab ∩ peer| / |lab ∪ peer| of the kept context positions."""
    shares = []
    for lab_layer, peer_layer in zip(lab_kept, peer_kept, strict=True):
        for a, b in zip(lab_layer[0].tolist(), peer_layer, strict=True):
            a, b = set(a), set(b)
            shares.append(len(a & b) / len(a | b))
    return sum(shares) / len(shares)


# Each kvpress press and the lab's EvictingCache (policy, settings) that keeps the same positions: four sinks
# and a recent window; SnapKV's observation window of 64 queries and pooling width 5.
LAB_PRESS = {"streaming_llm": ("sinks", dict(sinks=4)), "snapkv": ("snapkv", dict(observation=64, pool=5))}
PEER_PRESS = {"streaming_llm": dict(n_sink=4), "snapkv": dict(window_size=64, kernel_size=5)}


def against_kvpress(model, contexts, continuations, ratio, rerotate=False, presses=("streaming_llm", "snapkv")):
    """Each press at `ratio` (the fraction of the context removed), kvpress's and the lab's EvictingCache
    with the same settings and budget, on the same (context, continuation) pairs: loss and KL per pair,
    the difference and its standard error over the pairs, and how many kept positions the two share."""
    out = {}
    for press in presses:
        peer = compare_kvpress.run(smollm2_folder(), press, ratio, contexts, continuations,
                                   threads=torch.get_num_threads(), rerotate=rerotate, **PEER_PRESS[press])
        policy, kw = LAB_PRESS[press]
        lab, overlap = [], []
        for c, x, p in zip(contexts, continuations, peer["results"], strict=True):
            budget = int(len(c) * (1 - ratio))                     # kvpress's compute_n_kept
            logits, kept = pressed(model, c, x, EvictingCache(model.config, budget, policy, rerotate=rerotate, **kw))
            ref = reference(model, [c + x[:-1]], len(c))[0]
            r = compare(logits[None], ref[None], torch.tensor([x]))
            lab.append(r)
            overlap.append(kept_overlap(kept, p["kept"]) if p["kept"] else None)
        diff = [a["loss"] - p["loss"] for a, p in zip(lab, peer["results"], strict=True)]
        mean = sum(diff) / len(diff)
        se = (sum((d - mean) ** 2 for d in diff) / max(1, len(diff) - 1) / len(diff)) ** 0.5
        spread = [p["loss"] for p in peer["results"]]
        out[press] = dict(lab_loss=[r["loss"] for r in lab], lab_kl=[r["kl"] for r in lab],
                          peer_loss=spread, peer_kl=[p["kl"] for p in peer["results"]],
                          ref_loss=[r["ref_loss"] for r in lab], diff=mean, diff_se=se, overlap=overlap,
                          budget=[int(len(c) * (1 - ratio)) for c in contexts],
                          peer_cache_length=[p["cache_length"] for p in peer["results"]])
    out["versions"] = dict(kvpress=peer["kvpress"], transformers=peer["transformers"], torch=peer["torch"])
    return out


def values(kv) -> dict:
    """results.json entries for `against_kvpress` at each ratio (and "rerotate"), or NOT_RUN with the
    reason `kv` gives as a string: mean losses and KL over the pairs, the difference and whether it is
    within noise, and the kept positions the lab and kvpress share."""
    if isinstance(kv, str):
        return {"sinks_diff": not_run(kv), "snapkv_diff": not_run(kv)}
    versions = next(iter(kv.values()))["versions"]
    out = {"versions": value(", ".join(f"{k} {x}" for k, x in versions.items()), None)}
    for key, r in kv.items():
        label = "rerotate" if key == "rerotate" else f"ratio_{round(100 * key)}"
        out[label] = {}
        for press, x in ((p, x) for p, x in r.items() if p != "versions"):
            mean = lambda xs: sum(xs) / len(xs)                        # noqa: E731
            overlap = [o for o in x["overlap"] if o is not None]
            out[label][press] = {
                "lab_loss": value(mean(x["lab_loss"]), "nats", pairs=len(x["lab_loss"])),
                "peer_loss": value(mean(x["peer_loss"]), "nats"), "ref_loss": value(mean(x["ref_loss"]), "nats"),
                "diff": value(x["diff"], "nats", se=x["diff_se"]),
                "within_noise": value(abs(x["diff"]) <= 2 * x["diff_se"] + 1e-4, None,
                                      note="|lab - kvpress| <= 2 standard errors over pairs (+1e-4)"),
                "lab_kl": value(mean(x["lab_kl"]), "nats"), "peer_kl": value(mean(x["peer_kl"]), "nats"),
                "overlap": value(100 * mean(overlap), "%", note="kept positions shared (Jaccard)")
                if overlap else not_run("no kept positions to compare")}
    return out
