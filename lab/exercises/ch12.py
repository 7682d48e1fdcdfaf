"""Chapter 12 exercises: copy on write for many answers of one prompt, the log-sum-exp merge behind cascade
attention, and beams moved by their block tables.

Exercise 1 runs the reader's page manager on traces of appends, forks and releases drawn fresh at every run
(`seed=` draws the same ones again), on a pool of the check's own that counts the pages taken and copied, while
lab's block managers raise. Only then does it compare what every sequence reads through its block table, after
every op, with what it wrote (a plain list per sequence), and the pages held and copied with what a BlockManager
holds and copies on the same trace. Exercise 2 hands the reader's merge the partial attentions of two sets of
positions (their outputs and log-sum-exps, never their keys) while lab's merge raises, and compares the result
with attention over the union, worked out in float64. Exercise 3 hands the reader's step the beams' block
tables, reference counts, free list and the next step's parents while lab's block managers raise; then it runs
the step on a pool of values (the copies, then every new beam's write) and compares every new beam with its
parent, the reference counts and free list with the new tables, and the copies with the fewest that copy on
write needs.
"""

import itertools
import math
import random
import sys
import types
from collections import Counter

import torch

from ..cache import BlockManager
from ..cache.block_manager import pages_for
from ..cache.hybrid import HybridBlockManager
from ..cache.pool import PagePool
from ..kernels import merge_attention
from .rules import drawn_with, fresh_seed, functions_raise, unchanged

NO_MANAGER = ("forbidden shortcut: this exercise asks you to keep the pages yourself, not to run the library's "
              "BlockManager")
MANAGERS = (BlockManager, HybridBlockManager, PagePool)


def _count(n, what) -> str:
    return f"{n} {what}{'s' * (n != 1)}"


def _show(values, most=12) -> str:
    values = list(values)
    return str(values) if len(values) <= most else f"[{', '.join(map(str, values[:most]))}, ... ({len(values)})]"


# ---- exercise 1: fork a partly filled page -------------------------------------------------------------------

class Pool:
    """The pool of pages a reader's page manager is given. A page holds `page_size` values, one per position (a
    position's keys and values, in a real pool):

        pool.take() -> page        a free page (it holds nothing yet); pool.give(page) returns it
        pool.write(page, offset, value)
        pool.copy(src, dst)        every value of page src into page dst
        pool.read(page) -> list    its values (None where nothing was written)

    It counts what the check measures: `pool.in_use`, the pages taken and not given back, and `pool.copies`."""
    __slots__ = ("page_size", "__copies", "__values", "__spare", "__held")

    def __init__(self, page_size):
        self.page_size, self.__copies = page_size, 0
        self.__values = []          # page -> its values
        self.__spare = []           # pages given back, taken again first
        self.__held = set()         # pages taken and not given back

    @property
    def in_use(self) -> int:
        return len(self.__held)

    @property
    def copies(self) -> int:
        return self.__copies

    def take(self) -> int:
        page = self.__spare.pop() if self.__spare else len(self.__values)
        if page == len(self.__values):
            self.__values.append(None)
        self.__values[page] = [None] * self.page_size
        self.__held.add(page)
        return page

    def give(self, page):
        self.__mine(page, "give")
        self.__held.remove(page)
        self.__values[page] = [None] * self.page_size
        self.__spare.append(page)

    def write(self, page, offset, value):
        self.__mine(page, "write")
        if not (hasattr(offset, "__index__") and 0 <= offset < self.page_size):
            raise AssertionError(f"pool.write({page}, {offset!r}, ...): the offset is a position in the page, "
                                 f"0 .. {self.page_size - 1}")
        self.__values[page][offset] = value

    def copy(self, src, dst):
        self.__mine(src, "copy")
        self.__mine(dst, "copy")
        self.__values[dst] = list(self.__values[src])
        self.__copies += 1

    def read(self, page) -> list:
        self.__mine(page, "read")
        return list(self.__values[page])

    def __mine(self, page, what):
        if not (hasattr(page, "__index__") and page in self.__held):
            raise AssertionError(f"pool.{what}(...): page {page!r} is not one the pool gave you, or you gave it back "
                                 "(pages come from pool.take())")

    def _contents(self, pages) -> dict:
        """page -> a copy of its values, for the pages of `pages` that are taken (the check's view)."""
        return {p: list(self.__values[p]) for p in pages if hasattr(p, "__index__") and p in self.__held}


def fork_traces(seed) -> list[tuple[str, int, list]]:
    """Four traces drawn from `seed`: (name, page_size, ops). An op is ("append", seq, value), ("fork", src, dst)
    or ("release", seq); sequences are ints, a new one starts with an append (or a fork), values are distinct ints.

    - "three answers of one prompt": a prompt that ends inside a page (pages of 3..5) forked twice; the prompt's
      own sequence writes, then one answer (a copy on write each), the prompt is released (its partly filled page
      is then the other answer's alone: no copy), a fork at a full page, and writes from all.
    - "forks and releases": 160 random ops on pages of 2..4, new prompts now and then.
    - "pages of one position": 60 random ops on pages of 1 (every page full: nothing is ever copied).
    - "beam steps": 12 steps of 2..4 beams, each step releasing the beams not chosen, forking those chosen twice
      or more, and writing one position to every beam.
    """
    rng, values = random.Random(seed), iter(range(1000, 10**9))
    return [("three answers of one prompt", *_answers_trace(rng, values)),
            ("forks and releases", *_random_trace(rng, values, rng.randint(2, 4), 160)),
            ("pages of one position", *_random_trace(rng, values, 1, 60)),
            ("beam steps", *_beam_trace(rng, values))]


