# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 4 — State identity
#
# A KV cache holds the keys and values of one exact computation: these weights, this precision, these
# positions, these token ids. Reused for anything else, it still returns scores, because nothing in the
# tensors says what produced them: a cache has the right shape whatever went into it. The scores are
# then wrong, and sometimes only slightly wrong.
#
# This chapter writes down what a state is the state *of* as a key: a hash of everything the
# computation depended on. We build a minimal key in a few lines, compare it with `lab`'s `prefix_key`,
# put the key in front of every call of a cached backend, and make the cache itself remember which model
# filled it — weights changed in place included, as when a policy learns between rollouts. Then we break
# the rule eight ways on purpose to measure what each break does to the scores, and swap a LoRA adapter in
# under a cache the base model filled, at the size of a trained adapter.

# %%
import lab  # first, before torch: it sets OpenMP's wait policy, which torch reads once, when it loads

import dataclasses
import platform

import pandas as pd
import torch
import transformers
from IPython.display import display

from lab import results
from lab.cache import CacheMismatchError, ConcatCache, StaticCache
from lab.engine import CachedBackend, identity_of, key_for, prefix_key
from lab.identity_cost import key_cost, refusal_cost, weights_check_cost
from lab.experiments import ch04_identity as ch04
from lab.experiments.tables import show
from lab.models import load, owner
from lab.models.checks import FINGERPRINT_RUN, FINGERPRINT_SAMPLES, weights_state
from lab.models.load import scaled_copy
from lab.updates import LORA_NORM, LORA_RANK, lora_factors, lora_merged, optimizer_step, private_copy, step_signs
from lab.book.verdicts import beside

print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"pandas {pd.__version__}, threads {torch.get_num_threads()}")
print(lab.threads.describe())
QUICK = results.quick()
S, FULL = ch04.settings(QUICK), ch04.settings(False)      # FULL: the book's settings, to say what quick mode skips
print("quick mode (short runs; a temporary results file)" if QUICK else "full mode",
      "-> results in", results.results_path())

# %% [markdown]
# ## A minimal prefix key
#
# What does the state of a prompt depend on? Chapter 2's argument for the cache was that the stored keys
# and values are exactly what a recomputation would produce. A recomputation would produce the same
# numbers only with
#
# - the same **weights** — named by the model's *manifest*, the sha256 of its weight files and config;
# - the same **tokenizer** — it decides which ids a text becomes;
# - the same **precision** — a state computed in bfloat16 is not the state computed in float32;
# - the same **token ids**, every one of them, in order.
#
# A key is a hash over those four. A few details make it correct rather than nearly correct: a separator
# between fields (so that two different field lists never feed the hash the same bytes), the number of
# ids (so that `[1, 2]` and `[1, 2, 0]` differ), and the ids as fixed-width integers.

# %%
import hashlib


def minimal_key(manifest: str, tokenizer: str, dtype: str, ids: list[int]) -> str:
    h = hashlib.sha256()
    for field in (manifest, tokenizer, dtype):
        h.update(field.encode() + b"\0")          # a separator between fields
    h.update(len(ids).to_bytes(8, "little"))      # the length: [1, 2] and [1, 2, 0] differ
    for i in ids:
        h.update(i.to_bytes(4, "little"))         # each id as a fixed-width integer
    return h.hexdigest()


# %% [markdown]
# Try it on SmolLM2. For the tokenizer we hash its `tokenizer.json` text (vocabulary, merges, rules): the
# obvious thing to hash.

# %%
smol = load("smollm2")
tok = smol.tokenizer
vocab_hash = hashlib.sha256(tok.tok.to_str().encode()).hexdigest()
ids = tok.encode("To be, or not to be, that is the question")
print(f"{len(ids)} ids:", ", ".join(map(str, ids)))
print("minimal key:", minimal_key(smol.manifest, vocab_hash, "torch.float32", ids))

# %% [markdown]
# ## The same changes, against `lab`'s key
#
# `lab.engine.prefix_key` hashes more. Its fields are those of a `StateIdentity` — everything except the
# ids — plus the ids:
#
# - the model manifest;
# - the tokenizer's hash, **chat template included**;
# - the compute dtype and the cache dtype, and the **cache kind** (`StaticCache`, `ConcatCache`, ...);
# - the **position configuration**: the RoPE base and the trained context length;
# - an optional **salt** that separates tenants;
# - the exact token ids.
#
# Make one change at a time and ask both keys whether they noticed. The changes: another prompt, another
# model of the same shape (one layer's MLP output scaled by 1.02, as a swapped adapter might do), another
# precision, another tenant, another cache kind, another RoPE base set at run time, another chat template.

