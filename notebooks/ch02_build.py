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
# # Chapter 2 — Building the cache
#
# Chapter 1 showed that the keys and values of earlier positions never change once computed: the causal
# mask makes them functions of earlier tokens only. This chapter keeps them instead of recomputing them.
#
# We first write a cache of about fifteen lines into the attention of SmolLM2, in plain PyTorch, and
# check that it generates the same tokens and the same logits as recomputation. Then we check that the
# `lab` package's two caches, `ConcatCache` and `StaticCache`, compute the same thing as ours, and say
# what their extra lines buy. Only then do we measure: logits at every decode step against two
# independent oracles, chunked prefill, fork, crop, bytes, and the time of one decode step.
#
# Unless `LAB_FULL=1` is set (as `make results` does), the notebook runs in quick mode: shorter runs,
# results written to a temporary file, the committed `results/results.json` untouched.

# %%
import lab  # first, before torch: it sets OpenMP's wait policy, which torch reads once, when it loads

import platform

import matplotlib
import pandas as pd
import torch
import torch.nn.functional as F
import transformers
from IPython.display import display
from tqdm.auto import tqdm

from lab import results
from lab.cache import StaticCache, make_cache
from lab.experiments import ch02_build as ch02
from lab.experiments.tables import show, number
from lab.models import forward, forward_cached, llama, load
from lab.book.verdicts import beside

print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"matplotlib {matplotlib.__version__}, pandas {pd.__version__}, threads {torch.get_num_threads()}")
print(lab.threads.describe())
QUICK = results.quick()
S, FULL = ch02.settings(QUICK), ch02.settings(False)      # FULL: the book's settings, to say what quick mode skips
print("quick mode" if QUICK else "full mode", "-> results written to", results.results_path())

# %% [markdown]
# ## 1. A cache in fifteen lines
#
# A transformer layer computes, for every new token, a query, a key and a value. Attention compares the
# query with the keys of every position so far and averages their values. Without a cache, each decode
# step recomputes the keys and values of the whole prefix. With a cache, a layer keeps them:
#
# - **two lists per layer** — the keys and the values, each `[batch, kv_heads, positions, head_dim]`;
#   `update(i, k, v)` appends the new positions of layer `i` and returns all of them;
# - **a length** — how many positions the cache holds; it grows once per forward, after every layer.
#
# The forward that uses it changes in two more places, both about *where* the new tokens sit:
#
# - **the position offset.** SmolLM2 rotates each query and key by an angle proportional to its
#   position (RoPE). The new tokens sit at positions $\texttt{length}, \texttt{length} + 1, \ldots$, not at 0.
#   A forward that started again at 0 would rotate every new key as if it were the first token of the text.
# - **the offset causal mask.** A chunk of `T` new queries after `start` cached positions must see all
#   cached keys and the new keys up to itself: query $i$ sees keys $0, \ldots, \texttt{start} + i$. That is a
#   `[T, start + T]` mask, the causal triangle shifted right by `start`. With `start = 0` it is the
#   ordinary causal mask; for one decode query it is a row of ones. It matters for *chunked prefill*:
#   a long prompt fed in pieces, to bound the memory of one forward or to interleave with other
#   requests' decode steps.
#
# Everything else — embeddings, the layers' weights, the output head — is chapter 1's `llama` code,
# unchanged. We pass our attention function to its `block`.

# %%
class MyCache:
    """Two lists per layer, keys and values [B, H_kv, positions, D], grown by concatenation."""

    def __init__(self, n_layers):
        self.keys, self.values = [None] * n_layers, [None] * n_layers
        self.length = 0                                          # positions held

    def update(self, i, k, v):                                   # append layer i's new positions
        if self.keys[i] is not None:
            k = torch.cat([self.keys[i], k], dim=2)              # [B, H_kv, length + T, D]
            v = torch.cat([self.values[i], v], dim=2)
        self.keys[i], self.values[i] = k, v
        return k, v


def my_offset_mask(start, T):                                    # query i sits at start + i
    return torch.arange(start + T)[None, :] <= torch.arange(start, start + T)[:, None]  # [T, start+T]


