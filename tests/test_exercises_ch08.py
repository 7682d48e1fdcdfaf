"""Chapter 8 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut.

Oracles: every request's tokens are compared with its prompt decoded alone through a ConcatCache (no pages,
no batch, no scheduler), checked here against the stock engine; the admission order is read from the
engine's timeline, and that reading is checked by hand and on the stock engine (first come, first served);
the positions a run without recomputation needs are checked against an engine whose pool never runs out.
"""

import bisect

import pytest
import torch

from lab.engine import ServingEngine
from lab.exercises import ch08
from lab.exercises import ch08_solutions as sol8

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py

TINY_GAP = 1e-4   # 10 x the 1e-5 bound on tiny-model logit differences between cache designs (test_serving.py)


def size(req):
    return len(req.prompt) + req.max_new_tokens


# ---- the oracles ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("workload", [ch08.sjf_workload, ch08.swap_workload])
def test_each_request_alone_is_clear_of_ties_and_is_what_the_stock_engine_serves(workload):
    prompts, news, arrivals = workload()
    for p, n in zip(prompts, news, strict=True):
        assert ch08.alone(tuple(p), n)[1] > TINY_GAP              # no near tie: an inequality is a bug
    big = ServingEngine(ch08.tiny_model(), num_pages=256, page_size=4, prefix_caching=False)
    with ch08.counting_positions() as counted:
        outputs = big.generate(prompts, news, arrivals=arrivals)
    assert outputs == [list(ch08.alone(tuple(p), n)[0]) for p, n in zip(prompts, news, strict=True)]
    # a pool that never runs out recomputes nothing: the count the swapping check expects, counted at the forward
    assert big.stats["preemptions"] == 0
    assert counted[0] == big.stats["computed_tokens"] == ch08.positions_without_recomputation(prompts, news)


def test_cached_prefix_is_what_admission_takes():
    """The helper the reader ranks with, the check's oracle (a copy of the block manager admits the request:
    the admission log's work left) and what _admit really takes agree at every admission of a run."""
    seen = []

    class Watched(sol8.ShortestFirstEngine):
        def _admit(self, req, budget, now):
            looked, before = ch08.cached_prefix(self, req), req.cached_tokens
            n = super()._admit(req, budget, now)
            seen.append((looked, req.cached_tokens - before) if n else None)
            return n

    _, _, _, log = ch08._run_sjf(Watched)
    assert len(log) == len(seen)
    taken = []                                                     # (cached_prefix, the oracle's, _admit's)
    for admitted, (_, rid, waiting, _) in zip(seen, log, strict=True):
        if admitted is not None:
            size, left = waiting[rid]
            taken.append((admitted[0], size - left, admitted[1]))
    assert taken and all(a == b == c for a, b, c in taken)
    assert sum(c > 0 for _, _, c in taken) >= 4                    # the system prompt and preempted pages
    assert not hasattr(ch08, "_work_left")                         # the oracle is not a name an answer can call


def test_the_stock_engine_is_first_come_first_served_and_the_workload_tells_them_apart():
    prompts, news, arrivals = ch08.sjf_workload()
    assert arrivals == sorted(arrivals)                           # index order is arrival order
    _, _, timeline, log = ch08._run_sjf(ServingEngine)
    assert all(rid == min(waiting) for _, rid, waiting, _ in log)  # every choice the earliest arrival
    assert sum(any(left < waiting[rid][1] for _, left in waiting.values()) for _, rid, waiting, _ in log) > 5


def test_the_workload_tells_the_work_left_from_the_size():
    """Ranking by size (the tokens asked for) and by the work left choose differently at some admission."""
    _, _, _, log = ch08._run_sjf(sol8.ShortestFirstEngine)
    differ = [s for s, _, waiting, _ in log
              if min(waiting, key=lambda r: waiting[r][0]) != min(waiting, key=lambda r: waiting[r][1])]
    assert len(differ) >= 2