# %%
middle = smol.config.n_layers // 2   # same shapes, other weights: a manifest of its own
scaled = scaled_copy(smol, ch04.ADAPTER_WEIGHT.format(layer=middle), 1.02)
edited = type(tok)(tok.tok, tok.chat_template.replace("You are a helpful AI assistant", "You are a pirate"),
                   tok.special)        # the same vocabulary under another chat template
base = dict(manifest=smol.manifest, ids=ids, tokenizer=tok.sha256, vocab=vocab_hash, dtype="torch.float32",
            cache_kind="StaticCache", rope_theta=smol.config.rope_theta, salt=None)
changes = {
    "another prompt": dict(ids=tok.encode("To be, or not to see, that is the question")),
    "another model (MLP × 1.02)": dict(manifest=scaled.manifest),
    "bfloat16 instead of float32": dict(dtype="torch.bfloat16"),
    "another tenant (salt)": dict(salt="tenant-b"),
    "ConcatCache instead of StaticCache": dict(cache_kind="ConcatCache"),
    "RoPE base × 10 at run time": dict(rope_theta=10 * smol.config.rope_theta),
    "another chat template": dict(tokenizer=edited.sha256),   # the vocabulary, and so vocab_hash, unchanged
}


def both_keys(f):
    mine = minimal_key(f["manifest"], f["vocab"], f["dtype"], f["ids"])
    labs = prefix_key(f["manifest"], f["ids"], tokenizer=f["tokenizer"], compute_dtype=f["dtype"],
                      cache_dtype=f["dtype"], cache_kind=f["cache_kind"], rope_theta=f["rope_theta"],
                      max_positions=smol.config.max_positions, salt=f["salt"])
    return mine, labs


mine0, lab0 = both_keys(base)
rows = []
for change, fields in changes.items():
    mine, labs = both_keys({**base, **fields})
    rows.append({"change": change, "minimal key": "changes" if mine != mine0 else "SAME",
                 "lab's prefix_key": "changes" if labs != lab0 else "SAME"})
assert [r["minimal key"] for r in rows] == ["changes"] * 3 + ["SAME"] * 4     # what the text below says
assert all(r["lab's prefix_key"] == "changes" for r in rows)
show(pd.DataFrame(rows).set_index("change"))

# %% [markdown]
# The minimal key notices the first three changes and misses the last four. What each field protects
# against:
#
# - **ids**: a cache built for another prompt, a buffer not reset between requests, draft tokens left in
#   the cache after a rejection — all three are "the wrong ids", and all three are measured below.
# - **manifest**: a fine-tune, an adapter, a requantization, an optimizer step applied to the weights in
#   place. The shapes are the same, so a wrong state fits, and the difference it makes is small enough to
#   go unnoticed (measured below).
# - **dtypes**: a state written in bfloat16 and read by a float32 model is off by the rounding of every
#   stored key and value.
# - **tokenizer and chat template**: they decide which ids a text or a conversation becomes. With equal
#   ids and equal weights the state is the same whatever produced the ids, so this field is a guard
#   rather than a necessity: a changed template (another default system prompt, as here) invalidates
#   every stored state at once instead of relying on the new ids to differ. The minimal key hashed the
#   vocabulary only, and missed the template.
# - **cache kind**: the layout the state is stored in; a state is handed only to code that reads that
#   layout.
# - **positions**: the RoPE base and the context length decide how each key is rotated. The manifest
#   covers the config file; a server that overrides the RoPE base at run time (to extend the context)
#   computes other keys for the same ids, and only a key that names the setting notices.
# - **salt**: two tenants who send the same ids would compute the same state, so sharing it is
#   numerically right — and still wrong, because a hit answers faster than a miss, and one tenant can
#   then learn from timing whether another sent a prompt. vLLM added `cache_salt` to its block hash for
#   this reason (research/ch04/sources.md).

# %% [markdown]
# ### Checked against `lab`
#
# A backend does not fill in the fields by hand: `identity_of(model, cache)` reads them from the model
# and the cache it would compute into, and `key_for(identity, ids)` hashes them with the ids. That is the
# same key as `prefix_key` with the same fields:

# %%
identity = identity_of(smol, StaticCache(smol.config, 64))
fields = {k: f"{v[:16]}…" if isinstance(v, str) and len(v) == 64 else "none" if v is None else v   # sha256s cut
          for k, v in dataclasses.asdict(identity).items()}
display(show(pd.Series(fields, name="StateIdentity", dtype=object).rename_axis("field").to_frame()))
assert key_for(identity, ids) == lab0
assert key_for(identity_of(smol, ConcatCache(smol.config)), ids) != lab0     # another cache kind
assert key_for(identity_of(smol, StaticCache(smol.config, 64), salt="tenant-b"), ids) != lab0
print("key_for(identity_of(model, cache), ids) == prefix_key(...):", lab0[:16], "...")