def my_forward_cached(ids, model, cache):
    """Logits [B, T, V] of the T tokens `ids` [B, T] that follow the cache's positions."""
    cfg, w = model.config, model.weights
    start, T = cache.length, ids.shape[1]
    positions = torch.arange(start, start + T)                   # NEW: RoPE at the true positions
    mask = my_offset_mask(start, T)                              # NEW: the triangle shifted by start

    def attend(i, q, k, v):
        keys, values = cache.update(i, k, v)                     # NEW: every position so far
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, enable_gqa=True)

    x = llama.embed(ids, w)
    rope_cs = llama.rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
    for i in range(cfg.n_layers):
        x = llama.block(x, w, i, cfg, attend, rope_cs)
    cache.length += T                                            # NEW: the T positions are kept
    return llama.head(x, w, cfg)


# %% [markdown]
# The cache is the eleven lines of `MyCache` and the two of `my_offset_mask`; the forward differs from
# the uncached one of chapter 1 in the four lines marked `NEW`.
#
# Here is the mask for a chunk of 4 new queries after 3 cached positions (1: the query may see the key),
# beside what `scaled_dot_product_attention(..., is_causal=True)` would use for the same shapes. PyTorch
# aligns its triangle to the top-left corner: query $i$ sees keys $0, \ldots, i$ only. For a chunk after cached
# positions that is wrong for *every* query, the last one included.

# %%
start, T = 3, 4
cols = [f"key {j}" for j in range(start + T)]
rows = [f"query at {start + i}" for i in range(T)]
display(show(pd.DataFrame(my_offset_mask(start, T).int().numpy(), index=rows, columns=cols),
             caption="offset causal mask (start = 3, T = 4)"))
display(show(pd.DataFrame(torch.ones(T, start + T, dtype=torch.bool).tril().int().numpy(), index=rows, columns=cols),
             caption="is_causal=True: the triangle at the top-left"))

# %% [markdown]
# ## 2. Does it compute the same thing?
#
# The oracle is recomputation: `lab.models.forward` runs the whole sequence with no cache. We decode
# greedily from a prompt both ways, prefilling our cache in chunks of 5 tokens so the offset mask is
# exercised, and compare the tokens and, at every step, the logits.
#
# Tolerance: the two ways sum the same products in a different order (a `[1, T]` attention against a
# `[T, T]` one), so float32 rounding differs by a few units in the last place per operation. We allow
# $10^{-4}$ times the largest logit; a real bug — a wrong position, a missing offset — moves logits by whole
# units, as the last two rows of the table show.

# %%
smol = load("smollm2")
cfg = smol.config
prompt = torch.tensor([smol.tokenizer.encode("To be, or not to be, that is the question:")])  # [1, P]
n_new = S["steps"]["smollm2"]


@torch.inference_mode()
def greedy_recompute(prompt, n):
    ids, logits = prompt, []
    for _ in range(n):
        out = forward(ids, smol.weights, cfg)[:, -1]                     # [1, V]: the whole prefix again
        logits.append(out)
        ids = torch.cat([ids, out.argmax(-1, keepdim=True)], dim=1)
    return ids[0, prompt.shape[1]:].tolist(), torch.cat(logits)


@torch.inference_mode()
def greedy_cached(prompt, n, step, cache, chunk=5):
    """step(ids, cache) -> logits; the prompt goes in chunks of `chunk`, then one token per step."""
    for s in range(0, prompt.shape[1], chunk):
        out = step(prompt[:, s:s + chunk], cache)[:, -1]
    tokens, logits = [], []
    for _ in range(n):
        logits.append(out)
        tokens.append(int(out.argmax()))
        out = step(torch.tensor([[tokens[-1]]]), cache)[:, -1]
    return tokens, torch.cat(logits)


ref_tokens, ref_logits = greedy_recompute(prompt, n_new)
my_tokens, my_logits = greedy_cached(prompt, n_new, lambda ids, c: my_forward_cached(ids, smol, c),
                                     MyCache(cfg.n_layers))
tol = 1e-4 * ref_logits.abs().max().item()


# two ways to get it wrong, to see what a bug looks like
def buggy_forward(ids, c, positions, mask):
    def attend(i, q, k, v):
        keys, values = c.update(i, k, v)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, is_causal=mask is None,
                                              enable_gqa=True)

    x = llama.embed(ids, smol.weights)
    rope_cs = llama.rope_tables(positions, cfg.head_dim, cfg.rope_theta, x.dtype)
    for i in range(cfg.n_layers):
        x = llama.block(x, smol.weights, i, cfg, attend, rope_cs)
    c.length += ids.shape[1]
    return llama.head(x, smol.weights, cfg)


