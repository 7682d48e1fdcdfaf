"""Chapter 10 exercises: attention in a latent's own coordinates (the absorbed form), the pages a local layer's
group holds in a hybrid pool, and (open-ended) how low the latent's rank can go.

Exercise 1 runs the reader's latent attention on cases drawn fresh at every run (`seed=` draws the same ones
again) while the library's own absorbed and reconstructing forms raise, and every way out of torch too, counts the
work of every operation torch runs on the way, and compares the output with attention over keys and values rebuilt
from the latents. Keys or values rebuilt from the latents fail, whole, padded or a position at a time: the point of
the absorbed form is that they never exist, and rebuilding them costs several times its work. Exercise 2 asks for
the most pages one sequence's local group holds while it grows, and compares the reader's number with the real
HybridBlockManager's, run after the reader answered (while the reader's function runs, the manager raises, and no
thread or process may run it elsewhere). Exercise 3 measures, and sets the number beside the book's.
"""

import math
import random

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
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
# latent (R = 4), the positions (L) and a head's channels (D). L, a prime above 150, divides no product of the
# others; D = 32 = 2^5 divides none either (the others hold at most 2^3 in all). So a tensor with a dimension
# divisible by L and one divisible by D (the same one, flattened) holds something of every position in every
# channel of a head: keys or values rebuilt from the latents, in their plain shape.
# The shapes also set what rebuilding costs against the absorbed form, whatever shape it is given (padded, cut a
# position at a time): per cached position the absorbed form does 2 H_Q T R = 240 multiply-adds; rebuilding keys
# (or values) adds H_KV D R = 256 for the keys and H_Q T (D - R) = 840 for scoring against D channels instead of R.
LENGTHS = (157, 211, 263)   # L of each case: prime, so that the rebuilt work a case costs grows with it
D = 32                      # head_dim
R = 4                       # values per position in each of c_k and c_v: r / 2, for a latent of rank r = 8
H_KV, H_Q = 2, 6            # KV heads, query heads: each KV group serves H_Q / H_KV = 3 query heads
T = 5                       # queries, at positions L - T .. L - 1 (a verify step; T > 1 so the mask matters)
KEY_SCALE = 10.0            # c_k's spread: scores of standard deviation sqrt(100 x R / 2 / D) = 2.5 (softmax neither
                            # flat nor one-hot)
# The reader's float32 output against the float64 oracle: the same sums in another order, rounded to float32 (the
# reference: at most 9.7e-7 on 300 seeds, outputs of order 1; tests/test_exercises_ch10.py measures it). The scale
# 1/sqrt(r), the wrong KV group, no mask or a mask one position short miss by more than 6.6e-3 on some case of
# every one of those seeds: ATOL lies 100 x above rounding and 66 x below the smallest mistake.
ATOL = 1e-4
# The work a function may do on a case (multiply-adds of matrix products, one operation per element for everything
# else, views free), in units of the absorbed form's multiply-adds, 2 H_Q T R (D + L): the reference does 1.5 of
# them (its mask and softmax), the absorbed form with every head scored against every KV group 2.5; keys or values
# rebuilt, in any shape, 5.2 or more (tests/test_exercises_ch10.py measures each).
WORK_FACTOR = 3.5

LIBRARY_FORMS = (rf.absorb_query, rf.expand_output, rf.reconstructing, rf.from_latent)
# What takes a tensor's values out of torch without a torch operation, refused while the reader's function runs
# (on any tensor, so that none can be copied out of the watch's sight first): then the work is torch's, and counted.
# The pickling and copying of tensors, and DLPack's export, are Python functions: they raise (functions_raise).
CONVERSIONS = ("numpy", "__array__", "tolist", "item", "__float__", "__int__", "__index__", "__complex__", "__repr__",
               "__format__", "untyped_storage", "storage", "_typed_storage", "data_ptr", "__dlpack__", "apply_",
               "map_", "map2_", "share_memory_", "__reduce_ex__", "__deepcopy__", "__getstate__")
