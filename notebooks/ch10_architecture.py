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
# # Chapter 10 — A cache shaped by the architecture
#
# Chapters 5 to 7 shrank the cache from outside the model: pages, sharing, fewer bits, fewer positions.
# The largest savings in production come from inside it. A model can cache **fewer key/value heads**
# (grouped- and multi-query attention), a **latent** per token from which keys and values are computed
# (DeepSeek's multi-head latent attention), let most layers see only a **window** (Gemma, gpt-oss), or
# let layers **share** one cache (cross-layer attention). Those models were trained that way. Here each
# design is applied to SmolLM2 *after* training (`lab.models.retrofit`), so that one model can be
# measured four ways: what each design saves in bytes, and what it costs in quality without the training
# that would repair it.
#
# The notebook builds the latent's trick by hand first: attention that never rebuilds a key. Then a block
# table for a model whose local layers give pages back, and only then the measurements.

# %%
import lab  # first, before torch: it sets OpenMP's wait policy, which torch reads once, when it loads

import platform

import pandas as pd
import torch
import torch.nn.functional as F
from IPython.display import display

from lab import data, results
from lab.cache import LatentCache, StaticCache
from lab.cache.base import visible
from lab.experiments import ch10_architecture as ch10
from lab.experiments.tables import show
from lab.models import forward, forward_cached, load
from lab.models.retrofit import (RetrofitError, bases, calibration_moments, latent_kv, local_layers, pool_kv_heads,
                                 share_kv)
from lab.book.verdicts import beside

