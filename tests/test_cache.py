"""lab.cache: the protocol's contract (bytes, reset, fork, crop, bad input), for all three designs alike.

Oracles: hand-computed byte counts and the bytes of the storages the cache really holds; `lab.models.forward`
recomputing the whole sequence without a cache; a fresh cache that never held the dropped positions; clones
taken before an operation (for "unchanged", compared bit for bit).

Tolerances. fp32 rounds ~1e-7 relative per op. A cached and an uncached forward add the same terms in
different orders (matmuls of other shapes, attention over a slice of a longer buffer), so on the tiny
models (2 layers, logits and keys of order 1) they may differ by a few 1e-7: we allow 1e-5 absolute.
On SmolLM2 (30 layers, logits of order 10-30) the differences grow with depth: we allow 1e-4 x the
largest |logit|. What must not differ at all (a parent's tensors after a child's step, a reset cache
against a fresh one, a cache after a rejected call) is compared with torch.equal.
"""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lab.cache import (
    CacheError,
    CacheFullError,
    CacheInputError,
    CacheMismatchError,
    CacheStateError,
    ConcatCache,
    OutOfPagesError,
    PagedCache,
    StaticCache,
    bytes_per_position,
    cache_bytes,
)
from lab.data import passages
from lab.models import ModelConfig, forward, forward_cached, load

MAX_TOKENS = 600  # StaticCache capacity in these tests: the 513 positions of the SmolLM2 fork test fit
TINY_ATOL = 1e-5  # tiny models: see the module docstring
MAKERS = {"concat": lambda cfg, B=1, **kw: ConcatCache(cfg, batch_size=B, **kw),
          "static": lambda cfg, B=1, **kw: StaticCache(cfg, max_tokens=MAX_TOKENS, batch_size=B, **kw),
          # pages of 16 (the usual size) in a pool with room for MAX_TOKENS positions in every row
          "paged": lambda cfg, B=1, **kw: PagedCache(cfg, MAX_TOKENS * B, 16, batch_size=B,
                                                     max_seq_tokens=MAX_TOKENS, **kw)}
DESIGNS = [pytest.param(make, id=design) for design, make in MAKERS.items()]
TINY = ["tiny-gpt2", "tiny-llama", "tiny-mqa"]
_TINY_MODELS = {}


pytestmark = pytest.mark.usefixtures("one_thread")  # see tests/conftest.py


def tiny(name, dtype=torch.float32):
    """The seeded random tiny models, loaded once per module."""
    if (name, dtype) not in _TINY_MODELS:
        _TINY_MODELS[name, dtype] = load(name, dtype=dtype)
    return _TINY_MODELS[name, dtype]


def ids_of(tokens):  # a list of ids -> [1, T]
    return torch.tensor([list(tokens)])


def random_ids(n, vocab_size, seed=0):
    return torch.randint(0, vocab_size, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def step(model, cache, tokens, last_only=False):
    return forward_cached(ids_of(tokens), model.weights, model.config, cache, last_only=last_only)


def recompute(model, tokens, last_only=False):
    return forward(ids_of(tokens), model.weights, model.config, last_only=last_only)


def assert_close(got, want, atol, what="logits"):
    assert got.shape == want.shape, f"{what}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    err = (got.float() - want.float()).abs().max().item()
    assert err <= atol, f"{what}: max |difference| {err:.3g} > {atol:.3g}"


def stored(cache):
    """Every layer's committed keys and values, [B, H_kv, length, D] each."""
    n = cache.length
    if isinstance(cache, PagedCache):  # gathered from the pages, in position order
        return [cache._read(i) for i in range(cache.n_layers)] if n else []
    if isinstance(cache, StaticCache):
        return [(cache.k_buf[i, :, :, :n], cache.v_buf[i, :, :, :n]) for i in range(cache.n_layers)]
    return [(k[:, :, :n], v[:, :, :n]) for k, v in zip(cache.keys, cache.values, strict=True)] if n else []


def held_tensors(cache):
    """The tensors the cache keeps alive: its buffers (StaticCache), pools (PagedCache) or its per-layer lists
    (ConcatCache)."""
    if isinstance(cache, PagedCache):
        return [cache.k_pool, cache.v_pool]
    if isinstance(cache, StaticCache):
        return [cache.k_buf, cache.v_buf]
    return [t for t in cache.keys + cache.values if t is not None]


def reserved(cache):
    """Positions per row the storage holds: what was reserved (static, paged), else what is held (concat)."""
    if isinstance(cache, PagedCache):
        return cache.num_pages * cache.page_size // cache.batch_size
    return cache.max_tokens if isinstance(cache, StaticCache) else cache.length


def held_bytes(cache):
    """Bytes of the distinct storages behind the cache's tensors: the memory it really keeps alive."""
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in held_tensors(cache)}
    return sum(storages.values())


