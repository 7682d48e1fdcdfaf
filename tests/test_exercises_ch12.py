"""Chapter 12 exercises: each check passes the reference solution and fails a wrong answer or a forbidden shortcut.

Oracles: for copy on write, plain lists of what each sequence wrote and lab's BlockManager replaying the same
trace (shown here to copy exactly what the reference copies); for the merge, attention over the union in float64
(shown here to equal lab's attention_lse and paged_attention_reference); for the beams, a pool of values after
the copies and the writes, and BlockManager's copy on write on the same step (shown here to make the fewest
copies the check's per-page count allows). The cases are drawn fresh at every run; a test passes `seed=` where it
must know them.
"""

import math
from collections import Counter

import pytest
import torch
from attacks import copy_of, recompiled

from lab.cache import BlockManager
from lab.exercises import ch12
from lab.exercises import ch12_solutions as sol12
from lab.kernels import merge_attention, paged_attention_reference
from lab.kernels.cascade import attention_lse

pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


# ---- exercise 1: copy on write ---------------------------------------------------------------------------------

def test_copy_on_write_reference_passes(capsys):
    for seed in (None, 1, 2):
        result = ch12.check_copy_on_write(sol12.Pages, seed=seed)
        assert sum(result["copies"]) > 0
    assert "correct" in capsys.readouterr().out


def test_the_traces_hold_every_kind_of_write():
    """On 5 draws, each trace replayed on a BlockManager: the first copies a shared, partly filled page (for the
    prompt's own sequence, then for an answer: a manager where only forks copy leaks the prompt's write), then writes
    into a page a release left to one sequence in place, then forks at a full page; the random traces copy on
    write, and the trace of one-position pages never does. The reference copies exactly as many pages."""
    for seed in range(5):
        traces = ch12.fork_traces(seed)
        for name, P, ops in traces:
            manager, lengths, copied, in_place = BlockManager(len(ops) + 1, P), Counter(), 0, 0
            for op in ops:
                if op[0] == "append":
                    shared = lengths[op[1]] % P and manager.refs(manager.block_table(op[1])[-1]) > 1
                    copied += len(manager.reserve(op[1], 1))
                    in_place += bool(lengths[op[1]] % P) and not shared
                    lengths[op[1]] += 1
                elif op[0] == "fork":
                    manager.fork(op[1], op[2])
                    lengths[op[2]] = lengths[op[1]]
                else:
                    manager.release(op[1])
            assert (copied == 0) == (P == 1), (seed, name)
            assert in_place > 0 or P == 1, (seed, name)
            assert sum(r["copies"] for r in ch12._run_pages(sol12.Pages, P, ops)) == copied, (seed, name)
        P, ops = traces[0][1:]
        forks = [i for i, op in enumerate(ops) if op[0] == "fork"]
        assert ops[forks[0] + 2][:2] == ("append", 0) and ops[forks[0] + 4] == ("release", 0) and len(forks) == 3


class CopiesAtFork(sol12.Pages):
    """Every page of the source copied at the fork (what a cache without reference counts does)."""

    def fork(self, src, dst):
        self.tables[dst], self.lengths[dst] = [], self.lengths[src]
        for page in self.tables[src]:
            self.tables[dst].append(self.take())
            self.pool.copy(page, self.tables[dst][-1])


class NeverCopies(sol12.Pages):
    """Writes into the last page whether or not another sequence holds it."""

    def append(self, seq, value):
        table, n = self.tables.setdefault(seq, []), self.lengths.get(seq, 0)
        if n % self.P == 0:
            table.append(self.take())
        self.pool.write(table[-1], n % self.P, value)
        self.lengths[seq] = n + 1


class CopiesTheWholeTable(sol12.Pages):
    """At the first write into a shared page, copies every page of the sequence."""

    def append(self, seq, value):
        table = self.tables.get(seq, [])
        if self.lengths.get(seq, 0) % self.P and self.refs[table[-1]] > 1:
            for i, old in enumerate(table):
                table[i] = self.take()
                self.refs[old] -= 1
                self.pool.copy(old, table[i])
        super().append(seq, value)


