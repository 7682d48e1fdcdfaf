"""Several engines behind one server: `python -m lab.serve --workers N --router kv_aware` (chapter 11, served).

`Fleet` stands where one engine's EngineClient stood in front of the HTTP app, and has its face (`add`,
`cancel`, `alive`, `start`, `stop`, the model's `name`, `config`, `tokenizer`): each request goes to one of
N workers, each a ServingEngine in a process of its own, chosen before it is sent by `lab.fleet.choose`
(as the chapter's in-process Router chooses) from a WorkerState per worker: the request's tokens it holds
named (`cached_w`), its load, the requests routed to it, and their prompt tokens it held no page of.

- "round_robin": the next worker in turn (the k-th request routed goes to worker k mod N).
- "least_loaded": the lowest load: the pages of its requests in flight (sent, not yet finished, cancelled
  or failed), ceil(T_r / page_size) for a prompt of T_r tokens (lab.fleet counts the same).
- "kv_aware": NVIDIA Dynamo's KV router cost (lab.fleet's `kv_cost`), for a request of T tokens with
  `cached_w` of them in pages worker w holds named:

      cost_w = overlap_weight * ceil((T - cached_w) / page_size) + load_w + ceil(T / page_size)

Ties: the lower load, then the fewer prompt tokens computed, then the lowest index.

`cached_w` is exact, not guessed: every step's message from a worker's engine loop carries its KV events,
the digests of the pages it named and evicted (lab/serve/engine_loop.py `KVEvents`, Dynamo's BlockStored
and BlockRemoved), and each worker's EngineClient keeps the set they add up to. The router names the
request's pages as the engine will, `page_keys` chained from the identity the worker reported when it
started (its `extra`: model, tokenizer, dtypes, cache kind), and counts the leading ones in that set, at most
(T - 1) // page_size of them (one token is always computed). A worker whose identity differs names every
page otherwise, so its pages never count as hits for another's keys. The alternative, remembering the
chains routed to each worker (SGLang's approximate tree), guesses wrong after evictions and preemptions;
the events cost a few bytes per page named. What the set does not see: a prefix another request is
still computing on a worker counts only from the step that fills and names its pages.

A worker whose process dies fails its own requests in flight (as one engine's does); the fleet is then
no longer `alive` (/health and new requests answer 503) and `on_exit` tells `python -m lab.serve`, which
stops and exits 1 for its supervisor to restart it, as with one engine (lab/serve/cli.py says why).
"""

import math

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
        """Launch every worker's process, then wait for each to load its model (they load at once);
        RuntimeError, every worker stopped, if one fails to."""
        try:
            for i, w in enumerate(self.workers):
                w.on_exit = lambda why, i=i: self._exited(i, why)
                w.engine.launch()
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
        """kv_aware's cost of each worker for `ids` (module docstring)."""
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
            n = 0
            for digest in keys_of[group]:
                if digest not in w.named:
                    break
                n += 1
            out.append(n * P)
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