# %% [markdown]
# ## The backend's rule, on every call
#
# The engine's contract is "ids in, scores out": `next_logits(ids)` gets the whole sequence so far. A
# `CachedBackend` keeps one cache between calls, with the ids and identity of the state it holds. On
# every call it computes the identity under which it would compute now and the key of the request's
# prefix `ids[:-k]`:
#
# - equal keys for some $k \ge 1$: run only the $k$ new tokens (a **hit**);
# - anything else — another model, tokenizer, dtype or salt; identical ids ($k = 0$: the state of
#   `ids[:-0]` does not exist); a diverging prefix — discard the cache and recompute (a **miss**).
#
# A miss costs time, never correctness. A few requests of greedy tokens (`S["requests"]` of
# `S["new_tokens"]`) through one backend, against a backend without a cache:

# %%
eng = ch04.engine_check(smol, S["requests"], S["new_tokens"], S["prompt"])
engine_rows = {"calls": "calls", "hits": "hits", "misses": "misses", "positions": "positions per request, cached",
               "recompute_positions": "positions per request, recomputed", "tokens_identical": "tokens"}
show(pd.Series({label: ", ".join(map(str, eng[k])) if isinstance(eng[k], list) else eng[k]   # one a request
                for k, label in engine_rows.items()}, name="engine check").to_frame(),
     words=("identical to recomputation", "different from recomputation"))

# %%
assert eng["misses"] == S["requests"] and eng["hits"] == eng["calls"] - eng["misses"] and eng["tokens_identical"]
print(f"{eng['misses']} misses, {eng['hits']} hits; {max(eng['positions'])} positions a request at most, "
      f"against {eng['recompute_positions']} without a cache")

# %% [markdown]
# One miss a request (its first call: the previous request's state belongs to other ids), a hit on every
# other call, the same tokens as recomputation, and a fraction of the positions pushed through the model.

# %% [markdown]
# ## Weights that change in place
#
# A manifest is a hash of the weight files. In a reinforcement-learning loop the weights are not files:
# the trainer updates the policy in place between rollouts, and an inference server that serves the same
# tensors keeps its prefix cache. The files still say what they said; the tensors do not. Hashing every
# tensor on every call would notice, at a cost of tenths of a second a call.
#
# PyTorch already counts changes: every tensor has a **version counter** that each in-place operation
# (`add_`, `copy_`, an optimizer step) increments, and a storage address (`data_ptr()`) that names the
# memory it lives in. The pair, over every weight, names the state of the weights without reading them.
# `Model.manifest` compares it with the state it last hashed, and hashes the tensors again only when it
# moved; `lab.models.checks.owner(weights, config)` is the config and that state.
#
# Try it on a private copy of SmolLM2 (the shared model is never changed), with the update of one Adam
# step: each element moves by the learning rate (`lab.updates.STEP_LR`), in a random direction.

# %%
policy = private_copy(smol)
w0 = policy.weights["model.embed_tokens.weight"]
print("embedding: storage", hex(w0.data_ptr()), "version", w0._version, "| manifest", policy.manifest[:16], "...")
optimizer_step(policy.weights, step_signs(policy.weights))
print("embedding: storage", hex(w0.data_ptr()), "version", w0._version, "| manifest", policy.manifest[:16], "...")
assert policy.manifest != smol.manifest

# %% [markdown]
# Same storage, a new version, another manifest: a `CachedBackend` that holds a state of the old weights
# computes another identity on its next call, and recomputes.
#
# ### The cache records who filled it
#
# A key protects the states a backend hands out. A cache object can also be passed around by code that
# never computes a key: a static buffer reused between requests, a cache kept across a weight update.
# So the cache itself records its **owner** — `owner(weights, config)` of the model that filled it —
# and `forward_cached` refuses to continue it with another model (`CacheMismatchError`) until it is
# reset. An empty cache takes any owner. The check reads storages and version counters (and the
# fingerprint that the next section adds), not every value.

# %%
policy = private_copy(smol)
cache = ch04.prefill(policy, ids)                    # filled by the policy before its update
versions, printed = cache.owner[1]
print(f"cache.owner: config {cache.owner[0].name}, {len(versions)} (storage, version) pairs and a "
      f"{len(printed):,}-byte fingerprint")
assert cache.owner == owner(policy.weights, policy.config)
optimizer_step(policy.weights, step_signs(policy.weights))
assert cache.owner != owner(policy.weights, policy.config)   # the versions moved
try:
    ch04.step(policy, ids[-1], cache)
except CacheMismatchError as e:
    print("refused:", e)
try:
    ch04.step(scaled, ids[-1], ch04.prefill(smol, ids))  # another model of the same shapes
