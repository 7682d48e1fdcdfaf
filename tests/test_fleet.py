"""Routers over several engines and their simulation (lab.fleet, chapter 11).

Oracles: recomputation without a cache (RecomputeBackend) for every score a routed engine returns (tiny-llama in
float32, cached against uncached, differs by a few 1e-7, summation order; we allow 1e-5, as
tests/test_prefix_caching.py does); one PrefixCachingBackend run dry by hand (lab.workloads.hit_rate) for
a fleet of one; the closed form of round robin on a repeated prompt; the sums over the workers' own stats.
"""

import random
from types import SimpleNamespace

import pytest

from lab.engine import PrefixCachingBackend, RecomputeBackend, common_prefix
from lab.engine.hashing import page_keys
from lab.fleet import POLICIES, FleetError, Router, choose, simulate
from lab.models import InputError, load
from lab.serve import Fleet
from lab.workloads import conversation, hit_rate, random_tokens, shared_system_prompts

ATOL = 1e-5
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def tenants(seed=0, n=24, systems=3, system_len=40):
    """Requests of a few applications: a system prompt each, then a question; some repeat a question."""
    rng = random.Random(seed)
    prompts = [random_tokens(rng, system_len + 7 * k, 320) for k in range(systems)]
    out = []
    for _ in range(n):
        ids = rng.choice(prompts) + random_tokens(rng, rng.randint(1, 20), 320)
        out.append(ids if not out or rng.random() > 0.2 else list(rng.choice(out)))
    return out


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_scores_equal_recomputation(tiny, policy):
    trace = tenants() + conversation(320, system=30, turns=4, user=9, reply=11)
    router = Router([PrefixCachingBackend(tiny, 16, 8) for _ in range(3)], policy)
    oracle = RecomputeBackend(tiny)
    for ids in trace:
        got = router.next_logits(ids)
        want = oracle.next_logits(ids)
        assert (got - want).abs().max() <= ATOL, f"{policy}: {len(ids)} ids, calls per worker {router.calls}"
    cached = sum(e.stats["cached_tokens"] for e in router.engines)
    assert cached > 0 and sum(router.calls) == len(trace)      # the trace was served partly from pages


def test_kv_aware_predicts_what_the_worker_takes_and_goes_there(tiny):
    router = Router([PrefixCachingBackend(tiny, 128, 16) for _ in range(4)], "kv_aware")
    for ids in shared_system_prompts(320, scale=0.2, seed=3):
        predicted, costs, w = router.cached_tokens(ids), router.costs(ids), router.route(ids)
        assert costs[w] == min(costs)                            # it picks a cheapest worker
        assert router.dry_run(ids) == predicted[w]              # and it takes there what was predicted


def test_kv_aware_counts_pages_under_the_salt(tiny):
    ids = list(range(100))
    router = Router([PrefixCachingBackend(tiny, 16, 16) for _ in range(2)], "kv_aware")
    router.dry_run(ids)
    assert router.cached_tokens(ids) == [96, 0] and router.cached_tokens(ids, salt="b") == [0, 0]