print(f"python {platform.python_version()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
print(lab.threads.describe())
QUICK = results.quick()
S = ch10.settings(QUICK)
print("quick mode" if QUICK else "full mode", "-> results in", results.results_path())
smol = load("smollm2")
cfg = smol.config

# %% [markdown]
# ## 1. What each design holds per position
#
# SmolLM2 caches, per position, a key and a value for each of its 3 KV heads of 64 values in each of its
# 30 layers: $2 \times 30 \times 3 \times 64 = 11{,}520$ values, 23,040 bytes in bfloat16. Each retrofit
# changes one factor. `config.kv_layout` says what a cache holds per position (layers, heads, values per
# head) and `config.kv_bytes_per_position` what that costs. Local layers are the exception: they hold as
# many bytes per position as before, but fewer positions, so only the last column shows what they save
# (counted position by position here; a pool of whole pages, in section 3, holds a little more).

# %%
calibration = data.passages(smol.tokenizer, S["calibration"][1], S["calibration"][0], split="train")
designs = {"as trained": smol, "one KV head (MQA)": pool_kv_heads(smol, 1),
           "latent, rank 96": latent_kv(smol, 96, calibration), "layers share by 2": share_kv(smol, 2),
           "local: window 1,024, 1 global in 6": local_layers(smol, 1024, 6)}
BF16 = torch.bfloat16
display(show(pd.DataFrame({name: {"cache layers": m.config.kv_layout[0], "heads": m.config.kv_layout[1],
                                  "values per head": m.config.kv_layout[2],
                                  "bytes per position (bf16)": m.config.kv_bytes_per_position(BF16),
                                  "bytes at 8,192 positions (MiB)": m.config.kv_bytes(8192, BF16) / 2**20}
                           for name, m in designs.items()}).T.rename_axis("design")))

# %% [markdown]
# The latent is trained on nothing: its bases come from the keys and values SmolLM2 computes on a few
# passages of the *training* plays (never the held-out ones the chapter measures on). Rank 96 keeps 48
# values for the keys and 48 for the values of each position, where the model computed 192 of each.
#
# ## 2. Attention in latent space, by hand
#
# Take layer 0 and a short prompt. For every position the cache holds $c_k = U_k^\top k$ and
# $c_v = U_v^\top v$, with $k$ the keys of the 3 KV heads side by side, after RoPE, and $U_k, U_v$ the
# bases (`[192, 48]`, orthonormal columns). Rebuilding keys and values from the latents and attending,
# the **reconstructing** form, multiplies every cached position by $U$ at every step. The **absorbed**
# form moves $U$ onto the query instead: $q \cdot U_k c_k = (U_k^\top q) \cdot c_k$, and
# $\sum_t p_t U_v c_{v,t} = U_v \sum_t p_t c_{v,t}$. Attention then runs over the latents themselves,
# one "head" shared by all 9 query heads: multi-query attention with 48 values per head.

# %%
from lab.models.llama import embed, rms_norm, rope_tables  # noqa: E402
from lab.models.retrofit import attention_inputs  # noqa: E402

lat = designs["latent, rank 96"]
w, lcfg = lat.weights, lat.config
ids = torch.tensor(data.passages(smol.tokenizer, 24, count=1, seed=7))           # [1, 24]
T, H, D, G = ids.shape[1], lcfg.n_kv_heads, lcfg.head_dim, lcfg.group_size
x = embed(ids, w)
h = rms_norm(x, w["model.layers.0.input_layernorm.weight"], lcfg.norm_eps)
rope_cs = rope_tables(torch.arange(T), D, lcfg.rope_theta, x.dtype)
q, k, v = attention_inputs(h, w, 0, lcfg, rope_cs, stores=True)    # [1, 9, T, 64], [1, 3, T, 64] x 2
U_k, U_v = bases(w, 0)                                              # [192, 48] each

c_k = k.transpose(1, 2).reshape(T, H * D) @ U_k                     # [T, 48]: what the cache holds
c_v = v.transpose(1, 2).reshape(T, H * D) @ U_v                     # [T, 48]
U_kh, U_vh = U_k.view(H, D, -1), U_v.view(H, D, -1)                 # per KV head: [3, 64, 48]
q_lat = torch.stack([q[0, j] @ U_kh[j // G] for j in range(9)])    # [9, T, 48]: queries in latent space
p = (q_lat @ c_k.T / D ** 0.5).masked_fill(~visible(0, T), float("-inf")).softmax(-1)   # [9, T, T]
absorbed = torch.stack([(p[j] @ c_v) @ U_vh[j // G].T for j in range(9)])               # [9, T, 64]

k_hat = (c_k @ U_k.T).view(T, H, D).transpose(0, 1)                # rebuilt keys [3, T, 64] ...
v_hat = (c_v @ U_v.T).view(T, H, D).transpose(0, 1)                # ... and values
rebuilt = F.scaled_dot_product_attention(q[0], k_hat, v_hat, is_causal=True, enable_gqa=True)
print(f"absorbed against reconstructing: max |difference| {float((absorbed - rebuilt).abs().max()):.1e}")
assert torch.allclose(absorbed, rebuilt, atol=1e-5)

# %% [markdown]
# The two forms agree to float32 rounding (about $10^{-6}$ on outputs of order 1). Now the same against
# `lab`: a StaticCache filled by the latent model holds exactly these latents in layer 0 (its key slot
# $c_k$, its value slot $c_v$), and the cached forward, which runs the absorbed form in every layer,
# gives the logits of the uncached one, which rebuilds keys and values.

# %%
cache = StaticCache(lcfg, 64)
with torch.inference_mode():
    cached = forward_cached(ids, w, lcfg, cache)
    uncached = forward(ids, w, lcfg)
assert torch.allclose(cache.k_buf[0, 0, 0, :T], c_k, atol=1e-5) and torch.allclose(cache.v_buf[0, 0, 0, :T], c_v,
                                                                                      atol=1e-5)
assert torch.allclose(cached, uncached, atol=1e-3)    # 30 layers of float32 rounding, summed in another order
print(f"cached (absorbed) against uncached (reconstructing) logits: {float((cached - uncached).abs().max()):.1e} "
      f"(float32 rounding over 30 layers, on logits of order 10); the cache holds {cache.nbytes():,} bytes for 64 "
      f"positions, {lcfg.kv_bytes_per_position():,} per position (float32)")
latent_cache = LatentCache(lcfg, 64)                                # the same latents, one tensor per layer
with torch.inference_mode():
    assert torch.allclose(forward_cached(ids, w, lcfg, latent_cache), cached, atol=1e-5)
print("LatentCache:", latent_cache)

# %% [markdown]
# Why the basis is taken *after* RoPE: RoPE turns each key by an angle that depends on its position. A
# basis for the keys before RoPE would have to be turned with every position before a query could use
# it, so it could not move onto the query once for all positions (DeepSeek-V2 keeps a separate, small
# rotated key for exactly this reason). After RoPE, $q \cdot k$ needs no position at all; the price is
# that rotation spreads each pair of channels over the angles of every position, so the keys need more
# directions than before RoPE (section 5 measures how many).
#
# ## 3. Local layers and shared layers
#
# A local layer's query at position $p$ sees the keys at $p - w + 1, \ldots, p$ and the first $s$
# positions (sinks). `lab.cache.base.visible` is the mask; here a window of 4 with 1 sink over 8
# positions:

# %%
print(visible(0, 8, window=4, sinks=1).int())

# %% [markdown]
# `local_layers(model, window, global_every, sinks)` makes every layer local except every
# `global_every`-th; `share_kv(model, every)` lets each run of `every` layers read the cache of its
# lowest. At their identity settings (a window at least the context, `every=1`) both are the model
# itself, to float32 rounding (an explicit mask adds in another order than `is_causal`). The tests check
# that, and that every retrofit gives the same tokens through every cache design and the serving engine
# as through its own uncached forward.

# %%
ids = torch.tensor(data.passages(smol.tokenizer, 64, count=1, seed=3))
with torch.inference_mode():
    want = forward(ids, smol.weights, cfg)
    for m in (local_layers(smol, 64, 6), share_kv(smol, 1), pool_kv_heads(smol, 3)):
        assert torch.allclose(forward(ids, m.weights, m.config), want, atol=1e-5), m.name
print("a window of the whole context, sharing by 1 and pooling 3 heads into 3: the model itself (within 1e-5)")
try:
    local_layers(smol, 0, 6)
except RetrofitError as e:
    print("RetrofitError:", e)

# %% [markdown]
# ## 4. Pages that a window gives back
#
# In a model that mixes local and global layers, one block table per sequence no longer fits: a global
# layer needs every page that a local layer could give back. `HybridBlockManager` keeps the layers in
# groups, each with its own pages, as vLLM's hybrid KV cache manager does. Before a sequence at length
# $L$ grows, the local group gives back every page whose positions all lie below $L + 1 - w$ and that
# holds no sink; its block-table entry becomes NULL (-1). By hand, for a window of 8, 2 sinks and pages
# of 4:

# %%
from lab.cache.hybrid import HybridBlockManager  # noqa: E402

manager = HybridBlockManager(4, {"full": (16, 0, 0), "local": (16, 8, 2)})
for length in (6, 12, 20, 30, 31):                  # prefill chunks, then a decode of position 30
    manager.reserve("a", length - (manager.length("a") if "a" in manager else 0))
    print(f"{length:2} positions: full {manager.block_table('a', 'full')}, local {manager.block_table('a', 'local')}")
# the query at position 30 reads 23 .. 30 and the sinks 0, 1: the local group keeps pages 0 and 5 .. 7
assert manager.block_table("a", "local") == [0, -1, -1, -1, -1, 5, 6, 7]

# %% [markdown]
# A later request with the same prompt needs every page of the prefix in the full group, but only the pages
# of the last window and the sinks in the local one. Drawn from a real run, a few sequences in SmolLM2's
# layout made local (window 64, 16 sinks, one global layer in six), and what one sequence of 8,192
# positions holds with windows of 1,024:

# %%
tables = ch10.hybrid_tables(smol)
fig_tables = ch10.plot_tables(tables)
hybrid = ch10.hybrid_pool(smol, S)
print(f"a prefill of {hybrid['prefill']:,} positions and one decoded token, {hybrid['context']:,} positions: "
      f"the full group holds {hybrid['held']['full']} pages ({hybrid['layers']['full']} layers), the local group "
      f"{hybrid['held']['local']} ({hybrid['layers']['local']} layers): {hybrid['hybrid_bytes'] / 2**20:.1f} MiB in "
      f"bf16 instead of {hybrid['full_bytes'] / 2**20:.1f}; a second request with the prompt takes "
      f"{hybrid['taken']['full']} full and {hybrid['taken']['local']} local pages")
m = dict(settings=S, manifest=smol.manifest, threads=torch.get_num_threads(),
         bf16_bytes=cfg.kv_bytes_per_position(BF16), hybrid=hybrid, tables=tables)
beside("ch10", "ch10.hybrid", values=ch10.values(m))

# %% [markdown]
# The serving engine runs such a model on one `PagePool`, the kind it keeps for every model, with a pool
# pair of its own for each group of layers, and gives every request the tokens of the model's uncached forward.
# `stats["peak_held_pages"]` counts the most pages each group held at once: here that is during the
# prefill, when a local layer still needs every page of the chunk it computes; the window gives pages back
# as decoding moves it on.

# %%
from lab.engine import ServingEngine  # noqa: E402

local = local_layers(smol, 32, 6, sinks=4)
prompts = [p[:n] for p, n in zip(data.passages(smol.tokenizer, 120, count=2, seed=5), (120, 90), strict=True)]
engine = ServingEngine(local, num_pages=32, page_size=16)
out = engine.generate(prompts, 8)
with torch.inference_mode():
    for p, o in zip(prompts, out, strict=True):
        ids, want = list(p), []
        for _ in range(8):
            want.append(int(forward(torch.tensor([ids + want]), local.weights, local.config)[0, -1].argmax()))
        assert o == want
peak = engine.stats["peak_held_pages"]
print(f"the engine's tokens equal the uncached forward's; most pages held at once: {peak['full']} in the full "
      f"group, {peak['local']} in the local one")

# %% [markdown]
# Its decodes attend together in the paged decode kernel, which takes the window and the sinks and never
# loads a page the window gave back. One decode step beside the plain engine's, at the same batch and
# positions (SmolLM2's heads and widths over 6 layers, random ids; quick mode: 4 sequences at 1,024 and
# 2,048 positions, window 128; the book's: 16 at 4,096 and 8,000, window 1,024):

# %%
from lab.experiments import steps  # noqa: E402

st = steps.hybrid()
for part in ("short", "long"):
    r = st[f"hybrid_{part}"]
    print(f"{st['settings'][part]:,} positions: the hybrid step {r['hybrid']['over_base']['median']:.2f}x the "
          f"plain one's, reading {r['hybrid']['kv_read_bytes'] / 2**20:.1f} MiB of keys and values against "
          f"{r['plain']['kv_read_bytes'] / 2**20:.1f}")
beside("ch10", "steps.hybrid", values=steps.values(st), section="steps",
       why="4 sequences at 1,024 and 2,048 positions read far fewer bytes than the book's 16 at 4,096 and 8,000, "
       "so the window saves a smaller share of the step, and a few rounds on a busy machine are noisy")

# %% [markdown]
# ## 5. What each design costs in quality
#
# Chapter 7's protocol, on held-out passages: a prefill, then one token per step through the cache, and
# at every step the next-token distribution against the original model's (KL divergence, change in
# perplexity, top-1 agreement). Chapter 7's quantized and evicting caches run again in the same sweep,
# so every point shares one pair of axes: KL against bytes per position, as a share of the original
# model's bfloat16 cache.

# %%
moments = calibration_moments(smol, calibration)        # per layer: K^T K and V^T V, for every rank at once
cases, latent = ch10.retrofits(smol, moments, S)
ids, prefill, ref = ch10.held_out(smol, S)
q = ch10.quality_map(smol, cases, ids, prefill, ref)
def in_words(setting):
    """A setting's short name in words: "w64 g6 s4 kivi4" -> "window 64, 1 global layer in 6, 4 sinks, in KIVI-4"."""
    words = {"int8": "INT8", "kivi4": "KIVI-4", "sinks": "budget"}
    out = []
    for part in setting.split():
        if part[0] in "wgs" and part[1:].isdigit():
            out.append({"w": f"window {part[1:]},", "g": f"1 global layer in {part[1:]},", "s": f"{part[1:]} sinks,"}
                       [part[0]])
        else:
            out.append(("in " if part in ("int8", "kivi4") and out else "") + words.get(part, part))
    return " ".join(out).rstrip(",").replace(", in", " in")


rows = {(f, in_words(n)): {"bytes per position": r["bytes"],
                           "share of bf16": r["bytes"] / cfg.kv_bytes_per_position(BF16),
                           "KL (nats)": r["kl"], "Δ perplexity": r["delta_ppl"], "top-1 agreement": r["top1"]}
        for f, named in q.items() for n, r in named.items()}
display(show(pd.DataFrame(rows).T.rename_axis(["design", "setting"]),
             percent=["share of bf16", "top-1 agreement"]))
m |= dict(prefill=prefill, quality=q)
fig_kl = ch10.plot_kl_bytes(ch10.plot_points(m))

# %% [markdown]
# A KL of several nats, or a Δ perplexity in the thousands, is not a small error: the model's next-token
# distribution has little to do with the original's, and its top choice agrees at a few percent of positions.
# Perplexity is the exponential of the loss, so a loss a few nats worse multiplies it by $e$ to those nats:
# differences in the thousands say that the design broke the model, and little more.

# %%
beside("ch10", "ch10.quality", "ch10.best", values=ch10.values(m),
       why=f"your run decodes {S['decode']} tokens of {S['passages']} passage(s) of {S['tokens']} tokens, the book "
           f"{ch10.settings(False)['decode']} of {ch10.settings(False)['passages']} of "
           f"{ch10.settings(False)['tokens']}: short passages never leave a window of 64 far behind, and quick "
           "mode runs fewer designs, so the best design under a tenth of the bytes is another one.")

# %% [markdown]
# Without training, pooling three KV heads into one and sharing layers break the model: their KL is
# measured in nats, and top-1 agreement falls to chance. Local layers with sinks and a global layer
# every few layers cost least per byte saved; the latent sits in between. The values look harder to
# compress than the keys (a hint, not a test of what limits the latent): the share of each one's energy
# (on the calibration text) that the directions a latent keeps hold:

# %%
m["spectra"] = ch10.spectra(moments, S["ranks"], calibration_moments(smol, calibration, before_rope=True))
display(show(pd.DataFrame({r: {"keys (before RoPE)": x["keys_before_rope"], "keys (after RoPE)": x["keys"],
                               "values": x["values"]} for r, x in m["spectra"].items()}).T.rename_axis("rank"),
             percent=["keys (before RoPE)", "keys (after RoPE)", "values"]))
beside("ch10", "ch10.spectra", values=ch10.values(m))

# %% [markdown]
# The published conversions (MHA2MLA, TransMLA, the GQA paper's uptraining) spend up to billions of
# tokens of training after the conversion; nothing here measures what that training recovers.
#
# ## 6. The latent's two forms, timed
#
# One decode step of the latent model at rank 96 in the absorbed and in the reconstructing form, beside
# the original model, each through a StaticCache of the same context.

# %%
steps = ch10.step_times(smol, latent, S)
display(show(pd.DataFrame({(T, n): {"step (ms)": t["median"] * 1e3,
                                    "over the original": t["median"] / x["original"]["median"]}
                           for T, x in steps.items() for n, t in x.items()}).T.rename_axis(["context", "model"])))
m["steps"] = steps
beside("ch10", "ch10.steps", values=ch10.values(m),
       why="your run times 512 positions only (the book also 4,096, where the cache's bytes matter), a few "
           "rounds, on a machine doing other things.")

# %% [markdown]
# The reconstructing form multiplies every cached position by $U$ at every step, a cost that grows with
# the context; the absorbed form multiplies one query per head. This is why vLLM's MLA backend decodes in
# the absorbed form and rebuilds keys and values only for prefill, where many queries share the work.
#
# ## Record

# %%
ch10.record(m, drawn={"kl_bytes": fig_kl, "tables": fig_tables})
print("wrote section ch10 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# 1. **Derive the absorbed query.** Write `latent_attention(q, c_k, c_v, U_k, U_v, group_size)`: `q`
#    `[H_q, T, D]` are one layer's queries after RoPE at the last T positions, `c_k` and `c_v` `[L, r/2]`
#    the cached latents of its keys and values (a latent of rank r holds r/2 values for each), `U_k` and
#    `U_v` `[H_kv D, r/2]` their bases. Return the causal attention output `[H_q, T, D]`, computed in latent
#    space. The check, `ex.check_latent_attention`, runs it on cases you have not seen against attention over
#    rebuilt keys and values, counts the work of every operation your function runs, and keeps your tensors
#    inside torch: rebuilding keys or values, whole, padded or a position at a time, costs several times the
#    absorbed form's work and fails, and so does taking values out to numpy.
# 2. **Size a hybrid pool.** Write `local_pages(context, window, sinks, page_size, chunk)`: the most pages
#    one sequence's local group ever holds while it grows to `context` positions in steps of `chunk`. The
#    check, `ex.check_local_pages`, runs the real `HybridBlockManager` on random settings after your
#    function answered (while it runs, the manager refuses to), and compares. A window's pages alone, or
#    the bound you might guess from its docstring, fail.
# 3. **Open-ended: how low can the latent go?** `ex.measure_latent_kl(rank=96)` measures the latent's KL
#    on a short passage and sets it beside the book's. Try other ranks. Where does the KL stop being
#    tolerable, and would a different split between keys and values do better?

# %%
from lab.exercises import ch10 as ex  # noqa: E402


def latent_attention(q, c_k, c_v, U_k, U_v, group_size):
    raise NotImplementedError("your answer")


def local_pages(context, window, sinks, page_size, chunk):
    raise NotImplementedError("your answer")


for check, answer in ((ex.check_latent_attention, latent_attention), (ex.check_local_pages, local_pages)):
    try:
        check(answer)
    except NotImplementedError:
        print(f"{check.__name__}: not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch10_solutions.py`; the test suite runs every check on them.
