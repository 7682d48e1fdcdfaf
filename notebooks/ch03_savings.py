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
# # Chapter 3 — What the cache saves
#
# Chapter 2 showed the cache computes the same function. Here we measure what it buys and what it
# costs: the time of one decode step against context length, with and without a cache; the engine end to
# end; the lab's decode against the transformers library's own; and the memory each design really takes.

# %%
import platform

import torch
import transformers

from lab import results
from lab.experiments import ch03_savings as ch03
from lab.experiments import library, memory
from lab.models import load

print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"threads {torch.get_num_threads()}, CUDA available: {torch.cuda.is_available()}")
QUICK = results.quick()
S = ch03.settings(QUICK)
print("quick mode" if QUICK else "full mode", "-> results in", results.results_path())

# %% [markdown]
# ## One decode step, with and without a cache
#
# Uncached: a forward over all T + 1 positions. Cached: one new position, attending over T cached keys
# and values. Warm-up excluded, median of several runs; between runs the cache is cropped back to T
# positions, untimed.

# %%
smol, gpt2 = load("smollm2"), load("gpt2-random")
times = {m.name: ch03.step_times(m, S["contexts"][m.name], S["reps"], S["warmup"]) for m in (gpt2, smol)}
for name, by_T in times.items():
    sp = ch03.speedups(by_T)
    print(name)
    for T, row in by_T.items():
        print(f"  T={T:>5}: uncached {row['uncached']['median'] * 1e3:8.1f} ms   "
              f"concat {row['concat']['median'] * 1e3:6.1f} ms ({sp[T]['concat']:5.1f}x)   "
              f"static {row['static']['median'] * 1e3:6.1f} ms ({sp[T]['static']:5.1f}x)")
    print("  the cache pays from T =", ch03.pays_from(by_T))
ch03.plot_step_times(times);

# %% [markdown]
# ## End to end: the engine, 32 greedy tokens from a 17-token prompt

# %%
e2e = {m.name: ch03.end_to_end(m, 17, S["e2e_tokens"]) for m in (gpt2, smol)}
for name, e in e2e.items():
    for b in ("recompute", "concat", "static"):
        print(f"{name:>12} {b:>9}: {e[b]['positions']:>5} positions, TTFT {e[b]['ttft'] * 1e3:6.1f} ms, "
              f"TPOT {e[b]['tpot'] * 1e3:6.1f} ms, total {e[b]['total']:5.2f} s")
    print(f"{'':>12} identical tokens: {e['tokens_identical']}")

# %% [markdown]
# ## Against the library
#
# The lab's cached decode against `transformers`' own `generate` with its dynamic and its static cache,
# on the same weights, the same context and the same threads. The first check is that both produce the
# same greedy tokens.

# %%
lib = library.compare(("gpt2-random", "smollm2"), S["library_context"], S["library_tokens"], S["library_reps"])
for name, r in lib.items():
    print(f"{name:>12} at context {r['context']}: lab concat {r['lab_concat'] * 1e3:.1f}, lab static "
          f"{r['lab_static'] * 1e3:.1f}, library dynamic {r['library_dynamic'] * 1e3:.1f}, library static "
          f"{r['library_static'] * 1e3:.1f} ms/token; ratios {r['ratio_concat']:.2f}, {r['ratio_static']:.2f}; "
          f"same tokens {r['tokens_match']}")

# %% [markdown]
# ## Memory, measured in a fresh process
#
# Each measurement runs in its own process: load, warm up, take the resident size as the baseline,
# then decode to the target length and record the peak. The formula's bytes are the dashed line.

# %%
mem = memory.sweep(S["memory_models"], ("concat", "static"), S["memory_batches"], S["memory_tokens"])
for r in mem:
    print(f"{r['model']:>12} {r['design']:>6} batch {r['batch_size']}: peak extra "
          f"{r['peak_extra_bytes'] / 2**20:7.1f} MiB, cache by formula {r['cache_bytes'] / 2**20:7.1f} MiB")
memory.plot(mem);

# %% [markdown]
# ## Record

# %%
m = dict(settings=S, manifests={"smollm2": smol.manifest, "gpt2-random": gpt2.manifest}, times=times,
         end_to_end=e2e, library=lib, memory=mem)
ch03.record(m)
print("wrote section ch03 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# 1. **Where does the time go?** Write `decode_flops(config, T)`: the multiply-adds of one cached decode
#    step at context T (projections, attention over T keys, MLP, output head). The check compares with a
#    count taken by PyTorch's FLOP counter on a real step.
# 2. **When does attention dominate?** Write `attention_share(config, T)`: the fraction of a cached
#    step's multiply-adds spent in attention over the cache; the check uses the same counter.

# %%
from lab.exercises import ch03 as ex


def decode_flops(config, T):
    raise NotImplementedError("your answer")


def attention_share(config, T):
    raise NotImplementedError("your answer")


for check, answer in ((ex.check_decode_flops, decode_flops), (ex.check_attention_share, attention_share)):
    try:
        check(answer)
    except NotImplementedError:
        print(check.__name__, ": not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch03_solutions.py`; the test suite runs every check on them.
