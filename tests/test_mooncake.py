"""Mooncake's conversation trace as a workload (lab.workloads.mooncake), what the lab counts on it, LFU eviction
(lab.cache.eviction) and the fleet replayed on the trace's clock (lab.fleet.replay).

Oracles: the trace file read here with json; the hash ids spelled in each block's first ids; for hit rates, a set
of every page-aligned prefix seen (a pool that never evicts) and a page-level pool of twenty lines written here
(LRU and LFU), request by request; for the replay, a fleet of such sets on a clock, written here.
"""

import copy
import json
import math
from collections import Counter, OrderedDict

import pytest

from lab.cache.eviction import LFUBlockManager
from lab.engine import PrefixCachingBackend
from lab.fleet import FleetError, replay
from lab.workloads import MOONCAKE, TraceError, bookkeeping_model, hit_rate, mooncake, spelled_digits

P = 16
N = 300                                         # the slice of the trace the tests serve


@pytest.fixture(scope="module")
def rows():
    with open(MOONCAKE) as f:
        return [json.loads(next(f)) for _ in range(N)]


@pytest.fixture(scope="module")
def trace():
    return mooncake(limit=N)


@pytest.fixture(scope="module")
def chats():
    """Requests of multi-turn conversations: of the trace's first 4,000, the first 300 whose first two blocks
    at least four requests share (in the first 300 alone, only the system prompt's first page repeats)."""
    first = mooncake(limit=4000)
    turns = Counter(r.hash_ids[:2] for r in first)
    return [r for r in first if len(r.hash_ids) > 1 and turns[r.hash_ids[:2]] >= 4][:300]


@pytest.fixture(scope="module")
def model():
    return bookkeeping_model()


# ---- the loader ----------------------------------------------------------------------------------------------

def spelled(block, vocab=320):
    """The hash id a block's first ids spell (least significant digit first)."""
    return sum(x * vocab**k for k, x in enumerate(block[:spelled_digits(vocab)]))


def test_every_block_spells_its_hash_id_and_equal_hashes_give_equal_blocks(trace, rows):
    blocks = {}                                          # hash id -> its ids, as first seen
    for r, row in zip(trace, rows, strict=True):
        assert r.hash_ids == tuple(row["hash_ids"])
        for i, h in enumerate(row["hash_ids"]):
            block = r[i * 16:(i + 1) * 16]
            if len(block) >= spelled_digits(320):
                assert spelled(block) == h               # the hash id is recoverable from the ids
            want = blocks.setdefault(h, block)
            assert block == want[:len(block)]            # equal hashes, equal ids (the last block cut short)
    assert len(blocks) > 1000
    first_pages = {tuple(b[:P]) for b in blocks.values() if len(b) >= P}
    assert len(first_pages) == sum(len(b) >= P for b in blocks.values())   # different hashes, different first pages


def test_lengths_outputs_and_arrivals_are_the_trace_s_at_scale(trace, rows):
    for r, row in zip(trace, rows, strict=True):
        n, last = len(row["hash_ids"]), row["input_length"] - 512 * (len(row["hash_ids"]) - 1)
        assert len(r) == 16 * (n - 1) + math.ceil(last * 16 / 512)
        assert r.output_tokens == max(1, round(row["output_length"] / 32))
        assert r.arrival_ms == row["timestamp"]
        assert all(type(i) is int and 0 <= i < 320 for i in r)
    assert any(r.output_tokens == 1 for r in trace) and any(len(r) % 16 for r in trace)


