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
# # Chapter 12 — Many answers from one prompt
#
# Every chapter so far served one answer per prompt. Users often ask for more: `n` samples of one prompt
# (OpenAI's `n`, best-of-n, self-consistency, the rollouts of reinforcement learning), or the best few
# continuations found by **beam search**. The answers share their prompt, and often much more: paging was
# first sold on exactly this. Pages are counted, not owned (chapter 5), so n answers can hold one copy of
# the prompt's pages, and a page is copied only when an answer first writes into one it shares.
#
# The notebook forks a sequence by hand, with copy on write, and checks it against `lab`'s block manager.
# Then it asks the engine for many answers, runs beam search on pages beside transformers', and merges two
# partial attentions by hand, the step that lets a shared prefix be read once for every answer. Only then
# does it measure: memory, bytes copied, attention time and the engine end to end.

# %%
import lab  # first, before torch: it sets OpenMP's wait policy, which torch reads once, when it loads

import math
import platform

import pandas as pd
import torch
from IPython.display import display

from lab import results
from lab.book.verdicts import beside
from lab.cache import BlockManager
from lab.engine import ServingEngine, beam_search
from lab.experiments import ch12_branches as ch12
from lab.experiments.tables import show
from lab.kernels import cascade_attention, merge_attention, paged_attention_reference
from lab.models import load

print(f"python {platform.python_version()}, torch {torch.__version__}, threads {torch.get_num_threads()}")
print(lab.threads.describe())
QUICK = results.quick()
S, FULL = ch12.settings(QUICK), ch12.settings(False)
print("quick mode" if QUICK else "full mode", "-> results in", results.results_path())
smol = load("smollm2")
tok = smol.tokenizer

# %% [markdown]
# ## 1. A fork by hand
#
# A pool of pages, 4 positions each (one number per position stands for its keys and values), a free
# list, a reference count per page and a block table per sequence. `fork` copies a block table and counts
# each page once more: nothing is copied. `append` writes the next position; when the sequence's last page
# is partly filled and shared, it first takes a private copy of it (copy on write).

# %%
P = 4
pool, free, refs = torch.zeros(16, P), list(range(16)), [0] * 16
tables, lengths = {}, {}


def take():
    page = free.pop(0)
    refs[page] = 1
    return page


def append(seq, x):
    table, n = tables.setdefault(seq, []), lengths.get(seq, 0)
    if n % P == 0:                                   # the last page is full (or there is none): a new one
        table.append(take())
    elif refs[table[-1]] > 1:                        # shared and partly filled: copy it first
        old, table[-1] = table[-1], take()
        refs[old] -= 1
        pool[table[-1]] = pool[old]
    pool[table[-1], n % P] = x
    lengths[seq] = n + 1


def fork(src, dst):
    tables[dst], lengths[dst] = list(tables[src]), lengths[src]
    for page in tables[src]:
        refs[page] += 1


def read(seq):
    return torch.cat([pool[page] for page in tables[seq]])[:lengths[seq]].tolist()


# %% [markdown]
# A prompt of 6 positions, forked into three answers, each of which then writes 3 positions of its own:

# %%
for x in range(1, 7):
    append("a", x)
fork("a", "b")
fork("a", "c")
for seq, first in (("a", 10), ("b", 20), ("c", 30)):
    for x in range(first, first + 3):
        append(seq, x)
print({seq: read(seq) for seq in "abc"})
print("block tables:", tables, " references:", refs[:8])
assert read("b") == [1, 2, 3, 4, 5, 6, 20, 21, 22]            # the prompt, then only what b wrote

# %% [markdown]
# The full page of the prompt (page 0) is held once by all three. The partly filled one (page 1) was
# copied by the first two answers to write into it; the last writes into the original, which only it
# holds by then. `lab`'s `BlockManager` makes the same choices, page for page:

# %%
bm, copies = BlockManager(num_pages=16, page_size=P), []
bm.reserve("a", 6)
bm.fork("a", "b")
bm.fork("a", "c")
for seq in "abc":
    for _ in range(3):
        copies += bm.reserve(seq, 1)
assert {seq: bm.block_table(seq) for seq in "abc"} == tables and [bm.refs(p) for p in range(8)] == refs[:8]
print("the same block tables; the pages copied on write, (from, to):", copies)

