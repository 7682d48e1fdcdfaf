"""Beyond one pool (chapter 11): a router over several engines, and a simulation of it on a trace.

One engine caches the prefixes it has seen; several engines each cache only what was sent to them. A
request whose system prompt sits in worker 2's pages is served almost free by worker 2 and computed in full
by any other, so *where* a request goes decides the fleet's hit rate as much as each pool's size does.

    router = Router([PrefixCachingBackend(model, 256) for _ in range(4)], "kv_aware")
    router.next_logits(ids)                                  # routed, then scored by that worker: [V]
    simulate(trace, workers=8, policy="kv_aware", pages_per_worker=256)["hit_rate"]
    replay(mooncake_trace, 8, "kv_aware", 256, prefill_s=2e-3, decode_s=1.6)["ttft_s"]   # in time (below)

Three policies, one `choose(policy, states)` for this router and the server's (lab/serve/fleet.py), over a
WorkerState per worker (the tokens of the request it would take from its pages, its load, its requests and
tokens computed so far):

- "round_robin": the next worker in turn, whatever it holds: the k-th request routed goes to worker k mod N.
- "least_loaded": the worker with the smallest load (below).
- "kv_aware": NVIDIA Dynamo's KV router cost (below): prefill work left on that worker against its load.

Ties, in both: the lower load, then the fewer tokens computed so far, then the lowest index. Or a policy of
your own: a callable `policy(ids, workers) -> index` in place of the name, called once per request with a copy
of its ids and the WorkerStates; it returns the index of the worker to send it to.

Load, for a synchronous router. Each call here finishes before the next one starts, so nothing is ever in
flight. To give load a meaning, the router counts as in flight the last `window` requests it routed
(default: as many as there are workers, one per worker on average): a fleet where each request lives while
`window` others arrive. A worker's load is the pages its in-flight requests hold, ceil(T / page_size) for a
request of T tokens: the KV blocks it keeps active, what Dynamo calls its active (decode) blocks.

The kv_aware cost, per worker w, for a request of T tokens with `cached_w` of them in w's named pages:

    prefill_blocks_w = ceil((T - cached_w) / page_size)       # pages w would compute
    decode_blocks_w  = load_w + ceil(T / page_size)           # active pages, the new request's included
    cost_w           = overlap_weight * prefill_blocks_w + decode_blocks_w

the lowest cost wins (ties as above). This is the cost NVIDIA Dynamo's KV router documents ("cost =
overlap_score_weight * prefill_blocks + decode_blocks", lower is better, the weight defaulting to 1.0: higher
favours cache reuse, lower even load), docs.nvidia.com/dynamo, "Router > Routing Concepts > Cost Calculation"
and the frontend's `--router-kv-overlap-score-weight`. Dynamo counts prefill blocks still running on the
worker as well; here prefill ends within the call, so there are none.
Load, in time (`replay`): a trace with arrival times (lab.workloads.mooncake) is replayed on a clock, each
request living on its worker from its arrival until its last token, so a worker's load is the pages of the
requests in flight on it when the next one arrives, as a running fleet's is.

`cached_w` is what the worker would really take: the leading full pages of the request, at most
(T - 1) // page_size of them (one token is always run), named in its BlockManager under the page keys the
worker itself computes (`PrefixCachingBackend.page_keys`: its model's state identity and the salt).
"""

import heapq
import math
import operator
from collections import deque
from dataclasses import dataclass

from .engine import PrefixCachingBackend
from .engine.backends import as_ids
from .models import load

POLICIES = ("round_robin", "least_loaded", "kv_aware")