def test_another_scale_keeps_the_blocks_on_page_boundaries(rows):
    big = mooncake(page_size=16, tokens_per_block=64, vocab=49152, limit=50)
    for r, row in zip(big, rows, strict=False):
        last = row["input_length"] - 512 * (len(row["hash_ids"]) - 1)
        assert len(r) == 64 * (len(row["hash_ids"]) - 1) + math.ceil(last / 8)
        assert [spelled(r[64 * i:], 49152) for i in range(len(r) // 64)] == row["hash_ids"][:len(r) // 64]


def test_limit_takes_the_first_requests_and_changes_none_of_them(trace):
    few = mooncake(limit=7)
    assert len(few) == 7 and [list(r) for r in few] == [list(r) for r in trace[:7]]
    assert [r.arrival_ms for r in few] == [r.arrival_ms for r in trace[:7]]


@pytest.mark.parametrize("kwargs, match", [
    (dict(tokens_per_block=24), "multiple of page_size"),
    (dict(tokens_per_block=0), "tokens_per_block must be an int"),
    (dict(page_size=0), "page_size must be an int"),
    (dict(vocab=3), "vocab 3 is too small"),
    (dict(vocab=1), "too small"),
    (dict(limit=0), "limit must be None"),
    (dict(limit=2.5), "limit must be None"),
])
def test_bad_arguments_are_refused(kwargs, match):
    with pytest.raises(TraceError, match=match):
        mooncake(**kwargs)


def test_the_smallest_vocabulary_that_spells_within_a_page_is_taken():
    assert len(mooncake(vocab=4, limit=1)[0]) > 0          # 4**16 = 2**32 ids: exactly enough


def test_a_missing_file_and_a_bad_line_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no trace at"):
        mooncake(tmp_path / "nothing.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0, 1]}\n'
                   '{"timestamp": 0, "input_length": 600, "output_length": 3, "hash_ids": [0]}\n')
    with pytest.raises(TraceError, match="line 2"):
        mooncake(bad)
    assert len(mooncake(bad, limit=1)) == 1


def test_a_trace_out_of_arrival_order_or_not_text_is_refused(tmp_path):
    """The loader promises arrival order: a file that is not in it is refused, not returned as it lies."""
    late = tmp_path / "late.jsonl"
    late.write_text('{"timestamp": 5000, "input_length": 10, "output_length": 3, "hash_ids": [0]}\n'
                    '{"timestamp": 10, "input_length": 10, "output_length": 3, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match="line 2.*arrival order"):
        mooncake(late)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(TraceError, match="not text"):
        mooncake(binary)
    with pytest.raises(TraceError, match="base below 2"):
        spelled_digits(1)


# ---- hit rates on the trace against oracles written here ------------------------------------------------------

def never_evicts(requests, page=P) -> list:
    """Per request, the tokens a pool that never evicts serves: its longest page-aligned prefix seen before, at
    most (len - 1) // page pages (its last token is always run)."""
    seen, out = set(), []
    for ids in requests:
        n = max((k for k in range(1, (len(ids) - 1) // page + 1) if tuple(ids[:k * page]) in seen), default=0)
        seen.update(tuple(ids[:k * page]) for k in range(1, len(ids) // page + 1))
        out.append(n * page)
    return out


def pool(requests, num_pages, policy, page=P) -> list:
    """Per request, the tokens a pool of num_pages pages serves. A page is named by its whole prefix; a request
    takes its longest named prefix (one token left), a fresh page for every other page, then names its new full
    pages (a name already held stays where it is) and frees its pages, last first, names kept. A fresh page: the
    least recently freed (lru); or a free page without a name, else the named one used least (1 when named, +1 per
    request that took it), the least recently freed among equals (lfu)."""
    free = OrderedDict.fromkeys(range(num_pages))
    page_of, name_of, uses, out = {}, {}, {}, []
    for ids in requests:
        names = [tuple(ids[:(i + 1) * page]) for i in range(len(ids) // page)]
        n = 0
        while n < (len(ids) - 1) // page and names[n] in page_of:
            n += 1
        table = [page_of[x] for x in names[:n]]
        for p in table:
            del free[p]
            uses[p] += 1
        for _ in range(-(-len(ids) // page) - n):
            if policy == "lru":
                p = next(iter(free))
            else:
                p = min(enumerate(free), key=lambda e: (uses[e[1]] if e[1] in name_of else 0, e[0]))[1]
            del free[p]
            if p in name_of:
                del page_of[name_of.pop(p)]
            table.append(p)
        for i in range(n, len(names)):
            if names[i] not in page_of:
                page_of[names[i]], name_of[table[i]], uses[table[i]] = table[i], names[i], 1
        for p in reversed(table):
            free[p] = None
        out.append(n * page)
    return out


def served(model, requests, num_pages, manager=None) -> list:
    backend = PrefixCachingBackend(model, num_pages, P)
    if manager is not None:
        backend.pool.manager = manager
    return [backend.dry_run(r) for r in requests]


def test_a_pool_that_never_evicts_serves_every_prefix_seen_before(trace, model):
    want = never_evicts(trace)
    num_pages = sum(-(-len(r) // P) for r in trace)
    assert served(model, trace, num_pages) == want
    r = hit_rate(model, trace, num_pages)
    assert r["cached_tokens"] == sum(want) and r["evicted_pages"] == 0
    assert r["hit_rate"] == pytest.approx(sum(want) / sum(map(len, trace)))
    # and the trace's own hash ids say the same: a request is served its leading blocks some earlier one had
    seen, blocks = set(), []
    for r in trace:
        k = next((k for k in range(len(r.hash_ids), 0, -1) if r.hash_ids[:k] in seen), 0)
        seen.update(r.hash_ids[:j] for j in range(1, len(r.hash_ids) + 1))
        blocks.append(min(16 * k, (len(r) - 1) // P * P))
    assert blocks == want and sum(want) > 0.05 * sum(map(len, trace))


@pytest.mark.parametrize("num_pages", [300, 800])
def test_lru_on_the_trace_serves_what_a_page_level_lru_pool_serves(trace, chats, model, num_pages):
    for requests in (trace, chats):
        want = pool(requests, num_pages, "lru")
        assert served(model, requests, num_pages) == want
        assert hit_rate(model, requests, num_pages)["cached_tokens"] == sum(want)
    assert sum(want) < sum(never_evicts(chats))               # the pool is small enough to evict


@pytest.mark.parametrize("num_pages", [260, 800])
def test_lfu_on_the_trace_serves_what_a_page_level_lfu_pool_serves(chats, model, num_pages):
    want = pool(chats, num_pages, "lfu")
    assert served(model, chats, num_pages, LFUBlockManager(num_pages, P)) == want
    assert hit_rate(model, chats, num_pages, eviction="lfu")["cached_tokens"] == sum(want)
    assert sum(want) > sum(pool(chats, num_pages, "lru"))     # on conversations, LFU keeps more than LRU


def test_lfu_keeps_its_bookkeeping_consistent_and_keeps_popular_prompts(model):
    rows = [[1] * 32 + [i] for i in range(6)] + [[100 + i] * 80 for i in range(6)] + [[1] * 32 + [9]]
    manager = LFUBlockManager(8, P)
    got = served(model, rows, 8, manager)
    manager.check()
    assert got == pool(rows, 8, "lfu") and got[-1] == 32      # the prompt used six times outlives five documents
    assert pool(rows, 8, "lru")[-1] == 0                      # which push it out of an LRU pool


def test_an_unknown_eviction_is_refused(trace, model):
    with pytest.raises(ValueError, match="eviction must be one of 'lru', 'lfu'"):
        hit_rate(model, trace[:3], 300, eviction="fifo")


# ---- the fleet on the trace's clock ----------------------------------------------------------------------------

def clock_oracle(trace, workers, policy, prefill_s, decode_s, weight=1.0) -> dict:
    """Workers whose pools never evict (a set of prefixes each), on a clock: a request's load is its pages from
    its arrival until its last token; one prefill at a time per worker, first come first served."""
    seen = [set() for _ in range(workers)]
    live = [[] for _ in range(workers)]                  # (leaves at, pages) per worker
    free_at, computed, calls = [0.0] * workers, [0] * workers, [0] * workers
    ttft, cached_total = [], 0
    for k, r in enumerate(trace):
        now, T = r.arrival_ms / 1000, len(r)
        live = [[x for x in w if x[0] > now] for w in live]
        load = [sum(p for _, p in w) for w in live]
        hit = []
        for w in range(workers):
            n = max((j for j in range(1, (T - 1) // P + 1) if tuple(r[:j * P]) in seen[w]), default=0)
            hit.append(n * P)
        if policy == "round_robin":
            w = k % workers
        else:
            cost = [weight * -(-(T - hit[w]) // P) + load[w] + -(-T // P) if policy == "kv_aware" else 0
                    for w in range(workers)]
            w = min(range(workers), key=lambda w: (cost[w], load[w], computed[w], w))
        seen[w].update(tuple(r[:j * P]) for j in range(1, T // P + 1))
        start = max(now, free_at[w])
        free_at[w] = first = start + (T - hit[w]) * prefill_s
        live[w].append((first + r.output_tokens * decode_s, -(-T // P)))
        computed[w] += T - hit[w]
        calls[w] += 1
        cached_total += hit[w]
        ttft.append(first - now)
    return dict(calls=calls, cached_tokens=cached_total, ttft_s=sum(ttft) / len(ttft))


@pytest.mark.parametrize("policy", ["round_robin", "least_loaded", "kv_aware"])
def test_replay_on_the_clock_matches_a_fleet_written_here(trace, model, policy):
    requests = trace[:150]
    big = sum(-(-len(r) // P) for r in requests)          # pools that never evict
    got = replay(requests, 3, policy, big, prefill_s=0.02, decode_s=0.5, model=model)
    want = clock_oracle(requests, 3, policy, 0.02, 0.5)
    assert [w["calls"] for w in got["per_worker"]] == want["calls"]
    assert got["cached_tokens"] == want["cached_tokens"]
    assert got["ttft_s"] == pytest.approx(want["ttft_s"], rel=1e-9)
    assert got["in_flight"] > 1                              # requests overlap: load is not zero


def test_replay_with_one_worker_is_one_pool_and_a_queue(trace, model):
    requests = trace[:100]
    got = replay(requests, 1, "kv_aware", 300, prefill_s=0.05, decode_s=0.1, model=model)
    assert got["cached_tokens"] == hit_rate(model, requests, 300)["cached_tokens"]
    free, ttft = 0.0, []
    for r, cached in zip(requests, pool(requests, 300, "lru"), strict=True):
        free = max(r.arrival_ms / 1000, free) + (len(r) - cached) * 0.05
        ttft.append(free - r.arrival_ms / 1000)
    assert got["ttft_s"] == pytest.approx(sum(ttft) / len(ttft), rel=1e-9)


def test_replay_refuses_bad_costs_and_traces_without_times(trace, model):
    with pytest.raises(FleetError, match="prefill_s must be"):
        replay(trace[:3], 2, "kv_aware", 300, prefill_s=-1, decode_s=0.1, model=model)
    with pytest.raises(FleetError, match="arrival_ms and output_tokens"):
        replay([list(r) for r in trace[:3]], 2, "kv_aware", 300, prefill_s=0.1, decode_s=0.1, model=model)
    for field, bad in (("arrival_ms", float("nan")), ("arrival_ms", None), ("output_tokens", -1),
                       ("output_tokens", True)):
        broken = [copy.copy(r) for r in trace[:3]]
        setattr(broken[1], field, bad)
        with pytest.raises(FleetError, match="request 1"):
            replay(broken, 2, "kv_aware", 300, prefill_s=0.1, decode_s=0.1, model=model)
