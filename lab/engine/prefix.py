"""PrefixCachingBackend: many requests served from one pool of pages, each full page computed once.

Every full page of a request is named by `block_hashes` (chained over the state identity, the salt and the
tokens). A request takes the cached pages of its longest named prefix from the BlockManager, computes only
the rest, and names its own new full pages for the requests after it. When it ends, its pages go back to the
pool still named: they are reused until a fresh page is needed, least recently freed first (LRU).
"""

import torch

from ..cache import CacheInputError, CacheStateError, OutOfPagesError, PagedCache
from ..models import check_ids, forward_cached
from .backends import as_ids
from .hashing import page_keys
from .identity import check_salt, identity_of, model_identity


class PrefixCachingBackend:
    """Ids in, scores out, like CachedBackend; the state lives in named pages shared by every request.

    stats: running totals of calls, cached_tokens (positions taken from cached pages), computed_tokens
    (positions run through the model) and evicted_pages (cached pages reused for other positions).

    Which model: pages are named under the state identity, whose manifest is a hash of the weights'
    content. An identical copy of the model swapped in (`backend.model = load(name)` again) names the
    same pages and is served from them, rightly: equal weights compute equal keys and values. Weights
    changed in any way the manifest notices (version counters, fingerprint: `lab.models.checks`) name
    other pages, and the request is computed anew. A salt is a string or None (`check_salt`).
    """

    def __init__(self, model, num_pages: int, page_size: int = 16, salt=None):
        model_identity(model)  # refuse at once a model whose identity cannot be computed
        for name, n in (("num_pages", num_pages), ("page_size", page_size)):
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise CacheInputError(f"{name} must be an int of at least 1, got {n!r}")
        check_salt(salt)
        self.model, self.page_size, self.salt = model, page_size, salt
        self.pool = PagedCache(model.config, num_pages * page_size, page_size, dtype=model.dtype,
                               device=model.device)
        self.stats = dict(calls=0, cached_tokens=0, computed_tokens=0, evicted_pages=0)
        self.dry = False                                            # set by dry_run: pages without keys

    def page_keys(self, ids: list, salt=None) -> list:
        """(digest, parent digest, tokens) of every full page of `ids` under this model and salt."""
        identity = identity_of(self.model, self.pool, self.salt if salt is None else salt)
        return page_keys(ids, self.page_size, extra=(identity,))

    @torch.inference_mode()
    def next_logits(self, ids, salt=None) -> torch.Tensor:
        if self.dry:
            raise CacheStateError("this backend's pages were named by dry_run and hold no keys: score on another")
        t = self._check(ids, salt)                                          # [1, T]
        w, cfg = self.model.weights, self.model.config
        run = lambda seq, n: forward_cached(t[:, n:].to(self.model.device), w, cfg, self.pool.view([seq]),
                                            last_only=True)[0, -1]          # [V]
        return self._serve(t[0].tolist(), salt, run)

    def dry_run(self, ids, salt=None) -> int:
        """The page bookkeeping of next_logits without the model: the same pages taken, reserved, named and
        released, the same stats; returns the tokens found cached. For hit rates of long workloads; its pages
        hold no keys, so a backend that ran dry refuses next_logits."""
        t = self._check(ids, salt)
        self.dry = True

        def reserve(seq, n):                                    # what the forward's cache would reserve
            self.pool.reserve([(seq, t.shape[1] - n)])
            return n
        return self._serve(t[0].tolist(), salt, reserve)

    def _check(self, ids, salt) -> torch.Tensor:
        """Every check of a request, before anything changes: ids [1, T], the salt, the pool's size."""
        t = check_ids(as_ids(ids, self.model.config.vocab_size), self.model.config)  # [1, T]
        check_salt(salt)
        need, have = -(-t.shape[1] // self.page_size), self.pool.manager.num_pages
        if need > have:
            raise OutOfPagesError(f"a request of {t.shape[1]} tokens needs {need} pages of {self.page_size}; "
                                  f"the pool has {have}")
        return t

    # region prefix_serve
    def _serve(self, ids: list, salt, run):
        """Take the cached pages of the longest named prefix, run(seq, cached) the rest, name
        the new full pages, release the sequence (its pages stay cached, free, in LRU order)."""
        P, manager = self.page_size, self.pool.manager
        keys, seq, evicted = self.page_keys(ids, salt), self.pool.new_id(), manager.evicted
        n = P * manager.reserve_prefix(seq, keys[: (len(ids) - 1) // P])  # one token is run
        try:
            out = run(seq, n)
            for i in range(n // P, len(keys)):                  # name the new full pages
                manager.register(seq, i, *keys[i])
        finally:
            manager.release(seq)                                # named pages stay cached
        s = self.stats
        s["calls"] += 1
        s["cached_tokens"] += n
        s["computed_tokens"] += len(ids) - n
        s["evicted_pages"] += manager.evicted - evicted
        return out
    # endregion