def _answers_trace(rng, values) -> tuple[int, list]:
    P = rng.randint(3, 5)
    prompt = P * rng.randint(1, 2) + rng.randint(1, P - 1)                   # it ends inside a page
    ops = [("append", 0, next(values)) for _ in range(prompt)]
    ops += [("fork", 0, 1), ("fork", 0, 2), ("append", 0, next(values)), ("append", 1, next(values)), ("release", 0),
            ("append", 2, next(values))]                                   # the prompt writes too, then an answer
    ops += [("append", 2, next(values)) for _ in range(-(prompt + 1) % P)]    # answer 2 fills its last page
    ops += [("fork", 2, 3)]                                                    # a fork at a full page
    for _ in range(rng.randint(2 * P, 3 * P)):
        ops.append(("append", rng.choice((1, 2, 3)), next(values)))
    return P, ops


def _random_trace(rng, values, P, n) -> tuple[int, list]:
    ops = [("append", 0, next(values)) for _ in range(rng.randint(1, 3 * P))]
    live, new = [0], 1
    while len(ops) < n:
        r = rng.random()
        if r < 0.2 and len(live) < 10:
            ops.append(("fork", rng.choice(live), new))
            live.append(new)
            new += 1
        elif r < 0.32 and len(live) > 1:
            ops.append(("release", live.pop(rng.randrange(len(live)))))
        elif r < 0.36 and len(live) < 10:                                      # a new prompt
            ops.append(("append", new, next(values)))
            live.append(new)
            new += 1
        else:
            ops.append(("append", rng.choice(live), next(values)))
    return P, ops


def _beam_trace(rng, values, steps=12) -> tuple[int, list]:
    P, k = rng.randint(2, 5), rng.randint(2, 4)
    ops = [("append", 0, next(values)) for _ in range(rng.randint(1, 2 * P))]
    beams, new = [0], 1
    for _ in range(steps):
        parents = [rng.randrange(len(beams)) for _ in range(k)]
        ops += [("release", b) for i, b in enumerate(beams) if i not in parents]
        taken, nxt = set(), []
        for i in parents:
            if i in taken:
                ops.append(("fork", beams[i], new))
                nxt.append(new)
                new += 1
            else:
                nxt.append(beams[i])
                taken.add(i)
        beams = nxt
        ops += [("append", b, next(values)) for b in beams]
    return P, ops


def _run_pages(make_pages, P, ops) -> list[dict]:
    """The reader's manager on one trace: after each op, every live sequence's block table, the pool's values of
    the pages they list, the pages in use and the copies the op made."""
    pool = Pool(P)
    pages, live, record = make_pages(pool), set(), []
    for op in ops:
        copies = pool.copies
        getattr(pages, op[0])(*op[1:])
        if op[0] == "release":
            live.discard(op[1])
        else:
            live.add(op[2] if op[0] == "fork" else op[1])
        tables = {s: list(pages.block_table(s)) for s in sorted(live)}
        record.append(dict(tables=tables, contents=pool._contents({p for t in tables.values() for p in t}),
                           in_use=pool.in_use, copies=pool.copies - copies))
    return record


def _op(op) -> str:
    return f"{op[0]}({', '.join(map(str, op[1:]))})"


def _story(ops, i, most=10) -> str:
    """The ops up to op i, for a message: all of them, or the last `most`."""
    shown = [f"{j}: {_op(op)}" for j, op in enumerate(ops[:i + 1])][-most:]
    return ("The trace" if i < most else f"The last {most} ops of the trace") + " so far: " + "; ".join(shown)