def no_offset(ids, c):  # RoPE restarts at 0 in every forward
    return buggy_forward(ids, c, torch.arange(ids.shape[1]), my_offset_mask(c.length, ids.shape[1]))


def top_left(ids, c):   # is_causal=True instead of the offset mask
    return buggy_forward(ids, c, torch.arange(c.length, c.length + ids.shape[1]), None)


rows = {"our cache": (my_tokens, my_logits),
        "bug: positions restart at 0": greedy_cached(prompt, n_new, no_offset, MyCache(cfg.n_layers)),
        "bug: is_causal=True, no offset": greedy_cached(prompt, n_new, top_left, MyCache(cfg.n_layers))}
table = pd.DataFrame({name: {"tokens against recomputation": toks == ref_tokens,
                             "largest |Δ logit|": (lg - ref_logits).abs().max().item(),
                             "within tolerance": (lg - ref_logits).abs().max().item() <= tol}
                      for name, (toks, lg) in rows.items()}).T
print(f"tolerance: {tol:.2g} (1e-4 x the largest logit, {ref_logits.abs().max():.1f})")
display(show(table, digits={"largest |Δ logit|": 2},
             words={"tokens against recomputation": ("identical", "different")}))
assert my_tokens == ref_tokens and (my_logits - ref_logits).abs().max() <= tol
print("greedy continuation (↵: a new line): “" + smol.tokenizer.decode(my_tokens).replace("\n", "↵") + "”")

# %%
bugs = {name: (lg - ref_logits).abs().max().item() for name, (_, lg) in rows.items() if name.startswith("bug")}
assert all(d > tol for d in bugs.values())  # both bugs move logits past the tolerance
print("; ".join(f"{name}: largest |Δ logit| {d:.2g}, {d / tol:,.0f}x the tolerance" for name, d in bugs.items()))

# %% [markdown]
# Our cache reproduces recomputation. Forgetting the position offset or the mask offset does not crash:
# the model still returns logits, and they are wrong. That is why every cache in this book is checked
# against recomputation, logit by logit.
#
# ## 3. `lab`'s caches do the same
#
# `lab.cache` has two contiguous designs behind one interface:
#
# - **`ConcatCache`** is ours with a protocol around it: `update(layer, k, v)` stores and returns all
#   positions; `advance(T)` commits the $T$ positions once every layer was served (until then they are
#   pending, and `crop(length)` drops them); `reset()`, `fork()`, `crop(n)` and `nbytes()` complete it.
# - **`StaticCache`** allocates one buffer per layer for `max_tokens` positions up front and writes new
#   positions into it by index (`k_buf[layer, :, :, start:end] = k`), as gpt-fast does.
#
# `lab.models.forward_cached` is our `my_forward_cached` for both model families, with the same four
# changes; there the cache's own `attend(i, q, k, v)` stores the new keys and values and applies the
# offset mask, as our `attend` does. `lab.cache.make_cache(design, config, max_tokens)` builds either
# design by name. We run the same greedy decode (same chunks) through both designs and compare with our
# version; they do the same arithmetic, so we hold them to the same tolerance.

# %%
rows = {}
for design in ch02.DESIGNS:  # "concat": a ConcatCache, "static": a StaticCache
    cache = make_cache(design, cfg, max_tokens=prompt.shape[1] + n_new + 1)
    toks, lg = greedy_cached(prompt, n_new, lambda ids, c: forward_cached(ids, smol.weights, cfg, c), cache)
    rows[type(cache).__name__] = {"tokens against ours": toks == my_tokens,
                  "largest |Δ logit| vs ours": (lg - my_logits).abs().max().item(),
                  "largest |Δ logit| vs recomputation": (lg - ref_logits).abs().max().item()}
    assert toks == my_tokens and (lg - my_logits).abs().max() <= tol
display(show(pd.DataFrame(rows).T, digits=2, words=("identical", "different")))

