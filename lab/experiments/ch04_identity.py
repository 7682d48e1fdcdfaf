"""Chapter 4, "State identity": what wrong reuse of a cache does, and a backend that refuses it.

Each hazard builds a cache the wrong way, takes the next-token scores from it, and compares them with a
correct computation (recomputation without a cache). A cache records which model filled it, and
`forward_cached` refuses to continue it with another (CacheMismatchError): the hazards that change the
weights are tried that way first (is the wrong call refused?), then the record is erased on purpose to
measure the damage the wrong reuse would do without it. Then the same situation is put to a
CachedBackend, which must refuse the reuse (a miss) or handle it, and still return the correct scores.

The adapter swap is also measured at a realistic size (`lora_hazard`): a LoRA adapter of rank 8 on the
query and value projections of every layer (`lab.updates.lora_factors`), swapped in over a cache the base
weights filled, and read over a continuation of held-out text against the adapted model recomputed.

The checks' costs are measured by `lab.identity_cost`; the in-place update is `lab.updates`.
"""

import statistics

import torch
from tqdm.auto import tqdm

from .. import data, updates
from ..cache import CacheMismatchError, StaticCache
from ..engine import CachedBackend, RecomputeBackend, greedy_agreement
from ..identity_cost import key_cost, refusal_cost, weights_check_cost
from ..metrics import kl_divergence
from ..models import forward, forward_cached, load
from ..models.load import scaled_copy
from ..results import figures_dir, provenance, quick, value, write_section
from ..updates import STEP_LR, optimizer_step, private_copy, relative_update, step_signs
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
    "weights_in_place": "weights updated in place (one optimizer step) after the cache was filled",
    "bf16_cache": "cache built in bfloat16, continued in float32",
    "system_prompt": "another system prompt under the chat template",
}


# Which hazards change the state's identity (and so must be refused by the key check). The stale offset
# does not: it is a wrong call on the right state, which the backend never makes.
IDENTITY_CHANGES = {"other_prompt": "token ids", "stale_offset": None, "static_not_reset": "token ids",
                    "rollback_not_cropped": "token ids", "adapter_weights": "model manifest",
                    "weights_in_place": "model manifest (weights changed in place)",
                    "bf16_cache": "compute and cache dtype", "system_prompt": "token ids"}

# The adapter hazard's weight: the MLP output projection of the middle layer (Llama naming).
ADAPTER_WEIGHT = "model.layers.{layer}.mlp.down_proj.weight"


def settings(quick_mode: bool) -> dict:
    return dict(trials=5 if quick_mode else 20, prefix=24, prompt=17,
                continuation=16 if quick_mode else 32,   # held-out tokens read through the LoRA hazard's cache
                requests=3 if quick_mode else 5, new_tokens=16 if quick_mode else 32,
                key_lengths=(16, 512, 4096),          # ids hashed per key: a short prompt to a long context
                key_reps=50 if quick_mode else 400,   # key timings are microseconds: many repetitions
                step_reps=3 if quick_mode else 9,     # a decode step is tens of milliseconds
                rehash_reps=2 if quick_mode else 5)   # a rehash of every weight is tenths of a second


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
    """A deliberately broken call: the model is told the new token sits at `position` (its query and key
    are rotated for that position) while it is stored after the cache's positions (RoPE models)."""
    return forward_cached(torch.tensor([[token]]), model.weights, model.config, cache,
                          positions=torch.tensor([position]))[0, -1].float()


def continue_through(model, tokens, cache):
    """Scores `[C, V]` after feeding `tokens` (C of them) through the cache: row i scores the token after
    tokens[i]. One call, as a chunked prefill does: the same scores as C decode steps."""
    return forward_cached(torch.tensor([tokens]), model.weights, model.config, cache)[0].float()


def unguarded_step(model, token, cache):
    """(next-token scores, refused): `step`, even where the cache refuses it (see `unguarded`)."""
    return unguarded(lambda: step(model, token, cache), cache)


def unguarded(call, cache):
    """(call(), refused): a call that reads `cache`, made even where the cache refuses it.

    The cache records which model filled it (`cache.owner`: the config, every weight's storage and version,
    and their fingerprint), and `forward_cached` refuses another model with CacheMismatchError. To measure
    what the wrong reuse would do, the record is then erased and the call made again: a cache without an
    identity record (as in any implementation that checks only shapes) would take the call at once.
    `refused` says whether the cache refused it first."""
    try:
        return call(), False
    except CacheMismatchError:   # a failed call leaves the cache as it was
        cache.owner = None       # erased on purpose: what a cache without an identity record allows
        return call(), True