def test_the_workloads_preempt():
    engine, _, timeline, _ = ch08._run_sjf(sol8.ShortestFirstEngine)
    assert engine.stats["preemptions"] > 0                        # the preempted requests' rule is exercised
    assert any(len(e["admitted"]) > 1 for e in timeline)
    engine = sol8.SwappingEngine(ch08.tiny_model(), **ch08.SWAP_POOL, prefix_caching=False)
    victims, watch = [], ch08._SwapWatch()                       # (positions computed, prompt tokens)

    def record(engine):
        now = engine.stats["steps"] - 1
        victims.extend((watch.computed[r.id], len(r.prompt)) for r in engine.waiting if now in r.events["preempted"])
        watch(engine)

    prompts, news, arrivals = ch08.swap_workload()
    ch08.serve(engine, prompts, news, arrivals, after_step=record)
    assert len(victims) >= 3
    assert any(c < p for c, p in victims)                         # one swapped out before its prompt was done
    assert any(c % engine.page_size for c, _ in victims)          # one whose last page was partly filled
    assert max(len(r.events["preempted"]) for r in engine.requests.values()) >= 2   # one swapped out twice
    assert ch08.recompute_positions()[0] > ch08.positions_without_recomputation(prompts, news)


# ---- exercise 1: shortest job first -------------------------------------------------------------------------

def test_shortest_first_reference_passes(capsys):
    result = ch08.check_shortest_first(sol8.ShortestFirstEngine)
    mine, fcfs = result["shortest_first"], result["fcfs"]
    assert mine["ttft_median_steps"] < fcfs["ttft_median_steps"]
    # starvation, which the docstring promises the numbers show: the longest job and the tail wait longer
    assert mine["longest_job_ttft_steps"] > fcfs["longest_job_ttft_steps"]
    assert mine["ttft_p99_steps"] > fcfs["ttft_p99_steps"]
    assert "correct" in capsys.readouterr().out


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_drawn_workload_passes_the_reference_and_asks_for_other_choices(seed):
    drawn = ch08.sjf_draw(seed)
    assert drawn == ch08.sjf_draw(seed) and drawn != ch08.sjf_draw(seed + 1)
    assert sorted(map(tuple, drawn[0])) == sorted(map(tuple, ch08.sjf_workload()[0]))   # the same prompts
    assert drawn[2] == sorted(drawn[2])
    ch08.check_shortest_first(sol8.ShortestFirstEngine, seed=seed)
    # the reference's choices, as prompts, differ from those it makes on the fixed workload
    assert reference_admissions(drawn) != reference_admissions(ch08.sjf_workload())


def reference_admissions(workload) -> list[tuple]:
    """The prompts the reference solution admits on `workload`, in the order it admits them."""
    _, rids, _, log = ch08._run_sjf(sol8.ShortestFirstEngine, workload=workload)
    prompt = dict(zip(rids, map(tuple, workload[0]), strict=True))
    return [prompt[rid] for _, rid, _, ok in log if ok]


def replaying():
    """An engine that admits, among those waiting, the prompt the reference admitted first on the fixed
    workload: right there, by rote."""
    order = {}
    for prompt in reference_admissions(ch08.sjf_workload()):
        order.setdefault(prompt, len(order))

    class Replays(ServingEngine):
        def next_to_admit(self):
            return min(self.waiting, key=lambda r: order.get(tuple(r.prompt), len(order)))
    return Replays


def test_replaying_the_fixed_workloads_choices_fails():
    Replays = replaying()
    with pytest.raises(AssertionError, match="least work left|was chosen while"):
        ch08.check_shortest_first(Replays, seed=0)


class LongestFirst(ServingEngine):
    def next_to_admit(self):
        return max(self.waiting, key=size)


class ShortestPrompt(ServingEngine):
    def next_to_admit(self):
        return min(self.waiting, key=lambda req: len(req.prompt))


class CancelsLongJobs(ServingEngine):
    def next_to_admit(self):
        best = min(self.waiting, key=size)
        for req in [r for r in self.waiting if size(r) > 40 and r is not best]:
            self.cancel(req.id)
        return best


