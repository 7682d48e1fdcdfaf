"""`python -m lab.serve --workers N --router POLICY`: several engine processes behind one router (lab/serve/fleet.py).

Oracles: the same prompt ids through one fresh ServingEngine's `generate` (tokens equal, no tolerance:
where a request goes must not change what it answers); the engines' own counts of prompt tokens taken from
cache (the router's prediction of a worker's hit must equal the hit that worker then takes); the block
manager's own `cached(key)` for the pages the KV events say are named; Dynamo's cost computed by hand. Two
workers are started once for the module, the policy switched between tests (each test uses prompts of its
own, so the pages earlier tests left named never decide a route); one slow test runs `python -m lab.serve`
with two workers as a process and kills one of them.
"""

import http.client
import json
import random
import signal
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import psutil
import pytest
from servers import call, health, serve_process, serving

from lab.engine import ServingEngine
from lab.engine.hashing import page_keys
from lab.fleet import POLICIES
from lab.models import load
from lab.serve import EngineClient, EngineProcess, Fleet, cli
from lab.serve.engine_loop import KVEvents

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py
NUM_PAGES, PAGE_SIZE = 128, 16                      # per worker: 2,048 positions, tiny-llama's all


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def fleet():
    """Two engine processes of tiny-llama behind one Fleet, served by uvicorn in a thread: (port, fleet)."""
    fleet = Fleet([EngineClient(EngineProcess("tiny-llama", NUM_PAGES, PAGE_SIZE, max_batch_tokens=64, threads=1))
                   for _ in range(2)])
    fleet.start()
    try:
        with serving(fleet) as (port, _):
            yield port, fleet
    finally:
        fleet.stop()
    assert not any(w.engine.process.is_alive() for w in fleet.workers)


@pytest.fixture
def use(fleet):
    """use(policy): the module's fleet routes by `policy`, idle, for this test."""
    def switch(policy):
        wait_idle(fleet[1])
        fleet[1].policy = policy
        return fleet
    yield switch
    fleet[1].policy = "round_robin"


def prompts(lengths, seed, vocab=320) -> list[list]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def complete(port, ids, n) -> list:
    status, body = call(port, "/v1/completions", dict(prompt=ids, max_tokens=n, return_token_ids=True))
    assert status == 200, body
    return body["choices"][0]["token_ids"]


def streamed(port, ids, n) -> list:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = dict(prompt=ids, max_tokens=n, return_token_ids=True, stream=True)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    events = [e[6:] for e in conn.getresponse().read().decode().split("\n\n") if e]
    conn.close()
    assert events[-1] == "[DONE]", events[-2:]
    return [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]


def wait_idle(fleet, timeout=30) -> list[dict]:
    """Every worker's engine snapshot, once none has a request in flight."""
    deadline = time.monotonic() + timeout
    while True:
        snaps = [w.snapshot() for w in fleet.workers]
        if not any(s["in_flight"] for s in snaps):
            return snaps
        assert time.monotonic() < deadline, f"the workers did not go idle: {snaps}"
        time.sleep(0.01)


def served_by(fleet, send) -> tuple[int, int]:
    """(the worker that took the one request `send()` sends, the prompt tokens it took from cache)."""
    routed, before = list(fleet.routed), wait_idle(fleet)
    send()
    after = wait_idle(fleet)
    (w,) = [i for i in range(len(routed)) if fleet.routed[i] != routed[i]]
    return w, after[w]["cached_tokens"] - before[w]["cached_tokens"]


def turn_to(fleet, port, w):
    """Round robin's turn moved to worker `w`: short requests of their own sent until it is (the k-th request
    routed goes to worker k mod N), each to another worker than `w`."""
    while sum(fleet.routed) % len(fleet.workers) != w:
        complete(port, prompts([5], seed=sum(fleet.routed))[0], 1)


