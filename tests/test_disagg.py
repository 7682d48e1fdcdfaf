"""Prefill apart from decode (lab/engine/disagg.py): a prompt's pages handed from a PrefillEngine to a DecodeEngine
as a PageSet, checked on arrival, and decoded there.

Oracle: greedy decoding by the plain forward over the whole sequence at every step (recomputation, no cache),
which shares no pages, no engine and no hand-off with the code under test. Tolerance: none, the tokens must be
equal. The engines' logits differ from the oracle's only by float32 summation order (paged attention, other
matrix shapes): about 1e-6 on the tiny models (tests/test_paged.py bounds it by 1e-5). That can flip an argmax
only where the top two logits are closer than that, so the oracle also returns its smallest top-two gap and
every test asserts it is above GAP = 1e-4, ten times the bound: an inequality is then a bug, never rounding.
Refusals are checked by what they leave: the engine's free pages, named pages, sequences, requests and stats
exactly as before.
"""

import copy
import random
import time

import pytest
import torch

from lab.cache import CacheInputError, CacheMismatchError, OutOfPagesError
from lab.disagg_cost import colocated, measure, summarize
from lab.engine import ServingEngine
from lab.engine.disagg import (
    DecodeEngine,
    HandoffError,
    PageSet,
    PrefillEngine,
    WorkerError,
    prefill,
)
from lab.models import forward, load, random_model
from lab.models.retrofit import local_layers, share_kv
from lab.serve.disagg import Disaggregated

GAP = 1e-4            # 10 x the 1e-5 bound on tiny-model logit differences between a paged engine and forward
pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
_oracles = {}


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def tiny_gpt2():
    return load("tiny-gpt2")


def prompts(lengths, seed=0) -> list[list]:
    rng = random.Random(seed)
    return [[rng.randrange(320) for _ in range(n)] for n in lengths]


def recomputed(model, prompt, n) -> list:
    """Greedy tokens by the uncached forward; fails (naming the prompt) on a near tie."""
    key = (model.name, model.manifest, tuple(prompt), n)
    if key not in _oracles:
        ids, gap = list(prompt), float("inf")
        with torch.inference_mode():
            for _ in range(n):
                logits = forward(torch.tensor([ids]), model.weights, model.config)[0, -1]   # [V]
                top = logits.topk(2).values
                gap = min(gap, float(top[0] - top[1]))
                ids.append(int(logits.argmax()))
        _oracles[key] = ids[len(prompt):], gap
    tokens, gap = _oracles[key]
    assert gap > GAP, f"prompt of {len(prompt)} tokens has a near tie (top-two gap {gap:.2e}): pick another seed"
    return tokens


def finish(engine, rids) -> list:
    """Step until the requests `rids` are done; their outputs."""
    while not all(engine.requests[r].done for r in rids):
        engine.step()
    return [engine.output(r) for r in rids]


def snapshot(engine) -> dict:
    """Everything a refused hand-off must leave as it was."""
    m = engine.manager
    return dict(free=m.num_free, named=m.manager("full").named_tokens(), seqs=m.sequences(),
                requests=dict(engine.requests),
                running=list(engine.running), waiting=list(engine.waiting), stats=copy.deepcopy(engine.stats),
                tables={s: m.block_table(s) for s in m.sequences()})


# ---- token for token across the hand-off ----
@pytest.mark.parametrize("name,page_size", [("tiny-llama", 16), ("tiny-gpt2", 4)])
def test_handoff_decodes_like_recomputation(tiny, tiny_gpt2, name, page_size):
    """Prompts of 1 token, shorter than a page, exactly a page, one past it and several pages and a part, prefilled
    in chunks of 8 tokens, handed over through bytes and decoded together: the oracle's tokens, first to last."""
    model = {"tiny-llama": tiny, "tiny-gpt2": tiny_gpt2}[name]
    ps_in = prompts([1, 5, page_size, page_size + 1, 2 * page_size + 7, 40], seed=3)
    new = 6
    pe = PrefillEngine(model, 64, page_size, max_batch_tokens=8)          # 40 tokens: 5 chunks
    de = DecodeEngine(model, 64, page_size)
    sets = [prefill(pe, p) for p in ps_in]
    assert [s.first_token for s in sets] == [recomputed(model, p, new)[0] for p in ps_in]
    rids = [de.add_prefilled(PageSet.from_bytes(s.to_bytes()), new) for s in sets]
    assert all(de.requests[r].state == "running" and len(de.output(r)) == 1 for r in rids)
    assert finish(de, rids) == [recomputed(model, p, new) for p in ps_in]
    assert ServingEngine(model, 64, page_size).generate(ps_in, new) == finish(de, rids)   # co-located: the same
    assert not de.running and de.manager.num_free == de.manager.num_pages       # every page back
    de.manager.check()
    assert de.stats["handoffs"] == len(ps_in) and de.stats["handoff_bytes"] == sum(s.nbytes() for s in sets)
    assert all(r["handed_off"] == r["first_token"] and r["chunks"] == [] for r in de.timeline())


