"""Several engines behind one server (chapter 11, section 5): `python -m lab.serve --workers N`.

`Fleet` has the face of one engine's EngineClient and sends each request to one of N workers (a ServingEngine in a
process of its own each) chosen by `lab.fleet.choose`; a worker's load counts its requests in flight. A worker
whose process dies fails its own requests, and the fleet is no longer `alive`. A worker's `cached` tokens are
exact, from its engine's KV events (`KVEvents`), not SGLang's approximate tree of routed chains.
"""

import math
from itertools import takewhile

from ..engine.hashing import page_keys
from ..fleet import POLICIES, WorkerState, choose, kv_cost
from .client import RequestIdError


class Fleet:
    """`workers`, EngineClients of EngineProcesses of one model, behind one router of `policy` (a weight of
    `overlap_weight` for kv_aware). A request's id is worker w's id r as r * len(workers) + w."""

    def __init__(self, workers: list, policy: str = "round_robin", overlap_weight: float = 1.0):
        if not isinstance(workers, list) or not workers:
            raise ValueError(f"a fleet needs a non-empty list of workers, got {workers!r}")
        if policy not in POLICIES:
            raise ValueError(f"unknown router {policy!r}: one of {', '.join(POLICIES)}")
        if isinstance(overlap_weight, bool) or not isinstance(overlap_weight, (int, float)) \
                or not math.isfinite(overlap_weight) or overlap_weight < 0:
            raise ValueError(f"overlap_weight must be a finite number >= 0, got {overlap_weight!r}")
        self.workers, self.policy, self.overlap_weight = workers, policy, overlap_weight
        first = workers[0]
        self.name, self.config, self.tokenizer = first.name, first.config, first.tokenizer
        self.num_pages, self.page_size = first.num_pages, first.page_size
        self.routed = [0] * len(workers)                # requests routed to each worker
        self.computed = [0] * len(workers)              # their prompt tokens it held no named page of, when routed
        self.on_exit = None

    # ---- the face of one engine ----
    @property
    def alive(self) -> bool:
        return all(w.alive for w in self.workers)

    @property
    def failure(self):
        return next((w.failure for w in self.workers if w.failure is not None), None)

    def start(self, timeout_s: float = 600):
        """Launch every worker's process, then wait for each to load its model (they load at once; one after
        the other where a worker times its fused step when it starts, fast_decode="measure": two timing at once on
        the same cores would each time the other's work too); RuntimeError, every worker stopped, if one fails to."""
        try:
            for i, w in enumerate(self.workers):
                w.on_exit = lambda why, i=i: self._exited(i, why)
            alone = any(getattr(w.engine, "fast_decode", None) == "measure" for w in self.workers)
            for w in self.workers:
                w.engine.launch()
                if alone:
                    w.engine.wait_ready(timeout_s)
            if not alone:
                for w in self.workers:
                    w.engine.wait_ready(timeout_s)
        except Exception:
            self.stop()
            raise

    def stop(self):
        for w in self.workers:
            w.stop()

    def _exited(self, i: int, why: str):
        if self.on_exit is not None:
            self.on_exit(f"worker {i}: {why}")

    async def add(self, ids, max_new_tokens: int, eos_id: int | None, **sampling):
        """Route, then queue the request on that worker: (fleet id, its tokens' queue), as EngineClient.add."""
        states = self.states(ids)
        w = choose(self.policy, states, self.overlap_weight)
        self.routed[w] += 1                             # before the await: the next request routed sees them
        self.computed[w] += len(ids) - states[w].cached
        rid, tokens = await self.workers[w].add(ids, max_new_tokens, eos_id, **sampling)
        return rid * len(self.workers) + w, tokens

    async def beam(self, ids, max_new_tokens: int, eos_id: int | None, **params):
        """Beam search on the worker the policy routes `ids` to (EngineClient.beam)."""
        w = self.route(ids)
        self.routed[w] += 1
        return await self.workers[w].beam(ids, max_new_tokens, eos_id, **params)

    def cancel(self, rid: int, n: int = 1):
        if type(rid) is not int:
            raise RequestIdError(f"a request id is an int, got {rid!r} ({type(rid).__name__})")
        r, w = divmod(rid, len(self.workers))
        self.workers[w].cancel(r, n)

    # ---- routing ----
    def route(self, ids) -> int:
        """The worker `policy` sends `ids` to now (lab.fleet.choose). Changes nothing."""
        return choose(self.policy, self.states(ids), self.overlap_weight)

    def states(self, ids) -> list[WorkerState]:
        """Per worker, what `choose` reads for `ids` now."""
        cached = self.cached_tokens(ids)
        return [WorkerState(cached[i], sum(-(-t // w.page_size) for t in w.in_flight()), self.routed[i],
                            self.computed[i], w.page_size, len(ids)) for i, w in enumerate(self.workers)]

    def costs(self, ids) -> list[float]:
        """kv_aware's cost of each worker for `ids` (lab.fleet.kv_cost)."""
        return [kv_cost(s.tokens, s.cached, s.load, s.page_size, self.overlap_weight) for s in self.states(ids)]

    def cached_tokens(self, ids) -> list[int]:
        """Per worker, the leading tokens of `ids` its engine would take from its named pages now."""
        keys_of, out = {}, []
        for w in self.workers:
            extra = w.engine.extra
            if extra is None:                            # no prefix caching: nothing is ever named
                out.append(0)
                continue
            P = w.page_size
            group = (P, extra)
            if group not in keys_of:                     # workers of one identity name pages alike
                keys_of[group] = [d for d, _, _ in page_keys(list(ids[:P * ((len(ids) - 1) // P)]), P, extra)]
            out.append(P * len(list(takewhile(w.named.__contains__, keys_of[group]))))
        return out

    # ---- looking at it ----
    def snapshot(self, timeout_s: float = 30) -> dict:
        """The router's policy and, per worker, requests routed and in flight, and from its engine (None for
        a dead worker): prompt tokens taken from cache and computed, pages named, evicted, free."""
        workers = []
        for i, w in enumerate(self.workers):
            snap = w.snapshot(timeout_s) if w.alive else {}
            workers.append(dict(routed=self.routed[i], in_flight=len(w.in_flight()), alive=w.alive,
                                **{k: snap.get(k) for k in ("cached_tokens", "computed_tokens", "named_pages",
                                                            "evicted_pages", "free_pages")}))
        return dict(router=self.policy, overlap_weight=self.overlap_weight, workers=workers)

    def __repr__(self):
        return f"Fleet({len(self.workers)} workers, {self.policy!r}, routed {self.routed})"
