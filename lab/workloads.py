"""Synthetic prefix-sharing workloads, and the hit rate a pool of pages reaches on them (chapter 6).

A workload is a list of requests, each a list of token ids, in arrival order: random ids arranged in the
shapes of real traffic, so that a cache hit comes only from what the shape repeats (applications with long
system prompts, multi-turn chats, few-shot prompts). `hit_rate` serves one through a PrefixCachingBackend's
own bookkeeping without the model (`dry_run`, tested to count exactly what scoring counts).

    requests = multi_turn_chats(vocab=49152, scale=0.5)
    shape(requests)["distinct_pages"], hit_rate(model, requests, num_pages=256)["hit_rate"]

One workload is real traffic: `mooncake()`, Mooncake's published conversation trace (data/mooncake/), whose
block hashes become token ids at a smaller scale (its docstring says how), served by the same helpers.
"""

import json
import math
import random

import numpy as np
from tqdm.auto import tqdm

from .cache.eviction import POLICIES as EVICTION
from .engine import PrefixCachingBackend, RadixCache, block_hashes
from .models import ModelConfig, random_model
from .results import REPO_ROOT


def random_tokens(rng, n, vocab) -> list:
    """n token ids drawn uniformly below vocab from `rng` (a random.Random)."""
    return [rng.randrange(vocab) for _ in range(n)]


def shared_system_prompts(vocab, scale=1.0, seed=0, apps=8) -> list:
    """Eight applications (or `apps`), each with its own long system prompt (500-1,500 tokens), chosen by Zipf
    popularity (the first is the most used); each request is a system prompt and a user's question of
    20-150 tokens."""
    rng = random.Random(seed)
    systems = [random_tokens(rng, rng.randint(500, 1500), vocab) for _ in range(apps)]
    weights = [1 / (k + 1) ** 1.1 for k in range(len(systems))]
    return [rng.choices(systems, weights)[0] + random_tokens(rng, rng.randint(20, 150), vocab)
            for _ in range(int(300 * scale))]


def multi_turn_chats(vocab, scale=1.0, seed=1, turns=6) -> list:
    """Conversations of `turns` turns, interleaved in random order. Every chat starts with the same
    300-token system prompt; each turn's prompt is the previous prompt, the previous reply (50-250 tokens)
    and a new user message (20-120 tokens)."""
    rng = random.Random(seed)
    system = random_tokens(rng, 300, vocab)
    chats = [list(system) for _ in range(int(48 * scale))]
    order = [c for c in range(len(chats)) for _ in range(turns)]
    rng.shuffle(order)                       # a chat's turns stay in order; chats interleave
    out = []
    for c in order:
        if len(chats[c]) > len(system):      # not the first turn: the reply to the last prompt came back
            chats[c] += random_tokens(rng, rng.randint(50, 250), vocab)
        chats[c] += random_tokens(rng, rng.randint(20, 120), vocab)
        out.append(list(chats[c]))
    return out


def agent_branches(vocab, scale=1.0, seed=3, steps=6, branches=3, p_branch=0.4) -> list:
    """Agents that search (chapter 11): every task starts with the same 400-token system prompt and tool list,
    then its own task (50-150 tokens). At each of `steps` steps the agent is sent its whole history and
    answers with a tool call (20-60 tokens) whose result (50-300 tokens) joins the history. At a branching
    step (probability `p_branch`) it first tries `branches` alternative calls from the same history, each
    sent back with its result, and keeps the last (tree search, retries). Tasks interleave; a task's
    requests stay in order."""
    rng = random.Random(seed)
    system = random_tokens(rng, 400, vocab)
    tasks = []
    for _ in range(int(40 * scale)):
        history, requests = system + random_tokens(rng, rng.randint(50, 150), vocab), []
        for _ in range(steps):
            requests.append(list(history))
            for _ in range(branches if rng.random() < p_branch else 1):
                tried = history + random_tokens(rng, rng.randint(20, 60), vocab) \
                    + random_tokens(rng, rng.randint(50, 300), vocab)
                requests.append(list(tried))
            history = tried
        tasks.append(requests)
    order = [t for t, requests in enumerate(tasks) for _ in requests]
    rng.shuffle(order)
    at = [0] * len(tasks)
    out = []
    for t in order:
        out.append(tasks[t][at[t]])
        at[t] += 1
    return out