except CacheMismatchError:
    print("refused: the scaled copy continuing a cache of SmolLM2")
cache.reset()                                        # empty: the updated policy may fill it anew
print("after reset(), the updated policy fills it:", ch04.prefill(policy, ids, cache).length, "positions")
del policy, cache

# %% [markdown]
# ### What the version counter cannot see, and a fingerprint
#
# A write PyTorch does not count leaves the version counter where it was: a write through `w.data` (a new
# view with a counter of its own), through a NumPy view, by a kernel that does not count, or into an
# *inference tensor* (made inside `torch.inference_mode()`, it has no counter at all). Weight loaders
# write new checkpoints into a running server through `param.data.copy_`, and so can a training loop that
# pushes new weights to the server: these are exactly the writes that matter.
#
# So the weights' state carries a second part, a **fingerprint**: the exact bytes of a strided sample of
# every tensor, `FINGERPRINT_SAMPLES` elements in runs of `FINGERPRINT_RUN`, evenly spaced over each,
# however the tensor was written.
# Any write that changes every element (a new checkpoint, a scaled matrix, an optimizer step) changes the
# sample. It reads a few runs of every tensor on every call; the cost is measured below.
#
# On a small model, try the usual ways of changing a weight and ask each part whether it noticed:

# %%
def noticed(change):
    m = private_copy(load("tiny-llama"))
    w = m.weights["model.layers.0.mlp.down_proj.weight"]
    (versions, printed), before = weights_state(m.weights), m.manifest
    change(w)
    now = weights_state(m.weights)
    return {"version counters": "moved" if now[0] != versions else "-",
            "fingerprint": "moved" if now[1] != printed else "-",
            "manifest": "noticed" if m.manifest != before else "MISSED"}


def adam_step(w, **options):
    p = torch.nn.Parameter(w.detach())                # shares w's storage and version counter
    opt = torch.optim.Adam([p], lr=1e-3, **options)
    p.grad = torch.ones_like(p)
    opt.step()


writes = {"an in-place op, w.add_(...)": lambda w: w.add_(1e-3),
          "Adam step (foreach)": lambda w: adam_step(w, foreach=True),
          "Adam step (fused)": lambda w: adam_step(w, fused=True),
          "a write through w.data": lambda w: w.data.add_(1e-3),
          "a write through a NumPy view": lambda w: w.numpy().__iadd__(1e-3),
          "one element between the runs, through w.data": lambda w: w.data.view(-1)[FINGERPRINT_RUN].add_(1.0)}
print(f"the fingerprint reads {FINGERPRINT_SAMPLES} elements of each tensor, in runs of {FINGERPRINT_RUN}")
seen = pd.DataFrame({what: noticed(f) for what, f in writes.items()}).T
assert (seen["manifest"].iloc[:-1] == "noticed").all() and seen["manifest"].iloc[-1] == "MISSED"
show(seen)

# %% [markdown]
# The version counters miss the writes through `.data` and NumPy (and, with this PyTorch on the CPU, may
# miss a fused optimizer kernel); the fingerprint sees every write that changes the whole tensor. What is
# left is the last row, the blind spot: a write through an uncounted path that changes only elements
# between the runs (here the element just after the first run, in a matrix of 8,192 whose fingerprint reads
# 8 runs of 8, 1,024 elements apart).
# The same write made by an ordinary in-place operation moves the version counter. Closing the blind spot
# means reading every value, a rehash, on every call.
#
# ## A cache touched from outside
#
# The backend's key says which state it *wrote*. If anyone else touches its cache object afterwards — a
# crop, a reset, another model's forward — the key no longer describes what the cache holds. So the backend
# also records the cache's own version counter (`cache.version`, incremented by every update, advance, crop
# and reset) when it writes, and serves from the cache only while it is the same object, at the same
# version, holding as many positions as the ids it believes it holds (`holds_its_state()`):

# %%
b = CachedBackend(smol, ch04.static_for(smol, 64))
b.next_logits(ids[:-1])
b.cache.crop(3)                                     # touched from outside
b.next_logits(ids)
print(f"after a crop from outside: hits {b.hits}, misses {b.misses} (the second call recomputed)")
b.next_logits(ids + [ids[0]])
print(f"its own state again: hits {b.hits}, misses {b.misses}")

# %% [markdown]
# ## What the check costs
#
# The key is a sha256 over the identity and every id, computed on every call: its cost grows with the
# context. Time `prefix_key` alone, and the backend's whole per-call check (the key of `ids[:-1]` to
# decide, then the key of `ids` for the new state), at three lengths, and set them beside one cached
# decode step of SmolLM2 at the same context. `lab.bench.time_call` excludes warm-up and reports the
# median and the interquartile range.

