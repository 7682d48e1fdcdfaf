"""Reference solutions for chapter 8: shortest-remaining-job-first admission; preemption by swapping pages
to host memory."""

import torch

from ..cache import OutOfPagesError
from ..engine import ServingEngine
from .ch08 import cached_prefix


class ShortestFirstEngine(ServingEngine):
    def next_to_admit(self):
        # the work left: every token the request asks for, less the positions whose pages are still
        # named in the pool (a shared system prompt, or its own pages from before a preemption), which
        # admission takes instead of computing. min() keeps the first of equals
        return min(self.waiting, key=lambda req: len(req.prompt) + req.max_new_tokens - cached_prefix(self, req))


class SwappingEngine(ServingEngine):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.swapped = {}                      # request id -> (keys, values, positions) on the host

    def _preempt(self, req, now):
        computed, P = req.computed, self.page_size            # the positions its pages hold
        pages = self.manager.block_table(req.seq)[:-(-computed // P)]   # more may be reserved
        copies = [self.pool.page(p) for p in pages]             # (keys, values) [L, P, H_kv, D] each, copies
        keys = torch.stack([k for k, _ in copies], 1).cpu()     # [L, n, P, H_kv, D] on the host
        values = torch.stack([v for _, v in copies], 1).cpu()
        self.swapped[req.id] = (keys, values, computed)
        super()._preempt(req, now)             # its pages go back to the pool; it waits at the head

    def _admit(self, req, budget, now):
        if req.id not in self.swapped:
            return super()._admit(req, budget, now)             # a new request: prefill as usual
        keys, values, computed = self.swapped[req.id]
        n = min(req.num_tokens - computed, budget)              # what was left, this step's share
        seq = self.pool.new_id()
        try:
            self.pool.reserve([(seq, computed + n)])            # fresh pages, wherever they are
        except OutOfPagesError:
            return 0                                            # nothing changed: a later step
        pages = self.manager.block_table(seq)[:keys.shape[1]]   # page i holds what page i held
        for i, page in enumerate(pages):                        # [L, P, H_kv, D] each, back to the device
            self.pool.set_page(page, (keys[:, i], values[:, i]))
        del self.swapped[req.id]                                # the host copy is spent
        req.seq, req.computed, req.state = seq, computed, "running"
        req.events["admitted"].append(now)
        return n

    def cancel(self, rid):
        self.swapped.pop(rid, None)            # cancelled while swapped out: drop the host copy
        return super().cancel(rid)
