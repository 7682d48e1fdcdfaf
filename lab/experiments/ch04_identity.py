"""Chapter 4, "State identity": what wrong reuse of a cache does, and a backend that refuses it.

Each hazard builds a cache the wrong way, takes the next-token scores from it, and compares them with a
correct computation (recomputation without a cache). Then the same situation is put to a
CachedBackend, which must refuse the reuse (a miss) or handle it, and still return the correct scores.
"""

import statistics

import torch
from tqdm.auto import tqdm

from .. import data
from ..bench import time_rounds
from ..cache import StaticCache
from ..engine import CachedBackend, RecomputeBackend, generate
from ..metrics import kl_divergence
from ..models import forward, forward_cached, llama, load
from ..models.attention import cached_attention
from ..models.load import Model
from ..results import figures_dir, provenance, quick, value, write_section
from .plots import finish

SECTION = "ch04"
SYSTEM_A = "You are a helpful assistant who answers briefly."
SYSTEM_B = "You are a pirate. Answer every question in pirate speech."
HAZARDS = {
    "other_prompt": "a cache from another prompt",
    "stale_offset": "the new token computed at position 0 (a stale position offset)",
    "static_not_reset": "a static buffer not reset between requests",
    "rollback_not_cropped": "rejected draft tokens left in the cache",
    "adapter_weights": "cache built with one layer's MLP output scaled by 1.02",
    "bf16_cache": "cache built in bfloat16, continued in float32",
    "system_prompt": "another system prompt under the chat template",
}


# Which hazards change the state's identity (and so must be refused by the key check). The stale offset
# does not: it is a wrong call on the right state, which the backend never makes.
IDENTITY_CHANGES = {"other_prompt": "token ids", "stale_offset": None, "static_not_reset": "token ids",
                    "rollback_not_cropped": "token ids", "adapter_weights": "model manifest",
                    "bf16_cache": "compute and cache dtype", "system_prompt": "token ids"}


def settings(quick_mode: bool) -> dict:
    return dict(trials=5 if quick_mode else 20, prefix=24, requests=5, new_tokens=32, prompt=17)


def static_for(model, n=128):
    return lambda: StaticCache(model.config, n, dtype=model.dtype)


def prefill(model, ids, cache=None):
    cache = cache or StaticCache(model.config, 128, dtype=model.dtype)
    forward_cached(torch.tensor([ids]), model.weights, model.config, cache)
    return cache


def step(model, token, cache):
    """Next-token scores `[V]` after feeding one token through the cache."""
    return forward_cached(torch.tensor([[token]]), model.weights, model.config, cache)[0, -1].float()


def step_at_wrong_position(model, token, cache, position=0):
    """A deliberately broken call: the new token is rotated as if it sat at `position` (RoPE models)."""
    cfg, w = model.config, model.weights
    x = llama.embed(torch.tensor([[token]]), w)
    rope_cs = llama.rope_tables(torch.tensor([position]), cfg.head_dim, cfg.rope_theta, x.dtype)
    attend = cached_attention(cache, torch.tensor([cache.length]))
    for i in range(cfg.n_layers):
        x = llama.block(x, w, i, cfg, attend, rope_cs)
    cache.advance(1)
    return llama.head(x, w, cfg)[0, -1].float()


def scaled_mlp_model(model, layer=None, factor=1.02):
    """A copy of the model whose layer's MLP output is scaled by `factor` (as an adapter swap might)."""
    layer = model.config.n_layers // 2 if layer is None else layer
    w = dict(model.weights)
    name = f"model.layers.{layer}.mlp.down_proj.weight"
    w[name] = w[name] * factor
    return Model(model.name + f"-mlp{layer}x{factor}", model.config, w, model.tokenizer)  # a manifest of its own


def chat_ids(model, system, user):
    text = model.tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                {"role": "user", "content": user}])
    return model.tokenizer.encode(text)


