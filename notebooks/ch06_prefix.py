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
# # Chapter 6 — Prefix caching
#
# Chapter 4 keyed one whole state: reuse it only if the model, the tokenizer and every token id are the
# same. Chapter 5 handed out pages. Serving engines join the two: they give every *full page* of a
# request a name that stands for everything its keys and values depend on (every token up to the page's
# end, the model, the salt), keep named pages after a request ends, and let the next request that
# begins the same way take them instead of computing them.
#
# This notebook builds the two pieces in front of you: the chained name of a page, and the lookup that
# turns names into pages, with least-recently-used eviction. Each is checked against `lab`. Then it runs
# the real model through `lab`'s `PrefixCachingBackend`, and only then measures: how much of a workload
# the pages hold, what a hit saves, what a shared cache tells another tenant, and what caching saves in
# money.

# %%
import lab  # first, before torch: it sets OpenMP's wait policy, which torch reads once, when it loads

import math
import platform
import random

import pandas as pd
import torch
import transformers
from IPython.display import display

from lab import data, results, workloads
from lab.experiments import ch06_prefix as ch06
from lab.experiments.tables import show
from lab.book.verdicts import beside

print(f"python {platform.python_version()}, torch {torch.__version__}, transformers {transformers.__version__}, "
      f"pandas {pd.__version__}, threads {torch.get_num_threads()}")
print(lab.threads.describe())
QUICK = results.quick()
S, FULL = ch06.settings(QUICK), ch06.settings(False)      # FULL: the book's settings, to say what quick mode skips
print("quick mode" if QUICK else "full mode", "-> results in", results.results_path())

# %% [markdown]
# ## 1. A page's name, by hand
#
# Page $i$ of a sequence holds positions `i * PAGE` to `i * PAGE + PAGE - 1`. Its keys and values
# depend on every token before it, not only on its own, so its name must too. Hashing the whole prefix
# for every page would cost quadratic time; a **chain** costs one hash per page: page $i$'s name hashes
# page $(i - 1)$'s name and page $i$'s own tokens. The chain starts from a **root** that hashes everything
# else the state depends on: the model, the tokenizer, the dtypes, and a salt. A partial last page gets
# no name: its positions are not final, so nobody may share it.

# %%
import hashlib

import numpy as np

PAGE = 4


def name_page(parent: bytes, tokens) -> bytes:
    """sha256 of the parent's name and the page's token ids (as little-endian int64)."""
    return hashlib.sha256(parent + np.asarray(tokens, dtype="<i8").tobytes()).digest()


