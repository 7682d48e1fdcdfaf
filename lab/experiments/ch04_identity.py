"""Chapter 4, "State identity": what wrong reuse of a cache does, and a backend that refuses it.

Each hazard builds a cache the wrong way, takes the next-token scores from it, and compares them with a
correct computation (recomputation without a cache). Then the same situation is put to a
CachedBackend, which must refuse the reuse (a miss) or handle it, and still return the correct scores.
"""

import statistics

import torch
from tqdm.auto import tqdm

from .. import data
from ..bench import time_call, time_rounds, time_steps
from ..cache import StaticCache
from ..engine import CachedBackend, RecomputeBackend, generate, identity_of, key_for, prefix_key
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
    return dict(trials=5 if quick_mode else 20, prefix=24, prompt=17,
                requests=3 if quick_mode else 5, new_tokens=16 if quick_mode else 32,
                key_lengths=(16, 512, 4096),          # ids hashed per key: a short prompt to a long context
                key_reps=50 if quick_mode else 400,   # key timings are microseconds: many repetitions
                step_reps=3 if quick_mode else 9)     # a decode step is tens of milliseconds


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


def key_cost(model, lengths=(16, 512, 4096), reps=400, step_reps=9) -> dict:
    """What the identity check costs per call, beside one cached decode step at the same context.

    For each length T: `prefix_key` over T ids (identity and ids, from scratch); the CachedBackend's own
    check on a call that extends a state of T - 1 positions (`reusable_prefix`, then the key of the new
    state, as `next_logits` does); and one decode step of the model through a StaticCache holding T - 1
    positions. The check reads only the ids and the identity, never the tensors, so the backend's state
    is set directly rather than prefilled; a step's time does not depend on the values in the cache.
    """
    ident = identity_of(model, StaticCache(model.config, 1))
    out = {}
    for T in lengths:
        ids = torch.randint(0, model.config.vocab_size, (T,), generator=torch.Generator().manual_seed(T)).tolist()
        key = time_call(lambda ids=ids: prefix_key(ident.manifest, ids, tokenizer=ident.tokenizer,
                                                   cache_kind=ident.cache_kind, rope_theta=ident.rope_theta,
                                                   max_positions=ident.max_positions), warmup=5, reps=reps)
        backend = CachedBackend(model, static_for(model, 1))
        backend.cache = StaticCache(model.config, 1)       # the state of ids[:-1], as the bookkeeping sees it
        backend.cached_ids, backend.cached_identity = ids[:-1], ident
        backend.cached_key = key_for(ident, ids[:-1])

        def check(backend=backend, ids=ids):                # what next_logits adds to a hit, besides the step
            n = backend.reusable_prefix(ids, None)
            key_for(identity_of(model, backend.cache, None), ids)
            return n

        assert check() == T - 1, "the check must find the state of ids[:-1]"
        chk = time_call(check, warmup=5, reps=reps)
        cache = StaticCache(model.config, T, dtype=model.dtype)
        cache.length = T - 1
        token = torch.tensor([[ids[-1]]])
        step = time_steps(lambda cache=cache, T=T: cache.crop(T - 1),
                          lambda cache=cache, token=token: forward_cached(token, model.weights, model.config,
                                                                          cache, last_only=True),
                          warmup=1, reps=step_reps)
        out[T] = dict(key=key, check=chk, step=step)
    return out


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


LABELS = {"other_prompt": "another prompt", "stale_offset": "stale offset", "static_not_reset": "not reset",
          "rollback_not_cropped": "not cropped", "adapter_weights": "MLP × 1.02",
          "bf16_cache": "bfloat16 cache", "system_prompt": "system prompt"}


def plot_hazards(h: dict, path=None):
    """Left: how far the wrong scores are from the right ones (points on a log axis: median and maximum).
    Right: the fraction of trials whose top token is still the right one (bars on a linear axis)."""
    from . import plots

    names = list(h)[::-1]                      # first hazard on top
    y = range(len(names))
    fig, (a, b) = plots.figure(ncols=2, sharey=True)
    med, top = [h[n]["delta_median"] for n in names], [h[n]["delta_max"] for n in names]
    a.hlines(y, med, top, color="tab:red", alpha=0.4, lw=2)
    a.plot(med, y, "o", color="tab:red", label="median")
    a.plot(top, y, "|", color="tab:red", ms=10, mew=2, label="maximum")
    a.set(xscale="log", xlabel="|Δ logit| (log scale)", title="Logit error of the wrong reuse")
    a.set_yticks(list(y), [LABELS.get(n, n) for n in names])
    a.legend(loc="upper left")
    frac = [h[n]["argmax_agree"] / h[n]["trials"] for n in names]
    b.barh(list(y), frac, color="tab:blue")
    for i, n in enumerate(names):                # the count beside the bar, or inside it when it is long
        inside = frac[i] > 0.8
        b.text(frac[i] - 0.02 if inside else frac[i] + 0.02, i, f"{h[n]['argmax_agree']}/{h[n]['trials']}",
               va="center", ha="right" if inside else "left", color="white" if inside else "black")
    b.set(xlim=(0, 1), xlabel="fraction of trials", title="Top token still right")
    return finish(fig, path)


