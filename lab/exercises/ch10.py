"""Chapter 10 exercises: attention in a latent's own coordinates (the absorbed form), the pages a local layer's
group holds in a hybrid pool, and (open-ended) how low the latent's rank can go.

Exercise 1 runs the reader's latent attention on cases drawn fresh at every run (`seed=` draws the same ones
again) while the library's own absorbed and reconstructing forms raise, watches every tensor torch produces on
the way, and compares the output with attention over keys and values rebuilt from the latents. A keys or values
tensor rebuilt from the latents fails, whether whole or a position at a time: the point of the absorbed form is
that it never exists. Exercise 2 asks for the most pages one sequence's local group holds while it grows, and
compares the reader's number with the real HybridBlockManager's, run after the reader answered (while the reader's
function runs, the manager raises). Exercise 3 measures, and sets the number beside the book's.
"""

import math
import random

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..cache import ConcatCache
from ..cache.block_manager import pages_for
from ..cache.hybrid import HybridBlockManager
from ..data import passages
from ..metrics import quality, reference
from ..models import load
from ..models import retrofit as rf
from ..results import COMMITTED, ResultsKeyError
from . import compare_with_book
from .rules import drawn_with, fresh_seed, functions_raise, unchanged

# ---- exercise 1: the absorbed query ------------------------------------------------------------------------

# The shapes of every case, chosen so that a tensor's shape says what it holds. A dimension is one axis or several
# flattened: the KV groups (H_KV = 2), the query heads of a group (3; H_Q = 6 is both), the queries (T = 5), the
# latent (R = 9), the positions (L) and a head's channels (D). L, a prime above 150, divides no product of the
# others; D = 16 = 2^4 divides none either (the others hold a single factor 2 in all). So a tensor with a
# dimension divisible by L and one divisible by D (the same one, flattened) holds something of every position in
# every channel of a head: keys or values rebuilt from the latents.
LENGTHS = (157, 211, 263)   # L of each case: prime, so that the rebuilt work a case costs grows with it
D = 16                      # head_dim
R = 9                       # the rank of each latent: c_k and c_v hold R values per position
H_KV, H_Q = 2, 6            # KV heads, query heads: each KV group serves H_Q / H_KV = 3 query heads
T = 5                       # queries, at positions L - T .. L - 1 (a verify step; T > 1 so the mask matters)
KEY_SCALE = 5.0             # c_k's spread: scores of standard deviation about 2.6 (softmax neither flat nor one-hot)
# The reader's float32 output against the float64 oracle: the same sums in another order, rounded to float32 (the
# reference: 3e-7 to 1.4e-6 on 300 seeds, outputs of order 1; tests/test_exercises_ch10.py measures it). The
# scale 1/sqrt(r), the wrong KV group, no mask or a mask one position short miss by more than 1.4e-2 on some case
# of every one of those seeds: ATOL lies 70 x above rounding and 140 x below the smallest mistake.
ATOL = 1e-4

LIBRARY_FORMS = (rf.absorb_query, rf.expand_output, rf.reconstructing, rf.from_latent)


def latent_cases(seed) -> list[dict]:
    """One case per L in LENGTHS, drawn from `seed`, float32: queries q `[H_Q, T, D]`, the orthonormal bases
    U_k, U_v `[H_KV * D, R]` (QR of a normal matrix), and the latents c_k `[L, R]` (spread KEY_SCALE) and c_v
    `[L, R]`. Any key k in the span of U_k has c_k = U_k^T k; what attention reads is U_k c_k."""
    g, cases = torch.Generator().manual_seed(seed), []
    for L in LENGTHS:
        U_k = torch.linalg.qr(torch.randn(H_KV * D, R, generator=g, dtype=torch.float64))[0].float()
        U_v = torch.linalg.qr(torch.randn(H_KV * D, R, generator=g, dtype=torch.float64))[0].float()
        cases.append(dict(q=torch.randn(H_Q, T, D, generator=g), c_k=KEY_SCALE * torch.randn(L, R, generator=g),
                          c_v=torch.randn(L, R, generator=g), U_k=U_k, U_v=U_v))
    return cases


