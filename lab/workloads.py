"""Synthetic prefix-sharing workloads, and the hit rate a pool of pages reaches on them (chapter 6).

A workload is a list of requests, each a list of token ids, in arrival order: random ids arranged in the
shapes of real traffic, so that a cache hit comes only from what the shape repeats (applications with long
system prompts, multi-turn chats, few-shot prompts). `hit_rate` serves one through a PrefixCachingBackend's
own bookkeeping without the model (`dry_run`, tested to count exactly what scoring counts).

    requests = multi_turn_chats(vocab=49152, scale=0.5)
    shape(requests)["distinct_pages"], hit_rate(model, requests, num_pages=256)["hit_rate"]
"""

import random

import numpy as np
from tqdm.auto import tqdm

from .engine import PrefixCachingBackend, RadixCache, block_hashes


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


def hit_rate(model, requests, num_pages, page_size=16) -> dict:
    """Serve the requests in order from one pool of `num_pages` (LRU eviction); the backend's stats."""
    backend = PrefixCachingBackend(model, num_pages, page_size)
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
    for name, requests in workloads.items():
        sh = shape(requests, page_size)
        floor = -(-sh["max_tokens"] // page_size)
        sizes = sorted({max(floor, round(f * sh["distinct_pages"])) for f in fractions})
        out[name] = dict(shape=sh, runs=[hit_rate(model, requests, n, page_size)
                                         for n in tqdm(sizes, desc=f"hit rate: {name}")])
    return out