def snapshot(cache, pool=True):
    """Everything observable about a cache: lengths, pending counts, pages held and free (PagedCache), and
    clones of all its tensors. `pool=False` (a fork, which shares the pool): only what is the cache's own,
    its block tables and the keys and values of its positions, not the pool's other pages or free count."""
    if isinstance(cache, PagedCache):
        tables = [cache.manager.block_table(s) for s in cache.seqs]
        pages = (tables, cache.manager.num_free) if pool else tables
        tensors = [cache.k_pool, cache.v_pool] if pool else [t for kv in stored(cache) for t in kv]
    else:
        tensors = [cache.k_buf, cache.v_buf] if isinstance(cache, StaticCache) else cache.keys + cache.values
        pages = None
    state = (cache.seq_lengths(), list(cache.pending), pages)
    return state, [None if t is None else t.clone() for t in tensors], pool


def assert_unchanged(cache, before):
    state, tensors, _ = snapshot(cache, before[2])
    assert state == before[0], f"(lengths, pending, pages) {state} != {before[0]}"
    assert len(tensors) == len(before[1])
    for i, (now, then) in enumerate(zip(tensors, before[1], strict=True)):
        assert (now is None) == (then is None), f"tensor {i} appeared or disappeared"
        assert now is None or torch.equal(now, then), f"tensor {i} changed"


# ---- bytes ------------------------------------------------------------------------------------------------

def test_cache_bytes_hand_computed():
    # SmolLM2-135M: 30 layers, 3 kv heads of 64. Per position: 2 (K, V) x 30 x 3 x 64 x 4 bytes = 46,080.
    smol = ModelConfig(arch="llama", vocab_size=49152, n_layers=30, d_model=576, n_heads=9, n_kv_heads=3,
                       head_dim=64, d_ff=1536)
    assert bytes_per_position(30, 3, 64, 4) == 46_080
    assert cache_bytes(smol, 1) == 46_080
    assert cache_bytes(smol, 2048, batch_size=4, dtype=torch.bfloat16) == 23_040 * 2048 * 4 == 188_743_680
    # tiny-llama: 2 x 2 layers x 2 kv heads x 16 x 4 bytes = 512 per position.
    cfg = tiny("tiny-llama").config
    assert cache_bytes(cfg, 100, batch_size=3) == 512 * 100 * 3
    assert StaticCache(cfg, max_tokens=100, batch_size=3).nbytes() == 153_600
    assert ConcatCache(cfg).nbytes() == 0


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("make", DESIGNS)
@pytest.mark.parametrize("name", TINY)
def test_nbytes_equals_cache_bytes_and_held_storage(name, make, dtype):
    model, B = tiny(name, dtype), 2
    cache = make(model.config, B, dtype=dtype)
    ids = torch.tensor([random_ids(9, 320, seed=1), random_ids(9, 320, seed=2)])  # [2, 9]

    def check(state):
        want = cache_bytes(model.config, reserved(cache), B, dtype)
        assert cache.nbytes() == want, f"{state}: nbytes {cache.nbytes()} != cache_bytes {want}"
        assert held_bytes(cache) == want, f"{state}: storages hold {held_bytes(cache)} bytes, expected {want}"
        assert all(t.dtype == dtype for t in held_tensors(cache))

    forward_cached(ids, model.weights, model.config, cache)
    for _ in range(3):
        forward_cached(ids[:, :1], model.weights, model.config, cache)
    assert cache.length == 12
    check("after prefill + 3 decode steps")
    cache.crop(5)
    check("after crop(5)")
    forward_cached(ids[:, :1], model.weights, model.config, cache)
    check("after crop(5) + 1 decode step")
    cache.reset()
    check("after reset")