# ---- answers ----
@pytest.mark.parametrize("policy", POLICIES)
def test_every_router_answers_what_one_engine_computes(use, tiny, policy):
    """Concurrent requests, some sharing a prefix, streamed and not: the tokens of one engine alone."""
    port, fleet = use(policy)
    seed = 10 * POLICIES.index(policy)
    shared = prompts([40], seed=seed)[0]
    ps = prompts([5, 33, 17], seed=seed + 1) + [shared + p for p in prompts([3, 20], seed=seed + 2)]
    n = [6, 9, 4, 8, 7]
    routed = list(fleet.routed)
    with ThreadPoolExecutor(len(ps)) as pool:
        answers = list(pool.map(lambda i: complete(port, ps[i], n[i]), range(len(ps))))
    want = ServingEngine(tiny, NUM_PAGES, PAGE_SIZE).generate(ps, n)
    assert answers == want
    assert streamed(port, ps[3], n[3]) == want[3]
    assert sum(fleet.routed) - sum(routed) == len(ps) + 1
    if policy == "round_robin":                                   # 6 requests in turn: 3 each
        assert [a - b for a, b in zip(fleet.routed, routed, strict=True)] == [3, 3]
    snaps = wait_idle(fleet)
    assert [s["free_pages"] for s in snaps] == [{"full": NUM_PAGES}] * 2


def test_models_health_and_fleet(fleet):
    port, f = fleet
    assert call(port, "/health", method="GET") == (200, {"status": "ok"})
    status, body = call(port, "/v1/models", method="GET")
    assert status == 200 and [m["id"] for m in body["data"]] == ["tiny-llama"]
    status, body = call(port, "/fleet", method="GET")
    assert status == 200 and body["router"] == f.policy and len(body["workers"]) == 2
    assert [w["routed"] for w in body["workers"]] == f.routed and all(w["alive"] for w in body["workers"])
    assert {"in_flight", "cached_tokens", "computed_tokens", "named_pages"} <= set(body["workers"][0])


# ---- where requests go ----
def test_kv_aware_sends_a_shared_prefix_to_the_worker_that_holds_it(use):
    """The first request is put on worker 1 (round robin's turn); a second sharing its 64-token prefix goes
    to worker 1 under kv_aware and takes the 64 tokens from cache, as the router predicted. Under round robin
    the next request sharing it goes where the turn says."""
    port, fleet = use("round_robin")
    prefix = prompts([64], seed=21)[0]
    first, second, third = [prefix + p for p in prompts([10, 12, 9], seed=22)]
    turn_to(fleet, port, 1)
    assert served_by(fleet, lambda: complete(port, first, 4)) == (1, 0)
    fleet.policy = "kv_aware"
    assert fleet.cached_tokens(second) == [0, 64]
    assert served_by(fleet, lambda: complete(port, second, 4)) == (1, 64)
    fleet.policy = "round_robin"
    turn_to(fleet, port, 0)
    assert served_by(fleet, lambda: complete(port, third, 4)) == (0, 0)    # computed again on worker 0


def test_kv_aware_weighs_the_hit_against_the_load(use):
    """A worker holding the prefix but busy loses to an idle one when the weight is low: Dynamo's cost.
    Round robin puts the prefix and the busy stream on worker 0, then kv_aware routes."""
    port, fleet = use("round_robin")
    prefix = prompts([32], seed=31)[0]
    warm, busy, probe = prompts([8, 10, 6], seed=32)
    turn_to(fleet, port, 0)
    assert served_by(fleet, lambda: complete(port, prefix + warm, 2))[0] == 0
    turn_to(fleet, port, 0)
    conn = open_stream(port, busy, 500)
    fleet.policy = "kv_aware"
    try:
        assert fleet.workers[0].in_flight() == [len(busy)] and fleet.workers[1].in_flight() == []
        assert fleet.cached_tokens(prefix + probe) == [32, 0]
        # T = 38: worker 0 computes 1 page and holds 1; worker 1 computes 3 pages; both add 3
        assert fleet.costs(prefix + probe) == [1 + 1 + 3, 3 + 0 + 3]
        assert fleet.route(prefix + probe) == 0
        fleet.overlap_weight = 0.0                                # load alone: the idle worker
        assert fleet.route(prefix + probe) == 1
    finally:
        fleet.overlap_weight = 1.0
        leave(conn)


def test_least_loaded_balances_requests_in_flight(use):
    """Four streams opened one after another, each still running: two per worker. Leaving cancels them on
    the workers that hold them (a fleet id names its worker): every page comes back."""
    port, fleet = use("least_loaded")
    routed = list(fleet.routed)
    conns = [open_stream(port, p, 500) for p in prompts([8, 9, 10, 11], seed=41)]
    assert [len(w.in_flight()) for w in fleet.workers] == [2, 2]
    assert [a - b for a, b in zip(fleet.routed, routed, strict=True)] == [2, 2]
    for conn in conns:
        leave(conn)
    assert [s["free_pages"] for s in wait_idle(fleet)] == [{"full": NUM_PAGES}] * 2