@torch.inference_mode()
def trial(hazard, model, prefix, nxt, other, variants):
    """(wrong scores, right scores, refused, backend correct) for one hazard on one trial."""
    right = forward(torch.tensor([prefix + [nxt]]), model.weights, model.config)[0, -1].float()
    if hazard == "other_prompt":
        wrong = step(model, nxt, prefill(model, other))
        state, request, swap = other, prefix + [nxt], None
    elif hazard == "stale_offset":
        wrong = step_at_wrong_position(model, nxt, prefill(model, prefix), 0)
        state, request, swap = prefix, prefix + [nxt], None
    elif hazard == "static_not_reset":
        cache = prefill(model, other)                          # request A
        forward_cached(torch.tensor([prefix]), model.weights, model.config, cache)  # B, no reset()
        wrong = step(model, nxt, cache)
        state, request, swap = other, prefix + [nxt], None
    elif hazard == "rollback_not_cropped":
        drafts = other[:4]                                     # 4 rejected draft tokens stay in the cache
        wrong = step(model, nxt, prefill(model, prefix + drafts))
        state, request, swap = prefix + drafts, prefix + [nxt], None
    elif hazard == "adapter_weights":
        wrong = step(model, nxt, prefill(variants["scaled"], prefix))
        state, request, swap = prefix, prefix + [nxt], "scaled"
    elif hazard == "bf16_cache":
        bf16 = variants["bf16"]
        half = prefill(bf16, prefix)
        cache = StaticCache(model.config, 128)                 # the same values, converted to float32
        cache.k_buf.copy_(half.k_buf.float()), cache.v_buf.copy_(half.v_buf.float())
        cache.length = half.length
        wrong = step(model, nxt, cache)
        state, request, swap = prefix, prefix + [nxt], "bf16"
    elif hazard == "system_prompt":
        user = model.tokenizer.decode(prefix)
        ids_a, ids_b = chat_ids(model, SYSTEM_A, user), chat_ids(model, SYSTEM_B, user)
        right = forward(torch.tensor([ids_b + [nxt]]), model.weights, model.config)[0, -1].float()
        wrong = step(model, nxt, prefill(model, ids_a, StaticCache(model.config, len(ids_a) + 1)))
        state, request, swap = ids_a, ids_b + [nxt], None
    else:
        raise ValueError(f"unknown hazard {hazard!r}; hazards: {', '.join(HAZARDS)}")

    # the same situation, put to a CachedBackend: it holds `state`, then is asked for `request`
    first = variants[swap] if swap else model
    backend = CachedBackend(first, static_for(first, max(len(state), len(request)) + 8))
    backend.next_logits(state)
    if swap:  # the weights or the precision change under the backend, as an adapter swap would
        backend.model, backend.cache_factory = model, static_for(model, len(request) + 8)
    misses = backend.misses
    served = backend.next_logits(request).float()
    refused = backend.misses > misses
    correct = (served - right).abs().max().item() <= 1e-4 * right.abs().max().item()
    return wrong, right, refused, correct


def hazards(model, trials=20, prefix_len=24, progress=True) -> dict:
    """Every hazard, `trials` times, on held-out Shakespeare: prefix of `prefix_len` tokens, then one token."""
    passages = data.passages(model.tokenizer, prefix_len + 1, count=trials + 1, seed=7)
    variants = {"scaled": scaled_mlp_model(model), "bf16": model.to(dtype=torch.bfloat16)}
    out = {}
    for hazard in tqdm(HAZARDS, desc="hazards", disable=not progress):
        deltas, agree, kls, refused, correct, per_trial_max = [], 0, [], 0, 0, []
        for i in range(trials):
            p, other = passages[i], passages[i + 1][:prefix_len]
            wrong, right, ref, ok = trial(hazard, model, p[:prefix_len], p[prefix_len], other, variants)
            d = (wrong - right).abs()
            deltas.append(d.median().item()), per_trial_max.append(d.max().item())
            agree += int(wrong.argmax() == right.argmax())
            kls.append(kl_divergence(right, wrong).item())
            refused, correct = refused + ref, correct + ok
        out[hazard] = dict(delta_median=statistics.median(deltas), delta_max=max(per_trial_max),
                           argmax_agree=agree, kl_median=statistics.median(kls), kl_max=max(kls),
                           refused=refused, backend_correct=correct, trials=trials)
    return out