@pytest.mark.parametrize("make", DESIGNS)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-mqa", "tiny-gpt2"])
def test_prefill_holds_only_its_keys_and_values(name, make):
    model = tiny(name)
    cache = make(model.config)
    # regression: ConcatCache once kept GPT-2's k, v as views into the fused q|k|v output, holding 1.5x the bytes
    step(model, cache, random_ids(9, 320, seed=3))
    assert cache.nbytes() == cache_bytes(model.config, reserved(cache))
    assert held_bytes(cache) == cache.nbytes()


# ---- reset -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("make", DESIGNS)
@pytest.mark.parametrize("name", TINY)
def test_reset_is_bit_identical(name, make):
    # Request A (35 positions) leaves stale keys past request B's 10 in a StaticCache (reset only zeroes the
    # length); none may be read. ConcatCache runs the same test.
    model = tiny(name)
    a, b = random_ids(30, 320, seed=4), random_ids(9, 320, seed=5)
    cache = make(model.config)
    step(model, cache, a)
    for t in random_ids(5, 320, seed=6):
        step(model, cache, [t])
    cache.reset()
    assert (cache.length, cache.pending) == (0, [0] * model.config.n_layers)
    got_prefill, got_step = step(model, cache, b), step(model, cache, [7])
    fresh = make(model.config)
    want_prefill, want_step = step(model, fresh, b), step(model, fresh, [7])
    assert torch.equal(got_prefill, want_prefill)
    assert torch.equal(got_step, want_step)
    for (k, v), (k0, v0) in zip(stored(cache), stored(fresh), strict=True):
        assert torch.equal(k, k0) and torch.equal(v, v0)
    assert_close(got_step[0, -1], recompute(model, b + [7])[0, -1], TINY_ATOL)  # and it is right, not just equal


# ---- fork ---------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def fork_case(smollm2):
    """A 512-token held-out prefix, two different next tokens, and the uncached logits after each."""
    tok = smollm2.tokenizer
    prefix = passages(tok, 512, 1)[0]
    a, b = tok.encode(" the")[0], tok.encode(" and")[0]
    assert a != b
    with torch.inference_mode():
        want = forward(torch.tensor([prefix + [a], prefix + [b]]), smollm2.weights, smollm2.config,
                       last_only=True)[:, -1]  # [2, V]
    return prefix, a, b, want


@pytest.mark.parametrize("make", DESIGNS)
def test_fork_leaves_parent_untouched(smollm2, fork_case, make):
    prefix, a, b, want = fork_case
    parent = make(smollm2.config)
    step(smollm2, parent, prefix, last_only=True)
    before = snapshot(parent, pool=False)
    history = [(k.clone(), v.clone()) for k, v in stored(parent)]
    child = parent.fork()
    assert child.length == 512
    if isinstance(parent, ConcatCache):  # the design's promise: a fork copies no tensor
        assert all(c is p for c, p in zip(child.keys + child.values, parent.keys + parent.values, strict=True))

    child_logits = step(smollm2, child, [b], last_only=True)[0, -1]
    assert_unchanged(parent, before)  # the child's step did not touch the parent
    child_after = snapshot(child, pool=False)
    parent_logits = step(smollm2, parent, [a], last_only=True)[0, -1]
    assert_unchanged(child, child_after)  # nor the parent's step the child
    assert parent.length == child.length == 513
    for (k, v), (k0, v0) in zip(stored(parent), history, strict=True):  # the parent's own step kept its 512 positions
        assert torch.equal(k[:, :, :512], k0) and torch.equal(v[:, :, :512], v0)

    # SmolLM2 tolerance: 1e-4 x the largest |logit| (module docstring).
    assert_close(parent_logits, want[0], 1e-4 * want[0].abs().max().item(), "parent + ' the'")
    assert_close(child_logits, want[1], 1e-4 * want[1].abs().max().item(), "child + ' and'")


