"""Reference solutions for chapter 5 (the tests run the checks on these)."""


def speculative_step(cache, accepted, drafted):
    # Rollback on pages is bookkeeping: shorten every sequence's block table. The keys in the pool are
    # not touched; pages past the new end go back to the free list, and the next step overwrites the
    # stale slots of the last page.
    for seq in cache.seqs:
        cache.manager.crop(seq, cache.manager.length(seq) - drafted + accepted)


def best_block_size(lengths, candidates, page_cost, shared_prefix=0):
    def cost(b):
        shared = shared_prefix // b                       # full prefix pages: stored once, in every table
        own = [-(-(shared_prefix + n - shared * b) // b) for n in lengths]   # private pages per request
        waste = (shared + sum(own)) * b - shared_prefix - sum(lengths)
        return waste + page_cost * sum(shared + p for p in own)

    return min(candidates, key=lambda b: (cost(b), b))