class CopiesEveryPartlyFilledPage(sol12.Pages):
    """Copies the partly filled last page at every write, shared or not (the reference counts kept right)."""

    def append(self, seq, value):
        table = self.tables.get(seq, [])
        if self.lengths.get(seq, 0) % self.P and self.refs[table[-1]] == 1:
            old, table[-1] = table[-1], self.take()
            self.pool.copy(old, table[-1])
            self.release_page(old)
        super().append(seq, value)

    def release_page(self, page):
        self.refs[page] -= 1
        if self.refs[page] == 0:
            self.pool.give(page)


class NeverGivesBack(sol12.Pages):
    def release(self, seq):
        for page in self.tables.pop(seq):
            self.refs[page] -= 1
        del self.lengths[seq]


class KeepsTheSharedPagesCount(sol12.Pages):
    """Copy on write that forgets to take the copying sequence's reference off the shared page: it is never
    given back."""

    def append(self, seq, value):
        table, n = self.tables.setdefault(seq, []), self.lengths.get(seq, 0)
        if n % self.P and self.refs[table[-1]] > 1:
            old, table[-1] = table[-1], self.take()
            self.pool.copy(old, table[-1])
        elif n % self.P == 0:
            table.append(self.take())
        self.pool.write(table[-1], n % self.P, value)
        self.lengths[seq] = n + 1