def test_pageset_round_trip_is_exact_and_repeatable(tiny):
    """to_bytes / from_bytes gives the same PageSet; nbytes is what moves; two prefills of a prompt on fresh engines
    give the same bytes (the last page's positions past the prompt are zeros, not a stale page's)."""
    p = prompts([21])[0]
    ps = prefill(PrefillEngine(tiny, 8, 16), p)
    data = ps.to_bytes()
    assert PageSet.from_bytes(data) == ps and PageSet.from_bytes(bytearray(data)) == ps
    assert ps.nbytes() == len(data)
    layers, heads, dim = tiny.config.kv_layout
    assert len(ps.k) == len(ps.v) == 2 * layers * 16 * heads * dim * 4      # 2 pages, float32
    k, v = ps.tensors()                                                     # [pages, layers, P, H_kv, D]
    assert k.shape == (2, layers, 16, heads, dim) and (k[1, :, 5:] == 0).all() and (v[1, :, 5:] == 0).all()
    assert k[1, :, :5].abs().sum() > 0
    assert prefill(tiny, p).to_bytes() == data                              # a model: an engine built for it
    assert len(ps.names) == 1 and ps.names[0][2] == p[:16]
    assert "21 prompt tokens" in repr(ps) and len(repr(ps)) < 120


@pytest.mark.parametrize("data", [b"", b"not a page set", "truncated", "header"])
def test_unreadable_bytes_are_refused(tiny, data):
    good = prefill(tiny, prompts([7])[0]).to_bytes()
    if data == "truncated":
        data = good[:-1]
    elif data == "header":
        data = bytearray(good)
        data[30] ^= 0xFF                                                    # inside the JSON header
    with pytest.raises(HandoffError) as e:
        PageSet.from_bytes(data)
    assert e.value.fields == ("format",)


# ---- refusals: nothing changes ----
def refused(tiny, case) -> tuple[PageSet, set]:
    """A PageSet the tiny-llama DecodeEngine of page_size 16 must refuse, and the fields it must name."""
    p = prompts([20], seed=5)[0]
    if case == "weights":
        return prefill(random_model(tiny.config, seed=1), p), {"identity.manifest"}
    if case == "dtype":
        return prefill(tiny.to(dtype=torch.bfloat16), p), {"dtype", "identity.compute_dtype", "identity.cache_dtype"}
    if case == "page_size":
        return prefill(tiny, p, page_size=8), {"page_size"}
    if case == "model":
        return prefill(load("tiny-mqa"), p), {"model", "layout", "identity.manifest"}
    data = bytearray(prefill(tiny, p).to_bytes())
    data[-3] ^= 1                                                           # one bit of the last value
    return PageSet.from_bytes(bytes(data)), {"sha256"}


@pytest.mark.parametrize("case", ["weights", "dtype", "page_size", "model", "checksum"])
def test_refused_handoff_leaves_the_engine_unchanged(tiny, case):
    """Another model's weights, another dtype, another page size, another model, a flipped bit: HandoffError (a
    CacheMismatchError) naming what differs, raised while another request decodes, which then finishes unharmed."""
    de = DecodeEngine(tiny, 16, 16)
    good = prompts([30], seed=6)[0]
    rid = de.add_prefilled(prefill(tiny, good), 5)
    de.step()
    before = snapshot(de)
    bad, fields = refused(tiny, case)
    with pytest.raises(HandoffError) as e:
        de.add_prefilled(bad, 5)
    assert isinstance(e.value, CacheMismatchError)
    assert fields <= set(e.value.fields), e.value.fields
    assert all(f in str(e.value) for f in fields)
    assert snapshot(de) == before
    assert finish(de, [rid]) == [recomputed(tiny, good, 5)]