# %%
kc = key_cost(smol, S["key_lengths"], S["key_reps"], S["step_reps"])
show(pd.DataFrame({T: {"prefix_key (µs)": c["key"]["median"] * 1e6, "spread, IQR (µs)": c["key"]["iqr"] * 1e6,
                       "backend check (µs)": c["check"]["median"] * 1e6,
                       "decode step (ms)": c["step"]["median"] * 1e3,
                       "check / step": c["check"]["median"] / c["step"]["median"]}
                   for T, c in kc.items()}).T.rename_axis("ids in the key"), percent=["check / step"])

# %%
(T0, a), (T1, b) = list(kc.items())[0], list(kc.items())[-1]
check_growth, step_growth = b["check"]["median"] / a["check"]["median"], b["step"]["median"] / a["step"]["median"]
print(f"from {T0} to {T1} ids the check's time grows {check_growth:.2g}x, the decode step's {step_growth:.2g}x: "
      f"the step's grows {'less' if step_growth < check_growth else 'more'}")

# %% [markdown]
# The check's cost grows with the number of ids it hashes; the decode step's cost, dominated at these
# lengths by reading the weights, grows much less. The last column is the price of the check on every
# call. A system that hashes once per page of 16 tokens and chains the hashes (chapter 6) pays for each
# id once instead of on every call.
#
# The backend's check includes reading the manifest, and the step includes `forward_cached`'s owner
# check: each computes the weights' state, a storage, a version and a sampled fingerprint per weight
# tensor. They scale with the number of tensors, not with the context. Time them alone (the fingerprint
# too), and the one-off rehash the manifest does after a weight changed:

# %%
cc = weights_check_cost(smol, S["key_reps"], S["rehash_reps"])
per_call = cc["manifest"]["median"] + cc["owner"]["median"]       # a hit reads the manifest once
display(show(pd.DataFrame({"Model.manifest, weights unchanged (µs)": cc["manifest"]["median"] * 1e6,
                           "owner(weights, config) (µs)": cc["owner"]["median"] * 1e6,
                           "fingerprint alone (µs)": cc["fingerprint"]["median"] * 1e6,
                           "per call: manifest + owner (µs)": per_call * 1e6,
                           "rehash after an in-place change (s)": cc["rehash"]["median"]}, index=["SmolLM2"]).T))
show(pd.DataFrame({T: {"per call / decode step": per_call / c["step"]["median"],
                       "fingerprint / decode step": cc["fingerprint"]["median"] / c["step"]["median"]}
                   for T, c in kc.items()}).T.rename_axis("ids in the key"),
     percent=["per call / decode step", "fingerprint / decode step"])

# %%
print(f"on every call: {per_call * 1e6:.3g} µs; once after a change: {cc['rehash']['median']:.2g} s, "
      f"{cc['rehash']['median'] / per_call:,.0f} calls' worth")

# %%
m = dict(settings=S, manifest=smol.manifest, engine=eng, key_cost=kc, check_cost=cc)
beside("ch04", "ch04.key_cost_us", "ch04.check_us", "ch04.weights_check", values=ch04.values(m),
       why=f"your run times each key {S['key_reps']} times and each decode step {S['step_reps']} times, the book "
           f"{FULL['key_reps']} and {FULL['step_reps']}: microseconds move with whatever else the machine runs, and "
           "not all parts alike: the check reads the manifest, with its fingerprint, once, and the rest of it "
           "(the key, the versions) stretches most on a busy machine, so the fingerprint's share of the check "
           "moves from run to run.")

# %% [markdown]
# Noticing changed weights costs the same on every call, whatever the context, most of it the fingerprint
# (one view and one small copy per weight tensor), and a rehash of every weight only once a weight
# changed. Without the fingerprint the per-call part is the versions alone, a small fraction of it, and
# the writes in the table above that the counters miss would be served from a stale cache.

# %% [markdown]
# ## An adapter swapped in under a cache
#
# The 1.02 above changes one matrix by a rounding error's worth of a real adapter. A LoRA adapter (Hu et
# al., 2021) adds a low-rank update $B A$ to chosen weight matrices: for a matrix $W$ of shape
# `[out, in]`, $B$ is `[out, r]` and $A$ is `[r, in]`, so $W + BA$ has the same shape and $BA$ has rank
# at most $r$. Build one by hand: rank 8, on the query and value projections of every layer. $A$ is drawn
# as LoRA initializes it (Gaussian; here $\mathcal{N}(0, 1/r)$). $B$ starts at zero in training and ends
# wherever training takes it; we draw it Gaussian and scale it so that $\lVert BA \rVert$ is a tenth of
# $\lVert W \rVert$ (Frobenius norms): the lab's choice of a trained adapter's size, small beside the
# weight and large enough to change what the model says (measured below).

