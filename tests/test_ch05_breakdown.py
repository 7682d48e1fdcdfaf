"""Where a pool's KV memory goes (chapter 5, lab.experiments.ch05_paged.serve): tokens, reserved for future
tokens, internal and external fragmentation, and free positions, counted per step for contiguous allocators
(first fit, buddy) and for pages.

Oracle: a slot-by-slot simulation written here. It keeps, for every position of the pool, its owner and
the position of the owner's sequence stored there; it places runs by scanning the slots (not a list of
holes) and pages by taking the lowest free page, and it classifies each slot by looking at it. It follows
the same admission policy (the rules in serve's docstring) and must agree with serve's running sums
exactly: every count is an integer, so the tolerance is zero.
"""

import numpy as np
import pytest

from lab import data
from lab.experiments import ch05_paged as ch05

PAGE = 4


def oracle(inputs, outputs, scheme, pool, page=PAGE, max_len=32, answer=8):
    """serve()'s counts, by brute force: every position of the pool, every step."""
    final = [int(i + o) for i, o in zip(inputs, outputs, strict=True)]
    c = [int(i) for i in inputs]
    bounds = {"contiguous_max": [max(max_len, f) for f in final],
              "contiguous_budget": [max(int(i) + answer, f) for i, f in zip(inputs, final, strict=True)]}
    if scheme == "buddy":
        size = [next(2**k for k in range(32) if 2**k >= b) for b in bounds["contiguous_budget"]]
    elif scheme != "paged":
        size = bounds[scheme]
    owner, pos = [-1] * pool, [-1] * pool            # per slot: which request, which of its positions
    pages = {}                                        # request -> its page ids, in order (paged)
    queue, live = list(range(len(final))), []
    out = dict.fromkeys(ch05.PARTS + ("steps", "live", "preemptions", *bounds), 0)
    worst_internal = 0                                # the most never-written slots one request held at once

    def need(r):
        return -(-(c[r] + 1) // page) * page if scheme == "paged" else size[r]

    def free_slots():
        return [s for s in range(pool) if owner[s] < 0]

    def release(r):
        for s in range(pool):
            if owner[s] == r:
                owner[s], pos[s] = -1, -1
        pages.pop(r, None)

    def add_page(r):
        p = next(p for p in range(pool // page) if all(owner[s] < 0 for s in range(p * page, (p + 1) * page)))
        j = len(pages.setdefault(r, []))
        pages[r].append(p)
        for k in range(page):
            owner[p * page + k], pos[p * page + k] = r, j * page + k

    while queue or live:
        if scheme == "paged":
            while True:
                grow = [r for r in live if c[r] == len(pages[r]) * page]
                if len(grow) * page <= len(free_slots()):
                    break
                victim = live.pop()
                release(victim)
                queue.insert(0, victim)
                out["preemptions"] += 1
            for r in grow:
                add_page(r)
        while queue:
            r, n = queue[0], need(queue[0])
            if scheme == "paged":
                if n > len(free_slots()):
                    break
                for _ in range(n // page):
                    add_page(r)
            else:
                step = n if scheme == "buddy" else 1
                at = next((s for s in range(0, pool - n + 1, step) if all(owner[x] < 0 for x in range(s, s + n))),
                          None)
                if at is None:
                    break
                for k in range(n):
                    owner[at + k], pos[at + k] = r, k
            live.append(queue.pop(0))
        for r in live:
            c[r] += 1
        if queue:
            free = len(free_slots())
            held_internal = dict.fromkeys(live, 0)
            for s in range(pool):
                r = owner[s]
                if r < 0:
                    out["external" if need(queue[0]) <= free else "free"] += 1
                elif pos[s] < c[r]:
                    out["tokens"] += 1
                elif pos[s] < final[r]:
                    out["future"] += 1
                else:
                    out["internal"] += 1
                    held_internal[r] += 1
            worst_internal = max([worst_internal, *held_internal.values()])
            out["steps"] += 1
            out["live"] += len(live)
            for name, b in bounds.items():
                out[name] += sum(b[r] for r in live)
        for r in [r for r in live if c[r] == final[r]]:
            release(r)
        live = [r for r in live if c[r] < final[r]]
    return out, worst_internal


def small_case(seed):
    """10 to 24 requests of at most 32 positions, on a pool of 40 to 160 positions (whole pages)."""
    rng = np.random.default_rng(seed)
    n = int(rng.integers(10, 25))
    inputs = rng.integers(1, 17, n)
    outputs = np.minimum(rng.integers(1, 17, n), 32 - inputs)
    return inputs, outputs, int(rng.integers(10, 41)) * PAGE


@pytest.mark.parametrize("scheme", ch05.SERVED)
def test_serve_agrees_with_a_slot_by_slot_simulation(scheme):
    for seed in range(12):
        inputs, outputs, pool = small_case(seed)
        want, worst = oracle(inputs, outputs, scheme, pool)
        got = ch05.serve(inputs, outputs, scheme, pool, PAGE, max_len=32, answer=8)
        assert got == want, (seed, pool)
        assert want["steps"] > 0, "the case never made a request wait: it checks nothing"
        assert sum(got[p] for p in ch05.PARTS) == pool * got["steps"]        # every position, every step
        if scheme == "paged":
            assert worst < PAGE, "a request held a page or more it will never write"
            assert got["external"] == 0


def test_the_cases_exercise_every_part_and_preemption():
    """The random cases above meet what they are meant to check: every part and a preemption."""
    totals = {s: dict.fromkeys(ch05.PARTS + ("preemptions",), 0) for s in ch05.SERVED}
    for seed in range(12):
        inputs, outputs, pool = small_case(seed)
        for s in ch05.SERVED:
            r = ch05.serve(inputs, outputs, s, pool, PAGE, max_len=32, answer=8)
            for k in totals[s]:
                totals[s][k] += r[k]
    assert totals["contiguous_budget"]["external"] > 0 and totals["buddy"]["internal"] > 0
    assert totals["paged"]["preemptions"] > 0 and totals["paged"]["internal"] > 0
    assert all(totals[s]["future"] > 0 and totals[s]["tokens"] > 0 for s in ch05.SERVED)


# ---- worked by hand: every count below is written out step by step in the comments -----------------------

def test_a_contiguous_reservation_by_hand():
    # pool 8 = one request at max_len 8. A (2 + 3 = 5 positions) runs steps 1-3 while B waits:
    # tokens 3 + 4 + 5, future 2 + 1 + 0, internal 3 per step (8 - 5); B's 3 steps later are not counted.
    got = ch05.serve(np.array([2, 1]), np.array([3, 2]), "contiguous_max", 8, max_len=8)
    assert got == dict(tokens=12, future=3, internal=9, external=0, free=0, steps=3, live=3, preemptions=0,
                       contiguous_max=24, contiguous_budget=3 * 512 + 6)


def test_external_fragmentation_by_hand():
    # answer 0: each request takes exactly its length. Pool 10: A [0, 4), B [4, 7), C [7, 10); D (5) waits.
    # Step 1: tokens 4 + 2 + 3, B's future 1; A and C leave. Step 2: B holds 3 of [4, 7); 7 positions are
    # free in [0, 4) and [7, 10), enough for D in all but in no single run: 7 of external fragmentation.
    got = ch05.serve(np.array([3, 1, 2, 4]), np.array([1, 2, 1, 1]), "contiguous_budget", 10, answer=0)
    assert {k: got[k] for k in ch05.PARTS + ("steps",)} == dict(tokens=12, future=1, internal=0, external=7, free=0,
                                                                 steps=2)


def test_pages_by_hand():
    # pool 8 = 2 pages of 4. A (3 + 3) takes a page; B (4 + 1) needs 2 pages for its first step: waits.
    # Step 1: A holds 4, 4 free (too few for B). Step 2: A's page is full, it takes the second; holds 5,
    # positions 5 will be written (future 1), 6 and 7 never (internal 2). Step 3: 6 tokens, internal 2.
    # Step 4: B (2 pages) holds 5 of 8 (internal 3), C waits. Internal never reaches a page (4).
    got = ch05.serve(np.array([3, 4, 1]), np.array([3, 1, 1]), "paged", 8, page=4)
    assert {k: got[k] for k in ch05.PARTS + ("steps", "preemptions")} == dict(
        tokens=20, future=1, internal=7, external=0, free=4, steps=4, preemptions=0)


def test_a_preemption_by_hand():
    # pool 8 = 2 pages of 4. A and B (3 + 2 each) take a page each and fill it in step 1 (C waits). In step 2
    # both need a second page, none is free: B, the newest, is preempted; A takes B's page, holds 5 of 8.
    # Step 3: B comes back with its 4 positions recomputed, on 2 pages, holds 5 of 8. C runs alone, uncounted.
    got = ch05.serve(np.array([3, 3, 1]), np.array([2, 2, 1]), "paged", 8, page=4)
    assert {k: got[k] for k in ch05.PARTS + ("steps", "preemptions")} == dict(
        tokens=18, future=0, internal=6, external=0, free=0, steps=3, preemptions=1)


def test_a_request_larger_than_the_pool_is_refused_not_waited_for():
    with pytest.raises(ValueError, match="needs 16 positions; the pool has 8"):
        ch05.serve(np.array([3, 3]), np.array([2, 2]), "contiguous_max", 8, max_len=16)
    with pytest.raises(ValueError, match="whole number of pages"):
        ch05.serve(np.array([3]), np.array([2]), "paged", 10, page=4)


# ---- on the chapter's lengths and pool ------------------------------------------------------------------------

@pytest.fixture(scope="module")
def sharegpt():
    pool = 46_592                                    # 1 GiB of 16-bit SmolLM2 cache in whole pages of 16
    inputs, outputs = data.synthetic_lengths("ShareGPT", 300, seed=0)
    return {s: ch05.serve(inputs, outputs, s, pool) for s in ch05.SERVED}, pool


def test_on_the_chapters_pool_the_parts_add_up_and_pages_waste_under_a_page_per_request(sharegpt):
    runs, pool = sharegpt
    for s, r in runs.items():
        assert r["steps"] > 0
        assert sum(r[p] for p in ch05.PARTS) == pool * r["steps"], s
        held = r["tokens"] + r["future"] + r["internal"]
        assert held + r["external"] == pool * r["steps"] - r["free"], s                # the four parts: occupied
    paged = runs["paged"]
    assert paged["internal"] < 16 * paged["live"]              # under one page per request, at every step summed
    assert paged["external"] == 0
    # the contiguous_max run holds exactly its bound for its live set; pages' live set would need far more
    assert runs["contiguous_max"]["contiguous_max"] == pool * runs["contiguous_max"]["steps"] - \
        runs["contiguous_max"]["free"]
    assert paged["contiguous_max"] > pool * paged["steps"]


def test_breakdown_shares_sum_to_one():
    inputs, outputs = data.synthetic_lengths("Alpaca", 400, seed=1)
    bd = ch05.breakdown(inputs, outputs, 4096)
    for s, r in bd.items():
        assert abs(sum(r[p] for p in ch05.PARTS) - 1) < 1e-12, s         # float division of exact integer sums
        assert r["live"] > 0 and r["steps"] > 0
