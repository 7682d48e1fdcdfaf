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
# # Chapter 5 — Paged attention
#
# A cache stored in one piece must be reserved for the longest sequence it might hold, and it cannot
# grow in place. Pages change that: fixed-size blocks handed out from one pool and listed, per sequence,
# in a *block table*. A sequence grows by one page at a time, rolls back by handing pages back, and forks
# by sharing them; the keys themselves never move.
#
# This notebook first builds a block table and a slot mapping by hand, for two sequences, and checks
# them against `lab`'s `BlockManager` and `PagedCache`. Then it reads the Triton kernel's inner loop,
# line by line. Only then does it measure: how much reserved memory holds real tokens, where the rest of
# it goes while a pool serves requests, and what the indirection costs on this CPU.

# %%
import lab  # first, before torch: it sets OpenMP's wait policy, which torch reads once, when it loads

import os
import platform

import torch

# Without a GPU, Triton can run the kernel only in its interpreter, which must be chosen before Triton
# is imported (section 3 runs the kernel that way). `lab` itself never sets it; a GPU compiles instead.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pandas as pd
import transformers

from lab import data, results
from lab.experiments import ch05_paged as ch05
from lab.experiments.tables import show
from lab.book.verdicts import beside

print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"pandas {pd.__version__}, threads {torch.get_num_threads()}, CUDA available: {torch.cuda.is_available()}")
print(lab.threads.describe())
QUICK = results.quick()
S, FULL = ch05.settings(QUICK), ch05.settings(False)      # FULL: the book's settings, to say what quick mode skips
print("quick mode" if QUICK else "full mode", "-> results in", results.results_path())

# %% [markdown]
# ## 1. A block table by hand
#
# The pool is a stack of pages. Here: 8 pages of 4 positions each, and for every position 2 key/value
# heads of 3 features (tiny, so the numbers can be printed). The free list says which pages nobody
# holds. Two sequences arrive: A with 6 tokens, B with 9. They take pages in turns, as they would when
# they grow step by step, so neither gets a contiguous run of pages.

# %%
def pages(ids):                               # [0, 2] -> "0, 2"
    return ", ".join(map(str, ids))


PAGE, NUM_PAGES, H, D = 4, 8, 2, 3
free = list(range(NUM_PAGES))                 # page ids nobody holds
tables = {"A": [], "B": []}                   # each sequence's block table: its pages, in order
lengths = {"A": 6, "B": 9}

for _turn in range(3):                        # A and B take pages in turns until they fit
    for seq in "AB":
        if len(tables[seq]) * PAGE < lengths[seq]:
            tables[seq].append(free.pop(0))
print("block tables:", "; ".join(f"{seq} → pages {pages(t)}" for seq, t in tables.items()), "| free pages:",
      pages(free))

# %% [markdown]
# Position `p` of a sequence lives in page `table[p // PAGE]` at offset `p % PAGE`. Flatten the pool to
# one row per position (`NUM_PAGES * PAGE` rows) and that is row `page * PAGE + offset`: the position's
# **slot**. The list of slots a step writes is the **slot mapping**.