# %%
r, rho = 8, 0.1                                            # rank; |B·A| / |W| of every adapted matrix
g = torch.Generator().manual_seed(0)
by_hand = dict(smol.weights)                               # every other weight shared, not copied
for layer in range(smol.config.n_layers):
    for proj in ("q_proj", "v_proj"):                      # the query and value projections
        name = f"model.layers.{layer}.self_attn.{proj}.weight"
        W = smol.weights[name]                             # [out, in]
        A = torch.randn(r, W.shape[1], generator=g) / r**0.5   # [r, in]: LoRA's Gaussian start
        B = torch.randn(W.shape[0], r, generator=g)        # [out, r]: where training took it ...
        B *= rho * W.norm() / (B @ A).norm()               # ... scaled to a tenth of W's norm
        by_hand[name] = W + B @ A                          # the adapter, merged into the weight

# %% [markdown]
# `lab.updates.lora_factors` draws the same adapter (it keeps $A$ and $B$ apart, as an adapter file does),
# and `lora_merged` merges it into a model with a manifest of its own. Check the hand-built weights against
# it, then ask what the adapter changed: which matrices, by how much, and the rank of each update.

# %%
adapted = lora_merged(smol, lora_factors(smol))
assert (r, rho) == (LORA_RANK, LORA_NORM)
assert all(torch.equal(by_hand[k], adapted.weights[k]) for k in smol.weights)   # bit for bit
changed = [k for k in smol.weights if not torch.equal(adapted.weights[k], smol.weights[k])]
rows = {}
for name in [f"model.layers.{layer}.self_attn.{p}_proj.weight"   # the first and the last layer's q and v
             for layer in (0, smol.config.n_layers - 1) for p in "qv"]:
    delta = adapted.weights[name] - smol.weights[name]     # [out, in]
    sv = torch.linalg.svdvals(delta)                       # singular values, largest first
    rows[name.removeprefix("model.")] = {"shape": "x".join(map(str, delta.shape)),
                                         "|ΔW| / |W|": (delta.norm() / smol.weights[name].norm()).item(),
                                         "rank (σ > 1e-4 σ₁)": int((sv > 1e-4 * sv[0]).sum())}
print(f"{len(changed)} of {len(smol.weights)} weight tensors changed: the q and v projections of "
      f"{smol.config.n_layers} layers")
assert len(changed) == 2 * smol.config.n_layers and all(v["rank (σ > 1e-4 σ₁)"] == r for v in rows.values())
show(pd.DataFrame(rows).T)

# %% [markdown]
# Same shapes, other weights: another manifest. The cache refuses to be continued by the adapted model, and a
# backend that holds the base model's state when the adapter is swapped in recomputes.

# %%
print("manifest: base", smol.manifest[:16], "... adapted", adapted.manifest[:16], "...")
assert adapted.manifest != smol.manifest
try:
    ch04.step(adapted, ids[-1], ch04.prefill(smol, ids[:-1]))
except CacheMismatchError:
    print("refused: the adapted model continuing the base model's cache")
b = CachedBackend(smol, ch04.static_for(smol, 64))
b.next_logits(ids[:-1])
b.model, b.cache_factory = adapted, ch04.static_for(adapted, 64)   # the adapter swap
b.next_logits(ids)
print(f"after the swap: hits {b.hits}, misses {b.misses} (the second call recomputed)")
assert (b.hits, b.misses) == (0, 2)

# %% [markdown]
# What reusing the base model's cache would cost the adapted model is measured with the other hazards,
# next.
#
# ## Eight ways to reuse a cache wrongly
#
# Each trial takes a prefix of held-out Shakespeare and the token that follows, builds a cache the wrong
# way, and compares the next-token scores it gives with a correct computation (`forward` without a cache
# on the right sequence). Where the cache itself refuses the wrong call (the two hazards that change the
# weights), the trial records the refusal, then erases the cache's record (`cache.owner = None`) to
# measure what the reuse would have done without it. Then it puts the same situation to a
# `CachedBackend`: the backend holds the state the wrong reuse started from and is asked for the right
# request. Does it refuse, and are its scores then right?
#
# The in-place hazard is the reinforcement-learning loop: a private copy of the weights fills the cache,
# then takes one optimizer step in place (`lab.updates.STEP_LR` per element, a small fraction of a
# weight's size, as a real step is), and the next token is read through the stale cache; the backend
# serves that same model object.
#
# The LoRA swap is measured beside them (`ch04.lora_hazard`): a backend serves a prefix with the base
# model, the adapter built above is swapped in, and the adapted model reads the held-out tokens that follow
# (`S["continuation"]` of them) through a copy of the base model's cache. Its first position makes a row of
# the same table; the oracle is the adapted model recomputed from scratch.