def latent_oracle(q, c_k, c_v, U_k, U_v, group_size) -> torch.Tensor:
    """Attention as the original model computes it, in float64: keys and values rebuilt from the latents
    (k = U_k c_k, v = U_v c_v, `[H_KV, L, D]`), then scaled dot-product attention of each query head over its KV
    group's, the query at position L - T + i seeing positions 0 .. L - T + i. -> `[H_Q, T, D]`."""
    L, (_, Tq, Dh) = c_k.shape[0], q.shape
    k, v = ((c.double() @ U.double().T).view(L, -1, Dh).transpose(0, 1) for c, U in ((c_k, U_k), (c_v, U_v)))
    sees = torch.arange(L)[None, :] <= torch.arange(L - Tq, L)[:, None]                     # [T, L]
    k, v = k.repeat_interleave(group_size, 0), v.repeat_interleave(group_size, 0)           # [H_Q, L, D]
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=sees)


class WatchRebuilt(TorchDispatchMode):
    """Sees the outputs of every torch operation while inside. `rebuilt` names the first tensor whose shape holds
    L positions and D channels (a dimension divisible by L and one by D); `derived` holds every tensor computed
    from the latents (their storages, so a write into a buffer counts), and `derived_width` adds up the elements
    of those with a dimension divisible by D: the absorbed form makes the same few whatever L is, a form that
    rebuilds keys or values a position (or a block) at a time makes at least L x D of them."""

    def __init__(self, latents, L, D):
        super().__init__()
        self.L, self.D, self.rebuilt, self.derived_width = L, D, None, 0
        self.derived = {}                                      # storage pointer -> a tensor that keeps it alive
        for t in latents:
            self._mark(t)

    def _key(self, t):
        try:
            return t.untyped_storage().data_ptr() or id(t)
        except (RuntimeError, NotImplementedError):
            return id(t)

    def _mark(self, t):
        self.derived[self._key(t)] = t

    def is_derived(self, t) -> bool:
        return isinstance(t, torch.Tensor) and self._key(t) in self.derived

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        from_latents = any(self.is_derived(x) for x in tree_leaves((args, kwargs)))
        for o in tree_leaves(out):
            if not isinstance(o, torch.Tensor):
                continue
            shape = tuple(o.shape)
            by_l = any(n and n % self.L == 0 for n in shape)
            by_d = any(n and n % self.D == 0 for n in shape)
            if by_l and by_d and self.rebuilt is None:
                self.rebuilt = f"{func} made a tensor of shape {list(shape)}"
            if from_latents:
                self._mark(o)
                if by_d:
                    self.derived_width += o.numel()
        return out