def measure(quick_mode=None) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    smol = load("smollm2")
    return dict(settings=s, manifest=smol.manifest, hazards=hazards(smol, s["trials"], s["prefix"]),
                refusal=refusal_cost(smol, s["prefix"]),
                key_cost=key_cost(smol, s["key_lengths"], s["key_reps"], s["step_reps"]),
                engine=engine_check(smol, s["requests"], s["new_tokens"], s["prompt"]))


def record(m: dict, hazards_figure=None) -> dict:
    """Write section ch04 and its figure. A notebook passes the figure it already drew, which is saved
    as it is rather than drawn a second time."""
    import matplotlib.pyplot as plt

    figs = figures_dir()
    if hazards_figure is None:
        plt.close(plot_hazards(m["hazards"], figs / "ch04_hazards.png"))
    else:
        finish(hazards_figure, figs / "ch04_hazards.png")
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
    values["hazard_prefix"] = value(m["settings"]["prefix"], "tokens", note="held-out tokens before the next one")
    values["engine"] = {"requests": value(m["settings"]["requests"], "requests"),
                        "new_tokens": value(m["settings"]["new_tokens"], "tokens", note="greedy tokens a request"),
                        "calls": value(e["calls"], "calls"), "hits": value(e["hits"], "calls"),
                        "misses": value(e["misses"], "calls"),
                        "positions_per_request": value(e["positions"], "positions"),
                        "positions_per_request_median": value(statistics.median(e["positions"]), "positions"),
                        "recompute_positions_per_request": value(e["recompute_positions"], "positions"),
                        "tokens_identical": value(e["tokens_identical"], None)}
    r = m["refusal"]
    values["refusal"] = {"refused_ms": value(r["refused"] * 1e3, "ms"),
                         "recompute_ms": value(r["recompute"] * 1e3, "ms"),
                         "ratio": value(r["refused"] / r["recompute"], "x")}
    if "key_cost" in m:
        values["key_cost_us"], values["check_us"], values["step_ms"], values["check_share"] = {}, {}, {}, {}
        for T, c in m["key_cost"].items():
            k, chk, st = c["key"], c["check"], c["step"]
            values["key_cost_us"][f"T{T}"] = value(k["median"] * 1e6, "µs", iqr=k["iqr"] * 1e6, n=k["n"],
                                                   threads=k["threads"], note=f"prefix_key over {T} ids")
            values["check_us"][f"T{T}"] = value(chk["median"] * 1e6, "µs", iqr=chk["iqr"] * 1e6, n=chk["n"],
                                                threads=chk["threads"],
                                                note=f"CachedBackend check of a call extending {T - 1} positions")
            values["step_ms"][f"T{T}"] = value(st["median"] * 1e3, "ms", iqr=st["iqr"] * 1e3, n=st["n"],
                                               threads=st["threads"], note=f"one cached decode step at {T} positions")
            values["check_share"][f"T{T}"] = value(100 * chk["median"] / st["median"], "%",
                                                   note="the backend's check as a share of a decode step")
        lo, hi = min(m["key_cost"]), max(m["key_cost"])
        c_lo, c_hi = m["key_cost"][lo], m["key_cost"][hi]
        values["check_growth"] = value(c_hi["check"]["median"] / c_lo["check"]["median"], "x",
                                       note=f"backend check time at {hi} ids over {lo} ids")
        values["step_growth"] = value(c_hi["step"]["median"] / c_lo["step"]["median"], "x",
                                      note=f"decode step time at {hi} positions over {lo} positions")
    figures = {"hazards": {"path": figs / "ch04_hazards.png",
                           "caption": "Wrong reuse of a cache, hazard by hazard: logit error and the fraction "
                                      "of trials whose top token is still right"}}
    write_section(SECTION, values, provenance(manifest=m["manifest"]), figures=figures)
    return values


def run(quick_mode=None) -> dict:
    m = measure(quick_mode)
    record(m)
    return m
