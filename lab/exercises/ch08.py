"""Chapter 8 exercises: shortest-remaining-job-first admission, and preemption by swapping pages to host memory.

Both answers are ServingEngine subclasses. The checks run them on the tiny model through a fixed workload
(a small pool, so that requests queue or are preempted), step by step, and compare every request's tokens
with the same prompt decoded alone; step numbers stand for time, so every run is deterministic. Exercise 1's
check runs a second workload drawn fresh from the first, so that a list of choices cannot be replayed.
"""

import contextlib
import copy
import functools
import random

import torch

from ..cache import ConcatCache
from ..engine import ServingEngine, drive
from ..engine import serving as serving_module
from ..engine.fast import FusedStep
from ..loadgen import percentile
from ..models import forward_cached, load
from .rules import drawn_with, fresh_seed, unchanged

# ---- shared: the model, each request alone, a driver that watches every step --------------------------


@functools.cache
def tiny_model():
    """tiny-llama (2 layers, width 64, random weights, 320 token ids): a serving step takes about a
    millisecond, so a whole workload runs in a fraction of a second."""
    return load("tiny-llama")


def workload_prompts(lengths, seed) -> list[list[int]]:
    """One prompt of random token ids per length, the same for every call with the same seed."""
    rng, vocab = random.Random(seed), tiny_model().config.vocab_size
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


@functools.cache
def alone(prompt: tuple, n: int) -> tuple:
    """The oracle: greedy tokens of `prompt` decoded on its own through a ConcatCache (no pages, no batch,
    no scheduler), and the smallest gap between its top two logits on the way (a tie would make any
    comparison fragile; tests/test_exercises_ch08.py checks that every gap is wide)."""
    model = tiny_model()
    cache, x, out, gap = ConcatCache(model.config), torch.tensor([prompt]), [], float("inf")   # x [1, T]
    with torch.inference_mode():
        for _ in range(n):
            logits = forward_cached(x, model.weights, model.config, cache, last_only=True)[0, -1]  # [V]
            top = logits.topk(2).values
            gap = min(gap, float(top[0] - top[1]))
            out.append(int(logits.argmax()))
            x = torch.tensor([[out[-1]]])                                                    # [1, 1]
    return tuple(out), gap


def serve(engine, prompts, max_new_tokens, arrivals, after_step=None, max_steps=1000) -> list[int]:
    """`drive` a workload through `engine` (request i added just before step arrivals[i]), calling
    after_step(engine) after each step. Returns the requests' ids. Fails when a request that arrived is
    neither waiting, running nor done (dropped from the queue), or after max_steps."""
    def watch(engine, new):
        if after_step is not None:
            after_step(engine)
        present = set(map(id, engine.waiting)) | set(map(id, engine.running))
        lost = [r.id for r in engine.requests.values() if not r.done and id(r) not in present]
        assert not lost, (f"after step {engine.stats['steps'] - 1}, request(s) {lost} are neither waiting, "
                          "running nor done: dropped from the queue. Every request must be served")

    try:
        return drive(engine, [list(p) for p in prompts], list(max_new_tokens), arrivals, on_step=watch,
                     max_steps=max_steps)
    except RuntimeError as e:
        if engine.stats["steps"] < max_steps:
            raise
        left = [r.id for r in engine.requests.values() if not r.done]
        raise AssertionError(f"the workload did not finish in {max_steps} steps: requests {left} are still "
                             "waiting or running") from e


def _check_config(engine, engine_class, num_pages, page_size, max_batch_tokens):
    assert isinstance(engine, ServingEngine), (
        f"expected a subclass of ServingEngine, got {engine_class!r}")
    got = (engine.num_pages, engine.page_size, engine.max_batch_tokens)
    assert got == (num_pages, page_size, max_batch_tokens), (
        f"your engine runs with {got[0]} pages of {got[1]} and {got[2]} tokens a step; the check built it with "
        f"{num_pages} pages of {page_size} and {max_batch_tokens}: a bigger pool or budget hides the queue and the "
        "preemptions the exercise is about")