COPIES_OUT = (torch.Tensor.__reduce_ex__, torch.Tensor.__deepcopy__, torch.utils.dlpack.to_dlpack)
# aten operations that compute sums of products but are not matrix products, whose work the watch does not count:
# refused (an attention has no use for them)
UNCOUNTED = ("embedding_bag", "trilinear", "cdist", "_euclidean_dist", "fft", "sparse", "linalg", "solve", "lstsq",
             "inverse", "householder", "orgqr", "ormqr", "conv", "_int_mm", "mkldnn", "fbgemm", "quantized")
NOT_IN_TORCH = ("your function took values out of torch ({what}): this exercise asks for the absorbed form in torch, "
                "where the check can see what is computed; keep every tensor a tensor (print them outside the check)")

aten = torch.ops.aten


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


def absorbed_work(L) -> int:
    """The absorbed form's multiply-adds on a case of L positions: each query head's T queries into latent
    coordinates (T D R), scored against L latents (T R L), the weighted sum of L latents (T L R), and back (T R D)."""
    return 2 * H_Q * T * R * (D + L)


def latent_oracle(q, c_k, c_v, U_k, U_v, group_size) -> torch.Tensor:
    """Attention as the original model computes it, in float64: keys and values rebuilt from the latents
    (k = U_k c_k, v = U_v c_v, `[H_KV, L, D]`), then scaled dot-product attention of each query head over its KV
    group's, the query at position L - T + i seeing positions 0 .. L - T + i. -> `[H_Q, T, D]`."""
    L, (_, Tq, Dh) = c_k.shape[0], q.shape
    k, v = ((c.double() @ U.double().T).view(L, -1, Dh).transpose(0, 1) for c, U in ((c_k, U_k), (c_v, U_v)))
    sees = torch.arange(L)[None, :] <= torch.arange(L - Tq, L)[:, None]                     # [T, L]
    k, v = k.repeat_interleave(group_size, 0), v.repeat_interleave(group_size, 0)           # [H_Q, L, D]
    return F.scaled_dot_product_attention(q.double(), k, v, attn_mask=sees)


def _multiply_adds(func, args) -> int | None:
    """The multiply-adds of a matrix product (or fused attention) from its operands' shapes; None for others."""
    name = func.overloadpacket.__name__.rstrip("_")             # addmm_ and baddbmm_ (in place) count as addmm
    if name in ("mm", "addmm", "bmm", "baddbmm", "addbmm"):
        a, b = args[1:3] if name.startswith("add") or name == "baddbmm" else args[:2]
        return a.numel() * b.shape[-1]                          # [.., n, k] @ [.., k, m]: n k m per batch
    if name in ("mv", "addmv", "dot", "vdot"):
        return (args[1] if name == "addmv" else args[0]).numel()
    if "scaled_dot_product" in name:
        q, k, v = args[:3]                                      # [.., T, E], [.., L, E], [.., L, Ev]
        return q.numel() // q.shape[-1] * k.shape[-2] * (q.shape[-1] + v.shape[-1])
    return None