def _read_back(where, seq, values, table, contents, P, writer):
    """What `seq` reads through `table` equals the values it wrote; AssertionError with a hint otherwise."""
    assert len(table) == pages_for(len(values), P), (
        f"{where}: sequence {seq} holds {_count(len(values), 'position')}, its block table lists {len(table)} pages "
        f"({_show(table)}), not {pages_for(len(values), P)}: a page holds {P} positions, and a table lists the pages "
        "of its positions, no more")
    for p, value in enumerate(values):
        page = table[p // P]
        assert page in contents, (
            f"{where}: sequence {seq}'s block table lists page {page!r} (for position {p}), which the pool has not "
            "given you, or you gave back (pool.give) while a sequence still holds it")
        got = contents[page][p % P]
        if got == value:
            continue
        message = f"{where}: sequence {seq} reads {got!r} at position {p} (page {page}, offset {p % P}), not {value!r}"
        if got is None:
            message += (": nothing was written there. A page taken for a copy on write holds nothing until you "
                        "copy the shared page into it (pool.copy(src, dst)), before the write")
        elif got in writer and writer[got][0] != seq:
            other, j = writer[got]
            message += (f", which sequence {other} wrote at op {j} into page {page}, a page sequence {seq} holds "
                        "too. A shared page is read-only: before a sequence writes into a partly filled page it "
                        "shares (reference count above 1), it takes a private copy (copy on write)")
        raise AssertionError(message)


def _check_pages_trace(name, P, ops, record):
    """The verdict on one trace, the oracles run now: plain lists for the contents, a BlockManager for the pages."""
    manager, wrote, writer = BlockManager(len(ops) + 1, P), {}, {}     # an append takes at most one page
    for i, (op, rec) in enumerate(zip(ops, record, strict=True)):
        kind, seq = op[0], op[1]
        length = len(wrote.get(seq, ()))
        if kind == "append":
            copies = manager.reserve(seq, 1)
            wrote.setdefault(seq, []).append(op[2])
            writer[op[2]] = (seq, i)
        elif kind == "fork":
            manager.fork(seq, op[2])
            copies, wrote[op[2]] = [], list(wrote[seq])
        else:
            manager.release(seq)
            copies = []
            del wrote[seq]
        where, story = f"{name} (pages of {P}), op {i}: {_op(op)}", _story(ops, i)
        if kind == "append":                             # the page written is the writer's alone
            page = rec["tables"][seq][-1] if rec["tables"].get(seq) else None
            others = [s for s, t in rec["tables"].items() if s != seq and page in t]
            assert not others, (
                f"{where}: your append wrote into page {page}, which sequence {others[0]} holds too: a shared page "
                "is read-only (the other sequence's positions past its length live there as well); a write into a "
                f"shared, partly filled page takes a copy of it first, whichever sequence writes. {story}")
        for s, values in wrote.items():
            try:
                _read_back(where, s, values, rec["tables"][s], rec["contents"], P, writer)
            except AssertionError as e:
                raise AssertionError(f"{e}. {story}") from None
        if rec["copies"] > len(copies):
            if kind == "fork":
                why = ("a fork copies nothing: the new sequence's block table lists its source's pages, each "
                       "counted once more, until one of them writes")
            elif kind == "release":
                why = "a release copies nothing"
            elif copies:
                why = ("only the partly filled last page is written, so only it is copied; the full pages before it "
                       "are never written again and stay shared")
            elif length % P == 0:
                why = f"the sequence's {length} positions fill their pages, so the write goes to a new page"
            else:
                why = ("no other sequence holds the sequence's last page now, so the write goes in place: copy only a "
                       "page whose reference count is above 1 (from a fork until the others release it or take "
                       "copies). If your count says otherwise: a copy on write moves one reference from the shared "
                       "page to the copy, and a release takes one off each page")
            raise AssertionError(f"{where}: your {kind} copied {rec['copies']} page(s) (pool.copy), "
                                 f"{len(copies)} suffice: {why}. {story}")
        in_use = manager.num_pages - manager.num_free
        if rec["in_use"] > in_use:
            why = {"fork": "a fork shares every page of its source (one reference more each) and takes none",
                   "append": ("a write takes one page at most: a new one when the sequence's last page is full, or a "
                              "copy of a shared, partly filled last page"),
                   "release": ("a page goes back to the pool (pool.give) when no sequence holds it any more. Is every "
                               "reference count right? A copy on write moves one reference from the shared page "
                               "to the copy")}[kind]
            raise AssertionError(f"{where}: {rec['in_use']} pages in use after it (taken and not given back), "
                                 f"the sequences' positions need {in_use}: {why}. {story}")
    manager.check()


def check_copy_on_write(make_pages, seed=None) -> dict:
    """make_pages(pool) -> a page manager of your own for sequences of positions, kept in `pool`'s pages (a `Pool`:
    pool.page_size, pool.take() -> page, pool.give(page), pool.write(page, offset, value), pool.copy(src, dst),
    pool.read(page)). Its methods:

        append(seq, value)       write one more position of sequence `seq` (a new id starts empty)
        fork(src, dst)           a new sequence `dst` that holds everything `src` holds
        release(seq)             `seq` is done: the pages no sequence holds any more go back (pool.give)
        block_table(seq) -> list the pages of `seq`'s positions in order: position p in page table[p // page_size]
                                 at offset p % page_size

    The rules: a fork shares its source's pages, counted (one reference count per page), and copies nothing;
    a write into a page another sequence holds, partly filled, first copies that page (copy on write), and
    copies nothing else; full pages are never copied. lab's BlockManager (and the pools built on it) raise while
    your manager runs.

    The check draws four traces from `seed` (`fork_traces`: a prompt forked into three answers, random forks
    and releases, pages of one position, beam steps) and runs your manager on each, reading every live
    sequence through its block table after every op. Only then does it replay them through plain lists (what
    each sequence wrote) and a BlockManager (the pages held and copied), and fails the first op after which:
    - a sequence wrote into a page another sequence holds (a shared page is read-only);
    - a sequence reads anything but what it wrote (a write leaked into a page another sequence holds);
    - an op copied more pages than BlockManager's copy on write (a fork copies none, a write one at most);
    - more pages are in use than BlockManager holds (copies at a fork, or a page not given back).
    """
    assert callable(make_pages), (
        f"check_copy_on_write takes a class (or a function) that makes a page manager from a pool, not "
        f"{make_pages!r:.40}")
    seed = fresh_seed(seed)
    traces = fork_traces(seed)
    with drawn_with(seed, "check_copy_on_write"):
        with unchanged(__name__), functions_raise(*MANAGERS, _check_pages_trace, why=NO_MANAGER):
            records = [_run_pages(make_pages, P, ops) for _, P, ops in traces]
        for (name, P, ops), record in zip(traces, records, strict=True):
            _check_pages_trace(name, P, ops, record)
    copies = [sum(r["copies"] for r in record) for record in records]
    done = [f"{name}: {len(ops)} ops, {c} copies" for (name, _, ops), c in zip(traces, copies, strict=True)]
    print(f"correct ({'; '.join(done)}; traces drawn with seed={seed})")
    return dict(seed=seed, ops=[len(ops) for _, _, ops in traces], copies=copies)


# ---- exercise 2: merge two partial attentions ------------------------------------------------------------------

_CASCADE = sys.modules[merge_attention.__module__]
# everything the library's cascade module defines (merge_attention, attention_lse, the cascade kernels' Python):
# raises while your merge runs
CASCADE_LIBRARY = tuple(v for v in vars(_CASCADE).values()
                        if isinstance(v, types.FunctionType) and v.__module__ == _CASCADE.__name__)
NO_MERGE = ("forbidden shortcut: this exercise asks you to merge the two parts yourself, not to call the library's "
            "merge_attention or attention_lse")
# Tolerances: the partial results are worked out in float64 and handed over in float32. An lse rounded to float32
# is off by up to half a unit in the last place, 3e-5 below 1024 (on 200 draws |lse| stays below 640), so a
# weight exp(lse_i - m) is off by that share and the output by that share of |out_1 - out_2| (below 6.3 on those
# draws): 2e-4. The merge's own float32 arithmetic adds a few units of 1e-7. A wrong merge (a plain average,
# weights by the number of positions) is off by 0.05 or more.
OUT_ATOL = 5e-4
LSE_RTOL, LSE_ATOL = 1e-5, 1e-5
SCORE = 200             # the score of a key along (or against) the queries, in the cases that need one
HUGE = 800              # such a score past 709.8, where exp overflows even in float64


def attention64(q, k, v) -> tuple:
    """Attention of queries over one set of positions in float64, and the log-sum-exp of the scores: the check's
    own, written out (the query head h reads the kv head h // (H_q / H_kv), the scale 1 / sqrt(D)).

    q [N, H_q, D]; k, v [T, H_kv, D] (T may be 0). Returns out [N, H_q, D], lse [N, H_q]; over no positions,
    out 0 and lse -inf."""
    N, H_q, D = q.shape
    G = H_q // k.shape[1]
    k, v = k.double().repeat_interleave(G, 1), v.double().repeat_interleave(G, 1)     # [T, H_q, D]
    s = torch.einsum("nhd,thd->nht", q.double(), k) / math.sqrt(D)                   # [N, H_q, T]
    lse = torch.logsumexp(s, -1)                                                     # [N, H_q]
    out = torch.einsum("nht,thd->nhd", torch.exp(s - lse[..., None]), v)             # [N, H_q, D]
    return out.nan_to_num(0.0), lse


def merge_cases(seed) -> list[dict]:
    """Eleven cases drawn from `seed`: name, q [N, H_q, D], k, v [T, H_kv, D] (float32), and `first`, a bool [T] that
    splits the positions into two sets (every query attends over both). Grouped heads (H_q a multiple of H_kv), N
    1..16, D 8..64, T 6..300:

    - a prefix and the rest; positions scattered between the two sets; one position against many;
    - the first set empty, the second set empty (a set of no positions: lse -inf, out 0);
    - large scores (queries 100 x longer: lse in the hundreds, where exp overflows float32, above 88.7);
    - scores far below zero (keys pointing away from the queries: lse near -SCORE, where exp underflows to 0);
    - one set far above the other (keys along the queries in the first set: its lse near SCORE, the other's
      below 30), and the second far above the first;
    - scores past float64's exp (lse near HUGE, 800: exp overflows even in float64);
    - many heads and queries (N 16, H_q 32, H_kv 8, D 64).
    """
    rng, g = random.Random(seed), torch.Generator().manual_seed(seed)
    randn = lambda *shape: torch.randn(*shape, generator=g)                          # noqa: E731

    def case(name, first, N=None, heads=None, D=None, q_scale=1.0, toward=None, score=SCORE):
        """toward: per position, 1 for a key along its kv head's queries (a score near +score), -1 for one against
        them (near -score), 0 for a random key."""
        T, N, D = len(first), N or rng.randint(1, 6), D or rng.choice((8, 16, 32))
        H_q, H_kv = heads or rng.choice(((8, 2), (4, 4), (6, 1), (9, 3)))
        q, k, v = q_scale * randn(N, H_q, D), randn(T, H_kv, D), randn(T, H_kv, D)
        if toward is not None:
            u = randn(H_kv, D)
            u = u / u.norm(dim=-1, keepdim=True) * (score * math.sqrt(D)) ** 0.5      # u . u / sqrt(D) = score
            q = u.repeat_interleave(H_q // H_kv, 0) + 0.1 * randn(N, H_q, D)         # [N, H_q, D]
            along = toward[:, None, None].float()                                    # [T, 1, 1]
            k = torch.where(along == 0, k, along * u + 0.1 * randn(T, H_kv, D))      # [T, H_kv, D]
        return dict(name=name, q=q, k=k, v=v, first=first)

    def split(T, p):                                       # each position in the first set with probability p
        first = torch.rand(T, generator=g) < p
        first[0], first[-1] = True, False                  # both sets hold a position
        return first

    T = [rng.randint(20, 300) for _ in range(11)]
    return [case("a prefix and the rest", torch.arange(T[0]) < rng.randint(1, T[0] - 1)),
            case("positions scattered between the two sets", split(T[1], rng.uniform(0.2, 0.8))),
            case("one position against many", torch.arange(T[2]) == rng.randrange(T[2])),
            case("the first set empty", torch.zeros(T[3] // 3, dtype=torch.bool)),
            case("the second set empty", torch.ones(T[4] // 3, dtype=torch.bool)),
            case("large scores", split(T[5], 0.5), q_scale=100.0),
            case("scores far below zero", split(T[6], 0.5), toward=-torch.ones(T[6])),
            case("one set far above the other", first := split(T[7], 0.3), toward=first.float()),
            case("the second set far above the first", first := split(T[9], 0.7), toward=(~first).float()),
            case("scores past float64's exp", first := split(T[10], 0.5), toward=first.float(), score=HUGE),
            case("many heads and queries", split(T[8], 0.5), N=16, heads=(32, 8), D=64)]


def _parts(case) -> tuple:
    """The two sets' partial attentions, float32 as a kernel hands them over: (out_1, lse_1, out_2, lse_2)."""
    q, k, v, first = case["q"], case["k"], case["v"], case["first"]
    out_1, lse_1 = attention64(q, k[first], v[first])
    out_2, lse_2 = attention64(q, k[~first], v[~first])
    return tuple(x.float() for x in (out_1, lse_1, out_2, lse_2))


def _worst(err) -> tuple:
    """(row, head) of the largest entry of `err` [N, H_q, ...] (nan counts as the largest)."""
    at = int(err.double().reshape(err.shape[0] * err.shape[1], -1).nan_to_num(float("inf")).amax(-1).argmax())
    return divmod(at, err.shape[1])


def _check_merge_case(j, case, parts, got):
    """The verdict on one case: the merge of `parts` against attention64 over every position."""
    out_1, lse_1, out_2, lse_2 = (x.double() for x in parts)
    n_1, n_2 = int(case["first"].sum()), int((~case["first"]).sum())
    N, H_q, D = case["q"].shape
    where = (f"case {j}, {case['name']} ({n_1} + {n_2} positions; q [{N}, {H_q}, {D}], {case['k'].shape[1]} kv "
             "heads)")
    assert isinstance(got, tuple | list) and len(got) == 2 and all(isinstance(x, torch.Tensor) for x in got), (
        f"{where}: merge must return (out, lse), two tensors, got {type(got).__name__}")
    out, lse = got
    assert out.dtype == parts[0].dtype and lse.dtype == parts[1].dtype, (
        f"{where}: merge returned out {out.dtype} and lse {lse.dtype}; keep the dtype of out_1 and lse_1 "
        f"({parts[0].dtype}): a kernel's merge writes back into the same buffers")
    assert out.shape == parts[0].shape and lse.shape == parts[1].shape, (
        f"{where}: merge returned out {list(out.shape)} and lse {list(lse.shape)}; they have the shapes of out_1 "
        f"{list(parts[0].shape)} and lse_1 {list(parts[1].shape)}")
    want_out, want_lse = attention64(case["q"], case["k"], case["v"])
    out, lse = out.double(), lse.double()

    def at(n, h):
        return f"query {n}, head {h}: lse_1 = {float(lse_1[n, h]):.6g}, lse_2 = {float(lse_2[n, h]):.6g}"

    if not torch.isfinite(out).all():
        n, h = _worst(~torch.isfinite(out))
        raise AssertionError(
            f"{where}: your out holds {float(out[n, h][~torch.isfinite(out[n, h])][0])} at {at(n, h)}, "
            "where attention over the union is finite. In float32 exp(lse) overflows to inf above 88.7 and "
            "underflows to 0 below -103 (and exp(-inf) is 0, for a set of no positions): subtract the larger lse "
            "before exp, so that the larger weight is exp(0) = 1 and neither can overflow or both vanish")
    err = float((out - want_out).abs().max())
    if err > OUT_ATOL:
        mean = (out_1 + out_2) / 2
        counted = (n_1 * out_1 + n_2 * out_2) / (n_1 + n_2)
        hint = ("Each part's output is the average of its values under its own softmax; the union's softmax "
                "weighs a part by its share of the union's denominator, exp(lse_i) / (exp(lse_1) + exp(lse_2))")
        if torch.allclose(out, mean, atol=OUT_ATOL):
            hint = "That is the plain average of the two outputs. " + hint
        elif torch.allclose(out, counted, atol=OUT_ATOL):
            hint = ("That is the two outputs weighted by their numbers of positions, as if every score were equal: "
                    "a position's weight is exp(its score), not 1. ") + hint
        worst = at(*_worst((out - want_out).abs()))
        raise AssertionError(f"{where}: your out differs from attention over all {n_1 + n_2} positions by "
                             f"{err:.3g} (rounding stays below {OUT_ATOL:g}), worst at {worst}. {hint}")
    if not torch.allclose(lse, want_lse, rtol=LSE_RTOL, atol=LSE_ATOL):
        n, h = _worst(((lse - want_lse).abs() / (LSE_ATOL + LSE_RTOL * want_lse.abs()))[..., None])
        raise AssertionError(
            f"{where}: your lse is {float(lse[n, h]):.7g} at query {n}, head {h}, where the log-sum-exp of every "
            f"score is {float(want_lse[n, h]):.7g} (lse_1 = {float(lse_1[n, h]):.7g}, lse_2 = "
            f"{float(lse_2[n, h]):.7g}): the union's lse is log(exp(lse_1) + exp(lse_2)), worked out as "
            "m + log(exp(lse_1 - m) + exp(lse_2 - m)) with m the larger, so that a third part can be merged in next")


def check_merge(merge, seed=None) -> dict:
    """merge(out_1, lse_1, out_2, lse_2) -> (out, lse): attention over two disjoint sets of positions from each
    set's own, out_i [N, H_q, D] (float32) and lse_i [N, H_q], the log-sum-exp of the set's scores,
    log sum_t exp(q . k_t / sqrt(D)). A set of no positions has lse -inf and out 0 (never both sets).

    The rules: your merge sees the partial results only, never the queries or keys; lab's merge_attention and
    attention_lse (every function of lab/kernels/cascade.py) raise while it runs. The check draws eleven cases from
    `seed` (`merge_cases`: a prefix and the rest, scattered positions, one position against many, an empty set on
    either side, scores in the hundreds, far below zero, one set far above the other, many grouped heads), hands
    your merge each case's partial results (worked out in float64, handed over in float32), and only then works
    out attention over the union of the two sets (`attention64`); it fails the first case whose out differs by
    more than OUT_ATOL or whose lse differs by more than LSE_RTOL x |lse| + LSE_ATOL, or where your out holds inf
    or nan.
    """
    assert callable(merge), f"check_merge takes your merge function, not {merge!r:.40}"
    seed = fresh_seed(seed)
    cases = merge_cases(seed)
    parts = [_parts(case) for case in cases]
    with drawn_with(seed, "check_merge"):
        with unchanged(__name__), functions_raise(*CASCADE_LIBRARY, attention64, why=NO_MERGE):
            got = [merge(*(x.clone() for x in p)) for p in parts]
        for j, (case, p, g) in enumerate(zip(cases, parts, got, strict=True)):
            _check_merge_case(j, case, p, g)
    lse = torch.cat([torch.cat((p[1], p[3])).flatten() for p in parts])
    lse = lse[lse.isfinite()]
    print(f"correct ({len(cases)} cases, partial lse from {float(lse.min()):.0f} to {float(lse.max()):.0f}; cases "
          f"drawn with seed={seed})")
    return dict(seed=seed, cases=len(cases))


# ---- exercise 3: reorder beams by their block tables -----------------------------------------------------------

def _beam_step(manager, values, seqs, parents, fresh, ids) -> tuple[list, list]:
    """One beam step on a BlockManager and a pool of values (a list, slot -> value): the beams no parent names
    released, those named twice or more forked (as sequence next(ids)), then every new beam reserves its next
    position, its copies on write done on `values`, and writes next(fresh) there. Returns the new beams' sequence
    ids and the copies."""
    chosen = Counter(parents)
    for b, seq in enumerate(seqs):
        if not chosen[b]:
            manager.release(seq)
    taken, new, copies = set(), [], []
    for b in parents:
        if b in taken:
            new.append(next(ids))
            manager.fork(seqs[b], new[-1])
        else:
            new.append(seqs[b])
            taken.add(b)
    P = manager.page_size
    for seq in new:
        for src, dst in manager.reserve(seq, 1):
            values[dst * P:(dst + 1) * P] = values[src * P:(src + 1) * P]
            copies.append((src, dst))
        values[manager.slots(seq, manager.length(seq) - 1, 1)[0]] = next(fresh)
    return new, copies


def _beam_case(rng, fresh, name, P, k, prompt, steps, parents=None) -> dict:
    """A beam search's state after `steps` steps of k beams from a prompt of `prompt` positions (random parents),
    and the next step's parents (random unless given). The pool has room for every beam to copy its whole cache."""
    length = prompt + steps
    manager = BlockManager(2 * k * pages_for(length + 1, P) + 4, P)
    values = [None] * (manager.num_pages * P)
    manager.reserve(0, prompt)
    for slot in manager.slots(0, 0, prompt):
        values[slot] = next(fresh)
    seqs, ids = [0], itertools.count(1)
    for _ in range(steps):
        seqs, _ = _beam_step(manager, values, seqs, [rng.randrange(len(seqs)) for _ in range(k)], fresh, ids)
    return dict(name=name, page_size=P, manager=manager, values=values, seqs=seqs, ids=ids,
                tables=[manager.block_table(s) for s in seqs], lengths=[manager.length(s) for s in seqs],
                refs=[manager.refs(p) for p in range(manager.num_pages)], free=manager.free_pages(),
                parents=parents or [rng.randrange(len(seqs)) for _ in range(k)])


def beam_cases(seed) -> list[dict]:
    """Seven beam states drawn from `seed`, each with the next step's parents (dicts: name, page_size, tables,
    lengths, refs, free, parents; and the check's own: the BlockManager that holds the state, the pool's values):

    - the prompt, forked into 3 or 4 beams: it ends inside a page (pages of 2..4), which every beam writes;
    - two beams, one continued twice and the other dropped, the length inside a page;
    - a step after a full page (the beams' lengths fill their pages: no copy, a new page each);
    - pages of one position (every page full: nothing is ever copied);
    - three random states: pages of 2..8, 2..6 beams, prompts of 1..40, 1..12 steps before.
    """
    rng, fresh = random.Random(seed), iter(range(1000, 10**9))
    P = rng.randint(2, 4)
    k, prompt = rng.randint(3, 4), P * rng.randint(1, 2) + rng.randint(1, P - 1)
    cases = [_beam_case(rng, fresh, "the prompt, forked", P, k, prompt, 0, parents=[0] * k)]
    P = rng.randint(2, 4)
    prompt, steps = rng.randint(P + 1, 3 * P), rng.randint(1, 3)
    steps += (prompt + steps) % P == 0                                               # the length inside a page
    b = rng.randrange(2)
    cases.append(_beam_case(rng, fresh, "one beam continued twice, the other dropped", P, 2, prompt, steps,
                            parents=[b, b]))
    P = rng.randint(2, 4)
    prompt, k = rng.randint(1, 3 * P), rng.randint(3, 4)
    steps = rng.randint(1, 2) * P - prompt % P                                       # the length fills its pages
    cases.append(_beam_case(rng, fresh, "a step after a full page", P, k, prompt, steps,
                            parents=sorted(rng.choices(range(k), k=k))))
    cases.append(_beam_case(rng, fresh, "pages of one position", 1, 4, rng.randint(1, 10), rng.randint(1, 5)))
    for _ in range(3):
        cases.append(_beam_case(rng, fresh, "a random state", rng.randint(2, 8), rng.randint(2, 6),
                                rng.randint(1, 40), rng.randint(1, 12)))
    return cases


def _describe(case) -> str:
    tables = "; ".join(f"beam {b}: {_show(t)}" for b, t in enumerate(case["tables"]))
    return (f"{_count(len(case['tables']), 'beam')} of {case['lengths'][0]} positions, pages of "
            f"{case['page_size']}, parents {case['parents']}; block tables {tables}")


def _run_beams(reorder, case) -> dict:
    """The reader's step on copies of the case's state: their new tables and copies, and the refs and free list
    as their step left them."""
    refs, free = list(case["refs"]), list(case["free"])
    new_tables, copies = reorder([list(t) for t in case["tables"]], list(case["lengths"]), list(case["parents"]),
                                 refs, free, case["page_size"])
    return dict(tables=[list(t) for t in new_tables], copies=[tuple(c) for c in copies], refs=refs, free=free)


def _check_beam_case(j, case, got):
    """The verdict on one case: the shapes, then every new beam's contents on a pool of values after the copies and
    the writes, then the reference counts and free list, then the copies against the fewest copy on write needs."""
    P, parents, lengths, tables = case["page_size"], case["parents"], case["lengths"], case["tables"]
    where = f"case {j}, {case['name']} ({_describe(case)})"
    num_pages, new_tables, copies = len(case["refs"]), got["tables"], got["copies"]
    is_page = lambda p: hasattr(p, "__index__") and not isinstance(p, bool) and 0 <= p < num_pages  # noqa: E731
    assert len(new_tables) == len(parents), (
        f"{where}: you returned {len(new_tables)} block tables for {len(parents)} new beams (one per parent)")
    for i, (table, b) in enumerate(zip(new_tables, parents, strict=True)):
        need = pages_for(lengths[b] + 1, P)
        assert len(table) == need and all(map(is_page, table)), (
            f"{where}: new beam {i}'s block table is {_show(table)}; it holds its parent's {lengths[b]} positions and "
            f"room for the next, {need} pages of the pool (0 .. {num_pages - 1}): a page from `free` where the "
            "parent's last page is full")
    assert all(len(c) == 2 and is_page(c[0]) and is_page(c[1]) for c in copies), (
        f"{where}: copies must be (src, dst) pairs of pages, got {_show(copies)}")
    # the contents: the copies done in order, then every new beam writes its next position
    values = list(case["values"])
    for src, dst in copies:
        values[dst * P:(dst + 1) * P] = values[src * P:(src + 1) * P]
    for i, (table, b) in enumerate(zip(new_tables, parents, strict=True)):
        values[table[lengths[b] // P] * P + lengths[b] % P] = f"new beam {i}'s token"
    for i, (table, b) in enumerate(zip(new_tables, parents, strict=True)):
        want = [values_of(case, b, p) for p in range(lengths[b])] + [f"new beam {i}'s token"]
        for p, w in enumerate(want):
            page = table[p // P]
            g = values[page * P + p % P]
            if g == w:
                continue
            message = (f"{where}: new beam {i} (continuing beam {b}) reads {g!r} at position {p} (page {page}), "
                       f"not {w!r}")
            if isinstance(g, str):
                message += (f": two new beams write position {p} into page {page}, which both hold. A page that two "
                            "new beams hold and both write must be copied first (one keeps it, each other takes a "
                            "copy)")
            elif g is None:
                message += (": nothing was written there. A page taken from `free` holds nothing until a copy "
                            "(src, dst) fills it, before the beam writes")
            raise AssertionError(message)
    # the bookkeeping: refs count the new tables, free holds exactly the pages none of them holds
    held = Counter(p for t in new_tables for p in t)
    for i, t in enumerate(new_tables):
        assert len(set(t)) == len(t), f"{where}: new beam {i}'s block table lists a page twice: {_show(t)}"
    for page in range(num_pages):
        owners = [b for b, t in enumerate(tables) if page in t]
        dropped = [b for b in owners if b not in parents]
        assert got["refs"][page] == held[page], (
            f"{where}: refs[{page}] is {got['refs'][page]}, but {held[page]} new block tables hold page {page} (old "
            f"beam(s) {owners} held it, " + (f"{dropped} dropped" if dropped else "none of them dropped") + "): a "
            "page's count is the number of tables that hold it: a dropped beam's pages each lose one, and a beam "
            "continued c times counts c times")
    free, unheld = sorted(got["free"]), sorted(p for p in range(num_pages) if not held[p])
    if free != unheld:
        lost = sorted(set(unheld) - set(free))
        assert not lost, (
            f"{where}: page {lost[0]} is held by no new beam (it was beam(s) "
            f"{[b for b, t in enumerate(tables) if lost[0] in t]}'s) but is not in `free`: a page whose count drops "
            "to 0 goes back to the free list, or the pool loses it")
        extra = Counter(free) - Counter(unheld)
        raise AssertionError(f"{where}: `free` lists page {min(extra)}, which " + (
            "a new beam holds: take a page out of `free` when you use it" if held[min(extra)] else
            "it already listed: a page is free once"))
    # economy: only a partly filled last page, shared by the new beams that write it, is copied: one copy fewer
    # than its writers
    writers = Counter(tables[b][-1] for b in parents if lengths[b] % P)        # partly filled page -> its writers
    made = Counter(src for src, _ in copies)
    for src, n in made.items():
        if src not in writers:
            b, at = next(((b, t.index(src)) for b, t in enumerate(tables) if src in t), (None, None))
            full = b is not None and (at + 1) * P <= lengths[b]
            raise AssertionError(f"{where}: you copied page {src}, " + (
                f"beam {b}'s page {at}, which is full (positions {at * P} .. {at * P + P - 1}): a full page is never "
                "written again, so every beam that descends from it shares it. Only a shared, partly filled last "
                "page is copied (transformers' index_select copies every beam's whole cache at every step)" if full
                else "a page no new beam writes: copy only a partly filled last page that new beams share"))
        if n > writers[src] - 1:
            b = next(b for b in parents if tables[b][-1] == src)
            raise AssertionError(
                f"{where}: you copied page {src}, beam {b}'s partly filled last page, {n} time(s); {writers[src]} new "
                f"beam(s) write into it, so {writers[src] - 1} cop{'y' if writers[src] == 2 else 'ies'} suffice: the "
                "last of them writes the page itself, once the others hold their copies (a page only one beam "
                "holds is written in place)")
    manager = case["manager"]
    _, want = _beam_step(manager, list(case["values"]), case["seqs"], parents, iter(range(len(parents))),
                         case["ids"])
    in_use = manager.num_pages - manager.num_free
    assert len(held) <= in_use and len(copies) <= len(want), (
        f"{where}: your step holds {len(held)} pages and made {len(copies)} copies; BlockManager's copy on write "
        f"holds {in_use} and makes {len(want)}")


def values_of(case, beam, position):
    """What old `beam` holds at `position`, read from the case's pool of values through its block table."""
    P = case["page_size"]
    return case["values"][case["tables"][beam][position // P] * P + position % P]


def check_beam_reorder(reorder, seed=None) -> dict:
    """reorder(tables, lengths, parents, refs, free, page_size) -> (new_tables, copies): move the beams of a beam
    search to the next step by their block tables.

    tables[b] lists old beam b's pages, holding its lengths[b] positions (page_size each); refs[page] counts the
    tables that hold each page of the pool, and `free` lists the pages no table holds. New beam i continues old
    beam parents[i] (a beam named twice or more is continued by each; a beam named by none is dropped). Return
    new_tables[i], beam i's pages: its parent's positions and room for the next one, and `copies`, the (src, dst)
    page copies to do before every new beam writes its next position. Update refs and free in place, as a block
    manager would: a page's count is the number of new tables that hold it, and `free` lists exactly the pages
    none holds (take the pages you use out of it, put back those that no table holds any more).

    The rules: a full page is never copied (every beam that descends from it shares it); a partly filled last page
    that new beams write is copied once for each of them but one; a dropped beam's pages go back to `free` when
    no other beam holds them. lab's BlockManager (and the pools built on it) raise while your function runs.

    The check draws seven states from `seed` (`beam_cases`: the prompt forked into beams, a beam continued twice
    and one dropped, a step after a full page, pages of one position, three random states) and runs your function
    on a copy of each. Then it does your copies on a pool of values, writes every new beam's next position, and
    fails the first case where: a new beam reads anything but its parent's positions and its own token; refs or
    free disagree with the new tables; a full page is copied, or a partly filled one more often than it must be;
    or the step holds more pages or copies more than BlockManager's copy on write does on the same step.
    """
    assert callable(reorder), f"check_beam_reorder takes your function, not {reorder!r:.40}"
    seed = fresh_seed(seed)
    cases = beam_cases(seed)
    with drawn_with(seed, "check_beam_reorder"):
        with unchanged(__name__), functions_raise(*MANAGERS, _beam_step, _check_beam_case, why=NO_MANAGER):
            runs = [_run_beams(reorder, case) for case in cases]
        for j, (case, got) in enumerate(zip(cases, runs, strict=True)):
            _check_beam_case(j, case, got)
    copied = sum(len(r["copies"]) for r in runs)
    whole = sum(len(c["tables"][b]) for c in cases for b in c["parents"])
    print(f"correct ({len(cases)} steps: {copied} pages copied, where reordering every beam's whole cache "
          f"(index_select) copies {whole}; cases drawn with seed={seed})")
    return dict(seed=seed, copies=copied, index_select_pages=whole)