def test_out_of_pages_leaves_the_engine_unchanged(tiny):
    """A page set that does not fit the free pages now (one kept free per running request) raises OutOfPagesError;
    the cached pages its prefix took first go back, still named."""
    de = DecodeEngine(tiny, 5, 4)
    a, b = prompts([9, 11], seed=8)
    first = prefill(tiny, a, page_size=4)
    finish(de, [de.add_prefilled(first, 2)])
    rid = de.add_prefilled(prefill(tiny, b, page_size=4), 4)
    before = snapshot(de)                     # b holds 3 of 5 pages; a's 2 full pages are cached, free
    with pytest.raises(OutOfPagesError):
        de.add_prefilled(first, 3)            # takes a's 2 cached pages, needs 1 more, 0 left after the headroom
    assert snapshot(de) == before and de.manager.cached_pages() == 4
    assert finish(de, [rid]) == [recomputed(tiny, b, 4)]


# ---- prefix caching and the edges ----
def test_handed_off_pages_are_named_for_prefix_caching(tiny):
    """The full pages of a handed-off prompt are named: the same prompt added to the decode engine takes them
    (cached_tokens), and the same page set handed off again takes them instead of writing them."""
    p = prompts([40], seed=2)[0]                                              # 2 full pages of 16 and 8 positions
    de = DecodeEngine(tiny, 16, 16)
    ps = prefill(tiny, p)
    finish(de, [de.add_prefilled(ps, 4)])
    assert all(de.manager.manager("full").cached(key) is not None for key in ps.names) and len(ps.names) == 2
    rid = de.add_request(p, 4)
    assert finish(de, [rid]) == [recomputed(tiny, p, 4)]
    assert de.requests[rid].cached_tokens == 32 == de.stats["cached_tokens"]  # (40 - 1) // 16 pages
    again = de.add_prefilled(ps, 4)
    assert de.requests[again].cached_tokens == 32                             # every full page taken
    assert finish(de, [again]) == [recomputed(tiny, p, 4)]


def test_prefill_engine_reuses_its_cached_prefix(tiny):
    """A prompt prefilled twice on one PrefillEngine: the second computes only the last token, and exports the
    cached pages' bytes as they are and the last token's keys and values to float32 rounding (1e-5: computed as
    one row instead of inside a 33-row matmul, so summed in another order; tests/test_paged.py's bound)."""
    pe = PrefillEngine(tiny, 8, 16)
    p = prompts([33], seed=4)[0]
    ps = prefill(pe, p)
    computed = pe.stats["computed_tokens"]
    again = prefill(pe, p)
    assert again.names == ps.names and again.first_token == ps.first_token
    (k, v), (k2, v2) = ps.tensors(), again.tensors()                        # [pages, layers, P, H_kv, D]
    assert torch.equal(k[:2], k2[:2]) and torch.equal(v[:2], v2[:2])        # the 2 full pages: taken, not computed
    assert torch.allclose(k, k2, rtol=0, atol=1e-5) and torch.allclose(v, v2, rtol=0, atol=1e-5)
    assert pe.stats["computed_tokens"] - computed == 1 and pe.stats["cached_tokens"] == 32
    assert pe.manager.num_free == pe.manager.num_pages and not pe.running              # handed off: nothing held


def test_shared_cache_layers_local_layers_and_radix(tiny):
    """A model whose layers share a cache (chapter 10's share_kv) hands over its cache layers only and decodes as
    recomputation does; one with local layers (a pool per group of layers), or a radix tree's one-position pages,
    is refused when the engine is built."""
    shared = share_kv(tiny, 2)                                                 # 2 layers, 1 cache layer
    p = prompts([19], seed=1)[0]
    ps = prefill(shared, p)
    assert ps.layout[0] == 1 == shared.config.kv_layout[0]
    de = DecodeEngine(shared, 8, 16)
    assert finish(de, [de.add_prefilled(ps, 5)]) == [recomputed(shared, p, 5)]
    with pytest.raises(HandoffError, match="layout"):
        de.add_prefilled(prefill(tiny, p), 5)
    local = local_layers(tiny, window=8, global_every=2)
    for engine in (PrefillEngine, DecodeEngine):
        with pytest.raises(CacheInputError, match="local layers"):
            engine(local, 8, 16)
        with pytest.raises(CacheInputError, match="radix"):
            engine(tiny, 8, 1, prefix_caching="radix")


def test_done_at_the_first_token(tiny):
    """max_new_tokens=1, or a first token that is eos: finished at once, holding no page."""
    de = DecodeEngine(tiny, 4, 16)
    ps = prefill(tiny, prompts([10])[0])
    for kwargs in (dict(max_new_tokens=1), dict(max_new_tokens=5, eos_id=ps.first_token)):
        rid = de.add_prefilled(ps, **kwargs)
        assert de.requests[rid].state == "finished" and de.output(rid) == [ps.first_token]
        assert de.manager.num_free == de.manager.num_pages and not de.running


