"""PrefixCachingBackend (chapter 6): many requests served from one pool of pages, each full page
computed once, its pages named for the requests after it and reused least recently freed first.
"""

import weakref

import torch

from ..cache import CacheInputError, CacheStateError, OutOfPagesError, PagedCache
from ..models import check_ids, forward_cached
from .backends import as_ids
from .generate import check_counts
from .hashing import page_keys
from .identity import check_salt, identity_of, model_identity
from .tiers import Tiers


class PrefixCachingBackend:
    """Ids in, scores out, like CachedBackend; the state lives in named pages shared by every request. Pages are
    named under the state identity: an identical copy of the model swapped in is served from them, changed weights
    name other pages. stats, running totals: calls, cached_tokens (positions taken from cached pages, restored ones
    included), computed_tokens (run through the model), evicted_pages (cached pages reused for other positions),
    host_hits and disk_hits (pages restored from the tiers of chapter 11, given host_pages or a disk_dir)."""

    def __init__(self, model, num_pages: int, page_size: int = 16, salt=None, host_pages: int = 0, disk_dir=None):
        model_identity(model)  # refuse at once a model whose identity cannot be computed
        check_counts(CacheInputError, num_pages=num_pages, page_size=page_size)
        check_salt(salt)
        self.model, self.page_size, self.salt = model, page_size, salt
        self.pool = PagedCache(model.config, num_pages * page_size, page_size, dtype=model.dtype,
                               device=model.device)
        self.stats = dict(calls=0, cached_tokens=0, computed_tokens=0, evicted_pages=0, host_hits=0, disk_hits=0)
        self.dry = False                                            # set by dry_run: pages without keys
        self.tiers = Tiers(host_pages, disk_dir) if host_pages or disk_dir is not None else None
        if self.tiers is not None:     # a weak reference: the pool's manager must not keep its backend alive
            keep = weakref.WeakMethod(self._keep)
            self.pool.manager.on_evict = lambda page, key: keep()(page, key)

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

    def _keep(self, page, key):
        """The pool is about to reuse the named `page`: its keys and values go down to the tiers."""
        self.tiers.put(key, None if self.dry else self.pool.page(page))   # [layers, page_size, H_kv, D] each

    def _restore(self, seq, keys, n) -> int:
        """After the pool's hit of n positions, take the following pages from the tiers while they hold them,
        each into a fresh pool page, named again; returns the positions now cached."""
        P, manager = self.page_size, self.pool.manager
        while self.tiers is not None and n // P < len(keys) and keys[n // P] in self.tiers:
            found = self.tiers.take(keys[n // P])
            if found is None:                                          # a refused page file: computed instead
                break
            (kv, tier), i = found, n // P
            manager.reserve(seq, P)                                    # a fresh page for positions n .. n + P - 1
            page = manager.block_table(seq)[i]
            if kv is not None:
                self.pool.set_page(page, kv)
            manager.register(seq, i, *keys[i])
            self.stats[f"{tier}_hits"] += 1
            n += P
        return n

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
            n = self._restore(seq, keys[: (len(ids) - 1) // P], n)     # tiers below the pool (ch. 11)
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
