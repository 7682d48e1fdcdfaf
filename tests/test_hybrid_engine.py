"""ServingEngine with a model whose layers are local and global (chapter 10): one pool with a group of pages
per rule, the local group giving back the pages that left the window.

Oracles. Tokens: the model's own uncached forward (`lab.models.forward`, for a retrofit `retrofit.forward`,
which shares no code with the cached block, the pool or the step), greedy on each prompt alone; tolerance
none, and each oracle's smallest top-two gap must exceed GAP, so that a float32 summation order cannot flip a
token (tests/test_serving.py's argument). Pages: the window rule restated from positions, not from page
arithmetic: the query at position p reads p - window + 1 .. p and the sinks. After a step whose queries began
at position F and which brought a sequence to length L, its local group holds exactly the pages with a
position that a query at F or later reads, and the pages F .. L - 1 were written into; so at most
ceil((window - 1 + L - F) / P) + 1 + ceil(sinks / P) pages (lab/cache/hybrid.py's bound), while its full
group holds all ceil(L / P). Checked after every step of every run below.
"""

import dataclasses
import random

import pytest
import torch

from lab.cache import BlockManager, CacheInputError, CacheStateError, OutOfPagesError
from lab.cache.hybrid import NULL, HybridBlockManager
from lab.cache.pool import PagePool
from lab.engine import PromptLookup, ServingEngine
from lab.models import forward, load, random_model
from lab.models.retrofit import local_layers, share_kv

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

GAP = 1e-4                              # 10 x the 1e-5 bound on cached-vs-uncached logits (tests/test_retrofit.py)
LENGTHS = (5, 17, 30, 9, 41)            # all but two longer than the window and its sinks
NEW = 12
_oracles = {}