# ---- timing: the baseline, the summary, two processes ----
def test_summarize_exact():
    timeline = [dict(ttft_s=1.0, token_s=[1.0, 2.0, 4.0], arrival_s=0.0, output_tokens=3, bytes_moved=10),
                dict(ttft_s=3.0, token_s=[4.0, 5.0], arrival_s=1.0, output_tokens=2, bytes_moved=30)]
    s = summarize(timeline)
    assert s["ttft_mean_s"] == 2.0 and s["ttft_p50_s"] == 2.0 and s["ttft_p90_s"] == pytest.approx(2.8)
    assert s["itl_mean_s"] == pytest.approx(4 / 3) and s["itl_p90_s"] == pytest.approx(1.8)  # gaps 1, 2, 1
    # sorted gaps 1, 1, 2: the median is 1; p99 interpolates between 1 and 2 at 0.99 * 2 = 1.98 ranks
    assert s["itl_p50_s"] == 1.0 and s["itl_p99_s"] == pytest.approx(1.98) and s["itl_gaps"] == 3
    assert s["tokens_per_s"] == 5 / 5.0 and s["bytes_per_request"] == 20.0      # 5 tokens from 0 s to 5 s


def test_colocated_baseline(tiny):
    """One engine, requests arriving by the wall clock: the oracle's tokens and a timeline in order."""
    ps = prompts([6, 30, 17], seed=7)
    tokens, timeline = colocated(tiny, ps, 5, [0.0, 0.002, 0.004], num_pages=16, threads=1)
    assert tokens == [recomputed(tiny, p, 5) for p in ps]
    for r, p in zip(timeline, ps, strict=True):
        assert r["prompt_tokens"] == len(p) and r["output_tokens"] == len(r["token_s"]) == 5
        assert r["arrival_s"] <= r["first_token_s"] == r["token_s"][0] and r["token_s"] == sorted(r["token_s"])
        assert r["bytes_moved"] == 0


def test_two_processes(tiny):
    """Prefill and decode in two spawned processes: the oracle's tokens, a timeline in order, the bytes of each
    PageSet; a killed worker raises WorkerError (no hang), and close() ends both. The decode worker has 4 pages:
    a page set waits in its queue until the running request ends, and is then taken although the engine is
    idle (a worker that slept until the next message there never finished)."""
    ps = prompts([5, 40, 17], seed=3)
    with Disaggregated("tiny-llama", 16, 4, page_size=16, max_batch_tokens=16, timeout_s=60) as d:
        tokens, timeline = d.generate(ps, 6, arrivals_s=[0.0, 0.005, 0.01])
        assert tokens == [recomputed(tiny, p, 6) for p in ps]
        for r, p in zip(timeline, ps, strict=True):
            assert r["arrival_s"] <= r["first_token_s"] and r["token_s"] == sorted(r["token_s"])
            assert len(r["token_s"]) == 6 and r["bytes_moved"] == prefill(tiny, p).nbytes()
        d.workers[1].process.kill()
        with pytest.raises(WorkerError, match="lab-decode"):
            d.generate(ps, 6)
    assert not any(w.process.is_alive() for w in d.workers)


@pytest.mark.slow
def test_measure_smoke():
    """Both modes over the same load; their tokens agree."""
    ps = prompts([8, 60, 20, 33], seed=9)
    out = measure("tiny-llama", ps, 8, [0.0, 0.01, 0.02, 0.03], prefill_pages=16, decode_pages=16)
    assert out["same_tokens"]
    for mode in ("disaggregated", "colocated"):
        s = out[mode]
        assert s["requests"] == 4 and s["ttft_p50_s"] <= s["ttft_p90_s"] and s["tokens_per_s"] > 0
    assert out["disaggregated"]["bytes_per_request"] > 0 == out["colocated"]["bytes_per_request"]


@pytest.mark.slow
def test_a_page_set_no_decode_worker_can_take_fails_once():
    """A prompt whose pages the decode worker's whole pool cannot hold: generate raises WorkerError naming
    the decode worker, once, and the pair still closes (the page set is dropped, not retried forever)."""
    with Disaggregated("tiny-llama", 16, 1, page_size=16, max_batch_tokens=64, timeout_s=60) as d:
        with pytest.raises(WorkerError, match="lab-decode failed: OutOfPagesError"):
            d.generate(prompts([40], seed=3), 4)
        time.sleep(1.0)                                             # a worker failing on it again would
        later = []                                                  # have said so many times by now
        while not d.inbox.empty():
            later.append(d.inbox.get()[1][0])
        assert "failed" not in later, later
    assert not any(w.process.is_alive() for w in d.workers)
