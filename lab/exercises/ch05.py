"""Chapter 5 exercises: rollback on pages through the block manager, the block size a real system picks,
and (open-ended) the cost of the page indirection on the reader's own machine."""

import torch

from ..cache import BlockManager, PagedCache, make_cache
from ..data import synthetic_lengths
from ..models import forward_cached, load


class _CacheWithoutCrop(PagedCache):
    """A PagedCache whose own crop is off limits: the exercise rolls back through the block manager."""

    def crop(self, n):
        raise AssertionError("this exercise rolls back through the block manager (cache.manager): "
                             "cache.crop is off limits")


@torch.inference_mode()
def check_speculative_rollback(speculative_step):
    """speculative_step(cache, accepted, drafted): the cache holds `drafted` draft positions after the accepted
    prefix; keep only the first `accepted` of them, through `cache.manager` (the cache's crop raises).
    Oracle: a cache that only ever saw the accepted tokens, and a count of the pages that must stay in use."""
    model = load("tiny-llama")
    cfg, w = model.config, model.weights
    g = torch.Generator().manual_seed(0)
    for page_size, prefix, drafted, accepted in ((4, 10, 5, 2), (16, 15, 4, 0), (1, 3, 3, 3), (8, 8, 8, 1)):
        ids = torch.randint(0, cfg.vocab_size, (1, prefix + drafted), generator=g)
        paged = _CacheWithoutCrop(cfg, 64, page_size=page_size)
        forward_cached(ids, w, cfg, paged)                                  # prefix + all drafts written
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


# (dataset, page_cost in position-equivalents, shared prefix in tokens)
BLOCK_SIZE_CASES = (("ShareGPT", 0.25, 0), ("ShareGPT", 0.25, 200), ("ShareGPT", 1.0, 600),
                    ("Alpaca", 0.25, 100), ("Alpaca", 2.0, 200))
CANDIDATES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def check_best_block_size(best_block_size):
    """best_block_size(lengths, candidates, page_cost, shared_prefix) -> the candidate with the lowest cost in
    positions: the unused positions of the pool's pages, plus page_cost for every block-table entry of every
    request. Every request starts with the same shared_prefix tokens, stored once, but only in full pages;
    `lengths` are the requests' own tokens after it. The oracle simulates each candidate on a BlockManager."""
    for dataset, page_cost, prefix in BLOCK_SIZE_CASES:
        i, o = synthetic_lengths(dataset, 300, seed=3)
        lengths = (i + o).tolist()
        cost = {b: _cost_by_simulation(lengths, b, page_cost, prefix) for b in CANDIDATES}
        want = min(CANDIDATES, key=lambda b: (cost[b], b))
        got = best_block_size(lengths, list(CANDIDATES), page_cost, prefix)
        assert got == want, (f"{dataset}, a page costing {page_cost} positions, a shared prefix of {prefix}: you "
                             f"chose {got} (cost {cost.get(got, float('nan')):.0f} positions), the cheapest is "
                             f"{want} (cost {cost[want]:.0f})")
    print("correct")
    return True


def time_paged_against_contiguous(context=4096, batch=1, rounds=15):
    """The open-ended exercise's measurement: decode attention over pages (the CPU-tuned version) against a
    contiguous cache, SmolLM2's heads, warm, on this machine. Returns the ratio of the medians."""
    from ..experiments.ch05_paged import attention_case

    return attention_case(batch, context, reps=rounds)["ratio"]