class DropsLongJobs(ServingEngine):
    """Removes long requests from the queue without a word: they would wait forever."""

    def next_to_admit(self):
        best = min(self.waiting, key=size)
        for req in [r for r in self.waiting if size(r) > 40 and r is not best]:
            self.waiting.remove(req)
        return best


class TotalSize(ServingEngine):
    """Ranks by the tokens asked for, blind to the pages already cached (the exercise's old rule)."""

    def next_to_admit(self):
        return min(self.waiting, key=size)


class Truncates(sol8.ShortestFirstEngine):
    def next_to_admit(self):
        for req in self.waiting:
            req.max_new_tokens = min(req.max_new_tokens, 4)      # every job looks short
        return super().next_to_admit()


class SortedOnArrival(ServingEngine):
    """Keeps the queue sorted by size as requests arrive, and admits its head: but a preempted request goes
    back to the head whatever its size."""

    def _add(self, reqs):
        rid, req = super()._add(reqs), reqs[0]        # the request queued (n = 1: the only one)
        self.waiting.remove(req)
        sizes = [size(r) for r in self.waiting]
        self.waiting.insert(bisect.bisect_right(sizes, size(req)), req)
        return rid


class BiggerPool(sol8.ShortestFirstEngine):
    def __init__(self, model, num_pages, *args, **kwargs):
        super().__init__(model, 4 * num_pages, *args, **kwargs)


@pytest.mark.parametrize("wrong, message", [
    (ServingEngine, "that is first come, first served"),
    (LongestFirst, "was chosen while request"),
    (ShortestPrompt, "was chosen while request"),
    (CancelsLongJobs, "was cancelled"),
    (DropsLongJobs, "dropped from the queue"),
    (Truncates, "tokens of the 16 asked"),
    (SortedOnArrival, "least work left"),
    (BiggerPool, "a bigger pool"),
    (TotalSize, "rank by the work left, not by the size"),
], ids=["fcfs", "longest-first", "shortest-prompt", "cancels-long-jobs", "drops-long-jobs", "truncates",
        "sorted-on-arrival", "bigger-pool", "total-size"])
def test_shortest_first_wrong_answers_fail(wrong, message):
    with pytest.raises(AssertionError, match=message):
        ch08.check_shortest_first(wrong)


# ---- exercise 2: preemption by swapping ---------------------------------------------------------------------

def test_swapping_reference_passes(capsys):
    result = ch08.check_swapping(sol8.SwappingEngine)
    prompts, news, _ = ch08.swap_workload()
    assert result["positions"] == ch08.positions_without_recomputation(prompts, news) < result["recompute_positions"]
    assert result["preemptions"] > 0 and result["host_peak_bytes"] > 0
    assert "correct" in capsys.readouterr().out


class CopiesButRecomputes(sol8.SwappingEngine):
    def _admit(self, req, budget, now):
        n = ServingEngine._admit(self, req, budget, now)         # the stock admission: recomputes
        if n:
            self.swapped.pop(req.id, None)
        return n


class KeepsPages(sol8.SwappingEngine):
    """Copies the pages to the host, but a second sequence keeps them taken in the pool."""

    def _preempt(self, req, now):
        self.manager.fork(req.seq, self.pool.new_id())           # shares every page: released, still held
        super()._preempt(req, now)


def restore_with(write):
    """The reference, but the copy back into the fresh pages is write(pool tensor, pages, host copy)."""
    class Restores(sol8.SwappingEngine):
        def _admit(self, req, budget, now):
            saved, pool = self.swapped.get(req.id), self.pool
            before = pool.k_pools["full"].clone(), pool.v_pools["full"].clone()
            n = super()._admit(req, budget, now)
            if n and saved is not None:                           # undo the reference's restore, then write
                pages = self.manager.block_table(req.seq)[:saved[0].shape[1]]
                k, v = pool.k_pools["full"], pool.v_pools["full"]
                k[:, pages], v[:, pages] = before[0][:, pages], before[1][:, pages]
                write(pool.k_pools["full"], pages, saved[0])
                write(pool.v_pools["full"], pages, saved[1])
            return n
    return Restores