def test_the_router_knows_the_pages_each_worker_holds_after_evictions(use):
    """Five prompts of 500 tokens, 31 pages named each, overflow a worker's 128 pages (evictions): the
    router's set of named digests has the engine's count of named pages, and for every prompt sent, old and
    new, the tokens the router predicts cached are the tokens the engine then takes from cache. Round robin
    sends each to worker 0 (turn_to: the requests that move the turn go to worker 1)."""
    port, fleet = use("round_robin")
    ps = prompts([500] * 5, seed=51)
    for p in ps:
        turn_to(fleet, port, 0)
        complete(port, p, 2)
    snaps = wait_idle(fleet)
    assert snaps[0]["evicted_pages"] > 0
    assert [len(w.named) for w in fleet.workers] == [s["named_pages"] for s in snaps]
    for p in ps[::-1] + [ps[0][:200] + prompts([50], seed=52)[0]]:
        turn_to(fleet, port, 0)
        predicted = fleet.cached_tokens(p)[0]
        assert served_by(fleet, lambda p=p: complete(port, p, 2)) == (0, predicted)


# ---- the KV events, in one process ----
def test_kv_events_add_up_to_the_pages_a_manager_holds_named(tiny):
    """A pool of 12 pages, prompts sharing prefixes and evicting each other: after every step, the set the
    events build holds exactly the digests `manager.cached(key)` finds, for every page of every prompt."""
    engine = ServingEngine(tiny, 12, PAGE_SIZE, max_batch_tokens=48)
    events, named = KVEvents(engine.manager), set()
    base = prompts([50], seed=61)[0]
    ps = [base + p for p in prompts([20, 30, 5], seed=62)] + prompts([70, 40, 90], seed=63)
    keys = [k for p in ps for k in page_keys(p + [0] * 16, PAGE_SIZE, engine.extra)]
    for p in ps:
        rid = engine.add_request(p, 3)
        while not engine.requests[rid].done:
            engine.step()
            for event, digest in events.take():
                (named.add if event == "stored" else named.discard)(digest)
            assert named == {k[0] for k in keys if engine.manager.manager("full").cached(k) is not None}
    assert engine.stats["evicted_pages"] > 0 and engine.stats["cached_tokens"] > 0


def test_a_worker_of_another_identity_never_counts_as_a_hit():
    """Dynamo's cost by hand, and keys chained from each worker's own identity: pages named under another
    one are not this request's, however equal the tokens."""
    ids = prompts([40], seed=71)[0]
    mine = [d for d, _, _ in page_keys(ids[:32], PAGE_SIZE, ("mine",))]

    def worker(extra, flying=()):
        return SimpleNamespace(name="m", config=None, tokenizer=None, num_pages=64, page_size=PAGE_SIZE,
                               engine=SimpleNamespace(extra=extra), named=set(mine), in_flight=lambda: list(flying))

    fleet = Fleet([worker(("mine",), flying=[100]), worker(("theirs",)), worker(None)], "kv_aware")
    assert fleet.cached_tokens(ids) == [32, 0, 0]          # at most (40 - 1) // 16 pages: one token is run
    # T = 40: prefill pages ceil((40 - cached) / 16), active pages ceil(100 / 16) = 7, the request's own 3
    assert fleet.costs(ids) == [1 + 7 + 3, 3 + 0 + 3, 3 + 0 + 3]
    assert fleet.route(ids) == 1                            # ties: the lower load, fewer computed, lower index
    fleet.overlap_weight = 5.0
    assert fleet.costs(ids) == [5 + 7 + 3, 15 + 0 + 3, 15 + 0 + 3] and fleet.route(ids) == 0


# ---- the command line ----
@pytest.mark.parametrize("args,words", [
    (["--workers", "0"], "--workers: the number of engine processes is an int of at least 1, got '0'"),
    (["--workers", "-1"], "at least 1, got '-1'"),
    (["--workers", "two"], "at least 1, got 'two'"),
    (["--router", "random"], "--router: invalid choice: 'random'"),
    (["--router-overlap-weight", "-1"], "finite number >= 0"),
    (["--workers", "2", "--one-process"], "--one-process runs one engine"),
])
def test_bad_flags_are_refused_with_a_clear_message(capsys, args, words):
    with pytest.raises(SystemExit) as exit:
        cli.main(["--model", "tiny-llama", *args])
    assert exit.value.code == 2 and words in capsys.readouterr().err


class Built(Exception):
    pass