# %% [markdown]
# ## 2. Many answers in the engine
#
# `ServingEngine.add_request(ids, max_new_tokens, n=4, temperature=0.8, seed=0)` prefills the prompt once;
# at its first token the other answers fork its pages, and each then decodes as a request of its own,
# drawing its tokens with a generator of its own (seeded `seed + i`). The answers are the requests
# `rid .. rid + 3`:

# %%
prompt = tok.encode(tok.apply_chat_template([dict(role="user", content="Name a colour and a fruit.")],
                                             add_generation_prompt=True))
eos = tok.encode(tok.special["eos_token"])[0]
engine = ServingEngine(smol, num_pages=64, page_size=16)
rid = engine.add_request(prompt, 24, eos_id=eos, n=4, temperature=0.8, seed=0)
while engine.running or engine.waiting:
    engine.step()
for i in range(4):
    print(f"answer {i}: {tok.decode(engine.output(rid + i)).strip()!r}")
print(f"prompt {len(prompt)} tokens; tokens computed: {engine.stats['computed_tokens']} "
      f"(the prompt once, then the answers); pages held at the most: {engine.stats['peak_held_pages']['full']}")

# %% [markdown]
# With `temperature=0` every answer is the greedy one, and equals the prompt decoded alone. Sampled, each
# answer equals what a request of its own with the same seed draws: the fork changes where the keys and
# values live, never which tokens come out (the test suite checks both against recomputation without a
# cache, and the first token's frequencies against the model's distribution).
#
# ## 3. What sharing saves
#
# How much memory the fork saves depends on how long the prompt is beside the answers. Chapter 5's
# synthetic request lengths (log-normal, with the ShareGPT and Alpaca means the vLLM paper reports): for
# each request, a prompt and n answers of lengths drawn alike, counted on a `BlockManager`. The saving is
# the share of page-steps (pages held, summed over the decode steps) that n requests of their own would
# hold and the fork does not. Beam search forks and drops beams at every step (section 4); its savings are
# counted from the real search on SmolLM2.

# %%
sampling = ch12.sampling_memory(S)
beams_mem = ch12.beam_memory(smol, S)
rows = {(d, f"sampling, n = {n}"): r["saving"] for d, x in sampling.items() for n, r in x.items()}
rows |= {(d, f"beam search, {k} beams"): r["saving"] for d, x in beams_mem.items() for k, r in x.items()}
display(show(pd.DataFrame({"memory saved": rows}).rename_axis(["lengths", "answers"]), percent=["memory saved"]))
m = dict(settings=S, manifest=smol.manifest, threads=torch.get_num_threads(), sampling=sampling,
         beam_memory=beams_mem)
beside("ch12", "ch12.sampling", "ch12.beam_memory", values=ch12.values(m),
       why=f"your run counts {S['sampling_requests']} sampled requests and {S['beam_requests']} beam searches "
           f"of at most {S['beam_cap']} tokens; the book {FULL['sampling_requests']} and {FULL['beam_requests']} "
           f"of at most {FULL['beam_cap']}")

# %% [markdown]
# The vLLM paper (§6.3) reports 6.1–9.8% saved for parallel sampling and 37.6–55.2% for beam search on the
# Alpaca trace, 16.2–30.5% and 44.3–66.3% on ShareGPT's: answers of a short prompt share little, beams
# share most of their history.
#
# ## 4. Beam search on pages
#
# Beam search keeps the `k` best continuations. At each step every beam proposes its best tokens, the best
# 2k of (beam score + log-probability) are ranked, and the next beams are the best k that did not end. A
# beam chosen twice is forked; a beam not chosen is released. Only a partly filled last page shared by two
# beams is ever copied. transformers instead keeps one cache row per beam and reorders every row with
# `index_select` at every step. `lab.engine.beam_search` follows transformers' choices exactly:

# %%
from lab.models.hf import to_transformers  # noqa: E402

hf = to_transformers(smol)
ids = tok.encode("The three most useful things to pack for a long hike are")
ours = beam_search(smol, ids, num_beams=4, max_new_tokens=12, eos_id=eos)
with torch.inference_mode():
    theirs = hf.generate(torch.tensor([ids]), num_beams=4, do_sample=False, max_new_tokens=12, eos_token_id=eos,
                         pad_token_id=eos, num_return_sequences=4, output_scores=True, return_dict_in_generate=True)
