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
# # Chapter 5 — Paged attention
#
# A cache stored in one piece must be reserved for the longest sequence it might hold. Pages — fixed-size
# blocks handed out from a pool and listed in a per-sequence block table — let a sequence grow, shrink,
# fork and roll back without moving data. This chapter builds the block manager, a paged cache that the
# same forward runs on, a decode-attention kernel over pages, and measures how much memory pages save.

# %%
import platform

import torch
import transformers

from lab import results
from lab.cache import BlockManager, OutOfPagesError
from lab.experiments import ch05_paged as ch05
from lab.models import load

print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"threads {torch.get_num_threads()}, CUDA available: {torch.cuda.is_available()}")
QUICK = results.quick()
S = ch05.settings(QUICK)
print("quick mode" if QUICK else "full mode", "-> results in", results.results_path())

# %% [markdown]
# ## The block manager: pages as host-side lists

# %%
bm = BlockManager(num_pages=8, page_size=4)
bm.reserve("a", 6)                      # 2 pages
bm.reserve("b", 3)                      # 1 page
bm.fork("a", "a2")                      # shares a's pages
print("a:", bm.block_table("a"), "a2:", bm.block_table("a2"), "b:", bm.block_table("b"), "free:", bm.num_free)
print("copy on write:", bm.reserve("a2", 1), "-> a2:", bm.block_table("a2"))
try:
    bm.reserve("b", 100)
except OutOfPagesError as e:
    print("OutOfPagesError:", e, "| free pages still", bm.num_free)

# %% [markdown]
# ## The paged cache runs under the same forward
#
# SmolLM2 decoding through a `PagedCache` gives the same tokens as the concatenating cache, for page
# sizes 1, 16 and 64, from a 37-token prompt that crosses page boundaries.

# %%
smol = load("smollm2")
agree = ch05.token_agreement(smol, S["page_sizes"], 37, S["new_tokens"])
for ps, r in agree.items():
    print(f"page size {ps:>3}: identical tokens {r['identical']}, max |Δ logit| {r['max_diff']:.2e}")
ragged = ch05.ragged_batch(smol, new_tokens=S["new_tokens"] // 2)
print("a batch of lengths", ragged["lengths"], "decoded together, identical to each alone:", ragged["identical"])

# %%
ch05.plot_block_tables();

# %% [markdown]
# ## How much reserved memory holds real tokens
#
# Request lengths are **synthetic**: log-normal draws whose means match the statistics the vLLM paper
# published for ShareGPT (input 161.31, output 337.99 tokens) and Alpaca (19.31, 58.45).

# %%
lengths = {d: ch05.synthetic_lengths(d, S["requests"], seed=i) for i, d in enumerate(ch05.DATASETS)}
util = {d: ch05.utilization(i, o) for d, (i, o) in lengths.items()}
for d, u in util.items():
    i, o = lengths[d]
    print(f"{d} (synthetic, mean input {i.mean():.1f}, output {o.mean():.1f}):")
    print(f"   contiguous at {ch05.MAX_LEN}: {u['contiguous_max']:.1%}   prompt + {ch05.ANSWER_BUDGET}: "
          f"{u['contiguous_budget']:.1%}")
    print("   " + "  ".join(f"pages of {b}: {u[f'paged_{b}']:.1%}" for b in ch05.BLOCK_SIZES))
by_manager = {d: ch05.utilization_by_manager(i[:S["manager_requests"]], o[:S["manager_requests"]])
              for d, (i, o) in lengths.items()}
print("through the real BlockManager, pages of 16:", {d: f"{u:.1%}" for d, u in by_manager.items()})
ch05.plot_utilization(util);

# %%
from lab.cache import cache_bytes

budget = 2**30 // cache_bytes(smol.config, 1, 1, torch.float16)
conc = {d: ch05.concurrency(i, o, budget) for d, (i, o) in lengths.items()}
print(f"requests that fit at once in 1 GiB of 16-bit SmolLM2 cache ({budget:,} positions):", conc)

# %% [markdown]
# ## Reading keys page by page, on the CPU
#
# Decode attention over pages (the PyTorch reference: it gathers the key pages and sums the values by
# index) against `scaled_dot_product_attention` over a contiguous cache, for SmolLM2's head shape.

# %%
speed = ch05.decode_attention_times(S["contexts"], S["batches"], S["reps"], S["repeats"])


def line(r):
    spread = (f" (lowest {r['ratio_range'][0]:.2f}, highest {r['ratio_range'][1]:.2f} of {r['repeats']} runs; "
              f"{r['runs_within']} at most {ch05.SPEED_TARGET[1]})")
    return (f"pages {r['paged']['median'] * 1e3:7.3f} ms, contiguous {r['contiguous']['median'] * 1e3:7.3f} ms, "
            f"ratio {r['ratio']:.2f}" + (spread if r["repeats"] > 1 else ""))


for (B, L), r in speed.items():
    print(f"batch {B}, context {L:>5}: {line(r)}")
    for name, label in (("cold", "caches flushed"), ("one_thread", "one thread")):
        if name in r:
            print(f"{label:>24}: {line(r[name])}")
ch05.plot_speed(speed);

# %% [markdown]
# ## Record

# %%
means = {d: (float(i.mean()), float(o.mean())) for d, (i, o) in lengths.items()}
m = dict(settings=S, manifest=smol.manifest, means=means,
         utilization=util, by_manager=by_manager, concurrency=conc, budget_positions=budget, speed=speed,
         agreement=agree, ragged=ragged)
ch05.record(m)
print("wrote section ch05 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# 1. **Rollback for speculative decoding.** Write `speculative_step(cache, accepted, drafted)`: after
#    `drafted` draft tokens were written to a paged cache and only the first `accepted` were accepted, roll
#    the cache back so it holds exactly the accepted ones. The check decodes on with the real model.
# 2. **The best block size.** Write `best_block_size(total_lengths, candidates)`: the candidate block size
#    that wastes the fewest positions for a list of sequence lengths, counting that a smaller block needs a
#    longer block table (4 bytes a page). The check compares with a brute-force count.

# %%
from lab.exercises import ch05 as ex


def speculative_step(cache, accepted, drafted):
    raise NotImplementedError("your answer")


def best_block_size(total_lengths, candidates, bytes_per_position):
    raise NotImplementedError("your answer")


for check, answer in ((ex.check_speculative_rollback, speculative_step), (ex.check_best_block_size, best_block_size)):
    try:
        check(answer)
    except NotImplementedError:
        print(check.__name__, ": not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch05_solutions.py`; the test suite runs every check on them.