# %%
show(pd.DataFrame({"what goes wrong": ch04.HAZARDS,
                   "identity that changes": {k: v or "none" for k, v in ch04.IDENTITY_CHANGES.items()}}))

# %% [markdown]
# The trials show a progress bar; in quick mode there are fewer of them.

# %%
haz = ch04.hazards(smol, S["trials"], S["prefix"])
lora = ch04.lora_hazard(smol, S["trials"], S["prefix"], S["continuation"])
table = pd.DataFrame({name: {"median |Δ logit|": r["delta_median"], "max |Δ logit|": r["delta_max"],
                             "same top token": f"{r['argmax_agree']}/{r['trials']}",
                             "KL, median (nats)": r["kl_median"],
                             "cache refuses": f"{r['refused_by_cache']}/{r['trials']}",
                             "backend refuses": f"{r['refused']}/{r['trials']}",
                             "backend correct": f"{r['backend_correct']}/{r['trials']}"}
                      for name, r in (haz | {"lora_adapter": lora}).items()}).T
show(table, digits=2)

# %% [markdown]
# $\left\lvert \Delta\,\text{logit} \right\rvert$ is the absolute difference of the scores over the whole
# vocabulary; KL is $\mathrm{KL}(\text{correct} \,\Vert\, \text{wrong})$ of the next-token distributions.
# The left panel shows how far the scores move (a log axis: the hazards span several orders of
# magnitude); the right one, in how many trials the top token is still the right one.

# %%
fig = ch04.plot_hazards(haz | {"lora_adapter": lora})

# %%
def loudness(kept):                  # the share of trials (or positions) whose top token stayed the right one
    return "loud" if kept < 0.5 else "quiet" if kept >= 0.9 else "in between"


for name, r in haz.items():
    print(f"{name:22s} top token kept in {r['argmax_agree']:2d}/{r['trials']} trials: "
          f"{loudness(r['argmax_agree'] / r['trials'])}; "
          f"refused by the backend in {r['refused']}/{r['trials']}, by the cache in {r['refused_by_cache']}")
print(f"{'lora_adapter':22s} top token kept at {lora['cont_argmax_agree']}/{lora['positions']} positions of the "
      f"continuation: {loudness(lora['cont_argmax_agree'] / lora['positions'])}; refused by the backend in "
      f"{lora['refused']}/{lora['trials']}, by the cache in {lora['refused_by_cache']}")
print("the quietest, by the median KL:", min(haz, key=lambda n: haz[n]["kl_median"]))
changed = [n for n in haz if ch04.IDENTITY_CHANGES[n]]
every = all(h["refused"] == h["backend_correct"] == h["trials"] for h in [haz[n] for n in changed] + [lora])
print("every identity change refused by the backend, its scores then correct:", "yes" if every else "NO")

# %% [markdown]
# ### The LoRA swap, along the continuation
#
# One position says little about an adapter: its effect is on every token. Over the whole continuation, the
# adapted model reading the base model's cache against the adapted model recomputed (the oracle), and, for
# scale, the base model without the adapter against the same oracle:

# %%
n = lora["positions"]
show(pd.DataFrame({
    "adapted model, base model's cache": {"largest |Δ logit|": lora["cont_delta_max"],
                                          "same top token": f"{lora['cont_argmax_agree']}/{n}",
                                          "KL, mean (nats)": lora["cont_kl_mean"]},
    "base model, no adapter": {"largest |Δ logit|": "-", "same top token": f"{lora['base_argmax_agree']}/{n}",
                               "KL, mean (nats)": lora["base_kl_mean"]}}).T, digits=3)
lora_fig = ch04.plot_lora(lora)

# %%
print(f"the stale cache keeps the oracle's top token at {lora['cont_argmax_agree'] / n:.0%} of positions "
      f"(the base model: {lora['base_argmax_agree'] / n:.0%}); its KL is "
      f"{lora['cont_kl_mean'] / lora['base_kl_mean']:.0%} of the adapter's own, "
      f"{lora['kl_first_half'] / lora['base_kl_first_half']:.0%} over the first half of the continuation "
      f"and {lora['kl_second_half'] / lora['base_kl_second_half']:.0%} over the second")

# %% [markdown]
# The stale cache undoes part of the adapter, not all of it: the continuation's own tokens are computed
# with the adapted weights, and only the cached prefix is the base model's. The further the continuation
# runs, the smaller the prefix's share of what attention reads, and the smaller the damage — here a
# prefix of `S["prefix"]` tokens; a long system prompt served from a stale cache stays the larger share for
# much longer.