def few_shot_prompts(vocab, scale=1.0, seed=2) -> list:
    """Four tasks, each with six fixed examples of 80-160 tokens behind a 60-token instruction; each request
    is a task's instruction and examples, then a query of 30-80 tokens. Tasks are equally likely."""
    rng = random.Random(seed)
    tasks = [random_tokens(rng, 60, vocab)
             + sum((random_tokens(rng, rng.randint(80, 160), vocab) for _ in range(6)), []) for _ in range(4)]
    return [rng.choice(tasks) + random_tokens(rng, rng.randint(30, 80), vocab) for _ in range(int(200 * scale))]


def conversation(vocab, system, turns, user, reply, seed=5) -> list:
    """One conversation's requests: turn k sends a `system`-token prompt, every earlier message and reply
    (`user` and `reply` tokens each), and its own message; `turns` requests."""
    rng = random.Random(seed)
    ids, requests = random_tokens(rng, system, vocab), []
    for k in range(turns):
        if k:
            ids += random_tokens(rng, reply, vocab)
        ids += random_tokens(rng, user, vocab)
        requests.append(list(ids))
    return requests


WORKLOADS = {"system prompts": shared_system_prompts, "multi-turn chats": multi_turn_chats,
             "few-shot": few_shot_prompts}


def shape(requests, page_size=16) -> dict:
    """What a workload (a list of id lists) looks like: requests, prompt lengths (mean, longest, total), and
    its distinct full pages of `page_size` ids (the pool that would never evict: every page computed once)."""
    lengths = [len(r) for r in requests]
    distinct = len({d for r in requests for d in block_hashes(r, page_size)})
    return dict(requests=len(requests), mean_tokens=float(np.mean(lengths)), max_tokens=max(lengths),
                tokens=sum(lengths), distinct_pages=distinct)


def hit_rate(model, requests, num_pages, page_size=16, eviction="lru") -> dict:
    """Serve the requests in order from one pool of `num_pages`; the backend's stats. eviction: "lru" (the
    BlockManager's least recently freed page) or "lfu" (the least used, lab.cache.eviction)."""
    if eviction not in EVICTION:
        raise ValueError(f"eviction must be one of {', '.join(map(repr, EVICTION))}, got {eviction!r}")
    backend = PrefixCachingBackend(model, num_pages, page_size)
    if eviction != "lru":
        backend.pool.manager = EVICTION[eviction](num_pages, page_size)    # before the first request
    for ids in requests:
        backend.dry_run(ids)
    s = backend.stats
    return dict(s, hit_rate=s["cached_tokens"] / (s["cached_tokens"] + s["computed_tokens"]), num_pages=num_pages)


def radix_hit_rate(requests, num_slots: int) -> dict:
    """`hit_rate` for a RadixCache of `num_slots` positions (chapter 11): each request takes its longest cached
    prefix token by token (at most all but its last token, which is always run, as with pages), computes the
    rest, and leaves it cached; LRU leaves are evicted as room is needed. The same totals as `hit_rate`,
    for the same memory as a pool of num_slots / page_size pages."""
    cache, cached, computed = RadixCache(num_slots), 0, 0
    for ids in requests:
        n, slots, held = cache.match(ids)
        n = min(n, len(ids) - 1)                                # the last token is always run
        new = cache.allocate(len(ids) - n)
        inserted = cache.insert(ids, slots[:n] + new)
        cache.release(held), cache.release(inserted)
        cached, computed = cached + n, computed + len(ids) - n
    return dict(cached_tokens=cached, computed_tokens=computed, hit_rate=cached / (cached + computed),
                num_slots=num_slots)


