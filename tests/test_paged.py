"""PagedCache under the same forward: token for token against other caches and recomputation, ragged
batches, fork with copy-on-write, exhaustion and bad input (the allocator consistent after every error)."""

import pytest
import torch

from lab.cache import (
    CacheFullError,
    CacheInputError,
    CacheMismatchError,
    CacheStateError,
    OutOfPagesError,
    PagedCache,
    cache_bytes,
)
from lab.experiments import ch05_paged as ch05
from lab.models import forward, forward_cached, load, random_model

TINY_ATOL = 1e-5  # float32, tiny model: paged and contiguous attention differ only in summation order


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


def ids(n, seed=0):
    return torch.randint(0, 320, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
def test_paged_prefill_and_decode_match_recomputation(tiny, page_size):
    x = ids(40)
    cache = PagedCache(tiny.config, 64, page_size=page_size)
    out = [forward_cached(x[:, :7], tiny.weights, tiny.config, cache)]
    out += [forward_cached(x[:, t:t + 1], tiny.weights, tiny.config, cache) for t in range(7, 40)]
    assert (torch.cat(out, 1) - forward(x, tiny.weights, tiny.config)).abs().max() < TINY_ATOL
    assert cache.length == 40 and cache.manager.num_free == cache.num_pages - -(-40 // page_size)


def test_smollm2_tokens_match_concat_for_page_sizes_1_16_64(smollm2):
    r = ch05.token_agreement(smollm2, (1, 16, 64), prompt=37, new_tokens=8)
    for ps, x in r.items():
        assert x["identical"], f"page size {ps}"
        assert x["max_diff"] < 1e-4 * 40  # 1e-4 x SmolLM2's largest logits (about 40): fp32 summation order


def test_ragged_batch_decodes_like_each_sequence_alone(smollm2):
    assert ch05.ragged_batch(smollm2, lengths=(5, 16, 17, 33), new_tokens=5)["identical"]


def test_speed_measurement_runs_every_case_at_the_long_context_and_restores_threads():
    threads = torch.get_num_threads()
    L = ch05.LONG_CONTEXT
    r = ch05.decode_attention_times((256, L), (1,), reps=1, repeats=3)
    assert list(r) == [(1, 256), (1, L)] and torch.get_num_threads() == threads
    for case in [r[(1, L)]] + [r[(1, L)][name] for name in ch05.LONG_CASES]:
        assert case["repeats"] == 3
        low, high = case["ratio_range"]
        assert low <= case["ratio"] <= high
        # the two paths compute the same attention: fp32 sums over 4,096 positions in different orders
        assert case["max_diff"] < 1e-4
    assert r[(1, L)]["one_thread"]["paged"]["threads"] == 1
    assert r[(1, L)]["paged"]["threads"] == threads and "cold" not in r[(1, 256)]


def test_ragged_batch_logits_match_recomputation(tiny):
    cache = PagedCache(tiny.config, 128, page_size=4, batch_size=3)
    seqs = [ids(n, seed=n) for n in (5, 8, 13)]
    for row, s in enumerate(seqs):
        forward_cached(s, tiny.weights, tiny.config, cache.select([row]))
    nxt = torch.tensor([[1], [2], [3]])
    out = forward_cached(nxt, tiny.weights, tiny.config, cache)
    for row, s in enumerate(seqs):
        want = forward(torch.cat([s, nxt[row:row + 1]], 1), tiny.weights, tiny.config)[0, -1]
        assert (out[row, -1] - want).abs().max() < TINY_ATOL
    assert cache.seq_lengths() == [6, 9, 14]


def test_nbytes_is_the_pool(tiny):
    cache = PagedCache(tiny.config, 100, page_size=16)
    assert cache.nbytes() == cache_bytes(tiny.config, 7 * 16) == cache.k_pool.nbytes * 2


def test_block_table_buffers_keep_their_shape(tiny):
    cache = PagedCache(tiny.config, 200, page_size=4)
    shapes, ptrs = set(), set()
    x = ids(60)
    for t in range(0, 60, 5):
        forward_cached(x[:, t:t + 5], tiny.weights, tiny.config, cache)
        shapes.add((tuple(cache.block_tables.shape), tuple(cache.lengths.shape)))
        ptrs.add(cache.block_tables.data_ptr())
    assert shapes == {((1, 64), (1,))} and len(ptrs) == 1  # 50 pages padded to 64; the same buffer throughout


def test_fork_copies_the_shared_partial_page_on_first_write(tiny):
    x = ids(10)
    parent = PagedCache(tiny.config, 64, page_size=4)
    forward_cached(x, tiny.weights, tiny.config, parent)          # pages: 4 + 4 + 2 (partial)
    before = (parent.k_pool.clone(), parent.manager.block_table(parent.seqs[0]))
    child = parent.fork()
    a = forward_cached(torch.tensor([[7]]), tiny.weights, tiny.config, child)[0, -1]
    table = parent.manager.block_table(parent.seqs[0])
    assert table == before[1]
    for p in table:  # the parent's pages are untouched by the child's write
        assert torch.equal(parent.k_pool[:, p], before[0][:, p])
    assert child.manager.block_table(child.seqs[0])[:2] == table[:2]            # full pages still shared
    assert child.manager.block_table(child.seqs[0])[2] != table[2]              # the partial one was copied
    want = forward(torch.cat([x, torch.tensor([[7]])], 1), tiny.weights, tiny.config)[0, -1]
    assert (a - want).abs().max() < TINY_ATOL
    b = forward_cached(torch.tensor([[9]]), tiny.weights, tiny.config, parent)[0, -1]
    want = forward(torch.cat([x, torch.tensor([[9]])], 1), tiny.weights, tiny.config)[0, -1]
    assert (b - want).abs().max() < TINY_ATOL


def test_out_of_pages_changes_nothing(tiny):
    cache = PagedCache(tiny.config, 32, page_size=8, batch_size=2)
    forward_cached(ids(12).repeat(2, 1), tiny.weights, tiny.config, cache)       # 2 pages each: 4 of 4 used
    forward_cached(torch.tensor([[1], [2]]), tiny.weights, tiny.config, cache)
    state = (cache.seq_lengths(), cache.manager.num_free, [cache.manager.block_table(s) for s in cache.seqs])
    with pytest.raises(OutOfPagesError):
        forward_cached(ids(8, 1).repeat(2, 1), tiny.weights, tiny.config, cache)  # needs a third page each
    assert (cache.seq_lengths(), cache.manager.num_free, [cache.manager.block_table(s) for s in cache.seqs]) == state
    assert cache.pending == [0] * tiny.config.n_layers
    out = forward_cached(torch.tensor([[3], [4]]), tiny.weights, tiny.config, cache)  # still usable
    assert out.shape == (2, 1, 320)


def test_crop_returns_pages_and_continues_correctly(tiny):
    x = ids(30)
    cache = PagedCache(tiny.config, 64, page_size=4)
    forward_cached(x, tiny.weights, tiny.config, cache)
    cache.crop(9)
    assert cache.length == 9 and cache.manager.num_free == 16 - 3
    got = forward_cached(torch.tensor([[5]]), tiny.weights, tiny.config, cache)[0, -1]
    want = forward(torch.cat([x[:, :9], torch.tensor([[5]])], 1), tiny.weights, tiny.config)[0, -1]
    assert (got - want).abs().max() < TINY_ATOL


@pytest.mark.parametrize("make, error, word", [
    (lambda c: PagedCache(c, 64, page_size=0), CacheInputError, "page_size"),
    (lambda c: PagedCache(c, 0, page_size=16), CacheInputError, "max_tokens"),
])
def test_bad_construction(tiny, make, error, word):
    with pytest.raises(error, match=word):
        make(tiny.config)


def test_crop_beyond_length_and_use_after_release(tiny):
    cache = PagedCache(tiny.config, 64, page_size=4)
    forward_cached(ids(6), tiny.weights, tiny.config, cache)
    with pytest.raises(CacheStateError, match="crop"):
        cache.crop(7)
    assert cache.length == 6
    cache.release()
    with pytest.raises(CacheStateError, match="release"):
        forward_cached(ids(1), tiny.weights, tiny.config, cache)
    assert cache.manager.num_free == cache.num_pages


def test_block_table_wider_than_its_padded_buffer(tiny):
    cache = PagedCache(tiny.config, 200, page_size=1, max_seq_tokens=16)  # table width 16
    forward_cached(ids(16), tiny.weights, tiny.config, cache)
    free = cache.manager.num_free
    with pytest.raises(CacheFullError, match="capacity 16"):  # the table's width bounds a sequence
        forward_cached(ids(1), tiny.weights, tiny.config, cache)
    assert cache.length == 16 and cache.manager.num_free == free  # nothing reserved


def test_from_memory_sizes_the_pool(tiny):
    cache = PagedCache.from_memory(tiny.config, 0.5, page_size=16, available_bytes=1 << 20)
    per_page = cache_bytes(tiny.config, 16)
    assert cache.num_pages == (1 << 19) // per_page and cache.nbytes() <= 1 << 19
    with pytest.raises(CacheInputError):
        PagedCache.from_memory(tiny.config, 0.0)


def test_a_decode_step_reads_nothing_back_from_the_device(tiny, monkeypatch):
    """The bookkeeping of a step (reserve, block tables, lengths, slot mapping, the writes) and the kernel's
    argument checks never read a tensor back to the host: on a GPU each such read would make the step wait
    for the device. Oracle: every way of reading a tensor's values on the host raises while the step runs."""
    cache = PagedCache(tiny.config, 256, page_size=4, batch_size=2)
    forward_cached(ids(6).repeat(2, 1), tiny.weights, tiny.config, cache)
    forward_cached(ids(1, seed=3), tiny.weights, tiny.config, cache.select([0]))  # ragged: 7, 6
    g = torch.Generator().manual_seed(0)
    k = [torch.randn(2, 2, 1, 16, generator=g) for _ in range(2)]
    q = torch.randn(2, 4, 16, generator=g)

    def no_read(*args, **kwargs):
        raise AssertionError("a tensor was read back to the host during a decode step")

    with monkeypatch.context() as m:
        for name in ("item", "tolist", "__int__", "__float__", "__bool__", "__index__", "numpy"):
            m.setattr(torch.Tensor, name, no_read)
        m.setattr(torch, "aminmax", no_read)
        for layer in range(cache.n_layers):                  # the step's bookkeeping and writes
            cache._put(layer, k[layer], k[layer])
        from lab.kernels import check_paged_inputs
        check_paged_inputs(q, cache.k_pool[0], cache.v_pool[0], cache.block_tables, cache.lengths, values=False)
        cache.advance(1)
    assert cache.seq_lengths() == [8, 7] and cache.lengths.tolist() == [8, 7]
    with pytest.raises(AssertionError, match="read back"):   # the oracle can fail: a checked call reads
        with monkeypatch.context() as m:
            m.setattr(torch, "aminmax", no_read)
            check_paged_inputs(q, cache.k_pool[0], cache.v_pool[0], cache.block_tables, cache.lengths)


def test_ragged_decode_positions_come_from_the_device_lengths(tiny):
    cache = PagedCache(tiny.config, 256, page_size=4, batch_size=2)
    forward_cached(ids(6).repeat(2, 1), tiny.weights, tiny.config, cache)
    forward_cached(ids(1, seed=3), tiny.weights, tiny.config, cache.select([0]))  # a view: row 0 grows to 7
    assert cache.next_positions(1).tolist() == [[7], [6]]          # rows changed through a view: from the host
    forward_cached(torch.tensor([[5], [6]]), tiny.weights, tiny.config, cache)
    positions = cache.next_positions(1)
    assert positions.tolist() == [[8], [7]] and positions.dtype == torch.long
    assert positions.untyped_storage().data_ptr() != cache.lengths.untyped_storage().data_ptr()  # a copy


# ---- the planned step a serving engine runs: several sequences of one pool as one row

def test_planned_step_of_decodes_and_chunks_matches_recomputation(tiny):
    """One planned step over four sequences of one pool: a decode, a chunk after a cached prefix, a first
    chunk, and a decode of a fork whose shared, partly filled page is copied on write by `reserve`. Each
    token's logits equal the uncached forward's at its position (TINY_ATOL: summation order only)."""
    w, cfg = tiny.weights, tiny.config
    pool = PagedCache(cfg, 256, page_size=4)
    xs, done, new = [ids(13, 1), ids(21, 2), ids(6, 3)], [12, 9, 0], [1, 8, 6]
    seqs = [pool.new_id() for _ in xs]
    for s, x, d in zip(seqs, xs, done, strict=True):
        view = pool.view([s])                                   # a new id starts empty
        if d:
            forward_cached(x[:, :d], w, cfg, view)
    fork = pool.new_id()
    pool.manager.fork(seqs[0], fork)                            # shares its three full pages (12 positions)
    pool.manager.crop(fork, 11)                                 # the third is now its shared, partial last page
    xs.append(torch.cat([xs[0][:, :11], ids(1, 4)], 1))
    seqs.append(fork)
    done.append(11)
    new.append(1)
    parts = list(zip(seqs, new, strict=True))
    pool.reserve(parts)                                         # the fork's partial page is copied here
    step = pool.plan_step(parts)
    tokens = torch.cat([x[:, d:d + n] for x, d, n in zip(xs, done, new, strict=True)], 1)   # [1, N]
    out = forward_cached(tokens, w, cfg, step, positions=step.positions)                   # [1, N, V]
    at = 0
    for x, d, n in zip(xs, done, new, strict=True):
        want = forward(x[:, :d + n], w, cfg)[:, d:]
        assert (out[:, at:at + n] - want).abs().max() < TINY_ATOL
        at += n
    assert step.positions.tolist() == [12, 9, 10, 11, 12, 13, 14, 15, 16, 0, 1, 2, 3, 4, 5, 11]
    x = torch.cat([xs[0], ids(1, 5)], 1)                        # the parent's pages are intact: it goes on
    pool.reserve([(seqs[0], 1)])
    step = pool.plan_step([(seqs[0], 1)])
    out = forward_cached(x[:, 13:], w, cfg, step, positions=step.positions)
    assert (out - forward(x, w, cfg)[:, 13:]).abs().max() < TINY_ATOL


def test_planned_step_runs_once_and_refuses_what_it_cannot_serve(tiny):
    w, cfg = tiny.weights, tiny.config
    pool = PagedCache(cfg, 64, page_size=4)
    s = pool.new_id()
    pool.reserve([(s, 5)])
    with pytest.raises(CacheStateError, match="holds 5 reserved positions"):
        pool.plan_step([(s, 6)])
    with pytest.raises(CacheInputError, match="n must be at least 1"):
        pool.plan_step([(s, 0)])
    with pytest.raises(CacheStateError, match="unknown sequence"):
        pool.plan_step([(pool.new_id(), 1)])
    with pytest.raises(CacheInputError, match="names a sequence twice"):
        pool.plan_step([(s, 1), (s, 1)])                        # two tokens would share one slot
    step = pool.plan_step([(s, 5)])
    with pytest.raises(CacheStateError, match="advance"):
        step.advance(5)                                         # no layer stored anything yet
    forward_cached(ids(5), w, cfg, step, positions=step.positions)
    assert step.done
    k = torch.zeros(1, cfg.n_kv_heads, 5, cfg.head_dim)
    with pytest.raises(CacheStateError, match="has run"):
        step.attend(0, torch.zeros(1, cfg.n_heads, 5, cfg.head_dim), k, k)
    pool.reserve([(s, 1)])
    other = random_model(cfg, seed=1)                            # the pages hold tiny's keys, not these
    with pytest.raises(CacheMismatchError, match="another model"):
        forward_cached(ids(1), other.weights, cfg, pool.plan_step([(s, 1)]), positions=torch.tensor([5]))


def test_reserve_is_all_or_nothing_over_several_sequences(tiny):
    pool = PagedCache(tiny.config, 16, page_size=4)                # 4 pages
    a, b = pool.new_id(), pool.new_id()
    pool.reserve([(a, 4)])
    with pytest.raises(OutOfPagesError, match="needs 4 free pages of group 'full', which has 3"):
        pool.reserve([(a, 4), (b, 9)])                             # 1 + 3 pages: a alone would fit
    assert pool.manager.length(a) == 4 and b not in pool.manager and pool.manager.num_free == 3
    with pytest.raises(CacheInputError, match="twice"):
        pool.reserve([(a, 1), (a, 1)])
    assert pool.manager.length(a) == 4
    pool.manager.check()