def page_names(ids, root: bytes) -> list:
    names, parent = [], root
    for i in range(len(ids) // PAGE):            # full pages only
        parent = name_page(parent, ids[i * PAGE:(i + 1) * PAGE])
        names.append(parent)
    return names


ids = [17, 4, 99, 3, 8, 8, 51, 2, 40, 41, 42, 43, 7, 9]        # 14 tokens: three full pages and two tokens
root = hashlib.sha256(b"model manifest, tokenizer, dtypes, salt").digest()
edited = list(ids)
edited[9] = 0                                                # a token of page 2 changed
for a, b in zip(page_names(ids, root), page_names(edited, root), strict=True):
    print(a.hex()[:16], b.hex()[:16], "same" if a == b else "differs")

# %% [markdown]
# Three names for 14 tokens. Changing a token in page 2 changes page 2's name and, through the chain,
# every later one; pages 0 and 1 keep theirs, so they can still be shared. Another root (another model,
# or another tenant's salt) changes every name.
#
# `lab` computes the same chain: `block_hashes(ids, page_size, extra)` starts it at
# `root_digest(extra)` (a sha256 of the state identity and the salt) and returns the names in hex.

# %%
from lab.engine import block_hashes, root_digest

extra = ("a model's manifest", "tenant-a")
by_hand = [n.hex() for n in page_names(ids, root_digest(extra))]
assert by_hand == block_hashes(ids, PAGE, extra=extra)
assert block_hashes(ids, PAGE, extra=("a model's manifest", "tenant-b"))[0] != by_hand[0]
print("block_hashes equals the chain written by hand; another salt renames page 0 (and so every page)")

# %% [markdown]
# ## 2. From names to pages, by hand
#
# A pool of `NUM_PAGES` pages, free between requests. `page_of` maps a name to the page holding it;
# `free` is the queue of free pages, least recently freed on the left. A request:
#
# 1. takes the pages of its longest named prefix, but never its last token's page whole: the model must
#    run at least one token to produce the next token's scores, so at most `(len - 1) // PAGE` pages;
# 2. takes a fresh page from the left of `free` for each page it still needs; a fresh page that holds a
#    name is **evicted**: its name is forgotten;
# 3. names its new full pages (a name some page already holds stays with that page);
# 4. ends: every page goes back to the right of `free`, its last page first, **keeping its name**.
#
# Pages come back in the order they are freed and go out from the other end, so the page evicted is the
# one unused the longest: LRU.

# %%
from collections import deque

NUM_PAGES = 6
free, page_of, name_of = deque(range(NUM_PAGES)), {}, {}     # name_of: page -> its name


def serve(ids, root):
    """Serve one request; returns how many of its tokens came from cached pages."""
    names = page_names(ids, root)
    n = 0
    while n < (len(ids) - 1) // PAGE and names[n] in page_of:   # 1. the longest named prefix
        n += 1
    table = [page_of[name] for name in names[:n]]
    for page in table:
        free.remove(page)
    for _ in range(-(-len(ids) // PAGE) - n):                   # 2. fresh pages, evicting the LRU names
        page = free.popleft()
        if page in name_of:
            del page_of[name_of.pop(page)]
        table.append(page)
    for i in range(n, len(names)):                              # 3. name the new full pages
        if names[i] not in page_of:
            page_of[names[i]], name_of[table[i]] = table[i], names[i]
    free.extend(reversed(table))                                # 4. freed, last page first, names kept
    return n * PAGE


system = [5, 6, 7, 8, 9, 10, 11, 12]                            # two pages every request starts with
for question in ([1, 2, 3], [4, 4], [1, 2, 3]):
    print(f"{len(system + question)} tokens, {serve(system + question, root)} from cache")

# %% [markdown]
# The first request computes everything; the next two find the system prompt's two pages.
#
# ### The same with `lab`
#
# `lab`'s `BlockManager` keeps exactly this bookkeeping (`register` names a page, `reserve_prefix` takes
# the named prefix and checks the stored tokens, so a hash collision is a miss, never wrong state), and
# `PrefixCachingBackend` drives it for every request. Its `dry_run` does the bookkeeping without running
# the model. On a random stream of requests that share a few prefixes, with a pool small enough to evict
# all the time, our fifteen lines and `lab` serve the same tokens from cache, request by request.

# %%
from lab.engine import PrefixCachingBackend
from lab.models import load

tiny = load("tiny-llama")                       # a small random model: the bookkeeping needs no real one
rng = random.Random(0)
prefixes = [[rng.randrange(320) for _ in range(rng.randint(4, 13))] for _ in range(3)]
stream = [rng.choice(prefixes) + [rng.randrange(320) for _ in range(rng.randint(1, 9))] for _ in range(200)]

free, page_of, name_of = deque(range(NUM_PAGES)), {}, {}
ours = [serve(x, root) for x in stream]
backend = PrefixCachingBackend(tiny, NUM_PAGES, PAGE)
theirs = [backend.dry_run(x) for x in stream]
assert ours == theirs
print(f"{len(stream)} requests: identical counts; {sum(ours)} of {sum(map(len, stream))} tokens from cache, "
      f"{backend.stats['evicted_pages']} pages evicted")

# %% [markdown]
# ## 3. On the real model
#
# `PrefixCachingBackend(model, num_pages, page_size)` takes ids and returns the next token's scores,
# like every backend of chapter 4; all requests share one pool. Two users send questions behind the same
# system prompt; a third sends the second's request under another tenant's salt. Every score must equal
# recomputation without a cache.

# %%
from lab.engine import RecomputeBackend

smol = load("smollm2")
tok = smol.tokenizer
backend = PrefixCachingBackend(smol, num_pages=64, page_size=16)
recompute = RecomputeBackend(smol)
system_prompt = data.passages(tok, 100, count=1, seed=1)[0]
questions = data.passages(tok, 12, count=2, seed=2)
rows = []
for who, ids, salt in (("user 1", system_prompt + questions[0], None), ("user 2", system_prompt + questions[1], None),
                       ("user 2, another tenant", system_prompt + questions[1], "tenant-b")):
    before = dict(backend.stats)
    got = backend.next_logits(ids, salt=salt)
    diff = (got - recompute.next_logits(ids)).abs().max().item()
    assert diff < 1e-3, diff       # float32, the same sums in another order: ~1e-5 on logits of order 10
    rows.append({"request": who, "tokens": len(ids),
                 "from cache": backend.stats["cached_tokens"] - before["cached_tokens"],
                 "computed": backend.stats["computed_tokens"] - before["computed_tokens"],
                 "largest |Δ logit| vs recomputation": diff})
show(pd.DataFrame(rows).set_index("request"), digits={"largest |Δ logit| vs recomputation": 1})

# %% [markdown]
# User 2 finds the six full pages of the 100-token system prompt (96 tokens) and computes the rest. The
# same tokens under another salt find nothing: the salt is in the root of the chain, so every name
# differs.
#
# ### A conversation
#
# A chat template renders the whole conversation every turn, so a turn's prompt is the previous prompt,
# the reply and the new message, in the template's markup. What a cache can reuse is the longest common
# prefix with what the backend saw, rounded down to whole pages and never the last token. `ChatSession`
# records both, turn by turn.

# %%
from lab.engine import ChatSession

chat = ChatSession(smol, PrefixCachingBackend(smol, num_pages=128, page_size=16),
                   system="You are a helpful assistant who answers in one sentence.", max_new_tokens=24)
for text in ("What is a key-value cache?", "Why does it save time?", "And what does it cost?"):
    print(">", text, "\n ", chat.say(text).strip()[:200])
show(pd.DataFrame(chat.turns).rename(columns={"prompt_tokens": "prompt (tokens)", "common_prefix": "common prefix",
                                                "reused_tokens": "from cache", "reply_tokens": "reply (tokens)"}
                                       ).rename_axis("turn"))

# %% [markdown]
# From the second turn on, the common prefix is the whole earlier conversation, the previous prompt and
# its reply (the reply, decoded and rendered again, gives the same ids here), and the backend reuses it
# rounded down to whole pages. Pages written while the reply was decoded are named too, so the reply
# itself is reused. (The replies are a 135M-parameter model's, cut at 24 tokens, and may repeat an earlier
# one: what matters here is what each turn's prompt shares with the last.)
#
# ## 4. Measuring
#
# ### How much of a workload the pages hold
#
# Three **synthetic** workloads (random token ids in the shapes of real traffic), and after them a real
# trace:
#
# - **system prompts**: eight applications, each with a long system prompt (500–1,500 tokens), picked
#   with Zipf popularity; each request is a system prompt and a question of 20–150 tokens;
# - **multi-turn chats**: conversations of six turns, interleaved, behind one 300-token system prompt;
#   each turn adds the previous reply (50–250 tokens) and a message (20–120);
# - **few-shot**: four tasks, each an instruction and six fixed examples, then a query of 30–80 tokens.
#
# Each runs through one pool of 16-token pages, sized as a fraction of the workload's distinct pages (the
# pool that never has to evict), with LRU eviction. The bookkeeping is `dry_run`'s, which counts exactly
# what scoring does (tested), so the sweep needs no model time.

# %%
requests = {name: make(smol.config.vocab_size, S["scale"]) for name, make in workloads.WORKLOADS.items()}
sweep = workloads.hit_rate_sweep(smol, requests, S["pool_fractions"])
show(pd.DataFrame({name: r["shape"] for name, r in sweep.items()}).T.rename(columns={
    "mean_tokens": "mean prompt (tokens)", "max_tokens": "longest prompt (tokens)", "tokens": "prompt tokens",
    "distinct_pages": "distinct full pages"}).rename_axis("workload (synthetic)"))

# %%
fig_hit_rate = ch06.plot_hit_rate(sweep)
m = dict(settings=S, manifest=smol.manifest, threads=torch.get_num_threads(), sweep=sweep)
beside("ch06", "ch06.workloads", values=ch06.values(m),
       why=f"your run builds the workloads at {S['scale']:.0%} of the book's size and tries {len(S['pool_fractions'])} "
           f"pool sizes, the book {len(FULL['pool_fractions'])}: the pools the book quotes by size are not in your "
           "sweep.")

# %% [markdown]
# Even a pool that never evicts computes each distinct page once, and every request computes its own
# tail; so no curve reaches 100 %. Below that, how steeply a curve falls says how concentrated the
# reuse is: few-shot prompts share a few prefixes that everyone uses, chats share a short system prompt
# and then each conversation only with itself.
#
# ### Real traffic: Mooncake's conversation trace
#
# Moonshot AI published, with the Mooncake paper (FAST '25), an hour of requests to its chat service Kimi:
# no text, but each request's arrival time, prompt and answer lengths, and one hash id per 512-token block
# of the prompt, equal ids at the start of two requests marking a prefix they share. The lab ships it in
# `data/mooncake/` (its source and license beside it). One row:

# %%
import json

from lab.experiments import mooncake
from lab.workloads import MOONCAKE, spelled_digits

with open(MOONCAKE) as f:
    rows = [json.loads(next(f)) for _ in range(3)]
show(pd.DataFrame(rows).assign(hash_ids=[f"{r['hash_ids'][:5]} ... ({len(r['hash_ids'])} ids)" for r in rows]),
     caption="the trace's first three requests")

# %% [markdown]
# The first request has 6,758 prompt tokens: 13 full blocks and a last one of $6758 - 13 \times 512 = 102$ tokens,
# so 14 hash ids. All three begin with block 0 (every request of the trace does, presumably a system prompt), then go
# their own ways.
#
# To serve the trace, each block becomes token ids: 16 per block (one page), at 1/32 of the service's
# lengths. A block's ids are a function of its hash id alone, so equal ids give equal tokens. The first
# four ids spell the hash id in base 320, least significant digit first, so two different hash ids differ
# in their first page and can never pass for a shared prefix; the rest are drawn from a generator seeded
# with the hash id. The last block is cut to scale: 102 tokens become $\lceil 102 / 32 \rceil = 4$ ids.

# %%
MS = mooncake.settings(QUICK)                            # the trace's sizes in this run
trace = mooncake.trace(MS["pool_requests"])              # the trace's first requests, at 1/32 scale
a, b = trace[0], trace[1]
print(a, "\n", b)


def spelled(block, vocab=320):                           # the hash id a block's first ids spell
    return sum(x * vocab**k for k, x in enumerate(block[:spelled_digits(vocab)]))


assert len(a) == 13 * 16 + math.ceil(102 / 32)
assert [spelled(a[16 * i:]) for i in range(len(a) // 16)] == list(a.hash_ids[:len(a) // 16])
print("block 0, both:", a[:16] == b[:16], a[:6], "...; block 1:", a[16:20], "vs", b[16:20],
      "= hash ids", a.hash_ids[1], "and", b.hash_ids[1], "spelled in base 320")
print(f"arrivals {a.arrival_ms} ms and {b.arrival_ms} ms; answers of {a.output_tokens} and {b.output_tokens} "
      "tokens (the trace's 500 and 490, at 1/32)")

# %% [markdown]
# What a pool that never evicts would serve can be read off the hash ids alone: each request's leading
# blocks that some earlier request had, at most all but the page of its last token. `lab` serves the
# token ids through `PrefixCachingBackend`'s bookkeeping; the two must agree, request by request:

# %%
seen, by_hand = set(), []
for r in trace:
    k = next((k for k in range(len(r.hash_ids), 0, -1) if r.hash_ids[:k] in seen), 0)
    seen.update(r.hash_ids[:j] for j in range(1, len(r.hash_ids) + 1))
    by_hand.append(min(16 * k, (len(r) - 1) // 16 * 16))
moon = mooncake.capacity_sweep(trace, MS["capacities"])
assert sum(by_hand) == moon["unbounded"]["cached_tokens"]
print(f"{len(trace):,} requests: {sum(by_hand):,} prompt tokens from the cache by hand and by lab, "
      f"{moon['unbounded']['hit_rate']:.1%} of them")

# %% [markdown]
# Now pools that do evict (LRU), sized in tokens of the service: a pool of N pages here holds what N × 512
# tokens hold there. The paper's own marks are drawn in: a node's local cache of 3M tokens, and the
# trace's prefix cache ratio of about 40 %.

# %%
show(pd.DataFrame({mooncake.label(x["capacity"]): {"pages (1/32 scale)": x["num_pages"], "hit rate": x["hit_rate"]}
                   for x in moon["runs"]} | {"never evicts": {"pages (1/32 scale)": moon["unbounded"]["num_pages"],
                                                             "hit rate": moon["unbounded"]["hit_rate"]}}).T
     .rename_axis("pool (tokens of the service)"), percent=["hit rate"],
     caption=f"Mooncake's trace, first {len(trace):,} requests, LRU")

# %%
fig_mooncake = mooncake.plot_capacity(moon)
print(f"mean over requests of the share found cached, never evicting: {moon['unbounded']['request_mean']:.1%}")

# %%
beside("ch06", "mooncake.pool", values=mooncake.values({"pool": moon}), section="mooncake",
       why=f"your run serves the trace's first {len(trace):,} requests, the book all 12,031: the first minutes "
           "of the hour hold few second turns, so less of each prompt is found cached; and those requests hold "
           "fewer distinct pages, so a pool of a given size keeps a larger share of what a pool that never "
           "evicts would.")

# %% [markdown]
# ### llama.cpp's prompt cache
#
# `make results` sends one six-turn chat, a turn at a time, to llama-server and to the lab's server, each
# with its prompt cache on and off (`lab.experiments.llamacpp`, with llama.cpp built by `make llamacpp`).
# The book's verdicts, and yours where your results file holds that run:

# %%
beside("ch06", "llamacpp.prompt_cache",
       why="the run needs llama.cpp built and both servers started; a notebook in quick mode does not start them.")

# %% [markdown]
# ### Time to first token: a hit against a miss
#
# One prompt, a cached prefix of each length plus 16 new tokens. A hit finds the prefix's pages; a miss
# is the same prompt under a fresh salt, so nothing is found. Timed in alternating rounds on SmolLM2.

# %%
ttft = ch06.ttft(smol, S["prefixes"], S["ttft_rounds"])
show(pd.DataFrame({L: {"hit (ms)": r["hit"]["median"] * 1e3, "miss (ms)": r["miss"]["median"] * 1e3,
                       "miss / hit (×)": r["ratio"], "tokens from cache": r["cached"]} for L, r in ttft.items()}
                  ).T.rename_axis("cached prefix (tokens)"), caption="time to first token, median")

# %%
fig_ttft = ch06.plot_ttft(ttft)

# %%
short, long_ = ttft[min(ttft)], ttft[max(ttft)]
print(f"from {min(ttft):,} to {max(ttft):,} cached tokens, a hit's time grows "
      f"{long_['hit']['median'] / short['hit']['median']:.2f}x and a miss's "
      f"{long_['miss']['median'] / short['miss']['median']:.1f}x")
m["ttft"] = ttft
beside("ch06", "ch06.ttft", values=ch06.values(m),
       why=f"your run times prefixes of {', '.join(map(str, S['prefixes']))} tokens in {S['ttft_rounds']} rounds, "
           f"the book {', '.join(map(str, FULL['prefixes']))} in {FULL['ttft_rounds']}: a median of few rounds "
           "moves with whatever else the machine runs.")

# %% [markdown]
# A hit still runs the 16 new tokens through every layer, and its attention reads the whole prefix, so
# its time grows slowly with the prefix; a miss computes everything. Naming pages is cheap beside it:

# %%
hashing = ch06.hashing_cost(smol, S["hash_tokens"])
longest = ttft[max(ttft)]
per_token = (longest["miss"]["median"] - longest["hit"]["median"]) / longest["cached"]
print(f"hashing: {hashing['per_token'] * 1e6:.2f} µs per token; computing: {per_token * 1e3:.2f} ms per token "
      f"on this CPU ({per_token / hashing['per_token']:,.0f}× the hashing)")

# %% [markdown]
# ### What a shared cache tells another tenant
#
# A hit is faster, and whoever sends the request sees it. A victim's requests begin with one of four
# secret system prompts (one page each). An attacker, another tenant on the same server, sends a guess's
# first page followed by its own 16 tokens and times its own time to first token: fast means the guess
# was in the cache, so it was the victim's. In half the trials the guess is right. The attack's success
# is the ROC AUC of "fast means right" (1: always tells; 0.5: chance), once with one cache for all
# tenants and once with a salt per tenant.

# %%
side = ch06.side_channel(smol, S["trials"])
show(pd.DataFrame({case: {"ROC AUC": side[case]["auc"], "right guess (ms)": side[case]["right_ms"],
                          "wrong guess (ms)": side[case]["wrong_ms"]} for case in ("shared", "salted")}
                  ).T.rename_axis("cache"), caption="the attacker's time to first token, median")

# %%
fig_roc = ch06.plot_roc(side)

# %%
print(f"one cache for all: AUC {side['shared']['auc']:.2f}, "
      + ("the clock tells" if side["shared"]["auc"] > 0.75 else "the clock tells little in this run")
      + f"; a salt per tenant: AUC {side['salted']['auc']:.2f}, "
      + ("chance, within the noise of these trials" if abs(side["salted"]["auc"] - 0.5) < 0.1 else "off chance"))
m |= dict(hashing=hashing, side_channel=side)


def strays(trials, by=0.1):  # how often an AUC of pure chance (half the guesses right) lands `by` or more off 0.5
    return math.erfc(by / math.sqrt((trials + 1) / (3 * trials**2)) / math.sqrt(2))


beside("ch06", "ch06.side_channel", values=ch06.values(m),
       why=f"your run makes {S['trials']} trials, the book {FULL['trials']}: with a salt the AUC is chance, and "
           f"chance lands 0.1 or more off 0.5 in {strays(S['trials']):.0%} of runs of {S['trials']} trials "
           f"({strays(FULL['trials']):.2%} of the book's); a busy machine can also hide a hit's head start.")

# %% [markdown]
# With one cache for all, the attacker's own clock reads the victim's prompt; with a salt per tenant the
# names differ, nothing is shared, and the AUC falls to chance (it wanders around 0.5 by a few hundredths
# over a few hundred trials). Published work found the same on real servers: vLLM's security advisory
# on cache salting reports detection at ROC AUC 0.99 for 8-token prefixes, and an audit of API providers
# found caches shared across users at seven of them (sources in `research/ch06/sources.md`). A salt the
# caller chooses protects only if an attacker cannot send the victim's salt.
#
# ### What caching saves in money
#
# API providers bill cached input below fresh input, some charging extra to write it. One synthetic
# conversation: a 3,000-token system prompt, ten turns of 100-token messages and 300-token replies, a
# minute apart. Input cost per provider's published prices (`research/ch06/prices.md`, with dates and
# which figures are secondary), and what `lab`'s cache saves on this CPU for the same conversation.

# %%
econ = ch06.economics(smol, per_token)
show(pd.DataFrame({name: {"model": ch06.PRICES[name]["model"], "no cache (¢)": c["without"] * 100,
                          "cached (¢)": c["cached"] * 100, "saving": 1 - c["cached"] / c["without"]}
                   for name, c in econ["costs"].items()}).T, percent=["saving"],
     caption="input cost of the conversation, published prices")

# %%
fig_costs = ch06.plot_costs(econ)
print(f"lab, pages of 16: {econ['lab_cached']:,} prompt tokens from cache, {econ['lab_computed']:,} computed; "
      f"{econ['compute_saved_s']:.0f} s of SmolLM2 compute saved on this CPU")
m["economics"] = econ
beside("ch06", "ch06.economics", "ch06.hashing_us_per_token", values=ch06.values(m),
       why=f"your run hashes {S['hash_tokens']:,} tokens, the book {FULL['hash_tokens']:,}; the prices are "
           "published figures, the same in both runs.")

# %% [markdown]
# ### Against vLLM
#
# vLLM's CPU build runs beside the lab in its own environment (`make vllm`). `make results` sends the
# same requests to both, with pages of 32 (vLLM's CPU attention needs a multiple of 32): a shared prefix
# with two tails and a repeat; a prompt of exactly three pages, twice; a chat turn that carries the
# previous reply; then a 528-token prompt in turns as a hit and, under a fresh `cache_salt`, as a miss.
# Starting vLLM takes about a minute, so quick mode reads the book's run:

# %%
book = results.read(results.COMMITTED)["sections"].get("ch06", {}).get("values", {}).get("vllm", {})
same = book.get("cached_identical", {"value": results.NOT_RUN, "reason": "not measured yet: run `make results`"})
if same["value"] == results.NOT_RUN:
    print("the book's results have no vLLM comparison:", same["reason"])
else:
    names = ["shared prefix + tail A", "shared prefix + tail B", "tail A again", "three whole pages",
             "three whole pages again", "the next chat turn"]
    display(show(pd.DataFrame({"prompt tokens": same["prompt_tokens"], "cached, lab": same["lab"],
                               "cached, vLLM": same["vllm"]}, index=names), caption="tokens from cache"))
    display(show(pd.DataFrame({side: {"hit (ms)": book[side]["ttft_hit_ms"]["value"],
                                      "miss (ms)": book[side]["ttft_miss_ms"]["value"],
                                      "miss / hit (×)": book[side]["ratio"]["value"]} for side in ("lab", "vllm")}
                              ).T, caption="time to first token, the book's run"))
    print(f"cached tokens: {'identical' if same['value'] else 'different'}; greedy tokens: "
          f"{'identical' if book['tokens_identical']['value'] else 'different'}; the lab on "
          f"{book['lab_threads']['value']} threads, vLLM's engine on cores "
          f"{' and '.join(map(str, book['vllm_cores']['core_ids']))}")

# %% [markdown]
# Both engines take whole pages of a prompt and always run its last token, which is why they can report
# the same cached tokens for every request (the line above says whether they did in the book's run).
#
# ## Record
#
# The figures drawn above are saved as they are.

# %%
m["vllm"] = "the notebook does not start vLLM (about a minute); `make results` runs the comparison"
ch06.record(m, drawn={"hit_rate": fig_hit_rate, "ttft": fig_ttft, "roc": fig_roc, "costs": fig_costs})
print("wrote section ch06 to", results.results_path())

# %% [markdown]
# ## Exercises
#
# 1. **Evict the least frequently used page.** LRU evicts the page unused the longest, even if it was
#    used a thousand times before. Write `lfu_cached_tokens(requests, num_pages, page_size)`: serve the
#    requests as `serve` above does, but when a fresh page must evict a name, evict the named free page
#    used the fewest times (1 for being named, plus 1 per request that took it), the least recently
#    freed among equals; return the tokens each request found cached. The rules in full are in
#    `help(ex.check_lfu_eviction)`. The lab's `BlockManager` and `PrefixCachingBackend` raise while your
#    function runs: they evict LRU. The workloads are drawn fresh at every run. Then compare the two on a
#    stream of popular prompts and one-off documents, `ex.compare_lfu_lru(lfu_cached_tokens)`, and on
#    this chapter's workloads, e.g.
#    `ex.compare_lfu_lru(lfu_cached_tokens, workloads.few_shot_prompts(320), num_pages=100, page_size=16)`
#    (token ids below 320: the bookkeeping runs on the tiny model). Where does LFU win, and where does it
#    hold on to pages that were popular once?
# 2. **Prove that a weight update invalidates every page.** Write a test, `weight_update_test(make_backend)`,
#    that fills a prefix cache, changes a weight in place (an optimizer step does that), and asserts that
#    nothing stale is served afterwards. The check runs your test twice on the real `PrefixCachingBackend`,
#    where it must pass, and on four backends that serve stale pages, where it must fail, in an order
#    drawn fresh: one names pages under the identity the model had when the backend was built, one keeps
#    the identity of its first call, one names pages by the ids and the salt alone, one renames only the
#    first page. Each is a `PrefixCachingBackend`: only what it serves tells them apart, not its type. A
#    test that looks only at the first request after the update misses the last.
# 3. **Open-ended: the side channel on your machine.** Run `ch06.side_channel(smol, 200, probe=1)`: the
#    attacker's own part is one token. Does the AUC move? What does it take, on your machine, to push the
#    unsalted AUC towards 0.5 without a salt (a larger probe, another page size)?

# %%
from lab.exercises import ch06 as ex


def lfu_cached_tokens(requests, num_pages, page_size):
    raise NotImplementedError("your answer")


def weight_update_test(make_backend):
    raise NotImplementedError("your answer")


for check, answer in ((ex.check_lfu_eviction, lfu_cached_tokens), (ex.check_invalidation_test, weight_update_test)):
    try:
        check(answer)
    except NotImplementedError:
        print(f"{check.__name__}: not attempted yet")

# %% [markdown]
# Reference solutions are in `lab/exercises/ch06_solutions.py`; the test suite runs every check on them.