# %% [markdown]
# ### What the extra lines buy
#
# `lab`'s versions are longer than ours; the chapter lists them with the validation moved out to
# `lab/cache/checks.py`. What the extra lines buy:
#
# - **Errors that are loud and leave the cache as it was.** Wrong shapes, dtype or device, a layer out of
#   range, more positions than a `StaticCache` holds, a crop beyond the length: each raises a typed
#   `CacheError` *before* anything changes.
# - **Pending positions.** Our `MyCache` grows layer by layer; if a forward fails halfway, its layers
#   disagree on the length. `lab`'s caches count positions per layer until `advance`, so a failed step
#   can be dropped with `crop(length)`.
# - **Fork, crop, nbytes.** Continue one prefix two ways, roll back rejected tokens, count the memory.
# - **Preallocation (`StaticCache`).** Nothing is allocated while decoding and the tensors never change
#   shape. A concatenating cache allocates a new, longer tensor per layer at every step and copies the
#   old one into it; that copy grows with the length, and memory comes and goes in ever larger blocks.
#   Fixed shapes are also what a compiler (`torch.compile`) or a captured CUDA graph needs. The price is
#   memory reserved for the longest sequence from the start, used or not — the problem chapter 5 solves
#   with pages.

# %%
from lab.cache import CacheError

cache = StaticCache(cfg, max_tokens=8)
for bad in (lambda: forward_cached(torch.zeros(1, 9, dtype=torch.long), smol.weights, cfg, cache),
            lambda: cache.update(0, torch.zeros(1, 3, 1, 64, dtype=torch.float16), torch.zeros(1, 3, 1, 64)),
            lambda: cache.update(30, torch.zeros(1, 3, 1, 64), torch.zeros(1, 3, 1, 64)),
            lambda: cache.crop(5)):
    try:
        bad()
    except CacheError as e:
        print(f"{type(e).__name__}: {e}")
print(f"and the cache is as it was: {cache.length} positions held, {cache.nbytes():,} bytes allocated")

# %% [markdown]
# ## 4. Measuring: logits at every step, against two oracles
#
# Now that the idea is checked, `lab.experiments.ch02_build` measures it more widely: SmolLM2 and a
# GPT-2-shaped model with random weights, both designs, every decode step compared with (a)
# recomputation of the whole prefix and (b) the transformers library's model stepping with its own
# cache (`past_key_values`), an implementation written independently of ours.

# %%
runs = {(m.name, d): ch02.step_agreement(m, d, S["prompt"], S["steps"][m.name])
        for m in tqdm((smol, load("gpt2-random")), desc="models") for d in ch02.DESIGNS}
display(show(pd.DataFrame({f"{model}, {design}": {
    "steps": len(r["tokens"]), "tokens against both": r["tokens_identical"],
    "max |Δ logit| vs recomputation": max(r["vs_recompute"]), "max |Δ logit| vs transformers": max(r["vs_library"]),
    "largest |logit|": r["scale"]} for (model, design), r in runs.items()}).T,
             digits={"max |Δ logit| vs recomputation": 2, "max |Δ logit| vs transformers": 2},
             words=("identical", "different")))
fig = ch02.plot_agreement(runs)

# %% [markdown]
# The same check in bfloat16: SmolLM2 loaded with `dtype=torch.bfloat16`, whose cache then stores
# bfloat16, against recomputation and transformers' model in bfloat16. bfloat16 keeps 8 significant bits,
# so one rounding step is $2^{-8}$ of a value: the differences are counted in those steps.

# %%
bf16 = ch02.step_agreement(smol.to(dtype=torch.bfloat16), "static", S["prompt"], S["steps"]["smollm2"])
print(f"bfloat16, static: max |Δ logit| {max(bf16['vs_recompute']):.3g} vs recomputation "
      f"({max(bf16['vs_recompute']) / (2**-8 * bf16['scale']):.1f} steps of the largest logit), "
      f"{max(bf16['vs_library']):.3g} vs transformers; greedy tokens "
      f"{'identical' if bf16['tokens_identical'] else 'different'} over {len(bf16['tokens'])} steps")

# %% [markdown]
# Where the two designs share one legend entry, their curves coincide: they compute bit for bit the same
# logits. How far the differences stay below the largest logit, in this run:

# %%
worst = max((max(r["vs_recompute"] + r["vs_library"]) / r["scale"], m, d) for (m, d), r in runs.items())
print(f"largest |Δ logit| / largest logit over every run: {number(worst[0], 2)} ({worst[1]}, {worst[2]}); "
      f"the tests allow 10⁻⁴: {'within' if worst[0] <= 1e-4 else 'OUTSIDE'}")

# %%
m = dict(settings=S, manifests={"smollm2": smol.manifest, "gpt2-random": load("gpt2-random").manifest},
         runs=runs, bf16=bf16)
beside("ch02", "ch02.agreement", values=ch02.values(m),
       why=f"your run decodes {S['steps']['smollm2']} steps of SmolLM2, the book {FULL['steps']['smollm2']}; but a "
           "tolerance of 10⁻⁴ of the largest logit leaves room for rounding, not for a bug: a differing verdict "
           "here is a real disagreement, not quick mode.")

# %% [markdown]
# ## 5. Chunked prefill, fork, crop, bytes
#
# - **Chunked prefill:** a prompt of `S["chunk_tokens"]` tokens fed in chunks of 1, 7 and 64 tokens,
#   against one shot.
# - **Fork:** after a long prefix, fork and continue parent and child with different tokens; each must
#   match recomputation, and the parent must be untouched. A `ConcatCache` fork shares its parent's
#   tensors (nobody writes into them); a `StaticCache` fork must copy (it writes in place).
# - **Crop:** after `S["crop_keep"]` positions, add `S["crop_drop"]` more, crop them away and continue;
#   compare with a cache that never held them.
# - **Bytes:** `nbytes()` against the formula
#   $2 \times \text{layers} \times \text{kv_heads} \times \text{head_dim} \times \text{bytes} \times \text{positions}$.

# %%
chunked = {d: ch02.chunked_prefill(smol, d, S["chunk_tokens"]) for d in ch02.DESIGNS}
fork = {d: ch02.fork_check(smol, d, S["fork_prefix"]) for d in ch02.DESIGNS}
crop = {d: ch02.crop_check(smol, d, S["crop_keep"], S["crop_drop"]) for d in ch02.DESIGNS}
sizes = {d: ch02.bytes_check(smol, d, S["bytes_tokens"], S["bytes_batch"]) for d in ch02.DESIGNS}
display(show(pd.DataFrame({d: {f"chunks of {c}": x for c, x in by_c.items()} for d, by_c in chunked.items()}).T,
             caption="chunked prefill: largest |Δ logit| against one shot", digits=2))
display(show(pd.DataFrame({d: {"parent, max |Δ logit| vs recomputation": r["parent_vs_recompute"],
                               "child, max |Δ logit| vs recomputation": r["child_vs_recompute"],
                               "parent untouched": r["parent_untouched"],
                               "shared (MiB)": r["shared_bytes"] / 2**20, "parent (MiB)": r["parent_bytes"] / 2**20}
                           for d, r in fork.items()}).T, caption=f"fork after {S['fork_prefix']} positions",
             digits={"parent, max |Δ logit| vs recomputation": 2, "child, max |Δ logit| vs recomputation": 2}))
display(show(pd.DataFrame({d: {"crop, then continue: max |Δ logit|": crop[d], "nbytes() (bytes)": sizes[d]["nbytes"],
                               "formula (bytes)": sizes[d]["formula"], "storage held (bytes)": sizes[d]["held"]}
                           for d in ch02.DESIGNS}).T, digits={"crop, then continue: max |Δ logit|": 2},
             caption=f"crop; bytes of {S['bytes_batch']} sequences of {S['bytes_tokens']} positions"))

# %%
m |= dict(chunked=chunked, fork=fork, crop=crop, bytes=sizes)
beside("ch02", "ch02.fork", values=ch02.values(m),
       why=f"your run forks after {S['fork_prefix']} positions, the book after {FULL['fork_prefix']}: what the "
           "two designs share is a matter of design, not of length, so a differing verdict is a real "
           "disagreement.")

# %% [markdown]
# ## 6. The time of one decode step
#
# What does preallocation buy in time on this machine? We time one SmolLM2 decode step after
# `decode_context` cached positions, for both designs, in turns (so that a busy spell of the machine hits
# both alike), cropping each cache back before every step. On a CPU the copy a concatenation makes is
# small beside the model's matrix products, so expect the two to be close; the point of a static cache
# is fixed shapes and no allocation, which matter most on a GPU.