class ThroughTheBlockManager:
    """lab's BlockManager keeps the tables; the pool holds the values."""

    def __init__(self, pool):
        self.pool, self.manager, self.pages = pool, BlockManager(10_000, pool.page_size), {}

    def append(self, seq, value):
        for src, dst in self.manager.reserve(seq, 1):
            self.pool.copy(self.page(src), self.page(dst))
        n, P = self.manager.length(seq) - 1, self.pool.page_size
        self.pool.write(self.page(self.manager.block_table(seq)[n // P]), n % P, value)

    def page(self, page):
        if page not in self.pages:
            self.pages[page] = self.pool.take()
        return self.pages[page]

    def fork(self, src, dst):
        self.manager.fork(src, dst)

    def release(self, seq):
        self.manager.release(seq)

    def block_table(self, seq):
        return [self.page(p) for p in self.manager.block_table(seq)]


class ShadowLists(sol12.Pages):
    """Keeps what each sequence wrote in a list of its own and shows a block table of no pages."""

    def block_table(self, seq):
        return []


@pytest.mark.parametrize("wrong, message", [
    (CopiesAtFork, r"your fork copied \d+ page\(s\) \(pool.copy\), 0 suffice: a fork copies nothing"),
    (NeverCopies, r"your append wrote into page \d+, which sequence \d+ holds too: a shared page is read-only"),
    (CopiesTheWholeTable, r"your append copied [2-9] page\(s\) \(pool.copy\), 1 suffice: only the partly filled"),
    (CopiesEveryPartlyFilledPage, r"your append copied 1 page\(s\) \(pool.copy\), 0 suffice: no other sequence "
                                  r"holds the sequence's last page now"),
    (NeverGivesBack, r"pages in use after it .* a page goes back to the pool \(pool.give\)"),
    (KeepsTheSharedPagesCount, r"If your count says otherwise: a copy on write moves one reference from the shared "
                               r"page to the copy"),
    (ThroughTheBlockManager, "not to run the library's BlockManager"),
    (ShadowLists, r"its block table lists 0 pages"),
], ids=["copies-at-fork", "never-copies", "copies-the-whole-table", "copies-unshared-pages", "never-gives-back",
        "keeps-the-shared-count", "block-manager", "shadow-lists"])
def test_copy_on_write_shortcuts_fail(wrong, message):
    with pytest.raises(AssertionError, match=message) as e:
        ch12.check_copy_on_write(wrong, seed=3)
    assert "seed=3" in str(e.value)


def test_copy_on_write_failures_name_the_first_failing_op_of_the_smallest_trace():
    for seed in range(4):
        first = r"^three answers of one prompt \(pages of \d\), op \d+: append\("
        with pytest.raises(AssertionError, match=first) as e:
            ch12.check_copy_on_write(NeverCopies, seed=seed)
        assert "The trace so far: 0: append(0, " in str(e.value) or "The last 10 ops" in str(e.value)


def test_a_misused_pool_says_so():
    class GivesEveryPage(sol12.Pages):
        """Gives back every page of a released sequence, shared or not."""

        def release(self, seq):
            for page in self.tables.pop(seq):
                self.pool.give(page)
            del self.lengths[seq]

    with pytest.raises(AssertionError, match=r"page \d+ is not one the pool gave you, or you gave it back"):
        ch12.check_copy_on_write(GivesEveryPage, seed=3)


def test_patching_the_pool_fails():
    """A manager that copies every page at a fork and has the pool's counts say nothing was taken or copied."""
    class Patches(CopiesAtFork):
        def fork(self, src, dst):
            type(self.pool).in_use = property(lambda pool: 0)
            type(self.pool).copies = property(lambda pool: 0)
            super().fork(src, dst)

    with pytest.raises(AssertionError, match="changed Pool.in_use, Pool.copies"):
        ch12.check_copy_on_write(Patches, seed=3)
    assert ch12.Pool(4).in_use == 0 and isinstance(vars(ch12.Pool)["in_use"], property)


def test_the_pools_counts_are_read_only():
    pool = ch12.Pool(4)
    pool.copy(pool.take(), pool.take())
    with pytest.raises(AttributeError):
        pool.copies = 0
    assert (pool.copies, pool.in_use) == (1, 2)


# ---- exercise 2: the log-sum-exp merge ---------------------------------------------------------------------------

def test_merge_reference_passes(capsys):
    for seed in (None, 1, 2):
        ch12.check_merge(sol12.merge, seed=seed)
    assert "correct" in capsys.readouterr().out


def test_the_checks_attention_equals_the_librarys():
    """attention64 on each part equals lab's attention_lse (float32), and over the union lab's
    paged_attention_reference (the keys in one page), on the cases of 2 draws."""
    for seed in range(2):
        for case in ch12.merge_cases(seed):
            q, k, v, first = case["q"], case["k"], case["v"], case["first"]
            for part in (first, ~first):
                out, lse = ch12.attention64(q, k[part], v[part])
                out_f, lse_f = attention_lse(q, k[part], v[part])
                scale = max(1.0, float(lse.abs().nan_to_num(0, 0, 0).max()))
                assert torch.allclose(out, out_f.double(), atol=2e-4 * scale), case["name"]
                assert torch.allclose(lse, lse_f.double(), rtol=1e-5, atol=1e-4), case["name"]
            out, _ = ch12.attention64(q, k, v)
            T = len(first)
            paged = paged_attention_reference(q, k[None], v[None], torch.zeros(q.shape[0], 1, dtype=torch.int32),
                                              torch.full((q.shape[0],), T, dtype=torch.int32))
            assert torch.allclose(out, paged.double(), atol=2e-3), case["name"]


def test_the_merge_cases_reach_what_they_claim():
    """On 3 draws: both empty sides occur; the large cases' lse lie beyond float32's exp (above log(max) or below
    log(smallest subnormal)), so a merge that takes exp of an lse directly meets inf or 0 / 0."""
    for seed in range(3):
        cases = {c["name"]: (c, ch12._parts(c)) for c in ch12.merge_cases(seed)}
        assert cases["the first set empty"][1][1].isneginf().all() and (cases["the first set empty"][1][0] == 0).all()
        assert cases["the second set empty"][1][3].isneginf().all()
        big = math.log(torch.finfo(torch.float32).max)
        assert cases["large scores"][1][1].max() > big and cases["one set far above the other"][1][1].min() > big
        assert cases["scores far below zero"][1][1].max() < -104 and cases["scores far below zero"][1][3].max() < -104


def averaged(out_1, lse_1, out_2, lse_2):
    return (out_1 + out_2) / 2, torch.maximum(lse_1, lse_2)


def naive(out_1, lse_1, out_2, lse_2):
    """The weights exp(lse) without the larger lse subtracted: right in exact arithmetic."""
    w_1, w_2 = torch.exp(lse_1), torch.exp(lse_2)
    return (w_1[..., None] * out_1 + w_2[..., None] * out_2) / (w_1 + w_2)[..., None], torch.log(w_1 + w_2)


def lse_of_the_larger(out_1, lse_1, out_2, lse_2):
    return sol12.merge(out_1, lse_1, out_2, lse_2)[0], torch.maximum(lse_1, lse_2)


def counted(seed):
    """The outputs weighted by the number of positions in each set: the counts are read off the cases of `seed`
    beforehand (the merge itself never gets them), in the order the check hands them over."""
    counts = iter([(int(c["first"].sum()), int((~c["first"]).sum())) for c in ch12.merge_cases(seed)])

    def merge(out_1, lse_1, out_2, lse_2):
        n_1, n_2 = next(counts)
        return (n_1 * out_1 + n_2 * out_2) / (n_1 + n_2), torch.logaddexp(lse_1, lse_2)
    return merge


@pytest.mark.parametrize("wrong, message", [
    (averaged, "That is the plain average of the two outputs"),
    (counted(5), "That is the two outputs weighted by their numbers of positions"),
    (naive, r"case 5, large scores .* your out holds nan .* subtract the larger lse before exp"),
    (lse_of_the_larger, r"your lse is .* the union's lse is log\(exp\(lse_1\) \+ exp\(lse_2\)\)"),
    (merge_attention, "not to call the library's merge_attention"),
    (lambda o1, l1, o2, l2: attention_lse(o1, o1, o1) and sol12.merge(o1, l1, o2, l2),
     "not to call the library's merge_attention or attention_lse"),
    (copy_of(merge_attention), "not to call the library's merge_attention"),             # copies made beforehand
    (recompiled(merge_attention, rename=True), "not to call the library's merge_attention"),
    (lambda o1, l1, o2, l2: (o1, l1), "your out differs from attention over all"),
], ids=["averaged", "weighted-by-counts", "naive-exp", "lse-of-the-larger", "library", "attention-lse", "a-copy",
        "recompiled",
        "first-part-only"])
def test_merge_shortcuts_fail(wrong, message):
    with pytest.raises(AssertionError, match=message) as e:
        ch12.check_merge(wrong, seed=5)
    assert "seed=5" in str(e.value)


def first_as_the_max(out_1, lse_1, out_2, lse_2):
    """Subtracting lse_1 (lse_2 where the first set is empty), not the larger: overflows if the second is far above."""
    m = torch.where(lse_1.isneginf(), lse_2, lse_1)
    w_1, w_2 = torch.exp(lse_1 - m), torch.exp(lse_2 - m)
    return (w_1[..., None] * out_1 + w_2[..., None] * out_2) / (w_1 + w_2)[..., None], m + torch.log(w_1 + w_2)


def naive_in_float64(out_1, lse_1, out_2, lse_2):
    """The naive weights in float64, whose exp reaches 709.8: enough for scores in the hundreds, not past them."""
    out, lse = naive(*(x.double() for x in (out_1, lse_1, out_2, lse_2)))
    return out.float(), lse.float()


def in_float64(out_1, lse_1, out_2, lse_2):
    return sol12.merge(*(x.double() for x in (out_1, lse_1, out_2, lse_2)))


@pytest.mark.parametrize("seed", range(8))
@pytest.mark.parametrize("wrong, message", [
    (first_as_the_max, r"subtract the larger lse before exp"),
    (naive_in_float64, r"scores past float64's exp"),
    (in_float64, "keep the dtype of out_1 and lse_1"),
], ids=["lse_1-as-the-max", "naive-in-float64", "float64-out"])
def test_merge_shortcuts_a_reader_found_fail_on_every_draw(wrong, message, seed):
    with pytest.raises(AssertionError, match=message):
        ch12.check_merge(wrong, seed=seed)


def test_patching_the_checks_attention_fails():
    def patches(out_1, lse_1, out_2, lse_2):
        ch12.attention64 = lambda q, k, v: (out_1.double(), lse_1.double())
        return out_1, lse_1

    with pytest.raises(AssertionError, match="changed lab.exercises.ch12.attention64"):
        ch12.check_merge(patches, seed=5)
    assert ch12.attention64.__name__ == "attention64"


# ---- exercise 3: beams by their block tables ----------------------------------------------------------------------

def test_beam_reorder_reference_passes(capsys):
    for seed in (None, 1, 2):
        result = ch12.check_beam_reorder(sol12.reorder, seed=seed)
        assert 0 < result["copies"] < result["index_select_pages"] / 4
    assert "correct" in capsys.readouterr().out


def test_the_beam_cases_hold_what_they_claim_and_block_manager_copies_the_fewest():
    """On 5 draws: the first case's prompt ends inside a page that every beam writes; the second drops a beam; the
    third's beams fill their pages; every state is the realistic one (every old beam's partly filled last page its
    own). BlockManager's copy on write makes, page by page, one copy fewer than the new beams that write a page."""
    for seed in range(5):
        cases = ch12.beam_cases(seed)
        first, dropped, full = cases[:3]
        assert first["lengths"][0] % first["page_size"] and len(first["tables"]) == 1
        assert len(set(dropped["parents"])) == 1 and len(dropped["tables"]) == 2
        assert full["lengths"][0] % full["page_size"] == 0
        for case in cases:
            P = case["page_size"]
            assert all(case["refs"][t[-1]] == 1 for t, n in zip(case["tables"], case["lengths"], strict=True) if n % P)
            writers = Counter(case["tables"][b][-1] for b in case["parents"] if case["lengths"][b] % P)
            _, copies = ch12._beam_step(case["manager"], list(case["values"]), case["seqs"], case["parents"],
                                        iter(range(99)), case["ids"])
            assert Counter(src for src, _ in copies) == Counter({p: n - 1 for p, n in writers.items() if n > 1})


def index_select(tables, lengths, parents, refs, free, page_size):
    """transformers' way on pages: every new beam gets a copy of its parent's whole cache."""
    new_tables, copies = [], []
    for b in parents:
        table = []
        for page in tables[b]:
            table.append(free.pop(0))
            copies.append((page, table[-1]))
        if lengths[b] % page_size == 0:
            table.append(free.pop(0))
        new_tables.append(table)
        for page in table:
            refs[page] = 1
    for table in tables:
        for page in table:
            refs[page] -= 1
            if refs[page] == 0:
                free.append(page)
    return new_tables, copies


def copies_every_last_page(tables, lengths, parents, refs, free, page_size):
    """The reference's bookkeeping, but a fresh copy of the parent's partly filled last page for every new beam,
    shared or not."""
    new_tables, copies = [list(tables[b]) for b in parents], []
    for table in new_tables:
        for page in table:
            refs[page] += 1
    for table in tables:
        for page in table:
            refs[page] -= 1
            if refs[page] == 0:
                free.append(page)
    for table, b in zip(new_tables, parents, strict=True):
        page = free.pop(0)
        refs[page] = 1
        if lengths[b] % page_size == 0:
            table.append(page)
            continue
        old, table[-1] = table[-1], page
        copies.append((old, page))
        refs[old] -= 1
        if refs[old] == 0:
            free.append(old)
    return new_tables, copies


def keeps_dropped_beams(tables, lengths, parents, refs, free, page_size):
    """Forks the beams chosen twice or more and copies on write, but never lets go of a dropped beam's pages."""
    new_tables, copies, taken = [], [], set()
    for b in parents:
        table = list(tables[b])
        if b in taken:                                   # a fork: every page counted once more
            for page in table:
                refs[page] += 1
        taken.add(b)
        new_tables.append(table)
    for table, b in zip(new_tables, parents, strict=True):
        if lengths[b] % page_size == 0:
            table.append(free.pop(0))
            refs[table[-1]] = 1
        elif refs[table[-1]] > 1:
            old, table[-1] = table[-1], free.pop(0)
            refs[old] -= 1
            refs[table[-1]] = 1
            copies.append((old, table[-1]))
    return new_tables, copies


def forgets_the_free_list(tables, lengths, parents, refs, free, page_size):
    """The reference solution, the pages whose count drops to 0 not put back in `free`."""
    held = list(free)
    new_tables, copies = sol12.reorder(tables, lengths, parents, refs, free, page_size)
    free[:] = [p for p in free if p in held]
    return new_tables, copies


def never_copies(tables, lengths, parents, refs, free, page_size):
    new_tables = [list(tables[b]) for b in parents]
    for table, b in zip(new_tables, parents, strict=True):
        if lengths[b] % page_size == 0:
            table.append(free.pop(0))
    return new_tables, []


def through_the_block_manager(tables, lengths, parents, refs, free, page_size):
    manager = BlockManager(len(refs), page_size)
    manager.reserve(0, lengths[0])
    return [manager.block_table(0)], []


@pytest.mark.parametrize("wrong, message", [
    (index_select, r"which is full .* \(transformers' index_select copies every beam's whole cache"),
    (copies_every_last_page, r"partly filled last page, \d time\(s\); \d new beam\(s\) write into it, so \d cop"),
    (keeps_dropped_beams, r"refs\[\d+\] is \d+, but \d+ new block tables hold page \d+ \(old beam\(s\) .* "
                          r"dropped\): .* a dropped beam's pages each lose one"),
    (forgets_the_free_list, r"is held by no new beam .* but is not in `free`"),
    (never_copies, r"two new beams write position \d+ into page \d+"),
    (through_the_block_manager, "not to run the library's BlockManager"),
    (lambda *args: ([], []), r"you returned 0 block tables"),
], ids=["index-select", "copies-every-last-page", "keeps-dropped-beams", "forgets-the-free-list", "never-copies",
        "block-manager", "nothing"])
def test_beam_reorder_shortcuts_fail(wrong, message):
    with pytest.raises(AssertionError, match=message) as e:
        ch12.check_beam_reorder(wrong, seed=6)
    assert "seed=6" in str(e.value)


def test_patching_the_checks_oracle_fails():
    def patches(tables, lengths, parents, refs, free, page_size):
        ch12.values_of = lambda case, beam, position: None
        return sol12.reorder(tables, lengths, parents, refs, free, page_size)

    with pytest.raises(AssertionError, match="changed lab.exercises.ch12.values_of"):
        ch12.check_beam_reorder(patches, seed=6)
    assert ch12.values_of.__name__ == "values_of"


class OnlyForksCopy(sol12.Pages):
    """A reader's manager that copies a shared page only for a forked sequence, never for the one forked from: the
    prompt's write into the page its answers still hold leaks into them."""

    def __init__(self, pool):
        super().__init__(pool)
        self.forked = set()

    def fork(self, src, dst):
        super().fork(src, dst)
        self.forked.add(dst)

    def append(self, seq, value):
        if seq in self.forked:
            return super().append(seq, value)
        table, n = self.tables.setdefault(seq, []), self.lengths.get(seq, 0)
        if n % self.P == 0:
            table.append(self.pool.take())
            self.refs[table[-1]] = 1
        self.pool.write(table[-1], n % self.P, value)
        self.lengths[seq] = n + 1


@pytest.mark.parametrize("seed", range(12))
def test_a_manager_where_only_forks_copy_fails_on_every_draw(seed):
    with pytest.raises(AssertionError):
        ch12.check_copy_on_write(OnlyForksCopy, seed=seed)