def hit_rate_sweep(model, workloads: dict, fractions, page_size=16) -> dict:
    """{workload: {"shape": shape, "runs": [hit_rate at each pool size]}}; pool sizes are fractions of the
    workload's distinct pages, never below what its longest request needs."""
    out = {}
    for name, requests in tqdm(workloads.items(), desc="hit rate: workloads"):
        sh = shape(requests, page_size)
        floor = -(-sh["max_tokens"] // page_size)
        sizes = sorted({max(floor, round(f * sh["distinct_pages"])) for f in fractions})
        out[name] = dict(shape=sh, runs=[hit_rate(model, requests, n, page_size)
                                         for n in tqdm(sizes, desc=f"{name}: pool sizes", leave=False)])
    return out


# ---- real traffic: Mooncake's conversation trace ---------------------------------------------------------

MOONCAKE = REPO_ROOT / "data" / "mooncake" / "conversation_trace.jsonl"   # its source: SOURCE.md beside it
TRACE_BLOCK = 512               # prompt tokens per hash id in Mooncake's traces
HASH_BOUND = 2**32              # hash ids below this are spelled in a block's first ids (the trace's reach 182,789)


class TraceError(ValueError):
    """A trace that cannot be loaded as asked: tokens_per_block not a positive multiple of page_size, a
    vocabulary too small to spell a hash id within one page, a bad limit, or a line of the file that is not a
    request of the trace's format."""


class TraceRequest(list):
    """One request of a published trace: its prompt's token ids (the object is that list, so every helper
    that takes a workload, a list of id lists, takes a trace as it is) and what the trace says of it."""

    def __init__(self, ids, arrival_ms: int, output_tokens: int, hash_ids: tuple):
        super().__init__(ids)
        self.arrival_ms = arrival_ms          # when it arrived: the trace's timestamp, ms after the first request
        self.output_tokens = output_tokens    # its answer's length, scaled as the prompt is (at least 1)
        self.hash_ids = hash_ids              # the trace's block hashes: one per tokens_per_block ids, the last partial

    def __repr__(self):
        return (f"TraceRequest({len(self)} ids, arrival_ms={self.arrival_ms}, output_tokens={self.output_tokens}, "
                f"{len(self.hash_ids)} blocks)")


def spelled_digits(vocab: int) -> int:
    """How many ids spell any hash id below HASH_BOUND in base `vocab`: the fewest d with vocab**d >= 2**32."""
    if vocab < 2:
        raise TraceError(f"no base below 2 spells a hash id, got vocab {vocab!r}")
    d = 1
    while vocab**d < HASH_BOUND:
        d += 1
    return d


def block_ids(hash_id: int, n: int, vocab: int) -> list:
    """The n token ids that stand for block `hash_id`. Its first spelled_digits(vocab) ids spell
    hash_id in base vocab, least significant digit first, so blocks of different hashes differ
    there; the rest are drawn by random.Random(hash_id) below vocab, so equal hashes give equal
    ids, on every machine."""
    digits = spelled_digits(vocab)
    if n < digits:
        raise TraceError(f"{n} ids cannot spell a hash id in base {vocab}: it needs {digits}")
    spelled = [hash_id // vocab**k % vocab for k in range(digits)]
    rng = random.Random(hash_id)
    return spelled + [rng.randrange(vocab) for _ in range(n - digits)]


def mooncake(path=None, page_size: int = 16, tokens_per_block: int = 16, vocab: int = 320,
             limit: int | None = None) -> list:
    """Mooncake's conversation trace as a workload: a list of TraceRequests in arrival order.

    The trace (data/mooncake/SOURCE.md) gives each request's arrival time, prompt and answer lengths and one
    hash id per block of 512 prompt tokens, equal ids at the start of two requests marking a prefix they
    share. Each block becomes `tokens_per_block` token ids below `vocab` (`block_ids`), so every length is
    scaled by s = tokens_per_block / 512 (1/32 by default, a block to one page of 16):

    - a prompt of input_length tokens has n = ceil(input_length / 512) hash ids; its first n - 1 blocks are
      full and become tokens_per_block ids each; its last block holds r = input_length - 512 (n - 1) tokens
      (1 to 512) and becomes the first ceil(r * s) ids of that block's. So a prompt has
      (n - 1) * tokens_per_block + ceil(r * s) ids;
    - its answer has output_tokens = max(1, round(output_length * s)) tokens;
    - arrival_ms is the trace's timestamp, unscaled (the trace's hour stays an hour).

    A pool of N pages of page_size ids thus stands for N * page_size / s tokens of the real service.
    tokens_per_block is a multiple of page_size, so blocks start on page boundaries; block_ids spells a hash
    id within a block's first page (spelled_digits(vocab) <= page_size), so two requests share a page-aligned
    prefix of ids exactly when the trace says they share those blocks: equal leading hash ids, equal ids;
    a different hash, a different first page.

    path: the trace file (default: the vendored one, MOONCAKE); limit: only its first `limit` requests.
    FileNotFoundError for a missing file; TraceError for bad arguments or a bad line.
    """
    for name, n in (("page_size", page_size), ("tokens_per_block", tokens_per_block), ("vocab", vocab)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise TraceError(f"{name} must be an int of at least 1, got {n!r}")
    if tokens_per_block % page_size:
        raise TraceError(f"tokens_per_block ({tokens_per_block}) must be a multiple of page_size ({page_size}): "
                         "a block must start on a page boundary, or two blocks would share a page")
    if vocab < 2 or spelled_digits(vocab) > page_size:
        raise TraceError(f"vocab {vocab} is too small: a block's first page of {page_size} ids must spell hash ids "
                         f"up to 2**32 in base vocab (needs vocab >= {math.ceil(HASH_BOUND ** (1 / page_size))})")
    if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit < 1):
        raise TraceError(f"limit must be None or an int of at least 1, got {limit!r}")
    path = MOONCAKE if path is None else path
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except FileNotFoundError:
        raise FileNotFoundError(f"no trace at {path}: the lab ships Mooncake's conversation trace as "
                                f"{MOONCAKE.relative_to(REPO_ROOT)}") from None
    except UnicodeDecodeError as e:
        raise TraceError(f"{path} is not text (UTF-8): {e}") from None
    s, blocks, out = tokens_per_block / TRACE_BLOCK, {}, []
    for number, line in enumerate(lines[:limit], start=1):
        row = _trace_row(line, number, path)
        hashes, last = row["hash_ids"], row["input_length"] - TRACE_BLOCK * (len(row["hash_ids"]) - 1)
        ids = []
        for h in hashes:
            if h not in blocks:
                blocks[h] = block_ids(h, tokens_per_block, vocab)
            ids += blocks[h]
        del ids[len(ids) - tokens_per_block + math.ceil(last * s):]        # the last block, cut to scale
        if out and row["timestamp"] < out[-1].arrival_ms:
            raise TraceError(f"{path}, line {number}: timestamp {row['timestamp']} comes before the line above's "
                             f"({out[-1].arrival_ms}); a trace lists its requests in arrival order")
        out.append(TraceRequest(ids, row["timestamp"], max(1, round(row["output_length"] * s)), tuple(hashes)))
    return out


def _trace_row(line: str, number: int, path) -> dict:
    """One line of a trace, checked: TraceError naming the line when it is not a request of the format."""
    try:
        row = json.loads(line)
        ok = all(type(row[k]) is int and row[k] >= 0 for k in ("timestamp", "input_length", "output_length"))
        hashes = row["hash_ids"]
        ok = ok and isinstance(hashes, list) and all(type(h) is int and 0 <= h < HASH_BOUND for h in hashes)
        ok = ok and row["input_length"] >= 1 and len(hashes) == -(-row["input_length"] // TRACE_BLOCK)
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise TraceError(f"{path}, line {number}: not a request of the trace's format (timestamp, input_length, "
                         f"output_length, hash_ids: ceil(input_length / {TRACE_BLOCK}) ids below 2**32): "
                         f"{line[:80]!r}")
    return row


def bookkeeping_model(vocab: int = 320, max_positions: int = 1 << 17):
    """A model for page bookkeeping only (`hit_rate`, `simulate` and the tiers on long traces): it names pages
    as any model does and is never run. One layer with one key-value head of two values, so its pool costs 16
    bytes a position (SmolLM2's costs 46,080), and positions enough for the trace's longest prompt."""
    return random_model(ModelConfig(arch="llama", vocab_size=vocab, n_layers=1, d_model=2, n_heads=1, n_kv_heads=1,
                                    head_dim=2, d_ff=2, max_positions=max_positions, name="bookkeeping"))