def _run_latent(attend, case):
    """The reader's output on one case (inputs are copies), and what the watch saw."""
    L = case["c_k"].shape[0]
    args = {k: t.clone() for k, t in case.items()}
    watch = WatchRebuilt((args["c_k"], args["c_v"]), L, D)
    with unchanged(__name__), functions_raise(*LIBRARY_FORMS), watch:
        out = attend(args["q"], args["c_k"], args["c_v"], args["U_k"], args["U_v"], H_Q // H_KV)
    assert isinstance(out, torch.Tensor), f"latent_attention must return a tensor, got {type(out).__name__}"
    assert tuple(out.shape) == (H_Q, T, D), (
        f"latent_attention returned shape {list(out.shape)} for {H_Q} query heads, {T} queries of {D} channels: "
        f"expected [{H_Q}, {T}, {D}], the output turned back from latent space into each head's values")
    assert watch.rebuilt is None, (
        f"keys or values were rebuilt from the latents: {watch.rebuilt}, {L} positions by a multiple of "
        f"head_dim {D}. That is the reconstructing form; turn the queries into latent coordinates instead "
        "(q_h . U_k,g c = (U_k,g^T q_h) . c) and the output back once (U_v,g times the weighted sum of c_v)")
    assert watch.is_derived(out), (
        "your output was not computed from c_k and c_v by torch operations on the tensors given (the check "
        "watches them to see what your function builds): compute it with torch, from the arguments")
    return out, watch.derived_width


def check_latent_attention(attend, seed=None) -> dict:
    """attend(q, c_k, c_v, U_k, U_v, group_size) -> `[H_q, T, D]`: one layer's attention, computed in latent space.

    q `[H_q, T, D]`: the queries of positions L - T .. L - 1 after RoPE; c_k, c_v `[L, r]`: the cached latents of
    that layer's keys and values, c_k = U_k^T k with k the keys of all H_kv KV heads side by side `[L, H_kv D]`;
    U_k, U_v `[H_kv D, r]`; query head h reads KV group h // group_size. Turn each query head into latent
    coordinates with its group's block of U_k (rows g D .. (g + 1) D - 1), attend over c_k and c_v with the
    model's scale 1 / sqrt(D) and the causal mask (the query at L - T + i sees positions 0 .. L - T + i), and
    turn the output back with the group's block of U_v.

    The check draws three cases from `seed` (L = 157, 211, 263; D = 16, r = 9, 2 KV heads, 6 query heads, T = 5)
    and runs your function on each while `lab.models.retrofit`'s absorb_query, expand_output, reconstructing and
    from_latent raise. It watches every tensor torch makes meanwhile, and fails:
    - a tensor whose shape holds L positions and a multiple of D channels: keys or values rebuilt (the sizes are
      chosen so that nothing else has such a shape);
    - a form that rebuilds them a position or a block at a time: the elements of tensors with D channels computed
      from the latents grow by at least half of L x D from one case to a longer one (the absorbed form makes the
      same ones whatever L is);
    - an output not computed from the latents by torch.
    Then it compares your output with attention over the rebuilt keys and values (`latent_oracle`, float64),
    within ATOL. Returns the largest error and the rebuilt work seen per case.
    """
    seed = fresh_seed(seed)
    cases = latent_cases(seed)
    with drawn_with(seed, "check_latent_attention"):
        runs = [_run_latent(attend, case) for case in cases]
        (L0, L1), (w0, w1) = (LENGTHS[0], LENGTHS[-1]), (runs[0][1], runs[-1][1])
        assert w1 - w0 < (L1 - L0) * D / 2, (
            f"keys or values were rebuilt from the latents a part at a time: your function made {w0} elements of "
            f"tensors with {D} channels from the latents at L = {L0}, {w1} at L = {L1}, growing with the positions "
            "as rebuilt keys do. In the absorbed form only the queries and the output meet U")
        errors = []
        for j, (case, (out, _)) in enumerate(zip(cases, runs, strict=True)):
            want = latent_oracle(**case, group_size=H_Q // H_KV)
            err = float((out.double() - want).abs().max())
            if not math.isfinite(err) or err > ATOL:
                h, t = divmod(int((out.double() - want).abs().flatten().nan_to_num(float("inf")).argmax()) // D, T)
                raise AssertionError(
                    f"case {j} (L = {case['c_k'].shape[0]}): your output differs from attention over the rebuilt "
                    f"keys and values by {err:.3g} (rounding alone stays below {ATOL:g}), worst at query head {h}, "
                    f"query {t} (position L - {T - t}). Check the scale (1 / sqrt(D), D = head_dim, not the rank), "
                    f"which block of U_k and U_v head {h} uses (its group {h} // group_size), and the causal mask")
            errors.append(err)
    print(f"correct (L = {', '.join(str(c['c_k'].shape[0]) for c in cases)}: largest error {max(errors):.2g}; "
          f"cases drawn with seed={seed})")
    return dict(seed=seed, errors=errors, derived_width=[w for _, w in runs])


# ---- exercise 2: the pages of a local group -------------------------------------------------------------------

CASES = 100     # a subtle mistake (the window one position too long) is wrong in about 1 case in 10: 100 cases
                # miss it about once in 60,000 checks (tests/test_exercises_ch10.py counts the cases it fails)


def pool_cases(seed, count=CASES) -> list[tuple]:
    """`count` settings (context, window, sinks, page_size, chunk) drawn from `seed`: page_size 1..32, window
    1..300, sinks 0..min(40, window - 1), chunk 1..600, context 1..3000."""
    rng, out = random.Random(seed), []
    for _ in range(count):
        page_size, window = rng.randint(1, 32), rng.randint(1, 300)
        sinks, chunk, context = rng.randint(0, min(40, window - 1)), rng.randint(1, 600), rng.randint(1, 3000)
        out.append((context, window, sinks, page_size, chunk))
    return out


def pages_by_simulation(context, window, sinks, page_size, chunk) -> int:
    """The oracle: one sequence grows to `context` positions through a real HybridBlockManager (a group "local"
    with that window and sinks, room for every page), `chunk` positions a step (the last step what is left), as
    `lab.experiments.ch10_architecture.grow` runs it; the most pages it holds after any step. The window gives
    pages back at the start of each reserve, so the most is held right after one."""
    manager = HybridBlockManager(page_size, {"local": (pages_for(context, page_size) + 1, window, sinks)})
    most = 0
    for start in range(0, context, chunk):
        manager.reserve("seq", min(chunk, context - start))
        most = max(most, manager.held_pages("local", "seq"))
    manager.check()
    return most


NO_MANAGER = ("forbidden shortcut: this exercise asks you to count the pages, not to run the library's "
              "HybridBlockManager")


def check_local_pages(local_pages, seed=None) -> dict:
    """local_pages(context, window, sinks, page_size, chunk) -> int: the most pages one sequence's local group
    ever holds while the sequence grows to `context` positions in steps of `chunk` (the last step: what is left).

    The group's rule is HybridBlockManager's: the query at position p reads positions p - window + 1 .. p and the
    first `sinks`; before each step reserves its positions, the group gives back every page whose positions all
    lie before the window of the step's first query and that holds no sink. Pages hold `page_size` positions.

    The check draws CASES settings from `seed` (page_size 1..32, window 1..300, sinks 0..40 and below the window,
    chunk 1..600, context 1..3000) and runs your function on each while HybridBlockManager raises; only then does
    it run the real manager on each (`pages_by_simulation`) and compare, exactly: a page is a page.
    """
    seed = fresh_seed(seed)
    cases = pool_cases(seed)
    with unchanged(__name__), functions_raise(HybridBlockManager, pages_by_simulation, why=NO_MANAGER):
        got = [local_pages(*case) for case in cases]
    with drawn_with(seed, "check_local_pages"):
        for (context, window, sinks, page_size, chunk), g in zip(cases, got, strict=True):
            assert hasattr(g, "__index__") and not isinstance(g, bool), (
                f"local_pages must return a number of pages (an int), got {g!r}")
            want = pages_by_simulation(context, window, sinks, page_size, chunk)
            assert g == want, (
                f"context {context}, window {window}, sinks {sinks}, pages of {page_size}, chunks of {chunk}: you "
                f"said {g} pages, the manager held at most {want}. After a step the group holds the sink pages and "
                "every page from the one holding the oldest position its first query reads to the last its chunk "
                "fills")
    print(f"correct ({len(cases)} settings drawn with seed={seed})")
    return dict(seed=seed, cases=len(cases))


# ---- exercise 3: how low can the latent go? (open-ended) ------------------------------------------------------

# where the chapter's experiment (lab/experiments/ch10_architecture.py) records the KL of the latent of rank r
BOOK_KEY = "ch10.quality.latent.rank_{rank}.kl"


def measure_latent_kl(rank: int = 96, tokens: int = 256, decode: int = 16, calibration=(2, 256), model="smollm2",
                      path=COMMITTED) -> dict:
    """The KL of `latent_kv(model, rank)` to the model itself, as the chapter measures it (`lab.metrics.quality`):
    one held-out passage of `tokens` ids, a prefill, then its last `decode` ids one per step through a float
    cache, each next-token distribution against the original model's plain forward. The basis is calibrated on
    `calibration` = (passages, tokens) of training text. Prints the KL, the change in perplexity and the top-1
    agreement, and sets the KL beside the book's (BOOK_KEY in results/results.json; the book's full run used 4
    passages of 2,048 tokens, 128 decoded, and 8 calibration passages of 1,024: expect the same order, not the
    same number). Returns dict(kl, delta_ppl, top1, ratio), ratio None while the book holds no value for this
    rank. `model`: a name for `load`, or a loaded model.

    Open-ended: halve the rank until the KL passes chapter 7's INT8 and KIVI-4 caches (ch07's results); what does
    the latent hold per position then, against those caches' bytes?
    """
    model = load(model) if isinstance(model, str) else model
    count, n = calibration
    latent = rf.latent_kv(model, rank, passages(model.tokenizer, n, count, split="train"))
    ids = torch.tensor(passages(model.tokenizer, tokens, 1))                            # [1, tokens]
    prefill = tokens - decode
    r = quality(latent, ids, ConcatCache, prefill, ref=reference(model, ids, prefill))  # against the original
    print(f"latent of rank {rank}: KL {r['kl']:.3g} nats over {r['positions']} positions, perplexity "
          f"{r['delta_ppl']:+.3g}, top-1 agreement {100 * r['top1']:.1f}%")
    key = BOOK_KEY.format(rank=rank)
    try:
        ratio = compare_with_book(key, r["kl"], "nats", path=path)
    except ResultsKeyError as e:
        print(f"the book has no value to compare with yet ({e})")
        ratio = None
    return dict(kl=r["kl"], delta_ppl=r["delta_ppl"], top1=r["top1"], ratio=ratio)