for seq, score, hf_score in zip(ours.sequences, ours.scores, theirs.sequences_scores.tolist(), strict=True):
    print(f"{score:8.4f} (transformers {hf_score:8.4f})  {tok.decode(seq)!r}")
assert all(abs(a - b) < 1e-4 for a, b in zip(ours.scores, theirs.sequences_scores.tolist(), strict=True))
print(f"pages copied: {sum(ours.stats['copied_pages'])} in {len(ours.stats['forks'])} steps; bytes copied "
      f"{sum(ours.stats['copied_bytes']) / 2**10:,.0f} KiB, where reordering every row copies "
      f"{sum(ours.stats['index_select_bytes']) / 2**20:,.1f} MiB")

# %% [markdown]
# A longer prompt makes the difference plain: reordering copies every beam's whole cache at every step,
# copy on write at most one page per forked beam.

# %%
b = ch12.beams_vs_transformers(smol, S)
per_step = {"lab (pages)": (b["seconds"]["lab"], b["copied_per_step"]),
            "transformers (index_select)": (b["seconds"]["transformers"], b["index_select_per_step"])}
display(show(pd.DataFrame({who: {"ms per step": 1e3 * t / b["new"], "KiB copied per step": n / 2**10}
                           for who, (t, n) in per_step.items()})))
assert b["same"]
m["beams"] = b
beside("ch12", "ch12.beams", values=ch12.values(m),
       why=f"your run: a prompt of {S['tf_prompt']} tokens and {S['tf_new']} steps; the book's {FULL['tf_prompt']} "
           f"and {FULL['tf_new']}")

# %% [markdown]
# ## 5. One prefix, read once
#
# At a decode step, n answers of one prompt each attend over the prompt's keys and values and then over
# their own. Softmax attention over a set of positions can be cut in two: attend over each part alone, keep
# each part's log-sum-exp of scores (its softmax denominator, in logs), and weigh the two results by their
# denominators. By hand:

# %%
def attend(q, k, v):                                  # q [D], k, v [N, D] -> (out [D], log-sum-exp)
    s = k @ q / math.sqrt(q.shape[-1])
    return torch.softmax(s, 0) @ v, torch.logsumexp(s, 0)


def merge(o1, lse1, o2, lse2):                        # two disjoint parts -> their union
    m = torch.maximum(lse1, lse2)                     # subtract the larger: no exp overflows
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    return (w1 * o1 + w2 * o2) / (w1 + w2), m + torch.log(w1 + w2)


g = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(*shape, generator=g, dtype=torch.float64) for shape in ((64,), (300, 64), (300, 64)))
whole = attend(q, k, v)
parts = merge(*attend(q, k[:200], v[:200]), *attend(q, k[200:], v[200:]))
assert torch.allclose(parts[0], whole[0]) and torch.allclose(parts[1], whole[1])
assert torch.allclose(merge_attention(*attend(q, k[:200], v[:200]), *attend(q, k[200:], v[200:]))[0], whole[0])
print("attention over 300 positions = the merge of 200 and 100: equal, and equal to lab.kernels.merge_attention's")

# %% [markdown]
# So the shared part can be computed once for every answer: the queries of all n answers, as one matrix,
# against the prefix's keys, each page of the prefix read once instead of n times (Hydragen, FlashInfer's
# cascade attention); then each answer over its own pages; then the merge. `lab.kernels.cascade_attention`
# does this in the C++ kernel on the CPU and in Triton on a GPU, and equals the paged kernel over each
# answer's whole block table:

# %%
from lab.cascade_bench import cascade_inputs  # noqa: E402

x = cascade_inputs(n=8, shared=1024)
cascade = cascade_attention(x["q"], x["k_pool"], x["v_pool"], x["shared_table"], x["shared"], x["tables"], x["lengths"])
paged = paged_attention_reference(x["q"], x["k_pool"], x["v_pool"], x["full"], x["full_lengths"])
print(f"8 answers over a shared prefix of 1,024 positions: largest difference {(cascade - paged).abs().max():.1e}")
assert torch.allclose(cascade, paged, atol=1e-5)   # float32 sums in another order: a few units in the 6th place

# %%
att = ch12.attention(S)
display(show(pd.DataFrame({(r["dtype"], r["n"], r["shared"]): {"cascade (ms)": r["cascade_ms"],
                                                                "paged (ms)": r["paged_ms"],
                                                                "cascade MB read": r["cascade_MB"],
                                                                "paged MB read": r["paged_MB"]}
                           for r in att}).T.rename_axis(["dtype", "answers", "shared positions"])))