def both_routers(tiny, policy, ids, cached, load, calls, computed, P=16):
    """lab.fleet's Router and the server's Fleet (lab/serve/fleet.py) of len(cached) workers, where worker w
    holds the first cached[w] tokens of `ids` named, has load[w] pages in flight, and took calls[w] requests
    computing computed[w] tokens: the Router's engines really hold the pages (a dry run of those tokens), the
    Fleet's workers stand in for engine processes (their KV events' digests, one request in flight)."""
    router = Router([PrefixCachingBackend(tiny, 16, P) for _ in cached], policy)
    for e, c in zip(router.engines, cached, strict=True):
        if c:
            e.dry_run(ids[:c + 1])                              # names its c // P full pages
    router.load, router.calls, router.computed = list(load), list(calls), list(computed)
    digests = [d for d, _, _ in page_keys(ids, P, ("fake",))]
    workers = [SimpleNamespace(name="m", config=None, tokenizer=None, num_pages=16, page_size=P,
                               engine=SimpleNamespace(extra=("fake",)), named=set(digests[:c // P]),
                               in_flight=lambda n=n: [n * P] if n else []) for c, n in zip(cached, load, strict=True)]
    fleet = Fleet(workers, policy)
    fleet.routed, fleet.computed = list(calls), list(computed)
    assert router.cached_tokens(ids) == fleet.cached_tokens(ids) == cached
    return router, fleet


# T = 100, pages of 16: a worker holding 96 tokens computes 1 page, one holding 32 computes 5, an empty one 7
@pytest.mark.parametrize("policy, cached, load, calls, computed, want", [
    ("round_robin", [96, 0, 0], [0, 0, 0], [2, 1, 1], [0, 0, 0], 1),        # the 5th request: 4 mod 3
    ("least_loaded", [0, 0, 0], [0, 0, 0], [0, 0, 0], [0, 0, 0], 0),        # all equal: the lowest index
    ("least_loaded", [96, 0, 0], [7, 0, 0], [0, 3, 0], [0, 50, 50], 1),     # load, computed tie: lowest index
    ("least_loaded", [0, 0, 0], [7, 0, 0], [0, 0, 0], [0, 50, 20], 2),      # load tie: fewer tokens computed
    ("kv_aware", [96, 0, 0], [0, 0, 0], [5, 0, 0], [900, 0, 0], 0),         # the hit: 1 + 0 + 7 against 7 + 0 + 7
    ("kv_aware", [96, 0, 0], [7, 0, 0], [0, 0, 0], [0, 50, 20], 2),         # 15, 14, 14: fewer tokens computed
    ("kv_aware", [96, 32, 0], [4, 0, 0], [0, 0, 0], [0, 0, 0], 1),          # 12, 12, 14: the lower load
])
def test_both_routers_choose_as_documented(tiny, policy, cached, load, calls, computed, want):
    ids = random_tokens(random.Random(7), 100, 320)
    router, fleet = both_routers(tiny, policy, ids, cached, load, calls, computed)
    assert router.states(ids) == fleet.states(ids)
    assert router.route(ids) == fleet.route(ids) == choose(policy, router.states(ids)) == want


@pytest.mark.parametrize("policy", POLICIES)
def test_both_routers_make_the_same_choice_for_the_same_states(tiny, policy):
    """Random states of 3 workers drawn from few values, so that most tie somewhere: the same worker."""
    rng = random.Random(POLICIES.index(policy))
    ids = random_tokens(rng, 100, 320)
    for _ in range(40):
        draw = [[rng.choice(values) for _ in range(3)] for values in ((0, 32, 96), (0, 4, 7), (0, 1, 2), (0, 50))]
        router, fleet = both_routers(tiny, policy, ids, *draw)
        assert router.states(ids) == fleet.states(ids), draw
        assert router.route(ids) == fleet.route(ids) == choose(policy, fleet.states(ids)), draw


@pytest.mark.parametrize("workers", [1, 2, 4, 8])
def test_round_robin_on_a_repeated_prompt_misses_once_per_worker(tiny, workers):
    """R copies of one prompt of T tokens: each worker computes it once, then takes c = P * ((T-1) // P)
    tokens from its pages: hit rate (R - N) * c / (R * T), which falls like (R - N) / R."""
    R, T, P = 32, 200, 16
    prompt = random_tokens(random.Random(1), T, 320)
    s = simulate([prompt] * R, workers, "round_robin", 16, P, model=tiny)
    c = P * ((T - 1) // P)
    assert s["hit_rate"] == pytest.approx((R - workers) * c / (R * T), abs=1e-12)
    assert [p["calls"] for p in s["per_worker"]] == [R // workers] * workers


def test_kv_aware_beats_round_robin_on_tenants_and_keeps_the_single_pool_hit_rate(tiny):
    """8 system prompts (Zipf) × 300 requests, 4 workers of 200 pages. Round robin copies every prompt to
    every worker, so each pool holds the pages of all eight and evicts; kv_aware keeps a prompt where it is
    cached unless load outweighs it. Against one worker of the same pool: each worker of the fleet sees a
    subsequence of the trace, so a page reused within a distance LRU keeps on one pool is, to a first
    approximation (LRU is a stack algorithm), kept too on the worker it went to; what a fleet loses is the
    first use of a shared page on every further worker it is copied to: at most (N - 1) × the shared
    tokens (the eight system prompts), over the trace's tokens."""
    trace = shared_system_prompts(320, scale=1.0)
    rr, kv = (simulate(trace, 4, p, 200, model=tiny) for p in ("round_robin", "kv_aware"))
    one = simulate(trace, 1, "round_robin", 200, model=tiny)
    groups = {}                                                  # requests by their first 500 ids
    for ids in trace:
        groups.setdefault(tuple(ids[:500]), []).append(ids)
    shared = sum(min(common_prefix(g[0], ids) for ids in g) for g in groups.values())  # the 8 prompts
    bound = 3 * shared / sum(map(len, trace))
    assert len(groups) == 8 and kv["hit_rate"] > rr["hit_rate"]
    assert kv["hit_rate"] >= one["hit_rate"] - bound, (kv["hit_rate"], one["hit_rate"], bound)


@pytest.mark.parametrize("policy", POLICIES)
def test_totals_are_the_sums_over_the_workers(tiny, policy):
    trace = shared_system_prompts(320, scale=0.3, seed=4)
    s = simulate(trace, 3, policy, 120, model=tiny)
    for key in ("calls", "cached_tokens", "computed_tokens", "evicted_pages"):
        assert s[key] == sum(p[key] for p in s["per_worker"]), key
    assert s["calls"] == len(trace) and s["cached_tokens"] + s["computed_tokens"] == sum(map(len, trace))
    assert sum(p["tokens"] for p in s["per_worker"]) == sum(map(len, trace))
    computed = [p["computed_tokens"] for p in s["per_worker"]]
    assert s["imbalance"] == pytest.approx(max(computed) / (sum(computed) / 3))


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("pages", [110, 400])                  # evicting, and not
def test_a_fleet_of_one_is_one_backend(tiny, policy, pages):
    trace = shared_system_prompts(320, scale=0.3, seed=5)
    s = simulate(trace, 1, policy, pages, model=tiny)
    want = hit_rate(tiny, trace, pages)                          # one PrefixCachingBackend, dry, by hand
    for key in ("calls", "cached_tokens", "computed_tokens", "evicted_pages", "hit_rate"):
        assert s[key] == want[key], key


def test_least_loaded_balances(tiny):
    same = [random_tokens(random.Random(2), 300, 320)] * 30     # identical requests
    rr, ll = (simulate(same, 4, p, 32, model=tiny) for p in ("round_robin", "least_loaded"))
    assert ll["imbalance"] <= rr["imbalance"]
    rng = random.Random(3)                                       # long, short, long, short ... on 2 workers
    mixed = [random_tokens(rng, 400 if i % 2 == 0 else 20, 320) for i in range(40)]
    rr, ll = (simulate(mixed, 2, p, 32, model=tiny) for p in ("round_robin", "least_loaded"))
    assert rr["imbalance"] > 1.8 and ll["imbalance"] < 1.1      # round robin sends every long one to worker 0


def test_errors_are_typed(tiny):
    engines = [PrefixCachingBackend(tiny, 8)]
    with pytest.raises(FleetError, match="unknown policy"):
        Router(engines, "random")
    with pytest.raises(FleetError, match="non-empty"):
        Router([], "round_robin")
    with pytest.raises(FleetError, match="PrefixCachingBackend"):
        Router([RecomputeBackend(tiny)], "kv_aware")
    with pytest.raises(FleetError, match="window"):
        Router(engines, "least_loaded", window=-1)
    with pytest.raises(FleetError, match="overlap_weight"):
        Router(engines, "kv_aware", overlap_weight=float("nan"))
    with pytest.raises(InputError):                              # ids the model cannot take, before routing
        Router(engines, "kv_aware").next_logits([1, 2, 320])
    with pytest.raises(FleetError, match="unknown policy"):
        simulate([[1, 2]], 2, "kv-aware", 8, model=tiny)
    for workers in (0, -1, True, 2.0):
        with pytest.raises(FleetError, match="workers"):
            simulate([[1, 2]], workers, "round_robin", 8, model=tiny)
    with pytest.raises(FleetError, match="pages_per_worker"):
        simulate([[1, 2]], 2, "round_robin", 0, model=tiny)
    for trace, match in [("1 2 3", "list of requests"), ([[1, 2], []], "request 1"), ([[1, 320]], "320"),
                         ([[1, 2.0]], "2.0"), ([[True]], "True"), ([[0] * 129], "129 tokens")]:
        with pytest.raises(FleetError, match=match):
            simulate(trace, 2, "kv_aware", 8, model=tiny)
