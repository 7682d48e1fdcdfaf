"""Chapter 5 exercises: rollback on pages through the block manager, the block size a real system picks,
and (open-ended) the cost of the page indirection on the reader's own machine.

While the reader's function runs, the cache's own crop (and reset, and the truncation behind both) and the
check's own simulation of a block size raise, however they are reached (rules.functions_raise). The block
size cases are drawn fresh at every run (`seed=` draws the same ones again), and simulated only after the
reader's function has answered.
"""

import random

import torch

from ..cache import BlockManager, PagedCache, make_cache
from ..cache.base import KVCache
from ..data import synthetic_lengths
from ..models import forward_cached, load
from .rules import drawn_with, fresh_seed, functions_raise, unchanged

NO_CROP = "this exercise rolls back through the block manager (cache.manager): cache.crop is off limits"


@torch.inference_mode()
def check_speculative_rollback(speculative_step):
    """speculative_step(cache, accepted, drafted): the cache holds `drafted` draft positions after the accepted
    prefix; keep only the first `accepted` of them, through `cache.manager` (the cache's crop, reset and
    _truncate raise, called on the cache, unbound or through super()).
    Oracle: a cache that only ever saw the accepted tokens, and a count of the pages that must stay in use."""
    model = load("tiny-llama")
    cfg, w = model.config, model.weights
    g = torch.Generator().manual_seed(0)
    for page_size, prefix, drafted, accepted in ((4, 10, 5, 2), (16, 15, 4, 0), (1, 3, 3, 3), (8, 8, 8, 1)):
        ids = torch.randint(0, cfg.vocab_size, (1, prefix + drafted), generator=g)
        paged = PagedCache(cfg, 64, page_size=page_size)
        forward_cached(ids, w, cfg, paged)                                  # prefix + all drafts written
        with unchanged(__name__), functions_raise(KVCache.crop, KVCache.reset, PagedCache._truncate, why=NO_CROP):
            speculative_step(paged, accepted, drafted)
        keep = prefix + accepted
        assert paged.length == keep, f"after rollback the cache holds {paged.length} positions, expected {keep}"
        in_use = paged.num_pages - paged.manager.num_free
        assert in_use == -(-keep // page_size), (
            f"page size {page_size}: {in_use} pages in use for {keep} positions: the rejected pages were not "
            "returned to the pool")
        clean = make_cache("concat", cfg, keep + 1)
        forward_cached(ids[:, :keep], w, cfg, clean)
        nxt = torch.randint(0, cfg.vocab_size, (1, 1), generator=g)
        a, b = forward_cached(nxt, w, cfg, paged), forward_cached(nxt, w, cfg, clean)
        # 1e-5: float32, the same attention summed in another order (tiny model, logits of order 1)
        assert torch.allclose(a, b, atol=1e-5), f"continuing after the rollback differs by {(a - b).abs().max():.3g}"
    print("correct")
    return True


def _cost_by_simulation(lengths, block, page_cost, shared_prefix) -> float:
    """Run the workload through a real BlockManager and count: wasted positions + page_cost * table entries.

    A root sequence holds the shared prefix's full pages (only a full page can be shared); every request
    forks it and reserves the rest of its own length. Held positions come from the pages in use; table
    entries are the block-table lengths the kernel walks, one per page per request.
    """
    full = shared_prefix // block * block
    total = full + sum(-(-(shared_prefix + n - full) // block) * block for n in lengths)
    bm = BlockManager(total // block + 1, block)
    bm.reserve("root", full)
    for r, n in enumerate(lengths):
        bm.fork("root", r)
        bm.reserve(r, shared_prefix + n - full)
    held = (bm.num_pages - bm.num_free) * block
    entries = sum(len(bm.block_table(r)) for r in range(len(lengths)))
    return held - (shared_prefix + sum(lengths)) + page_cost * entries


CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def block_size_cases(seed, count=8) -> list:
    """`count` (dataset, lengths, page_cost in position-equivalents, shared prefix in tokens), drawn from `seed`:
    300 requests of ShareGPT's or Alpaca's lengths, a page costing a quarter of a position to two, a prefix of
    up to 800 tokens (none, in a third of the cases)."""
    rng, cases = random.Random(seed), []
    for _ in range(count):
        dataset = rng.choice(("ShareGPT", "Alpaca"))
        i, o = synthetic_lengths(dataset, 300, seed=rng.randrange(2**31))
        prefix = 0 if rng.random() < 1 / 3 else rng.randint(1, 800)
        cases.append((dataset, (i + o).tolist(), rng.choice((0.25, 0.5, 0.75, 1.0, 1.5, 2.0)), prefix))
    return cases


def check_best_block_size(best_block_size, seed=None):
    """best_block_size(lengths, candidates, page_cost, shared_prefix) -> the candidate with the lowest cost in
    positions: the unused positions of the pool's pages, plus page_cost for every block-table entry of every
    request. Every request starts with the same shared_prefix tokens, stored once, but only in full pages;
    `lengths` are the requests' own tokens after it. The oracle simulates each candidate on a BlockManager, on
    workloads drawn fresh, after your function has answered (while it runs, the simulation raises)."""
    seed = fresh_seed(seed)
    cases = block_size_cases(seed)
    with unchanged(__name__), functions_raise(_cost_by_simulation):
        got = [best_block_size(list(lengths), list(CANDIDATES), page_cost, prefix)
               for _, lengths, page_cost, prefix in cases]
    with drawn_with(seed, "check_best_block_size"):
        for (dataset, lengths, page_cost, prefix), g in zip(cases, got, strict=True):
            cost = {b: _cost_by_simulation(lengths, b, page_cost, prefix) for b in CANDIDATES}
            want = min(CANDIDATES, key=lambda b: (cost[b], b))
            assert g == want, (f"{dataset}, a page costing {page_cost} positions, a shared prefix of {prefix}: you "
                               f"chose {g} (cost {cost.get(g, float('nan')):.0f} positions), the cheapest is "
                               f"{want} (cost {cost[want]:.0f})")
    print(f"correct (workloads drawn with seed={seed})")
    return True


def time_paged_against_contiguous(context=4096, batch=1, rounds=15):
    """The open-ended exercise's measurement: decode attention over pages (the CPU-tuned version) against a
    contiguous cache, SmolLM2's heads, warm, on this machine. Returns the ratio of the medians."""
    from ..step_cost import attention_case

    return attention_case(batch, context, reps=rounds)["ratio"]