class _InTorch(TorchFunctionMode):
    """While inside, every way to take a tensor's values out of torch (CONVERSIONS) raises: into numpy, a list, a
    Python number, a printed string, a storage or a pointer."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in CONVERSIONS:
            raise AssertionError(NOT_IN_TORCH.format(what=f"Tensor.{name}"))
        return func(*args, **(kwargs or {}))


class WatchRebuilt(TorchDispatchMode):
    """Sees every torch operation while inside, and
    - `rebuilt` names the first tensor whose shape holds L positions and D channels (a dimension divisible by L
      and one by D): keys or values rebuilt in their plain shape;
    - `work` adds up what every operation does: a matrix product's multiply-adds, one operation per element for
      everything else (the most elements among its tensors), nothing for a view;
    - `derived` holds every tensor computed from the latents (by storage, so a write into a buffer counts): an
      operation whose result depends on their values alone (a Python number: an `if` on a tensor, item; a shape
      that depends on values: nonzero, a mask's selection) raises on those, so that no value leaves torch bit by
      bit; and an operation whose work is not counted (UNCOUNTED) raises on any tensor."""

    def __init__(self, latents, L, D):
        super().__init__()
        self.L, self.D, self.rebuilt, self.work = L, D, None, 0
        self.derived = {}                                       # storage id -> a tensor that keeps it alive
        for t in latents:
            self._mark(t)

    def _mark(self, t):
        self.derived[torch._C._storage_id(t)] = t

    def is_derived(self, t) -> bool:
        return isinstance(t, torch.Tensor) and torch._C._storage_id(t) in self.derived

    def _refuse(self, func, tensors, from_latents):
        name = func.overloadpacket.__name__
        if any(word in name for word in UNCOUNTED):
            raise AssertionError(f"your function ran torch's {name}, which computes sums of products the check does "
                                 "not count: write attention with matrix products (@, matmul, einsum, bmm) and "
                                 "elementwise operations")
        tags = set(func.tags)
        data = torch.Tag.data_dependent_output in tags
        if func.overloadpacket in (aten.index, aten.index_put, aten.index_put_):    # a shape set by a derived mask
            shaped = any(self.is_derived(t) and t.dtype in (torch.bool, torch.uint8) for t in tensors[1:])
        else:
            shaped = torch.Tag.dynamic_output_shape in tags and from_latents
        if (data and from_latents) or shaped:
            raise AssertionError(NOT_IN_TORCH.format(what=f"{name}: a Python value or a shape set by values computed "
                                                          "from the latents"))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        tensors = [x for x in tree_leaves((args, kwargs)) if isinstance(x, torch.Tensor)]
        from_latents = any(self.is_derived(x) for x in tensors)
        self._refuse(func, tensors, from_latents)
        out = func(*args, **(kwargs or {}))
        outs = [o for o in tree_leaves(out) if isinstance(o, torch.Tensor)]
        if not (func.is_view or func.overloadpacket in (aten._unsafe_view, aten.alias, aten.detach, aten.lift_fresh)):
            work = _multiply_adds(func, args)
            self.work += max([t.numel() for t in tensors + outs] + [0]) if work is None else work
        for o in outs:
            shape = tuple(o.shape)
            by_l = any(n and n % self.L == 0 for n in shape)
            by_d = any(n and n % self.D == 0 for n in shape)
            if by_l and by_d and self.rebuilt is None:
                self.rebuilt = f"{func} made a tensor of shape {list(shape)}"
            if from_latents:
                self._mark(o)
        return out


def _run_latent(attend, case):
    """The reader's output on one case (inputs are copies), and the work the watch counted."""
    import torch._dynamo  # noqa: F401  a dispatch mode's first use imports it (800 modules): not under the watch
    L = case["c_k"].shape[0]
    args = {k: t.clone() for k, t in case.items()}
    watch = WatchRebuilt((args["c_k"], args["c_v"]), L, D)
    with unchanged(__name__), functions_raise(*LIBRARY_FORMS, latent_oracle), \
            functions_raise(*COPIES_OUT, why=NOT_IN_TORCH.format(what="a copy of a tensor made outside torch")), \
            _InTorch(), watch:
        out = attend(args["q"], args["c_k"], args["c_v"], args["U_k"], args["U_v"], H_Q // H_KV)
    assert isinstance(out, torch.Tensor), f"latent_attention must return a tensor, got {type(out).__name__}"
    assert tuple(out.shape) == (H_Q, T, D), (
        f"latent_attention returned shape {list(out.shape)} for {H_Q} query heads, {T} queries of {D} channels: "
        f"expected [{H_Q}, {T}, {D}], the output turned back from latent space into each head's values")
    assert watch.rebuilt is None, (
        f"keys or values were rebuilt from the latents: {watch.rebuilt}, {L} positions by a multiple of "
        f"head_dim {D}. That is the reconstructing form; turn the queries into latent coordinates instead "
        "(q_h . U_k,g c = (U_k,g^T q_h) . c) and the output back once (U_v,g times the weighted sum of c_v)")
    ratio = watch.work / absorbed_work(L)
    assert ratio <= WORK_FACTOR, (
        f"keys or values were rebuilt from the latents, in some shape or a part at a time: at L = {L} your function "
        f"did {watch.work:,} operations (multiply-adds of matrix products, one per element of everything else), "
        f"{ratio:.1f} x the absorbed form's {absorbed_work(L):,} multiply-adds (at most {WORK_FACTOR} x allowed; "
        f"rebuilding keys or values costs 5 x or more). In the absorbed form only the queries and the output meet "
        "U: q_h . U_k,g c = (U_k,g^T q_h) . c, and sum_t p_t U_v,g c_t = U_v,g (sum_t p_t c_t)")
    assert watch.is_derived(out), (
        "your output was not computed from c_k and c_v by torch operations on the tensors given (the check "
        "watches them to see what your function builds): compute it with torch, from the arguments")
    return out, ratio


def check_latent_attention(attend, seed=None) -> dict:
    """attend(q, c_k, c_v, U_k, U_v, group_size) -> `[H_q, T, D]`: one layer's attention, computed in latent space.

    q `[H_q, T, D]`: the queries of positions L - T .. L - 1 after RoPE; c_k, c_v `[L, r/2]`: the cached latents
    of that layer's keys and values (a latent of rank r holds r/2 values for each), c_k = U_k^T k with k the keys
    of all H_kv KV heads side by side `[L, H_kv D]`; U_k, U_v `[H_kv D, r/2]`; query head h reads KV group
    h // group_size. Turn each query head into latent coordinates with its group's block of U_k (rows g D ..
    (g + 1) D - 1), attend over c_k and c_v with the model's scale 1 / sqrt(D) and the causal mask (the query at
    L - T + i sees positions 0 .. L - T + i), and turn the output back with the group's block of U_v.

    The check draws three cases from `seed` (L = 157, 211, 263; D = 32, r/2 = 4, 2 KV heads, 6 query heads, T = 5)
    and runs your function on each while `lab.models.retrofit`'s absorb_query, expand_output, reconstructing and
    from_latent raise, and so does every way to take a tensor's values out of torch (numpy, tolist, item, a
    printed tensor, a storage: CONVERSIONS). It watches every operation torch runs meanwhile, and fails:
    - a tensor whose shape holds L positions and a multiple of D channels: keys or values rebuilt (the sizes are
      chosen so that nothing else has such a shape);
    - more work than WORK_FACTOR x the absorbed form's multiply-adds (a matrix product counted by its
      multiply-adds, everything else by its elements): keys or values rebuilt in any other shape (padded, a
      position or a block at a time) cost 5 x or more, since each position is then turned into D channels;
    - an output not computed from the latents by torch.
    Then it compares your output with attention over the rebuilt keys and values (`latent_oracle`, float64),
    within ATOL. Returns the largest error and the work per case, in units of the absorbed form's.
    """
    seed = fresh_seed(seed)
    cases = latent_cases(seed)
    with drawn_with(seed, "check_latent_attention"):
        runs = [_run_latent(attend, case) for case in cases]
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
    print(f"correct (L = {', '.join(str(c['c_k'].shape[0]) for c in cases)}: largest error {max(errors):.2g}, work "
          f"{max(r for _, r in runs):.1f} x the absorbed form's multiply-adds; cases drawn with seed={seed})")
    return dict(seed=seed, errors=errors, work=[r for _, r in runs])


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