m["attention"] = att
beside("ch12", "ch12.attention", values=ch12.values(m),
       why="your run times fewer cases, fewer rounds each; the book's grid goes to 16,384 shared positions")

# %% [markdown]
# ## 6. The engine, end to end
#
# n answers to each prompt as one request (one prefill, forked), against n requests of their own, with and
# without prefix caching (which lets a request take a prompt another has already computed, but not one
# being computed beside it):

# %%
e = ch12.engine_end_to_end(smol, S)
display(show(pd.DataFrame({mode: {"tokens/s": r["tokens_per_s"], "time to first token (s)": r["ttft_mean_s"],
                                  "positions computed": r["computed_tokens"], "pages held at most": r["peak_pages"]}
                           for mode, r in e.items() if mode != "same_answers"}).T.rename_axis("answers")))
assert e["same_answers"]
m["engine"] = e
m["http"] = "the notebook does not start servers; `make results` compares the lab's server with vLLM's"
beside("ch12", "ch12.engine", "ch12.http", values=ch12.values(m),
       why=f"your run: {S['engine_prompts']} prompts of {S['engine_prompt']} tokens, {S['engine_new']} new each; "
           f"the book's {FULL['engine_prompts']} of {FULL['engine_prompt']}, {FULL['engine_new']} new. With few new "
           "tokens the prompts are most of the work, and the fork computes each prompt once where the n requests "
           "compute part of it again for every answer, so the fork's ratio over them is larger than the book's.")

# %% [markdown]
# ## Record

# %%
ch12.record(m)
print("wrote section ch12 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# 1. **Fork a partly filled page, with release, on a pool that counts.** Section 1's fork, grown into a page
#    manager on the check's pool (`pool.take()`, `pool.give(page)`, `pool.write(page, offset, value)`,
#    `pool.copy(src, dst)`): `append`, `fork`, `release`, `block_table`. A fork copies nothing; a write into a
#    shared, partly filled page copies that page first; full pages are never copied; a page nobody holds goes
#    back. `BlockManager` raises in the check, which reads every sequence through your block tables after
#    every operation and counts the pages you hold and copy against `lab`'s manager on the same trace.
# 2. **Merge two partial attentions.** `merge(out_1, lse_1, out_2, lse_2) -> (out, lse)`: attention over two
#    disjoint sets of positions from each set's output `[N, H_q, D]` and log-sum-exp `[N, H_q]`. A set of no
#    positions has lse -inf and out 0. The check compares with attention over the union in float64, on cases
#    with scores in the hundreds, where exp overflows float32; `merge_attention` raises meanwhile.
# 3. **Move beams by their block tables.** `reorder(tables, lengths, parents, refs, free, page_size) ->
#    (new_tables, copies)`: new beam i continues old beam `parents[i]`. Return each new beam's table (its
#    parent's positions and room for one more) and the (src, dst) copies to do before the beams write; update
#    `refs` and `free` in place. Copy only a shared, partly filled last page, one copy fewer than the beams that
#    write it; give a dropped beam's pages back. The check fails transformers' whole-cache reordering and
#    compares with `BlockManager`'s copy on write.

# %%
from lab.exercises import ch12 as ex  # noqa: E402


class MyPages:
    def __init__(self, pool):
        self.pool, self.P = pool, pool.page_size

    def append(self, seq, value):               # one more position of seq (a new id starts empty)
        raise NotImplementedError("your answer")

    def fork(self, src, dst):                   # dst holds what src holds: share, count, copy nothing
        raise NotImplementedError("your answer")

    def release(self, seq):                     # pages no sequence holds any more: pool.give
        raise NotImplementedError("your answer")

    def block_table(self, seq) -> list:
        raise NotImplementedError("your answer")


def my_merge(out_1, lse_1, out_2, lse_2):
    raise NotImplementedError("your answer")


def my_reorder(tables, lengths, parents, refs, free, page_size):
    raise NotImplementedError("your answer")


for check, answer in ((ex.check_copy_on_write, MyPages), (ex.check_merge, my_merge),
                      (ex.check_beam_reorder, my_reorder)):
    try:
        check(answer)
    except NotImplementedError:
        print(f"{check.__name__}: not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch12_solutions.py`; the test suite runs every check on them.