def _check_outputs(engine, rids, prompts, max_new_tokens, skip=()):
    """Every request finished with all the tokens it asked for, each equal to decoding it alone."""
    for i, rid in enumerate(rids):
        if i in skip:
            continue
        req, asked = engine.requests[rid], max_new_tokens[i]
        what = f"request {i} ({len(prompts[i])} prompt tokens, {asked} new)"
        assert req.state != "cancelled", (
            f"{what} was cancelled at step {req.events.get('cancelled')}: every request must be served to the "
            "end; dropping a request is not a way to schedule it")
        assert req.state == "finished", f"{what} is {req.state}, not finished"
        want, got = list(alone(tuple(prompts[i]), asked)[0]), list(req.output)
        assert len(got) >= asked, (
            f"{what} got {len(got)} tokens of the {asked} asked: a request is served its max_new_tokens, "
            "not fewer (did your engine shorten a job to make it look shorter?)")
        assert len(got) == asked, f"{what} got {len(got)} tokens, more than the {asked} asked"
        for j, (a, b) in enumerate(zip(got, want, strict=True)):
            assert a == b, f"{what}: token {j} is {a}, decoding the prompt alone gives {b}"


# ---- exercise 1: shortest remaining job first --------------------------------------------------------------

# (prompt tokens of its own, new tokens, arrival step, starts with the system prompt): a burst at step 0 with
# long jobs near the head of the queue, then nine more over steps 3 to 23. Four requests start with the same
# 24-token system prompt: once one of them has run, the others find its 6 pages cached, and their work left is
# 24 positions less than their size. Sizes (system prompt + own prompt + new) run from 9 to 58.
SJF_WORKLOAD = ((40, 16, 0, False), (36, 12, 0, False), (6, 4, 0, False), (44, 14, 0, False), (9, 3, 0, False),
                (5, 6, 0, False), (12, 5, 0, False), (6, 14, 0, False), (8, 8, 0, False), (6, 8, 0, True),
                (10, 6, 3, True), (38, 16, 7, False), (10, 6, 7, False), (4, 10, 9, True), (7, 4, 10, False),
                (42, 12, 14, False), (8, 6, 16, True), (4, 5, 21, False), (11, 3, 23, False))
SYSTEM_TOKENS = 24
SJF_SEED = 21        # the token ids: every request decoded alone is clear of near ties (a test checks it)
SJF_POOL = dict(num_pages=20, page_size=4, max_batch_tokens=32)   # 80 positions: the burst must queue


def sjf_workload() -> tuple:
    """(prompts, max_new_tokens, arrivals) of SJF_WORKLOAD."""
    system, *own = workload_prompts([SYSTEM_TOKENS] + [p for p, _, _, _ in SJF_WORKLOAD], seed=SJF_SEED)
    prompts = [(system if shared else []) + mine for mine, (_, _, _, shared) in zip(own, SJF_WORKLOAD, strict=True)]
    return prompts, [n for _, n, _, _ in SJF_WORKLOAD], [a for _, _, a, _ in SJF_WORKLOAD]


def job_size(prompt_tokens: int, max_new_tokens: int) -> int:
    """A job's size: every token it asks for."""
    return prompt_tokens + max_new_tokens


def cached_prefix(engine, req) -> int:
    """The positions `req` would take from cached pages if it were admitted now: its longest prefix of full
    pages that are named in the pool (pages it computed itself before a preemption, or pages another request
    with the same start named), at most all but its last token. Looks, changes nothing."""
    return engine.cached_prefix(req)       # a page named for other tokens (a collision) is a miss