@settings(max_examples=20, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("make", DESIGNS)
@pytest.mark.parametrize("name", ["tiny-llama", "tiny-gpt2"])
def test_fork_parent_and_child_steps_do_not_touch_each_other(name, make, data):
    model = tiny(name)
    token = st.integers(0, model.config.vocab_size - 1)
    prefill = data.draw(st.lists(token, min_size=1, max_size=20), label="prefill")
    moves = data.draw(st.lists(st.tuples(st.sampled_from(["parent", "child"]), st.lists(token, min_size=1, max_size=3)),
                               min_size=1, max_size=6), label="moves")
    caches = {"parent": make(model.config)}
    step(model, caches["parent"], prefill)
    caches["child"] = caches["parent"].fork()
    seqs = {"parent": list(prefill), "child": list(prefill)}
    for who, tokens in moves:
        other = "child" if who == "parent" else "parent"
        before = snapshot(caches[other], pool=False)
        logits = step(model, caches[who], tokens)
        seqs[who] += tokens
        assert_unchanged(caches[other], before)
        assert caches[who].length == len(seqs[who])
        assert_close(logits, recompute(model, seqs[who])[:, -len(tokens):], TINY_ATOL, f"{who} after {seqs[who]}")


# ---- crop ---------------------------------------------------------------------------------------------------

@settings(max_examples=30, deadline=None)
@given(data=st.data())
@pytest.mark.parametrize("make", DESIGNS)
@pytest.mark.parametrize("name", TINY)
def test_crop_then_continue_equals_never_having_held_the_extra(name, make, data):
    model = tiny(name)
    token = st.integers(0, model.config.vocab_size - 1)
    ids = data.draw(st.lists(token, min_size=1, max_size=40), label="ids")
    split = data.draw(st.integers(1, len(ids)), label="prefill length")  # the rest goes in one-token steps
    n = data.draw(st.integers(0, len(ids)), label="crop to")
    cont = data.draw(st.lists(token, min_size=1, max_size=10), label="continuation")

    cache = make(model.config)
    step(model, cache, ids[:split])
    for t in ids[split:]:
        step(model, cache, [t])
    cache.crop(n)
    assert cache.length == n
    got = step(model, cache, cont)

    clean = make(model.config)  # never held positions n .. len(ids)-1
    if n:
        step(model, clean, ids[:n])
    want = step(model, clean, cont)
    assert cache.length == clean.length == n + len(cont)
    assert_close(got, want, TINY_ATOL)
    assert_close(got, recompute(model, ids[:n] + cont)[:, n:], TINY_ATOL, "logits vs recomputation")
    for i, ((k, v), (k0, v0)) in enumerate(zip(stored(cache), stored(clean), strict=True)):
        assert_close(k, k0, TINY_ATOL, f"keys of layer {i}")
        assert_close(v, v0, TINY_ATOL, f"values of layer {i}")


# ---- bad input --------------------------------------------------------------------------------------------
# tiny-llama: 2 layers, 2 kv heads of 16. Every case starts from a cache holding 5 positions (plus what
# `prepare` does), makes one bad call, and checks the error's type and message and that nothing changed.

def kv(*shape, dtype=torch.float32, device="cpu"):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(sum(shape))).to(dtype=dtype, device=device)


def update_all(cache, t=1):  # one valid step's updates, without the advance
    for i in range(cache.n_layers):
        cache.update(i, kv(1, 2, t, 16), kv(1, 2, t, 16))