# %%
m["hazards"], m["lora"] = haz, lora
beside("ch04", "ch04.hazards", "ch04.lora", values=ch04.values(m),
       why=f"your run makes {S['trials']} trials of each hazard, the book {FULL['trials']}: one trial is "
           f"{100 / S['trials']:.0f}% of yours, so a trial or two decides the thresholds the sentences set (half "
           "the trials, nine in ten).")

# %% [markdown]
# **Loud and quiet**, as the lines above classify them (loud: the top token moves in most trials; the LoRA
# swap, whose effect is on every token, by the positions of its continuation, far more than its trials).
# Another prompt, a wrong position and draft tokens left behind move the top token in most trials: a
# test that compares generated text catches them. The MLP scaled by 1.02, the in-place update and the
# bfloat16 cache move every score a little and leave the top token alone: greedy text looks right while
# every probability is off, and sampling, beam search or anything that reads the probabilities inherits
# the error. One optimizer step is the quietest of all, and a cache kept across several steps drifts
# further with each. The LoRA swap, at a trained adapter's size, falls in between: over the continuation
# it keeps the top token at most positions and moves it at the rest, too few for a glance at the text and
# far too many for the probabilities to be trusted.
#
# Every hazard that changes the identity — the ids, the manifest, the dtypes — is refused by the
# backend, and its scores are then the correct ones. The three that continue a cache with other weights
# (the MLP scaled by 1.02, the optimizer step, the LoRA swap) are refused by the cache itself too, before
# any key is computed. The bfloat16 hazard is not: its values were
# copied into a new cache, and a copy carries no record. The stale offset changes no identity: it is a
# wrong call on the right state, and the backend never makes it, because it takes the position from the
# cache's own length.
#
# A refusal costs a recomputation, no more:

# %%
cost = refusal_cost(smol, S["prefix"])
print(f"a refused call {cost['refused'] * 1e3:.3g} ms, a plain recomputation {cost['recompute'] * 1e3:.3g} ms, "
      f"a ratio of {cost['refused'] / cost['recompute']:.2f}")

# %%
m["refusal"] = cost
beside("ch04", "ch04.refusal", values=ch04.values(m),
       why="your run takes the medians of as many interleaved rounds as the book's, on another machine and "
           "beside whatever else it runs: a refusal costs a recomputation and a little more, and how much more "
           "moves with the machine.")

# %% [markdown]
# ## Record
#
# Everything measured above goes into section `ch04` of the results file; the figure drawn above is
# saved, not drawn again.

# %%
ch04.record(m, hazards_figure=fig, lora_figure=lora_fig)
print("wrote section ch04 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# ### 1. A store of prefixes
#
# Keep several caches keyed by identity, reuse the longest stored prefix of each request, and choose an
# eviction rule. `lookup(identity, ids)` returns a cache holding exactly the state of `ids[:n]`, with
# `n < len(ids)`, stored under the same identity — or `(None, 0)`. `insert(identity, ids, cache)` keeps
# the state of `ids`. `check_prefix_store` serves a stream of requests that share system prompts (some to
# a fine-tuned variant of the model, some from another tenant) through your store, compares every answer
# with recomputation and reports your hit rate. It fails a store that offers a state under another
# identity, offers more than the common prefix, or keeps nothing; one that runs the model to make a state
# (a store hands out forks of the states it was given: the model's code raises while its methods run);
# and one that keeps more than `capacity` states (the check counts the caches still alive afterwards, and the
# bytes of the tensors still alive, in caches or not).

# %%
from lab.exercises import ch04 as ex


class MyPrefixStore:
    def __init__(self, capacity):
        self.capacity = capacity

    def lookup(self, identity, ids):
        raise NotImplementedError("your answer: (a cache holding exactly ids[:n], n) or (None, 0)")

    def insert(self, identity, ids, cache):
        raise NotImplementedError("your answer")


try:
    ex.check_prefix_store(MyPrefixStore)
except NotImplementedError:
    print("not attempted yet")

# %% [markdown]
# A reference solution (least recently used) is in `lab/exercises/ch04_solutions.py`; the tests run it.
#
# ### 2. Open-ended: what does a key cost on your machine?
#
# Write `key_cost_us(T)`: build T token ids, time one prefix key over them — `prefix_key`, or your own
# `minimal_key` from the top of this notebook — with `lab.bench.time_call(fn, warmup=5, reps=200)`, and
# return the median in microseconds (`result["median"] * 1e6`). The check also runs it at 4 × T ids, where
# a key must cost more (it reads every id), then sets your number beside the book's at 4,096 ids. Then
# ask: what share of a decode step on your machine is it, and what would a per-page chained hash save?

# %%
def key_cost_us(T):
    raise NotImplementedError("your answer: microseconds per key over T ids, measured with lab.bench.time_call")


try:
    ex.check_key_cost(key_cost_us, T=4096)
except NotImplementedError:
    print("not attempted yet")
