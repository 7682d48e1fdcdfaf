# ---
# jupyter:
#   jupytext:
#     formats: py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Chapter 2 — Building the cache
#
# Chapter 1 showed that the keys and values of earlier positions never change. Here we keep them: two
# cache designs behind one interface, a forward that runs prefill, chunked prefill and decode through the
# same code, and checks that the cached model computes the same function as recomputation — at every
# step, against two independent oracles.

# %%
import platform

import torch
import transformers

from lab import results
from lab.cache import ConcatCache, StaticCache, cache_bytes
from lab.engine import CachedBackend, RecomputeBackend, generate
from lab.experiments import ch02_build as ch02
from lab.models import forward_cached, load

print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"threads {torch.get_num_threads()}")
QUICK = results.quick()
S = ch02.settings(QUICK)
print("quick mode" if QUICK else "full mode", "-> results in", results.results_path())

# %% [markdown]
# ## The interface
#
# A forward step of T new positions calls `keys, values = cache.update(layer, k, v)` for every layer
# (k, v are `[batch, kv_heads, T, head_dim]`) and then `cache.advance(T)`. `ConcatCache` grows each layer
# by concatenation; `StaticCache` writes into buffers allocated once for a maximum length.

# %%
smol = load("smollm2")
cfg = smol.config
ids = torch.tensor([smol.tokenizer.encode("To be, or not to be, that is the question:")])  # [1, T]
for cache in (ConcatCache(cfg), StaticCache(cfg, max_tokens=64)):
    with torch.inference_mode():
        logits = forward_cached(ids, smol.weights, cfg, cache)    # prefill
        nxt = logits[:, -1:].argmax(-1)                           # [1, 1]
        forward_cached(nxt, smol.weights, cfg, cache)             # one decode step
    print(cache)
    print("   nbytes", cache.nbytes(), "= formula", cache_bytes(cfg, cache.capacity() or cache.length))

# %% [markdown]
# ## Greedy decoding: identical tokens
#
# The engine cannot tell a cached backend from a recomputing one, except by the work done.

# %%
prompt = smol.tokenizer.encode("Friends, Romans, countrymen, lend me your ears;")[:17]
n_new = S["steps"]["smollm2"]
plain = generate(RecomputeBackend(smol), prompt, n_new)
for design in ("concat", "static"):
    backend = CachedBackend(smol, lambda d=design: ch02.DESIGNS[d](cfg, len(prompt) + n_new))
    cached = generate(backend, prompt, n_new)
    print(f"{design:>6}: identical tokens {cached.tokens == plain.tokens}, positions {backend.positions} "
          f"(hits {backend.hits}, misses {backend.misses}), TPOT {cached.tpot * 1e3:.1f} ms vs "
          f"{plain.tpot * 1e3:.1f} ms uncached")
print(repr(smol.tokenizer.decode(plain.tokens)))

# %% [markdown]
# ## Logits at every step, against two oracles
#
# Identical tokens could hide small differences. At every step we compare the cached logits with
# recomputation of the whole prefix, and with the transformers model stepping with its own cache.

# %%
runs = {(m.name, d): ch02.step_agreement(m, d, S["prompt"], S["steps"][m.name])
        for m in (smol, load("gpt2-random")) for d in ch02.DESIGNS}
for (model, design), r in runs.items():
    print(f"{model:>12} {design:>6}: max |Δ| vs recompute {max(r['vs_recompute']):.2e}, "
          f"vs transformers {max(r['vs_library']):.2e} (logits up to {r['scale']:.1f}); "
          f"tokens identical: {r['tokens_identical']}")
ch02.plot_agreement(runs);

# %% [markdown]
# ## Chunked prefill, fork, crop
#
# A long prompt can be prefilled in chunks (to bound memory, or to interleave with other requests'
# decode steps). The offset causal mask makes every chunk see the cached positions and itself.

# %%
chunked = {d: ch02.chunked_prefill(smol, d, S["chunk_tokens"]) for d in ch02.DESIGNS}
print("chunked prefill, max |Δ| against one shot:", chunked)
fork = {d: ch02.fork_check(smol, d, S["fork_prefix"]) for d in ch02.DESIGNS}
for d, r in fork.items():
    print(f"fork {d}: parent {r['parent_vs_recompute']:.1e}, child {r['child_vs_recompute']:.1e} from "
          f"recomputation; parent untouched {r['parent_untouched']}; "
          f"shared {r['shared_bytes'] / 2**20:.1f} of {r['parent_bytes'] / 2**20:.1f} MiB")
crop = {d: ch02.crop_check(smol, d) for d in ch02.DESIGNS}
print("crop then continue vs never held, max |Δ|:", crop)
sizes = {d: ch02.bytes_check(smol, d) for d in ch02.DESIGNS}
print("bytes:", sizes)

# %% [markdown]
# ## Errors are loud, and leave the cache as it was

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
print(cache)

# %% [markdown]
# ## Record

# %%
m = dict(settings=S, manifests={"smollm2": smol.manifest, "gpt2-random": load("gpt2-random").manifest},
         runs=runs, chunked=chunked, fork=fork, crop=crop, bytes=sizes)
ch02.record(m)
print("wrote section ch02 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# 1. **The mask offset.** Write `offset_causal_mask(start, T)`: which of the `start + T` keys each of T new
#    queries may see. The check runs a chunked prefill with your mask against a one-shot prefill, then
#    shows where the mask without the offset (`is_causal=True`) first goes wrong.
# 2. **How many sequences fit?** Write `sequences_that_fit(memory_bytes, weight_bytes, config, tokens,
#    dtype_bytes)`: how many sequences of `tokens` positions fit beside the weights.
# 3. **Implement crop.** Write `crop(cache, n)` for a `ConcatCache` without calling its own `crop`.

# %%
from lab.exercises import ch02 as ex


def offset_causal_mask(start, T):
    raise NotImplementedError("your answer: a bool tensor [T, start + T]")


def sequences_that_fit(memory_bytes, weight_bytes, config, tokens, dtype_bytes):
    raise NotImplementedError("your answer")


def crop(cache, n):
    raise NotImplementedError("your answer")


for check, answer in ((ex.check_mask_offset, offset_causal_mask), (ex.check_sequences_that_fit, sequences_that_fit),
                      (ex.check_crop, crop)):
    try:
        check(answer)
    except NotImplementedError:
        print(check.__name__, ": not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch02_solutions.py`; the test suite runs every check on them.