OK = kv(1, 2, 1, 16)
BAD_INPUT = [  # id, prepare(cache), bad(cache, model), error, message pattern
    ("k_rank_3", None, lambda c, m: c.update(0, kv(1, 2, 16), OK), CacheInputError, r"k must have rank 4"),
    ("v_rank_5", None, lambda c, m: c.update(0, OK, kv(1, 1, 2, 1, 16)), CacheInputError, r"v must have rank 4"),
    ("k_wrong_kv_heads", None, lambda c, m: c.update(0, kv(1, 3, 1, 16), kv(1, 3, 1, 16)), CacheInputError,
     r"k has shape \(1, 3, 1, 16\), expected \[1, 2, tokens >= 1, 16\]"),
    ("k_wrong_head_dim", None, lambda c, m: c.update(0, kv(1, 2, 1, 8), kv(1, 2, 1, 8)), CacheInputError,
     r"shape \(1, 2, 1, 8\)"),
    ("k_wrong_batch", None, lambda c, m: c.update(0, kv(2, 2, 1, 16), kv(2, 2, 1, 16)), CacheInputError,
     r"shape \(2, 2, 1, 16\)"),
    ("k_zero_tokens", None, lambda c, m: c.update(0, kv(1, 2, 0, 16), kv(1, 2, 0, 16)), CacheInputError,
     r"tokens >= 1"),
    ("k_wrong_dtype", None, lambda c, m: c.update(0, kv(1, 2, 1, 16, dtype=torch.float64), OK), CacheInputError,
     r"k has dtype torch.float64, the cache holds torch.float32"),
    ("v_wrong_dtype", None, lambda c, m: c.update(0, OK, kv(1, 2, 1, 16, dtype=torch.bfloat16)), CacheInputError,
     r"v has dtype torch.bfloat16"),
    ("k_wrong_device", None, lambda c, m: c.update(0, kv(1, 2, 1, 16, device="meta"), OK), CacheInputError,
     r"k is on meta, the cache is on cpu"),
    ("k_v_shapes_differ", None, lambda c, m: c.update(0, OK, kv(1, 2, 2, 16)), CacheInputError,
     r"must have the same shape"),
    ("layer_minus_1", None, lambda c, m: c.update(-1, OK, OK), CacheInputError, r"layer index -1 out of range"),
    ("layer_n_layers", None, lambda c, m: c.update(2, OK, OK), CacheInputError, r"layer index 2 out of range"),
    ("layer_float", None, lambda c, m: c.update(1.0, OK, OK), CacheInputError, r"layer index 1\.0 out of range"),
    ("same_layer_twice", lambda c: c.update(0, OK, OK), lambda c, m: c.update(0, OK, OK), CacheStateError,
     r"layer 0 was already updated"),
    ("uneven_layers_then_advance", lambda c: c.update(0, OK, OK), lambda c, m: c.advance(1), CacheStateError,
     r"advance\(1\) but the layers stored \[1, 0\]"),
    ("advance_wrong_count", update_all, lambda c, m: c.advance(2), CacheStateError,
     r"advance\(2\) but the layers stored \[1, 1\]"),
    ("advance_without_update", None, lambda c, m: c.advance(1), CacheStateError, r"stored \[0, 0\]"),
    ("crop_beyond_length", None, lambda c, m: c.crop(6), CacheStateError, r"crop\(6\): the cache holds 5"),
    ("crop_minus_1", None, lambda c, m: c.crop(-1), CacheStateError, r"crop\(-1\)"),
    ("fork_mid_step", lambda c: c.update(0, OK, OK), lambda c, m: c.fork(), CacheStateError,
     r"fork\(\) in the middle of a step"),
    ("model_mismatch", None, lambda c, m: forward_cached(ids_of([1]), tiny("tiny-mqa").weights,
                                                         tiny("tiny-mqa").config, c),
     CacheMismatchError, r"\(layers, kv_heads, head_dim\) = \(2, 2, 16\), model has \(2, 1, 8\)"),
    ("batch_mismatch", None, lambda c, m: forward_cached(torch.tensor([[1], [2]]), m.weights, m.config, c),
     CacheInputError, r"expected \[1, 2"),
]
FULL = [  # a bounded cache of 7 positions holding 5
    ("full_via_update", None, lambda c, m: c.update(0, kv(1, 2, 3, 16), kv(1, 2, 3, 16)), CacheFullError,
     r"5 positions held \+ 3 new > capacity 7"),
    ("full_via_forward_cached", None, lambda c, m: step(m, c, [1, 2, 3]), CacheFullError, r"capacity 7"),
]
BOUNDED = {"static": lambda cfg, B=1: StaticCache(cfg, max_tokens=7),
           "paged": lambda cfg, B=1: PagedCache(cfg, 7, page_size=1)}