# region fleet_cost
def kv_cost(tokens: int, cached: int, active: int, page_size: int, weight: float) -> float:
    """Dynamo's KV router cost of one worker (module docstring): weight * prefill pages
    + decode pages, where `active` is the pages its requests in flight hold."""
    prefill_blocks = -(-(tokens - cached) // page_size)  # pages the worker would compute
    decode_blocks = active + -(-tokens // page_size)     # pages active on it, with this request
    return weight * prefill_blocks + decode_blocks
# endregion


class FleetError(ValueError):
    """A router or simulation asked for something it cannot do: an unknown policy (a name not in POLICIES, or
    neither a name nor a callable), a callable policy that returned no worker's index, no engines or fewer than
    one worker, a bad window or weight, a trace that is not a list of requests of valid token ids."""


@dataclass(frozen=True)
class WorkerState:
    """One worker as a router sees it when a request of `tokens` tokens arrives: what `choose` and a callable
    policy read. Load has one meaning on both routers: the pages its requests in flight hold, ceil(T_r /
    page_size) for a request of T_r prompt tokens (Dynamo's active blocks; the module's docstring says which
    requests count as in flight here, lab/serve/fleet.py there)."""
    cached: int             # tokens of this request the worker would take from its named pages (cached_tokens)
    load: int               # pages held by its in-flight requests
    calls: int              # requests routed to it so far
    computed: int           # tokens it has run so far (the server's Fleet: prompt tokens routed it did not hold)
    page_size: int          # tokens per page of its pool: load * page_size tokens are in flight
    tokens: int             # the request's length T, the same for every worker


# region fleet_route
def choose(policy: str, states: list[WorkerState], weight: float = 1.0) -> int:
    """The index of the worker a named policy sends a request to, from one WorkerState per worker.

    round_robin: the k-th request routed (k: the calls so far) to worker k mod N. least_loaded:
    the lowest load. kv_aware: the lowest kv_cost, `weight` on the pages to prefill. Ties: the
    lower load, then the fewer tokens computed, then the lowest index."""
    n = len(states)
    if policy == "round_robin":
        return sum(s.calls for s in states) % n
    if policy not in POLICIES:
        raise FleetError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
    if policy == "kv_aware":
        cost = [kv_cost(s.tokens, s.cached, s.load, s.page_size, weight) for s in states]
    else:                                                   # least_loaded: the load alone
        cost = [0] * n
    return min(range(n), key=lambda w: (cost[w], states[w].load, states[w].computed, w))
# endregion


def _known(policy) -> bool:
    """A policy's name in POLICIES, or a callable (`policy(ids, workers) -> index`)."""
    return callable(policy) or (isinstance(policy, str) and policy in POLICIES)


class Router:
    """Requests in, each to one of `engines` by `policy`; `next_logits` (and `dry_run`) route, then call.

    engines: backends with `next_logits(ids, salt=None)`; "kv_aware" and a callable policy also read their
    named pages, so they need PrefixCachingBackends (`page_keys`, `page_size`, `pool.manager`); any other
    backend holds no pages: its `cached` is 0, its load counts pages of 16 tokens. route(ids)
    decides and changes nothing of the router's (a callable policy is called once); next_logits / dry_run
    route, call the chosen worker, then record the request: per-worker `calls`, `tokens` (prompt tokens
    routed), `computed` (tokens it ran: its stats' computed_tokens grew by that much) and `load` (pages of its
    in-flight requests, see the module's docstring).
    """

    def __init__(self, engines, policy, overlap_weight: float = 1.0, window: int | None = None):
        engines = list(engines) if isinstance(engines, (list, tuple)) else engines
        if not isinstance(engines, list) or not engines:
            raise FleetError(f"a router needs a non-empty list of engines, got {engines!r}")
        if not _known(policy):
            raise FleetError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}, or a callable")
        if policy == "kv_aware" or callable(policy):
            for i, e in enumerate(engines):
                if not isinstance(e, PrefixCachingBackend):
                    raise FleetError(f"{_name(policy)} reads each worker's named pages: engine {i} is a "
                                     f"{type(e).__name__}, not a PrefixCachingBackend")
        if not isinstance(overlap_weight, (int, float)) or isinstance(overlap_weight, bool) \
                or not math.isfinite(overlap_weight) or overlap_weight < 0:
            raise FleetError(f"overlap_weight must be a finite number >= 0, got {overlap_weight!r}")
        window = len(engines) if window is None else window
        if not isinstance(window, int) or isinstance(window, bool) or window < 0:
            raise FleetError(f"window must be an int >= 0 (requests counted in flight), got {window!r}")
        self.engines, self.policy, self.overlap_weight, self.window = engines, policy, overlap_weight, window
        n = len(engines)
        self.calls, self.tokens, self.computed, self.load = [0] * n, [0] * n, [0] * n, [0] * n
        self.in_flight = deque()                        # (worker, pages) of the last `window` requests
        self.last = None                                # the worker the last request went to

    def __len__(self):
        return len(self.engines)

    def cached_tokens(self, ids, salt=None) -> list[int]:
        """Per worker, the tokens of `ids` it would take from its named pages (what dry_run would count).

        Workers that share one model object, pool class, pool dtype and page size name pages alike (the
        state identity reads nothing else, `lab.engine.identity.identity_of`), so their keys are computed
        once per call, by the first of them (`PrefixCachingBackend.page_keys`)."""
        return self._cached_tokens(self._ids(ids), salt)

    def _cached_tokens(self, ids: list, salt) -> list[int]:
        keys_of, out = {}, []
        for e in self.engines:
            if not isinstance(e, PrefixCachingBackend):
                out.append(0)
                continue
            P = e.page_size
            group = (id(e.model), type(e.pool), str(e.pool.dtype), P)
            if group not in keys_of:
                keys_of[group] = e.page_keys(ids[: P * ((len(ids) - 1) // P)], salt)  # pages it may take
            out.append(e.pool.manager.cached_prefix(keys_of[group]))
        return out

    def states(self, ids, salt=None) -> list[WorkerState]:
        """What `choose` and a callable policy read of each worker, for `ids` now."""
        return self._states(self._ids(ids), salt)

    def _states(self, ids: list, salt) -> list[WorkerState]:
        return [WorkerState(c, self.load[w], self.calls[w], self.computed[w], getattr(e, "page_size", 16), len(ids))
                for w, (e, c) in enumerate(zip(self.engines, self._cached_tokens(ids, salt), strict=True))]

    def costs(self, ids, salt=None) -> list[float]:
        """kv_aware's cost of each worker for `ids` (module docstring): weight * prefill pages + decode pages."""
        return [kv_cost(s.tokens, s.cached, s.load, s.page_size, self.overlap_weight) for s in self.states(ids, salt)]

    def route(self, ids, salt=None) -> int:
        """The index of the worker `policy` sends `ids` to now. Changes nothing."""
        return self._route(self._ids(ids), salt)

    def _route(self, ids: list, salt) -> int:
        states = self._states(ids, salt)
        return self._ask(ids, states) if callable(self.policy) else choose(self.policy, states, self.overlap_weight)

    def _ask(self, ids: list, workers: list) -> int:
        """A callable policy's choice for `ids`: FleetError unless it is a worker's index (an integer, no bool)."""
        w = self.policy(list(ids), workers)
        try:
            index = operator.index(w)                   # an int, numpy's or torch's integers too; no float
        except TypeError:
            index = None
        if isinstance(w, bool) or index is None or not 0 <= index < len(workers):
            raise FleetError(f"policy {_name(self.policy)} returned {w!r:.40}, not a worker's index in "
                             f"0..{len(workers) - 1}")
        return index

    def next_logits(self, ids, salt=None):
        """Route `ids`, score them on that worker: `[V]`, as `engines[route(ids)].next_logits(ids, salt)`."""
        return self._dispatch(ids, salt, "next_logits")

    def dry_run(self, ids, salt=None) -> int:
        """Route `ids`, run that worker's page bookkeeping without the model; the tokens it found cached."""
        return self._dispatch(ids, salt, "dry_run")

    def _dispatch(self, ids, salt, method):
        ids = self._ids(ids)
        w = self._route(ids, salt)
        engine = self.engines[w]
        before = _computed(engine)
        out = getattr(engine, method)(ids, salt=salt)       # the engine's own checks run before any change
        after = _computed(engine)
        pages = -(-len(ids) // getattr(engine, "page_size", 16))
        self.calls[w] += 1
        self.last = w
        self.tokens[w] += len(ids)
        self.computed[w] += len(ids) if before is None else after - before
        if self.window:
            self.in_flight.append((w, pages))
            self.load[w] += pages
            if len(self.in_flight) > self.window:
                done, freed = self.in_flight.popleft()
                self.load[done] -= freed
        return out

    def _ids(self, ids) -> list:
        """`ids` as a list of ints, checked against the first engine's vocabulary (InputError if bad)."""
        if isinstance(ids, list) and ids and all(type(i) is int for i in ids):
            return ids                                              # the fast path of simulate's traces
        model = getattr(self.engines[0], "model", None)
        vocab = model.config.vocab_size if model is not None else None
        return as_ids(ids, vocab)[0].tolist()

    def __repr__(self):
        return f"Router({len(self.engines)} engines, {_name(self.policy)!r}, calls per worker {self.calls})"


def _name(policy) -> str:
    """A policy's name: the string itself, or a callable's __name__."""
    return policy if isinstance(policy, str) else getattr(policy, "__name__", repr(policy))


def _computed(engine):
    stats = getattr(engine, "stats", None)
    return stats["computed_tokens"] if isinstance(stats, dict) and "computed_tokens" in stats else None


def check_trace(trace, vocab_size: int, max_tokens: int) -> None:
    """FleetError unless `trace` is a list (or tuple) of non-empty lists of int ids in [0, vocab_size), each
    at most `max_tokens` long; checked before anything runs, so a bad request never leaves half a run."""
    if not isinstance(trace, (list, tuple)):
        raise FleetError(f"a trace is a list of requests (lists of token ids), got {type(trace).__name__}")
    for r, ids in enumerate(trace):
        if not isinstance(ids, (list, tuple)) or not ids:
            raise FleetError(f"request {r} of the trace is not a non-empty list of token ids: {ids!r:.60}")
        if not all(type(i) is int and 0 <= i < vocab_size for i in ids):
            bad = next(i for i in ids if not (type(i) is int and 0 <= i < vocab_size))
            raise FleetError(f"request {r} holds {bad!r}, not an int id in [0, {vocab_size}) "
                             f"(map ids into the model's vocabulary first, e.g. i % {vocab_size})")
        if len(ids) > max_tokens:
            raise FleetError(f"request {r} has {len(ids)} tokens; a worker takes at most {max_tokens} "
                             "(its pool's pages, the model's positions)")


def simulate(trace, workers: int, policy, pages_per_worker: int, page_size: int = 16, model=None,
             overlap_weight: float = 1.0, window: int | None = None) -> dict:
    """Replay `trace` (a list of id lists, in arrival order) through `workers` PrefixCachingBackends of
    `pages_per_worker` pages each, run dry (`dry_run`: the page bookkeeping, no forward), behind a Router of
    `policy` (a name in POLICIES, or a callable: the module's docstring). Returns the fleet's totals, the sums
    of the workers' stats:

        calls, cached_tokens, computed_tokens, evicted_pages, hit_rate = cached / (cached + computed)
        (0.0 for an empty trace), workers, policy (its name: a callable's __name__), pages_per_worker, page_size,
        per_worker: [{calls, tokens, cached_tokens, computed_tokens, evicted_pages}] per worker,
        imbalance: max / mean of the workers' computed tokens (1.0 when all equal or none computed).

    model: whose state identity names the pages; `load("tiny-llama")` by default, never run. Ids must lie in
    its vocabulary (320 for tiny-llama: generate workloads with vocab=320, or map ids, i % 320) and a
    request must fit its positions (2048) and one worker's pool; FleetError otherwise, before anything runs.
    """
    router = _fleet(trace, workers, policy, pages_per_worker, page_size, model, overlap_weight, window)
    for ids in trace:
        router.dry_run(list(ids))
    return _totals(router, workers, policy, pages_per_worker, page_size)


def _fleet(trace, workers, policy, pages_per_worker, page_size, model, overlap_weight, window) -> Router:
    """simulate's and replay's checks, then `workers` fresh PrefixCachingBackends behind a Router."""
    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise FleetError(f"workers must be an int of at least 1, got {workers!r}")
    if not _known(policy):
        raise FleetError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}, or a callable")
    for name, n in (("pages_per_worker", pages_per_worker), ("page_size", page_size)):
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise FleetError(f"{name} must be an int of at least 1, got {n!r}")
    model = load("tiny-llama") if model is None else model
    check_trace(trace, model.config.vocab_size, min(pages_per_worker * page_size, model.config.max_positions))
    engines = [PrefixCachingBackend(model, pages_per_worker, page_size) for _ in range(workers)]
    return Router(engines, policy, overlap_weight=overlap_weight, window=window)


def _totals(router: Router, workers, policy, pages_per_worker, page_size) -> dict:
    engines = router.engines
    keys = ("calls", "cached_tokens", "computed_tokens", "evicted_pages")
    per_worker = [dict(calls=e.stats["calls"], tokens=router.tokens[w],
                       **{k: e.stats[k] for k in keys if k != "calls"}) for w, e in enumerate(engines)]
    out = {k: sum(p[k] for p in per_worker) for k in keys}
    seen = out["cached_tokens"] + out["computed_tokens"]
    computed = [p["computed_tokens"] for p in per_worker]
    mean = sum(computed) / workers
    return dict(out, hit_rate=out["cached_tokens"] / seen if seen else 0.0, workers=workers, policy=_name(policy),
                pages_per_worker=pages_per_worker, page_size=page_size, per_worker=per_worker,
                imbalance=max(computed) / mean if mean else 1.0)


# region fleet_replay
def replay(trace, workers: int, policy, pages_per_worker: int, prefill_s: float, decode_s: float,
           page_size: int = 16, model=None, overlap_weight: float = 1.0) -> dict:
    """`simulate` on a clock: each request of `trace` (each with `arrival_ms` and `output_tokens`, as
    lab.workloads.mooncake's TraceRequests have) arrives at its time, is routed, and stays in flight on its
    worker until its last token. A worker's load when a request arrives is the pages of its requests then in
    flight (ceil(T / page_size) each: Dynamo's active blocks), so least_loaded and kv_aware see a running
    fleet. The cost model of a worker, in seconds:

        prefill: one request at a time, first come first served: prefill_s per token it computes (its cached
                 tokens cost nothing), starting when the request arrives or the previous prefill ends;
        decode:  batched beside it, decode_s per output token, whatever else runs;
        time to first token = waiting + prefill; the request leaves when its decode ends.

    A request's pages are named when it arrives (the dry run's bookkeeping), a little before its prefill
    would name them. kv_aware's cost counts the pages in flight on a worker, not the prefills queued on it
    (Dynamo adds those to its prefill blocks, its "active prompt load").

    Returns simulate's totals and ttft_s, ttft_p50_s, ttft_p90_s (over the requests), in_flight (requests
    in flight on the chosen worker when one arrives, mean), busy (the busiest worker's prefill time over
    the trace's span: above 1, its queue only grows)."""
    for name, x in (("prefill_s", prefill_s), ("decode_s", decode_s)):
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not math.isfinite(x) or x < 0:
            raise FleetError(f"{name} must be a finite number of seconds >= 0, got {x!r}")
    if not all(hasattr(r, "arrival_ms") and hasattr(r, "output_tokens") for r in trace):
        raise FleetError("replay needs each request's arrival_ms and output_tokens (lab.workloads.mooncake)")
    for i, r in enumerate(trace):
        a, o = r.arrival_ms, r.output_tokens
        if not (isinstance(a, (int, float)) and not isinstance(a, bool) and math.isfinite(a) and a >= 0
                and isinstance(o, int) and not isinstance(o, bool) and o >= 0):
            raise FleetError(f"request {i}: arrival_ms must be a finite number >= 0 and output_tokens an int >= 0, "
                             f"got {a!r} and {o!r}")
    router = _fleet(trace, workers, policy, pages_per_worker, page_size, model, overlap_weight, window=0)
    prefill_free = [0.0] * workers              # when each worker's prefill queue empties
    prefill_time = [0.0] * workers
    leaving = []                                # heap of (time, worker, pages) of the requests in flight
    count = [0] * workers                       # requests in flight per worker
    ttft, in_flight = [], []
    for r in sorted(trace, key=lambda r: r.arrival_ms):         # in arrival order (stable: the trace's own)
        now = r.arrival_ms / 1000
        while leaving and leaving[0][0] <= now:                 # requests that ended before this arrival
            _, w, pages = heapq.heappop(leaving)
            router.load[w] -= pages
            count[w] -= 1
        cached = router.dry_run(list(r))
        w, computed = router.last, len(r) - cached
        start = max(now, prefill_free[w])
        prefill_free[w] = first = start + computed * prefill_s
        prefill_time[w] += computed * prefill_s
        pages = -(-len(r) // page_size)
        heapq.heappush(leaving, (first + r.output_tokens * decode_s, w, pages))
        in_flight.append(count[w])
        router.load[w] += pages
        count[w] += 1
        ttft.append(first - now)
    out = _totals(router, workers, policy, pages_per_worker, page_size)
    span = (max(r.arrival_ms for r in trace) - min(r.arrival_ms for r in trace)) / 1000 if trace else 0.0
    ttft.sort()
    return dict(out, ttft_s=sum(ttft) / len(ttft) if ttft else 0.0,
                ttft_p50_s=ttft[len(ttft) // 2] if ttft else 0.0,
                ttft_p90_s=ttft[int(0.9 * (len(ttft) - 1))] if ttft else 0.0,
                in_flight=sum(in_flight) / len(in_flight) if in_flight else 0.0,
                busy=max(prefill_time) / span if span else 0.0, prefill_s=prefill_s, decode_s=decode_s)
# endregion