# %%
decode = ch02.decode_step_times(smol, S["decode_context"], S["decode_rounds"])
display(show(pd.DataFrame({d: {"median (ms)": r["median"] * 1e3, "IQR (ms)": r["iqr"] * 1e3, "steps timed": r["n"]}
                           for d, r in decode.items()}).T,
             caption=f"one decode step after {S['decode_context']} positions, "
                     f"{torch.get_num_threads()} thread{'s' if torch.get_num_threads() > 1 else ''}"))

# %%
ratio = decode["static"]["median"] / decode["concat"]["median"]
print(f"static / concat: {ratio:.2f}, the static cache "
      + ("faster" if ratio < 1 else "slower") + f" by {abs(1 - ratio):.0%} at this length"
      + (", within a few percent: close, as expected on a CPU" if abs(1 - ratio) < 0.1 else ""))

# %% [markdown]
# ## Record
#
# The measurements go into section `ch02` of the results file named in the first cell; the figure drawn
# above is saved as it is.

# %%
m["decode"] = decode
ch02.record(m, drawn={"agreement": fig})
print("wrote section ch02 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# Each check runs your function against an independent oracle and enforces the exercise's rule.
#
# 1. **The mask offset.** Write `offset_causal_mask(start, T)`: a bool `[T, start + T]`, which of the
#    `start + T` keys each of $T$ new queries may see. Rule: write it yourself — `lab`'s own
#    `offset_causal_mask` raises while the check runs your function (and so does PyTorch's
#    `causal_lower_right`, which builds the same mask). The check runs a chunked prefill with your mask
#    against a one-shot forward, compares your mask at large offsets drawn fresh with a shifted triangle,
#    then shows where `is_causal=True` first goes wrong.
# 2. **How many sequences fit?** Write `sequences_that_fit(memory_bytes, weight_bytes, config, tokens,
#    dtype_bytes)`: how many whole sequences of `tokens` positions fit in `memory_bytes` beside the
#    weights. Rule: work it out from the model's shape (`config.n_layers`, `n_kv_heads`, `head_dim`);
#    `lab`'s caches, `cache_bytes` and `bytes_per_position` raise while the check runs your function.
# 3. **Implement crop.** Write `crop(cache, n)` for a `ConcatCache`: keep the first $n$ positions and
#    release the memory of the rest. Rule: do not call the cache's own `crop` (nor `reset`): they raise
#    while your function runs, however you reach them (on the cache, unbound, through `super()`).
# 4. **Open-ended: time a decode step on your machine.** Build a `ConcatCache` and a
#    `StaticCache(cfg, max_tokens=context + 1)`, prefill `context` positions of SmolLM2 (the book's
#    context is printed below), then time one decode step with `lab.bench.time_steps(setup, step)`,
#    where `setup` crops the cache back to `context` (untimed) and `step` runs `forward_cached` on one
#    token. Pass each median in ms to `ex.compare_decode_step(design, ms)`: it prints yours beside the
#    book's, with the book's machine. Is the static cache faster on yours? Try a longer context.

# %%
from lab.exercises import ch02 as ex


def offset_causal_mask(start, T):
    raise NotImplementedError("your answer: a bool tensor [T, start + T]")


def sequences_that_fit(memory_bytes, weight_bytes, config, tokens, dtype_bytes):
    raise NotImplementedError("your answer")


def crop(cache, n):
    raise NotImplementedError("your answer")


def decode_step_ms(design, context):
    raise NotImplementedError("your measurement: the median ms of one decode step")


for check, answer in ((ex.check_mask_offset, offset_causal_mask), (ex.check_sequences_that_fit, sequences_that_fit),
                      (ex.check_crop, crop)):
    try:
        check(answer)
    except NotImplementedError:
        print(f"{check.__name__}: not attempted yet")
context = ch02.settings(False)["decode_context"]  # the book's context (a full run)
try:
    for design in ("concat", "static"):
        ex.compare_decode_step(design, decode_step_ms(design, context))
except NotImplementedError:
    print("compare_decode_step: not attempted yet (the book's context is", context, "positions)")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch02_solutions.py` (`decode_step_ms` there shows one way to
# time the step); the test suite runs every check on them and on the shortcuts each rule forbids.