def test_one_worker_is_the_single_engine_server_and_more_are_a_fleet(monkeypatch):
    """--workers 1 (the default) gives the app the EngineClient of one EngineProcess, as before the flag;
    --workers 3 a Fleet of three with the router and weight asked for. Nothing is started."""
    clients = []

    def built(client, **kwargs):
        clients.append(client)
        raise Built

    monkeypatch.setattr(cli, "create_app", built)
    for args in ([], ["--workers", "1", "--router", "kv_aware"],
                 ["--workers", "3", "--router", "least_loaded", "--router-overlap-weight", "2.5"]):
        with pytest.raises(Built):
            cli.main(["--model", "tiny-llama", "--num-pages", "32", *args])
    one, also_one, three = clients
    assert type(three) is Fleet and (three.policy, three.overlap_weight) == ("least_loaded", 2.5)
    assert len(three.workers) == 3 and all(w.num_pages == 32 for w in three.workers)
    for w in [one, also_one, *three.workers]:
        assert type(w) is EngineClient and type(w.engine) is EngineProcess and not w.engine.process.is_alive()


@pytest.mark.slow                                    # 14 s on the 2-core machine: a server and two engines start
def test_a_dead_worker_fails_its_own_stream_and_the_server_exits_1():
    """`python -m lab.serve --workers 2 --router kv_aware`: it answers, /fleet counts; a stream on each
    worker (kv_aware spreads them by load), then one worker's process is killed: its stream ends with an
    error event, the other's with all its tokens, and the server exits 1 for its supervisor."""
    flags = ("--model", "tiny-llama", "--threads", "1", "--num-pages", "64", "--workers", "2", "--router",
             "kv_aware")
    with serve_process(*flags) as (proc, port):
        assert complete(port, [1, 2, 3], 3) == complete(port, [1, 2, 3], 3)
        assert call(port, "/fleet", method="GET")[1]["router"] == "kv_aware"
        a, b = open_stream(port, [5, 6, 7], 300), open_stream(port, [8, 9], 300)
        assert [w["in_flight"] for w in call(port, "/fleet", method="GET")[1]["workers"]] == [1, 1]
        engines = [c for c in psutil.Process(proc.pid).children() if "spawn_main" in " ".join(c.cmdline())]
        assert len(engines) == 2
        engines[0].send_signal(signal.SIGKILL)
        ends = sorted([rest(a), rest(b)], key=len)
        assert "engine's process ended" in json.loads(ends[0][-2][6:])["error"]["message"], ends[0][-2:]
        assert len(ends[1]) == 299 + 1 and json.loads(ends[1][-2][6:])["choices"][0]["finish_reason"] == "length"
        assert proc.wait(30) == 1 and health(port) is None
        assert "the engine's process ended (exit code -9): stopping the server" in proc.stdout.read()


# ---- streams held open ----
def open_stream(port, ids, n) -> http.client.HTTPResponse:
    """A streamed request read until its first token: in flight on its worker until read or left."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = dict(prompt=ids, max_tokens=n, stream=True)
    conn.request("POST", "/v1/completions", body=json.dumps(body), headers={"Content-Type": "application/json"})
    resp = conn.getresponse()
    resp.readline()
    resp.readline()
    resp.conn = conn
    return resp


def rest(resp) -> list[str]:
    """The events a stream opened with open_stream still sends, "[DONE]" last."""
    out = [e for e in resp.read().decode().split("\n\n") if e]
    resp.conn.close()
    return out


def leave(resp):
    resp.conn.sock.shutdown(socket.SHUT_RDWR)
    resp.conn.close()


def test_workers_that_time_their_fused_step_start_one_after_the_other():
    """Two workers timing their fused step at once on the same cores would each time the other's work too: with
    fast_decode="measure" each waits for the last to be ready before it launches; otherwise they load at once."""
    def worker(i, fast_decode, log):
        engine = SimpleNamespace(fast_decode=fast_decode, launch=lambda: log.append(f"launch {i}"),
                                 wait_ready=lambda timeout_s: log.append(f"ready {i}"))
        return SimpleNamespace(name="m", config=None, tokenizer=None, num_pages=64, page_size=PAGE_SIZE,
                               engine=engine, stop=lambda: None)

    for fast_decode, want in (("measure", ["launch 0", "ready 0", "launch 1", "ready 1"]),
                              (True, ["launch 0", "launch 1", "ready 0", "ready 1"])):
        log = []
        Fleet([worker(0, fast_decode, log), worker(1, fast_decode, log)]).start()
        assert log == want