def nowhere(pool, pages, saved):
    pass                                                          # fresh pages as they were: stale values


def reversed_pages(pool, pages, saved):
    pool[:, pages[::-1]] = saved                                  # the right values, in the wrong pages


class RemembersPageIds(sol8.SwappingEngine):
    """Keeps only where the pages were, and reads them back after others have reused them."""

    def _preempt(self, req, now):
        pages = self.manager.block_table(req.seq)[:-(-req.computed // self.page_size)]
        self.swapped[req.id] = (pages, req.computed)
        ServingEngine._preempt(self, req, now)

    def _admit(self, req, budget, now):
        if req.id not in self.swapped:
            return super()._admit(req, budget, now)
        old, computed = self.swapped[req.id]
        self.swapped[req.id] = (self.pool.k_pools["full"][:, old], self.pool.v_pools["full"][:, old], computed)
        return super()._admit(req, budget, now)


class KeepsViews(sol8.SwappingEngine):
    """Keeps views of the pages (indexing one page at a time with an int does not copy)."""

    def _preempt(self, req, now):
        pages = self.manager.block_table(req.seq)[:-(-req.computed // self.page_size)]
        k, v = self.pool.k_pools["full"], self.pool.v_pools["full"]
        self.swapped[req.id] = ([k[:, p] for p in pages], [v[:, p] for p in pages], req.computed)
        ServingEngine._preempt(self, req, now)

    def _admit(self, req, budget, now):
        if req.id in self.swapped:
            k, v, computed = self.swapped[req.id]
            self.swapped[req.id] = (torch.stack(k, 1), torch.stack(v, 1), computed)
        return super()._admit(req, budget, now)


class NeverFreesHostCopies(sol8.SwappingEngine):
    def _admit(self, req, budget, now):
        saved = self.swapped.get(req.id)
        n = super()._admit(req, budget, now)
        if n and saved is not None:
            self.swapped[req.id] = saved                          # put back: kept for ever
        return n


class ForgetsCancel(sol8.SwappingEngine):
    cancel = ServingEngine.cancel


class SwapsInABiggerPool(sol8.SwappingEngine):
    def __init__(self, model, num_pages, *args, **kwargs):
        super().__init__(model, 2 * num_pages, *args, **kwargs)


@pytest.mark.parametrize("wrong, message", [
    (ServingEngine, "keep the host copies in self.swapped"),
    (CopiesButRecomputes, "recomputing them"),
    (KeepsPages, "pages are taken but the running requests hold"),
    (restore_with(nowhere), "differ from those it had when swapped out"),
    (restore_with(reversed_pages), "differ from those it had when swapped out"),
    (RemembersPageIds, "not where they were"),
    (KeepsViews, "a view of the pool"),
    (NeverFreesHostCopies, "still holds its host copy"),
    (ForgetsCancel, "drop it in cancel"),
    (SwapsInABiggerPool, "a bigger pool"),
], ids=["recomputes", "copies-but-recomputes", "keeps-pages", "restores-nothing", "wrong-pages",
        "remembers-page-ids", "keeps-views", "never-frees-host-copies", "forgets-cancel", "bigger-pool"])
def test_swapping_wrong_answers_fail(wrong, message):
    with pytest.raises(AssertionError, match=message):
        ch08.check_swapping(wrong)


class PatchesTheOracle(TotalSize):
    def next_to_admit(self):
        ch08._check_admissions = lambda log, timeline, rids: None     # a check that no longer looks
        return super().next_to_admit()


def test_patching_the_check_fails():
    with pytest.raises(AssertionError, match="changed lab.exercises.ch08._check_admissions"):
        ch08.check_shortest_first(PatchesTheOracle)
    assert ch08._check_admissions.__name__ == "_check_admissions"