# %%
def slot_mapping(table, start, n):
    return [table[p // PAGE] * PAGE + p % PAGE for p in range(start, start + n)]


rows = [dict(sequence=seq, position=p, page=tables[seq][p // PAGE], offset=p % PAGE,
             slot=slot_mapping(tables[seq], p, 1)[0]) for seq in "AB" for p in range(lengths[seq])]
show(pd.DataFrame(rows).set_index(["sequence", "position"]).T)

# %% [markdown]
# Now write keys. Each sequence's keys are made contiguous first (`keys[seq]`, `[length, H, D]`), then
# scattered into the pool through the slot mapping. Reading sequence B back is a **gather**: take B's
# pages in block-table order, lay them end to end, and drop the unused tail of the last page. It must
# give B's keys back exactly.

# %%
torch.manual_seed(0)
k_pool = torch.zeros(NUM_PAGES, PAGE, H, D)                                   # [pages, PAGE, H, D]
keys = {seq: torch.randn(n, H, D) for seq, n in lengths.items()}              # [length, H, D]
for seq in "AB":
    k_pool.view(-1, H, D)[slot_mapping(tables[seq], 0, lengths[seq])] = keys[seq]  # scatter by slot

gathered = k_pool[tables["B"]].flatten(0, 1)[: lengths["B"]]                 # [length, H, D]
print("B's keys read back through its block table equal a contiguous copy:",
      "yes" if torch.equal(gathered, keys["B"]) else "NO")

# %% [markdown]
# ### The same with `lab`
#
# `lab`'s `BlockManager` keeps exactly this bookkeeping (a free list, a block table and a length per
# sequence, plus a reference count per page for forks). Reserving the same positions in the same order
# gives the same block tables, and its `slots` is our slot mapping.

# %%
from lab.cache import BlockManager, ConcatCache, OutOfPagesError, PagedCache

bm = BlockManager(num_pages=NUM_PAGES, page_size=PAGE)
for p in range(max(lengths.values())):        # grow both one position at a time, A first
    for seq in "AB":
        if p < lengths[seq]:
            bm.reserve(seq, 1)
print("BlockManager:", "; ".join(f"{seq} → pages {pages(bm.block_table(seq))}" for seq in "AB"),
      f"| {bm.num_free} pages free")
for seq in "AB":
    assert bm.block_table(seq) == tables[seq], (seq, bm.block_table(seq), tables[seq])
    assert bm.slots(seq, 0, lengths[seq]) == slot_mapping(tables[seq], 0, lengths[seq])
print("BlockManager: same block tables and slot mapping as by hand")

# %% [markdown]
# Two things the hand version lacks. **Fork**: a second sequence shares A's pages (the reference count
# goes up); its first write to A's shared, partly filled last page gets a private copy first
# (copy-on-write). **Exhaustion**: a request for more pages than are free raises `OutOfPagesError` and
# changes nothing.

# %%
bm.fork("A", "A2")
print("A2 shares A's pages:", pages(bm.block_table("A2")))
(old, new), = bm.reserve("A2", 1)              # the copies made: one (old page, new page) pair
print(f"copy on write: A2's next position goes to page {new}, a copy of page {old}; A2 → pages "
      f"{pages(bm.block_table('A2'))}")
try:
    bm.reserve("B", 100)
except OutOfPagesError as e:
    print("OutOfPagesError:", e, "| free pages still", bm.num_free)

# %% [markdown]
# ### On the real model
#
# A `PagedCache` holds one key pool and one value pool per layer, `[num_pages, page_size, kv_heads,
# head_dim]`, and a `BlockManager`. Run two prompts of different lengths through SmolLM2, each in its
# own row of one paged cache, and the same prompts through a contiguous `ConcatCache`. Our hand-written
# gather, applied to the paged cache's layer-0 pool and block tables, must return exactly the keys the
# contiguous cache holds.

# %%
from lab.models import forward_cached, load

smol = load("smollm2")
prompts = [smol.tokenizer.encode("Pages hold keys and values."),
           smol.tokenizer.encode("A block table lists the pages of one sequence, in order, so they can sit anywhere.")]
paged = PagedCache(smol.config, max_tokens=128, page_size=PAGE, batch_size=2)
for row, ids in enumerate(prompts):
    forward_cached(torch.tensor([ids]), smol.weights, smol.config, paged.select([row]))
for row, ids in enumerate(prompts):
    contiguous = ConcatCache(smol.config)
    forward_cached(torch.tensor([ids]), smol.weights, smol.config, contiguous)
    table = paged.manager.block_table(paged.seqs[row])
    by_hand = paged.k_pool[0][table].flatten(0, 1)[: len(ids)]                 # [length, H_kv, D]
    want = contiguous.keys[0][0].transpose(0, 1)                               # [length, H_kv, D]
    print(f"row {row}: {len(ids)} tokens in pages {pages(table)}; gathered keys equal the contiguous cache's:",
          "yes" if torch.equal(by_hand, want) else "NO")

# %% [markdown]
# And the paged cache runs under the same forward as every other cache: greedy decoding through it
# gives the same tokens as through the concatenating cache, for pages of 1, 16 and 64 positions, from a
# 37-token prompt that crosses page boundaries. Four prompts of different lengths, prefilled one by one
# and then decoded together in one batch, give the tokens each gives alone.

# %%
agree = ch05.token_agreement(smol, S["page_sizes"], 37, S["new_tokens"])
ragged = ch05.ragged_batch(smol, new_tokens=S["new_tokens"] // 2)
show(pd.DataFrame({f"pages of {ps}": {"tokens against ConcatCache": r["identical"], "largest |Δ logit|": r["max_diff"]}
                   for ps, r in agree.items()}
                  | {f"ragged batch of {pages(ragged['lengths'])} tokens": {
                      "tokens against ConcatCache": ragged["identical"], "largest |Δ logit|": None}}).T,
     digits=2, words=("identical", "different"),
     note="— : the ragged batch is compared by its tokens only (each sequence against itself generated alone)")

# %% [markdown]
# A live cache with three sequences of different lengths and a fork, drawn from its own block manager:
# each cell is a page of the pool and its number is the page id; the colour says whose block table lists
# it; grey pages are shared by a sequence and its fork.

# %%
fig_tables = ch05.plot_block_tables()

# %% [markdown]
# ## 2. The kernel: reading pages in place
#
# The gather above copies every page before attention reads it. A GPU kernel does not need the copy:
# it can follow the block table itself. Here is the inner part of `lab`'s Triton kernel
# (`lab/kernels/triton_paged.py`, the region `paged_decode_loop`).

# %%
from lab.book.render import code_listing

print(code_listing("lab/kernels/triton_paged.py", "paged_decode_loop"))

# %% [markdown]
# Line by line:
#
# - **One program per (sequence, KV head).** `seq` and `kv_head` are the program's coordinates in the
#   launch grid `(batch, kv_heads)`. With grouped-query attention several query heads share one KV head
#   (SmolLM2: 9 query heads, 3 KV heads, so groups of 3). The program loads all `GROUP` query heads of
#   its KV head as one `[GROUP, D]` block `q`, so every page of keys and values is read once for the
#   whole group instead of once per query head.
# - **Padding and masks.** Triton blocks have power-of-two sizes, so `offs_g`, `offs_d` and `offs_t`
#   run to padded sizes, and `g_mask`, `d_mask`, `t_mask` say which lanes are real.
# - **The loop over pages.** `n_pages = cdiv(length, PAGE_SIZE)`: only the pages that hold the
#   sequence's positions are visited; the zero padding of the block table is never read. Iteration `i`
#   loads block-table entry `i`, the id of the page that holds positions `i * PAGE_SIZE` onwards.
# - **What a page load reads.** `k_ptrs` points at `PAGE_SIZE` rows of `HEAD_DIM` values: the page's
#   base in the pool (`page * stride_kp`), one row per position (`offs_t * stride_kt`), this KV head's
#   slice (`kv_head * stride_kh`). With the pool laid out `[pages, page_size, kv_heads, head_dim]` that
#   is a strided block inside one contiguous page. Positions past the sequence's length in its last page
#   are masked (`t_mask`) and load as 0.
# - **Scores.** $s = q k^\top$, `[GROUP, PAGE]`, with masked positions set to $-\infty$.
# - **Online softmax.** A softmax needs the maximum over all positions, but the program sees one page
#   at a time. It keeps three running quantities: `m_i`, the largest score so far; `l_i`, the sum of
#   $\exp(s - m_i)$ so far; `acc`, the sum of $\exp(s - m_i)\, v$ so far. When a page brings a
#   larger maximum `m_new`, everything summed so far was scaled by $\exp(-m_i)$ and must be scaled by
#   $\exp(-m_\text{new})$ instead: multiply by `alpha = tl.exp(m_i - m_new)`. Then add the page's own terms.
# - **The end.** `acc / l_i` is the softmax-weighted sum of values, exactly; it is stored for the
#   group's query heads.
#
# The online softmax is easy to check in plain PyTorch: split a row of scores into pages, run the
# recurrence, and compare with the softmax of the whole row.

# %%
torch.manual_seed(1)
scores, values = torch.randn(37), torch.randn(37, 5)       # one query head: 37 positions, 5 features
m, l, acc = torch.tensor(float("-inf")), torch.tensor(0.0), torch.zeros(5)
for start in range(0, 37, PAGE):                           # one page at a time
    s, v = scores[start:start + PAGE], values[start:start + PAGE]
    m_new = torch.maximum(m, s.max())
    alpha = torch.exp(m - m_new)                           # rescale what was summed so far
    p = torch.exp(s - m_new)
    l, acc, m = l * alpha + p.sum(), acc * alpha + p @ v, m_new
print("online softmax over pages equals the softmax of the whole row:",
      "yes" if torch.allclose(acc / l, torch.softmax(scores, 0) @ values, atol=1e-6) else "NO")

# %% [markdown]
# `lab` has four versions of this attention, with one signature:
# `(q [B, H_q, D], k_pool, v_pool [pages, page_size, H_kv, D], block_tables int32 [B, max_pages],
# lengths int32 [B])`.
#
# - `paged_attention_reference`: the gather above plus `scaled_dot_product_attention`, one sequence at a
#   time. Readable; the oracle the others are tested against.
# - `paged_attention_gather`: the same gather for the whole batch at once, then one masked SDPA call.
# - `paged_attention`: the Triton kernel, which reads the pages where they lie with the online softmax
#   above. Compiled on a GPU; on a CPU it runs only in Triton's interpreter (NumPy, slow), which is how
#   the test suite checks it without a GPU.
# - `paged_attention_cpu`: the same loop in C++ for the CPU (section 3 explains it), compiled at its
#   first call and cached. A `PagedCache` uses it when it decodes on the CPU.
#
# All four agree on a ragged batch. (The kernel runs here in the interpreter when this machine has no
# GPU; the interpreter cannot run in a process that has imported `torch._dynamo`, so the cell says so
# instead of failing in that case.)

# %%
from lab.kernels import paged_attention, paged_attention_cpu, paged_attention_gather, paged_attention_reference

g = torch.Generator().manual_seed(2)
q = torch.randn(2, 9, 64, generator=g)                                 # [B, H_q, D]: SmolLM2's heads
k_pool, v_pool = torch.randn(2, 12, 16, 3, 64, generator=g)            # [pages, 16, H_kv, D] each
block_tables = torch.tensor([[5, 2, 9, 0], [7, 1, 0, 0]], dtype=torch.int32)  # zero-padded
lens = torch.tensor([40, 17], dtype=torch.int32)
want = paged_attention_reference(q, k_pool, v_pool, block_tables, lens)
for name, attend in (("gather version", paged_attention_gather), ("C++ kernel", paged_attention_cpu)):
    same = torch.allclose(attend(q, k_pool, v_pool, block_tables, lens), want, atol=1e-5)
    print(f"{name} equals the reference (within 1e-5):", "yes" if same else "NO")
try:
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    args = [t.to(dev) for t in (q, k_pool, v_pool, block_tables, lens)]
    same = torch.allclose(paged_attention(*args).cpu(), want, atol=1e-5)
    print(f"Triton kernel ({dev}) equals the reference (within 1e-5):", "yes" if same else "NO")
except Exception as e:  # no Triton, or the interpreter after torch._dynamo was imported
    print("Triton kernel not run here:", type(e).__name__, str(e)[:120])

# %% [markdown]
# ## 3. Measuring
#
# ### How much reserved memory holds real tokens
#
# Request lengths are **synthetic**: log-normal draws whose means match the statistics the vLLM paper
# published for ShareGPT (input 161.31, output 337.99 tokens) and Alpaca (19.31, 58.45); the spread
# ($\sigma = 1$ in log space) is an assumption. Each scheme reserves positions per request at completion:
# contiguous at the maximum length (2,048), contiguous for the prompt plus a 512-position answer budget,
# or pages of a given size (the tail of the last page is the only waste).

# %%
lengths = {d: data.synthetic_lengths(d, S["requests"], seed=i) for i, d in enumerate(data.REQUEST_DATASETS)}
util = {d: ch05.utilization(i, o) for d, (i, o) in lengths.items()}
by_manager = {d: ch05.utilization_by_manager(i[:S["manager_requests"]], o[:S["manager_requests"]])
              for d, (i, o) in lengths.items()}
from IPython.display import display

util_table = pd.DataFrame(util).rename(index=lambda k: k.replace("paged_", "pages of ").replace("_", " "))
util_table.loc["pages of 16, real BlockManager"] = pd.Series(by_manager)
display(show(util_table.rename_axis("reservation scheme"), percent=list(util_table.columns),
             caption="share of the reserved positions that hold tokens, per synthetic trace"))
show(pd.DataFrame({d: {"mean input (tokens)": i.mean(), "mean output (tokens)": o.mean()}
                   for d, (i, o) in lengths.items()}).T.rename_axis("trace (synthetic)"))

# %%
fig_util = ch05.plot_utilization(util)
means = {d: (float(i.mean()), float(o.mean())) for d, (i, o) in lengths.items()}
m = dict(settings=S, manifest=smol.manifest, means=means, utilization=util, by_manager=by_manager)
beside("ch05", "ch05.utilization", values=ch05.values(m),
       why=f"your run draws {S['requests']:,} requests per trace, the book {FULL['requests']:,}: the same "
           "distributions, fewer draws.")

# %% [markdown]
# How many requests, taken in arrival order, fit at once in 1 GiB of 16-bit SmolLM2 cache:

# %%
from lab.cache import cache_bytes

budget = 2**30 // cache_bytes(smol.config, 1, 1, torch.float16)
conc = {d: ch05.concurrency(i, o, budget) for d, (i, o) in lengths.items()}
print(f"1 GiB holds {budget:,} positions")
show(pd.DataFrame(conc).T.rename(columns=lambda k: k.replace("paged_", "pages of ").replace("_", " "))
     .rename_axis("trace (synthetic)"), caption="requests that fit at once in 1 GiB")

# %% [markdown]
# ### Where reserved memory goes
#
# The table above counts each request once, at its end. A server holds memory all along: a request
# admitted a moment ago holds its whole reservation and has written little of it. The vLLM paper (Kwon
# et al. 2023, Figure 2) splits the KV memory of a running system into four parts. Take each position of
# the pool at one decode step:
#
# 1. **token states**: it holds a token's keys and values;
# 2. **reserved for future tokens**: its request holds it now and will write it later;
# 3. **internal fragmentation**: its request holds it and will never write it (a reservation past the
#    request's final length; with pages, the unused tail of the last page);
# 4. **external fragmentation**: it is free, and as many positions are free in all as the waiting
#    request needs, but no run of them is long enough for it.
#
# What is left is plainly **free**: fewer positions free in all than the next request needs.
#
# First one moment, by hand, on a pool of 24 positions. Three requests arrived in this order: A (prompt 3,
# 5 positions in the end) has written all 5; B (prompt 2, 7 in the end) has written 3; C (prompt 4, 7 in
# the end) has just been admitted and has written 5. Capital letters are tokens, small letters reserved
# for future tokens, `_` internal fragmentation, `.` a free position.

# %%
import re


def draw(pool, placed):
    """placed: {name: (start, held, written, final)} -> one character per position of the pool."""
    cells = ["."] * pool
    for name, (start, held, written, final) in placed.items():
        for p in range(held):
            cells[start + p] = name if p < written else name.lower() if p < final else "_"
    return "".join(cells)


def parts(cells, waiting=None):
    """Count a drawn pool's positions. The free ones are external fragmentation when a request waits for
    `waiting` positions, that many are free in all, and no run of free positions is that long."""
    free, longest = cells.count("."), max(map(len, re.findall(r"\.+", cells)), default=0)
    stuck = waiting is not None and free >= waiting > longest
    return dict(tokens=sum(ch.isupper() for ch in cells), future=sum(ch.islower() for ch in cells),
                internal=cells.count("_"), external=free if stuck else 0, free=0 if stuck else free)


moment = {
    "contiguous, 8 each": (draw(24, {"A": (0, 8, 5, 5), "B": (8, 8, 3, 7), "C": (16, 8, 5, 7)}), None),
    "contiguous, prompt + 3": (draw(24, {"A": (0, 6, 5, 5), "B": (11, 7, 3, 7)}), 7),   # C waits for 4 + 3
    "pages of 4": (draw(24, {"A": (0, 8, 5, 5), "B": (8, 4, 3, 7), "C": (12, 8, 5, 7)}), None),
}
for name, (cells, _) in moment.items():
    print(f"{name:>22}  {cells}")
show(pd.DataFrame({name: parts(cells, waiting) for name, (cells, waiting) in moment.items()}).T,
     caption="one moment of a pool of 24 positions, by hand: positions per part")

# %% [markdown]
# Reserving 8 each, A's three positions past its end and one each of B's and C's are internal
# fragmentation, and B's four and C's two unwritten positions are reserved for their future tokens.
# Reserving the prompt plus 3 (B takes its 7, longer than 2 + 3), A and B fit, but a request that left
# between them opened a hole of 5; with the 6 at the end, 11 positions are free, C needs 7, and no run is
# that long: all 11 are external fragmentation. Pages hold only what has been written, rounded up to a
# page: A's last page has 3 unused positions (less than a page), C got the two pages its first step needs,
# and the 4 positions left are a page any request can use.
#
# A moment is not the whole story: `ch05.serve` runs a pool over time, one decode step after another,
# and adds up each step. Requests wait from the start and are admitted first come, first served; a
# step counts while one waits (the pool is then what limits). Two requests on a pool of 8 with a
# reservation of 8: A (prompt 2, 3 new tokens) runs three steps while B waits, so by hand the steps hold
# 3, 4 and 5 tokens, 2, 1 and 0 positions reserved for A's future tokens, and 3 positions of internal
# fragmentation each.

# %%
import numpy as np

by_hand = dict(tokens=3 + 4 + 5, future=2 + 1 + 0, internal=3 * 3, external=0, free=0)
served = ch05.serve(np.array([2, 1]), np.array([3, 2]), "contiguous_max", pool=8, max_len=8)
print("by hand:", by_hand)
print("ch05.serve:", {k: served[k] for k in ch05.PARTS}, "over", served["steps"], "steps")
assert {k: served[k] for k in ch05.PARTS} == by_hand

# %% [markdown]
# `serve` does the same for four allocators: contiguous runs of the maximum length and of the prompt plus
# the answer budget, placed first fit; the budget rounded up to a power of two and placed at an aligned
# start, as a buddy allocator does; and pages of 16, taken when a request's last page is full, the newest
# request preempted when too few are free. The pool is 1 GiB of 16-bit SmolLM2 cache (whole pages), the
# lengths the synthetic ones above. Each part is its share of the pool, averaged over the steps in which a
# request waits.

# %%
pool = budget - budget % 16
traffic = {d: data.synthetic_lengths(d, S["served"][d], seed=i) for i, d in enumerate(data.REQUEST_DATASETS)}
bd = {d: ch05.breakdown(i, o, pool) for d, (i, o) in traffic.items()}
rows = {(d, ch05.SCHEME_LABEL[k]): {ch05.PART_STYLE[p][0]: r[p] for p in ch05.PARTS}
        | {"live requests": r["live"], "preemptions": r["preemptions"]} for d, b in bd.items() for k, r in b.items()}
bd_table = pd.DataFrame(rows).T.rename_axis(["trace (synthetic)", "allocator"])
display(show(bd_table, percent=[ch05.PART_STYLE[p][0] for p in ch05.PARTS],
             caption=f"where a pool of {pool:,} positions goes, averaged over the steps a request waits"))
for d, b in bd.items():
    print(f"{d}: the requests pages hold at once would need {b['paged']['bound_max']:.2f} pools reserved at "
          f"{data.MAX_REQUEST_LEN:,} each, {b['paged']['bound_budget']:.2f} at prompt + {ch05.ANSWER_BUDGET}")

# %%
fig_bd = ch05.plot_breakdown(bd)
m |= dict(breakdown=bd, pool_positions=pool)
beside("ch05", "ch05.breakdown", values=ch05.values(m),
       why=f"your run serves {S['served']['ShareGPT']:,} ShareGPT- and {S['served']['Alpaca']:,} Alpaca-shaped "
           f"requests, the book {FULL['served']['ShareGPT']:,} and {FULL['served']['Alpaca']:,}: fewer pass "
           "through the pool, so the start (every request admitted at once) weighs more.")

# %% [markdown]
# ### What reading pages costs on the CPU
#
# Decode attention moves many bytes and does little arithmetic on each, so its time follows the bytes.
# `paged_attention_gather` reads every page, writes a copy and reads the copy again: three passes over the
# keys and values where attention over a contiguous cache makes one. `paged_attention_cpu` makes one pass:
# a task (a sequence and a run of up to 512 of its positions) walks its block table and reads each page
# where it lies, a contiguous block of `page_size` rows with every KV head of one position. It takes one
# KV head at a time, reads its keys and values in the page once for the query heads that share them, and
# keeps the online softmax above per query head; a short second loop merges each sequence's runs by
# log-sum-exp.
# This is why serving engines (vLLM's paged attention, FlashInfer) read pages in place.
#
# Both are timed against `scaled_dot_product_attention` over a contiguous cache with SmolLM2's heads and
# pages of 16 scattered at random in the pool: medians over alternating rounds, warm (back to back).
# At 4,096 positions (full mode) each case is repeated on fresh data, in turns, also with the CPU caches
# flushed before every call and on one thread; the table keeps the median run and the spread.

# %%
speed = ch05.decode_attention_times(S["contexts"], S["batches"], S["reps"], S["repeats"])


def speed_row(r):
    return {"in place (ms)": r["paged"]["median"] * 1e3, "gathered (ms)": r["gather"]["median"] * 1e3,
            "contiguous (ms)": r["contiguous"]["median"] * 1e3, "ratio": r["ratio"],
            "lowest ratio": r["ratio_range"][0], "highest ratio": r["ratio_range"][1],
            "gathered ratio": r["gather_ratio"], "runs": r["repeats"]}


rows = {}
for (B, L), r in speed.items():
    rows[(B, L, "warm")] = speed_row(r)
    for name in ch05.LONG_CASES:
        if name in r:
            rows[(B, L, name.replace("_", " "))] = speed_row(r[name])
speed_table = pd.DataFrame(rows).T.rename_axis(["batch", "context", "case"])
show(speed_table, caption="decode attention over pages against contiguous (ratio: in place / contiguous)")

# %%
fig_speed = ch05.plot_speed(speed)
m |= dict(concurrency=conc, budget_positions=budget, speed=speed)
beside("ch05", "ch05.speed", values=ch05.values(m),
       why=f"your run takes medians of {S['reps']} rounds, {S['repeats']} times, the book {FULL['reps']} rounds, "
           f"{FULL['repeats']} times: a ratio of two short times moves with whatever else the machine runs.")

# %% [markdown]
# Read the ratio with its spread: on a shared machine a single run can land anywhere in it. How much the
# ratio matters for a whole decode step depends on attention's share of the step, which grows with the
# context: chapter 3 measures it (figure `ch03_attention_share.png`). On a GPU the Triton kernel reads
# the pages in place the same way: `python -m lab.experiments.gpu` measures it there.
#
# ## Record
#
# The figures drawn above are saved as they are, not drawn again.

# %%
m |= dict(agreement=agree, ragged=ragged)
ch05.record(m, drawn={"block_tables": fig_tables, "utilization": fig_util, "breakdown": fig_bd,
                      "speed": fig_speed})
print("wrote section ch05 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# 1. **Rollback on pages.** After `drafted` draft tokens were written to a `PagedCache` and only the
#    first `accepted` were accepted, roll the cache back so it holds exactly the accepted ones. The rule:
#    go through the block manager (`cache.manager`, one call per sequence in `cache.seqs`), not the
#    cache's own `crop`, which raises in the check however you reach it (on the cache, unbound, through
#    `super()`, or the `_truncate` behind it). Rollback on pages is
#    bookkeeping: the block table gets shorter, pages past the new end go back to the free list, and no
#    key in the pool moves. The check counts the pages in use and decodes on against a cache that only
#    ever saw the accepted tokens.
# 2. **The block size a real system picks.** `best_block_size(lengths, candidates, page_cost,
#    shared_prefix)` returns the candidate page size with the lowest cost in positions: the unused
#    positions of the pool's pages, plus `page_cost` for every block-table entry of every request (the
#    work a page costs beyond its positions: a table entry, a loop iteration, a load to issue). Every
#    request starts with the same `shared_prefix` tokens, stored once but only in full pages (a page can
#    be shared, and hashed for prefix caching, only when it is full); `lengths` are the tokens after the
#    prefix. The check counts the pages by running each candidate through a real `BlockManager`, on
#    workloads drawn fresh at every run, after your function has answered (it raises meanwhile). Small
#    pages waste little but cost more entries; large ones waste up to a page per request and share less
#    of the prefix. vLLM's default is 16.
# 3. **Open-ended: the indirection on your machine.** Time decode attention over pages against a
#    contiguous cache at 4,096 positions, batch 1: `ratio = ex.time_paged_against_contiguous(4096)`
#    (warm, 15 alternating rounds, SmolLM2's heads), then `compare_with_book("ch05.speed.B1.T4096.ratio",
#    ratio)` prints yours beside the book's. Try `torch.set_num_threads(1)` too: which way does the ratio
#    move, and why?

# %%
from lab.exercises import ch05 as ex
from lab.exercises import compare_with_book  # noqa: F401  (for exercise 3)


def speculative_step(cache, accepted, drafted):
    raise NotImplementedError("your answer")


def best_block_size(lengths, candidates, page_cost, shared_prefix):
    raise NotImplementedError("your answer")


for check, answer in ((ex.check_speculative_rollback, speculative_step), (ex.check_best_block_size, best_block_size)):
    try:
        check(answer)
    except NotImplementedError:
        print(f"{check.__name__}: not attempted yet")

# Exercise 3, on your machine:
# ratio = ex.time_paged_against_contiguous(4096)
# compare_with_book("ch05.speed.B1.T4096.ratio", ratio)

# %% [markdown]
# Reference solutions are in `lab/exercises/ch05_solutions.py`; the test suite runs every check on them.