# a pool of 5 pages of 2: 5 positions take 3 pages and a fork shares them; the parent's next step copies
# its shared partial page on write (4 used), the one after takes a fifth, and a third finds none free
POOL = lambda cfg, B=1: PagedCache(cfg, 10, page_size=2)
OUT_OF_PAGES = ("out_of_pages", lambda c: setattr(c, "child", c.fork()) or step_twice(c),
                lambda c, m: step(m, c, [1, 2, 3]), OutOfPagesError, r"needs \d+ free pages")
CASES = ([pytest.param(make, *case[1:], id=f"{case[0]}-{design}") for case in BAD_INPUT
          for design, make in MAKERS.items()]
         + [pytest.param(make, *case[1:], id=f"{case[0]}-{design}") for case in FULL
            for design, make in BOUNDED.items()]
         + [pytest.param(POOL, *OUT_OF_PAGES[1:], id="out_of_pages-paged")])


def step_twice(cache):
    model = tiny("tiny-llama")
    step(model, cache, [4])
    step(model, cache, [5])


@pytest.mark.parametrize("make, prepare, bad, error, message", CASES)
def test_bad_input_raises_a_typed_error_and_changes_nothing(make, prepare, bad, error, message):
    model = tiny("tiny-llama")
    prefix = random_ids(5, 320, seed=8)
    cache = make(model.config)
    step(model, cache, prefix)
    if prepare:
        prepare(cache)
    before = snapshot(cache)
    with pytest.raises(CacheError, match=message) as caught:
        bad(cache, model)
    assert type(caught.value) is error
    assert isinstance(caught.value, CacheFullError) == (error in (CacheFullError, OutOfPagesError))
    assert_unchanged(cache, before)
    # and the cache still works: drop what a step left pending, continue, compare with recomputation
    held = cache.length
    cache.crop(held - 1)
    got = step(model, cache, [9])[0, -1]
    assert_close(got, recompute(model, (prefix + [4, 5])[:held - 1] + [9])[0, -1], TINY_ATOL)


@pytest.mark.parametrize("make", DESIGNS)
def test_crop_rejects_a_non_integer_count(make):
    model = tiny("tiny-llama")
    cache = make(model.config)
    step(model, cache, [1, 2, 3])
    before = snapshot(cache)
    with pytest.raises(CacheError, match=r"crop"):
        cache.crop(1.5)
    assert_unchanged(cache, before)


@pytest.mark.parametrize("make", DESIGNS)
def test_advance_rejects_a_non_integer_count(make):
    model = tiny("tiny-llama")
    cache = make(model.config)
    update_all(cache)
    with pytest.raises(CacheError, match=r"advance"):
        cache.advance(1.0)
    assert type(cache.length) is int and cache.length == 0


@pytest.mark.parametrize("device", [
    "cpu:0", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU"))])
@pytest.mark.parametrize("make", DESIGNS)
def test_cache_accepts_tensors_on_its_own_device_given_as_a_name(make, device):
    model = tiny("tiny-llama").to(device)
    cache = make(model.config, device=device)
    ids = torch.tensor([[1, 2, 3]], device=device)
    got = forward_cached(ids, model.weights, model.config, cache)
    assert_close(got, forward(ids, model.weights, model.config), TINY_ATOL)


@pytest.mark.parametrize("build", [
    pytest.param(lambda cfg: ConcatCache(cfg, batch_size=0), id="concat-batch_size_0"),
    pytest.param(lambda cfg: StaticCache(cfg, max_tokens=8, batch_size=0), id="static-batch_size_0"),
    pytest.param(lambda cfg: StaticCache(cfg, max_tokens=0), id="static-max_tokens_0"),
    pytest.param(lambda cfg: PagedCache(cfg, 64, batch_size=0), id="paged-batch_size_0"),
    pytest.param(lambda cfg: PagedCache(cfg, 0), id="paged-max_tokens_0"),
    pytest.param(lambda cfg: PagedCache(cfg, 64, page_size=0), id="paged-page_size_0"),
])
def test_bad_constructor_arguments_raise_cache_input_error(build):
    with pytest.raises(CacheInputError, match=r"at least 1, got 0"):
        build(tiny("tiny-llama").config)