def refusal_cost(model, prefix_len=24, reps=5) -> dict:
    """Time of a refused call (the backend discards its cache and recomputes) against a plain recomputation."""
    p = data.passages(model.tokenizer, 2 * prefix_len + 1, count=1, seed=9)[0]
    request = p[prefix_len:]
    recompute = RecomputeBackend(model)
    backend = CachedBackend(model, static_for(model))
    r = time_rounds({"refused": lambda: backend.next_logits(request),     # refused: recomputes
                     "recompute": lambda: recompute.next_logits(request)},
                    warmup=1, rounds=reps,
                    setup=lambda: backend.next_logits(p[:prefix_len]))  # untimed: holds another prompt's state
    return dict(refused=r["refused"]["median"], recompute=r["recompute"]["median"])


def engine_check(model, requests=5, new_tokens=32, prompt=17) -> dict:
    """Several greedy requests through one CachedBackend: hits, misses, positions, same tokens as recompute."""
    prompts = data.passages(model.tokenizer, prompt, count=requests, seed=11)
    backend, recompute = CachedBackend(model, static_for(model, prompt + new_tokens)), RecomputeBackend(model)
    same, per_request = True, []
    for p in prompts:
        before = backend.positions
        cached = generate(backend, p, new_tokens).tokens
        per_request.append(backend.positions - before)
        same &= cached == generate(recompute, p, new_tokens).tokens
    return dict(calls=backend.calls, hits=backend.hits, misses=backend.misses, positions=per_request,
                tokens_identical=same, recompute_positions=recompute.positions // requests)


def plot_hazards(h: dict, path=None):
    import matplotlib.pyplot as plt

    names = list(h)
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.8))
    a.barh(names, [h[n]["delta_median"] for n in names], color="tab:red", label="median |Δ logit|")
    a.barh(names, [h[n]["delta_max"] for n in names], color="tab:red", alpha=0.3, label="max |Δ logit|")
    a.set(xscale="log", xlabel="|Δ logit| against a correct computation", title="How far the scores move")
    a.legend(fontsize=7)
    b.barh(names, [h[n]["argmax_agree"] / h[n]["trials"] for n in names], color="tab:blue")
    b.set(xlim=(0, 1), xlabel="fraction of trials with the same top token", title="Does the answer change?")
    b.set_yticks([])
    return finish(fig, path)


def measure(quick_mode=None) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    smol = load("smollm2")
    return dict(settings=s, manifest=smol.manifest, hazards=hazards(smol, s["trials"], s["prefix"]),
                refusal=refusal_cost(smol, s["prefix"]),
                engine=engine_check(smol, s["requests"], s["new_tokens"], s["prompt"]))


def record(m: dict) -> dict:
    figs = figures_dir()
    plot_hazards(m["hazards"], figs / "ch04_hazards.png")
    values = {"hazards": {}, "engine": {}, "refusal": {}}
    for name, r in m["hazards"].items():
        values["hazards"][name] = {
            "delta_median": value(r["delta_median"], "logit"), "delta_max": value(r["delta_max"], "logit"),
            "argmax_agree": value(r["argmax_agree"], None, note=f"trials of {r['trials']} with the same top token"),
            "kl_median": value(r["kl_median"], "nats"), "kl_max": value(r["kl_max"], "nats"),
            "refused": value(r["refused"], None, note=f"trials of {r['trials']} the CachedBackend refused"),
            "backend_correct": value(r["backend_correct"], None, note="trials whose backend scores were correct"),
            "trials": value(r["trials"], "trials"), "what": value(HAZARDS[name], None),
            "identity_change": value(IDENTITY_CHANGES[name] or "none", None)}
    e = m["engine"]
    values["engine"] = {"calls": value(e["calls"], "calls"), "hits": value(e["hits"], "calls"),
                        "misses": value(e["misses"], "calls"),
                        "positions_per_request": value(e["positions"], "positions"),
                        "recompute_positions_per_request": value(e["recompute_positions"], "positions"),
                        "tokens_identical": value(e["tokens_identical"], None)}
    r = m["refusal"]
    values["refusal"] = {"refused_ms": value(r["refused"] * 1e3, "ms"),
                         "recompute_ms": value(r["recompute"] * 1e3, "ms"),
                         "ratio": value(r["refused"] / r["recompute"], "x")}
    figures = {"hazards": {"path": figs / "ch04_hazards.png", "caption": "Wrong reuse, hazard by hazard"}}
    write_section(SECTION, values, provenance(manifest=m["manifest"]), figures=figures)
    return values


def run(quick_mode=None) -> dict:
    m = measure(quick_mode)
    record(m)
    return m
