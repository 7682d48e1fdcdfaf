"""Chapter 5 exercises: rollback of rejected draft tokens with crop, and the block size that wastes least."""

import torch

from ..cache import ConcatCache, PagedCache
from ..models import forward_cached, load


@torch.inference_mode()
def check_speculative_rollback(speculative_step):
    """speculative_step(cache, accepted, drafted): the cache holds `drafted` draft positions after the accepted
    prefix; keep only the first `accepted` of them. Oracle: a cache that only ever saw the accepted tokens."""
    model = load("tiny-llama")
    cfg, w = model.config, model.weights
    g = torch.Generator().manual_seed(0)
    for page_size, prefix, drafted, accepted in ((4, 10, 5, 2), (16, 15, 4, 0), (1, 3, 3, 3), (8, 8, 8, 1)):
        ids = torch.randint(0, cfg.vocab_size, (1, prefix + drafted), generator=g)
        paged = PagedCache(cfg, 64, page_size=page_size)
        forward_cached(ids, w, cfg, paged)                                  # prefix + all drafts written
        free_before = paged.manager.num_free
        speculative_step(paged, accepted, drafted)
        keep = prefix + accepted
        assert paged.length == keep, f"after rollback the cache holds {paged.length} positions, expected {keep}"
        clean = ConcatCache(cfg)
        forward_cached(ids[:, :keep], w, cfg, clean)
        nxt = torch.randint(0, cfg.vocab_size, (1, 1), generator=g)
        a, b = forward_cached(nxt, w, cfg, paged), forward_cached(nxt, w, cfg, clean)
        assert torch.allclose(a, b, atol=1e-5), f"continuing after the rollback differs by {(a - b).abs().max():.3g}"
        pages_needed = -(-(keep + 1) // page_size)
        assert paged.manager.num_free == paged.num_pages - pages_needed, (
            f"page size {page_size}: {paged.num_pages - paged.manager.num_free} pages in use, {pages_needed} "
            f"needed (free before rollback: {free_before}): the rejected pages were not returned")
    print("correct")
    return True


def check_best_block_size(best_block_size):
    """best_block_size(total_lengths, candidates, bytes_per_position) -> the candidate with the fewest wasted
    bytes: the unused tail of each last page, plus 4 bytes of block table per page."""
    import numpy as np

    from ..experiments.ch05_paged import synthetic_lengths

    for dataset, bpp in (("ShareGPT", 23040), ("Alpaca", 23040), ("Alpaca", 16)):
        i, o = synthetic_lengths(dataset, 500, seed=3)
        lengths = (i + o).tolist()
        candidates = [1, 2, 4, 8, 16, 32, 64, 128]
        cost = {b: sum((-(-n // b) * b - n) * bpp + 4 * -(-n // b) for n in lengths) for b in candidates}
        want = min(candidates, key=lambda b: (cost[b], b))
        got = best_block_size(lengths, candidates, bpp)
        assert got == want, f"{dataset}, {bpp} bytes a position: you chose {got}, the fewest wasted bytes is {want}"
    print(f"correct (at {bpp} bytes a position the tables matter: block {want})")
    return bool(np.isfinite(cost[want]))