def ceil_div(a, b):
    return -(-a // b)


@pytest.fixture(scope="module")
def base():
    """tiny-llama with 4 layers, so that layers 0 and 2 are local and 1 and 3 global (global_every=2)."""
    return random_model(dataclasses.replace(load("tiny-llama").config, n_layers=4, name="tiny4"), seed=1)


@pytest.fixture(scope="module")
def models(base):
    return {"w8s2": local_layers(base, window=8, global_every=2, sinks=2),
            "w6": local_layers(base, window=6, global_every=2),             # a window of a page and a half
            "w5s3": local_layers(base, window=5, global_every=2, sinks=3),
            "shared": share_kv(local_layers(base, window=8, global_every=3, sinks=1), 2)}   # layer 1 reads 0


def prompts(lengths=LENGTHS, seed=0):
    rng = random.Random(seed)
    return [[rng.randrange(320) for _ in range(n)] for n in lengths]


def copied(seed, length=20):
    """Prompts that repeat their first part, so that prompt lookup finds matches (and misses some)."""
    rng = random.Random(seed)
    part = [rng.randrange(320) for _ in range(length)]
    return part + part[: length // 2 + seed % 5]


def uncached(model, prompt, n=NEW, oracle=True) -> list:
    """Greedy tokens of `prompt` alone from repeated uncached forwards; as an oracle, fails on a near tie."""
    key = (model.name, tuple(prompt), n)
    if key not in _oracles:
        ids, gap = list(prompt), float("inf")
        with torch.inference_mode():
            for _ in range(n):
                logits = forward(torch.tensor([ids]), model.weights, model.config)[0, -1]
                top = logits.topk(2).values
                gap = min(gap, float(top[0] - top[1]))
                ids.append(int(logits.argmax()))
        _oracles[key] = ids[len(prompt):], gap
    tokens, gap = _oracles[key]
    assert gap > GAP or not oracle, f"prompt of {len(prompt)} tokens has a near tie (gap {gap:.2e}): pick another seed"
    return tokens


def near_tie(model, prompt, n) -> bool:
    uncached(model, prompt, n, oracle=False)
    return _oracles[model.name, tuple(prompt), n][1] <= GAP


def pages_kept(first, P, window, sinks) -> set:
    """Block-table indices a local group must hold for queries from position `first` on: every page with a
    position one of them reads (the sinks, the last window), and the partially written last page."""
    read = set(range(max(0, first + 1 - window), first)) | set(range(min(sinks, first)))
    return {p // P for p in read} | ({first // P} if first % P else set())


def held(engine, seq, group) -> set:
    return {i for i, page in enumerate(engine.manager.block_table(seq, group)) if page != NULL}


def check_pages(engine, before):
    """After a step: every group's bookkeeping, and each running sequence's pages against the window rule.
    `before`: request id -> (seq, computed, cached_tokens) before the step."""
    hm, P = engine.manager, engine.page_size
    hm.check()
    window, sinks = hm.rule("local")
    assert engine.stats["held_pages"] == {g: hm.held_pages(g) for g in hm.groups}
    for req in engine.running:
        L = hm.length(req.seq)
        assert L == req.computed and not req.guess                         # rejected guesses cropped
        assert NULL not in hm.block_table(req.seq, "full")
        assert hm.held_pages("full", req.seq) == ceil_div(L, P)            # a global layer keeps every page
        local = held(engine, req.seq, "local")
        assert pages_kept(L, P, window, sinks) <= local                     # the next query finds its window
        seq0, computed0, cached0 = before[req.id]
        if seq0 == req.seq and computed0 == L:
            continue                                                        # not in this step
        first = computed0 if seq0 == req.seq else req.cached_tokens - cached0   # this step's first query
        assert local == pages_kept(first, P, window, sinks) | set(range(first // P, ceil_div(L, P)))
        bound = ceil_div(window - 1 + L - first, P) + 1 + ceil_div(sinks, P)
        assert len(local) <= bound == hm.most_pages("local", L - first)


def state(engine) -> dict:
    return {r.id: (r.seq, r.computed, r.cached_tokens) for r in engine.requests.values()}


def run(engine, ps, n=NEW, arrivals=None) -> list:
    """Add `ps` (at step arrivals[i]), step until they finish, checking the pages after every step."""
    arrivals, rids, start = arrivals or [0] * len(ps), [None] * len(ps), engine.stats["steps"]
    while None in rids or not all(engine.requests[r].done for r in rids):
        for i, a in enumerate(arrivals):
            if rids[i] is None and a <= engine.stats["steps"] - start:
                rids[i] = engine.add_request(ps[i], n)
        before = state(engine)
        engine.step()
        check_pages(engine, before)
    return [engine.output(r) for r in rids]


def check_idle(engine):
    """Every request done: every page of every group back, no sequence left, the bookkeeping consistent."""
    hm = engine.manager
    assert not engine.running and not engine.waiting and hm.sequences() == []
    assert all(hm.num_free[g] == hm.manager(g).num_pages for g in hm.groups)
    assert engine.stats["held_pages"] == {"full": 0, "local": 0}
    hm.check()


# ---- tokens: each request's, as the uncached forward gives them ----
@pytest.mark.parametrize("name, page_size, budget, prefix_caching", [
    ("w8s2", 4, 8, True), ("w8s2", 4, 8, False), ("w6", 4, 5, True), ("w5s3", 3, 7, True), ("w8s2", 16, 32, True),
    ("shared", 4, 8, True)])
def test_tokens_equal_the_uncached_forward(models, base, name, page_size, budget, prefix_caching):
    model, ps = models[name], prompts()
    want = [uncached(model, p) for p in ps]
    assert want != [uncached(base, p, oracle=False) for p in ps]         # the window changes the tokens
    engine = ServingEngine(model, num_pages=64, page_size=page_size, max_batch_tokens=budget,
                           prefix_caching=prefix_caching)
    assert isinstance(engine.pool, PagePool) and engine.manager.groups == ["full", "local"]
    assert run(engine, ps, arrivals=[0, 0, 2, 5, 7]) == want
    assert max(len(t["chunks"]) for t in engine.timeline()) > 1           # prefill really was chunked
    assert max(engine.stats["batch_sizes"]) > 1                            # requests really were batched
    peak = engine.stats["peak_held_pages"]
    assert peak["local"] < peak["full"] or page_size > 8 and peak["local"] == peak["full"]   # what the window saves
    check_idle(engine)


def test_the_pool_holds_each_group_s_layers(models):
    """Layers 0 and 2 in the local group's pool, 1 and 3 in the full one's, each of its own size."""
    engine = ServingEngine(models["w8s2"], num_pages=40, page_size=4, local_pages=12)
    pool, cfg = engine.pool, models["w8s2"].config
    assert (engine.manager.layers("full"), engine.manager.layers("local")) == ([1, 3], [0, 2])
    assert tuple(pool.k_pools["full"].shape) == (2, 40, 4, cfg.n_kv_heads, cfg.head_dim)
    assert tuple(pool.v_pools["local"].shape) == (2, 12, 4, cfg.n_kv_heads, cfg.head_dim)
    assert pool.nbytes() == 2 * 4 * (2 * 40 + 2 * 12) * 4 * cfg.n_kv_heads * cfg.head_dim    # K, V in float32
    assert engine.num_pages == 40 and "40/40 full, 12/12 local" in repr(engine)


def test_preemption_when_either_group_runs_out(models):
    """A full group too small for every request, then a local group too small: requests are preempted and
    recomputed, and their tokens stay the uncached ones."""
    model, ps = models["w8s2"], prompts()
    want = [uncached(model, p) for p in ps]
    tight = ServingEngine(model, num_pages=14, page_size=4, max_batch_tokens=8)
    assert run(tight, ps) == want and tight.stats["preemptions"] > 0
    check_idle(tight)
    local = ServingEngine(model, num_pages=64, page_size=4, max_batch_tokens=8, local_pages=6)
    assert run(local, ps) == want and local.stats["preemptions"] > 0
    assert local.stats["peak_held_pages"]["local"] <= 6 < local.stats["peak_held_pages"]["full"]
    check_idle(local)
    alone = ServingEngine(model, num_pages=64, page_size=4, max_batch_tokens=64, local_pages=4)   # one window
    assert run(alone, ps[-1:]) == want[-1:]                               # a 41-token prompt chunked to fit
    assert len(alone.timeline()[0]["chunks"]) > 1


# ---- speculation ----
@pytest.mark.parametrize("k", [2, 4])
def test_speculation_keeps_the_tokens_and_the_window(models, k):
    """Prompt lookup guesses, verified in the step and cropped back: the lookahead reservation judges the
    window from the decode's own query (PagePool's first_query), and a crop never goes below it."""
    model = models["w8s2"]
    ps = [copied(seed) for seed in range(4)] + prompts((13,), seed=3)
    want = [uncached(model, p, 16) for p in ps]
    engine = ServingEngine(model, num_pages=64, page_size=4, max_batch_tokens=16, draft=PromptLookup(2), k=k)
    assert run(engine, ps, 16, arrivals=[0, 0, 1, 3, 4]) == want
    s = engine.stats
    assert s["proposed"] > s["accepted"] > 0 and s["rollback_pages"] > 0
    check_idle(engine)


def test_the_lookahead_keeps_the_page_the_decode_reads():
    """Pages of 4, window 8: the decode at position 18 reads 11 .. 18, so page 2 (8 .. 11) must stay while
    its guesses are reserved; judged from length 19 instead, the window would give page 2 back."""
    hm = HybridBlockManager(4, {"full": (16, 0, 0), "local": (16, 8, 0)})
    for first in (None, 18):
        seq = f"s{first}"
        hm.reserve(seq, 18)
        hm.reserve(seq, 1)                                # the decode: pages 0, 1 leave the window
        hm.reserve(seq, 3, first_query=first)             # the guesses
        assert (hm.block_table(seq, "local")[2] == NULL) == (first is None)
    with pytest.raises(CacheStateError, match="first_query 30"):
        hm.reserve("s18", 1, first_query=30)
    hm.check()


# ---- prefix caching ----
def test_a_prefix_hit_takes_the_last_window_in_the_local_group(models):
    """The same prompt again, and one extended: both hit (cached_tokens > 0) and give the uncached tokens; in
    the local group the hit holds only the pages of the sinks and the last window, the named ones."""
    model, P = models["w8s2"], 4
    first, = prompts((41,), seed=7)
    longer = first + prompts((6,), seed=8)[0]
    engine = ServingEngine(model, num_pages=64, page_size=P, max_batch_tokens=8)
    assert run(engine, [first]) == [uncached(model, first)]
    hm, cached = engine.manager, engine.stats["cached_tokens"]
    for prompt in (first, longer):
        rid = engine.add_request(prompt, NEW)
        before = state(engine)
        engine.step()
        check_pages(engine, before)
        req = engine.requests[rid]
        h = req.cached_tokens // P
        assert h == (len(prompt) - 1) // P if prompt is first else h == len(first) // P
        keys = engine._index_keys(req, h)
        assert hm.block_table(req.seq, "full")[:h] == [hm.manager("full").cached(key) for key in keys]
        local = hm.block_table(req.seq, "local")[:h]
        reads = pages_kept(h * P, P, *hm.rule("local"))
        assert [i for i, page in enumerate(local) if page != NULL] == sorted(reads) and len(reads) < h
        assert all(local[i] == hm.manager("local").cached(keys[i]) for i in reads)
        while not req.done:
            before = state(engine)
            engine.step()
            check_pages(engine, before)
        assert engine.output(rid) == uncached(model, prompt)
    assert engine.stats["cached_tokens"] > cached
    check_idle(engine)


# ---- random operations ----
class HalfRight:
    """A draft that guesses the uncached greedy continuation and spoils one guess in two at a random place:
    every decode speculates, and a verify accepts some guesses and rolls the others back."""

    def bind(self, model, prompt):
        self.model, self.prompt, self.rng = model, list(prompt), random.Random(len(prompt))

    def propose(self, context, k):
        done = len(context) - len(self.prompt)
        guess = uncached(self.model, self.prompt, done + k, oracle=False)[done:]
        if self.rng.random() < 0.5:
            i = self.rng.randrange(k)
            guess[i] = (guess[i] + 1) % 320
        return guess


@pytest.mark.parametrize("seed, draft", [(0, False), (7, True), (2, False)])
def test_random_adds_steps_and_cancels_return_every_page(models, seed, draft):
    """Requests added, stepped and cancelled at random over small pools (prompts that share a stem, so that
    some hit, and repeat part of it, so that prompt lookup guesses): after every step the pages obey the
    window rule, finished requests have the uncached tokens, and at the end every page of every group is
    free."""
    rng, model = random.Random(seed), models["w8s2" if seed != 2 else "w5s3"]
    stem = prompts((24,), seed=100 + seed)[0]
    engine = ServingEngine(model, num_pages=16, page_size=4 if seed != 2 else 3, max_batch_tokens=rng.choice([6, 12]),
                           local_pages=8, draft=HalfRight() if draft else None, k=3)
    added = {}
    for _ in range(70):
        action = rng.random()
        if action < 0.3:
            a = rng.randrange(4, 25)
            p = stem[:a] + stem[rng.randrange(a):a] + prompts((rng.randrange(0, 4),), seed=rng.randrange(1000))[0]
            added[engine.add_request(p, rng.randrange(1, 12))] = p
        elif action < 0.37 and added:
            engine.cancel(rng.choice(list(added)))
        else:
            before = state(engine)
            engine.step()
            check_pages(engine, before)
    while engine.running or engine.waiting:
        before = state(engine)
        engine.step()
        check_pages(engine, before)
    s = engine.stats
    assert s["preemptions"] > 0 and s["cached_tokens"] > 0 and (s["proposed"] > s["accepted"] > 0 or not draft)
    finished = [r for r in engine.requests.values() if r.state == "finished"]
    clear = [r for r in finished if not near_tie(model, added[r.id], r.max_new_tokens)]
    assert len(clear) > 5                                  # a near tie leaves no oracle: not compared
    for r in clear:
        assert r.output == uncached(model, added[r.id], r.max_new_tokens)
    check_idle(engine)


# ---- what is refused, and what stays as it was ----
def test_a_step_never_reads_a_page_the_window_gave_back(models):
    """A plan whose queries read a page that is NULL in the local group's block table is refused."""
    pool = PagePool.for_model(models["w8s2"].config, num_pages=16, page_size=4)
    pool.reserve([(0, 20)])
    pool.manager.manager("local").drop_pages(0, [2])      # by hand: positions 8 .. 11, which queries read
    with pytest.raises(CacheStateError, match="given back"):
        pool.plan_step([(0, 20)])
    assert pool.plan_step([(0, 1)]).block_tables["local"][0, 2] == 0    # position 19 reads 0, 1 and 12 .. 19
    pool.manager.manager("local").drop_pages(0, [3])      # positions 12 .. 15: in the decode's window
    with pytest.raises(CacheStateError, match="given back"):
        pool.plan_step([(0, 1)])


def test_bad_settings_are_refused(models, base):
    model = models["w8s2"]
    for bad, match in ((0, "local_pages must be an int of at least 1, got 0"), (2.0, "local_pages must be an int"),
                       (3, r"group 'local' has 3 pages; one sequence's window \(8 positions, 2 sinks, pages of 4\) "
                           "needs 4")):                       # ceil(8 / 4) + 1 + ceil(2 / 4): a one-token step
        with pytest.raises(CacheInputError, match=match):
            ServingEngine(model, num_pages=16, page_size=4, local_pages=bad)
    with pytest.raises(CacheInputError, match="local_pages sizes the pages of local layers"):
        ServingEngine(base, num_pages=16, page_size=4, local_pages=8)
    engine = ServingEngine(model, num_pages=4, page_size=4)
    with pytest.raises(OutOfPagesError, match="the pool has 4"):
        engine.add_request(list(range(20)), 4)             # 23 positions: 6 pages in the full group
    with pytest.raises(CacheInputError, match="a planned step attends"):
        engine.pool.plan_step([]).attend(0, None, None, None)


def test_a_model_without_local_layers_has_one_group(base):
    """As trained, or local_layers with every layer global: one group of pages, a BlockManager's (chapter 8)."""
    for model in (base, local_layers(base, window=8, global_every=1)):
        engine = ServingEngine(model, num_pages=16, page_size=4)
        assert engine.manager.groups == ["full"] and type(engine.manager.manager("full")) is BlockManager
        out = engine.generate(prompts((9, 14)), 4)
        assert out == [uncached(base, p, 4) for p in prompts((9, 14))]
        assert engine.stats["held_pages"] == {"full": 0} and engine.stats["peak_held_pages"]["full"] > 0


def test_longest_prefix_first_runs_on_a_hybrid_pool(models):
    """schedule="lpm" ranks waiting requests by manager.cached_prefix (it asked the hybrid manager for a
    method it lacked, AttributeError): the request whose prefix the pool holds goes first, and every request
    still gets its greedy tokens."""
    model = models["w8s2"]
    stem = [(5 * i + 3) % 250 + 1 for i in range(24)]
    engine = ServingEngine(model, num_pages=64, page_size=4, schedule="lpm")
    engine.generate([stem + [7]], 2)                                   # names stem's pages
    a, b = [9, 8, 7, 6, 5, 4, 3, 2, 1] * 2, stem + [11, 12]
    ids = [engine.add_request(p, NEW) for p in (a, b)]
    assert [engine.cached_prefix(engine.requests[i]) for i in ids] == [0, 24]
    assert engine.next_to_admit().id == ids[1]
    while engine.running or engine.waiting:
        engine.step()
    for p, i in zip((a, b), ids, strict=True):
        if not near_tie(model, p, NEW):
            assert engine.output(i) == uncached(model, p)
    check_idle(engine)
