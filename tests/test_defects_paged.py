"""Regression tests for defects of the paged cache, its block manager, the serving engine and the cached
forward: each fails on the code before its fix. Oracles: the typed errors the design promises (a bool is
not an id or a count; a position past the model's context raises PositionLimitError, as decoding past it
does) and the state left unchanged by a refused call.
"""

import pytest
import torch

from lab.cache import BlockManager, CacheInputError, ConcatCache, PagedCache
from lab.engine import ServingEngine
from lab.models import InputError, PositionLimitError, forward_cached, load


@pytest.fixture(scope="module")
def tiny():
    return load("tiny-llama")


@pytest.fixture(scope="module")
def tiny_gpt2():
    return load("tiny-gpt2")


def test_cancel_refuses_a_bool_or_float_request_id(tiny):
    engine = ServingEngine(tiny, num_pages=8, page_size=4)
    rids = [engine.add_request([5, 6, 7], 2) for _ in range(3)]
    assert rids == [0, 1, 2]
    for bad in (True, 2.0):                       # True == 1 and 2.0 == 2: both used to cancel a request
        with pytest.raises((TypeError, InputError), match="request id is an int"):
            engine.cancel(bad)
    assert [engine.requests[r].state for r in rids] == ["waiting"] * 3
    assert engine.cancel(1) and engine.requests[1].state == "cancelled"


def test_eos_id_refuses_a_bool(tiny):
    engine = ServingEngine(tiny, num_pages=8, page_size=4)
    with pytest.raises(InputError, match="eos_id"):
        engine.add_request([5, 6, 7], 2, eos_id=True)     # used to stop after token 1
    assert not engine.requests and not engine.waiting


def test_block_manager_refuses_a_bool_sequence_id_and_count():
    bm = BlockManager(4, 4)
    bm.reserve(1, 2)
    with pytest.raises(CacheInputError, match="sequence id must not be a bool"):
        bm.reserve(True, 1)                               # used to grow sequence 1
    with pytest.raises(CacheInputError, match="n must be an int"):
        bm.reserve(1, True)
    assert bm.length(1) == 2 and bm.sequences() == [1] and bm.num_free == 3


def test_from_memory_refuses_a_bool_or_text_fraction(tiny):
    for bad in (True, "0.5"):                             # True used to mean 100%; "0.5" a raw TypeError
        with pytest.raises(CacheInputError, match="fraction must be a number"):
            PagedCache.from_memory(tiny.config, bad, available_bytes=10**7)
    cache = PagedCache.from_memory(tiny.config, 0.5, page_size=4, available_bytes=10**7)
    assert cache.nbytes() <= 0.5 * 10**7


@pytest.mark.parametrize("bad", [0, -5, 2.5, True])
def test_paged_cache_refuses_a_bad_max_seq_tokens(tiny, bad):
    with pytest.raises(CacheInputError, match="max_seq_tokens must be an int of at least 1"):
        PagedCache(tiny.config, 64, 16, max_seq_tokens=bad)   # 0 used to mean "the whole pool", -5 and 2.5 ran


@pytest.mark.parametrize("name", ["tiny", "tiny_gpt2"])
def test_explicit_positions_past_the_context_raise_position_limit_error(name, request):
    model = request.getfixturevalue(name)
    cfg, last = model.config, model.config.max_positions - 1
    ids = torch.tensor([[3, 4]])
    cache = ConcatCache(cfg)
    with pytest.raises(PositionLimitError, match=f"position {last + 1} is past"):
        forward_cached(ids, model.weights, cfg, cache, positions=torch.tensor([last, last + 1]))
    assert cache.length == 0 and not any(cache.pending)   # refused before anything was stored
    # the last position of the context is still served (GPT-2 used to raise a raw IndexError past it,
    # Llama to run silently where it was never trained)
    out = forward_cached(ids[:, :1], model.weights, cfg, cache, positions=torch.tensor([last]))
    assert out.shape == (1, 1, cfg.vocab_size) and cache.length == 1
