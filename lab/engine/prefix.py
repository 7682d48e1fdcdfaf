"""PrefixCachingBackend: many requests served from one pool of pages, each full page computed once.

Every full page of a request is named by `block_hashes` (chained over the state identity, the salt and the
tokens). A request takes the cached pages of its longest named prefix from the BlockManager, computes only
the rest, and names its own new full pages for the requests after it. When it ends, its pages go back to the
pool still named: they are reused until a fresh page is needed, least recently freed first (LRU).
"""

import torch

from ..cache import PagedCache
from ..cache.hashing import root_digest
from .backends import as_ids
from .hashing import block_hashes
from .identity import identity_of, model_identity


class PrefixCachingBackend:
    """Ids in, scores out, like CachedBackend; the state lives in named pages shared by every request.

    stats: running totals of calls, cached_tokens (positions taken from cached pages), computed_tokens
    (positions run through the model) and evicted_pages (cached pages reused for other positions).
    """

    def __init__(self, model, num_pages: int, page_size: int = 16, salt=None):
        model_identity(model)  # refuse at once a model whose identity cannot be computed
        self.model, self.page_size, self.salt = model, page_size, salt
        self.pool = PagedCache(model.config, num_pages * page_size, page_size, dtype=model.dtype,
                               device=model.device)
        self.stats = dict(calls=0, cached_tokens=0, computed_tokens=0, evicted_pages=0)

    def page_keys(self, ids: list, salt=None) -> list:
        """(digest, parent digest, tokens) of every full page of `ids` under this model and salt."""
        P, identity = self.page_size, identity_of(self.model, self.pool, self.salt if salt is None else salt)
        digests = [bytes.fromhex(d) for d in block_hashes(ids, P, extra=(identity,))]
        parents = ([root_digest((identity,))] + digests)[:len(digests)]
        return [(d, p, ids[i * P:(i + 1) * P]) for i, (d, p) in enumerate(zip(digests, parents, strict=True))]

    @torch.inference_mode()
    def next_logits(self, ids, salt=None) -> torch.Tensor:
        from ..models import forward_cached

        t = as_ids(ids, self.model.config.vocab_size)                # [1, T]
        ids, P, manager = t[0].tolist(), self.page_size, self.pool.manager
        keys = self.page_keys(ids, salt)
        seq = self.pool.new_id()
        evicted = manager.evicted
        n = P * manager.reserve_prefix(seq, keys[: (len(ids) - 1) // P])  # at least one token is run
        try:
            cache = self.pool.view([seq])
            logits = forward_cached(t[:, n:].to(self.model.device), self.model.weights, self.model.config, cache,
                                    last_only=True)
            for i in range(n // P, len(keys)):                      # name the new full pages
                manager.register(seq, i, *keys[i])
        finally:
            manager.release(seq)                                    # named pages stay cached, unowned
        s = self.stats
        s["calls"], s["cached_tokens"], s["computed_tokens"] = s["calls"] + 1, s["cached_tokens"] + n, \
            s["computed_tokens"] + len(ids) - n
        s["evicted_pages"] += manager.evicted - evicted
        return logits[0, -1]                                         # [V]