def variants_of(model, names=None) -> dict:
    """What the hazards in `names` (default: all) need besides the model: the adapter's scaled copy, the
    bfloat16 copy, the optimizer step's signs."""
    names = HAZARDS if names is None else names
    out = {}
    if "adapter_weights" in names:
        out["scaled"] = scaled_copy(model, ADAPTER_WEIGHT.format(layer=model.config.n_layers // 2), 1.02)
    if "bf16_cache" in names:
        out["bf16"] = model.to(dtype=torch.bfloat16)
    if "weights_in_place" in names:
        out["signs"] = step_signs(model.weights)
    return out


def chat_ids(model, system, user):
    text = model.tokenizer.apply_chat_template([{"role": "system", "content": system},
                                                {"role": "user", "content": user}])
    return model.tokenizer.encode(text)


@torch.inference_mode()
def trial(hazard, model, prefix, nxt, other, variants=None, lr=STEP_LR) -> dict:
    """One hazard on one trial: the wrong scores and the right ones `[V]`; whether the cache itself refused
    the wrong call (`refused_by_cache`); whether a CachedBackend put in the same situation refused it (a
    miss) and served the correct scores. `variants` (variants_of) may be passed to build them once."""
    variants = variants_of(model, [hazard]) if variants is None else variants
    right = forward(torch.tensor([prefix + [nxt]]), model.weights, model.config)[0, -1].float()
    backend, by_cache = None, False
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
        wrong, by_cache = unguarded_step(model, nxt, prefill(variants["scaled"], prefix))
        state, request, swap = prefix, prefix + [nxt], "scaled"
    elif hazard == "weights_in_place":
        # A reinforcement-learning loop: the inference server keeps its prefix cache while the policy it
        # serves is updated between rollouts. The weights are a private copy: the shared model never changes.
        policy = private_copy(model)
        backend = CachedBackend(policy, static_for(policy, len(prefix) + 9))
        backend.next_logits(prefix)                            # the server's cache, filled before the update
        cache = prefill(policy, prefix)                        # the same state, to be reused by hand
        optimizer_step(policy.weights, variants["signs"], lr)  # the policy learns: its weights change in place
        right = forward(torch.tensor([prefix + [nxt]]), policy.weights, policy.config)[0, -1].float()
        wrong, by_cache = unguarded_step(policy, nxt, cache)
        state, request, swap = prefix, prefix + [nxt], None
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
    if backend is None:
        first = variants[swap] if swap else model
        backend = CachedBackend(first, static_for(first, max(len(state), len(request)) + 8))
        backend.next_logits(state)
        if swap:  # the weights or the precision change under the backend, as an adapter swap would
            backend.model, backend.cache_factory = model, static_for(model, len(request) + 8)
    misses = backend.misses
    served = backend.next_logits(request).float()
    refused = backend.misses > misses
    # correct: within 1e-4 of the largest logit, far above float32's summation-order differences between
    # a cached and a recomputed forward (about 1e-6 of it) and far below any hazard's damage
    correct = (served - right).abs().max().item() <= 1e-4 * right.abs().max().item()
    return dict(wrong=wrong, right=right, refused_by_cache=by_cache, refused=refused, correct=correct)


def hazards(model, trials=20, prefix_len=24, progress=True) -> dict:
    """Every hazard, `trials` times, on held-out Shakespeare: prefix of `prefix_len` tokens, then one token."""
    passages = data.passages(model.tokenizer, prefix_len + 1, count=trials + 1, seed=7)
    variants = variants_of(model)
    out = {}
    for hazard in tqdm(HAZARDS, desc="hazards", disable=not progress):
        deltas, agree, kls, by_cache, refused, correct, per_trial_max = [], 0, [], 0, 0, 0, []
        for i in range(trials):
            p, other = passages[i], passages[i + 1][:prefix_len]
            r = trial(hazard, model, p[:prefix_len], p[prefix_len], other, variants)
            d = (r["wrong"] - r["right"]).abs()
            deltas.append(d.median().item()), per_trial_max.append(d.max().item())
            agree += int(r["wrong"].argmax() == r["right"].argmax())
            kls.append(kl_divergence(r["right"], r["wrong"]).item())
            by_cache, refused = by_cache + r["refused_by_cache"], refused + r["refused"]
            correct += r["correct"]
        out[hazard] = dict(delta_median=statistics.median(deltas), delta_max=max(per_trial_max),
                           argmax_agree=agree, kl_median=statistics.median(kls), kl_max=max(kls),
                           refused_by_cache=by_cache, refused=refused, backend_correct=correct, trials=trials)
    if "weights_in_place" in out:  # the size of the update, for the record
        out["weights_in_place"] |= dict(lr=STEP_LR, relative_update=relative_update(model.weights, variants["signs"]))
    return out


@torch.inference_mode()
def lora_trial(model, adapted, prefix, continuation) -> dict:
    """The adapter swap on one passage. A CachedBackend serves `prefix` with the base `model`: its cache holds
    the base state when the `adapted` model is swapped in. Read through a fork of that cache, the adapted model
    scores `continuation` (the held-out tokens that follow, fed as they are): `wrong` `[C, V]`. The oracle,
    `right`, is the adapted model recomputed from scratch on prefix + continuation; `base`, the base model
    continuing its own state, measures what the adapter itself changes. The backend, asked for the first
    continuation token after the swap, must refuse its cache (a miss) and serve the oracle's first scores."""
    ids, n = torch.tensor([prefix + continuation]), len(prefix)
    backend = CachedBackend(model, static_for(model, ids.shape[1]))
    backend.next_logits(prefix)                                   # the server's cache, filled by the base model
    stale, own = backend.cache.fork(), backend.cache.fork()       # copies: the backend's cache stays as it was
    wrong, by_cache = unguarded(lambda: continue_through(adapted, continuation, stale), stale)   # [C, V]
    base = continue_through(model, continuation, own)                                             # [C, V]
    right = forward(ids, adapted.weights, adapted.config)[0, n:].float()                          # [C, V]
    backend.model, backend.cache_factory = adapted, static_for(adapted, ids.shape[1])   # the adapter swap
    served = backend.next_logits(prefix + continuation[:1]).float()
    correct = (served - right[0]).abs().max().item() <= 1e-4 * right[0].abs().max().item()   # as in `trial`
    return dict(wrong=wrong, right=right, base=base, refused_by_cache=by_cache, refused=backend.misses == 2,
                correct=correct)


def lora_hazard(model, trials=20, prefix_len=24, continuation=32, progress=True) -> dict:
    """The LoRA adapter swap on `trials` held-out passages: the first continuation position as a row of the
    hazards table (the next token after prefix_len + 1 tokens, as `hazards` measures), and the whole
    continuation: the largest |Δ logit|, the positions whose top token survives, the mean KL; beside them
    the adapter's own effect (adapted against base, no cache)."""
    adapted = updates.lora_merged(model, updates.lora_factors(model))
    passages = data.passages(model.tokenizer, prefix_len + continuation, count=trials, seed=7)
    kl0, d0_med, d0_max, agree0, kls, base_kls, d_max, agree, base_agree = [], [], [], 0, [], [], 0.0, 0, 0
    counts = dict(refused_by_cache=0, refused=0, backend_correct=0)
    for p in tqdm(passages, desc="LoRA swap", disable=not progress):
        r = lora_trial(model, adapted, p[:prefix_len], p[prefix_len:])
        d = (r["wrong"] - r["right"]).abs()                                        # [C, V]
        d0_med.append(d[0].median().item()), d0_max.append(d[0].max().item())
        kl = kl_divergence(r["right"], r["wrong"])                                 # [C]
        kl0.append(kl[0].item()), kls.append(kl), base_kls.append(kl_divergence(r["right"], r["base"]))
        top = r["right"].argmax(-1)
        agree0 += int(top[0] == r["wrong"][0].argmax())
        agree += (top == r["wrong"].argmax(-1)).sum().item()
        base_agree += (top == r["base"].argmax(-1)).sum().item()
        d_max = max(d_max, d.max().item())
        for k, was in (("refused_by_cache",) * 2, ("refused",) * 2, ("backend_correct", "correct")):
            counts[k] += int(r[was])
    kls, base_kls = torch.stack(kls), torch.stack(base_kls)                        # [trials, C]
    half = continuation // 2
    changed = [k for k in model.weights if adapted.weights[k] is not model.weights[k]
               and not torch.equal(adapted.weights[k], model.weights[k])]
    return dict(delta_median=statistics.median(d0_med), delta_max=max(d0_max), argmax_agree=agree0,
                kl_median=statistics.median(kl0), kl_max=max(kl0), trials=trials, **counts,
                continuation=continuation, positions=kls.numel(), cont_delta_max=d_max, cont_argmax_agree=agree,
                cont_kl_mean=kls.mean().item(), base_kl_mean=base_kls.mean().item(),
                kl_first_half=kls[:, :half].mean().item(), kl_second_half=kls[:, half:].mean().item(),
                base_kl_first_half=base_kls[:, :half].mean().item(),
                base_kl_second_half=base_kls[:, half:].mean().item(),
                kl_by_position=kls.mean(0).tolist(), base_kl_by_position=base_kls.mean(0).tolist(),
                base_argmax_agree=base_agree, rank=updates.LORA_RANK, targets=list(updates.LORA_TARGETS),
                relative_norm=updates.LORA_NORM, matrices=len(changed), layers=model.config.n_layers,
                manifest_changed=adapted.manifest != model.manifest)


def engine_check(model, requests=5, new_tokens=32, prompt=17) -> dict:
    """Several greedy requests through one CachedBackend: hits, misses, positions, same tokens as recompute."""
    prompts = data.passages(model.tokenizer, prompt, count=requests, seed=11)
    backend = CachedBackend(model, static_for(model, prompt + new_tokens))
    r = greedy_agreement(backend, RecomputeBackend(model), prompts, new_tokens)
    return r | dict(calls=backend.calls, hits=backend.hits, misses=backend.misses)


LABELS = {"other_prompt": "another prompt", "stale_offset": "stale offset", "static_not_reset": "not reset",
          "rollback_not_cropped": "not cropped", "adapter_weights": "MLP × 1.02",
          "weights_in_place": "weights in place", "bf16_cache": "bfloat16 cache", "system_prompt": "system prompt",
          "lora_adapter": "LoRA swap, r = 8"}


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


def plot_lora(r: dict, path=None):
    """The LoRA swap along the continuation: the mean KL from the adapted model recomputed, position by
    position, of the stale cache's scores and of the base model's (the adapter's own effect)."""
    from . import plots

    fig, ax = plots.figure()
    x = range(1, len(r["kl_by_position"]) + 1)
    ax.plot(x, r["base_kl_by_position"], "--", color="tab:gray", label="base model, no adapter")
    ax.plot(x, r["kl_by_position"], "o-", color="tab:red", ms=3, label="adapted model on the base model's cache")
    ax.set(xlabel="continuation token (after the cached prefix)", ylabel="KL from the adapted model (nats)",
           title=f"LoRA swap (rank {r['rank']}, q and v): mean over {r['trials']} passages", ylim=(0, None))
    ax.legend(loc="upper right")
    return finish(fig, path)


def measure(quick_mode=None) -> dict:
    s = settings(quick() if quick_mode is None else quick_mode)
    smol = load("smollm2")
    return dict(settings=s, manifest=smol.manifest, hazards=hazards(smol, s["trials"], s["prefix"]),
                lora=lora_hazard(smol, s["trials"], s["prefix"], s["continuation"]),
                refusal=refusal_cost(smol, s["prefix"]),
                key_cost=key_cost(smol, s["key_lengths"], s["key_reps"], s["step_reps"]),
                check_cost=weights_check_cost(smol, s["key_reps"], s["rehash_reps"]),
                engine=engine_check(smol, s["requests"], s["new_tokens"], s["prompt"]))


def values(m: dict) -> dict:
    """The section's values, from every part of the measurements that m holds: a notebook sets each part's
    verdicts beside the book's as soon as it has measured that part (lab.book.verdicts); record() writes them all."""
    values = {"hazards": {}} if "hazards" in m else {}
    for name, r in m.get("hazards", {}).items():
        values["hazards"][name] = {
            "delta_median": value(r["delta_median"], "logit"), "delta_max": value(r["delta_max"], "logit"),
            "argmax_agree": value(r["argmax_agree"], None, note=f"trials of {r['trials']} with the same top token"),
            "kl_median": value(r["kl_median"], "nats"), "kl_max": value(r["kl_max"], "nats"),
            "refused_by_cache": value(r["refused_by_cache"], None,
                                      note=f"trials of {r['trials']} in which forward_cached refused the wrong call "
                                           "(CacheMismatchError: the cache records another model)"),
            "refused": value(r["refused"], None, note=f"trials of {r['trials']} the CachedBackend refused"),
            "backend_correct": value(r["backend_correct"], None, note="trials whose backend scores were correct"),
            "trials": value(r["trials"], "trials"), "what": value(HAZARDS[name], None),
            "identity_change": value(IDENTITY_CHANGES[name] or "none", None)}
        if "lr" in r:
            values["hazards"][name] |= {
                "lr": value(r["lr"], None, note="learning rate of the one Adam step: every element of every "
                                                "matrix moves by it"),
                "relative_update": value(r["relative_update"], None,
                                         note="median over matrices of |update| / |weight| (Frobenius norms)")}
    if "lora" in m:
        values["lora"] = lora_values(m["lora"])
    if "hazards" in m:
        values["hazard_prefix"] = value(m["settings"]["prefix"], "tokens", note="held-out tokens before the next one")
    if "engine" in m:
        e = m["engine"]
        values["engine"] = {"requests": value(m["settings"]["requests"], "requests"),
                            "new_tokens": value(m["settings"]["new_tokens"], "tokens", note="greedy tokens a request"),
                            "calls": value(e["calls"], "calls"), "hits": value(e["hits"], "calls"),
                            "misses": value(e["misses"], "calls"),
                            "positions_per_request": value(e["positions"], "positions"),
                            "positions_per_request_median": value(statistics.median(e["positions"]), "positions"),
                            "recompute_positions_per_request": value(e["recompute_positions"], "positions"),
                            "tokens_identical": value(e["tokens_identical"], None)}
    if "refusal" in m:
        r = m["refusal"]
        values["refusal"] = {"refused_ms": value(r["refused"] * 1e3, "ms"),
                             "recompute_ms": value(r["recompute"] * 1e3, "ms"),
                             "ratio": value(r["refused"] / r["recompute"], "x")}
    if "key_cost" in m:
        kc = m["key_cost"]
        values["key_cost_us"] = {f"T{T}": timed(c["key"], 1e6, "µs", f"prefix_key over {T} ids") for T, c in kc.items()}
        values["check_us"] = {f"T{T}": timed(c["check"], 1e6, "µs", f"CachedBackend check of a call extending {T - 1} "
                                             "positions") for T, c in kc.items()}
        values["step_ms"] = {f"T{T}": timed(c["step"], 1e3, "ms", f"one cached decode step at {T} positions")
                             for T, c in kc.items()}
        values["check_share"] = {f"T{T}": value(100 * c["check"]["median"] / c["step"]["median"], "%",
                                                note="the backend's check as a share of a decode step")
                                 for T, c in kc.items()}
        lo, hi = kc[min(kc)], kc[max(kc)]
        values["check_growth"] = value(hi["check"]["median"] / lo["check"]["median"], "x",
                                       note=f"backend check time at {max(kc)} ids over {min(kc)} ids")
        values["step_growth"] = value(hi["step"]["median"] / lo["step"]["median"], "x",
                                      note=f"decode step time at {max(kc)} positions over {min(kc)} positions")
    if "check_cost" in m:
        c, kc = m["check_cost"], m.get("key_cost", {})
        per_call = c["manifest"]["median"] + c["owner"]["median"]
        values["weights_check"] = {
            "manifest_us": timed(c["manifest"], 1e6, "µs", "Model.manifest, weights unchanged: every tensor's "
                                 "storage, version and fingerprint compared with the state last hashed"),
            "owner_us": timed(c["owner"], 1e6, "µs", "lab.models.owner(weights, config), which forward_cached "
                              "computes and the cache compares on every call"),
            "fingerprint_us": timed(c["fingerprint"], 1e6, "µs", "lab.models.checks.fingerprint: a strided "
                                    "sample of every weight, inside both the manifest and the owner"),
            "rehash_s": timed(c["rehash"], 1, "s", "the first Model.manifest after a weight changed in place: "
                              "every tensor hashed"),
            "per_call_us": value(per_call * 1e6, "µs", note="a CachedBackend hit: the manifest read once (the new "
                                 "state's key reuses that identity) and the owner once (forward_cached); inside "
                                 "check_us and step_ms")}
        share = lambda t, what: {f"T{T}": value(100 * t / k["step"]["median"], "%", note=f"{what} as a share of "
                                                f"one cached decode step at {T} positions") for T, k in kc.items()}
        if kc:
            values["weights_check"] |= dict(share=share(per_call, "per_call_us"),
                                            fingerprint_share=share(c["fingerprint"]["median"], "one fingerprint"))
    return values


def record(m: dict, hazards_figure=None, lora_figure=None) -> dict:
    """Write section ch04 and its figures. A notebook passes the figures it already drew, which are saved
    as they are rather than drawn a second time."""
    import matplotlib.pyplot as plt

    figs = figures_dir()
    if hazards_figure is None:
        rows = m["hazards"] | ({"lora_adapter": m["lora"]} if "lora" in m else {})
        plt.close(plot_hazards(rows, figs / "ch04_hazards.png"))
    else:
        finish(hazards_figure, figs / "ch04_hazards.png")
    v = values(m)
    figures = {"hazards": {"path": figs / "ch04_hazards.png",
                           "caption": "Wrong reuse of a cache, hazard by hazard: logit error and the fraction "
                                      "of trials whose top token is still right"}}
    if "lora" in m:
        if lora_figure is None:
            plt.close(plot_lora(m["lora"], figs / "ch04_lora.png"))
        else:
            finish(lora_figure, figs / "ch04_lora.png")
        figures["lora"] = {"path": figs / "ch04_lora.png",
                           "caption": "A LoRA adapter swapped in over a base-model cache: KL from the adapted "
                                      "model along the continuation, beside the base model's"}
    write_section(SECTION, v, provenance(manifest=m["manifest"]), figures=figures)
    return v


def lora_values(r: dict) -> dict:
    """The LoRA hazard's recorded values: a row like the hazards' (first continuation position), then the
    whole continuation, the adapter's own effect, and the adapter's settings."""
    n, pos = r["trials"], r["positions"]
    return {
        "delta_median": value(r["delta_median"], "logit"), "delta_max": value(r["delta_max"], "logit"),
        "argmax_agree": value(r["argmax_agree"], None, note=f"trials of {n} with the same top token"),
        "kl_median": value(r["kl_median"], "nats"), "kl_max": value(r["kl_max"], "nats"),
        "refused_by_cache": value(r["refused_by_cache"], None, note=f"trials of {n} in which forward_cached "
                                  "refused the adapted model on the base model's cache (CacheMismatchError)"),
        "refused": value(r["refused"], None, note=f"trials of {n} the CachedBackend refused after the swap"),
        "backend_correct": value(r["backend_correct"], None, note="trials whose backend scores were correct"),
        "trials": value(n, "trials"), "identity_change": value("model manifest", None),
        "continuation": value(r["continuation"], "tokens", note="held-out tokens read through the stale cache"),
        "positions": value(pos, "positions", note="continuation positions over all trials"),
        "cont_delta_max": value(r["cont_delta_max"], "logit", note="largest |Δ logit| over every position"),
        "cont_argmax_agree": value(r["cont_argmax_agree"], None,
                                   note=f"positions of {pos} whose top token is the oracle's"),
        "cont_kl_mean": value(r["cont_kl_mean"], "nats", note="KL(adapted, recomputed || stale cache), mean "
                              "over every position"),
        "base_kl_mean": value(r["base_kl_mean"], "nats", note="KL(adapted || base model), no cache: what the "
                              "adapter itself changes"),
        "base_argmax_agree": value(r["base_argmax_agree"], None,
                                   note=f"positions of {pos} where base and adapted share the top token"),
        "kl_first_half": value(r["kl_first_half"], "nats", note="cont_kl_mean over the first half of the "
                               "continuation"),
        "kl_second_half": value(r["kl_second_half"], "nats", note="cont_kl_mean over the second half"),
        "base_kl_first_half": value(r["base_kl_first_half"], "nats", note="base_kl_mean, first half"),
        "base_kl_second_half": value(r["base_kl_second_half"], "nats", note="base_kl_mean, second half"),
        "rank": value(r["rank"], None, note="rank of every update B·A"),
        "targets": value(", ".join(t.split(".")[-1] for t in r["targets"]), None),
        "relative_norm": value(r["relative_norm"], None, note="|B·A| / |W|, Frobenius norms, every adapted "
                               "matrix: the lab's choice"),
        "matrices": value(r["matrices"], "matrices", note="weights that differ from the base model's"),
        "layers": value(r["layers"], "layers"),
        "manifest_changed": value(r["manifest_changed"], None)}


def timed(t: dict, scale: float, unit: str, note: str) -> dict:
    """A timing summary (lab.bench) as a recorded value: its median in `unit` (seconds x scale), with spread."""
    return value(t["median"] * scale, unit, iqr=t["iqr"] * scale, n=t["n"], threads=t["threads"], note=note)