def _watch_admissions(engine) -> list:
    """Record, at every admission the engine tries, (step, the request chosen, {waiting request id: (size,
    work left)}) before anything changes, and whether it was admitted. Returns the list the records go to.
    The work left is the check's oracle, kept inside this function so that no answer can call it:
    len(prompt) + max_new_tokens less the positions admission would really take from the cache, found by
    admitting the request into a copy of the engine's block manager."""
    log, admit = [], engine._admit

    def work_left(req) -> int:
        manager = copy.deepcopy(engine.manager)
        taken = manager.lookup(object(), engine._index_keys(req, (req.num_tokens - 1) // engine.page_size))
        return len(req.prompt) + req.max_new_tokens - taken * engine.page_size

    def watched(req, budget, now):
        waiting = {r.id: (len(r.prompt) + r.max_new_tokens, work_left(r)) for r in engine.waiting}
        n = admit(req, budget, now)
        log.append((now, req.id, waiting, n > 0))
        return n

    engine._admit = watched
    return log


def ttft_steps(timeline: list) -> list[int]:
    """Each request's time to first token, in steps: the step of its first token less its arrival step."""
    return [e["first_token"] - e["arrived"] for e in timeline]


def _ttft_summary(ttfts, longest) -> dict:
    return dict(ttft_median_steps=percentile(ttfts, 50), ttft_p99_steps=percentile(ttfts, 99),
                longest_job_ttft_steps=ttfts[longest])


def sjf_draw(seed) -> tuple:
    """(prompts, max_new_tokens, arrivals): SJF_WORKLOAD drawn again from `seed`. The same prompts, so the same
    tokens decoded alone; each request's new tokens drawn from half of its own up to all of them (a prefix
    of a continuation the tie test has cleared), each later arrival moved by up to two steps, and requests
    that arrive in the same step submitted in a shuffled order: other sizes, so other choices."""
    rng = random.Random(seed)
    prompts, news, arrivals = sjf_workload()
    news = [rng.randint((n + 1) // 2, n) for n in news]
    arrivals = [a and max(1, a + rng.randint(-2, 2)) for a in arrivals]
    order = sorted(range(len(prompts)), key=lambda i: (arrivals[i], rng.random()))
    return [prompts[i] for i in order], [news[i] for i in order], [arrivals[i] for i in order]


def _run_sjf(engine_class, check=None, workload=None):
    """(engine, request ids, timeline in request order, the admission log) of `workload` (prompts,
    max_new_tokens, arrivals; SJF_WORKLOAD by default) served by engine_class with prefix caching;
    check(engine) runs once it is built."""
    prompts, news, arrivals = workload or sjf_workload()
    with unchanged(__name__):                      # the reader's engine may not change the check
        engine = engine_class(tiny_model(), **SJF_POOL, prefix_caching=True)
        if check:
            check(engine)
        log = _watch_admissions(engine)
        rids = serve(engine, prompts, news, arrivals)
    by_id = {e["id"]: e for e in engine.timeline()}
    return engine, rids, [by_id[r] for r in rids], log


@functools.cache
def fcfs_timeline() -> tuple:
    """The stock engine's timeline on SJF_WORKLOAD: first come, first served."""
    return tuple(_run_sjf(ServingEngine)[2])


def _check_admissions(log, timeline, rids):
    """Every admission chose a waiting request with the least work left."""
    index = {rid: i for i, rid in enumerate(rids)}
    admitted = sorted((s, index[rid]) for s, rid, _, ok in log if ok)
    assert admitted == sorted((s, i) for i, e in enumerate(timeline) for s in e["admitted"]), (
        "your engine admitted requests without its _admit (the timeline's admissions are not the ones _admit "
        "made): choose the request in next_to_admit and let the stock scheduler admit it")
    first_come = all(rid == min(waiting) for _, rid, waiting, _ in log)
    for step, rid, waiting, _ in log:
        (size, left), i = waiting[rid], index[rid]
        rid_j = min(waiting, key=lambda r: waiting[r][1])
        if waiting[rid_j][1] >= left:
            continue
        (size_j, left_j), j = waiting[rid_j], index[rid_j]
        what = (f"at step {step}, request {i} (size {size}, {size - left} positions in cached pages: {left} left to "
                f"compute) was chosen while request {j} (size {size_j}, {size_j - left_j} cached: {left_j} left) "
                "waited: admit the waiting request with the least work left, len(prompt) + max_new_tokens less "
                "the positions its cached pages hold (ex.cached_prefix(self, req))")
        if size <= size_j:
            what += (f". Request {i} is no larger in all, but request {j} finds {size_j - left_j} of its positions "
                     "in cached pages: rank by the work left, not by the size")
        if timeline[j]["preempted"] and size_j != left_j:
            what += (f". Request {j} had been preempted: the pages it computed before are still named in the pool, "
                     "and it takes them back")
        if first_come:
            what += ". Every admission took the request that arrived first: that is first come, first served"
        raise AssertionError(what)


def check_shortest_first(engine_class, seed=None):
    """engine_class: a ServingEngine subclass whose `next_to_admit(self) -> Request` returns the waiting
    request (an element of `self.waiting`) with the least work left: its size, len(req.prompt) +
    req.max_new_tokens, less the positions it would take from cached pages if admitted now,
    `cached_prefix(self, req)` (this module's helper). Among equals, any. The engine runs with prefix caching:
    a request whose prompt starts with a system prompt another request has run finds those pages named in
    the pool, and a preempted request finds the pages it computed before it was preempted (until they are
    evicted): shortest *remaining* job first.

    The engine admits the request you return, or none in that step if it does not fit: it never skips it.
    The check builds engine_class(model, num_pages=20, page_size=4, max_batch_tokens=32, prefix_caching=True)
    on the tiny model and serves SJF_WORKLOAD (19 requests of sizes 9 to 58, four of them starting with the
    same system prompt: a burst at step 0 with long jobs near the head of the queue, then nine more over steps
    3 to 23) step by step. It verifies:
    - every request finishes, none cancelled or dropped from the queue, each with all of its max_new_tokens,
      each token equal to decoding its prompt alone (greedy, through a ConcatCache);
    - the pool and the budget are the ones asked for (a bigger pool would hide the queue);
    - every admission chose a waiting request with the least work left, counted at that moment by admitting
      each waiting request into a copy of the block manager (ranking by size alone fails: a request that
      finds the system prompt, or its own pages, cached has that much less to compute than its size);
    - the median time to first token (TTFT, in steps) is below first come, first served's (the stock engine
      on the same workload);
    - then the same requests with their sizes and arrivals drawn fresh (`sjf_draw`; `seed` draws them again):
      every token again, and every admission again the least work left, so that replaying a list of choices
      that suits the fixed workload fails.
    Returns the TTFTs of both policies (median, p99, and the longest job's), and prints them. Shortest job
    first starves long jobs: while short ones keep arriving, a long one waits, so its TTFT and the p99 grow
    even as the median falls. A server bounds that wait (ageing: a job's priority grows as it waits).
    """
    prompts, news, arrivals = sjf_workload()
    sizes = [job_size(len(p), n) for p, n in zip(prompts, news, strict=True)]
    fcfs = list(fcfs_timeline())
    engine, rids, timeline, log = _run_sjf(engine_class, lambda e: _check_config(e, engine_class, **SJF_POOL))
    _check_outputs(engine, rids, prompts, news)
    assert max(engine.stats["batch_tokens"]) <= SJF_POOL["max_batch_tokens"], "a step ran more tokens than its budget"
    _check_admissions(log, timeline, rids)
    longest = max(range(len(sizes)), key=lambda i: sizes[i])
    mine, theirs = _ttft_summary(ttft_steps(timeline), longest), _ttft_summary(ttft_steps(fcfs), longest)
    assert mine["ttft_median_steps"] < theirs["ttft_median_steps"], (
        f"median TTFT {mine['ttft_median_steps']} steps, first come first served's "
        f"{theirs['ttft_median_steps']}: shortest first should lower it")
    seed = fresh_seed(seed)
    drawn = sjf_draw(seed)
    with drawn_with(seed, "check_shortest_first"):
        engine, rids, timeline, log = _run_sjf(engine_class, workload=drawn)
        _check_outputs(engine, rids, drawn[0], drawn[1])
        _check_admissions(log, timeline, rids)
    print(f"TTFT in steps             median    p99   the longest job (size {sizes[longest]})")
    for name, t in (("first come, first served", theirs), ("shortest job first", mine)):
        print(f"{name:<25} {t['ttft_median_steps']:6.1f} {t['ttft_p99_steps']:6.1f}   "
              f"{t['longest_job_ttft_steps']}")
    print(f"correct (the second workload drawn with seed={seed})")
    return {"fcfs": theirs, "shortest_first": mine}


# ---- exercise 2: preemption by swapping to host memory ----------------------------------------------------

# (prompt tokens, new tokens, arrival step); 18 pages of 4 hold 72 positions, the requests grow to 217
SWAP_WORKLOAD = ((13, 16, 0), (22, 20, 0), (7, 20, 0), (30, 14, 2), (18, 20, 4), (25, 18, 6))
SWAP_POOL = dict(num_pages=18, page_size=4, max_batch_tokens=12)   # 12 tokens a step: prompts in chunks


def swap_workload() -> tuple:
    """(prompts, max_new_tokens, arrivals) of SWAP_WORKLOAD."""
    prompts = workload_prompts([p for p, _, _ in SWAP_WORKLOAD], seed=4)
    return prompts, [n for _, n, _ in SWAP_WORKLOAD], [a for _, _, a in SWAP_WORKLOAD]


def positions_without_recomputation(prompts, max_new_tokens) -> int:
    """The positions a run that never recomputes puts through the model: each request's prompt and its
    new tokens, less the last (never fed back)."""
    return sum(len(p) + n - 1 for p, n in zip(prompts, max_new_tokens, strict=True))


@contextlib.contextmanager
def counting_positions():
    """While inside, every forward a ServingEngine step runs (forward_cached, or a step of decodes in one call)
    adds its tokens to the yielded list's item 0."""
    real, real_fused, counted = serving_module.forward_cached, FusedStep.__call__, [0]

    def counting(ids, *args, **kwargs):
        counted[0] += ids.shape[1]                                    # ids [1, N]: the step's tokens
        return real(ids, *args, **kwargs)

    def counting_fused(self, ids, *args, **kwargs):
        counted[0] += ids.shape[1]
        return real_fused(self, ids, *args, **kwargs)

    serving_module.forward_cached, FusedStep.__call__ = counting, counting_fused
    try:
        yield counted
    finally:
        serving_module.forward_cached, FusedStep.__call__ = real, real_fused


def _tensors(x) -> list:
    """The tensors inside x: a tensor, or tuples, lists and dicts of them (anything else is skipped)."""
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, dict):
        x = list(x.values())
    return [t for y in x for t in _tensors(y)] if isinstance(x, (tuple, list)) else []


def pages_of(engine, req) -> tuple:
    """The keys and values of the computed positions of a running request, read through its block table:
    two `[L, computed, H_kv, D]` tensors (copies)."""
    P = engine.page_size
    slots = engine.manager.slots(req.seq, 0, req.computed)           # pool slots, in position order
    pages = [engine.pool.page(slot // P) for slot in slots[::P]]     # (keys, values) [L, P, H_kv, D] each
    pages = pages or [tuple(t[:, :0] for t in engine.pool.page(0))]  # nothing computed yet: [L, 0, H_kv, D]
    return tuple(torch.cat([kv[i] for kv in pages], 1)[:, :req.computed] for i in (0, 1))  # [L, computed, H_kv, D]


class _SwapWatch:
    """Called after every step: pages go back to the pool while a request is swapped out, its host copy
    lives exactly as long as it waits, and it comes back into its new pages as it left. Records the most
    bytes held on the host at once."""

    def __init__(self):
        self.kv, self.away, self.peak_bytes = {}, {}, 0   # running / swapped-out request id -> (keys, values)

    @property
    def computed(self) -> dict:
        """Request id -> positions computed, for every request running after the last step."""
        return {rid: k.shape[1] for rid, (k, _) in self.kv.items()}

    def __call__(self, engine):
        m, now = engine.manager, engine.stats["steps"] - 1
        swapped = getattr(engine, "swapped", None)
        assert isinstance(swapped, dict), (
            "keep the host copies in self.swapped, a dict from request id to what you copied (set it in __init__)")
        held, running = engine.num_pages - m.num_free["full"], sum(len(m.block_table(r.seq)) for r in engine.running)
        out = [r.id for r in engine.waiting if now in r.events["preempted"]]
        assert held == running, (
            f"after step {now}, {held} pages are taken but the running requests hold {running}"
            + (f"; request(s) {out} were preempted in this step" if out else "")
            + ": a request swapped out gives its pages back to the pool (release them once copied)")
        want = {r.id for r in engine.waiting if r.events["preempted"]}
        for rid in want - set(swapped):
            raise AssertionError(f"request {rid} was preempted at step {engine.requests[rid].events['preempted'][-1]}"
                                 " and waits, but self.swapped has no copy of its pages: copy its keys and values "
                                 "to the host in _preempt")
        for rid in set(swapped) - want:
            req = engine.requests.get(rid)
            state = req.state if req else "unknown"
            raise AssertionError(f"request {rid} is {state} after step {now}, yet self.swapped still holds its host "
                                 "copy: delete it once the pages are restored (or the request is cancelled)")
        for rid in out:
            self.away[rid] = self.kv[rid]                                   # what its pages held when it left
            self._check_copy(engine, rid, swapped[rid], self.away[rid][0].shape[1])
        if swapped:
            self._check_not_views(engine, swapped)
        for req in engine.running:
            if req.id in self.away:                                          # swapped in during this step
                assert now in req.events["admitted"], (
                    f"request {req.id} runs again after step {now}, but req.events['admitted'] does not say so: "
                    "append the step to it when you swap a request in")
                self._check_restored(engine, req, now, *self.away.pop(req.id))
        self.peak_bytes = max(self.peak_bytes, sum(t.nbytes for v in swapped.values() for t in _tensors(v)))
        self.kv = {r.id: pages_of(engine, r) for r in engine.running}

    @staticmethod
    def _check_copy(engine, rid, saved, positions):
        tensors, cfg = _tensors(saved), engine.model.config
        need = 2 * cfg.n_layers * positions * cfg.n_kv_heads * cfg.head_dim   # keys and values of its positions
        have = sum(t.numel() for t in tensors)
        assert have >= need, (
            f"self.swapped[{rid}] holds {have} values; request {rid} had {positions} positions computed, whose "
            f"keys and values are {need} values: copy the pages' keys and values themselves "
            "(self.pool.page(p)), not where they were")
        for t in tensors:
            assert t.device.type == "cpu", f"self.swapped[{rid}] holds a tensor on {t.device}: copy it to the host"

    @staticmethod
    def _check_not_views(engine, swapped):
        """Every host copy is a copy, not a view of the pool: it stays as it is while every page of the pool
        changes (through set_page, each value negated, a zero made one), and then the pages are put back."""
        held = {rid: [t.clone() for t in _tensors(saved)] for rid, saved in swapped.items()}
        pages = [engine.pool.page(p) for p in range(engine.num_pages)]   # (keys, values) [L, P, H_kv, D]
        flip = lambda t: torch.where(t == 0, torch.ones_like(t), -t)             # every value differs
        try:
            for p, (k, v) in enumerate(pages):
                engine.pool.set_page(p, (flip(k), flip(v)))
            moved = [rid for rid, saved in swapped.items()
                     if any(not torch.equal(a, b) for a, b in zip(_tensors(saved), held[rid], strict=True))]
        finally:
            for p, kv in enumerate(pages):
                engine.pool.set_page(p, kv)                                      # the pool as it was
        assert not moved, (
            f"self.swapped[{moved[0]}] holds a view of the pool, not a copy: it changed when the pool's pages did, "
            "so once the pages are reused it changes under you")

    @staticmethod
    def _check_restored(engine, req, now, keys, values):
        positions = keys.shape[1]
        assert req.computed >= positions, (
            f"request {req.id}, swapped in at step {now}, has {req.computed} positions computed after that step, "
            f"fewer than the {positions} it had when swapped out: it is recomputing them. Restore its pages and "
            "continue from req.computed")
        k, v = pages_of(engine, req)
        for name, got, had in (("keys", k, keys), ("values", v, values)):
            bad = (got[:, :positions] != had).flatten(2).any(-1).any(0).nonzero()   # [positions] that differ
            assert not len(bad), (
                f"request {req.id} was swapped in at step {now}, but the {name} its block table points at differ "
                f"from those it had when swapped out, from position {int(bad[0])} of {positions}: copy host page i "
                "into page i of its new block table, the pages of its positions")


@functools.cache
def recompute_positions() -> tuple:
    """(positions run through the model, preemptions) of the stock engine, which recomputes, on
    SWAP_WORKLOAD."""
    prompts, news, arrivals = swap_workload()
    engine = ServingEngine(tiny_model(), **SWAP_POOL, prefix_caching=False)
    with counting_positions() as counted:
        serve(engine, prompts, news, arrivals)
    return counted[0], engine.stats["preemptions"]


def check_swapping(engine_class):
    """engine_class: a ServingEngine subclass that preempts by swapping instead of recomputing.

    - `_preempt(req, now)`: copy the victim's keys and values to host memory, page by page:
      `self.pool.page(p)` returns page p's keys and values in every layer, `(keys, values)`, `[L, P, H_kv, D]`
      each (copies on the pool's device: move them to the host), for its pages p from
      `self.manager.block_table(req.seq)` (the first ceil(req.computed / P) of them hold its `req.computed`
      positions); keep them in `self.swapped[req.id]`, a dict you set up in `__init__`; then let the stock
      `_preempt` release its pages and queue it at the head.
    - `_admit(req, budget, now) -> n`: for a swapped request, take a new sequence, `seq = self.pool.new_id()`,
      and reserve the `computed` positions it had plus the n >= 1 it computes in this step (at most
      `budget`): `self.pool.reserve([(seq, computed + n)])`, which raises OutOfPagesError, changing nothing, when the
      pool is too full (return 0 then). Copy host page i back into page i of its new block table,
      `self.pool.set_page(page, (keys, values))`, delete the host
      copy, set `req.seq`, `req.computed` and `req.state = "running"`, append `now` to
      `req.events["admitted"]`, and return n. Other requests: the stock `_admit`.
    - `cancel(rid)`: a request cancelled while swapped out drops its host copy.
    The check builds engine_class(model, num_pages=18, page_size=4, max_batch_tokens=12, prefix_caching=False)
    on the tiny model and serves SWAP_WORKLOAD, six requests growing to 217 positions in a pool of 72,
    some preempted mid-prompt or mid-page, one twice. It verifies: every request's tokens equal decoding it alone; there
    were preemptions; the positions run through the model (counted at the forward) are exactly those of a
    run that never recomputes, sum(prompt + new - 1); after every step the pages taken are exactly those
    of the running requests, and self.swapped holds exactly the preempted requests still waiting, as CPU
    tensors that are copies of at least their computed positions (not views of the pool: they stay as they are
    while the check changes every page of the pool, and puts it back); a request swapped in
    finds, through its new block table, exactly the keys and values it left with (the tokens alone may not
    show full pages restored in another order: attention over earlier positions does not depend on where
    they are stored, since each stored key already carries its position). Then it serves the workload
    again, cancelling the first request swapped out: its host copy must go. Returns the positions computed
    by you and by recomputation, the preemptions, and the most bytes held on the host at once.
    On a CPU the pool is in host memory already: the copy stands for the transfer over PCIe on a GPU.
    """
    prompts, news, arrivals = swap_workload()
    watch = _SwapWatch()
    with counting_positions() as counted, unchanged(__name__):
        engine = engine_class(tiny_model(), **SWAP_POOL, prefix_caching=False)
        _check_config(engine, engine_class, **SWAP_POOL)
        rids = serve(engine, prompts, news, arrivals, after_step=watch)
    _check_outputs(engine, rids, prompts, news)
    assert engine.stats["preemptions"] > 0, "no request was preempted: the pool of 18 pages must run out"
    want, (recomputed, stock_preemptions) = positions_without_recomputation(prompts, news), recompute_positions()
    assert counted[0] >= want, f"your engine ran only {counted[0]} positions through the model, fewer than {want}"
    assert counted[0] == want, (
        f"your engine ran {counted[0]} positions through the model; without recomputation the workload needs "
        f"{want}, so {counted[0] - want} were computed again (recomputation runs {recomputed}). Restore the "
        "swapped pages on admission and continue from req.computed")
    assert not engine.swapped and engine.manager.num_free == engine.manager.num_pages, (
        "after the workload, host copies or pages are still held")
    result = dict(positions=counted[0], recompute_positions=recomputed, preemptions=engine.stats["preemptions"],
                  host_peak_bytes=watch.peak_bytes)

    cancelled, watch = [], _SwapWatch()                           # the second run: cancel a swapped request

    def cancel_one(engine):
        watch(engine)
        if not cancelled and engine.swapped:
            rid = min(engine.swapped)
            engine.cancel(rid)
            cancelled.append(rid)
            assert rid not in engine.swapped, (
                f"cancel({rid}) of a request swapped out left its host copy in self.swapped: drop it in cancel")

    with unchanged(__name__):
        again = engine_class(tiny_model(), **SWAP_POOL, prefix_caching=False)
        rids = serve(again, prompts, news, arrivals, after_step=cancel_one)
    assert cancelled, "in the second run, no request was ever swapped out"
    i = rids.index(cancelled[0])
    _check_outputs(again, rids, prompts, news, skip={i})
    got = again.output(cancelled[0])
    assert got == list(alone(tuple(prompts[i]), news[i])[0][:len(got)]), (
        f"request {i}, cancelled while swapped out, had generated tokens that differ from decoding it alone")
    assert again.manager.num_free == again.manager.num_pages, "after the second run, pages are still held"
    print(f"{result['preemptions']} preemptions; positions through the model: {counted[0]} swapping, {recomputed} "
          f"recomputing ({stock_preemptions} preemptions); at most {result['host_peak_bytes']} bytes on the host "
          "at once")
    print("correct")
    return result
